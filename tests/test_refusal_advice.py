"""What a refusal tells to change when even the smallest step does not fit
(memtrain.analysis.advice): the flags that shrink the model's state when the state alone is over
the budget, the activation flags the run does not use yet otherwise, and each claim true by the
same estimate."""

from __future__ import annotations

import pytest

from memtrain.analysis.advice import model_state_bytes, save_memory_clause, size_text
from memtrain.cli import main
from memtrain.config.run import build_config

SMALL = dict(d_model=128, n_heads=4, n_layers=2, d_ff=256, batch_size=1, seq_len=64, device="cpu")


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


def test_a_state_over_the_budget_names_the_state_flags_not_the_activation_ones(capsys):
    cfg = build_config(SMALL)
    state = model_state_bytes(cfg, "cpu")
    assert state is not None
    budget = int(state * 0.8)  # the weights, gradients and AdamW state alone exceed it
    args = ["maxbatch", "--d-model", "128", "--n-heads", "4", "--n-layers", "2", "--d-ff", "256", "--seq-len", "64",
            "--device", "cpu", "--memory-budget", str(budget)]
    assert main(args) == 2
    err = _error(capsys)
    assert f"the weights, gradients and optimizer state alone need {state / 2**20:.2f} MiB" in err
    assert "--loss chunked" not in err and "--checkpointing" not in err
    # Each flag with the state it leaves, by the same estimate, the smallest first.
    after = {flag: model_state_bytes(cfg.replace(**change), "cpu") for flag, change in (
        ("--lora-rank 16", {"lora_rank": 16}), ("--precision bf16-pure", {"precision": "bf16-pure"}),
        ("--optim adamw-8bit", {"optim": "adamw-8bit"}))}
    named = [f"{flag} (to {b / 2**20:.2f} MiB)" for flag, b in sorted(after.items(), key=lambda kv: kv[1])]
    assert f"shrink them with {named[0]}, {named[1]} or {named[2]}, or raise --memory-budget" in err
    assert after["--lora-rank 16"] < budget  # LoRA alone is enough here: no "together"
    assert "together" not in err


def test_when_no_one_flag_is_enough_the_refusal_says_what_they_leave_together():
    cfg = build_config(SMALL)
    together = model_state_bytes(cfg.replace(lora_rank=16, precision="bf16-pure", optim="adamw-8bit"), "cpu")
    lora = model_state_bytes(cfg.replace(lora_rank=16), "cpu")
    assert together < lora
    advice = save_memory_clause(cfg, (together + lora) / 2, "cpu")
    assert advice.text.endswith(f"; together to {together / 2**20:.2f} MiB")


def test_activations_over_the_budget_name_the_activation_flags_the_run_lacks(capsys):
    cfg = build_config(dict(SMALL, seq_len=512))
    state = model_state_bytes(cfg, "cpu")
    budget = int(state * 1.05)  # the state fits; one sequence's activations and logits do not
    flags = ["--d-model", "128", "--n-heads", "4", "--n-layers", "2", "--d-ff", "256", "--device", "cpu",
             "--memory-budget", str(budget)]
    assert main(["maxbatch", *flags, "--seq-len", "512"]) == 2
    err = _error(capsys)
    assert "save memory with --loss chunked, --checkpointing full, --precision bf16 or a smaller --seq-len, or raise " \
           "--memory-budget" in err
    # A run that uses them already is not told to; the length search does not suggest a length.
    flags[-1] = str(int(state * 1.001))  # the state fits, no step does
    assert main(["maxbatch", *flags, "--search", "seq-len", "--max-len", "64", "--loss", "chunked",
                 "--checkpointing", "full", "--precision", "bf16", "--multiple-of", "64"]) == 2
    err = _error(capsys)
    assert err.endswith("); lower --batch-size or --multiple-of, or raise --memory-budget\n"), err


@pytest.mark.parametrize("tech,flags", [
    ({"lora_rank": 8}, "shrink them with --precision bf16-pure (to "),  # the adapters' optimizer state is tiny
    ({"lora_rank": 8, "precision": "bf16-pure"}, "shard them with --distributed"),
    ({"precision": "bf16-pure", "optim": "adafactor"}, "shrink them with --lora-rank 16 (to "),
])
def test_the_state_flags_leave_out_what_the_run_uses_or_what_cannot_help(tech, flags):
    cfg = build_config(dict(SMALL, **tech))
    advice = save_memory_clause(cfg, 1, "cpu")
    assert advice.model_state and advice.text.split(": ", 1)[1].startswith(flags) and " or " not in advice.text, advice.text


def test_a_transformers_lora_run_is_told_of_qlora_with_its_figure(tmp_path):
    transformers = pytest.importorskip("transformers")
    # Widths whose q/o (128 x 128) and MLP (256 x 128) weights fit NF4's 64 x 256-value blocks, the
    # k/v ones (64 x 128) not: QLoRA shrinks the state, by the estimate's NF4 bytes.
    transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=300, max_position_embeddings=64).save_pretrained(tmp_path)
    cfg = build_config({"model": str(tmp_path), "lora_rank": 8, "batch_size": 1, "seq_len": 16, "device": "cpu"})
    advice = save_memory_clause(cfg, 1, "cpu")
    qlora = model_state_bytes(cfg.replace(qlora=True), "cpu")
    assert qlora is not None and qlora < model_state_bytes(cfg, "cpu")
    assert advice.model_state and f"--qlora (to {qlora / 2**20:.2f} MiB)" in advice.text, advice.text
    assert "--precision bf16-pure (to " in advice.text
    full = save_memory_clause(cfg.replace(lora_rank=0), 1, "cpu")
    both = model_state_bytes(cfg.replace(lora_rank=16, qlora=True), "cpu")
    together = model_state_bytes(cfg.replace(lora_rank=16, qlora=True, precision="bf16-pure", optim="adamw-8bit"),
                                 "cpu")
    assert both is not None and together is not None
    # The smallest state first; what all of them leave together now counts QLoRA too.
    assert f"shrink them with --lora-rank 16 --qlora (to {both / 2**20:.2f} MiB), " in full.text, full.text
    assert full.text.endswith(f"; together to {size_text(together)}"), full.text


def test_estimate_budget_names_the_state_flags_when_no_technique_set_fits(capsys):
    """``estimate --budget``: where plan's whole space fits nothing, the verdict's line says what
    holds the memory and what shrinks it, not only "lower --seq-len"."""
    assert main(["estimate", "--d-model", "128", "--n-heads", "4", "--n-layers", "2", "--d-ff", "256",
                 "--seq-len", "64", "--device", "cpu", "--budget", "5MiB"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("fit: does not fit"))
    assert line.startswith("fit: does not fit 5.00 MiB: needs ")  # not "0.00 GiB"
    assert "no technique set or micro-batch split fits batch 8: the weights, gradients and optimizer state alone " \
           "need " in line and "shrink them with --lora-rank 16 (to " in line


@pytest.mark.parametrize(("n", "text"), [(1024, "1.00 KiB"), (2**20 - 1, "1024.00 KiB"), (2**20, "1.00 MiB"),
                                         (3 * 2**28, "768.00 MiB"), (3 * 2**30, "3.00 GiB")])
def test_a_size_under_a_mib_is_said_in_kib_not_rounded_to_nothing(n, text):
    """A budget of 1KiB read "the budget of 0.00 MiB" in max-batch's refusal."""
    assert size_text(n) == text


def test_maxbatch_names_a_kib_budget_as_given(capsys):
    assert main(["maxbatch", "--budget", "1KiB", "--n-layers", "1"]) == 2
    assert "the budget of 1.00 KiB" in capsys.readouterr().err
