"""What `--memory-by-module` costs: a metered step and a traced step, with and without the table.

    python benchmarks/memory_by_module_overhead.py [--repeats 5] [--d-model 256 --n-layers 8 ...]

The metered step (the two steps `memtrain train` meters, tracked meter on, real CPU tensors)
and the trace (`memtrain estimate --memory-by-module`: the same two steps under fake tensors)
are timed with the module table off and on, alternating, ``--repeats`` times each; the
minimum of each is printed with the ratio. Steps that are not metered install no hook in
either case, so the rest of a run is unchanged. Any config flag of `memtrain estimate` may
be given (`--checkpointing full`, `--model PATH`, ...).
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from memtrain.analysis.trace import trace_step
from memtrain.cli import add_config_flags, config_from_args
from memtrain.metrics import MemoryMeter
from memtrain.training.step import build_state, measure_steps, random_micro_batches

DEFAULTS = {"d_model": 256, "n_heads": 4, "n_layers": 8, "d_ff": 1024, "seq_len": 256, "max_seq_len": 256,
            "batch_size": 4, "dropout": 0.0}


def metered_seconds(cfg, by_module: bool) -> float:
    """Seconds of two metered training steps on the CPU (model and optimizer built before)."""
    device = torch.device("cpu")
    torch.manual_seed(0)
    state = build_state(cfg, device)
    meter = MemoryMeter(state.model, state.optimizer, by_module=by_module)
    generator = torch.Generator().manual_seed(0)
    gc.collect()  # the previous measurement's garbage is not this one's cost
    start = time.perf_counter()
    measure_steps(state, lambda: random_micro_batches(cfg, cfg.train.batch_size, device, generator), meter=meter)
    return time.perf_counter() - start


def traced_seconds(cfg) -> float:
    gc.collect()
    start = time.perf_counter()
    trace_step(cfg, "cpu")
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    add_config_flags(p, ("model", "technique", "train"))
    args = p.parse_args()
    cfg = config_from_args(args, base=DEFAULTS)
    on, off = cfg.replace(memory_by_module=True), cfg.replace(memory_by_module=False)
    times: dict[str, list[float]] = {k: [] for k in ("metered off", "metered on", "traced off", "traced on")}
    metered_seconds(off, False)  # warm-up: imports, first kernels
    for _ in range(args.repeats):
        times["metered off"].append(metered_seconds(off, False))
        times["metered on"].append(metered_seconds(on, True))
        times["traced off"].append(traced_seconds(off))
        times["traced on"].append(traced_seconds(on))
    best = {k: min(v) for k, v in times.items()}
    m, t = cfg.model, cfg.train
    print(f"GPT d_model {m.d_model}, {m.n_layers} layers, batch {t.batch_size} x seq {t.seq_len}, "
          f"{cfg.technique.checkpointing} checkpointing; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"min of {args.repeats}")
    for kind in ("metered", "traced"):
        a, b = best[f"{kind} off"], best[f"{kind} on"]
        print(f"  {kind:8s} two steps: {a:.3f} s without the table, {b:.3f} s with it ({b / a - 1:+.0%})")


if __name__ == "__main__":
    main()
