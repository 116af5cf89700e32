"""Trace a real training step under fake tensors: the exact tracked peak, nothing allocated.

The real model, techniques, optimizer and training step (the step harness,
:mod:`memtrain.training.step`: ``build_state`` and ``measure_steps``) run under
``torch._subclasses.fake_tensor.FakeTensorMode``: every op computes shapes, dtypes and
strides but no data, so a 7B-parameter step "runs" on a laptop in seconds. The
:class:`memtrain.metrics.MemoryMeter` counts the fake storages exactly as it counts real ones,
so the traced peak is what the same step would measure (to the byte on CPU; on CUDA the
allocator's 512-byte rounding and caching come on top, as for any tracked figure).

Two steps are traced, as in a run: the first creates the optimizer state, the second is the
steady state whose peak is reported.

What fake tensors cannot do, and what is done instead:

* ``.item()`` has no value to return: the fake mode answers 1 (AdamW's step counter, the
  loss). Values never change memory here, so the fake mode also keeps no "constants" (real
  values of one-element tensors, which made every optimizer op run for real and uncached).
* ``Module.to`` swaps parameters and refuses fake ones that are weakly referenced (torch
  2.13): the model is built directly on the fake device in the parameter dtype, and while
  ``prepare_model`` runs, ``Module.to`` replaces parameters instead of swapping them.
* Fake CUDA tensors need a CUDA build of torch: the autograd engine asks for CUDA's device
  guard when it records a CUDA tensor, and a CPU-only build aborts the process there (not an
  exception). ``device_type="cuda"`` is therefore refused on such a build with a ConfigError;
  on a CUDA build the random kernels (dropout, init) are replaced by their memory footprint,
  since fake mode cannot reach the CUDA generator without a GPU.
* ``--compile`` is traced eagerly (the compiled graph's own memory planning is not traced),
  except with ``--compile-memory-budget``: what the partitioner saves under a budget has no
  analytic rule, so the model is compiled over the fake tensors with inductor's decompositions
  and partitioner, its graphs run op by op (:mod:`memtrain.analysis.compile_trace`), and the
  result gains ``compile`` {``memory_budget``, ``scope``, ``saved_activation_bytes`` (per
  forward pass), ``graphs``, ``forward_calls``}. Such a trace starts with ``torch.compiler.reset()``.
* torchao's optimizer steps (the low-bit AdamWs, and ``--precision bf16-pure``'s
  stochastic-rounding AdamW) are compiled functions, which cannot be compiled over fake tensors:
  they run eagerly, op by op, and their FP32 temporaries make the optimizer phase an upper
  bound (up to 2.3x the backward peak on small models), where the compiled step holds no
  scratch above the optimizer state. The result then says so in ``optimizer_step``. bf16-pure's
  AdamW updates its small tensors in buckets (memtrain.techniques.sr_adamw): a trace holds their
  copies, as the real step does, and skips the update's values; only where it leaves tensors to
  torchao's per-tensor step is its optimizer phase an upper bound and said so.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memtrain.analysis.flops.fake_ops import CpuStepFakeMode
from memtrain.config.run import ConfigError, RunConfig, TechniqueConfig
from memtrain.metrics import MemoryMeter
from memtrain.models.families import build_model
from memtrain.models.hf import same_paths_as_eager
from memtrain.models.spec import is_hf
from memtrain.runtime.extras import cuda_trace_refusal
from memtrain.techniques.compile import apply_compile
from memtrain.techniques.facts import precision_facts, torchao_compiled_step
from memtrain.techniques.precision import make_precision
from memtrain.training.step import build_state, measure_steps, random_micro_batches

if TYPE_CHECKING:
    from memtrain.analysis.compile_trace import SavedActivations

__all__ = ["trace_step", "trace_peak_bytes", "cuda_trace_supported"]

# What a trace of torchao's compiled optimizer step says about its optimizer phase.
EAGER_OPTIMIZER_STEP = ("torchao's compiled optimizer step was traced eagerly: the optimizer phase is an "
                        "upper bound (the compiled step holds no scratch above the optimizer state)")


def cuda_trace_supported() -> bool:
    """Whether fake CUDA tensors can run autograd in this torch build."""
    return torch.version.cuda is not None or torch.cuda.is_available()


def _item_stub(t: Any) -> Any:
    """What ``.item()`` answers on a fake tensor: 1 (True for bool). AdamW's step counter and
    the loss are read this way; no value ever changes the memory of a step."""
    if t.dtype == torch.bool:
        return True
    return 1.0 if t.dtype.is_floating_point else 1


def _stub_mode(device_type: str) -> Any:
    """On fake CUDA, a dispatch mode above the fake mode that replaces random kernels by
    allocations of the same size (the memory they would take); on CPU none is needed."""
    if device_type != "cuda":
        # Every op of a trace passes through each Python dispatch mode on the stack: a mode
        # that would only forward costs time for nothing.
        return contextlib.nullcontext()
    aten = torch.ops.aten
    inplace_random = {"uniform_", "normal_", "bernoulli_", "random_", "exponential_", "geometric_",
                      "log_normal_", "cauchy_"}

    class _Stubs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            if func is aten._local_scalar_dense.default:
                return _item_stub(args[0])
            name = func.overloadpacket.__name__
            if name in inplace_random:
                return args[0]
            if name == "native_dropout":
                x = args[0]
                return torch.empty_like(x), torch.empty_like(x, dtype=torch.bool)
            if name == "bernoulli":
                return torch.empty_like(args[0])
            if name in ("randint", "rand", "randn", "randperm"):
                size = next(a for a in args if isinstance(a, (list, tuple, torch.Size)))
                dtype = kwargs.get("dtype") or (torch.int64 if name in ("randint", "randperm") else torch.float32)
                return torch.empty(size, dtype=dtype, device=kwargs.get("device"))
            return func(*args, **kwargs)

    return _Stubs()


def _fake_mode() -> Any:
    """The fake mode a trace runs under: ``FakeTensorMode`` that answers ``.item()`` itself
    (:func:`_item_stub`) and keeps no constants.

    FakeTensorMode keeps the real value of every one-element tensor made by ``torch.tensor``
    (AdamW's ``step`` and ``lr``) and computes each op on such "constants" for real; an op with
    a constant among its inputs also bypasses the fake-kernel cache. Half of a traced step's
    optimizer ops touch ``step`` or ``lr``, so this made the optimizer phase most of a trace's
    time. Values never reach memory here (``.item()`` is answered before any constant is read)
    and an output's storage is the same with or without the constant, so a trace without them
    gives the same bytes, faster.
    """
    item = torch.ops.aten._local_scalar_dense.default

    class _TraceFakeMode(CpuStepFakeMode):  # a mixture-of-experts step too (memtrain.analysis.flops.fake_ops)
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func is item:
                return _item_stub(args[0])
            return super().__torch_dispatch__(func, types, args, kwargs)

        def may_turn_const(self, t: Any) -> bool:
            return False

    return _TraceFakeMode(allow_non_fake_inputs=True)


@contextlib.contextmanager
def _cuda_stubs(device_type: str) -> Iterator[None]:
    """On a CUDA build without a visible GPU, answer the few torch.cuda queries a step makes."""
    if device_type != "cuda" or torch.cuda.is_available():
        yield
        return
    saved = {name: getattr(torch.cuda, name) for name in ("get_rng_state", "set_rng_state", "is_bf16_supported")}
    torch.cuda.get_rng_state = lambda device="cuda": torch.empty(16, dtype=torch.uint8)  # type: ignore[assignment]
    torch.cuda.set_rng_state = lambda state, device="cuda": None  # type: ignore[assignment]
    torch.cuda.is_bf16_supported = lambda *a, **k: True  # type: ignore[assignment]
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.cuda, name, fn)


@contextlib.contextmanager
def _fake_safe_module_to() -> Iterator[None]:
    """``Module.to`` that replaces parameters instead of swapping them (swapping refuses fake
    tensors); a parameter already on the target device and dtype is left alone, so tied
    weights stay tied. Needed because peft moves its adapters with ``.to``."""
    original = torch.nn.Module.to

    def to(module, *args, **kwargs):  # type: ignore[no-untyped-def]
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        for m in module.modules():
            for store in (m._parameters, m._buffers):
                for name, t in list(store.items()):
                    if t is None:
                        continue
                    new = t.to(device=device, dtype=dtype if (dtype is not None and t.is_floating_point()) else None)
                    if new is t:
                        continue
                    if isinstance(t, torch.nn.Parameter):
                        new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
                    store[name] = new
        return module

    torch.nn.Module.to = to  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.nn.Module.to = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _fake_prepare(device: Any) -> Iterator[None]:
    """Where the technique pass runs under fake tensors: ``Module.to`` replaces parameters and
    new tensors land on the traced device."""
    with _fake_safe_module_to(), torch.device(device):
        yield


MAX_TRACE_LAYERS = 1024


# Micro-batches a traced step runs at most. From the second micro-batch of a step on, every
# gradient exists and each micro-batch repeats the same shapes, so later ones add nothing to any
# peak but their own input tensors, which the step's list of micro-batches holds
# (:class:`_SkippedMicroBatches` counts those); each is another full forward and backward to
# dispatch, though (a Llama-3-8B plan at micro-batch 1 x 8 spent 23-40 s per trace on eight of
# them). tests/test_trace_accum.py checks the capped trace against the full one.
TRACED_MICRO_BATCHES = 2


class _SkippedMicroBatches:
    """A traced step's micro-batches beyond the first ``run``, left out but still counted.

    The step harness holds every micro-batch of a step in one list (as the loader hands them
    out) and the meter counts an input tensor from the moment an op first shows it (the loss's
    ``targets.reshape``): from then until the step ends it is part of every later peak. So when
    the second micro-batch starts, each skipped micro-batch's inputs are counted the way the
    first one's are by then, as the last micro-batch of the full step would find them.
    ``around_micro_batch`` wraps each micro-batch (inside ``inner``, the compile trace's
    context, when given)."""

    def __init__(self, meter: MemoryMeter, run: int,
                 inner: Optional[Callable[[], ContextManager[Any]]] = None) -> None:
        self.meter = meter
        self.run = run
        self.inner = inner
        self._batches: list[Any] = []  # the step's every micro-batch
        self._started = 0  # micro-batches of this step begun

    def step(self, micro_batches: list[Any]) -> list[Any]:
        """The micro-batches to run of a step's ``micro_batches`` (all of them are held)."""
        self._batches, self._started = micro_batches, 0
        return micro_batches[:self.run]

    @contextlib.contextmanager
    def around_micro_batch(self) -> Iterator[None]:
        self._started += 1
        if self._started == 2:  # the first micro-batch is done: its inputs show what stays counted
            first = self._batches[0]
            for later in self._batches[self.run:]:
                for tensor, seen in zip(later, first):
                    category = self.meter.category_of(seen)
                    if category is not None:
                        self.meter.track(tensor, category=category)
        with (self.inner or contextlib.nullcontext)():
            yield


def trace_step(cfg: RunConfig, device_type: str = "cpu", steps: int = 2) -> dict[str, Any]:
    """Run ``steps`` training steps of ``cfg`` on fake tensors; return the last step's
    :class:`memtrain.metrics.MemoryStats` as a dict (``peak_bytes``, ``by_category``,
    ``peak_phase``, ``phase_peaks``...), plus ``device_type``. At most
    :data:`TRACED_MICRO_BATCHES` micro-batches of a step are run: the rest repeat them."""
    if device_type not in ("cpu", "cuda"):
        raise ConfigError(f"--trace-device {device_type!r}: use cpu or cuda")
    if cfg.model.n_layers > MAX_TRACE_LAYERS:
        # A trace dispatches every op of every layer (O(n_layers)); the analytic estimate is O(1).
        raise ConfigError(f"--trace runs every layer under fake tensors: at most {MAX_TRACE_LAYERS} layers, got "
                          f"{cfg.model.n_layers}; drop --trace for the analytic estimate, which answers any depth")
    if device_type == "cuda" and not cuda_trace_supported():
        raise ConfigError(cuda_trace_refusal())
    if precision_facts(cfg.technique.precision).fp8 and device_type != "cuda":
        raise ConfigError("--precision fp8 runs on FP8 tensor cores only, so its step is traced with CUDA kernels: "
                          "use --trace-device cuda (a CUDA build of torch) or the analytic estimate (drop --trace)")
    compiled = cfg.technique if cfg.technique.compile_memory_budget is not None else None
    if cfg.technique.compile:
        # Built eagerly; with a budget, compiled below over the fake tensors (see the module docstring).
        cfg = cfg.replace(compile=False, compile_memory_budget=None)
    device = torch.device(device_type)
    with _cuda_stubs(device_type):
        precision = make_precision(cfg.technique.precision, device)
        # fp16's GradScaler is left out of every trace: its memory is scalars, and over fake
        # tensors its inf check cannot read a value, so it skipped each step (no optimizer
        # state: the traced CPU peak was 29% under the measured one). Without a GPU it would also
        # disable itself.
        precision.scaler = None
        fake = _fake_mode()
        default_dtype = torch.get_default_dtype()
        # Compiled functions (torchao's low-bit optimizer steps) cannot be compiled over fake
        # tensors: run them eagerly. Their eager scratch is larger than the fused kernel's.
        # Only a transformers model needs transformers patched; importing it for memtrain's own
        # model cost each max-batch probe about as long as importing torch.
        hf_paths = same_paths_as_eager() if is_hf(cfg) else contextlib.nullcontext()
        with fake, _stub_mode(device_type), torch.compiler.set_stance("force_eager"), hf_paths:
            try:
                torch.set_default_dtype(precision.param_dtype)
                with torch.device(device):
                    base = build_model(cfg, with_weights=False)  # weights never matter to memory
            finally:
                torch.set_default_dtype(default_dtype)
            # prepare_model moves the model first (already where it should be); Module.to
            # cannot swap fake parameters (see the module docstring), so it replaces them.
            state = build_state(cfg, device, precision, base=base,
                                prepare_context=lambda: _fake_prepare(device))
            saved: Optional[SavedActivations] = None
            micro_context: Optional[Callable[[], ContextManager[Any]]] = None
            if compiled is not None:
                # Local import: compile_trace loads AOTAutograd, its partitioner and inductor's
                # decompositions (0.3-0.5 s), which only a trace compiled under a budget uses.
                from memtrain.analysis.compile_trace import SavedActivations, partition_recording_backend

                saved = SavedActivations()
                # Each trace compiles a new model with a new backend: dynamo never reuses the
                # graphs of earlier traces (it guards on the backend), but they stay in its cache
                # of Module._call_impl's code and count towards its recompile limit, past which
                # the model would run eagerly. So the cache starts empty.
                torch.compiler.reset()
                apply_compile(state.model, compiled, backend=partition_recording_backend(saved))
                # The model runs compiled; everything else (torchao's steps) stays eager.
                micro_context = lambda: torch.compiler.set_stance("default")  # noqa: E731
            meter = MemoryMeter(state.model, state.optimizer, by_module=cfg.train.memory_by_module,
                                module_depth=cfg.train.module_depth)
            batch = cfg.train.batch_size
            # The module table would place the skipped micro-batches' inputs elsewhere: traced in full.
            run = cfg.train.grad_accum if cfg.train.memory_by_module else min(cfg.train.grad_accum, TRACED_MICRO_BATCHES)
            skipped = _SkippedMicroBatches(meter, run, micro_context)
            measure_steps(state, lambda: skipped.step(random_micro_batches(cfg, batch, device)), steps=steps,
                          meter=meter, micro_context=skipped.around_micro_batch)
            skipped.step([])  # the last step's batches are gone once it returns, as in a run
            stats = meter.stats().to_dict()
    if compiled is not None and saved is not None:
        stats["compile"] = _saved_entry(saved, compiled, forward_passes=steps * run)
    stats["device_type"] = device_type
    stats["parameters"] = state.n_params
    stats["trainable_parameters"] = state.trainable_parameters  # train's figure (LoRA: the adapters)
    # bf16-pure's AdamW traces its buckets as they run (their copies) and its large tensors as
    # torchao's compiled kernel holds them (their state, no scratch: memtrain.techniques.sr_adamw);
    # it runs torchao's step eagerly (an upper bound) only for an AMSGrad group.
    if torchao_compiled_step(cfg.technique.optim, cfg.technique.precision) and \
            getattr(state.optimizer, "updated_alone", 1) > 0:
        stats["optimizer_step"] = EAGER_OPTIMIZER_STEP
    if state.offload is not None:  # --offload-activations: what the traced step moved each way
        # Every micro-batch moves the same tensors: the step's counts are per micro-batch x accum.
        stats["offload"] = {k: v // run * cfg.train.grad_accum for k, v in state.offload.counts.to_dict().items()}
    return stats


def _saved_entry(saved: SavedActivations, tech: TechniqueConfig, forward_passes: int) -> dict[str, Any]:
    """The ``compile`` entry of a trace compiled under a memory budget."""
    if saved.calls == 0:
        # dynamo fell back to eager (a graph break everywhere, a recompile limit): the figure
        # would be eager's, reported as the partition's.
        raise RuntimeError("the traced model never ran compiled; its partition cannot be measured")
    return {"memory_budget": tech.compile_memory_budget, "scope": tech.compile_scope,
            "saved_activation_bytes": saved.saved_bytes // forward_passes,
            "graphs": saved.graphs, "forward_calls": saved.calls // forward_passes}


def trace_peak_bytes(cfg: RunConfig, device_type: Optional[str] = None) -> int:
    """The traced steady-state peak of ``cfg`` (device type from ``cfg.train.device``)."""
    if device_type is None:
        device_type = "cuda" if cfg.train.device.startswith("cuda") else "cpu"
        if cfg.train.device == "auto":
            device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return int(trace_step(cfg, device_type)["peak_bytes"])
