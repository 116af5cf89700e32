"""The analytic FLOP inventory is the counted step: same FLOPs, element-wise FLOPs and bytes in
every phase and operation class, for every technique combination it covers; and `memtrain flops`
answers from it for memtrain's GPT, counting only what it does not cover."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from memtrain.analysis.flops.count import count_step
from memtrain.analysis.flops.inventory import inventory_step, not_covered
from memtrain.analysis.flops.roofline import step_count
from memtrain.cli import main
from memtrain.config.run import build_config

# Odd sizes, so that no two dimensions coincide and a swapped factor shows.
TINY = {"vocab_size": 37, "d_model": 12, "n_heads": 2, "n_layers": 2, "d_ff": 20, "max_seq_len": 9,
        "batch_size": 3, "seq_len": 7}

# Each combination exercises several techniques at once (the counted side costs a fake step).
COMBOS = [
    {},
    {"precision": "bf16", "dropout": 0.0, "bias": False, "untie_embeddings": True, "checkpointing": "full",
     "loss": "chunked", "loss_chunk": 4, "vocab_multiple": 8, "grad_accum": 2},
    {"precision": "fp16", "attention": "sdpa", "dropout": 0.0, "n_layers": 3, "checkpointing": "every:2",
     "loss": "naive", "vocab_multiple": 8, "grad_clip": 0.0, "optim": "sgd"},
    {"precision": "bf16-pure", "n_layers": 4, "checkpointing": "sqrt", "loss": "chunked", "loss_chunk": 5,
     "untie_embeddings": True, "optim": "adafactor"},
    {"precision": "tf32", "attention": "sdpa", "dropout": 0.0, "bias": False, "checkpointing": "full",
     "grad_accum": 3},
    {"precision": "bf16", "n_layers": 3, "checkpointing": "every:2", "vocab_multiple": 16},
    {"dropout": 0.0, "loss": "chunked", "loss_chunk": 21},  # the chunks divide the tokens
    {"batch_size": 1, "precision": "fp16", "checkpointing": "full"},  # (B, heads) folds without copies
]

SLOW_COMBOS = [
    {"precision": p, "attention": a, "dropout": dr, "checkpointing": ck, "loss": loss, "untie_embeddings": untie}
    for p in ("fp32", "bf16", "fp16", "bf16-pure")
    for a, dr in (("math", 0.1), ("math", 0.0), ("sdpa", 0.0))
    for ck, loss, untie in (("none", "chunked", False), ("full", "standard", True), ("every:2", "naive", False))
] + [{"batch_size": 1, "precision": p, "attention": a, "dropout": dr, "checkpointing": "every:2"}
     for p in ("fp32", "bf16") for a, dr in (("math", 0.1), ("math", 0.0), ("sdpa", 0.0))] + [
    # deeper than the count traces whole (it then counts one block per kind and extrapolates)
    {"n_layers": 9, "checkpointing": "every:4", "precision": "bf16", "loss": "chunked", "loss_chunk": 8},
    {"n_layers": 10, "checkpointing": "sqrt", "dropout": 0.0, "vocab_multiple": 64},
]


def _tables(step) -> dict:
    return {(phase, name): (c.counted, c.elementwise, c.bytes)
            for phase, classes in step.table.items() for name, c in classes.items()
            if c.counted or c.elementwise or c.bytes}


def _assert_inventory_is_the_count(settings: dict) -> None:
    cfg = build_config({**TINY, **settings})
    assert not_covered(cfg) is None, settings
    counted, listed = count_step(cfg), inventory_step(cfg)
    assert _tables(listed) == _tables(counted), settings
    for key in ("counter_flops", "tokens", "n_params", "trainable_params", "rule_flops", "rule_terms", "notes"):
        assert getattr(listed, key) == getattr(counted, key), (key, settings)


@pytest.mark.parametrize("settings", COMBOS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "default")
def test_the_inventory_is_the_counted_step(settings):
    _assert_inventory_is_the_count(settings)


@pytest.mark.slow
@pytest.mark.parametrize("settings", SLOW_COMBOS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_the_inventory_is_the_counted_step_on_a_wider_grid(settings):
    _assert_inventory_is_the_count(settings)


def test_a_count_without_dropout_is_the_same_in_every_process():
    """With dropout off, a dropout module hands its input back: the count's backward attribution
    (torch's ModuleTracker) must still put each layer's gradient matmuls in that layer's class,
    whatever the process's string hash seed."""
    cfg = build_config({**TINY, "dropout": 0.0})
    back = count_step(cfg).table["backward"]
    N, d, f = TINY["batch_size"] * TINY["seq_len"], TINY["d_model"], TINY["d_ff"]
    L = TINY["n_layers"]
    assert back["attn_proj"].counted == L * 2 * (2 * N * d * d)
    assert back["mlp_fc"].counted == back["mlp_fc_out"].counted == L * 2 * (2 * N * d * f)
    assert back["qkv"].counted == L * 2 * (2 * N * d * 3 * d)


def test_a_fused_attention_kernel_is_attention_wherever_the_tracker_is():
    """With LoRA the module tracker still held the output projection while the fused kernel's
    backward ran: its five (T x T) matmuls went to that projection's class and the fused line
    read forward only (the reconciliation's "computes the scores again" term came out negative).
    The kernel's backward is attention's: 10/4 of its forward, as without LoRA."""
    for lora in (0, 2):
        cfg = build_config({**TINY, "attention": "sdpa", "dropout": 0.0, "lora_rank": lora})
        table = count_step(cfg).table
        forward, backward = table["forward"]["attn_fused"].counted, table["backward"]["attn_fused"].counted
        assert forward > 0 and backward == pytest.approx(2.5 * forward), lora


def test_a_lora_count_is_the_same_in_every_process():
    """peft's LoRA dropout at --lora-dropout 0 is an Identity, which hands its input back: as
    with dropout above, the backward's classes then followed the process's hash seed. Counted
    in two processes with different seeds: the same table, and the frozen base's matmuls count
    their input gradient only (mlp fc: forward + input gradient in every layer, and LoRA's)."""
    import os
    import subprocess
    import sys

    script = ("import json; from memtrain.analysis.flops.count import count_step; "
              "from memtrain.config.run import build_config; "
              f"t = count_step(build_config({{**{TINY!r}, 'dropout': 0.0, 'lora_rank': 2}})).table; "
              "print(json.dumps({p: {k: c.counted for k, c in v.items()} for p, v in t.items()}, sort_keys=True))")
    tables = []
    for seed in ("1", "2"):
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONHASHSEED": seed})
        assert done.returncode == 0, done.stderr
        tables.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert tables[0] == tables[1]
    N, d, f, L, r = TINY["batch_size"] * TINY["seq_len"], TINY["d_model"], TINY["d_ff"], TINY["n_layers"], 2
    lora = 2 * N * r * (d + f)  # x A and (x A) B, forward
    assert tables[0]["forward"]["mlp_fc"] == L * (2 * N * d * f + lora)
    assert tables[0]["backward"]["mlp_fc"] == L * (2 * N * d * f + 2 * lora)  # base: input gradient only


@pytest.mark.parametrize("settings, why", [
    ({"lora_rank": 2}, "--lora-rank"),
    ({"window": 3}, "--window"),
    ({"checkpointing": "selective"}, "--checkpointing selective"),
    ({"checkpointing": "selective-matmul"}, "--checkpointing selective-matmul"),
    ({"attention": "flash"}, "--attention flash"),
    ({"attention": "sdpa", "dropout": 0.1}, "--attention sdpa with dropout"),
    ({"vocab_size": 12}, "a vocabulary as large as another dimension"),  # = d_model
    ({"d_model": 13, "n_heads": 1}, "one attention head"),
    ({"d_model": 4, "n_heads": 4}, "a head of width 1"),
    ({"model": "tiny-llama"}, "transformers model"),
    ({"precision": "fp8"}, "--precision fp8"),  # Float8Linear's casts move other bytes
])
def test_what_the_inventory_does_not_cover_is_counted(settings, why):
    cfg = build_config({**TINY, **settings})
    assert why in (not_covered(cfg) or "")
    with pytest.raises(ValueError, match="does not cover"):
        inventory_step(cfg)


def test_step_count_answers_from_the_inventory_unless_asked_to_count(monkeypatch):
    cfg = build_config(TINY)
    import memtrain.analysis.flops.roofline as roofline

    monkeypatch.setattr(roofline, "count_step", lambda c: pytest.fail("counted a covered step"))
    assert _tables(step_count(cfg)) == _tables(inventory_step(cfg))
    monkeypatch.setattr(roofline, "count_step", lambda c: "counted")
    assert step_count(cfg, count=True) == "counted"
    assert step_count(build_config({**TINY, "lora_rank": 2})) == "counted"


def test_a_compile_memory_budget_is_named_not_guessed_on_both_paths():
    """Both paths describe the step eagerly (the count builds it uncompiled, so the budget must
    not make that config invalid); the partition's recompute is named in a note."""
    cfg = build_config({**TINY, "compile": True, "compile_memory_budget": 0.5})
    plain = build_config({**TINY, "compile": True})
    for count in (False, True):
        step = step_count(cfg, count=count)
        assert _tables(step) == _tables(step_count(plain, count=count))
        assert any("--compile-memory-budget 0.5" in note for note in step.notes)
        assert not any("compile-memory-budget" in note for note in step_count(plain, count=count).notes)


def test_flops_prints_the_same_with_count():
    """`memtrain flops` from the inventory and with --count: the same bytes, text and JSON."""
    argv = ["flops", "--gpu", "h100", *[x for k, v in TINY.items() for x in ("--" + k.replace("_", "-"), str(v))],
            "--precision", "bf16", "--checkpointing", "full"]

    def out(*extra: str) -> str:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main([*argv, *extra]) == 0
        return buf.getvalue()

    assert out() == out("--count")
    listed = json.loads(out("--json"))
    assert listed == json.loads(out("--json", "--count"))
    assert listed["total_flops"] > listed["counter_flops"] > 0
