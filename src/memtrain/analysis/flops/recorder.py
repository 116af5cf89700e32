"""The dispatch recorder: attributes every aten op to (phase, class) with its FLOPs and bytes."""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any, Iterable

from memtrain.analysis.flops.classes import (
    ELEMENTWISE_FLOPS,
    NO_BYTE_OPS,
    NO_FLOP_OPS,
    WRITE_ONLY,
    ClassCount,
    Shaped,
    classify,
)

if TYPE_CHECKING:  # torch stays out of import time for ``memtrain --help``
    import torch


def _unique_elements(t: "torch.Tensor") -> int:
    """Elements a kernel touches: a broadcast (stride-0) dimension is read once, not per copy."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n


def _tensors(value: Any) -> Iterable["torch.Tensor"]:
    # torch loads only when this runs: the CLI's start-up and the analytic commands import this module
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def op_bytes(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """Bytes one eager kernel reads and writes: each tensor input once, each output (or mutated
    argument) once. Views and allocations move nothing."""
    name = func._overloadpacket.__name__
    if getattr(func, "is_view", False) or name in NO_BYTE_OPS:
        return 0
    if name in _GATHER_BYTES:
        return _GATHER_BYTES[name](args, out)
    schema = func._schema
    total = 0
    out_ids: set[int] = set()
    for i, arg in enumerate(schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if value is None:
            continue
        written = arg.alias_info is not None and arg.alias_info.is_write
        for t in _tensors(value):
            n = _unique_elements(t) * t.element_size()
            if written:
                out_ids.add(id(t))
                total += n if name in WRITE_ONLY else 2 * n
            else:
                total += n
    for t in _tensors(out):
        if id(t) not in out_ids:  # an in-place op returns its mutated argument: counted above
            total += _unique_elements(t) * t.element_size()
    return total


def _nbytes(value: Any) -> int:
    return sum(_unique_elements(t) * t.element_size() for t in _tensors(value))


def _rows_read(args: tuple, out: Any) -> int:
    """A gather (embedding lookup): reads the indices and only the rows it returns."""
    return _nbytes(args[1]) + 2 * _nbytes(out)


def _nll_forward(args: tuple, out: Any) -> int:
    """NLL picks one log-probability per target: reads the targets and those N values."""
    logp, target = args[0], args[1]
    return _nbytes(target) + target.numel() * logp.element_size() + _nbytes(out)


def _nll_backward(args: tuple, out: Any) -> int:
    """Writes the (N x V) gradient (zeros and one value per row); reads targets, not logits."""
    return _nbytes(args[2]) + _nbytes(args[0]) + _nbytes(out)


# Ops that read only part of an input (the rest is used for its shape).
_GATHER_BYTES = {"embedding": _rows_read, "nll_loss_forward": _nll_forward,
                 "nll_loss_backward": _nll_backward}


def _elementwise_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> float:
    """Analytic FLOPs of an op the counter has no formula for (see ELEMENTWISE_FLOPS)."""
    # torch loads only when this runs: the CLI's start-up and the analytic commands import this module
    import torch

    name = func._overloadpacket.__name__
    if name in NO_FLOP_OPS or getattr(func, "is_view", False) or name in NO_BYTE_OPS:
        return 0.0
    if name in ELEMENTWISE_FLOPS:
        per, basis = ELEMENTWISE_FLOPS[name]
        if basis == "arg0":
            first = next(iter(_tensors(args[:1])), None)
            return per * (first.numel() if first is not None else 0)
        sizes = [t.numel() for t in _tensors((args, out))]
        return per * (max(sizes) if sizes else 0)
    tags = func.tags
    if torch.Tag.pointwise in tags:
        sizes = [t.numel() for t in _tensors(out)] or [t.numel() for t in _tensors(args)]
        return float(max(sizes) if sizes else 0)
    if torch.Tag.reduction in tags:
        sizes = [t.numel() for t in _tensors(args)]
        return float(max(sizes) if sizes else 0)
    return 0.0


def _innermost_modules(parents: Iterable[str]) -> list[str]:
    """The deepest running modules among the tracker's parents, sorted (``["Global"]`` when none).
    Several when sibling modules' backward passes are open together (a Llama MLP's ``act_fn`` and
    ``up_proj`` both receive their gradients from the one ``act(gate) * up`` product)."""
    names = [p for p in parents if p != "Global"]
    if not names:
        return ["Global"]
    depth = max(n.count(".") for n in names)
    return sorted(n for n in names if n.count(".") == depth)


def _common_ancestor(names: list[str]) -> str:
    """The deepest module path that every one of ``names`` lies in."""
    parts = [n.split(".") for n in names]
    shared = []
    for level in zip(*parts):
        if len(set(level)) > 1:
            break
        shared.append(level[0])
    return ".".join(shared) or "Global"


def backward_class(parents: Iterable[str], op: str, tensors: list[Shaped], vocab: int) -> str:
    """The class of a backward op run while the tracker holds ``parents`` (a set: its order
    changes with the hash seed, so the answer must not depend on it). Among sibling modules
    open at the same depth, the class they agree on; where they disagree (``act_fn``, ``other``,
    beside ``up_proj``, ``mlp_fc``) the op is none of the projections' own (a Linear's backward
    is its matmuls, decided the same way by every sibling of its kind) but the module around
    them: the class of their common ancestor, the one the op's forward ran in."""
    deepest = _innermost_modules(parents)
    classes = {classify(n, op, tensors, vocab) for n in deepest}
    if len(classes) == 1:
        return classes.pop()
    return classify(_common_ancestor(deepest), op, tensors, vocab)


def make_recorder(model: Any, tracker: Any, registry: dict, vocab: int, profile: bool = False) -> Any:
    """A TorchDispatchMode that attributes every aten op to (phase, class): FLOPs by the flop
    counter's formulas, analytic element-wise FLOPs, bytes. With ``profile`` it instead wraps
    each op in a profiler range ``mt::<class>`` so kernel time can be summed per class.

    Which module runs an op: in the forward pass, and whenever a module's forward runs during
    the backward pass (that is activation checkpointing recomputing it: phase ``recompute``),
    the innermost module on a stack kept by global forward hooks (``always_call``, so the stack
    stays balanced when checkpointing stops a recompute early by raising). Otherwise, in the
    backward pass proper, the innermost module of ``tracker`` (torch's ModuleTracker, the one
    FlopCounterMode uses, which follows gradients through module boundaries).
    """
    # torch loads only when this runs: the CLI's start-up and the analytic commands import this module
    import torch
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
    from torch.utils._python_dispatch import TorchDispatchMode

    names = {m: ("GPT." + n if n else "GPT") for n, m in model.named_modules()}

    class _Recorder(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.phase = "forward"
            self.stack: list[str] = []
            self.table: dict[str, dict[str, ClassCount]] = defaultdict(lambda: defaultdict(ClassCount))
            self._hooks: list[Any] = []

        def __enter__(self) -> "_Recorder":
            def push(module: Any, args: Any) -> None:
                self.stack.append(names.get(module, type(module).__name__))

            def pop(module: Any, args: Any, out: Any) -> None:  # must return None: a value would replace the output
                if self.stack:
                    self.stack.pop()

            self._hooks = [register_module_forward_pre_hook(push), register_module_forward_hook(pop, always_call=True)]
            return super().__enter__()

        def __exit__(self, *exc: Any) -> None:
            for h in self._hooks:
                h.remove()
            self.stack.clear()
            return super().__exit__(*exc)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            if func.namespace in ("prim", "profiler"):  # metadata queries (fake tensors ask for .device)
                return func(*args, **kwargs)
            name = func._overloadpacket.__name__
            phase = self.phase
            shaped = list(_tensors((args, kwargs)))
            if self.stack or _CORE_STACK:
                module = self.stack[-1] if self.stack else _CORE_STACK[-1]
                if phase == "backward":
                    phase = "recompute"
                cls = classify(module, name, shaped, vocab)
            elif phase == "backward":
                cls = backward_class(tracker.parents, name, shaped, vocab)
            else:
                cls = classify("GPT", name, shaped, vocab)
            if profile:
                with torch.profiler.record_function(f"mt::{cls}"):
                    return func(*args, **kwargs)
            out = func(*args, **kwargs)
            c = self.table[phase][cls]
            packet = func._overloadpacket
            if packet in registry:
                c.counted += registry[packet](*args, **kwargs, out_val=out)
            else:
                c.elementwise += _elementwise_flops(func, args, kwargs, out)
            c.bytes += op_bytes(func, args, kwargs, out)
            c.ops += 1
            return out

    return _Recorder()


# Attention modules whose checkpointed core (selective checkpointing) is running: a core
# recomputed during backward runs outside any module's forward, so the recorder looks here.
_CORE_STACK: list[str] = []


def in_core(name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    _CORE_STACK.append(name)
    try:
        return fn(*args, **kwargs)
    finally:
        _CORE_STACK.pop()
