"""transformers models on one CUDA GPU: the estimate and the trace beside a measured step, and
the GPU-only technique paths (bitsandbytes QLoRA, flex attention, SDPA's flash and
memory-efficient kernels, Liger's fused loss, flash_attention_2 where installed) trained for a
few steps.

Part 1 (memory): for each (family, techniques) row of ``MEMORY_ROWS`` on a mid-size config
(random weights; batch 4 x seq 512): ``memtrain estimate --json --gpu NAME`` (analytic where the
family has a model, else the extrapolated trace; its allocator replay predicts
``max_memory_allocated`` / ``max_memory_reserved``), ``--trace`` on CUDA fake tensors, and two
real steps (:func:`memtrain.analysis.maxbatch.measure_step_memory`: the allocator's peaks of the
second step).

Part 2 (training): ``memtrain train`` for ``TRAIN_STEPS`` steps on the embedded default corpus for
each row of ``TRAIN_ROWS``: first and last losses, median step time, peak.

    PYTHONPATH=src python benchmarks/hf_gpu_check.py --out DIR [--gpu h100]

Writes ``DIR/hf_gpu_memory.jsonl`` and ``DIR/hf_gpu_train.jsonl``, a line per row as each
finishes (a row's failure is recorded in its line and the other rows still run).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

import torch
import transformers

# One mid-size shape per family (random init, GPT-2's vocabulary so the embedded corpus's
# GPT-2 BPE tokenizes for it): ~190M parameters, large enough that the CUDA context-free
# allocations (cuBLAS workspace, allocator rounding) are small next to the step.
MID = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
           max_position_embeddings=1024, vocab_size=50257)
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**MID, num_key_value_heads=4),
    "qwen2": lambda: transformers.Qwen2Config(**MID, num_key_value_heads=4, tie_word_embeddings=True),
    "mistral": lambda: transformers.MistralConfig(**MID, num_key_value_heads=4, sliding_window=256),
    "gemma": lambda: transformers.GemmaConfig(**{**MID, "num_key_value_heads": 1, "head_dim": 64}),
    "gpt2": lambda: transformers.GPT2Config(n_embd=1024, n_layer=8, n_head=16, n_positions=1024, vocab_size=50257),
}

MEMORY_ROWS: list[tuple[str, dict[str, Any]]] = [
    ("llama", {"precision": "fp32", "attention": "sdpa"}),
    ("llama", {"precision": "bf16", "attention": "sdpa"}),
    ("llama", {"precision": "bf16", "attention": "flash", "checkpointing": "full", "loss": "chunked"}),
    ("llama", {"precision": "bf16-pure", "attention": "sdpa", "lora_rank": 16}),
    ("llama", {"precision": "bf16-pure", "attention": "sdpa", "lora_rank": 16, "qlora": True,
               "checkpointing": "full"}),
    ("llama", {"precision": "bf16", "attention": "mem-efficient", "checkpointing": "every:2"}),
    ("qwen2", {"precision": "bf16", "attention": "sdpa", "lora_rank": 16, "loss": "chunked"}),
    ("mistral", {"precision": "bf16", "attention": "sdpa", "window": 256}),
    ("gemma", {"precision": "bf16", "attention": "sdpa"}),
    ("gpt2", {"precision": "bf16", "attention": "sdpa"}),
    ("gpt2", {"precision": "fp32", "attention": "math", "checkpointing": "full"}),
]

TRAIN_ROWS: list[tuple[str, dict[str, Any]]] = [
    ("llama", {"precision": "bf16", "attention": "sdpa"}),
    ("llama", {"precision": "bf16-pure", "attention": "sdpa", "lora_rank": 16, "qlora": True,
               "checkpointing": "full", "loss": "chunked"}),
    ("llama", {"precision": "bf16", "attention": "flex"}),
    ("llama", {"precision": "bf16", "attention": "flash", "loss": "chunked"}),  # Liger where installed
    ("llama", {"precision": "bf16", "attention": "mem-efficient"}),
    ("llama", {"precision": "bf16", "attention": "flash-attn"}),  # flash_attention_2: needs flash-attn
    ("mistral", {"precision": "bf16", "attention": "sdpa", "window": 128}),
    ("gpt2", {"precision": "bf16", "attention": "sdpa", "lora_rank": 16}),
]
TRAIN_STEPS = 30

BATCH, SEQ = 4, 512
ROOT = pathlib.Path(__file__).resolve().parents[1]


def flags(tech: dict[str, Any]) -> list[str]:
    """Config keys as the CLI's flags (every config field is a --flag)."""
    out: list[str] = []
    for k, v in tech.items():
        out += [f"--{k.replace('_', '-')}"] if v is True else [f"--{k.replace('_', '-')}", str(v)]
    return out


def label(family: str, tech: dict[str, Any]) -> str:
    return family + " " + " ".join(f"{k}={v}" for k, v in tech.items())


def cli(args: list[str], timeout: float = 600) -> tuple[int, str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, "-m", "memtrain", *args], capture_output=True, text=True,
                       timeout=timeout, env=env)
    return p.returncode, p.stdout, p.stderr


def append(path: pathlib.Path, row: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def memory_row(model_dir: pathlib.Path, family: str, tech: dict[str, Any], gpu: str) -> dict[str, Any]:
    from memtrain.analysis.maxbatch import measure_step_memory
    from memtrain.config.run import build_config

    row: dict[str, Any] = {"row": label(family, tech)}
    common = ["--model", str(model_dir), "--batch-size", str(BATCH), "--seq-len", str(SEQ), "--device", "cuda",
              *flags(tech), "--json"]
    rc, out, err = cli(["estimate", *common, "--gpu", gpu])
    if rc == 0:
        est = json.loads(out)
        row.update(method=est.get("method"), estimate_peak=est.get("peak_bytes"),
                   estimate_device=est.get("device_memory"))
    else:
        row["estimate_error"] = err.strip().splitlines()[-1] if err.strip() else f"exit {rc}"
    rc, out, err = cli(["estimate", *common, "--trace"])
    if rc == 0:
        est = json.loads(out)
        row["trace_peak"] = (est.get("trace") or {}).get("peak_bytes", est.get("peak_bytes"))
        row["trace_method"] = est.get("method")
    else:
        row["trace_error"] = err.strip().splitlines()[-1] if err.strip() else f"exit {rc}"
    cfg = build_config({"model": str(model_dir), "batch_size": BATCH, "seq_len": SEQ, "device": "cuda",
                        "progress": False, **tech})
    t0 = time.perf_counter()
    stats = measure_step_memory(cfg, BATCH)
    row["measure_s"] = round(time.perf_counter() - t0, 1)
    row["measured"] = None if stats is None else {k: stats.get(k) for k in ("max_allocated_bytes", "max_reserved_bytes")}
    alloc = (row["measured"] or {}).get("max_allocated_bytes")
    for key in ("estimate_peak", "trace_peak"):
        if alloc and row.get(key):
            row[key + "_vs_allocated"] = row[key] / alloc - 1
    dev = row.get("estimate_device") or {}
    if alloc and dev.get("allocated"):
        row["predicted_allocated_vs_measured"] = dev["allocated"] / alloc - 1
    reserved = (row["measured"] or {}).get("max_reserved_bytes")
    if reserved and dev.get("reserved"):
        row["predicted_reserved_vs_measured"] = dev["reserved"] / reserved - 1
    return row


def train_row(model_dir: pathlib.Path, family: str, tech: dict[str, Any], work: pathlib.Path) -> dict[str, Any]:
    out_dir = work / f"train-{abs(hash(label(family, tech)))}"
    rc, _, err = cli(["train", "--model", str(model_dir), "--device", "cuda", "--steps", str(TRAIN_STEPS),
                      "--batch-size", "8", "--seq-len", "256", "--lr", "1e-3", "--warmup-steps", "5",
                      "--no-progress", "--out", str(out_dir), *flags(tech)])
    row: dict[str, Any] = {"row": label(family, tech), "exit": rc}
    if rc != 0:
        row["error"] = err.strip().splitlines()[-1] if err.strip() else ""
        return row
    res = json.loads((out_dir / "result.json").read_text())
    losses = res["loss_history"]
    row.update(first_loss=losses[0], last_loss=losses[-1], val_ppl=res["val_ppl"],
               step_time_median_s=res["step_time_s"]["median"], memory=res["memory"],
               loss_kernel=res.get("loss_kernel"), optimizer_kernel=res.get("optimizer_kernel"))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--out", required=True)
    ap.add_argument("--gpu", default="h100")
    ap.add_argument("--part", choices=["memory", "train", "both"], default="both")
    ap.add_argument("--rows", default=None, help="Only these MEMORY_ROWS (comma-separated indices).")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: this check needs a CUDA GPU")
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = pathlib.Path(tempfile.mkdtemp())
    dirs = {}
    for fam, make in FAMILIES.items():
        d = work / fam
        make().save_pretrained(d)
        dirs[fam] = d
    header = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "transformers": transformers.__version__, "batch": BATCH, "seq": SEQ}
    print(json.dumps(header), flush=True)
    if a.part in ("memory", "both"):
        keep = {int(i) for i in a.rows.split(",")} if a.rows else set(range(len(MEMORY_ROWS)))
        for fam, tech in (r for i, r in enumerate(MEMORY_ROWS) if i in keep):
            try:
                row = memory_row(dirs[fam], fam, tech, a.gpu)
            except Exception as exc:  # noqa: BLE001 - a row's failure is recorded, the rest still run
                row = {"row": label(fam, tech), "exception": repr(exc)[:500], "tb": traceback.format_exc()[-1500:]}
            append(out / "hf_gpu_memory.jsonl", {**header, **row})
    if a.part in ("train", "both"):
        for fam, tech in TRAIN_ROWS:
            append(out / "hf_gpu_train.jsonl", {**header, **train_row(dirs[fam], fam, tech, work)})


if __name__ == "__main__":
    main()
