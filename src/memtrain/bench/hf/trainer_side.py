"""The Hugging Face side: ``transformers.Trainer`` (+ ``peft`` for LoRA rows) on the same
model, tokens and schedule, metered by memtrain's own meters through Trainer callbacks."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import tempfile
import time
from typing import Any, Callable, Optional

import torch

from memtrain.bench.hf.data import hf_train_dataset
from memtrain.bench.hf.hf_model import apply_hf_lora, build_hf_model
from memtrain.bench.hf.lockstep import BATON, STEP_WINDOWS
from memtrain.bench.hf.mapping import HFPlan, hf_plan
from memtrain.config.run import ConfigError, RunConfig
from memtrain.devices.tf32 import align_legacy_with_new


def training_arguments(cfg: RunConfig, plan: HFPlan, output_dir: str, device: torch.device) -> Any:
    """``TrainingArguments`` with memtrain's loop settings and the plan's technique settings."""
    from transformers import TrainingArguments

    t = cfg.train
    kwargs: dict[str, Any] = dict(
        output_dir=output_dir,
        max_steps=t.steps,
        per_device_train_batch_size=t.batch_size,
        gradient_accumulation_steps=t.grad_accum,
        learning_rate=t.lr,
        weight_decay=t.weight_decay,
        adam_beta1=t.beta1,
        adam_beta2=t.beta2,
        adam_epsilon=1e-8,
        max_grad_norm=t.grad_clip,
        # The Trainer's linear decays to 0: the same schedule where --min-lr-ratio is 0 (--lr_scheduler_type linear).
        lr_scheduler_type={"cosine": "cosine_with_min_lr", "linear": "linear"}.get(t.schedule, "constant_with_warmup"),
        lr_scheduler_kwargs={"min_lr_rate": t.min_lr_ratio} if t.schedule == "cosine" else {},
        warmup_steps=t.warmup_steps,
        seed=t.seed,
        train_sampling_strategy="sequential",
        remove_unused_columns=False,  # keep shift_labels (forward takes it through **kwargs)
        dataloader_num_workers=cfg.data.num_workers,
        dataloader_pin_memory=cfg.data.pin_memory,
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=device.type == "cpu",
    )
    kwargs.update(plan.training_args)
    args = TrainingArguments(**_checkpointing_for_installed(kwargs, TrainingArguments))
    # On CUDA it has just set TF32 through torch's new API only (tf32=..., or torch_compile with
    # bf16): the legacy readers, which inductor's max-autotune uses, would raise from here on.
    align_legacy_with_new()
    return args


def _checkpointing_for_installed(kwargs: dict[str, Any], arguments_class: type) -> dict[str, Any]:
    """The plan's ``activation_checkpointing*`` keys under the names the installed transformers
    takes: releases before the rename (5.17 on the GPU image, say) know only
    ``gradient_checkpointing*``, and have no ``every_n_layers``."""
    if "activation_checkpointing" not in kwargs or any(
            f.name == "activation_checkpointing" for f in dataclasses.fields(arguments_class)):
        return kwargs
    out = dict(kwargs)
    out["gradient_checkpointing"] = out.pop("activation_checkpointing")
    ck = dict(out.pop("activation_checkpointing_kwargs", None) or {})
    if ck.pop("every_n_layers", 1) != 1:
        raise ConfigError("checkpointing every k layers: this transformers' Trainer checkpoints every layer or none "
                          "(activation_checkpointing's every_n_layers came later); upgrade transformers or "
                          "use --checkpointing full")
    out["gradient_checkpointing_kwargs"] = ck
    return out


def checkpointing_of(args: Any) -> tuple[bool, dict[str, Any]]:
    """Whether ``TrainingArguments`` ask for activation checkpointing, and its kwargs, under either
    transformers' names (``activation_checkpointing`` or the older ``gradient_checkpointing``)."""
    if hasattr(args, "activation_checkpointing"):
        return bool(args.activation_checkpointing), dict(args.activation_checkpointing_kwargs or {})
    return bool(args.gradient_checkpointing), dict(args.gradient_checkpointing_kwargs or {})


def enable_checkpointing(model: Any, kwargs: dict[str, Any]) -> None:
    """``model``'s layers checkpointed as ``Trainer.train`` does it for these kwargs."""
    kw = dict(kwargs)
    every = kw.pop("every_n_layers", 1)
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw or None, every_n_layers=every)
    else:  # transformers before the rename: every layer only (training_arguments refused every k)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw or None)


def make_hf_optimizer(model: torch.nn.Module, args: Any) -> torch.optim.Optimizer:
    """The optimizer ``Trainer.create_optimizer`` builds for ``args`` (same groups, same class)."""
    from transformers import Trainer

    # get_decay_parameter_names reads only the model; calling it unbound keeps the Trainer's rule.
    decay = set(Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)  # type: ignore[arg-type]  # peft's PeftModel too, as the Trainer passes it
    return cls(groups, **kwargs)


# ============================================================================ metering
class StepMeter:
    """The Trainer side of memtrain's step metering, driven by callbacks.

    The meter and the timer are entered at ``on_step_begin`` and left at ``on_step_end``, the
    same window memtrain meters (the batch is already fetched; optimizer step, scheduler step
    and zero_grad inside). Phases: forward (``compute_loss``, the loss included as in memtrain),
    backward (from the end of ``compute_loss``; gradient clipping falls here, memtrain counts it
    in its optimizer phase) and optimizer (from ``on_pre_optimizer_step``).
    """

    def __init__(self, device: torch.device, steps: int, warmup_timing_steps: int, track_memory: bool = True) -> None:
        # on this side's turn: the package imports no torch before the lockstep baton
        from memtrain.metrics import StepTimer

        # on this side's turn: the package imports no torch before the lockstep baton
        from memtrain.training.train import METERED_STEPS

        self.device = device
        self.metered_steps: tuple[int, ...] = METERED_STEPS if track_memory else ()
        warmup = max(warmup_timing_steps, len(self.metered_steps))
        self.timer = StepTimer(device, warmup=min(warmup, max(0, steps - 1)))
        self.meter: Any = None
        self.step = 0
        self.step_losses: list[torch.Tensor] = []
        self._micro_losses: list[torch.Tensor] = []
        self._step_ctx: Optional[contextlib.ExitStack] = None
        self._phase_ctx: Optional[contextlib.ExitStack] = None

    @property
    def metering(self) -> bool:
        return self.meter is not None and self.step in self.metered_steps

    def attach(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        # on this side's turn: the package imports no torch before the lockstep baton
        from memtrain.metrics import MemoryMeter

        if self.metered_steps:
            # The Trainer's optimizer is accelerate's wrapper; the state and step hooks are the
            # wrapped torch optimizer's.
            self.meter = MemoryMeter(model, getattr(optimizer, "optimizer", optimizer))

    def begin_step(self) -> None:
        self._window_start = time.time()
        stack = contextlib.ExitStack()
        stack.enter_context(self.timer.step())
        if self.metering:
            stack.enter_context(self.meter)
            if self.step == self.metered_steps[-1]:
                self.meter.reset_peak()
        self._step_ctx = stack

    def switch_phase(self, name: Optional[str]) -> None:
        if self._phase_ctx is not None:
            self._phase_ctx.close()
            self._phase_ctx = None
        if name is not None and self.metering and self._step_ctx is not None:
            self._phase_ctx = contextlib.ExitStack()
            self._phase_ctx.enter_context(self.meter.phase(name))

    def add_loss(self, loss: torch.Tensor) -> None:
        self._micro_losses.append(loss.detach())

    def end_step(self) -> None:
        self.switch_phase(None)
        if self._step_ctx is not None:
            self._step_ctx.close()
            self._step_ctx = None
        if self._micro_losses:
            self.step_losses.append(torch.stack(self._micro_losses).sum())
            self._micro_losses = []
        self.step += 1
        STEP_WINDOWS.append((self._window_start, time.time()))
        BATON.handoff()  # lockstep: the other side's step k runs now


def _trainer_classes() -> tuple[type, type]:
    """``(MeteredTrainer, MeterCallback)``, defined on first use so that importing this module
    (the memtrain-side worker does) never imports transformers."""
    from transformers import Trainer, TrainerCallback

    class MeterCallback(TrainerCallback):
        """Step boundaries and the optimizer phase for a :class:`StepMeter`."""

        def __init__(self, meter: StepMeter) -> None:
            self.meter = meter

        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):  # type: ignore[no-untyped-def]
            from memtrain.metrics import reset_device_peak

            self.meter.attach(model, optimizer)
            reset_device_peak(self.meter.device)

        def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            self.meter.begin_step()

        def on_pre_optimizer_step(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            self.meter.switch_phase("optimizer")

        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            self.meter.end_step()

    class MeteredTrainer(Trainer):
        """``Trainer`` that labels the forward phase and records each micro-batch loss.

        Everything else is the stock Trainer; ``compute_loss`` is its documented override point.
        """

        step_meter: StepMeter
        exact_schedule: Optional[Callable[[int], float]] = None

        def create_scheduler(self, num_training_steps, optimizer=None):  # type: ignore[no-untyped-def]
            # --exact-schedule: memtrain's own warm-up + cosine instead of cosine_with_min_lr, to
            # show that the perplexity gap of short runs is the warm-up offset and nothing else.
            if self.exact_schedule is not None and self.lr_scheduler is None:
                self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer or self.optimizer, self.exact_schedule)
                self._created_lr_scheduler = True
                return self.lr_scheduler
            return super().create_scheduler(num_training_steps, optimizer)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # type: ignore[no-untyped-def]
            self.step_meter.switch_phase("forward")
            out = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                       num_items_in_batch=num_items_in_batch)
            self.step_meter.switch_phase("backward")
            self.step_meter.add_loss(out[0] if return_outputs else out)
            return out

    return MeteredTrainer, MeterCallback


def autocast_dtype(args: Any) -> Optional[torch.dtype]:
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None


@torch.no_grad()
def hf_evaluate(model: torch.nn.Module, batches: list, device: torch.device, autocast_dtype: Optional[torch.dtype]) -> float:
    """Mean token loss over memtrain's validation batches (same weighting as memtrain.training.train.evaluate)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        ctx = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
        with ctx:
            loss = model(input_ids=x, labels=y, shift_labels=y).loss
        total += float(loss) * y.numel()
        count += y.numel()
    model.train(was_training)
    return total / count


# ============================================================================ runs
def run_theirs(cfg: RunConfig, track_memory: bool = True, exact_schedule: bool = False) -> dict[str, Any]:
    """Train with ``transformers.Trainer``; return a result dict shaped like memtrain's.

    ``exact_schedule`` replaces the Trainer's ``cosine_with_min_lr`` by memtrain's schedule
    (a check, not the comparison: see the module docstring on the warm-up offset).
    """
    import transformers

    # on this side's turn: the package imports no torch before the lockstep baton
    from memtrain.data import check_split_documents, check_val_tokens, make_val_batches, prepare_splits

    # on this side's turn: the package imports no torch before the lockstep baton
    from memtrain.metrics import device_peak_memory

    # on this side's turn: the package imports no torch before the lockstep baton
    from memtrain.models import data_tokenizer

    # on this side's turn: the package imports no torch before the lockstep baton
    from memtrain.runtime.env import environment, resolve_device

    transformers.logging.set_verbosity_error()
    t = cfg.train
    device = resolve_device(t.device)
    plan = hf_plan(cfg, device.type)
    if plan.status == "none":
        raise ConfigError("no Hugging Face equivalent: " + "; ".join(plan.missing))
    if plan.matmul_precision:
        torch.set_float32_matmul_precision(plan.matmul_precision)

    splits = prepare_splits(cfg.data, progress=False, tokenizer=data_tokenizer(cfg))  # --val-data as train reads it
    check_split_documents(splits, cfg.data)
    check_val_tokens(splits, cfg.data, t.seq_len)
    train_ds = hf_train_dataset(splits.train, cfg)
    val_batches = make_val_batches(splits.val, t.seq_len, cfg.data.val_blocks, t.batch_size)

    model = build_hf_model(cfg, plan, device=device)  # on the device, as memtrain's side builds
    n_params = model.num_parameters()  # the base model, as memtrain counts it (adapters not included)
    model = apply_hf_lora(model, plan)
    MeteredTrainer, MeterCallback = _trainer_classes()
    meter = StepMeter(device, t.steps, t.warmup_timing_steps, track_memory)
    with tempfile.TemporaryDirectory(prefix="hf-trainer-") as tmp:
        args = training_arguments(cfg, plan, tmp, device)
        from transformers import default_data_collator

        trainer = MeteredTrainer(model=model, args=args, train_dataset=train_ds,
                                 data_collator=default_data_collator, callbacks=[MeterCallback(meter)])
        trainer.step_meter = meter
        if exact_schedule:
            # on this side's turn: the package imports no torch before the lockstep baton
            from memtrain.training.step import lr_lambda

            trainer.exact_schedule = lr_lambda(cfg)
        wall = time.perf_counter()
        trainer.train()
        total_time = time.perf_counter() - wall
        val_loss = hf_evaluate(trainer.model, val_batches, device, autocast_dtype(args))

    stats = meter.timer.summary().to_dict()
    losses = [float(x) for x in meter.step_losses]
    tail = losses[-min(10, len(losses)):] or [float("nan")]
    memory: dict[str, Any] = {"peak_bytes": None, "by_category": None}
    if meter.meter is not None:
        memory.update(meter.meter.stats().to_dict())
    memory.update(device_peak_memory(device))
    tokens_per_step = t.batch_size * t.grad_accum * t.seq_len
    median = stats["median"]
    return {
        "train_loss": sum(tail) / len(tail),
        "val_loss": val_loss,
        "val_ppl": math.exp(min(val_loss, 50)),
        "steps": t.steps,
        "tokens": tokens_per_step * t.steps,
        "step_time_s": {k: stats[k] for k in ("median", "p10", "p90", "mean")},
        "timed_steps": stats["steps"],
        "total_time_s": total_time,
        "tokens_per_s": tokens_per_step / median if median else None,
        "memory": memory,
        "parameters": n_params,
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "loss_history": losses,
        "hf_plan": plan.to_dict(),
        "lr_schedule": "memtrain (--exact-schedule)" if exact_schedule else args.lr_scheduler_type,
        "transformers": transformers.__version__,
        "env": environment(device),
    }

