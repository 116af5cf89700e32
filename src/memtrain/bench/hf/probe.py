"""The Trainer's training step outside the Trainer: max-batch probes (traced under fake
tensors or run) and per-phase profiles of both sides in one process."""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from typing import Any, Callable, Iterator, Optional

import torch

from memtrain.bench.hf.hf_model import apply_hf_lora, build_hf_model
from memtrain.bench.hf.mapping import hf_plan
from memtrain.bench.hf.trainer_side import (
    autocast_dtype,
    checkpointing_of,
    enable_checkpointing,
    make_hf_optimizer,
    training_arguments,
)
from memtrain.config.run import RunConfig
from memtrain.models import is_hf
from memtrain.models.hf import same_paths_as_eager


class _ItemStub:
    """Under fake tensors ``.item()`` has no value: answer 1 (AdamW's step counter, the loss).
    Values never change how much memory a step takes."""

    def __enter__(self) -> "_ItemStub":
        # on this side's turn: the package imports no torch before the lockstep baton
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
        model = build_hf_model(cfg, plan, init_from_memtrain=init_from_memtrain, device=device)
        checkpointing, ck_kwargs = checkpointing_of(args)
        if checkpointing:
            enable_checkpointing(model, ck_kwargs)
        with _modules_stay_put() if fake else contextlib.nullcontext():
            model = apply_hf_lora(model, plan)
        model.train()
        self.model = model
        self.optimizer = make_hf_optimizer(model, args)
        forward = model.forward
        dtype = autocast_dtype(args)
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

    # on this side's turn: the package imports no torch before the lockstep baton
    from memtrain.metrics import MemoryMeter, reset_device_peak

    # on this side's turn: the package imports no torch before the lockstep baton
    from memtrain.runtime.env import resolve_device

    transformers.logging.set_verbosity_error()
    device = resolve_device(cfg.train.device)
    fake = device.type != "cuda" if fake is None else fake
    cfg = cfg.replace(batch_size=batch)
    hf = meter = None
    try:
        with contextlib.ExitStack() as stack:
            if fake:
                # on this side's turn: the package imports no torch before the lockstep baton
                from torch._subclasses.fake_tensor import FakeTensorMode

                stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
                stack.enter_context(_ItemStub())
                stack.enter_context(torch.compiler.set_stance("force_eager"))
                if is_hf(cfg):
                    # transformers takes fake tensors for tracing and would build a different step
                    # (a materialized causal mask): the same switch memtrain's own trace uses.
                    stack.enter_context(same_paths_as_eager())
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
        # on this side's turn: the package imports no torch before the lockstep baton
        import gc

        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


# Steps of each side under torch.profiler (after the timed ones): its operator tables are their sums.
PROFILED_STEPS = 3


class _PhaseSeam:
    """``train_step``'s ``meter`` argument for a plain ``phase(name)`` function."""

    def __init__(self, phase: Callable[[str], Any]) -> None:
        self.phase = phase


def profile_phases(cfg: RunConfig, steps: int, top_ops: int = 12) -> dict[str, Any]:
    """Forward / backward / optimizer time of ours and of the Trainer-equivalent step, in one
    process, alternating step by step (which side goes first alternates too), after 3 warm-up
    steps each; plus each side's top operators (torch.profiler, self CPU/CUDA time, 3 steps), every
    operator's and kernel's calls and self time per step (``ops``: :func:`per_step_ops`) and
    the host syncs in one step's forward and backward (:func:`_count_host_syncs`).

    For finding *where* one side is slower; the lockstep runs are the comparison itself (here
    both sides share one allocator and, with torchao, one compile cache).
    """
    import transformers

    # on this side's turn: the package imports no torch before the lockstep baton
    from torch.profiler import ProfilerActivity, profile

    # on this side's turn: the package imports no torch before the lockstep baton
    from memtrain.metrics import synchronize

    # on this side's turn: the package imports no torch before the lockstep baton
    from memtrain.runtime.env import resolve_device, seed_everything

    # on this side's turn: the package imports no torch before the lockstep baton
    from memtrain.techniques import build_optimizer, make_precision, prepare_model

    # on this side's turn: the package imports no torch before the lockstep baton
    from memtrain.training.step import build_base_model, train_step

    transformers.logging.set_verbosity_error()
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)  # two sides' graphs
    device = resolve_device(cfg.train.device)
    t = cfg.train
    micro = _random_micro_batches(cfg, t.batch_size, device)
    precision = make_precision(cfg.technique.precision, device)
    seed_everything(t.seed)
    # Built on the device in the weight dtype, as train builds it (the Trainer side's model is too):
    # built on the host in FP32 and then moved, a model of Llama-3-8B's shape draws its weights
    # on the CPU first, the slow build train had before it built on the device.
    ours = prepare_model(build_base_model(cfg, device, precision), cfg, device, precision)
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
            # train_step's own phases, each timed when it ends.
            @contextlib.contextmanager
            def timed(name: str) -> Iterator[None]:
                yield
                clock(name)

            train_step(ours, micro, ours_opt, precision, t.grad_clip, device, _PhaseSeam(timed))  # type: ignore[arg-type]  # only .phase is read
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
            for _ in range(PROFILED_STEPS):
                run(side, None)
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        events = prof.key_averages()
        result[side]["top_ops"] = events.table(sort_by=sort, row_limit=top_ops)
        result[side]["ops"] = per_step_ops(events, device, steps=PROFILED_STEPS)

    def ours_step(phase: Callable[[str], Any]) -> None:
        train_step(ours, micro, ours_opt, precision, t.grad_clip, device, _PhaseSeam(phase))  # type: ignore[arg-type]  # only .phase is read

    # last: a step that fails under the counter cannot disturb the timed ones
    result["ours"]["host_syncs"] = _count_host_syncs(cfg, ours_step)
    result["theirs"]["host_syncs"] = _count_host_syncs(cfg, lambda phase: hf.step(micro, phase))
    return result


def per_step_ops(events: Any, device: torch.device, steps: int) -> dict[str, dict[str, float]]:
    """Each profiled operator (and, on a GPU, each kernel) by name: calls per step and self time
    per step in milliseconds (the device's on CUDA, the host's elsewhere), from the profiler's
    ``key_averages`` over ``steps`` steps. Two rows' tables subtract to what a technique adds
    (:func:`memtrain.bench.hf.report.checkpointing_cost_lines`)."""
    def self_us(e: Any) -> float:
        if device.type != "cuda":
            return float(e.self_cpu_time_total)
        # torch >= 2.4 names it for any device; the CUDA name is the older one
        device_us = getattr(e, "self_device_time_total", None)
        return float(device_us if device_us is not None else getattr(e, "self_cuda_time_total", 0.0))

    return {e.key: {"count": e.count / steps, "self_ms": self_us(e) / 1e3 / steps} for e in events}


def _count_host_syncs(cfg: RunConfig, step: Callable[[Callable[[str], Any]], None]) -> dict[str, Any]:
    """Host syncs (memtrain.metrics.host_syncs) in the forward and backward passes of one
    ``step(phase)``: the count and its call sites, or why they were not counted. The optimizer
    phase is left out (bf16-pure's update is compiled, and nothing compiled runs under the
    counting mode), and so is a ``--compile`` row."""
    # on this side's turn: the package imports no torch before the lockstep baton
    from memtrain.metrics import HostSyncCounter

    if cfg.technique.compile:
        return {"count": None, "sites": "not counted: a compiled step cannot run under the counting mode"}
    counter = HostSyncCounter()
    try:
        step(lambda name: counter if name != "optimizer" else contextlib.nullcontext())
    except Exception as exc:  # a diagnostic: the profile's timings stand without it
        return {"count": None, "sites": f"not counted: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"}
    return {"count": counter.total, "sites": counter.describe(top=8)}

