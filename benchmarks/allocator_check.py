"""Check `memtrain estimate --gpu` (the CUDA caching-allocator model) against a real GPU.

For each config, in a fresh process (so allocator caches and peaks do not leak between rows):
two real training steps of memtrain's model (memtrain.analysis.maxbatch.measure_step_memory: the second,
steady-state step is measured), then

* ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` of that step,
* the CUDA context: device memory in use (``torch.cuda.mem_get_info``) after CUDA is initialized
  and torch holds nothing, and the nvidia-smi-style peak total = max reserved + what is in use
  outside torch's cache after the run,

next to the estimate (tracked peak, modelled allocated / reserved / device total). Rows include
the seed table's batch 64 x 256 configs with ``--loss naive`` (the seed measured the common loop
that keeps the logits; its published RTX 4090 figures are printed beside them, mapped to the
rows in this order: baseline, bf16, flash-bf16, window-flash, ckpt-bf16).

    python benchmarks/allocator_check.py --out benchmarks/results/allocator-h100

The columns "outside torch after the run" and "reserved after step 1" (measured beside the
two-step replay's figure) are absent from the recorded H100 run
(benchmarks/results/gpu-h100/allocator-check; its commit and card: benchmarks/results/gpu-h100/README.md):
the next run on a GPU fills them.

Needs torch with CUDA and memtrain's own dependencies only; about 1-2 minutes on an H100.
Writes OUT/allocator_check.json and OUT/allocator_check.md (command, commit, GPU, table).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# (name, config overrides, seed-table figure in GB or None)
SEED = {"batch_size": 64, "seq_len": 256}
ROWS: list[tuple[str, dict[str, Any], Any]] = [
    ("seed baseline, naive loss", {**SEED, "precision": "tf32", "attention": "math", "loss": "naive"}, 15.79),
    ("seed bf16, naive loss", {**SEED, "precision": "bf16", "attention": "math", "loss": "naive"}, 16.14),
    ("seed flash-bf16, naive loss", {**SEED, "precision": "bf16", "attention": "flash", "loss": "naive"}, 15.20),
    # the seed's "window-flash" row: CUDA's flash kernel takes no band mask, so memory-efficient
    # SDPA runs it, as the seed bench does on CUDA
    ("seed window (mem-efficient), naive loss", {**SEED, "precision": "bf16", "attention": "mem-efficient",
                                                 "window": 128, "loss": "naive"}, 15.20),
    ("seed ckpt-bf16, naive loss", {**SEED, "precision": "bf16", "attention": "math", "checkpointing": "full",
                                    "loss": "naive"}, 14.57),
    ("seed bf16, standard loss", {**SEED, "precision": "bf16", "attention": "math"}, None),
    ("bf16 flash chunked, batch 16", {"batch_size": 16, "seq_len": 256, "precision": "bf16", "attention": "flash",
                                      "loss": "chunked"}, None),
    ("fp32 small batch (state-bound)", {"batch_size": 2, "seq_len": 128, "precision": "fp32"}, None),
]
# The transformers rows whose reserved memory was off by up to 5.3% on an H100 (bundled configs,
# random weights): the 8B LoRA fine-tune and the 0.5B full fine-tune with either loss.
QWEN = {"model": "qwen2.5-0.5b", "batch_size": 4, "seq_len": 1024, "precision": "bf16", "attention": "sdpa"}
MODEL_ROWS: list[tuple[str, dict[str, Any], Any]] = [
    ("Llama-3-8B LoRA r16 all-linear, bf16-pure, checkpointing, 1 x 2048",
     {"model": "llama-3-8b", "batch_size": 1, "seq_len": 2048, "precision": "bf16-pure", "attention": "sdpa",
      "lora_rank": 16, "checkpointing": "full"}, None),
    ("Qwen2.5-0.5B full, bf16, 4 x 1024", QWEN, None),
    ("Qwen2.5-0.5B full, bf16, 4 x 1024, chunked loss", {**QWEN, "loss": "chunked"}, None),
]
# Cut Cross-Entropy (--loss-kernel cce, cut_cross_entropy installed): the estimate models its buffers
# from its source; these rows check that model against the allocator.
KERNEL_ROWS: list[tuple[str, dict[str, Any], Any]] = [
    ("seed flash-bf16, Cut Cross-Entropy", {**SEED, "precision": "bf16", "attention": "flash", "loss": "chunked",
                                            "loss_kernel": "cce"}, None),
    ("Qwen2.5-0.5B full, bf16, 4 x 1024, Cut Cross-Entropy", {**QWEN, "loss": "chunked", "loss_kernel": "cce"}, None),
]
ROW_SETS = {"seed": ROWS, "models": MODEL_ROWS, "kernels": KERNEL_ROWS, "all": ROWS + MODEL_ROWS + KERNEL_ROWS}


def _one(overrides: dict[str, Any]) -> dict[str, Any]:
    """Runs in the child: measure one config and estimate it."""
    import torch

    from memtrain.analysis.maxbatch import measure_step_memory
    from memtrain.config.run import build_config

    dev = torch.device("cuda")
    torch.cuda.init()
    torch.zeros(1, device=dev)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    context = total - free - torch.cuda.memory_reserved()
    cfg = build_config({**overrides, "device": "cuda"})
    # Reserved after each of the two steps (the model replays both: step 1 creates the
    # optimizer state in the blocks its backward freed, step 2 runs in that cache).
    import memtrain.training.step as step_mod

    reserved_after: list[int] = []
    real_step = step_mod.run_step

    def step_and_record(*a: Any, **k: Any) -> Any:
        out = real_step(*a, **k)
        torch.cuda.synchronize()
        reserved_after.append(torch.cuda.memory_reserved())
        return out

    step_mod.run_step = step_and_record  # measure_steps looks it up in its module at each step
    t0 = time.time()
    try:
        stats = measure_step_memory(cfg, cfg.train.batch_size)
    finally:
        step_mod.run_step = real_step
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    outside = total - free - torch.cuda.memory_reserved()  # context + libraries, after the run
    name = torch.cuda.get_device_name(dev)
    if stats is None:
        measured = {"oom": True}
    else:
        measured = {"max_allocated": stats["max_allocated_bytes"], "max_reserved": stats["max_reserved_bytes"],
                    "device_total": stats["max_reserved_bytes"] + outside,
                    "reserved_after_step1": reserved_after[0] if reserved_after else None}
    return {"gpu": name, "seconds": time.time() - t0, "context_before": context, "outside_torch_after": outside,
            "measured": measured, "estimate": estimate_row(cfg, name)}


def estimate_row(cfg: Any, gpu: str) -> dict[str, Any]:
    """The estimate of one row, as `memtrain estimate --gpu` answers it (estimate_step: a
    transformers model gets its own layer model, not memtrain's GPT's)."""
    from memtrain.analysis.estimate.method import estimate_step, model_arch

    est = estimate_step(cfg, "cuda", model_arch(cfg), gpu=gpu).analytic
    assert est is not None, "every row of this check is one the analytic model covers"
    dm = est.device_memory or {}
    return {"tracked_peak": est.peak_bytes, "allocated": dm.get("allocated"),
            "reserved": dm.get("reserved"), "device_total": dm.get("device_total"),
            "reserved_after_step1": dm.get("reserved_first_step"),
            "assumed_context": dm.get("cuda_context"), "peak_phase": est.peak_phase}


def _gb(x: Any) -> str:
    return "-" if x is None else f"{x / 1e9:.2f}"


def _ratio(a: Any, b: Any) -> str:
    return "-" if not a or not b else f"{a / b - 1:+.1%}"


def _defaults_env() -> tuple[dict[str, str], dict[str, str]]:
    """This process's environment less the caching allocator's settings, and the settings left out.
    The model describes torch's default allocator; under ``expandable_segments`` or
    ``max_split_size_mb`` (a machine may set them) its reserved figures would be compared against
    another allocator's."""
    from memtrain.runtime.env import ALLOC_CONF_VARS  # memtrain's imports of this script are local (see main)

    dropped = {k: os.environ[k] for k in ALLOC_CONF_VARS if os.environ.get(k)}
    return {k: v for k, v in os.environ.items() if k not in ALLOC_CONF_VARS}, dropped


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--out", default="benchmarks/results/allocator-check")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=120.0, help="Seconds per config (default 120).")
    ap.add_argument("--rows", choices=sorted(ROW_SETS), default="seed",
                    help="seed: memtrain's GPT at the seed table's sizes (default); models: the transformers "
                         "rows (Llama-3-8B LoRA, Qwen2.5-0.5B); kernels: Cut Cross-Entropy on the seed GPT and "
                         "Qwen2.5-0.5B (needs cut_cross_entropy); all: every row")
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(_one(json.loads(args.one))))
        return 0
    # memtrain.runtime.env reads memtrain's own checkout, or MEMTRAIN_COMMIT where git is hidden
    # (the GPU runbook); imported here as the other memtrain imports of this script are
    from memtrain.files.results import benchmark_out_problem
    from memtrain.runtime.env import git_commit

    out = Path(args.out)
    problem = benchmark_out_problem(out, "allocator_check.json")
    if problem:
        ap.error(problem)
    out.mkdir(parents=True, exist_ok=True)

    env, dropped = _defaults_env()
    meta = {"command": " ".join([sys.executable, *sys.argv]), "commit": git_commit() or "unknown",
            "allocator_conf_dropped": dropped}
    if dropped:
        print(f"note: the rows run under torch's allocator defaults, as the model assumes, not {dropped}",
              file=sys.stderr)
    rows: list[dict[str, Any]] = []
    for name, overrides, seed in ROW_SETS[args.rows]:
        try:
            proc = subprocess.run([sys.executable, __file__, "--one", json.dumps(overrides)], capture_output=True,
                                  text=True, timeout=args.timeout, env=env)
        except subprocess.TimeoutExpired:
            rows.append({"name": name, "overrides": overrides, "error": [f"no result within --timeout {args.timeout:g} s"]})
            print(f"{name}: no result within {args.timeout:g} s", file=sys.stderr)
        else:
            if proc.returncode != 0:
                rows.append({"name": name, "overrides": overrides, "error": proc.stderr.strip().splitlines()[-1:]})
                print(f"{name}: failed: {proc.stderr.strip()[-500:]}", file=sys.stderr)
            else:
                r = json.loads(proc.stdout.strip().splitlines()[-1])
                rows.append({"name": name, "overrides": overrides, "seed_table_gb": seed, **r})
                print(f"{name}: measured {r['measured']}, estimate {r['estimate']}")
        _write(out, meta, rows)  # after every row: a later row's failure or a kill loses none before it
    print(f"wrote {out / 'allocator_check.md'}")
    return 0


def _write(out: Path, run: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """allocator_check.json and .md of the rows so far (each replaced atomically); ``run``: the
    command and commit."""
    from memtrain.files.results import write_text_atomic

    meta = {**run, "gpu": next((r.get("gpu") for r in rows if r.get("gpu")), None)}
    write_text_atomic(out / "allocator_check.json", json.dumps({**meta, "rows": rows}, indent=2))
    lines = [f"# CUDA allocator model vs measured ({meta['gpu']})", "",
             f"Command: `{meta['command']}`, commit {meta['commit']}. GB = 1e9 bytes."
             + (f" Rows ran under torch's allocator defaults (the model's), not the environment's "
                f"{meta['allocator_conf_dropped']}." if meta.get("allocator_conf_dropped") else ""), "",
             "| config | tracked est. | allocated meas. | allocated est. | err | reserved meas. | reserved est. | err "
             "| device total meas. | device total est. | err | seed table | context meas. / assumed "
             "| outside torch after the run meas. | reserved after step 1 meas. / est. |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | failed: {r['error']} |" + " |" * 13)
            continue
        m, e = r["measured"], r["estimate"]
        lines.append(
            f"| {r['name']} | {_gb(e['tracked_peak'])} | {_gb(m.get('max_allocated'))} | {_gb(e['allocated'])} | "
            f"{_ratio(e['allocated'], m.get('max_allocated'))} | {_gb(m.get('max_reserved'))} | {_gb(e['reserved'])} | "
            f"{_ratio(e['reserved'], m.get('max_reserved'))} | {_gb(m.get('device_total'))} | {_gb(e['device_total'])} | "
            f"{_ratio(e['device_total'], m.get('device_total'))} | {r['seed_table_gb'] or '-'} | "
            f"{_gb(r['context_before'])} / {_gb(e['assumed_context'])} | {_gb(r['outside_torch_after'])} | "
            f"{_gb(m.get('reserved_after_step1'))} / {_gb(e.get('reserved_after_step1'))} |")
    write_text_atomic(out / "allocator_check.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
