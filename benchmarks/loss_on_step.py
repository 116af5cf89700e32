"""Time the training step under ``--loss-on completion`` beside ``--loss-on all``, in one run.

``--loss-on completion`` (prompt-completion or chat records) averages the loss over the answer
tokens only: the prompt's targets are IGNORE_INDEX, each micro-batch's loss is weighted by its
share of the step's answer tokens (``MicroBatches.loss_scales``) and the model's loss skips the
ignored targets (``answers_only``). This script builds the same model twice, once per setting,
and times its steps on the same token ids (random ones: a step's time and memory do not depend on
them), the prompt taking the first ``1 - --answer-share`` of every block under ``completion``:

* ``all``: every target counts (text data), the loss divided by the micro-batch count;
* ``completion``: the answer tokens only, weighted by their counts.

For each: the first step's time (a compile lands there under ``--compile``), the median of the
next ``--steps`` steps (each waited for), and on CUDA the peak of allocated memory over the
timed steps. The variants run one after the other in this process, the first freed before the
second is built.

    python benchmarks/loss_on_step.py --device cuda --precision bf16 --attention flash --compile --out /tmp/loss-on
    python benchmarks/loss_on_step.py --d-model 64 --n-layers 2 --batch-size 2 --seq-len 64 --steps 3
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from memtrain.config.argtypes import positive_int
from memtrain.config.run import build_config
from memtrain.data.loader import IGNORE_INDEX, MicroBatches, host_target_count
from memtrain.files.results import benchmark_out_problem, write_json_atomic
from memtrain.training.step import build_state, run_step

VARIANTS = ("all", "completion")
PRODUCED = "loss_on_step.json"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _answer_share(text: str) -> float:
    """argparse type: a share of each block in (0, 1]."""
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text}: give a share of the block in (0, 1], e.g. 0.5")
    return value


def micro_batches(loss_on: str, batch: int, seq: int, accum: int, vocab: int, answer_share: float) -> list:
    """``accum`` micro-batches of random ids; under ``completion`` each block's first
    ``1 - answer_share`` of targets are the prompt's (IGNORE_INDEX) and the step carries the
    answer-token counts the loader gives it."""
    g = torch.Generator().manual_seed(0)
    group: MicroBatches = MicroBatches()
    prompt = int(round(seq * (1.0 - answer_share)))
    for _ in range(accum):
        x = torch.randint(0, vocab, (batch, seq), generator=g)
        y = torch.randint(0, vocab, (batch, seq), generator=g)
        if loss_on == "completion":
            y[:, :prompt] = IGNORE_INDEX
        group.append((x, y))
    if loss_on == "completion":
        group.target_counts = [host_target_count(y) for _, y in group]
    return group


def _settings(args: argparse.Namespace, loss_on: str) -> dict[str, Any]:
    """The run config of one variant (the records file is named, never read: no data is loaded)."""
    settings: dict[str, Any] = {
        "device": args.device, "batch_size": args.batch_size, "seq_len": args.seq_len, "grad_accum": args.grad_accum,
        "precision": args.precision, "attention": args.attention, "loss": args.loss, "compile": args.compile,
        "loss_on": loss_on,
    }
    if loss_on == "completion":
        settings.update(data="records.jsonl", data_format="prompt-completion")
    for key in ("d_model", "n_layers", "n_heads", "d_ff"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    return settings


def run(args: argparse.Namespace) -> Iterator[tuple[str, dict[str, float]]]:
    """Each variant's timings, the model built anew (same seed) for each."""
    device = torch.device(args.device)
    for loss_on in VARIANTS:
        cfg = build_config(_settings(args, loss_on))
        torch.manual_seed(0)
        state = build_state(cfg, device)
        group = micro_batches(loss_on, args.batch_size, args.seq_len, args.grad_accum, cfg.model.vocab_size,
                              args.answer_share)
        _sync(device)
        t0 = time.perf_counter()
        run_step(state, group)  # reads the loss: the step has finished
        first = time.perf_counter() - t0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times, losses = [], []
        for _ in range(args.steps):
            _sync(device)
            t0 = time.perf_counter()
            losses.append(run_step(state, group))
            _sync(device)
            times.append(time.perf_counter() - t0)
        timing = {"first_s": first, "median_ms": statistics.median(times) * 1e3, "last_loss": losses[-1]}
        if device.type == "cuda":
            timing["max_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        del state
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        yield loss_on, timing


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch-size", type=positive_int, default=64)
    ap.add_argument("--seq-len", type=positive_int, default=256)
    ap.add_argument("--grad-accum", type=positive_int, default=1)
    ap.add_argument("--answer-share", type=_answer_share, default=0.5,
                    help="the share of each block that is the answer under completion (default 0.5)")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--attention", default="sdpa")
    ap.add_argument("--loss", default="standard")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--steps", type=positive_int, default=20, help="timed steps after the first")
    for key in ("d-model", "n-layers", "n-heads", "d-ff"):  # the seed GPT's unless given (a toy model on a CPU)
        ap.add_argument(f"--{key}", type=positive_int, default=None)
    ap.add_argument("--out", type=Path, help=f"folder for {PRODUCED}")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    problem = None if args.out is None else benchmark_out_problem(args.out, PRODUCED)
    if problem:
        ap.error(problem)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(f"batch {args.batch_size} x {args.seq_len}, grad accum {args.grad_accum}, answer share "
          f"{args.answer_share:g}, {args.precision}, {args.attention}, loss {args.loss}"
          f"{', compiled' if args.compile else ''} on {name}, torch {torch.__version__}")
    print("| --loss-on | first step (s) | median step (ms) | max allocated (GiB) |\n|---|---:|---:|---:|", flush=True)
    payload: dict[str, Any] = {"command": " ".join(["python", *sys.argv]), "device": name, "torch": torch.__version__,
                               "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                               "results": {}}
    for loss_on, timing in run(args):
        peak = timing.get("max_allocated_gib")
        print(f"| {loss_on} | {timing['first_s']:.2f} | {timing['median_ms']:.2f} | "
              f"{'-' if peak is None else f'{peak:.2f}'} |", flush=True)
        payload["results"][loss_on] = timing
        if args.out is not None:  # after each variant: a later one that fails loses nothing
            write_json_atomic(args.out / PRODUCED, payload)
    results = payload["results"]
    if len(results) == len(VARIANTS):
        ratio = results["completion"]["median_ms"] / results["all"]["median_ms"]
        print(f"completion / all median step: {ratio:.3f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
