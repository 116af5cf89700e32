"""Measured seconds per operation class: ``memtrain flops --profile``.

Beside :mod:`memtrain.analysis.flops` (which counts) because this one trains: it runs the configured
model with :func:`memtrain.train.train_step`, so it sits above the step while the counting
that the train loop needs for MFU sits below it (no import circle between the two).
"""

from __future__ import annotations

from collections import defaultdict

# The op-class recorder is shared with the counter so that profiled time and counted FLOPs
# use the same classes; it stays private to the flops modules.
from memtrain.analysis.flops.recorder import _make_recorder
from memtrain.config import ConfigError, RunConfig

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
    split evenly, as their FLOPs and bytes are (see ``_split_attention``); identical shapes
    make equal kernel times likely, not certain.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function
    from torch.utils.module_tracker import ModuleTracker

    from memtrain.metrics import synchronize
    from memtrain.model import GPT
    from memtrain.runtime import resolve_device, seed_everything
    from memtrain.techniques import build_optimizer, make_precision, prepare_model
    from memtrain.train import train_step

    if steps <= 0 or warmup < 0:
        raise ConfigError(f"--profile-steps must be positive, got {steps}")
    t = cfg.train
    device = resolve_device(t.device)
    seed_everything(t.seed)
    precision = make_precision(cfg.technique.precision, device)
    model = prepare_model(GPT(cfg.model), cfg, device, precision)
    model.train()
    optimizer = build_optimizer(model, cfg.technique, t)
    gen = torch.Generator().manual_seed(t.seed)
    micro = [tuple(torch.randint(0, cfg.model.vocab_size, (t.batch_size, t.seq_len), generator=gen).to(device)
                   for _ in range(2)) for _ in range(t.grad_accum)]
    for _ in range(warmup):
        train_step(model, micro, optimizer, precision, t.grad_clip, device)  # type: ignore[arg-type]  # each tuple is (inputs, targets): range(2)
    synchronize(device)

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    tracker = ModuleTracker()
    recorder = _make_recorder(model, tracker, {}, cfg.model.padded_vocab_size, profile=True)
    scaler = precision.scaler
    with profile(activities=activities) as prof:
        for _ in range(steps):
            with tracker, recorder:
                for x, y in micro:
                    with precision.autocast():
                        loss = model(x, y) / len(micro)
                    (scaler.scale(loss) if scaler is not None else loss).backward()
            with record_function("mt::optimizer"):
                if scaler is not None:
                    scaler.unscale_(optimizer)
                if t.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], t.grad_clip)
                if scaler is not None:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
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
