"""estimate --mode inference --budget/--gpu: whether memtrain generate fits, the largest batch and
the most new tokens, each checked against the estimate it searches (the estimate itself is held
to a measured generate in test_generate_estimate.py), and the budget's edges."""

from __future__ import annotations

import json

import pytest

from memtrain.cli import main
from memtrain.devices.gpu_kinds import allocator_facts

LLAMA = ["--model", "llama-3-8b", "--weights-dtype", "bf16", "--seq-len", "1024"]


def _estimate(capsys, *flags: str) -> dict:
    assert main(["estimate", "--mode", "inference", *flags, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _error_line(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1, err
    return err


def test_the_largest_batch_fits_and_one_more_does_not(capsys):
    fit = _estimate(capsys, *LLAMA, "--new-tokens", "512", "--batch-size", "16", "--budget", "24GiB")["fit"]
    budget = 24 << 30
    assert fit["fits"] and fit["budget_bytes"] == budget and not fit["lower_bound"]
    best = fit["largest_batch"]
    assert 16 < best < 4096 and not fit["largest_batch_capped"]
    at = _estimate(capsys, *LLAMA, "--new-tokens", "512", "--batch-size", str(best))["peak_bytes"]
    past = _estimate(capsys, *LLAMA, "--new-tokens", "512", "--batch-size", str(best + 1))["peak_bytes"]
    assert at <= budget < past
    asked = _estimate(capsys, *LLAMA, "--new-tokens", "512", "--batch-size", "16")["peak_bytes"]
    assert fit["needed_bytes"] == round(asked) and fit["headroom_bytes"] == budget - fit["needed_bytes"]


def test_the_most_new_tokens_fit_and_one_more_does_not(capsys):
    fit = _estimate(capsys, *LLAMA, "--new-tokens", "64", "--batch-size", "64", "--budget", "40GiB")["fit"]
    most = fit["most_new_tokens"]
    assert fit["most_new_tokens_bound"] == "memory" and 64 < most < 8192 - 1024
    at = _estimate(capsys, *LLAMA, "--new-tokens", str(most), "--batch-size", "64")["peak_bytes"]
    past = _estimate(capsys, *LLAMA, "--new-tokens", str(most + 1), "--batch-size", "64")["peak_bytes"]
    assert at <= 40 << 30 < past


def test_the_models_positions_bound_the_new_tokens(capsys):
    """Llama-3-8B's 8192 positions: a 1024-token prompt leaves 7168 (generate refuses more)."""
    out = _estimate(capsys, *LLAMA, "--new-tokens", "64", "--batch-size", "1", "--gpu", "h100")
    assert out["fit"]["most_new_tokens"] == 8192 - 1024 and out["fit"]["most_new_tokens_bound"] == "positions"


def test_gpu_adds_its_context_and_workspace_and_says_it_is_a_lower_bound(capsys):
    flags = [*LLAMA, "--new-tokens", "128", "--batch-size", "8"]
    live = _estimate(capsys, *flags, "--budget", "80GiB")["fit"]
    card = _estimate(capsys, *flags, "--gpu", "h100", "--budget", "80GiB")["fit"]
    facts = allocator_facts("h100")
    assert card["needed_bytes"] - live["needed_bytes"] == facts.cuda_context_bytes + facts.cublas_workspace_bytes
    assert card["lower_bound"] and "lower bound" in card["measure"]
    assert main(["estimate", "--mode", "inference", *flags, "--gpu", "h100"]) == 0
    text = capsys.readouterr().out
    assert "fit: fits 79.18 GiB with " in text and "before the caching allocator's rounding" in text
    assert "model: CUDA context" in text and "estimated, not measured" in text


def test_weights_over_the_budget_say_so(capsys):
    fit = _estimate(capsys, *LLAMA, "--new-tokens", "16", "--budget", "10GiB")["fit"]
    assert not fit["fits"] and fit["largest_batch"] is None and fit["most_new_tokens"] is None
    assert main(["estimate", "--mode", "inference", *LLAMA, "--new-tokens", "16", "--budget", "10GiB"]) == 0
    assert "not even 1 sequence generates 16 tokens: the weights alone are 14.96 GiB" in capsys.readouterr().out


def test_our_gpt_without_a_position_limit_searches_to_its_cap(capsys):
    """memtrain's GPT without --max-seq-len takes a position table as long as the run: the new
    tokens are bounded by memory (its table grows with them), or by --max-seq-len where given."""
    gpt = ["--d-model", "64", "--n-heads", "4", "--n-layers", "2", "--seq-len", "32", "--batch-size", "2"]
    free = _estimate(capsys, *gpt, "--budget", "64MiB")["fit"]
    assert free["most_new_tokens_bound"] == "memory" and free["most_new_tokens"] > 1000
    bounded = _estimate(capsys, *gpt, "--max-seq-len", "128", "--budget", "64MiB")["fit"]
    assert bounded["most_new_tokens"] == 128 - 32 and bounded["most_new_tokens_bound"] == "positions"


def test_a_gpu_without_a_memory_figure_asks_for_a_budget(capsys):
    out = _estimate(capsys, *LLAMA, "--gpu", "v100")
    assert out["fit"] is None and "add --budget SIZE" in out["fit_note"]


@pytest.mark.parametrize("flags,expect", [
    (["--new-tokens", "0", "--budget", "8GiB"], "give --new-tokens N, or drop --budget/--gpu"),
    (["--budget", "0"], "memory size '0' is not positive"),
    (["--budget", "lots"], "cannot read memory size"),
])
def test_bad_budget_use_is_one_error_line(capsys, flags, expect):
    argv = ["estimate", "--mode", "inference", "--d-model", "64", "--n-heads", "4", "--n-layers", "2", *flags]
    assert expect in _error_line(capsys, argv)


@pytest.mark.parametrize("flags,named", [
    (["--qlora"], "--qlora is a training setting; drop it (--weights-dtype sets the weights' dtype)"),
    (["--checkpointing", "full", "--distributed", "fsdp"], "--checkpointing, --distributed are training settings"),
    (["--lora-rank", "8"], "--lora-rank is a training setting; drop it"),
    (["--new-tokens", "0", "--grad-accum", "2"], "--grad-accum is a training setting"),
])
def test_training_settings_are_refused_by_inference_mode(capsys, flags, named):
    """They were ignored silently: --qlora's 4-bit weights, say, answered for full-width ones."""
    argv = ["estimate", "--mode", "inference", "--d-model", "64", "--n-heads", "4", "--n-layers", "2", *flags]
    assert named in _error_line(capsys, argv)


def test_training_settings_at_their_default_pass_inference_mode(capsys):
    """A config file spelling out every key at its default is no request for a technique."""
    argv = ["estimate", "--mode", "inference", "--d-model", "64", "--n-heads", "4", "--n-layers", "2",
            "--checkpointing", "none", "--grad-accum", "1", "--json"]
    from memtrain.cli import main

    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["peak_bytes"] > 0


def test_generate_help_names_the_memory_its_check_holds_on_a_cpu(capsys):
    """generate's check holds the estimate against a GPU's free memory or, on the CPU, the host's
    available memory (memtrain.training.size_check.host_available_bytes); its --help said "the
    device's free memory", which a CPU has no figure of, as the README says."""
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "a GPU's free memory; on the CPU the host's available memory" in help_text
