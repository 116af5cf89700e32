"""``memtrain estimate --mode inference`` against a measured ``generate``, on a GPU (or a CPU).

For each row (a model, weights dtype, batch x prompt + new tokens): the model is built with random
weights on the device in its dtype (SDPA, as ``memtrain generate`` loads it) and samples with
memtrain generate's ``GenerationConfig``; measured are the tracked peak (live tensor bytes, what
the estimate predicts), ``max_memory_allocated``, ``max_memory_reserved`` and the device's used
memory (total - free, the CUDA context included: what ``--gpu``'s fit verdict compares). Beside
them: the estimate's peak, and the fit's ``needed_bytes`` with ``--gpu`` (live bytes + CUDA
context + cuBLAS workspace, documented as a lower bound: the caching allocator's rounding and
the segments a cache grown by ``torch.cat`` each step leaves are not modelled).

    PYTHONPATH=src python benchmarks/generate_check.py --out DIR [--device cuda] [--gpu h100]
    PYTHONPATH=src python benchmarks/generate_check.py --out DIR --device cpu --rows smoke

Writes ``DIR/generate_check.jsonl`` (a line per row as it finishes; a failed row records its
error and the others run) and ``DIR/generate_check.md`` (the table, with the command, commit and
device). Rows run one after another in this process, the allocator's cached segments given back
between them (``torch.cuda.empty_cache``); the device's used memory is read once generate has
returned (the context, and the segments the allocator keeps: about its reserved peak).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import shlex
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Optional

import torch

# model spec (a bundled config, or "mistral-7b-window" for Mistral-7B's shape with v0.1's 4096
# window), weights dtype, batch, prompt, new tokens
FULL_ROWS: list[tuple[str, str, int, int, int]] = [
    ("qwen2.5-0.5b", "bf16", 16, 512, 256),  # decode-bound: the cache outgrows the weights' share
    ("llama-3-8b", "bf16", 8, 1024, 512),
    ("llama-3-8b", "bf16", 1, 4096, 64),  # prefill-bound
    ("mistral-7b-window", "bf16", 2, 5120, 128),  # a prompt past the window: the masked prefill
]
SMOKE_ROWS: list[tuple[str, str, int, int, int]] = [
    ("tiny-llama", "fp32", 2, 32, 16),
    ("tiny-llama", "bf16", 2, 32, 4),
]
WINDOWED = {"mistral-7b-window": ("mistral-7b", 4096)}


def _model_dir(spec: str, work: Path) -> str:
    """A --model for ``spec``: the bundled config, or a folder with its config and a window set."""
    if spec not in WINDOWED:
        return spec
    from memtrain.models.source import CONFIG_DIR

    base, window = WINDOWED[spec]
    config = json.loads((CONFIG_DIR / f"{base}.json").read_text())
    config["sliding_window"] = window
    folder = work / spec
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def _estimate(model: str, dtype: str, batch: int, prompt: int, new: int, gpu: Optional[str]) -> dict[str, Any]:
    """``memtrain estimate --mode inference --json`` (with ``--gpu``: its fit entry too)."""
    from memtrain.cli import main

    argv = ["estimate", "--mode", "inference", "--model", model, "--weights-dtype", dtype, "--batch-size", str(batch),
            "--seq-len", str(prompt), "--new-tokens", str(new), "--json"]
    if gpu:
        argv += ["--gpu", gpu, "--budget", "100TiB"]  # a budget that fits: the fit's needed_bytes is the figure
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(argv)
    if rc != 0:
        raise RuntimeError(f"memtrain {shlex.join(argv)} exited {rc}")
    return json.loads(out.getvalue())


def _measure(model_dir: str, dtype: str, batch: int, prompt: int, new: int, device: torch.device) -> dict[str, Any]:
    """Peaks of memtrain generate's sampling call on a random-weight model built on ``device``."""
    import transformers

    from memtrain.inference.generate import generation_config, sample_ids
    from memtrain.metrics import MemoryMeter
    from memtrain.models.auto_config import load_config

    config = load_config(model_dir)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()  # the rows before this one: their cached segments go back
    with torch.device(device):
        lm = transformers.AutoModelForCausalLM.from_config(config, dtype=torch_dtype, attn_implementation="sdpa",
                                                           trust_remote_code=False).eval()
    torch.manual_seed(0)
    x = torch.randint(1, config.vocab_size, (batch, prompt), device=device)
    settings = generation_config(new, 0.8, 50, 0)
    meter = MemoryMeter(lm)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    with torch.no_grad(), meter:
        meter.track(x)
        sample_ids(lm, x, settings)
    if cuda:
        torch.cuda.synchronize(device)
    out: dict[str, Any] = {"tracked_peak": meter.stats().peak_bytes, "seconds": time.perf_counter() - start}
    if cuda:
        free, total = torch.cuda.mem_get_info(device)
        out.update(max_allocated=torch.cuda.max_memory_allocated(device),
                   max_reserved=torch.cuda.max_memory_reserved(device),
                   reserved_after=torch.cuda.memory_reserved(device),
                   # What the card holds for this process once generate has returned (nvidia-smi's
                   # view: the CUDA context and the allocator's segments, which it keeps cached).
                   device_used_after=total - free, device_total=total)
    del lm, x, meter
    gc.collect()
    return out


def _ratio(a: Any, b: Any) -> str:
    return f"{a / b - 1:+.2%}" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else "-"


def _gib(n: Any) -> str:
    return f"{n / 2**30:.3f}" if isinstance(n, (int, float)) else "-"


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="a folder for the results (new, or without an earlier run's)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--gpu", default=None, help="the card's name for --gpu's fit figure (e.g. h100); default: the device's")
    p.add_argument("--rows", default="full", choices=["full", "smoke"])
    args = p.parse_args(argv)
    out = Path(args.out)
    # The rows are appended to generate_check.jsonl: a folder that holds one from an earlier run is
    # refused, other files are not (the GPU runbook writes its step's log.txt there first).
    from memtrain.files.results import benchmark_out_problem

    problem = benchmark_out_problem(out, "generate_check.jsonl")
    if problem:
        p.error(problem)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda needs a CUDA GPU; give --device cpu --rows smoke on a CPU", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    gpu = args.gpu or (torch.cuda.get_device_name(device) if args.device == "cuda" else None)
    rows = FULL_ROWS if args.rows == "full" else SMOKE_ROWS
    from memtrain.runtime.env import git_commit

    lines = [f"# estimate --mode inference against a measured generate ({args.device}"
             + (f", {gpu}" if gpu else "") + ")", "",
             f"command: `{shlex.join(['python', 'benchmarks/generate_check.py', *(argv or sys.argv[1:])])}`; "
             f"memtrain commit {git_commit() or 'unknown'}; torch {torch.__version__}", "",
             "| model | dtype | batch x prompt + new | estimated peak GiB | tracked GiB | est. vs tracked | "
             "max allocated GiB | max reserved GiB | fit's lower bound GiB | device used GiB | bound vs used | "
             "peak phase |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    with tempfile.TemporaryDirectory() as work, (out / "generate_check.jsonl").open("a") as log:
        for spec, dtype, batch, prompt, new in rows:
            record: dict[str, Any] = {"model": spec, "dtype": dtype, "batch": batch, "prompt": prompt, "new": new}
            try:
                model = _model_dir(spec, Path(work))
                est = _estimate(model, dtype, batch, prompt, new, gpu)
                record.update(estimated_peak=est["peak_bytes"], peak_phase=est["peak_phase"],
                              fit_needed=(est.get("fit") or {}).get("needed_bytes"))
                record.update(_measure(model, dtype, batch, prompt, new, device))
            except Exception as exc:  # noqa: BLE001 - a failed row is recorded, the rest still run
                record["error"] = f"{type(exc).__name__}: {exc}"
                record["traceback"] = traceback.format_exc()
            log.write(json.dumps(record) + "\n")
            log.flush()
            r = record
            lines.append(f"| {spec} | {dtype} | {batch} x {prompt} + {new} | {_gib(r.get('estimated_peak'))} | "
                         f"{_gib(r.get('tracked_peak'))} | {_ratio(r.get('estimated_peak'), r.get('tracked_peak'))} | "
                         f"{_gib(r.get('max_allocated'))} | {_gib(r.get('max_reserved'))} | "
                         f"{_gib(r.get('fit_needed'))} | {_gib(r.get('device_used_after'))} | "
                         f"{_ratio(r.get('fit_needed'), r.get('device_used_after'))} | "
                         f"{r.get('peak_phase', r.get('error', '-'))} |")
            (out / "generate_check.md").write_text("\n".join(lines) + "\n")
            print(lines[-1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
