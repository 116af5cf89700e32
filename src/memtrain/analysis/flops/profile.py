"""Measured seconds per operation class: ``memtrain flops --profile``.

Beside :mod:`memtrain.analysis.flops` (which counts) because this one trains: it builds and
steps the configured run with the step harness (:mod:`memtrain.training.step`), so it sits above the
step while the counting that the train loop needs for MFU sits below it (no import circle
between the two).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Iterator

# The op-class recorder is shared with the counter so that profiled time and counted FLOPs
# use the same classes; it stays private to the flops modules.
from memtrain.analysis.flops.recorder import make_recorder
from memtrain.config.run import ConfigError, RunConfig

__all__ = ["profile_op_classes"]


def profile_op_classes(cfg: RunConfig, steps: int = 5, warmup: int = 3) -> dict[str, float]:
    """Measured seconds per optimizer step spent in each operation class, on ``cfg.train.device``.

    The configured model trains on random tokens for ``warmup`` steps, then ``steps`` steps run
    under ``torch.profiler`` with the recorder of :func:`count_step` active, which wraps every
    aten op in a profiler range ``mt::<class>`` (the optimizer step gets one range). On CUDA a
    class's time is the summed duration of the GPU kernels launched inside its ranges (CUPTI
    timestamps, unaffected by the recorder's Python overhead, which only delays launches). On
    CPU it is the CPU time of the ops inside the ranges; it proves the attribution, but a CPU
    has no roof here, so ``memtrain flops --profile`` asks for a GPU.

    The math backend's two attention matmuls run as one op inside one module, so their time is
    split evenly, as their FLOPs and bytes are (see ``memtrain.analysis.flops.classes.split_attention``); identical shapes
    make equal kernel times likely, not certain.
    """
    # torch loads only when this runs: the CLI's start-up and the analytic commands import this module
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function
    from torch.utils.module_tracker import ModuleTracker

    from memtrain.metrics import synchronize  # torch loads only when this runs
    from memtrain.runtime.env import resolve_device, seed_everything  # torch loads only when this runs
    from memtrain.training.step import build_state, random_micro_batches, run_step  # torch loads only when this runs

    if steps <= 0 or warmup < 0:
        raise ConfigError(f"--profile-steps must be positive, got {steps}")
    t = cfg.train
    device = resolve_device(t.device)
    seed_everything(t.seed)
    state = build_state(cfg, device)
    micro = random_micro_batches(cfg, t.batch_size, device, torch.Generator().manual_seed(t.seed))
    for _ in range(warmup):
        run_step(state, micro)
    synchronize(device)

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    tracker = ModuleTracker()
    recorder = make_recorder(state.model, tracker, {}, cfg.model.padded_vocab_size, profile=True)

    @contextlib.contextmanager
    def classes() -> Iterator[None]:  # each micro-batch's forward + backward, op by op
        with tracker, recorder:
            yield

    with profile(activities=activities) as prof:
        for _ in range(steps):
            run_step(state, micro, micro_context=classes,
                     optimizer_context=lambda: record_function("mt::optimizer"))
        synchronize(device)

    micros: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if not ev.name.startswith("mt::"):
            continue
        if cuda:
            micros[ev.name[4:]] += ev.device_time_total
        else:
            micros[ev.name[4:]] += sum(ch.cpu_time_total for ch in ev.cpu_children)
    seconds = {k: v / steps / 1e6 for k, v in micros.items()}
    core = seconds.pop("attn_core", None)
    if core is not None:
        for name in ("attn_scores", "attn_values"):
            seconds[name] = seconds.get(name, 0.0) + core / 2
    return seconds
