"""Named technique sets: the rows of a bench (``memtrain bench --techniques``). Each is a flat
dict of config overrides applied on top of a scale (:mod:`memtrain.bench.scales`)."""

from __future__ import annotations

import difflib
from typing import Any, Optional

from memtrain.bench.scales import SCALE_WINDOW
from memtrain.config.run import ConfigError
from memtrain.report.noise import NUDGE_SUFFIX, Twin, twin_of

# The chunked loss is on in most rows beyond the published five: with GPT-2's 50257-token
# vocabulary the logits dominate the default model's memory, and any other saving would drown
# in them (docs/techniques.md).
TECHNIQUES: dict[str, dict[str, Any]] = {
    "baseline": {"precision": "tf32", "attention": "math"},
    "bf16": {"precision": "bf16", "attention": "math"},
    "flash-bf16": {"precision": "bf16", "attention": "flash"},
    "window-flash": {"precision": "bf16", "attention": "flash", "window": 128},
    "ckpt-bf16": {"precision": "bf16", "attention": "math", "checkpointing": "full"},
    "chunked-loss": {"precision": "bf16", "attention": "flash", "loss": "chunked"},
    "adamw-8bit": {"precision": "bf16", "attention": "flash", "loss": "chunked", "optim": "adamw-8bit", "vocab_multiple": 64},
    "adafactor": {"precision": "bf16", "attention": "flash", "loss": "chunked", "optim": "adafactor"},
    "lora": {"precision": "bf16", "attention": "flash", "loss": "chunked", "lora_rank": 8},
    "compile": {"precision": "bf16", "attention": "flash", "compile": True},
    # torch.compile with the chunked loss, under CUDA graphs: each chunk is one compiled call, whose
    # host time reduce-overhead's graph replay removes. On an H200 the fastest and one of the
    # smallest seed rows: 7.9 ms a step and 1.26 GiB reserved, against the compile row's 9.2 ms
    # and 3.3 GiB (benchmarks/results/gpu-h200).
    "compile-chunked": {"precision": "bf16", "attention": "flash", "compile": True, "compile_mode": "reduce-overhead",
                        "loss": "chunked"},
    # The library loss kernels (CUDA only; not default rows until measured beside memtrain's):
    # Cut Cross-Entropy never writes the logits to memory (docs/techniques.md), eager and compiled.
    "cce-loss": {"precision": "bf16", "attention": "flash", "loss": "chunked", "loss_kernel": "cce"},
    "compile-cce": {"precision": "bf16", "attention": "flash", "compile": True, "compile_mode": "reduce-overhead",
                    "loss": "chunked", "loss_kernel": "cce"},
    "liger-loss": {"precision": "bf16", "attention": "flash", "loss": "chunked", "loss_kernel": "liger"},
    # The compile row with the block Linears' matmuls in FP8 (torchao float8; CUDA 8.9+ only).
    "fp8": {"precision": "fp8", "attention": "flash", "compile": True},
    # The "compile" row with torch.compile's activation memory budget: the partitioner
    # recomputes what it must to save at most half of what it saves by default.
    "compile-budget": {"precision": "bf16", "attention": "flash", "compile": True, "compile_memory_budget": 0.5},
    # Everything that lowers memory without changing what is trained: LoRA is left out (it
    # freezes the base, a different experiment) and so is the window (it changes the model).
    "lowest-memory": {
        "precision": "bf16", "attention": "flash", "checkpointing": "full", "loss": "chunked",
        "optim": "adamw-4bit", "vocab_multiple": 128,
    },
    # Activation offloading: the saved activations wait in host memory between forward and
    # backward. Not a default row (its cost is the host link's, which a CPU run cannot show):
    # `memtrain bench --techniques ckpt-bf16,offload-bf16,ckpt-offload-bf16`.
    "offload-bf16": {"precision": "bf16", "attention": "flash", "loss": "chunked", "offload_activations": True},
    "ckpt-offload-bf16": {"precision": "bf16", "attention": "flash", "loss": "chunked", "checkpointing": "full",
                          "offload_activations": True},
}

DESCRIPTIONS: dict[str, str] = {
    "baseline": "Baseline (TF32/FP32)",
    "bf16": "BF16 Mixed Precision",
    "flash-bf16": "FlashAttention + BF16",
    "window-flash": "Windowed Attn + FlashAttn",
    "ckpt-bf16": "Grad Checkpointing + BF16",
    "chunked-loss": "Chunked LM-head loss + Flash + BF16",
    "adamw-8bit": "8-bit AdamW + chunked loss",
    "adafactor": "Adafactor + chunked loss",
    "lora": "LoRA r=8 + chunked loss",
    "compile": "torch.compile + Flash + BF16",
    "compile-chunked": "torch.compile (CUDA graphs) + chunked loss + Flash + BF16",
    "cce-loss": "Cut Cross-Entropy loss + Flash + BF16",
    "compile-cce": "torch.compile (CUDA graphs) + Cut Cross-Entropy + Flash + BF16",
    "liger-loss": "Liger fused loss + Flash + BF16",
    "fp8": "FP8 Linears (torchao) + torch.compile + Flash",
    "compile-budget": "torch.compile, activation budget 0.5 + Flash + BF16",
    "lowest-memory": "Lowest memory (ckpt + chunked + 4-bit AdamW)",
    "offload-bf16": "Activation offloading + chunked loss",
    "ckpt-offload-bf16": "Grad Checkpointing + activation offloading",
}

# Rows of `memtrain bench` when --techniques is not given: the five published rows plus the
# two that matter most for memory.
DEFAULT_TECHNIQUES = ["baseline", "bf16", "flash-bf16", "window-flash", "ckpt-bf16", "chunked-loss", "lowest-memory"]
# On a GPU the default list also times torch.compile, alone and with the chunked loss under CUDA
# graphs, so the recommendation can name the fastest row (speed is one of the table's columns).
# A CPU's list leaves it out: inductor's first compile of the model costs longer than the rest of
# the quick bench on 2 cores.
# fp8 joins it where the GPU has FP8 tensor cores (memtrain.bench.device_rows.adapt_fp8_rows
# drops it elsewhere).
CUDA_DEFAULT_EXTRA = ["compile", "compile-chunked", "fp8"]


def default_techniques(device_type: str) -> list[str]:
    """The rows of `memtrain bench` without --techniques on a device of ``device_type``."""
    return DEFAULT_TECHNIQUES + (CUDA_DEFAULT_EXTRA if device_type == "cuda" else [])

# A preset's name with a twin suffix (memtrain.report.noise.twin_of) is the same row again, there
# to measure noise: ``X-nudgeN`` with its initial weights nudged by one rounding (--nudge-seed N),
# ``X-seed2`` with the next seed. The report judges the other rows' PPL and step time against the
# spread of a row and its twins. `memtrain bench` without --techniques adds two nudged baselines:
# with one, the noise figure is a single draw and a small one would call rounding a difference.
# It adds a nudged twin of its BF16 flash row too: rounding grows otherwise in BF16 (at the quick
# scale on one CPU its twin ended 15% apart where the FP32 twins ended 0.8% apart), and the BF16
# rows are judged against it (memtrain.report.noise.row_noise: never against less than the FP32 twins).
NOISE_ROWS = ["baseline" + NUDGE_SUFFIX + "1", "baseline" + NUDGE_SUFFIX + "2", "flash-bf16" + NUDGE_SUFFIX + "1"]


def noise_twin(name: str) -> Optional[Twin]:
    """The twin a bench row ``name`` spells, when it repeats a preset; None for any other row."""
    twin = twin_of(name)
    return twin if twin is not None and twin.base in TECHNIQUES else None


# Settings a row cannot choose: the bench runs each row in its own folder, OUT/rows/NAME.
BENCH_SET_KEYS = frozenset({"out"})


def _refuse_row_key(name: str, key: str, earlier: dict[str, Any]) -> None:
    """A key of the explicit row ``name`` that could only be ignored: one it already set (the last
    value silently won: ``precision=bf16+precision=fp32`` ran, and was reported, as fp32), or one
    the bench sets for every row (``out=/etc`` ran in OUT/rows as if it had not been written)."""
    if key in earlier:
        raise ConfigError(f"technique {name!r} sets {key} twice; keep one")
    if key in BENCH_SET_KEYS:
        raise ConfigError(f"technique {name!r} sets {key}, which the bench sets for each row (OUT/rows/NAME); "
                          f"drop {key}= from the row")


def technique_overrides(name: str, scale: str) -> dict[str, Any]:
    """Config overrides of technique ``name`` (a preset, a preset's noise twin, or an
    explicit ``key=value+key=value`` combination) at ``scale``."""
    twin = noise_twin(name)
    if twin is not None:
        name = twin.base
    if "=" in name:
        out: dict[str, Any] = {}
        for part in name.split("+"):
            key, _, value = part.partition("=")
            if not key or not _:
                raise ConfigError(f"cannot read technique {name!r}; write presets or key=value+key=value, e.g. precision=bf16+loss=chunked")
            key = key.strip().replace("-", "_")
            _refuse_row_key(name, key, out)
            out[key] = value.strip()
        return out
    if name not in TECHNIQUES:
        close = difflib.get_close_matches(name, TECHNIQUES, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        twins = (" (a noise twin is PRESET-nudgeN, N = 1-99, or PRESET-seed2)"
                 if NUDGE_SUFFIX in name or "-seed" in name else "")
        raise ConfigError(f"unknown technique {name!r}; {hint}choose from {', '.join(TECHNIQUES)} or "
                          f"key=value+key=value{twins}")
    overrides = dict(TECHNIQUES[name])
    if "window" in overrides:
        overrides["window"] = SCALE_WINDOW[scale]
    return overrides


# The baseline's label off CUDA: TF32 is a CUDA tensor-core mode (torch.backends.cuda.matmul);
# a CPU (or MPS) baseline computes in plain FP32.
BASELINE_OFF_CUDA = "Baseline (FP32)"


def describe(name: str, device_type: Optional[str] = None) -> str:
    """The label a report shows for row ``name`` (its ``description``; rows are matched across
    runs by their name, never by this). ``device_type``: what the row runs on ("cpu", "cuda");
    the baseline's label names TF32 only on CUDA (None: unknown, the CUDA label as before)."""
    twin = noise_twin(name)
    if twin is not None and twin.kind == "nudge":
        return f"{describe(twin.base, device_type)}, weights nudged {twin.nudge_seed} (noise)"
    if twin is not None:
        return f"{describe(twin.base, device_type)}, seed + 1 (noise)"
    if name == "baseline" and device_type not in (None, "cuda"):
        return BASELINE_OFF_CUDA
    return DESCRIPTIONS.get(name, name)
