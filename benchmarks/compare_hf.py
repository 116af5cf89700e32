"""memtrain vs Hugging Face Trainer: the same GPT-2 model, tokens and schedule, the same meters.

    python benchmarks/compare_hf.py --scale quick --presets baseline,bf16,chunked-loss \
        --out benchmarks/results/cpu [--budget 1GiB] [--steps N] [--repeats R]

For each memtrain bench preset (``memtrain.bench.presets.TECHNIQUES``) two runs are made, each
in a fresh Python process (so neither side inherits the other's allocator state, compile
cache, thread pool or global TF32 switch):

* ours:   ``memtrain.train.train(cfg)`` (the code path of ``memtrain train``);
* theirs: ``transformers.GPT2LMHeadModel`` trained by ``transformers.Trainer`` with the
  ``TrainingArguments`` of :mod:`hf_presets`.

By default the two processes run in lockstep (:class:`Baton`): both alive, taking turns step by
step, so step k of each side runs seconds apart under the same machine load and no timed step
overlaps the other side's work; which side moves first alternates between rows and repetitions.
``--no-lockstep`` runs them one after the other instead. ``--profile N`` times the phases of both
steps in one process (:func:`profile_phases`) to find where one side loses time.

What is identical on both sides, and how:

* Architecture: ``GPT2Config`` built from the memtrain ``ModelConfig`` (parameter counts are
  checked to be equal before training) and initial weights: the HF model is loaded with the
  weights of ``memtrain.model.GPT`` built under the same seed (Conv1D weights transposed), so
  both start from the same point and a perplexity gap is the training loop's, not the seed's.
* Tokens: ``memtrain.data.prepare_tokens`` and memtrain's block split (blocks of seq_len + 1
  tokens, x = first seq_len, y = last seq_len). The HF dataset yields, in memtrain's training
  order (``ResumableBatchSampler``), ``input_ids = x``, ``labels = y`` and ``shift_labels = y``;
  with ``shift_labels`` given, transformers' causal-LM loss uses it as the target as is instead
  of shifting ``labels``, so both sides predict the same seq_len targets from the same seq_len
  inputs (batch x seq_len tokens per micro-batch; a plain ``labels = input_ids`` would lose
  the last target of every row). ``train_sampling_strategy="sequential"`` keeps the order.
* Loss normalization: memtrain averages each micro-batch and divides by the number of
  micro-batches; the Trainer divides the summed loss by the token count of the whole step
  (``num_items_in_batch``). Every micro-batch has the same token count, so these are equal.
* Optimizer: AdamW betas (0.9, 0.95), eps 1e-8, weight decay on every tensor with >= 2 dims
  (the Trainer's rule, no decay for biases and LayerNorm, selects the same tensors), grad clip
  1.0, linear warm-up then cosine to ``min_lr_ratio`` (``lr_scheduler_type=
  "cosine_with_min_lr"``, ``min_lr_rate``). One known difference: HF's warm-up factor at step
  s is s / W, memtrain's is (s + 1) / W, so HF's first step has learning rate 0.
* Meters: ``memtrain.metrics.MemoryMeter`` around the same two steps (``METERED_STEPS``: the
  first builds optimizer state, the second is the reported steady state, peak reset at its
  start), with forward / backward / optimizer phases; ``StepTimer`` with the same warm-up
  (metered steps excluded); validation loss on the same blocks of ``make_val_batches``.
  On CUDA, ``max_memory_allocated``/``max_memory_reserved`` are added on both sides.
* Max batch: ``memtrain.analysis.maxbatch.find_max_batch`` on both sides under the same budget; ours
  with its own probe, theirs with :func:`hf_step_peak` (two Trainer-equivalent steps: forward
  with labels, backward, clip, optimizer step, zero_grad). On CPU both probes trace the step
  under fake tensors (exact tracked bytes, no memory used); the traced peak at the run's batch
  is reported next to the measured one as a check.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

BATON_ENV = "COMPARE_HF_BATON"


class Baton:
    """Turn-taking between the two sides of a lockstep pair (``--lockstep``, the default).

    Both processes live at once but only the one holding the turn computes: a side holds it
    from start-up to the end of each training step, then hands it over and waits for it to come
    back. Consecutive steps of ours and theirs thus alternate, a few seconds apart, under the
    same machine load, and no timed step ever overlaps the other side's work (start-up, data,
    compile, evaluation or max-batch search included). The turn travels as one byte over two
    pipes set up by the parent: ``g`` (your turn) or ``d`` (the other side has finished: run
    freely). Outside a pair (env var unset) every call is a no-op.
    """

    def __init__(self, spec: Optional[str]) -> None:
        self.in_fd: Optional[int] = None
        self.out_fd: Optional[int] = None
        self.free = True
        if spec:
            self.in_fd, self.out_fd = (int(x) for x in spec.split(","))
            self.free = False

    def acquire(self) -> None:
        """Block until it is this side's turn (or the other side is gone)."""
        if self.free or self.in_fd is None:
            return
        if os.read(self.in_fd, 1) in (b"d", b""):
            self.free = True

    def _send(self, token: bytes) -> None:
        if self.out_fd is None:
            return
        try:
            os.write(self.out_fd, token)
        except OSError:  # the other side has exited
            self.free = True

    def handoff(self) -> None:
        """End of a step: give the turn to the other side and wait for it to come back."""
        if self.free:
            return
        self._send(b"g")
        self.acquire()

    def finish(self) -> None:
        """This side is done: let the other side run freely from now on."""
        self._send(b"d")
        self.out_fd = None
        self.free = True


BATON = Baton(os.environ.get(BATON_ENV))
# (start, end) wall-clock times of every training step of this process, so the report can show
# that the two sides' steps never overlapped.
STEP_WINDOWS: list[tuple[float, float]] = []
if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    # Wait for the turn before importing torch: the import is heavy and the other side may be
    # in the middle of a timed step.
    BATON.acquire()

import torch  # noqa: E402

# The script runs as a file (python benchmarks/compare_hf.py): its folder is on sys.path, so the
# mapping module next to it imports by name.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_presets import HFPlan, gpt2_config_kwargs, hf_plan, trainer_alignment  # noqa: E402
from memtrain.bench.presets import (  # noqa: E402
    SCALE_BUDGET,
    SCALE_MAX_BATCH,
    SCALES,
    TECHNIQUES,
    scale_overrides,
    technique_overrides,
)
from memtrain.config import ConfigError, RunConfig, build_config, parse_size  # noqa: E402

RUNS_FILE = "runs.jsonl"
COMMANDS_FILE = "commands.log"  # every invocation that wrote into the folder (--resume adds to runs.jsonl)
REPORT_JSON = "compare_hf.json"
REPORT_MD = "compare_hf.md"
SIDES = ("ours", "theirs")


# ============================================================================ data
class OrderedBlocks(torch.utils.data.Dataset):
    """memtrain's training blocks as Trainer examples, in memtrain's batch order.

    Item ``i`` is block ``order[i]`` as ``{"input_ids": x, "labels": y, "shift_labels": y}``; read
    sequentially in batches of ``batch_size`` it reproduces memtrain's batches exactly.
    """

    def __init__(self, blocks: Any, order: list[int]) -> None:
        self.blocks = blocks  # memtrain.data.BlockDataset
        self.order = order

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, y = self.blocks[self.order[i]]
        return {"input_ids": x, "labels": y, "shift_labels": y}


def training_order(n_blocks: int, batch_size: int, seed: int, n_batches: int) -> list[int]:
    """Block indices of memtrain's first ``n_batches`` training batches, flattened."""
    from memtrain.data import ResumableBatchSampler

    order: list[int] = []
    it = iter(ResumableBatchSampler(n_blocks, batch_size, seed))
    for _ in range(n_batches):
        order.extend(next(it))
    return order


def hf_train_dataset(tokens: Any, cfg: RunConfig) -> OrderedBlocks:
    """The Trainer's dataset: exactly the micro-batches memtrain's loader gives for ``cfg``."""
    from memtrain.data import BlockDataset

    t = cfg.train
    blocks = BlockDataset(tokens, t.seq_len)
    if len(blocks) < t.batch_size:
        raise ConfigError(f"training corpus has fewer than {t.batch_size} blocks of {t.seq_len + 1} tokens; "
                          "use more data or lower --batch-size / --seq-len")
    return OrderedBlocks(blocks, training_order(len(blocks), t.batch_size, t.seed, t.steps * t.grad_accum))


# ============================================================================ model
def copy_gpt_weights(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """Load a ``memtrain.model.GPT``'s weights into a ``GPT2LMHeadModel`` of the same shape.

    GPT-2's Conv1D keeps (in, out) weights where nn.Linear keeps (out, in): those are
    transposed. The q, k, v order of the fused projection is the same on both sides.
    """
    linear = {"attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj", "mlp.fc": "mlp.c_fc", "mlp.fc_out": "mlp.c_proj"}
    out: dict[str, torch.Tensor] = {}
    for name, value in src.state_dict().items():
        if name == "lm_head.weight":
            if src.cfg.untie_embeddings:
                out["lm_head.weight"] = value
            continue
        if name.startswith("blocks."):
            _, i, rest = name.split(".", 2)
            module, _, kind = rest.rpartition(".")
            if module in linear:
                target = f"transformer.h.{i}.{linear[module]}.{kind}"
                out[target] = value.t() if kind == "weight" else value
            else:
                out[f"transformer.h.{i}.{rest}"] = value
        else:
            out[f"transformer.{name}"] = value
    missing, unexpected = dst.load_state_dict(out, strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]  # tied to wte
    if missing or unexpected:
        raise RuntimeError(f"weight copy memtrain -> GPT-2 failed: missing {missing}, unexpected {unexpected}")


def build_hf_model(cfg: RunConfig, plan: HFPlan, init_from_memtrain: bool = True) -> torch.nn.Module:
    """``GPT2LMHeadModel`` with ``cfg.model``'s architecture (and weights, unless told not to)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from memtrain.model import GPT
    from memtrain.runtime import seed_everything

    config = GPT2Config(**gpt2_config_kwargs(cfg.model))
    config._attn_implementation = plan.attn_implementation
    model = GPT2LMHeadModel(config)
    if init_from_memtrain:
        seed_everything(cfg.train.seed)  # what memtrain.train does right before building its GPT
        ours = GPT(cfg.model)
        if ours.num_parameters() != model.num_parameters():
            raise RuntimeError(f"parameter counts differ: memtrain {ours.num_parameters():,}, "
                               f"GPT2LMHeadModel {model.num_parameters():,}")
        copy_gpt_weights(ours, model)
        del ours
    return model


def apply_hf_lora(model: torch.nn.Module, plan: HFPlan) -> torch.nn.Module:
    """Wrap with peft's LoRA as a Trainer user would (``get_peft_model``)."""
    if plan.lora is None:
        return model
    from peft import LoraConfig, get_peft_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft notes that fan_in_fan_out is set for Conv1D
        return get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **plan.lora))


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
        lr_scheduler_type="cosine_with_min_lr" if t.schedule == "cosine" else "constant_with_warmup",
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
    return TrainingArguments(**kwargs)


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
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
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
        from memtrain.metrics import StepTimer
        from memtrain.train import METERED_STEPS

        self.device = device
        self.metered_steps = METERED_STEPS if track_memory else ()
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
        BATON.handoff()


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


def _autocast_dtype(args: Any) -> Optional[torch.dtype]:
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None


@torch.no_grad()
def hf_evaluate(model: torch.nn.Module, batches: list, device: torch.device, autocast_dtype: Optional[torch.dtype]) -> float:
    """Mean token loss over memtrain's validation batches (same weighting as memtrain.train.evaluate)."""
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

    from memtrain.data import make_val_batches, prepare_tokens
    from memtrain.metrics import device_peak_memory
    from memtrain.runtime import environment, resolve_device

    transformers.logging.set_verbosity_error()
    t = cfg.train
    device = resolve_device(t.device)
    plan = hf_plan(cfg, device.type)
    if plan.status == "none":
        raise ConfigError("no Hugging Face equivalent: " + "; ".join(plan.missing))
    if plan.matmul_precision:
        torch.set_float32_matmul_precision(plan.matmul_precision)

    splits = prepare_tokens(cfg.data, progress=False)
    train_ds = hf_train_dataset(splits.train, cfg)
    val_batches = make_val_batches(splits.val, t.seq_len, cfg.data.val_blocks, t.batch_size)

    model = build_hf_model(cfg, plan)
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
            from memtrain.train import lr_lambda

            trainer.exact_schedule = lr_lambda(cfg)
        wall = time.perf_counter()
        trainer.train()
        total_time = time.perf_counter() - wall
        val_loss = hf_evaluate(trainer.model, val_batches, device, _autocast_dtype(args))

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


class _ItemStub:
    """Under fake tensors ``.item()`` has no value: answer 1 (AdamW's step counter, the loss).
    Values never change how much memory a step takes."""

    def __enter__(self) -> "_ItemStub":
        from torch.utils._python_dispatch import TorchDispatchMode

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                if func is torch.ops.aten._local_scalar_dense.default:
                    t = args[0]
                    return True if t.dtype == torch.bool else 1.0 if t.dtype.is_floating_point else 1
                return func(*args, **(kwargs or {}))

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)


@contextlib.contextmanager
def _modules_stay_put() -> Iterator[None]:
    """Make ``nn.Module.to`` a no-op while peft adds adapters under fake tensors.

    peft moves each new adapter to its base layer's device; the adapter is already there (the
    fake mode creates it on the same device, in FP32), but ``Module.to`` swaps parameters and
    torch refuses to swap fake ones that the fake mode references weakly.
    """
    original = torch.nn.Module.to
    torch.nn.Module.to = lambda self, *a, **k: self  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.nn.Module.to = original  # type: ignore[method-assign]


class HFStep:
    """The Trainer's training step, outside the Trainer (for probes and phase profiles).

    The model is prepared as ``Trainer.train`` prepares it (activation checkpointing, LoRA); the
    forward is accelerate's mixed-precision forward (autocast, outputs converted to FP32) called
    as ``compute_loss`` calls it (``num_items_in_batch``); then backward, ``clip_grad_norm_``, the
    Trainer's optimizer and ``model.zero_grad()``. ``init_from_memtrain`` loads memtrain's initial
    weights (not possible under fake tensors).
    """

    def __init__(self, cfg: RunConfig, device: torch.device, fake: bool = False, init_from_memtrain: bool = False) -> None:
        from accelerate.utils import convert_outputs_to_fp32

        self.cfg, self.device = cfg, device
        plan = hf_plan(cfg, device.type)
        with tempfile.TemporaryDirectory(prefix="hf-step-") as tmp:
            self.args = args = training_arguments(cfg, plan, tmp, device)
        with torch.device(device):
            model = build_hf_model(cfg, plan, init_from_memtrain=init_from_memtrain)
        if args.activation_checkpointing:
            kw = dict(args.activation_checkpointing_kwargs or {})
            every = kw.pop("every_n_layers", 1)
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw or None, every_n_layers=every)
        with _modules_stay_put() if fake else contextlib.nullcontext():
            model = apply_hf_lora(model, plan)
        model.train()
        self.model = model
        self.optimizer = make_hf_optimizer(model, args)
        forward = model.forward
        dtype = _autocast_dtype(args)
        if dtype is not None:
            forward = convert_outputs_to_fp32(torch.autocast(device.type, dtype=dtype)(forward))
        if args.torch_compile and not fake:
            forward = torch.compile(forward)
        self.forward = forward
        self.params = [p for p in model.parameters() if p.requires_grad]

    def step(self, micro: list[tuple[torch.Tensor, torch.Tensor]], phase: Callable[[str], Any],
             clock: Optional[Callable[[str], None]] = None) -> None:
        """One optimizer step over ``micro`` (``phase(name)`` labels a MemoryMeter; ``clock(name)``
        marks the end of each phase for timing)."""
        t = self.cfg.train
        n_items = torch.tensor(sum(y.numel() for _, y in micro), device=self.device)
        mark = clock or (lambda name: None)
        for x, y in micro:
            with phase("forward"):
                loss = self.forward(input_ids=x, labels=y, shift_labels=y, num_items_in_batch=n_items).loss
            mark("forward")
            with phase("backward"):
                loss.backward()
            mark("backward")
            del loss
        with phase("optimizer"):
            if t.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.params, t.grad_clip)
            self.optimizer.step()
            self.model.zero_grad(set_to_none=True)
        mark("optimizer")


def _random_micro_batches(cfg: RunConfig, batch: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Memory and time do not depend on the token values.
    g = torch.Generator().manual_seed(0)
    t = cfg.train
    return [tuple(torch.randint(0, cfg.model.vocab_size, (batch, t.seq_len), generator=g).to(device)  # type: ignore[misc]
                  for _ in range(2)) for _ in range(t.grad_accum)]


def hf_step_peak(cfg: RunConfig, batch: int, fake: Optional[bool] = None) -> Optional[int]:
    """Peak bytes of two Trainer-equivalent steps (:class:`HFStep`) at ``batch`` (second step).

    ``fake`` (default: on CPU) traces them under fake tensors; otherwise they run for real and,
    on CUDA, report ``max_memory_allocated`` (None on out-of-memory). Compiled rows are traced
    eagerly, as memtrain's trace does.
    """
    import transformers

    from memtrain.metrics import MemoryMeter, reset_device_peak
    from memtrain.runtime import resolve_device

    transformers.logging.set_verbosity_error()
    device = resolve_device(cfg.train.device)
    fake = device.type != "cuda" if fake is None else fake
    cfg = cfg.replace(batch_size=batch)
    hf = meter = None
    try:
        with contextlib.ExitStack() as stack:
            if fake:
                from torch._subclasses.fake_tensor import FakeTensorMode

                stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
                stack.enter_context(_ItemStub())
                stack.enter_context(torch.compiler.set_stance("force_eager"))
            hf = HFStep(cfg, device, fake=fake)
            micro = _random_micro_batches(cfg, batch, device)
            meter = MemoryMeter(hf.model, hf.optimizer) if device.type != "cuda" else None
            for step in range(2):
                with meter if meter is not None else contextlib.nullcontext():
                    if step == 1:
                        if meter is not None:
                            meter.reset_peak()
                        reset_device_peak(device)
                    hf.step(micro, meter.phase if meter is not None else (lambda name: contextlib.nullcontext()))
            if meter is not None:
                return int(meter.stats().peak_bytes)
            torch.cuda.synchronize(device)
            return int(torch.cuda.max_memory_allocated(device))
    except torch.OutOfMemoryError:
        return None
    finally:
        del hf, meter
        import gc

        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def profile_phases(cfg: RunConfig, steps: int, top_ops: int = 12) -> dict[str, Any]:
    """Forward / backward / optimizer time of ours and of the Trainer-equivalent step, in one
    process, alternating step by step (which side goes first alternates too), after 3 warm-up
    steps each; plus each side's top operators (torch.profiler, self CPU/CUDA time, 3 steps).

    For finding *where* one side is slower; the lockstep runs are the comparison itself (here
    both sides share one allocator and, with torchao, one compile cache).
    """
    import transformers
    from torch.profiler import ProfilerActivity, profile

    from memtrain.metrics import synchronize
    from memtrain.model import GPT
    from memtrain.runtime import resolve_device, seed_everything
    from memtrain.techniques import build_optimizer, make_precision, prepare_model
    from memtrain.train import train_step

    transformers.logging.set_verbosity_error()
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)  # two sides' graphs
    device = resolve_device(cfg.train.device)
    t = cfg.train
    micro = _random_micro_batches(cfg, t.batch_size, device)
    precision = make_precision(cfg.technique.precision, device)
    seed_everything(t.seed)
    ours = prepare_model(GPT(cfg.model), cfg, device, precision)
    ours.train()
    ours_opt = build_optimizer(ours, cfg.technique, t)
    plan = hf_plan(cfg, device.type)
    if plan.matmul_precision:
        torch.set_float32_matmul_precision(plan.matmul_precision)
    hf = HFStep(cfg, device, init_from_memtrain=True)
    null_phase = lambda name: contextlib.nullcontext()  # noqa: E731

    def run(side: str, record: Optional[list[dict[str, float]]]) -> None:
        marks: dict[str, float] = {}
        synchronize(device)
        start = time.perf_counter()

        def clock(name: str) -> None:
            synchronize(device)
            marks[name] = marks.get(name, 0.0) + time.perf_counter() - start - sum(marks.values())

        if side == "ours":
            # train_step's own phases, timed by a meter-shaped clock.
            class _Phases:
                def phase(self, name: str) -> Any:
                    @contextlib.contextmanager
                    def cm() -> Iterator[None]:
                        yield
                        clock(name)
                    return cm()

            train_step(ours, micro, ours_opt, precision, t.grad_clip, device, _Phases())  # type: ignore[arg-type]
        else:
            hf.step(micro, null_phase, clock)
        if record is not None:
            record.append(marks)

    times: dict[str, list[dict[str, float]]] = {"ours": [], "theirs": []}
    for _ in range(3):
        run("ours", None)
        run("theirs", None)
    for i in range(steps):
        for side in (("ours", "theirs") if i % 2 == 0 else ("theirs", "ours")):
            run(side, times[side])
    result: dict[str, Any] = {}
    for side, recs in times.items():
        result[side] = {k: statistics.median(r.get(k, 0.0) for r in recs) for k in ("forward", "backward", "optimizer")}
        result[side]["step"] = statistics.median(sum(r.values()) for r in recs)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(3):
                run(side, None)
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        result[side]["top_ops"] = prof.key_averages().table(sort_by=sort, row_limit=top_ops)
    return result


def _probe_at(max_batch: Optional[dict[str, Any]], batch: int) -> Optional[int]:
    for p in (max_batch or {}).get("probes", []):
        if p.get("batch_size") == batch:
            return p.get("peak_bytes")
    return None


def run_side(side: str, cfg: RunConfig, maxbatch: Optional[dict[str, Any]], exact_schedule: bool = False) -> dict[str, Any]:
    """One side's run (training, then the max-batch search); the worker process calls this."""
    from memtrain.analysis.maxbatch import find_max_batch
    from memtrain.runtime import resolve_device

    if side == "ours":
        import memtrain.train
        from memtrain.metrics import StepTimer

        class HandoffStepTimer(StepTimer):
            """memtrain's StepTimer that hands the lockstep turn over after every step."""

            @contextlib.contextmanager
            def step(self) -> Iterator[None]:
                start = time.time()
                with super().step():
                    yield
                STEP_WINDOWS.append((start, time.time()))
                BATON.handoff()

        # The one hook into memtrain's loop: train() builds its timer from this name.
        memtrain.train.StepTimer = HandoffStepTimer  # type: ignore[misc]
        result = memtrain.train.train(cfg, progress=False)
    else:
        result = run_theirs(cfg, exact_schedule=exact_schedule)
    result["step_windows"] = list(STEP_WINDOWS)
    if maxbatch:
        device = resolve_device(cfg.train.device)
        method = maxbatch.get("method") or ("measure" if device.type == "cuda" else "trace")
        probe = None if side == "ours" else (lambda c, b: hf_step_peak(c, b, fake=method == "trace"))
        try:
            found = find_max_batch(cfg, budget_bytes=maxbatch.get("budget_bytes"), max_batch=maxbatch.get("max_batch"),
                                   progress=False, method=method, probe=probe).to_dict()
            if _probe_at(found, cfg.train.batch_size) is None and method == "trace":
                # The search did not visit the run's batch: probe it for the traced-vs-measured check.
                peak = traced_peak(side, cfg)
                found["probes"].append({"batch_size": cfg.train.batch_size, "peak_bytes": peak, "fits": None})
            result["max_batch"] = found
        except (ConfigError, RuntimeError) as exc:
            result["max_batch"] = {"batch_size": None, "error": str(exc).splitlines()[0]}
    return result


def traced_peak(side: str, cfg: RunConfig) -> Optional[int]:
    """The traced steady-state peak at the run's own batch (CPU)."""
    if side == "ours":
        from memtrain.analysis.maxbatch import traced_step_peak

        return traced_step_peak(cfg, cfg.train.batch_size)
    return hf_step_peak(cfg, cfg.train.batch_size, fake=True)


# ============================================================================ worker
def worker_main(side: str, spec_path: str, out_path: str) -> int:
    """``compare_hf.py --worker SIDE SPEC OUT``: run one side in this fresh process."""
    spec = json.loads(Path(spec_path).read_text())
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    warnings.filterwarnings("ignore")
    start = time.perf_counter()
    try:
        cfg = build_config(spec["config"])
        result = run_side(side, cfg, spec.get("maxbatch"), bool(spec.get("exact_schedule")))
        result["status"] = "ok"
    except ConfigError as exc:
        msg = str(exc)
        result = {"status": "not available yet" if "not wired" in msg else "invalid", "error": msg}
    except Exception as exc:  # noqa: BLE001 - every failure is recorded in the row, not lost
        import traceback

        oom = isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()
        msg = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        result = {"status": "oom" if oom else ("not available yet" if "not wired" in msg else "error"),
                  "error": msg, "traceback": traceback.format_exc(limit=10)}
    result["worker_wall_s"] = time.perf_counter() - start
    tmp = Path(out_path).with_suffix(".tmp")
    tmp.write_text(json.dumps(result, default=str))
    tmp.replace(out_path)
    BATON.finish()
    return 0


def run_subprocess(side: str, cfg: RunConfig, maxbatch: Optional[dict[str, Any]], threads: Optional[int],
                   timeout: Optional[float], exact_schedule: bool = False) -> dict[str, Any]:
    """Run one side in a fresh Python process; return its result (with status)."""
    with tempfile.TemporaryDirectory(prefix="compare-hf-") as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({"config": cfg.to_dict(), "maxbatch": maxbatch, "threads": threads,
                                    "exact_schedule": exact_schedule}))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", side, str(spec), str(out)]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return {"status": "timeout", "error": f"run exceeded {timeout:.0f} s"}
        wall = time.perf_counter() - start
        if out.is_file():
            result = json.loads(out.read_text())
        else:
            tail = " | ".join((err or "").strip().splitlines()[-3:])
            result = {"status": "error", "error": f"worker ended with code {proc.returncode} before writing: {tail}"}
    result["process_wall_s"] = wall
    return result


def run_pair(order: tuple[str, str], cfg: RunConfig, maxbatch: Optional[dict[str, Any]], threads: Optional[int],
             timeout: Optional[float], exact_schedule: bool = False) -> dict[str, dict[str, Any]]:
    """Run both sides at once in lockstep (see :class:`Baton`), ``order[0]`` taking the first turn."""
    inbox = {side: os.pipe() for side in order}  # side -> (read end, write end)
    procs: dict[str, subprocess.Popen] = {}
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="compare-hf-") as tmp:
        paths = {}
        for side in order:
            other = order[1] if side == order[0] else order[0]
            spec, out, err = (Path(tmp) / f"{side}.{x}" for x in ("spec.json", "out.json", "stderr"))
            paths[side] = (out, err)
            spec.write_text(json.dumps({"config": cfg.to_dict(), "maxbatch": maxbatch, "threads": threads,
                                        "exact_schedule": exact_schedule}))
            fds = (inbox[side][0], inbox[other][1])
            env = {**os.environ, BATON_ENV: f"{fds[0]},{fds[1]}"}
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", side, str(spec), str(out)]
            with open(err, "w") as fh:
                procs[side] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=fh, env=env, pass_fds=fds)
        for side in order:
            os.close(inbox[side][0])
        start = time.perf_counter()
        os.write(inbox[order[0]][1], b"g")
        walls: dict[str, float] = {}
        try:
            while len(walls) < len(procs):
                for side, proc in procs.items():
                    if side not in walls and proc.poll() is not None:
                        walls[side] = time.perf_counter() - start
                        for other in procs:  # a side that died mid-run must not leave the other waiting
                            if other != side:
                                with contextlib.suppress(OSError):
                                    os.write(inbox[other][1], b"d")
                if timeout is not None and time.perf_counter() - start > timeout:
                    for side, proc in procs.items():
                        if side not in walls:
                            proc.kill()
                            proc.wait()
                            walls[side] = -1.0
                    break
                time.sleep(0.2)
        finally:
            for side in order:
                with contextlib.suppress(OSError):
                    os.close(inbox[side][1])
        for side in order:
            out, err = paths[side]
            if walls.get(side, -1.0) < 0:
                results[side] = {"status": "timeout", "error": f"pair exceeded {timeout:.0f} s"}
                continue
            if out.is_file():
                results[side] = json.loads(out.read_text())
            else:
                tail = " | ".join(err.read_text().strip().splitlines()[-3:])
                results[side] = {"status": "error", "error": f"worker ended with code {procs[side].returncode} "
                                                            f"before writing: {tail}"}
            results[side]["process_wall_s"] = walls[side]
    return results


# ============================================================================ rows and report
def resolve_rows(scale: str, presets: list[str], overrides: dict[str, Any], device_type: str) -> list[dict[str, Any]]:
    """Each preset's memtrain config and Hugging Face plan, validated before anything runs.

    A preset takes :func:`hf_presets.trainer_alignment` (settings the Trainer cannot change,
    e.g. the low-bit optimizers' block) below the user's ``--set`` overrides."""
    rows = []
    for name in presets:
        try:
            layers = [scale_overrides(scale), technique_overrides(name, scale)]
            align = trainer_alignment(build_config(*layers, overrides))
            cfg = build_config(*layers, align, overrides)
        except ConfigError as exc:
            raise ConfigError(f"preset {name!r}: {exc}") from None
        plan = hf_plan(cfg, device_type)
        rows.append({"preset": name, "config": cfg, "plan": plan})
    return rows


def config_hash(cfg: RunConfig) -> str:
    import hashlib

    c = cfg.to_dict()
    c["train"].pop("out", None)
    c["train"].pop("progress", None)
    return hashlib.sha256(json.dumps(c, sort_keys=True).encode()).hexdigest()[:16]


def read_runs(out: Path) -> list[dict[str, Any]]:
    path = out / RUNS_FILE
    if not path.is_file():
        return []
    runs = []
    for line in path.read_text().splitlines():
        try:
            runs.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn last line from an interrupted write
    return runs


def _slim(result: dict[str, Any]) -> dict[str, Any]:
    """What a run line keeps (the full config is in the report once per row)."""
    keep = ("status", "error", "train_loss", "val_loss", "val_ppl", "steps", "tokens", "step_time_s", "timed_steps",
            "total_time_s", "tokens_per_s", "memory", "parameters", "trainable_parameters", "max_batch",
            "loss_history", "worker_wall_s", "process_wall_s", "transformers", "env", "hf_plan", "lr_schedule", "step_windows")
    return {k: result[k] for k in keep if k in result}


def _median(xs: list[float]) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def aggregate(rows: list[dict[str, Any]], runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per preset and side: medians over repetitions; paired step-time ratios per repetition."""
    table = []
    for row in rows:
        name, cfg, plan = row["preset"], row["config"], row["plan"]
        h = config_hash(cfg)
        entry: dict[str, Any] = {"preset": name, "hf_status": plan.status, "hf_missing": plan.missing,
                                 "hf_mapping": plan.mapping, "hf_training_args": plan.training_args,
                                 "hf_attn_implementation": plan.attn_implementation, "sides": {}}
        mine = [r for r in runs if r["preset"] == name and r["config_hash"] == h]
        for side in SIDES:
            rs = [r for r in mine if r["side"] == side]
            ok = [r["result"] for r in rs if r["result"].get("status") == "ok"]
            if not ok:
                entry["sides"][side] = {"status": rs[-1]["result"].get("status") if rs else "not run",
                                        "error": rs[-1]["result"].get("error") if rs else None}
                continue
            first = ok[0]
            mb = next((r.get("max_batch") for r in ok if r.get("max_batch")), None)
            peaks = [r["memory"]["peak_bytes"] for r in ok if r["memory"].get("peak_bytes") is not None]
            medians = [r["step_time_s"]["median"] for r in ok]
            tokens_per_step = cfg.train.batch_size * cfg.train.grad_accum * cfg.train.seq_len
            step = _median(medians)
            entry["sides"][side] = {
                "status": "ok",
                "repeats": len(ok),
                "step_time_s": step,
                "step_time_runs_s": medians,
                "step_time_p10_s": _median([r["step_time_s"]["p10"] for r in ok]),
                "step_time_p90_s": _median([r["step_time_s"]["p90"] for r in ok]),
                "tokens_per_s": tokens_per_step / step if step else None,
                "peak_bytes": max(peaks) if peaks else None,
                "peak_bytes_runs": peaks,
                "by_category": first["memory"].get("by_category"),
                "peak_phase": first["memory"].get("peak_phase"),
                "max_allocated_bytes": first["memory"].get("max_allocated_bytes"),
                "max_reserved_bytes": first["memory"].get("max_reserved_bytes"),
                "val_ppl": _median([r["val_ppl"] for r in ok]),
                "train_loss": _median([r["train_loss"] for r in ok]),
                "parameters": first.get("parameters"),
                "trainable_parameters": first.get("trainable_parameters"),
                "max_batch": (mb or {}).get("batch_size"),
                "max_batch_peak_bytes": (mb or {}).get("peak_bytes"),
                "max_batch_error": (mb or {}).get("error"),
                "traced_peak_at_run_batch": _probe_at(mb, cfg.train.batch_size),
            }
        # Paired ratios: the two sides of one repetition ran together (lockstep) or back to back.
        pairs, overlaps, per_step = [], [], []
        skip = max(cfg.train.warmup_timing_steps, 2)  # the steps StepTimer leaves out (metered + warm-up)
        for rep in sorted({r["rep"] for r in mine}):
            by_side = {r["side"]: r["result"] for r in mine if r["rep"] == rep and r["result"].get("status") == "ok"}
            if len(by_side) == 2:
                pairs.append(by_side["ours"]["step_time_s"]["median"] / by_side["theirs"]["step_time_s"]["median"])
                wo, wt = (by_side[s].get("step_windows") or [] for s in SIDES)
                overlaps.append(window_overlap_s(wo, wt))
                lockstep = all(r.get("lockstep") for r in mine if r["rep"] == rep)
                if lockstep and len(wo) == len(wt):
                    # Step k of ours and step k of theirs ran back to back, seconds apart: their
                    # ratio is the least load-sensitive figure a shared machine gives.
                    per_step += [(eo - so) / (et - st) for (so, eo), (st, et) in list(zip(wo, wt))[skip:]]
        entry["paired_step_ratios"] = pairs
        entry["step_overlap_s"] = overlaps
        entry["per_step_ratios"] = per_step
        o, t = entry["sides"].get("ours", {}), entry["sides"].get("theirs", {})
        if o.get("status") == "ok" and t.get("status") == "ok":
            def ratio(key: str) -> Optional[float]:
                a, b = o.get(key), t.get(key)  # noqa: B023 - called at once, within this iteration
                return a / b if a is not None and b else None

            entry["ratios"] = {k: ratio(k) for k in ("peak_bytes", "step_time_s", "tokens_per_s", "val_ppl", "max_batch",
                                                    "max_allocated_bytes")}
            entry["ratios"]["paired_step_time_median"] = _median(pairs)
            if per_step:
                q = statistics.quantiles(per_step, n=4) if len(per_step) > 1 else [per_step[0]] * 3
                entry["ratios"]["per_step"] = {"median": q[1], "q1": q[0], "q3": q[2], "n": len(per_step),
                                               "ours_faster_share": sum(r < 1 for r in per_step) / len(per_step)}
        table.append(entry)
    return table


def window_overlap_s(a: list, b: list) -> float:
    """Seconds during which a step of one side ran while a step of the other side also ran."""
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)


def _mib(b: Optional[float]) -> str:
    return "n/a" if b is None else f"{b / 2**20:,.1f}"


def _num(x: Optional[float], fmt: str = "{:.2f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def _repetitions(report: dict[str, Any], settings: dict[str, Any]) -> str:
    """Repetitions behind the report's rows (a --report-only run does not know the count it
    rebuilds): the recorded range, or the requested count when nothing was recorded."""
    counts = {side["repeats"] for row in report.get("rows", []) for side in row.get("sides", {}).values()
              if side.get("status") == "ok"}
    if not counts:
        return str(settings["repeats"])
    return str(min(counts)) if len(counts) == 1 else f"{min(counts)} to {max(counts)}"


def render_markdown(report: dict[str, Any]) -> str:  # noqa: C901 - one flat section per table; moves with benchmarks/hf/
    """The report as Markdown: provenance, values, ratios, breakdowns, mapping, raw runs."""
    env, s = report["env"], report["settings"]
    lines = [
        "# memtrain vs Hugging Face Trainer",
        "",
        *(f"- command: `{c}`" for c in report.get("commands") or [report["command"]]),
        f"- commit: `{', '.join(report.get('commits') or [str(env.get('commit'))])}`; memtrain {env.get('memtrain')}, "
        f"torch {env.get('torch')}, "
        f"transformers {report.get('transformers')}, python {env.get('python')}",
        f"- hardware: {env.get('device')}, {env.get('host_threads')} torch threads"
        + (f", {env.get('gpu_memory_bytes', 0) / 2**30:.0f} GiB" if env.get("gpu_memory_bytes") else ""),
        f"- finished: {report['finished']}; wall time {report['wall_s'] / 60:.1f} min",
        f"- scale `{s['scale']}`: batch {s['batch_size']}, seq {s['seq_len']}, {s['steps']} steps "
        f"({s['warmup_steps']} warm-up), grad_accum {s['grad_accum']}, dropout {s['dropout']}; "
        f"{_repetitions(report, s)} repetition(s); each side in a fresh process; "
        + ("lockstep: both sides of a preset run at once, taking turns step by step (no timed step overlaps "
           "other work of either side), the first turn alternating between rows and repetitions"
           if s.get("lockstep") else "sides one after the other, which one first alternating")
        + ("; HF given memtrain's LR schedule (--exact-schedule)" if s.get("exact_schedule") else ""),
        (f"- max batch: budget {s['budget']}, at most {s['max_batch']}, method {s['maxbatch_method']} on both sides"
         if s.get("maxbatch_method") else "- max batch: not searched (--no-maxbatch)"),
        "",
        "Peak = tracked live tensor bytes of the steady-state step (memtrain.metrics.MemoryMeter, same "
        "meter and steps on both sides). Step time = median over timed steps (metered and warm-up steps "
        "excluded), median over repetitions; on a shared machine the absolute times move with other "
        "people's load, so compare sides with the ratios. Ratios are ours / theirs: below 1 is better for "
        "peak, step time and PPL, above 1 is better for tokens/s and max batch. The per-step-pair ratio "
        "divides ours' step k by theirs' step k (run back to back in lockstep) over every timed step of "
        "every repetition: the figure to trust for speed.",
        "",
        "## Results",
        "",
        "| preset | HF match | peak MiB ours | peak MiB HF | step s ours | step s HF | tok/s ours | tok/s HF "
        "| val PPL ours | val PPL HF | max batch ours | max batch HF |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for e in report["rows"]:
        o, t = e["sides"].get("ours", {}), e["sides"].get("theirs", {})
        if e["hf_status"] == "none":
            lines.append(f"| {e['preset']} | no HF equivalent | | | | | | | | | | |")
            continue

        def batch(x: Optional[int]) -> str:
            # A batch equal to the search's cap may not be the largest that fits.
            return _num(x, "{}") if x is None or x != s.get("max_batch") else f">= {x} (cap)"

        def cell(side: dict[str, Any], key: str, f: Callable[[Any], str]) -> str:
            return f(side.get(key)) if side.get("status") == "ok" else side.get("status", "n/a")

        lines.append(
            f"| {e['preset']} | {e['hf_status']} | {cell(o, 'peak_bytes', _mib)} | {cell(t, 'peak_bytes', _mib)} "
            f"| {cell(o, 'step_time_s', _num)} | {cell(t, 'step_time_s', _num)} "
            f"| {cell(o, 'tokens_per_s', lambda x: _num(x, '{:,.0f}'))} | {cell(t, 'tokens_per_s', lambda x: _num(x, '{:,.0f}'))} "
            f"| {cell(o, 'val_ppl', lambda x: _num(x, '{:,.1f}'))} | {cell(t, 'val_ppl', lambda x: _num(x, '{:,.1f}'))} "
            f"| {cell(o, 'max_batch', batch)} | {cell(t, 'max_batch', batch)} |")
    lines += ["", "## Ratios (ours / theirs)", "",
              "| preset | peak | step time | step time, per run pair | step time, per step pair: median [IQR] (n) "
              "| tokens/s | val PPL | max batch | steps overlapping, s |",
              "|---|---:|---:|---|---|---:|---:|---:|---:|"]
    for e in report["rows"]:
        r = e.get("ratios")
        if not r:
            continue
        pairs = ", ".join(f"{p:.2f}" for p in e.get("paired_step_ratios", []))
        ps = r.get("per_step")
        per_step = f"**{ps['median']:.2f}** [{ps['q1']:.2f}, {ps['q3']:.2f}] ({ps['n']})" if ps else "n/a"
        lines.append(f"| {e['preset']} | {_num(r['peak_bytes'])} | {_num(r['step_time_s'])} | {pairs} | {per_step} "
                     f"| {_num(r['tokens_per_s'])} | {_num(r['val_ppl'], '{:.3f}')} | {_num(r['max_batch'])} "
                     f"| {_num(sum(e.get('step_overlap_s') or [0.0]), '{:.1f}')} |")
    if any((e["sides"].get("ours", {}).get("max_allocated_bytes") is not None) for e in report["rows"]):
        lines += ["", "## CUDA allocator peaks (whole run)", "",
                  "| preset | max allocated MiB ours | HF | max reserved MiB ours | HF |", "|---|---:|---:|---:|---:|"]
        for e in report["rows"]:
            o, t = e["sides"].get("ours", {}), e["sides"].get("theirs", {})
            lines.append(f"| {e['preset']} | {_mib(o.get('max_allocated_bytes'))} | {_mib(t.get('max_allocated_bytes'))} "
                         f"| {_mib(o.get('max_reserved_bytes'))} | {_mib(t.get('max_reserved_bytes'))} |")
    lines += ["", "## Memory at the peak, by category (MiB)", "",
              "| preset | side | parameters | gradients | optimizer | activations | temporaries | peak phase "
              "| traced peak at run batch | params (trainable) |",
              "|---|---|---:|---:|---:|---:|---:|---|---:|---|"]
    for e in report["rows"]:
        for side in SIDES:
            d = e["sides"].get(side, {})
            if d.get("status") != "ok" or not d.get("by_category"):
                continue
            c = d["by_category"]
            lines.append(f"| {e['preset']} | {side} | " + " | ".join(_mib(c.get(k)) for k in
                         ("parameters", "gradients", "optimizer", "activations", "temporaries"))
                         + f" | {d.get('peak_phase')} | {_mib(d.get('traced_peak_at_run_batch'))} "
                         f"| {_num(d.get('parameters'), '{:,}')} ({_num(d.get('trainable_parameters'), '{:,}')}) |")
    lines += ["", "## How each preset maps onto the Trainer", ""]
    for e in report["rows"]:
        lines.append(f"- **{e['preset']}** ({e['hf_status']}; attn_implementation `{e['hf_attn_implementation']}`, "
                     f"TrainingArguments `{json.dumps(e['hf_training_args'])}`)")
        for m in e["hf_mapping"]:
            lines.append(f"  - {m}")
        for m in e["hf_missing"]:
            lines.append(f"  - missing in HF: {m}")
    failures = [(e["preset"], side, d) for e in report["rows"] for side, d in e["sides"].items()
                if e["hf_status"] != "none" and d.get("status") not in ("ok", None)]
    if failures:
        lines += ["", "## Runs that did not finish", ""]
        for name, side, d in failures:
            lines.append(f"- {name} / {side}: {d.get('status')}: {d.get('error')}")
    lines += ["", "## Every run", "", "| rep | preset | side | ran | step s median | p10 | p90 | peak MiB | val PPL | run wall s |",
              "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["runs"]:
        res = r["result"]
        st = res.get("step_time_s") or {}
        lines.append(f"| {r['rep']} | {r['preset']} | {r['side']} | {r['position']} | {_num(st.get('median'))} "
                     f"| {_num(st.get('p10'))} | {_num(st.get('p90'))} | {_mib((res.get('memory') or {}).get('peak_bytes'))} "
                     f"| {_num(res.get('val_ppl'), '{:,.1f}')} | {_num(res.get('process_wall_s'), '{:.0f}')} |")
    return "\n".join(lines) + "\n"


def write_report(out: Path, rows: list[dict[str, Any]], settings: dict[str, Any], command: Optional[str],
                 start: float) -> dict[str, Any]:
    """Aggregate every recorded run of these rows; write JSON and Markdown; return the report."""
    from memtrain.runtime import environment, resolve_device

    hashes = {config_hash(r["config"]) for r in rows}
    runs = [r for r in read_runs(out) if r["config_hash"] in hashes]
    commands = ((out / COMMANDS_FILE).read_text().splitlines() if (out / COMMANDS_FILE).is_file()
                else [command] if command else [])
    wall = time.perf_counter() - start
    if command is None:  # --report-only: the runs' own wall time (a lockstep pair lasts as long as its longer side)
        command = commands[-1].split("  #")[0] if commands else None
        pairs: dict[tuple, list[float]] = {}
        for r in runs:
            pairs.setdefault((r["rep"], r["preset"], r.get("lockstep") and "pair" or r["side"]), []).append(
                r["result"].get("process_wall_s") or 0.0)
        wall = sum(max(v) for v in pairs.values())
    tf_version = next((r["result"].get("transformers") for r in runs if r["result"].get("transformers")), None)
    if tf_version is None:
        try:
            import importlib.metadata as md

            tf_version = md.version("transformers")
        except Exception:  # noqa: BLE001
            tf_version = None
    report = {
        "command": command,
        "commands": commands,
        # The machine and commit of the runs themselves (a --report-only rebuild may come later).
        "env": next((r["result"]["env"] for r in runs if r["result"].get("env")), None)
        or environment(resolve_device(settings["device"])),
        "commits": sorted({str(r["result"]["env"].get("commit")) for r in runs if r["result"].get("env")}),
        "transformers": tf_version,
        "settings": settings,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "wall_s": wall,
        "rows": aggregate(rows, runs),
        "configs": {r["preset"]: r["config"].to_dict() for r in rows},
        "runs": runs,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / REPORT_JSON).write_text(json.dumps(report, indent=1, default=str))
    (out / REPORT_MD).write_text(render_markdown(report))
    return report


def write_profiles(out: Path, rows: list[dict[str, Any]], steps: int, command: str) -> int:
    """``--profile``: per-phase medians of both sides for every row with a Trainer counterpart."""
    from memtrain.runtime import environment, git_commit, resolve_device

    env = environment(resolve_device(rows[0]["config"].train.device))
    lines = ["# Per-phase step times, memtrain vs the Trainer-equivalent step", "",
             f"- command: `{command}`", f"- commit: `{git_commit()}`; hardware: {env['device']}, "
             f"{env['host_threads']} torch threads", "",
             "Both steps in one process, alternating step by step; median milliseconds per phase "
             "(ours' phases are train_step's: forward includes the loss, optimizer includes clipping; "
             "the Trainer's: clipping is counted in its optimizer phase here too).", "",
             "| preset | side | forward | backward | optimizer | step |", "|---|---|---:|---:|---:|---:|"]
    details = []
    for row in rows:
        if row["plan"].status == "none":
            continue
        res = profile_phases(row["config"], steps)
        for side in SIDES:
            r = res[side]
            lines.append(f"| {row['preset']} | {side} | " + " | ".join(f"{r[k] * 1000:.1f}" for k in
                         ("forward", "backward", "optimizer", "step")) + " |")
            details += ["", f"### {row['preset']}: {side}", "", "```", r["top_ops"].rstrip(), "```"]
        print("\n".join(lines[-2:]), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.md").write_text("\n".join(lines + ["", "## Top operators (3 steps)"] + details) + "\n")
    return 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", default="quick", choices=sorted(SCALES), help="memtrain bench scale (model, batch, seq, steps)")
    ap.add_argument("--presets", default=",".join(TECHNIQUES), help="comma-separated memtrain bench presets")
    ap.add_argument("--out", default="benchmarks/results/cpu", help="folder for runs.jsonl, compare_hf.json, compare_hf.md")
    ap.add_argument("--budget", default=None, help="memory budget of the max-batch search (default: the scale's on CPU)")
    ap.add_argument("--max-batch", type=int, default=None, help="largest batch the search tries")
    ap.add_argument("--no-maxbatch", action="store_true", help="skip the max-batch search")
    ap.add_argument("--maxbatch-method", default="auto", choices=("auto", "trace", "measure"),
                    help="probe steps under fake tensors (trace: fast, exact for eager steps; CPU default) or run "
                         "them (measure: needed for compiled steps such as torchao's low-bit optimizers; CUDA default)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the scale's)")
    ap.add_argument("--warmup-steps", type=int, default=None, help="learning-rate warm-up steps (default: the scale's)")
    ap.add_argument("--repeats", type=int, default=1, help="repetitions of every preset (timing noise)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads in each run (default: torch's)")
    ap.add_argument("--device", default="auto", help="auto|cpu|cuda")
    ap.add_argument("--timeout", type=float, default=None, help="seconds one run may take")
    ap.add_argument("--lockstep", action=argparse.BooleanOptionalAction, default=True,
                    help="run both sides of a preset at once, taking turns step by step (default); "
                         "--no-lockstep runs them one after the other")
    ap.add_argument("--exact-schedule", action="store_true",
                    help="give the Trainer memtrain's learning-rate schedule (a check of the PPL gap; "
                         "default: HF's cosine_with_min_lr)")
    ap.add_argument("--profile", type=int, default=None, metavar="STEPS",
                    help="instead of the comparison: per-phase times of both steps over STEPS alternating steps "
                         "in one process, and their top operators (OUT/profile.md)")
    ap.add_argument("--report-only", action="store_true",
                    help="rebuild compare_hf.json/.md from OUT/runs.jsonl without running anything")
    ap.add_argument("--resume", action="store_true", help="keep runs already in OUT/runs.jsonl with the same config")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="any other memtrain config field for every row, e.g. --set d_model=64 (repeatable)")
    return ap.parse_args(argv)


def main(argv: list[str]) -> int:  # noqa: C901 - flag checks in sequence; moves with benchmarks/hf/
    if argv[:1] == ["--worker"]:
        return worker_main(*argv[1:4])
    opts = parse_args(argv)
    start = time.perf_counter()
    command = "python benchmarks/compare_hf.py " + " ".join(argv)
    try:
        from memtrain.runtime import resolve_device

        device = resolve_device(opts.device)
        overrides: dict[str, Any] = {"progress": False, "device": opts.device}
        if opts.steps is not None:
            overrides["steps"] = opts.steps
        if opts.warmup_steps is not None:
            overrides["warmup_steps"] = opts.warmup_steps
        for item in opts.set:
            key, eq, value = item.partition("=")
            if not eq or not key.strip():
                raise ConfigError(f"cannot read --set {item!r}; write KEY=VALUE, e.g. --set d_model=64")
            overrides[key.strip().replace("-", "_")] = value.strip()
        presets = [p.strip() for p in opts.presets.split(",") if p.strip()]
        rows = resolve_rows(opts.scale, presets, overrides, device.type)
        budget = opts.budget or (SCALE_BUDGET.get(opts.scale) if device.type == "cpu" else None)
        if device.type == "cpu" and budget is None:
            budget = "1GiB"
        maxbatch = None if opts.no_maxbatch else {
            "budget_bytes": parse_size(budget) if budget else None,
            "max_batch": opts.max_batch or SCALE_MAX_BATCH.get(opts.scale, 1024),
            "method": opts.maxbatch_method if opts.maxbatch_method != "auto" else (
                "measure" if device.type == "cuda" else "trace"),
        }
        if opts.repeats < 1:
            raise ConfigError(f"--repeats must be >= 1, got {opts.repeats}")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    t0 = rows[0]["config"].train
    settings = {
        "scale": opts.scale, "batch_size": t0.batch_size, "seq_len": t0.seq_len, "steps": t0.steps,
        "warmup_steps": t0.warmup_steps, "grad_accum": t0.grad_accum, "dropout": rows[0]["config"].model.dropout,
        "repeats": opts.repeats, "budget": budget, "max_batch": (maxbatch or {}).get("max_batch"),
        "maxbatch_method": None if maxbatch is None else maxbatch["method"],
        "threads": opts.threads, "device": opts.device, "lockstep": opts.lockstep,
        "exact_schedule": opts.exact_schedule,
    }
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    if opts.profile is not None:
        return write_profiles(out, rows, opts.profile, command)
    if opts.report_only:
        if not (out / RUNS_FILE).is_file():
            print(f"error: {out / RUNS_FILE} not found; run the comparison first", file=sys.stderr)
            return 2
        command = None  # keep the commands that produced the runs
        report = write_report(out, rows, settings, command, start)
        print((out / REPORT_MD).read_text().split("## Memory at the peak")[0])
        return 0
    if not opts.resume:
        for name in (RUNS_FILE, COMMANDS_FILE):
            if (out / name).exists():
                (out / name).unlink()
    with open(out / COMMANDS_FILE, "a") as fh:
        fh.write(f"{command}  # started {time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n")
    done = {(r["preset"], r["side"], r["rep"], r["config_hash"]) for r in read_runs(out)
            if r["result"].get("status") == "ok"}
    for rep in range(opts.repeats):
        for i, row in enumerate(rows):
            name, cfg, plan = row["preset"], row["config"], row["plan"]
            if plan.status == "none":
                if rep == 0:
                    print(f"[{name}] no HF equivalent: {'; '.join(plan.missing)}", flush=True)
                continue
            order = SIDES if (rep + i) % 2 == 0 else SIDES[::-1]
            h = config_hash(cfg)
            todo = [side for side in order if (name, side, rep, h) not in done]
            if not todo:
                continue
            mb = maxbatch if rep == 0 else None
            if opts.lockstep and len(todo) == 2:
                results = run_pair(order, cfg, mb, opts.threads, opts.timeout, opts.exact_schedule)
            else:
                results = {side: run_subprocess(side, cfg, mb, opts.threads, opts.timeout, opts.exact_schedule)
                           for side in todo}
            for side in todo:
                result = results[side]
                line = {"preset": name, "side": side, "rep": rep, "position": order.index(side) + 1,
                        "lockstep": bool(opts.lockstep and len(todo) == 2), "config_hash": h, "result": _slim(result)}
                with open(out / RUNS_FILE, "a") as fh:
                    fh.write(json.dumps(line, default=str) + "\n")
                st = (result.get("step_time_s") or {}).get("median")
                peak = (result.get("memory") or {}).get("peak_bytes")
                print(f"[rep {rep} {name} {side}] {result.get('status')}: step {_num(st)} s, peak {_mib(peak)} MiB, "
                      f"val ppl {_num(result.get('val_ppl'), '{:,.1f}')}, max batch "
                      f"{(result.get('max_batch') or {}).get('batch_size')}, {result.get('process_wall_s', 0):.0f} s"
                      + (f" ({result.get('error')})" if result.get("status") != "ok" else ""), flush=True)
            write_report(out, rows, settings, command, start)
    report = write_report(out, rows, settings, command, start)
    print((out / REPORT_MD).read_text().split("## Memory at the peak")[0])
    return 0 if all(e["sides"].get(s, {}).get("status") in ("ok", None)
                    for e in report["rows"] if e["hf_status"] != "none" for s in SIDES) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
