"""The longest context that fits: Llama-3-8B LoRA and QLoRA at batch 1 on 24 and 80 GB GPUs.

Each row is one `memtrain maxbatch --search seq-len --json` (a subprocess, as a user runs it),
estimated on a machine without a GPU:

* LoRA rows: the CUDA model (``--gpu NAME``): the analytic estimate with CUDA kernel facts,
  replayed through the caching-allocator model, plus the card's CUDA context, against the
  card's memory (memtrain.analysis.context.estimated_longest_context). Seconds per row.
* QLoRA rows: NF4 weights are not modelled analytically and fake CUDA tensors need a CUDA build
  of torch, so they are traced with CPU kernels (torchao NF4, fake tensors, two shallow copies
  of the model extended to its 32 layers) against the card's memory as a budget: live tensor
  bytes, no caching allocator and no CUDA context counted. Minutes per row.

The search goes up to 131,072 tokens (``--max-len``), past the bundled config's 8,192
max_position_embeddings: Llama-3.1-8B has the same shape with RoPE scaling and 131,072
positions, so the memory is the same; the output says so. Writes ``OUT/context_table.json``
and ``OUT/context_table.md`` (command, commit, hardware). A measured row waits for a GPU.

    python benchmarks/context_table.py --out benchmarks/results/estimated-context
    python benchmarks/context_table.py --rows lora-bf16-pure-sdpa --gpus rtx4090 --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from memtrain.devices.gpu_memory import gpu_memory
from memtrain.files.results import benchmark_out_problem, write_text_atomic

ROOT = Path(__file__).resolve().parent.parent
MODEL = "llama-3-8b"
MAX_LEN = 131072
LORA = ["--lora-rank", "16"]  # peft all-linear: every decoder Linear
# name -> (memtrain flags, estimated how: "cuda-model" | "cpu-trace")
ROWS: dict[str, tuple[list[str], str]] = {
    "lora-bf16-pure-sdpa": ([*LORA, "--precision", "bf16-pure", "--attention", "sdpa", "--checkpointing", "full",
                             "--loss", "chunked", "--optim", "adamw"], "cuda-model"),
    "lora-bf16-pure-flash": ([*LORA, "--precision", "bf16-pure", "--attention", "flash", "--checkpointing", "full",
                              "--loss", "chunked", "--optim", "adamw"], "cuda-model"),
    "lora-bf16-pure-sdpa-standard-loss": ([*LORA, "--precision", "bf16-pure", "--attention", "sdpa",
                                           "--checkpointing", "full", "--loss", "standard", "--optim", "adamw"],
                                          "cuda-model"),
    "lora-bf16-sdpa": ([*LORA, "--precision", "bf16", "--attention", "sdpa", "--checkpointing", "full",
                        "--loss", "chunked", "--optim", "adamw"], "cuda-model"),
    "qlora-bf16-sdpa": ([*LORA, "--qlora", "--precision", "bf16", "--attention", "sdpa", "--checkpointing", "full",
                         "--loss", "chunked", "--optim", "adamw"], "cpu-trace"),
}
# --gpu names (memtrain.devices.gpu_kinds resolves them) and their labels here
GPUS = dict([("rtx4090", "RTX 4090 24 GB"), ("a100-80gb", "A100 80 GB"), ("h100", "H100 80 GB")])


def command(row: str, gpu: str) -> list[str]:
    flags, how = ROWS[row]
    cmd = ["maxbatch", "--search", "seq-len", "--model", MODEL, *flags, "--batch-size", "1",
           "--max-len", str(MAX_LEN), "--json"]
    if how == "cuda-model":
        return [*cmd, "--gpu", gpu]
    found = gpu_memory(gpu)  # the card's memory, as --gpu takes it: the budget of a CPU-kernel trace
    assert found is not None, f"--gpu {gpu}: no memory figure in memtrain.devices.gpu_kinds"
    return [*cmd, "--device-type", "cpu", "--memory-budget", str(found[0])]


def hardware() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, no GPU ({platform.system()} {platform.release()})"


def run_row(row: str, gpu: str) -> dict:
    argv = command(row, gpu)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "memtrain", *argv], capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    rec = {"row": row, "gpu": gpu, "command": "memtrain " + " ".join(argv), "seconds": round(seconds, 1),
           "how": ROWS[row][1]}
    if proc.returncode != 0:
        rec["error"] = (proc.stderr.strip().splitlines() or ["exit %d" % proc.returncode])[-1]
        return rec
    res = json.loads(proc.stdout)
    rec.update({k: res.get(k) for k in ("seq_len", "peak_bytes", "next_seq_len", "next_peak_bytes", "budget_bytes",
                                        "capped", "method", "guess_method", "multiple_of")})
    rec["probes"] = len(res.get("probes", []))
    return rec


def markdown(rows: list[dict], commit: str, hw: str) -> str:
    gib = 2**30
    lines = [
        f"# Longest context that fits: {MODEL}, batch 1 (estimated, no GPU)",
        "",
        f"Commit {commit}; {hw}; generated by `python benchmarks/context_table.py` "
        f"({time.strftime('%Y-%m-%d')}). Each row's command is in context_table.json.",
        "",
        "| technique set | GPU | longest context (tokens) | peak | next length needs | how | probes | s |",
        "|---|---|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            why = r["error"].removeprefix("error: ").split(";")[0]  # the reason, not the advice
            lines.append(f"| {r['row']} | {GPUS[r['gpu']]} | none: {why} | | | {r['how']} | | |")
            continue
        nxt = f"{r['next_peak_bytes'] / gib:.2f} GiB" if r.get("next_peak_bytes") else "-"
        size = f"{r['seq_len']:,}" + ("+" if r["capped"] else "")
        how = ("CUDA model (analytic + allocator + context)" if r["how"] == "cuda-model"
               else f"CPU-kernel trace, {r['guess_method'] or 'no'} guess")
        lines.append(f"| {r['row']} | {GPUS[r['gpu']]} | {size} | {r['peak_bytes'] / gib:.2f} GiB | {nxt} | "
                     f"{how} | {r['probes']} | {r['seconds']:.0f} |")
    lines += [
        "",
        "LoRA r16 on every decoder Linear, AdamW, full activation checkpointing, lengths in multiples of 64, "
        f"searched up to {MAX_LEN:,} tokens. Beyond the bundled config's 8,192 max_position_embeddings the "
        "figures are memory only (Llama-3.1-8B: the same shape, RoPE scaling, 131,072 positions). "
        "CUDA-model rows count what the card holds (caching allocator + CUDA context; the RTX 4090's and "
        "A100's context is assumed, the H100's measured). QLoRA rows are traced with CPU kernels (torchao NF4) "
        "against the card's memory: live tensors only, no allocator rounding or CUDA context, so they are an "
        "upper bound for the card. A measured row (maxbatch --search seq-len on the GPU) waits for a GPU.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of: {', '.join(ROWS)}")
    ap.add_argument("--gpus", default=",".join(GPUS), help=f"comma-separated, of: {', '.join(GPUS)}")
    ap.add_argument("--out", required=True, help="a new folder for context_table.json and .md (rewritten after "
                                                 "every row)")
    args = ap.parse_args(argv)
    rows_asked = [r for r in args.rows.split(",") if r]
    gpus_asked = [g for g in args.gpus.split(",") if g]
    for flag, asked, known in (("--rows", rows_asked, ROWS), ("--gpus", gpus_asked, GPUS)):
        unknown = [a for a in asked if a not in known]
        if unknown or not asked:
            ap.error(f"{flag}: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(known)}")
    out = Path(args.out)
    problem = benchmark_out_problem(out, "context_table.json")
    if problem:
        ap.error(problem)
    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip() or "unknown"
    hw = hardware()
    rows = []
    for row in rows_asked:
        for gpu in gpus_asked:
            rec = run_row(row, gpu)
            print(json.dumps(rec), flush=True)
            rows.append(rec)
            # after every row: a later row's failure or a kill loses none before it
            write_text_atomic(out / "context_table.json",
                              json.dumps({"commit": commit, "hardware": hw, "rows": rows}, indent=2))
            write_text_atomic(out / "context_table.md", markdown(rows, commit, hw))
    return 0


if __name__ == "__main__":
    sys.exit(main())
