"""The step harness: build a run into one train-state value, then run training steps on it.

Every caller that trains goes through here, so a model family, a technique or a precision
behaves the same in all of them: ``memtrain train`` (:mod:`memtrain.training.train`), the max-batch
probe (:func:`memtrain.analysis.maxbatch.measure_step_memory`), the fake-tensor tracer
(:func:`memtrain.analysis.trace.trace_step`), the op-class profiler
(:func:`memtrain.analysis.flops.profile.profile_op_classes`), plan verification (through ``train``) and
both checkpoint backends (which save and restore a :class:`TrainState`).

Public API (stable; scripts such as ``benchmarks/compare_hf.py`` may build on it):

``build_state(cfg, device, precision=None, *, dist_ctx=None, base=None, schedule=False,
prepare_context=None) -> TrainState``
    The model (through the one model seam, :func:`memtrain.models.build_model`: memtrain's
    GPT or a transformers model), the techniques applied in their one order
    (:func:`memtrain.techniques.prepare_model`), training mode, the optimizer
    (:func:`memtrain.techniques.build_optimizer`), the distributed optimizer wrap (ZeRO-1,
    DeepSpeed) and, with ``schedule``, the LR schedule (:func:`lr_lambda`). Seeding is the
    caller's: ``train`` seeds before probing the device, the tracer never seeds.
``build_base_model(cfg, device, precision) -> nn.Module``
    The untouched model, created directly on ``device`` in the run's weight dtype
    (:func:`building_on`): no full-precision copy on the host first.
``TrainState``
    One run's training state: config, device, model, optimizer, precision (autocast, loss
    scaler, skipped steps), scheduler, data loader, step counter, loss history, and the step
    function and no-sync context the distributed wrap chose.
``train_step(model, micro_batches, optimizer, precision, grad_clip, device, meter=None,
no_sync=None, micro_context=None, optimizer_context=None, forward_context=None,
before_wait=None) -> float``
    One optimizer step: micro-batch loop (autocast, loss / N or, for :class:`memtrain.data.loader.MicroBatches`
    with target counts, the loss times its share of the step's targets instead; scaled backward) -> unscale ->
    clip -> step (skipped-step count under a GradScaler) -> zero_grad, with the meter's
    phases. ``micro_context`` / ``optimizer_context`` wrap each micro-batch's forward+backward
    and the optimizer phase (the profiler's op-class ranges); ``forward_context`` each forward
    (``--offload-activations``' saved-tensor hooks, from ``TrainState.offload``);
    ``before_wait`` runs once the step's work is queued, before the host waits for its loss
    (the loop fetches the next batch there: :meth:`memtrain.data.device_feed.DeviceFeed.prefetch`).
``queue_step(...) -> Tensor``
    ``train_step`` without the read: the step queued, its mean loss a 0-d tensor on the device
    (the loop reads the losses of the steps since its last read together, once per metrics line,
    evaluation, checkpoint or ``READ_EVERY_MAX`` steps, after queueing the next step:
    :mod:`memtrain.training.readings`).
``run_step(state, micro_batches, meter=None, *, before_wait=None, **contexts) -> float``
    ``train_step`` (or the distributed wrap's replacement) on ``state``.
``queue_run_step(state, micro_batches, **contexts) -> Tensor``
    ``queue_step`` on ``state`` (single-process runs only).
``measure_steps(state, make_micro, steps=2, meter=None) -> None``
    ``steps`` steps with the meter's and the device's peak reset before the last one (the
    steady state: the first step creates the optimizer state).
``random_micro_batches(cfg, batch, device, generator=None)``
    ``grad_accum`` micro-batches of random token ids (memory and FLOPs do not depend on them).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch
import torch.nn as nn

from memtrain.analysis.flops.rules import model_rule_params
from memtrain.config.run import RunConfig
from memtrain.metrics import MemoryMeter, reset_device_peak
from memtrain.models.families import build_model
from memtrain.techniques import Precision, build_optimizer, make_precision, prepare_model
from memtrain.techniques.offload import offloader_for
from memtrain.training.schedule import lr_lambda
from memtrain.training.size_check import check_model_size

__all__ = [
    "Batch", "TrainState", "build_base_model", "build_state", "building_on", "lr_lambda", "measure_steps", "queue_run_step",
    "queue_step", "random_micro_batches", "run_step", "train_step",
]

Batch = tuple[torch.Tensor, torch.Tensor]
ContextFactory = Callable[[], ContextManager[Any]]


@contextlib.contextmanager
def building_on(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """Tensors created inside are made on ``device`` in ``dtype`` (a floating dtype).

    Building a model on the host in FP32 and then moving it costs twice the weight bytes of
    host memory and a full copy: an 8B model took minutes to build that way before its first
    step on a GPU, where transformers' own ``from_config`` under a device context takes under a
    second. torch's device context makes every factory call allocate on ``device``; the default
    dtype makes parameters start in the weight dtype (BF16 for ``bf16-pure``, else FP32).
    """
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def build_base_model(cfg: RunConfig, device: torch.device, precision: Precision) -> nn.Module:
    """``cfg``'s model, before any technique, built on ``device`` in ``precision``'s weight dtype."""
    with building_on(device, precision.param_dtype):
        return build_model(cfg)  # memtrain's GPT, or a transformers model for --model SPEC


# Each model's trainable parameters, listed once (see _trainable_parameters).
_TRAINABLE: "weakref.WeakKeyDictionary[nn.Module, list[nn.Parameter]]" = weakref.WeakKeyDictionary()


def _trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """``model``'s parameters that require a gradient, in ``model.parameters()``'s order, walked
    once per model: ``parameters()`` visits every submodule, and a peft-wrapped 32-layer model has
    thousands (8.4 ms a walk on 2 CPU cores, every step; docs/performance.md, "Host work per step").
    Which parameters train does not change during a run."""
    params = _TRAINABLE.get(model)
    if params is None:
        params = _TRAINABLE[model] = [p for p in model.parameters() if p.requires_grad]
    return params


def _optimizer_phase(model: nn.Module, optimizer: torch.optim.Optimizer, precision: Precision,
                     grad_clip: float) -> None:
    """Unscale -> clip -> step -> zero_grad; a GradScaler's skipped step is counted."""
    scaler = precision.scaler
    if scaler is not None:
        scaler.unscale_(optimizer)
    if grad_clip > 0:
        # Only a parameter that requires a gradient can have one.
        params = [p for p in _trainable_parameters(model) if p.grad is not None]
        precision.last_grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    if scaler is not None:
        scaler.step(optimizer)
        found_inf = _found_inf(scaler, optimizer)  # before update(), which forgets it
        if found_inf is not None:
            precision.count_skipped(found_inf)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> Optional[torch.Tensor]:
    """Whether GradScaler skipped this step, as the 0-d device flag its ``unscale_`` found
    (1.0: an inf or NaN gradient); None when the scaler is off.

    The flag is read from the scaler's per-optimizer state (no public accessor): a skipped step
    counted from it costs no host read, and one kernel (:meth:`Precision.count_skipped`'s add),
    where comparing the scale before and after ``update()`` cost four (a copy of the scale, the
    comparison, a cast and the add). torch's ``GradScaler.step`` itself reads this flag on the
    host (``.item()``) before a for-loop or foreach optimizer's step, and hands it to a fused one
    on the device; memtrain reads it nowhere (tests/test_step_syncs.py)."""
    # A disabled scaler (enabled=False) keeps no per-optimizer state at all.
    state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer), {})
    flags = list(state.get("found_inf_per_device", {}).values())
    if not flags:
        return None
    if len(flags) == 1:
        return flags[0]
    return sum(f.to(flags[0].device) for f in flags) > 0  # a model over devices: skipped if any saw one


def queue_step(
    model: nn.Module,
    micro_batches: list[Batch],
    optimizer: torch.optim.Optimizer,
    precision: Precision,
    grad_clip: float,
    device: torch.device,
    meter: Optional[MemoryMeter] = None,
    no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
    micro_context: Optional[ContextFactory] = None,
    optimizer_context: Optional[ContextFactory] = None,
    forward_context: Optional[ContextFactory] = None,
) -> torch.Tensor:
    """One optimizer step over ``len(micro_batches)`` micro-batches, queued on ``device``;
    returns the mean loss as a 0-d tensor there, not read (see :func:`train_step`).

    Each micro-batch loss is scaled by 1/N so the summed gradients equal the gradient of the
    mean loss over the large batch (gradient accumulation); micro-batches that carry their
    target counts (:class:`memtrain.data.loader.MicroBatches`, --loss-on completion) by their
    share of the step's targets instead, so the mean is over every answer token of the step. ``no_sync`` (data parallel)
    suppresses the gradient all-reduce on all but the last micro-batch. ``forward_context``
    wraps each forward alone (activation offloading's saved-tensor hooks).
    """
    phase = meter.phase if meter is not None else (lambda name: contextlib.nullcontext())
    around_micro = micro_context or contextlib.nullcontext
    around_forward = forward_context or contextlib.nullcontext
    n = len(micro_batches)
    total: Optional[torch.Tensor] = None
    scaler = precision.scaler
    # --loss-on completion: each micro-batch weighted by its share of the step's answer tokens
    # (MicroBatches.loss_scales); otherwise 1/N, as ever.
    # Read by name, not isinstance: importing memtrain.data here would pull the tokenizers (tiktoken)
    # into every traced estimate, which needs no data.
    loss_scales = getattr(micro_batches, "loss_scales", None)
    scales = loss_scales(device) if loss_scales is not None else None
    for i, (x, y) in enumerate(micro_batches):
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        sync_ctx = no_sync() if (no_sync is not None and i < n - 1) else contextlib.nullcontext()
        with sync_ctx, around_micro():
            with phase("forward"), precision.autocast(), around_forward():
                loss = _weighted(model(x, y), n, None if scales is None else scales[i])
            with phase("backward"):
                (scaler.scale(loss) if scaler is not None else loss).backward()
        total = _add_loss(total, loss, n)
    with phase("optimizer"), (optimizer_context or contextlib.nullcontext)():
        _optimizer_phase(model, optimizer, precision, grad_clip)
    return total if total is not None else torch.zeros((), device=device)  # no micro-batch: no loss


def _add_loss(total: Optional[torch.Tensor], loss: torch.Tensor, n: int) -> torch.Tensor:
    """The step's loss so far plus a micro-batch's ``loss``, in float32 (as ``float(loss)`` reads).

    A step of one micro-batch returns its loss itself: a zero-filled total and an add were two
    more kernels a step on a GPU (tests/test_step_overhead.py lists what a step adds to a plain
    loop). Under accumulation the first loss is copied into a total of its own, which later ones
    are added to in place: from the second micro-batch on each then holds the same tensors as the
    one before, which the traced estimate's cap on micro-batches relies on
    (memtrain.analysis.trace.TRACED_MICRO_BATCHES)."""
    if total is None and n == 1:
        return loss.detach().float()  # the loss itself when it is float32 already
    if total is None:
        return loss.detach().to(torch.float32, copy=True)
    return total.add_(loss.detach())


def _weighted(loss: torch.Tensor, n: int, scale: Optional[torch.Tensor]) -> torch.Tensor:
    """A micro-batch's share of the step's mean loss: times its share of the step's targets
    (``scale``), else 1/``n``. A step of one micro-batch is its loss as it is: ``loss / 1`` is
    exact, and costs a kernel in the forward and another in the backward on a GPU."""
    if scale is not None:
        return loss * scale
    return loss / n if n > 1 else loss


def train_step(
    model: nn.Module,
    micro_batches: list[Batch],
    optimizer: torch.optim.Optimizer,
    precision: Precision,
    grad_clip: float,
    device: torch.device,
    meter: Optional[MemoryMeter] = None,
    no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
    micro_context: Optional[ContextFactory] = None,
    optimizer_context: Optional[ContextFactory] = None,
    forward_context: Optional[ContextFactory] = None,
    before_wait: Optional[Callable[[], None]] = None,
) -> float:
    """One optimizer step (:func:`queue_step`); returns the mean loss, read by the host.

    ``before_wait`` is called after the optimizer step is queued and before the loss is read:
    on a GPU the host would otherwise sit idle there until the device finishes the step.
    """
    total = queue_step(model, micro_batches, optimizer, precision, grad_clip, device, meter, no_sync,
                       micro_context, optimizer_context, forward_context)
    if before_wait is not None:
        before_wait()
    return float(total)  # the host waits for the device here


StepFn = Callable[..., float]


@dataclass
class TrainState:
    """Everything one run trains with; what a checkpoint saves and a resume restores."""

    cfg: RunConfig
    device: torch.device
    model: nn.Module  # the module to train: the prepared model or its distributed wrapper
    optimizer: torch.optim.Optimizer
    precision: Precision  # autocast, loss scaler, skipped-step count, last gradient norm
    n_params: int  # parameters of the model as built (before LoRA adds adapters)
    # Parameters the 6ND rule drops: its learned position table (GPT's wpe; none in a rotary
    # model) and a mixture-of-experts model's experts a token does not meet (RuleParams): the
    # MFU numerator where a step cannot be counted. None: by the config.
    rule_dropped_params: Optional[int] = None
    scheduler: Any = None  # LambdaLR over lr_lambda(cfg), when the run schedules its LR
    loader: Any = None  # the resumable data loader (its position is checkpointed)
    step: int = 0  # optimizer steps completed
    # SHA-256 of the training data's content (memtrain.data.sources.data_fingerprint), saved in
    # checkpoints so that --resume refuses other data at the same path; None when unknown.
    data_fingerprint: Optional[str] = None
    # A transformers --model's config.json fields (memtrain.models.identity), saved in checkpoints
    # so that --resume compares the model by content, not path; None for memtrain's GPT.
    model_config: Optional[dict[str, Any]] = None
    losses: list[float] = field(default_factory=list)  # one training loss per completed step
    # The evaluations so far (--eval-every): {"step", "val_loss", "val_ppl"} each. Checkpointed,
    # so that a resumed run's result.json lists those before the interruption too.
    val_history: list[dict[str, float]] = field(default_factory=list)
    # The step function and the data-parallel no-sync context the distributed wrap chose
    # (DeepSpeed drives its engine with its own step; DDP/FSDP skip all-reduces on accumulation).
    step_fn: StepFn = train_step
    no_sync: Optional[Callable[[], contextlib.AbstractContextManager]] = None
    # --offload-activations: the saved-tensor hooks each forward runs under, and what they moved
    # (memtrain.techniques.offload.ActivationOffloader); None when off.
    offload: Any = None

    @property
    def trainable_parameters(self) -> int:
        """Trainable parameters of the prepared model (tied weights counted once)."""
        unique = {id(p): p for p in self.model.parameters() if p.requires_grad}
        return sum(p.numel() for p in unique.values())


def build_state(cfg: RunConfig, device: torch.device, precision: Optional[Precision] = None, *,
                dist_ctx: Any = None, base: Optional[nn.Module] = None, schedule: bool = False,
                prepare_context: Optional[ContextFactory] = None) -> TrainState:
    """Build ``cfg``'s run on ``device`` into a :class:`TrainState` (see the module docstring).

    ``base``: an already built model (the tracer builds it on fake tensors); otherwise it is
    built here through :func:`memtrain.models.build_model`, the one seam a model family plugs
    into. ``prepare_context`` wraps the technique pass (the tracer's fake-safe ``Module.to``).
    ``dist_ctx`` (:class:`memtrain.distributed.session.DistContext`) wraps the optimizer and
    supplies the step function and no-sync context.
    """
    if precision is None:
        precision = make_precision(cfg.technique.precision, device)
    if base is None:
        check_model_size(cfg.model, device, cfg.technique.precision)  # a shape that cannot be built, refused before building
        base = build_base_model(cfg, device, precision)
    n_params = base.num_parameters()  # type: ignore[operator]  # GPT and HFCausalLM both define it
    with (prepare_context or contextlib.nullcontext)():
        model = prepare_model(base, cfg, device, precision)
    model.train()
    optimizer = build_optimizer(model, cfg.technique, cfg.train)
    rule = model_rule_params(base)
    state = TrainState(cfg, device, model, optimizer, precision, n_params, rule.positions + rule.inactive_experts)
    if dist_ctx is not None:
        state.model, state.optimizer = dist_ctx.wrap_optimizer(model, optimizer)  # ZeRO-1 / DeepSpeed
        state.step_fn = dist_ctx.train_step or train_step
        state.no_sync = dist_ctx.no_sync(state.model)
    state.offload = offloader_for(cfg, state.model, device)
    if schedule:
        state.scheduler = torch.optim.lr_scheduler.LambdaLR(state.optimizer, lr_lambda(cfg))
    return state


def _step_options(state: TrainState, contexts: dict[str, Optional[ContextFactory]]) -> dict[str, Any]:
    """The keyword arguments of ``state``'s step function besides the batches and the meter."""
    extra: dict[str, Any] = {k: v for k, v in contexts.items() if v is not None}
    if state.offload is not None:
        state.offload.reset_counts()  # the counts describe the last step
        extra["forward_context"] = state.offload.forward
    return extra


def run_step(state: TrainState, micro_batches: list[Batch], meter: Optional[MemoryMeter] = None,
             *, before_wait: Optional[Callable[[], None]] = None, **contexts: Optional[ContextFactory]) -> float:
    """One optimizer step of ``state`` (see :func:`train_step`); returns the mean loss.
    ``contexts`` (``micro_context``, ``optimizer_context``) reach :func:`train_step` only."""
    extra = _step_options(state, contexts)
    if before_wait is not None:
        extra["before_wait"] = before_wait
    return state.step_fn(state.model, micro_batches, state.optimizer, state.precision,
                         state.cfg.train.grad_clip, state.device, meter, no_sync=state.no_sync, **extra)


def queue_run_step(state: TrainState, micro_batches: list[Batch], **contexts: Optional[ContextFactory]) -> torch.Tensor:
    """One optimizer step of ``state`` queued, its mean loss left on the device
    (:func:`queue_step`). Only for the single-process step: a distributed wrap's own step
    function reads its loss itself."""
    if state.step_fn is not train_step:
        raise ValueError("queue_run_step needs the single-process step; this run's step function reads its loss itself")
    return queue_step(state.model, micro_batches, state.optimizer, state.precision, state.cfg.train.grad_clip,
                      state.device, None, state.no_sync, **_step_options(state, contexts))


def measure_steps(state: TrainState, make_micro: Callable[[], list[Batch]], steps: int = 2,
                  meter: Optional[MemoryMeter] = None, **contexts: Optional[ContextFactory]) -> None:
    """Run ``steps`` steps under ``meter``, its peak and the device's reset before the last
    (the steady state: the first step creates the optimizer state). ``make_micro`` gives each
    step's micro-batches, made outside the meter as a data loader would. ``contexts`` reach
    :func:`run_step`."""
    for i in range(steps):
        micro = make_micro()
        with meter if meter is not None else contextlib.nullcontext():
            if i == steps - 1:
                if meter is not None:
                    meter.reset_peak()
                reset_device_peak(state.device)
            run_step(state, micro, meter, before_wait=None, **contexts)


def random_micro_batches(cfg: RunConfig, batch: int, device: torch.device,
                         generator: Optional[torch.Generator] = None) -> list[Batch]:
    """``grad_accum`` micro-batches of ``batch`` random sequences (inputs, targets), on ``device``.

    Memory and FLOPs do not depend on token values, so random ids stand in for data. With a
    ``generator`` the ids are drawn on the CPU and moved (reproducible, and the global RNG is
    left alone); without one they are drawn on ``device`` (fake tensors draw nothing)."""
    shape = (batch, cfg.train.seq_len)
    v = cfg.model.vocab_size
    if generator is None:
        return [(torch.randint(0, v, shape, device=device), torch.randint(0, v, shape, device=device))
                for _ in range(cfg.train.grad_accum)]
    out = []
    for _ in range(cfg.train.grad_accum):
        x = torch.randint(0, v, shape, generator=generator)
        y = torch.randint(0, v, shape, generator=generator)
        out.append((x.to(device), y.to(device)))
    return out
