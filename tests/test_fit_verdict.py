"""Whether a run fits a GPU: `estimate --budget/--gpu` gives a verdict counted as the card holds
it (caching allocator + CUDA context), the largest batch and the changes that fit the asked
batch; `maxbatch` answers with the CUDA model where no CUDA device is here, saying so; `plan`
plans for CUDA on a CPU-only install and its error lines name flags plan accepts."""

from __future__ import annotations

import json
import shlex

import pytest

from memtrain.cli import main

MODEL = ["--d-model", "128", "--n-heads", "4", "--n-layers", "2", "--seq-len", "256"]


def _estimate(capsys, *flags: str) -> dict:
    assert main(["estimate", *MODEL, *flags, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _device_total(capsys, *flags: str) -> int:
    """The allocator model's device total of one configuration (estimate --gpu's own figure)."""
    return _estimate(capsys, "--device-type", "cuda", *flags)["device_memory"]["device_total"]


def _error_line(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1, err
    return err


def test_gpu_alone_judges_the_card_with_allocator_and_context(capsys):
    from memtrain.devices.gpu_memory import GPU_MEMORY_BYTES

    out = _estimate(capsys, "--gpu", "h100", "--batch-size", "8")
    fit = out["fit"]
    # The contract's keys are extended, not renamed.
    assert {"parameters", "bytes", "peak_bytes", "peak_phase", "device_memory"} <= set(out)
    dm = out["device_memory"]
    assert fit["budget_bytes"] == GPU_MEMORY_BYTES["h100-sxm"]
    # What is compared is what the card holds: reserved segments plus the CUDA context, more
    # than the live tensor bytes.
    assert fit["needed_bytes"] == dm["device_total"] == dm["reserved"] + dm["cuda_context"] > out["peak_bytes"]
    assert fit["headroom_bytes"] == fit["budget_bytes"] - fit["needed_bytes"]
    assert fit["fits"] is (fit["headroom_bytes"] >= 0) is True
    assert any("CUDA context" in a for a in fit["assumptions"])
    assert any("measured total_memory" in a for a in fit["assumptions"])


def test_largest_batch_is_the_last_batch_whose_device_total_fits(capsys):
    budget = _device_total(capsys, "--gpu", "h100", "--batch-size", "6")
    fit = _estimate(capsys, "--gpu", "h100", "--budget", str(budget), "--batch-size", "6")["fit"]
    assert fit["fits"] and fit["headroom_bytes"] == 0
    best = fit["largest_batch"]
    assert best >= 6 and not fit["largest_batch_capped"]
    assert _device_total(capsys, "--gpu", "h100", "--batch-size", str(best)) <= budget
    assert _device_total(capsys, "--gpu", "h100", "--batch-size", str(best + 1)) > budget


def test_a_run_that_does_not_fit_gets_changes_that_really_fit(capsys):
    asked = ["--batch-size", "16"]
    needed = _device_total(capsys, "--gpu", "rtx4090", *asked)
    budget = needed * 2 // 3  # a third too little
    out = _estimate(capsys, "--gpu", "rtx4090", "--budget", str(budget), *asked)
    fit = out["fit"]
    assert not fit["fits"] and fit["needed_bytes"] == needed and fit["headroom_bytes"] < 0
    assert fit["largest_batch"] is not None and fit["largest_batch"] < 16
    assert fit["suggestions"], fit
    for s in fit["suggestions"]:
        # Applied as printed, each change fits by the same model and needs what it says.
        total = _device_total(capsys, "--gpu", "rtx4090", *asked, *shlex.split(s["flags"]))
        assert total == s["needed_bytes"] <= budget, s
        assert s["batch_size"] * s["grad_accum"] == 16
    line = out["fit_line"]
    assert line.startswith("does not fit") and "to fit batch 16: " + fit["suggestions"][0]["flags"] in line


def test_cpu_kernels_compare_the_tracked_peak(capsys):
    out = _estimate(capsys, "--device-type", "cpu", "--budget", "1GiB", "--batch-size", "2")
    fit = out["fit"]
    assert fit["needed_bytes"] == out["peak_bytes"] and "tracked peak" in fit["measure"]
    assert fit["budget_bytes"] == 2**30 and fit["fits"]


def test_the_verdict_is_printed(capsys):
    assert main(["estimate", *MODEL, "--gpu", "h100", "--batch-size", "4"]) == 0
    text = capsys.readouterr().out
    assert "fit: fits 79.18 GiB with " in text and "largest batch" in text and "not measured" in text


def test_an_h200_is_held_to_its_measured_memory_not_its_datasheets(capsys):
    """torch reports 150,109,880,320 B (139.80 GiB) for an NVIDIA H200 (benchmarks/results/gpu-h200);
    its 141 GB read as GiB was 1.2 GiB more than a run can have."""
    out = _estimate(capsys, "--gpu", "NVIDIA H200", "--batch-size", "2")
    assert out["fit"]["budget_bytes"] == 150_109_880_320
    assert any("measured total_memory of an H200 SXM" in a for a in out["fit"]["assumptions"])


def test_gpus_without_a_memory_figure_ask_for_a_budget(capsys):
    out = _estimate(capsys, "--gpu", "v100", "--batch-size", "2")
    assert out["fit"] is None and "--budget" in out["fit_note"]
    assert _estimate(capsys, "--gpu", "v100", "--budget", "16GiB", "--batch-size", "2")["fit"]["fits"]


@pytest.mark.parametrize("argv,expect", [
    (["--mode", "inference", "--new-tokens", "0", "--budget", "8GiB"], "give --new-tokens N, or drop --budget/--gpu"),
    (["--budget", "0", "--device-type", "cpu"], "memory size '0' is not positive"),
    (["--gpu", "h100", "--device-type", "cpu"], "--device-type cuda"),
])
def test_bad_budget_use_is_one_error_line(capsys, argv, expect):
    assert expect in _error_line(capsys, ["estimate", *MODEL, *argv])


def test_gpu_table_names_the_same_kinds_as_the_flops_table():
    from memtrain.devices.gpu_memory import GPU_MEMORY_BYTES
    from memtrain.devices.gpus import PEAK_FLOPS, lookup_gpu

    assert set(GPU_MEMORY_BYTES) == set(PEAK_FLOPS)
    # estimate's --gpu help spells it rtx4090: MFU and the memory table know that name too.
    assert lookup_gpu("rtx4090") is PEAK_FLOPS["rtx-4090"]
    assert lookup_gpu("4090 D") is None


# --------------------------------------------------------------------------- maxbatch
@pytest.fixture
def no_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_maxbatch_without_a_gpu_answers_with_the_cuda_model(capsys, no_cuda):
    from memtrain.devices.gpu_memory import GPU_MEMORY_BYTES

    args = ["maxbatch", *MODEL, "--device-type", "cuda", "--gpu", "a10", "--max-batch", "64"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["measured"] is False and out["method"] == "estimate" and out["device"] == "cuda"
    assert out["budget_bytes"] == GPU_MEMORY_BYTES["a10"] and "not measured" in out["note"]
    best = out["batch_size"]
    # The CUDA model's own figures: the answer fits by the card's count (context included), the
    # next batch does not.
    assert out["peak_bytes"] == out["device_memory"]["device_total"] == _device_total(
        capsys, "--gpu", "a10", "--batch-size", str(best)) <= out["budget_bytes"]
    if not out["capped"]:
        assert _device_total(capsys, "--gpu", "a10", "--batch-size", str(best + 1)) > out["budget_bytes"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert f"max batch {best}" in text and "ESTIMATED with the CUDA model, not measured" in text


def test_maxbatch_cuda_model_counts_the_overhead_a_tracked_search_misses(capsys, no_cuda):
    # The same budget: the CPU-kernel search (tracked bytes only) fits a larger batch than
    # the card would.
    budget = str(_device_total(capsys, "--gpu", "h100", "--batch-size", "8"))
    assert main(["maxbatch", *MODEL, "--device-type", "cuda", "--budget", budget, "--json"]) == 0
    cuda = json.loads(capsys.readouterr().out)
    assert main(["maxbatch", *MODEL, "--device", "cpu", "--budget", budget, "--json"]) == 0
    cpu = json.loads(capsys.readouterr().out)
    assert cuda["measured"] is False and cpu["measured"] is True
    assert cuda["batch_size"] < cpu["batch_size"]


@pytest.mark.parametrize("argv,expect", [
    (["--device-type", "cuda"], "--gpu NAME"),
    (["--gpu", "v100"], "add --memory-budget"),  # a kind without one memory figure (16 or 32 GB)
    (["--gpu", "h100", "--device", "cpu"], "drop --device-type cpu/--device cpu"),
    (["--gpu", "h100", "--method", "trace"], "drop it"),
    # no --gpu given: the line names the two flags that disagree, not --gpu
    (["--device-type", "cuda", "--device", "cpu"], "--device-type cuda asks for CUDA kernels and --device cpu"),
])
def test_maxbatch_cuda_model_errors_are_one_line(capsys, no_cuda, argv, expect):
    assert expect in _error_line(capsys, ["maxbatch", *MODEL, *argv])


@pytest.mark.parametrize("verb,argv,expect", [
    ("estimate", ["--device-type", "cpu"], "--gpu models the CUDA caching allocator: add --device-type cuda"),
    ("maxbatch", ["--device-type", "cpu"], "--gpu names the card the CUDA model assumes: drop --device-type cpu"),
    ("plan", ["--device-type", "cpu", "--budget", "8GiB"], "--gpu plans for a CUDA GPU kind: add --device-type cuda"),
])
def test_gpu_next_to_cpu_kernels_is_refused_by_every_verb(capsys, no_cuda, verb, argv, expect):
    """--gpu names a CUDA GPU kind in estimate, maxbatch and plan alike: next to CPU kernel facts
    each refuses it in one line saying what the card is for there."""
    assert expect in _error_line(capsys, [verb, *MODEL, "--gpu", "h100", *argv])


def test_device_type_and_gpu_are_one_flag_in_every_verb():
    """estimate, maxbatch and plan take --device-type and --gpu with the same choices, default
    and metavar (only their help says what each verb does with them)."""
    from memtrain.cli import build_parser

    verbs = build_parser()._subparsers._group_actions[0].choices
    for flag in ("--device-type", "--gpu", "--max-len"):
        shapes = set()
        for verb in ("estimate", "maxbatch", "plan"):
            action = next(a for a in verbs[verb]._actions if flag in a.option_strings)
            shapes.add((tuple(action.option_strings), action.dest, action.choices and tuple(action.choices),
                        action.default, action.metavar, action.type))
        assert len(shapes) == 1, (flag, shapes)


def test_maxbatch_on_a_cuda_machine_still_measures(capsys, monkeypatch):
    import torch

    import memtrain.analysis.maxbatch as mb

    seen = {}

    def fake_search(cfg, **kw):
        seen.update(device=cfg.train.device, **kw)
        return mb.MaxBatchResult(4, 123, kw["budget_bytes"], "cuda", "measure", [{"fits": True}, {"fits": False}])

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mb, "find_max_batch", fake_search)
    assert main(["maxbatch", *MODEL, "--device-type", "cuda", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert seen["device"] == "cuda" and seen["method"] == "auto" and out["measured"] is True


# --------------------------------------------------------------------------- plan
def test_plan_for_cuda_on_a_cpu_only_install_uses_the_analytic_model(capsys, monkeypatch):
    pytest.importorskip("transformers")
    import memtrain.analysis.trace as trace

    monkeypatch.setattr(trace, "cuda_trace_supported", lambda: False)
    assert main(["plan", "--model", "qwen2.5-0.5b", "--device-type", "cuda", "--budget", "24GiB",
                 "--seq-len", "128", "--batch-size", "2", "--precisions", "bf16", "--optims", "adamw-fused",
                 "--checkpointings", "none", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["candidates"] and out["device_type"] == "cuda"
    assert any("analytic model of transformers layers" in n for n in out["notes"])


def _verb_flags(verb: str, capsys) -> str:
    with pytest.raises(SystemExit):
        main([verb, "--help"])
    return capsys.readouterr().out


def test_plan_cuda_error_names_a_flag_plan_accepts(capsys, monkeypatch):
    pytest.importorskip("transformers")
    import memtrain.analysis.trace as trace

    monkeypatch.setattr(trace, "cuda_trace_supported", lambda: False)
    err = _error_line(capsys, ["plan", "--model", "qwen2.5-0.5b", "--device-type", "cuda", "--budget", "24GiB",
                               "--seq-len", "128", "--lora-rank", "8", "--lora-targets", "q_proj,lm_head"])
    assert "--trace-device" not in err and "use --device-type cpu" in err
    assert "--device-type" in _verb_flags("plan", capsys)
