"""The training loop: micro-steps (autocast, loss, backward) -> clip -> optimizer step.

``train(cfg)`` runs one configured run and returns its result dict (the ``result.json``
contract of docs/architecture.md). It prints nothing itself except an optional progress bar;
the CLI decides what to show.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn as nn

from memtrain.analysis.flops import counted_flops_per_step, rule_flops_per_token
from memtrain.checkpoint import load_checkpoint, save_checkpoint
from memtrain.config import RunConfig
from memtrain.data import make_train_loader, make_val_batches, prepare_tokens
from memtrain.device_advice import mfu_for_run, run_device_facts
from memtrain.logging_sinks import MetricsLogger, live_memory
from memtrain.metrics import MemoryMeter, StepTimer, device_peak_memory, percentile, reset_device_peak
from memtrain.metrics.state import ShardedStateBytes
from memtrain.models import build_model, data_tokenizer
from memtrain.preflight import check_destinations, check_resume, check_vocab
from memtrain.runtime import environment, resolve_device, seed_everything
from memtrain.techniques import Precision, build_optimizer, make_precision, prepare_model
from memtrain.techniques.distributed import DistContext, distributed_session

Batch = tuple[torch.Tensor, torch.Tensor]

# Steps whose memory is tracked (the meter slows a step down, so only these are metered and
# they are also left out of the timing). Step 0 creates the optimizer state; step 1 is the
# steady state whose peak is reported.
METERED_STEPS = (0, 1)


class LossDiverged(RuntimeError):
    """The loss became NaN or infinite: further steps would only train on garbage."""


def lr_lambda(cfg: RunConfig) -> Callable[[int], float]:
    """Linear warm-up to 1, then cosine down to ``min_lr_ratio`` (or constant)."""
    t = cfg.train

    def factor(step: int) -> float:
        if t.warmup_steps and step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        if t.schedule == "constant":
            return 1.0
        decay_steps = max(1, t.steps - t.warmup_steps)
        progress = min(1.0, (step - t.warmup_steps) / decay_steps)
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def train_step(
    model: nn.Module,
    micro_batches: list[Batch],
    optimizer: torch.optim.Optimizer,
    precision: Precision,
    grad_clip: float,
    device: torch.device,
    meter: Optional[MemoryMeter] = None,
    no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
) -> float:
    """One optimizer step over ``len(micro_batches)`` micro-batches; returns the mean loss.

    Each micro-batch loss is scaled by 1/N so the summed gradients equal the gradient of the
    mean loss over the large batch (gradient accumulation). ``no_sync`` (data parallel)
    suppresses the gradient all-reduce on all but the last micro-batch.
    """
    phase = meter.phase if meter is not None else (lambda name: contextlib.nullcontext())
    n = len(micro_batches)
    total = torch.zeros((), device=device)
    scaler = precision.scaler
    for i, (x, y) in enumerate(micro_batches):
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        sync_ctx = no_sync() if (no_sync is not None and i < n - 1) else contextlib.nullcontext()
        with sync_ctx:
            with phase("forward"), precision.autocast():
                loss = model(x, y) / n
            with phase("backward"):
                (scaler.scale(loss) if scaler is not None else loss).backward()
        total += loss.detach()
    with phase("optimizer"):
        if scaler is not None:
            scaler.unscale_(optimizer)
        if grad_clip > 0:
            params = [p for p in model.parameters() if p.grad is not None]
            precision.last_grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
        if scaler is not None:
            scale_before = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            if scaler.get_scale() < scale_before:
                # GradScaler skips the step when it finds inf/nan and lowers the scale.
                precision.skipped_steps += 1
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return float(total)


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[Batch], precision: Precision, device: torch.device) -> float:
    """Mean token loss over the fixed validation batches."""
    was_training = model.training
    model.eval()
    losses, weights = [], []
    for x, y in batches:
        with precision.autocast():
            loss = model(x.to(device), y.to(device))
        losses.append(float(loss))
        weights.append(y.numel())
    model.train(was_training)
    return sum(loss * w for loss, w in zip(losses, weights)) / sum(weights)


@dataclass
class _Progress:
    """A tqdm bar that is silent when disabled."""

    total: int
    initial: int
    enabled: bool
    bar: Any = field(default=None)

    def __post_init__(self) -> None:
        if self.enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.total, initial=self.initial, desc="train", unit="step", dynamic_ncols=True)

    def update(self, loss: float, tokens_per_s: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _micro_batches(it: Iterator[Batch], n: int) -> list[Batch]:
    return [next(it) for _ in range(n)]


def _flops_per_rank_step(cfg: RunConfig, n_params: int) -> tuple[float, str]:
    """Model FLOPs of one optimizer step on one rank, the MFU numerator: the counted
    forward + backward (as ``memtrain flops`` reports them, so both agree), or the 6ND +
    attention rule when the model cannot be traced for counting."""
    try:
        return float(counted_flops_per_step(cfg)["model_flops"]), "counted"
    except Exception:  # noqa: BLE001 - a counting gap must not fail a finished run
        t = cfg.train
        tokens = t.batch_size * t.grad_accum * t.seq_len
        return rule_flops_per_token(cfg.model, t.seq_len, n_params) * tokens, "rule"


# Called after every optimizer step with (steps done, steps in this run, timed-step median so
# far or None while still in the timing warm-up); the bench uses it for its ETA.
StepCallback = Callable[[int, int, Optional[float]], None]


def _optimizer_kernel(optimizer: Any) -> Optional[str]:
    """Which AdamW kernel ran (``--optim adamw`` picks one per device): fused | foreach | for-loop."""
    d = getattr(optimizer, "defaults", {}) or {}
    if "fused" not in d and "foreach" not in d:
        return None
    return "fused" if d.get("fused") else "foreach" if d.get("foreach") else "for-loop"


def train(cfg: RunConfig, progress: Optional[bool] = None, track_memory: bool = True,
          on_result: Optional[Callable[[dict[str, Any]], None]] = None,
          log_metrics: bool = False, on_step: Optional[StepCallback] = None) -> dict[str, Any]:
    """Run one training run as configured; return the result dict.

    Under ``--distributed`` every rank (torchrun process) runs this and gets the result;
    only rank 0 shows progress (see :mod:`memtrain.techniques.distributed`). ``on_result``
    receives the result before the final checkpoint is written (the CLI writes result.json
    there), so a failing final save cannot lose the run's numbers. ``log_metrics`` (the
    ``train`` command) writes ``OUT/metrics.jsonl`` and the ``--report-to`` sinks as steps
    complete; library callers (bench rows, plan's check) leave it off.
    """
    check_destinations(cfg)  # before any step: never a run that cannot write its result
    check_vocab(cfg)
    check_resume(cfg)  # a checkpoint of another run is refused before tokenizing
    with distributed_session(cfg, resolve_device(cfg.train.device)) as dist_ctx:
        return _train(cfg, dist_ctx, progress, track_memory, on_result, log_metrics, on_step)


def _step_scalars(loss: float, scheduler: Any, precision: Precision, tokens_per_s: float,
                  device: torch.device) -> dict[str, Any]:
    """What one metrics.jsonl line holds besides the step number."""
    norm = precision.last_grad_norm
    return {"loss": loss, "lr": scheduler.get_last_lr()[0],
            "grad_norm": float(norm) if norm is not None else None,
            "tokens_per_s": tokens_per_s, **live_memory(device)}


def _train(cfg: RunConfig, dist_ctx: DistContext, progress: Optional[bool], track_memory: bool,
           on_result: Optional[Callable[[dict[str, Any]], None]] = None,
           log_metrics: bool = False, on_step: Optional[StepCallback] = None) -> dict[str, Any]:
    t = cfg.train
    show = (t.progress if progress is None else progress) and dist_ctx.is_main
    device = dist_ctx.device
    seed_everything(t.seed)
    # Distributed runs save a sharded checkpoint directory (torch.distributed.checkpoint).
    save_ckpt, load_ckpt = save_checkpoint, load_checkpoint
    if dist_ctx.enabled:
        # Imported only here: torch.distributed.checkpoint pulls in DTensor and most of a
        # bench row's import time (measured with python -X importtime), for runs that never use it.
        from memtrain.distributed_checkpoint import load_checkpoint as dcp_load, save_checkpoint as dcp_save

        save_ckpt, load_ckpt = dcp_save, dcp_load

    # Techniques first: an impossible combination (a backend the device lacks, an optimizer
    # that cannot pair with the precision) fails in seconds, before a long tokenization.
    precision = make_precision(cfg.technique.precision, device)
    # Probe the device (cached per machine) and warn up front when this precision is slow here.
    caps, device_caps = run_device_facts(cfg.technique.precision, device) if dist_ctx.is_main else (None, None)
    base = build_model(cfg)  # memtrain's GPT, or a transformers model for --model SPEC
    n_params = base.num_parameters()  # type: ignore[operator]  # GPT and HFCausalLM both define it
    model = prepare_model(base, cfg, device, precision)
    model.train()
    optimizer = build_optimizer(model, cfg.technique, t)
    model, optimizer = dist_ctx.wrap_optimizer(model, optimizer)  # ZeRO-1 / DeepSpeed; else unchanged
    if dist_ctx.enabled:  # what this rank holds of the state, the result's ranks[].sharded_state
        dist_ctx.state = ShardedStateBytes(model, optimizer, dist_ctx.local_optimizer or optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))

    # Then data; nothing is written before both succeeded.
    with dist_ctx.main_first():  # rank 0 fills the token cache, the other ranks then read it
        splits = prepare_tokens(cfg.data, progress=show, tokenizer=data_tokenizer(cfg))
    loader = make_train_loader(
        splits.train, t.seq_len, t.batch_size, seed=t.seed,
        num_workers=cfg.data.num_workers, pin_memory=cfg.data.pin_memory,
        prefetch_factor=cfg.data.prefetch_factor, rank=dist_ctx.rank, world_size=dist_ctx.world_size,
    )
    val_batches = make_val_batches(splits.val, t.seq_len, cfg.data.val_blocks, t.batch_size)

    start_step = 0
    losses: list[float] = []
    if t.resume:
        state = load_ckpt(t.resume, model, optimizer, scheduler, loader, precision)
        start_step, losses = state["step"], list(state["losses"])

    tokens_per_step = t.batch_size * t.grad_accum * t.seq_len * dist_ctx.world_size  # global batch
    # Metered steps run slower (the meter sees every op): keep them inside the timing warm-up.
    warmup = max(t.warmup_timing_steps, len(METERED_STEPS) if track_memory else 0)
    timer = StepTimer(device, warmup=min(warmup, max(0, (t.stop_after or t.steps) - start_step - 1)))
    meter = MemoryMeter(model, optimizer) if track_memory else None
    dist_ctx.attach_meter(meter)
    step_fn, no_sync = dist_ctx.train_step or train_step, dist_ctx.no_sync(model)
    reset_device_peak(device)
    end_step = t.stop_after or t.steps
    bar = _Progress(total=end_step, initial=start_step, enabled=show)
    logger = MetricsLogger(t.out, t.report_to, t.log_every, enabled=log_metrics and dist_ctx.is_main,
                           append=bool(t.resume), config=cfg.to_dict())
    batches = iter(loader)
    wall_start = time.perf_counter()
    val_history: list[dict[str, float]] = []
    try:
        for step in range(start_step, end_step):
            metered = meter is not None and (step - start_step) in METERED_STEPS
            with timer.data_wait():
                micro = _micro_batches(batches, t.grad_accum)
            step_start = time.perf_counter()
            with timer.step():
                with meter if metered else contextlib.nullcontext():  # type: ignore[union-attr]  # meter is set whenever metered is true
                    if metered and step - start_step == METERED_STEPS[-1]:
                        meter.reset_peak()  # type: ignore[union-attr]  # meter is set whenever metered is true
                    loss = step_fn(model, micro, optimizer, precision, t.grad_clip, device,
                                   meter if metered else None, no_sync=no_sync)
                loss = dist_ctx.mean(loss)  # the global batch's loss, the same on every rank
                if not math.isfinite(loss):  # the same value on every rank: all stop together
                    raise LossDiverged(f"the training loss became {loss} at step {step + 1}; lower --lr "
                                       f"(now {t.lr:g}) or keep --grad-clip on; checkpoints written before are intact")
                scheduler.step()
            losses.append(loss)
            tokens_per_s = tokens_per_step / max(time.perf_counter() - step_start, 1e-9)
            bar.update(loss, tokens_per_s)
            done = step + 1
            if logger.sinks and (done % logger.every == 0 or done == end_step):
                logger.log(done, _step_scalars(loss, scheduler, precision, tokens_per_s, device), force=True)
            if on_step is not None:
                on_step(done - start_step, end_step - start_step,
                        percentile(timer.step_times, 50) if timer.step_times else None)
            if t.eval_every and done % t.eval_every == 0 and done < end_step:
                v = evaluate(model, val_batches, precision, device)
                val_history.append({"step": done, "val_loss": v, "val_ppl": math.exp(min(v, 50))})
                logger.log(done, val_history[-1], force=True)
            if t.save and t.save_every and done % t.save_every == 0:
                save_ckpt(t.save, model, optimizer, scheduler, loader, precision, done, losses, cfg)
    except BaseException:
        logger.close()
        raise
    finally:
        bar.close()
    total_time = time.perf_counter() - wall_start

    val_loss = evaluate(model, val_batches, precision, device)
    logger.log(end_step, {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50))}, force=True)
    logger.close()

    stats = timer.summary().to_dict()
    tail = losses[-min(10, len(losses)):] if losses else [float("nan")]
    memory: dict[str, Any] = {"peak_bytes": None, "by_category": None}
    if meter is not None and len(losses) > 0:
        memory.update(meter.stats().to_dict())
    memory.update(device_peak_memory(device))
    flops_per_rank_step, flops_source = _flops_per_rank_step(cfg, n_params)
    median = stats["median"]
    run_mfu, mfu_reference = mfu_for_run(flops_per_rank_step, median, device, cfg.technique.precision, caps)
    result: dict[str, Any] = {
        "config": cfg.to_dict(),
        "train_loss": sum(tail) / len(tail),
        "val_loss": val_loss,
        "val_ppl": math.exp(min(val_loss, 50)),
        "steps": end_step,
        "steps_run": end_step - start_step,
        "stopped_early": end_step < t.steps,
        "tokens": tokens_per_step * end_step,
        "step_time_s": {k: stats[k] for k in ("median", "p10", "p90", "mean")},
        "data_wait_share": stats.get("data_wait_share"),
        "total_time_s": total_time,
        "tokens_per_s": tokens_per_step / median if median else None,
        "mfu": run_mfu,
        "mfu_reference": mfu_reference,
        "optimizer_kernel": _optimizer_kernel(optimizer),  # CUDA: datasheet peak; CPU: the GEMM rate measured here
        "device_caps": device_caps,
        "flops_per_step": flops_per_rank_step,
        "flops_source": flops_source,
        "memory": memory,
        "parameters": n_params,
        "trainable_parameters": sum(p.numel() for p in {id(p): p for p in model.parameters() if p.requires_grad}.values()),
        "loss_history": losses,
        "val_history": val_history,
        "skipped_steps": precision.skipped_steps,
        "data": {
            "train_tokens": int(len(splits.train)),
            "val_tokens": int(len(splits.val)),
            "train_documents": splits.n_train_docs,
            "val_documents": splits.n_val_docs,
            "from_cache": splits.from_cache,
            "tokenize_tokens_per_s": splits.tokens_per_s,
        },
        "env": environment(device),
    }
    result.update(dist_ctx.result_fields(memory))  # distributed: "ranks" (memory per rank), "distributed"
    if on_result is not None:
        on_result(result)
    if t.save:  # after the result is out: a full disk here loses no numbers
        save_ckpt(t.save, model, optimizer, scheduler, loader, precision, end_step, losses, cfg)
    return result
