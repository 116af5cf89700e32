"""Tracked memory: live tensor storage by category, exact, on any device.

``MemoryMeter`` counts the bytes of every live tensor *storage* (each storage once, however
many views share it) while a training step runs, sorted into five categories:

``parameters``   storages of module parameters and buffers;
``gradients``    storages held as ``.grad`` of parameters;
``optimizer``    storages held in ``optimizer.state`` (any nesting, tensor subclasses included);
``activations``  storages allocated in forward that are still alive (saved for backward,
                 outputs, the loss);
``temporaries``  everything else the step allocates (backward intermediates, optimizer scratch,
                 checkpoint recomputation).

Why not ``torch.distributed._tools.mem_tracker.MemTracker``: its live totals are exact, but
(1) every allocation inside ``optimizer.step`` is labelled optimizer state, so scratch buffers
inflate the optimizer share at the peak (AdamW on a small MLP: 1.32 MB "optimizer" at the peak
for 0.79 MB of real state); (2) its peak cannot be restarted after warm-up without touching
private fields, and it refuses a second forward of the root module unless its module stats are
reset; (3) it knows nothing of step phases; (4) it only looks one level deep into
``optimizer.state``; (5) like any dispatch mode that does not opt in, it makes
``torch.compile`` fall back to eager, so a compiled step's memory is not what it measures.
The tracker below keeps the parts that work (a ``TorchDispatchMode`` that sees every op output,
weakref finalizers on ``UntypedStorage`` to see frees, flattening of wrapper subclasses) and
fixes those points.

Device peaks (``torch.cuda.max_memory_allocated``/``max_memory_reserved``) are in
:mod:`memtrain.metrics.device_peak`; they include allocator rounding and caching, which the
tracked meter deliberately does not. The storage walk (each storage once, wrapper subclasses
flattened) is :mod:`memtrain.metrics.storage`.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch
from torch import nn
from torch._prims import rng_prims  # the RNG higher-order operators compiled code calls
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from memtrain.metrics.by_module import OPTIMIZER, OUTSIDE, ModuleLedger
from memtrain.metrics.storage import is_wrapper_type, leaf_storages, tensors_in
from memtrain.techniques.facts import MEMORY_CATEGORIES
from memtrain.techniques.offload import copying_to_host

__all__ = [
    "CATEGORIES",
    "MemoryMeter",
    "MemoryStats",
]

CATEGORIES: tuple[str, ...] = MEMORY_CATEGORIES  # one home: memtrain.techniques.facts

# Category indices. The first three are *roles* found by walking the model and optimizer; a lower
# index is the stronger role (a storage that is both a parameter and in optimizer state, as some
# optimizers keep, stays a parameter). The last two are decided by when a storage was allocated.
_PARAM, _GRAD, _OPT, _ACT, _TEMP = range(5)
# Host copies made by activation offloading (memtrain.techniques.offload): a ledger of their own,
# beside the device categories, never part of peak_bytes or by_category.
_HOST = len(CATEGORIES)
_ROLES = {"parameters": _PARAM, "gradients": _GRAD, "optimizer": _OPT,
          "activations": _ACT, "temporaries": _TEMP}


def _active_fake_mode() -> Any:
    """The FakeTensorMode in effect, or None (a C lookup: this runs once per op)."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)


def _in_autograd_backward() -> bool:
    """True while the autograd engine executes a backward graph on this thread."""
    return torch._C._current_graph_task_id() != -1


class _Record:
    """What the meter knows of one live storage."""

    __slots__ = ("nbytes", "cat", "seq", "ref", "owner")

    def __init__(self, nbytes: int, cat: int, seq: int, owner: str = OUTSIDE) -> None:
        self.nbytes = nbytes
        self.cat = cat
        self.seq = seq  # allocation order: tells whether the storage was alive at the peak
        self.ref: weakref.ref | None = None
        self.owner = owner  # the module holding it (read only with by_module)


@dataclass
class MemoryStats:
    """A report of one peak window of a ``MemoryMeter``.

    Attributes:
        peak_bytes: the largest total of live tracked bytes seen in the window.
        by_category: the five categories at that peak; they sum to ``peak_bytes``.
        category_peaks: each category's own maximum over the window.
        peak_phase: the innermost phase label current at the peak (None outside any phase).
        phase_peaks: the largest total seen while each phase label was current.
        current_bytes: live tracked bytes now.
        current_by_category: the five categories now.
        offloaded_peak_bytes: the most host bytes activation offloading held at once in the
            window (0 without ``--offload-activations``).
        offloaded_at_peak_bytes: host bytes it held at the moment of ``peak_bytes``.
        by_module: with ``by_module`` on, who holds the bytes at the peak
            (:meth:`MemoryMeter.module_table`); None otherwise, and then left out of ``to_dict``.
    """

    peak_bytes: int
    by_category: dict[str, int]
    category_peaks: dict[str, int]
    peak_phase: str | None
    phase_peaks: dict[str, int] = field(default_factory=dict)
    current_bytes: int = 0
    current_by_category: dict[str, int] = field(default_factory=dict)
    offloaded_peak_bytes: int = 0
    offloaded_at_peak_bytes: int = 0
    by_module: Optional[dict[str, Any]] = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy (without ``by_module`` when it is off, so results keep their keys)."""
        out = asdict(self)
        if out["by_module"] is None:
            del out["by_module"]
        return out


class _AllocationWatcher(TorchDispatchMode):
    """Forwards every op's outputs to the meter, so new storages are seen as they appear."""

    def __init__(self, meter: MemoryMeter) -> None:
        super().__init__()
        self._meter = meter
        # Tensors made under a *different* fake mode than the one active at entry are shape
        # propagation (DTensor, compile tracing), not memory the step holds.
        self._fake_mode = _active_fake_mode()

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Let ``torch.compile`` compile with the meter on (torch >= 2.9 reads this).

        Without it, dynamo refuses to compile under any non-infra dispatch mode: compiled models
        silently fall back to eager (so the meter would measure eager memory) and
        ``fullgraph=True`` callers such as torchao's low-bit optimizers fail outright. With it,
        the mode is off while compiling and on while the compiled code runs, so the buffers the
        compiled code allocates are counted; what happens inside a fused kernel is not.
        """
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if any(is_wrapper_type(t) for t in types):
            # Let a wrapper subclass (DTensor, torchao state, float8) run its own dispatch
            # first: the ops it issues on its inner tensors come back through this mode, so the
            # scratch it makes (e.g. the FP32 copy while quantizing) is seen too.
            return NotImplemented
        return self._observed(func(*args, **(kwargs or {})))

    def _observed(self, out: Any) -> Any:
        """Count ``out``'s new storages (unless made under another fake mode) and return it."""
        if _active_fake_mode() is self._fake_mode:
            self._meter._observe_output(out)
        return out


def _count_like_an_op(hop: Any) -> None:
    """Let the meter run ``hop`` as it runs any op: call it, then count its outputs.

    A dispatch mode that does not handle a higher-order operator makes it raise. Inductor wraps a
    random op (SDPA's CPU flash kernel, dropout) in ``run_and_save_rng_state`` /
    ``run_with_rng_state`` when a compiled region is checkpointed, so without this a compiled,
    checkpointed step failed under the meter with ``NotImplementedError``.
    """

    def handler(mode: _AllocationWatcher, *args: Any, **kwargs: Any) -> Any:
        # The mode is popped while a handler runs: the wrapped op runs as the compiled code
        # asked, and its outputs (the saved RNG state included) are counted here.
        return mode._observed(hop(*args, **kwargs))

    hop.py_impl(_AllocationWatcher)(handler)


for _hop in (rng_prims.run_and_save_rng_state, rng_prims.run_with_rng_state,
             rng_prims.graphsafe_run_with_rng_state):
    _count_like_an_op(_hop)


class MemoryMeter:
    """Counts live tensor storage by category during training steps; exact on any device.

    Use as a context manager around the steps to measure::

        meter = MemoryMeter(model, optimizer)
        with meter:
            with meter.phase("forward"):
                loss = model(x, y)
            with meter.phase("backward"):
                loss.backward()
            with meter.phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        stats = meter.stats()

    Parameters, buffers, existing gradients and optimizer state are counted from the moment
    the meter is entered; every storage an op creates inside it is counted until it is freed,
    even if the free happens after the meter is left. Tensors made before entry that are not
    parameters, gradients or optimizer state (the input batch) are not counted unless passed to
    ``track``.

    How a new storage is classified: allocated inside autograd's backward, inside the attached
    optimizer's ``step``, or inside a phase that is not a forward phase: ``temporaries``;
    otherwise (forward phases, or no phase at all): ``activations``. A storage is promoted to
    ``gradients`` as soon as autograd accumulates it into a parameter's ``.grad`` (a
    post-accumulate-grad hook), and to ``optimizer`` when it is found in ``optimizer.state``
    (after each ``step`` and whenever a phase starts or ends). A promotion is also applied to the
    breakdown of the peak already recorded when the storage was alive at that peak (allocated
    before it and alive still), so ``by_category`` reports every storage in its final role:
    a gradient produced by a backward matmul is a gradient at the peak even if the peak came the
    instant before autograd stored it in ``.grad``. ``category_peaks`` use the role known at
    each moment instead.

    Args:
        model: the module whose parameters and buffers are ``parameters`` (may be None).
        optimizer: its optimizer; may also be attached later with ``attach_optimizer``.
        device: count only storages of tensors on this device (type, or type and index), e.g.
            ``"cuda"`` to leave out the CPU scalars AdamW keeps for ``step``. None counts all.
        by_module: also attribute every storage to the module holding it and report the
            table at the peak (``MemoryStats.by_module``, :mod:`memtrain.metrics.by_module`);
            needs ``model``. Off, no module hook is installed.
        module_depth: with ``by_module``, the depth of module paths (None: each Transformer
            block one entry, :func:`memtrain.metrics.by_module.default_module_depth`).
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        device: str | torch.device | None = None,
        by_module: bool = False,
        module_depth: Optional[int] = None,
    ) -> None:
        self._models: list[nn.Module] = [model] if model is not None else []
        if by_module and model is None:
            raise ValueError("by_module attributes memory to the modules of a model: pass the model")
        # The owner bookkeeping exists only when asked for: off, every hook below is one
        # `is None` test and nothing else runs.
        self._ledger = ModuleLedger(model, module_depth) if by_module and model is not None else None
        self._optimizers: list[torch.optim.Optimizer] = []
        self._device = torch.device(device) if device is not None else None
        self._records: dict[int, _Record] = {}
        self._seq = 0
        self._cur = [0] * len(CATEGORIES)
        self._total = 0
        self._peak = 0
        self._peak_cats = [0] * len(CATEGORIES)
        self._peak_seq = 0
        self._peak_phase: str | None = None
        self._cat_peaks = [0] * len(CATEGORIES)
        self._host = 0  # live offloaded host bytes
        self._host_peak = 0
        self._host_at_peak = 0
        self._phase_peaks: dict[str, int] = {}
        self._phases: list[tuple[str, bool]] = []
        self._in_opt = 0
        self._depth = 0
        self._mode: _AllocationWatcher | None = None
        self._hooks: list[Any] = []
        # Parameters that carry our grad hook, by id; strong references (only while the meter
        # is active) because a weakref on a parameter makes nn.Module.to() fail when it swaps
        # tensors (torch.utils.swap_tensors refuses tensors with weakrefs).
        self._hooked: dict[int, torch.Tensor] = {}
        if optimizer is not None:
            self.attach_optimizer(optimizer)

    # ----------------------------------------------------------------------------- public API

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Count ``optimizer``'s state as ``optimizer`` and its step's scratch as temporaries."""
        if any(o is optimizer for o in self._optimizers):
            return
        self._optimizers.append(optimizer)
        if self._depth:
            self._install_optimizer_hooks(optimizer)
            self._scan()

    def track(self, *objs: Any, category: str = "activations") -> None:
        """Count tensors made outside the meter (e.g. the input batch) under ``category``.

        ``objs`` may be tensors, modules (their parameters and buffers) or nested containers
        of tensors. A storage already tracked keeps its category unless ``category`` is one of
        the stronger roles (parameters > gradients > optimizer).
        """
        if category not in _ROLES:
            raise ValueError(f"unknown category {category!r}; choose one of {', '.join(CATEGORIES)}")
        cat = _ROLES[category]
        for obj in objs:
            if isinstance(obj, nn.Module):
                tensors = [*obj.parameters(), *obj.buffers()]
            else:
                tensors = list(tensors_in(obj))
            for t in tensors:
                owner = self._ledger.owner_of(t, OUTSIDE) if self._ledger is not None else OUTSIDE
                self._assign(t, cat, owner)
        self._check_peak()

    def category_of(self, t: torch.Tensor) -> str | None:
        """The category ``t``'s (first) storage is counted in, or None when it is not counted."""
        for st, _ in leaf_storages(t):
            rec = self._records.get(id(st))
            if rec is not None and rec.cat != _HOST:
                return CATEGORIES[rec.cat]
        return None

    @contextlib.contextmanager
    def phase(self, name: str, activations: bool | None = None) -> Iterator[None]:
        """Label the step's phase; the label current at the peak becomes ``peak_phase``.

        Args:
            name: the label, e.g. "forward", "backward", "optimizer".
            activations: whether storages allocated in this phase (outside autograd's backward
                and the optimizer step) are activations. Default: names starting with
                "forward" or "fwd" are forward phases; others hold temporaries.
        """
        if activations is None:
            activations = name.startswith(("forward", "fwd"))
        self._phases.append((name, activations))
        self._scan()
        try:
            yield
        finally:
            self._scan()
            self._phases.pop()

    def stats(self) -> MemoryStats:
        """The current peak window's report (roles refreshed first, see the class docstring)."""
        self._scan()
        by_module = None
        if self._ledger is not None:
            by_module = {"depth": self._ledger.depth, "peak_bytes": self._peak, "peak_phase": self._peak_phase,
                         "modules": self._ledger.table()}
        return MemoryStats(
            peak_bytes=self._peak,
            by_category=dict(zip(CATEGORIES, self._peak_cats)),
            category_peaks=dict(zip(CATEGORIES, self._cat_peaks)),
            peak_phase=self._peak_phase,
            phase_peaks=dict(self._phase_peaks),
            current_bytes=self._total,
            current_by_category=dict(zip(CATEGORIES, self._cur)),
            offloaded_peak_bytes=self._host_peak,
            offloaded_at_peak_bytes=self._host_at_peak,
            by_module=by_module,
        )

    def current(self) -> dict[str, int]:
        """Live tracked bytes now, by category, plus ``total``."""
        self._scan()
        return {**dict(zip(CATEGORIES, self._cur)), "total": self._total}

    def reset_peak(self) -> None:
        """Start a new peak window at the current live bytes (e.g. after warm-up steps).

        Live accounting is kept: parameters, state and anything still alive stay counted.
        """
        self._scan()
        self._peak = self._total
        self._peak_cats = list(self._cur)
        self._peak_seq = self._seq
        self._peak_phase = self._current_phase()
        self._cat_peaks = list(self._cur)
        self._host_peak = self._host_at_peak = self._host
        self._phase_peaks = {}
        if self._peak_phase is not None:
            self._phase_peaks[self._peak_phase] = self._total
        if self._ledger is not None:
            self._ledger.snapshot()

    def __enter__(self) -> MemoryMeter:
        if self._depth == 0:
            for opt in self._optimizers:
                self._install_optimizer_hooks(opt)
            self._scan()
            if self._ledger is not None:
                self._ledger.__enter__()
            self._mode = _AllocationWatcher(self)
            self._mode.__enter__()
        self._depth += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            assert self._mode is not None
            self._mode.__exit__(*exc)
            self._mode = None
            if self._ledger is not None:
                self._ledger.__exit__(*exc)
            self._scan()
            for h in self._hooks:
                h.remove()
            self._hooks.clear()
            self._hooked.clear()
            self._in_opt = 0  # a step that raised never ran its post hook

    # ----------------------------------------------------------------------------- internals

    def _current_phase(self) -> str | None:
        return self._phases[-1][0] if self._phases else None

    def _alloc_category(self) -> int:
        """Category of a storage allocated now (see the class docstring)."""
        if copying_to_host():
            return _HOST
        if self._in_opt or _in_autograd_backward():
            return _TEMP
        if self._phases and not self._phases[-1][1]:
            return _TEMP
        return _ACT

    def _wanted(self, device: torch.device) -> bool:
        d = self._device
        if d is None:
            return True
        return device.type == d.type and (d.index is None or device.index == d.index)

    def _add(self, st: torch.UntypedStorage, cat: int, owner: str = OUTSIDE) -> _Record:
        """Start tracking a storage not seen before (``owner``: see ``by_module``)."""
        nbytes = st.nbytes()  # from the storage size: no data pointer needed (meta/fake work)
        self._seq += 1
        rec = _Record(nbytes, cat, self._seq, owner)
        key = id(st)
        # The finalizer runs when the storage itself dies (torch keeps one Python object per
        # storage alive as long as the storage is), so views and re-fetched storages are fine.
        rec.ref = weakref.ref(st, functools.partial(self._on_free, key, rec.seq))
        self._records[key] = rec
        if cat == _HOST:  # a host copy: booked apart, never in the device categories nor the module table
            self._host += nbytes
            self._host_peak = max(self._host_peak, self._host)
            return rec
        if self._ledger is not None:
            self._ledger.add(owner, cat, nbytes)
        self._cur[cat] += nbytes
        self._total += nbytes
        if self._cur[cat] > self._cat_peaks[cat]:
            self._cat_peaks[cat] = self._cur[cat]
        return rec

    def _on_free(self, key: int, seq: int, _ref: weakref.ref) -> None:
        rec = self._records.get(key)
        if rec is None or rec.seq != seq:
            return
        del self._records[key]
        if rec.cat == _HOST:
            self._host -= rec.nbytes
            return
        self._cur[rec.cat] -= rec.nbytes
        self._total -= rec.nbytes
        if self._ledger is not None:
            self._ledger.add(rec.owner, rec.cat, -rec.nbytes)

    def _resized(self, rec: _Record, nbytes: int) -> None:
        delta = nbytes - rec.nbytes
        rec.nbytes = nbytes
        if rec.cat == _HOST:
            self._host += delta
            self._host_peak = max(self._host_peak, self._host)
            return
        self._cur[rec.cat] += delta
        self._total += delta
        if self._ledger is not None:
            self._ledger.add(rec.owner, rec.cat, delta)
        if self._cur[rec.cat] > self._cat_peaks[rec.cat]:
            self._cat_peaks[rec.cat] = self._cur[rec.cat]

    def _observe_output(self, out: Any) -> None:
        """Called after every op inside the meter: count new storages, then check the peak."""
        leaves = (out,) if isinstance(out, torch.Tensor) else tree_leaves(out)
        cat = -1
        owner = OUTSIDE
        for t in leaves:
            if not isinstance(t, torch.Tensor):
                continue
            for st, dev in leaf_storages(t):
                rec = self._records.get(id(st))
                if rec is not None:
                    n = st.nbytes()
                    if n != rec.nbytes:  # resize_ / set_ grew or shrank it in place
                        self._resized(rec, n)
                else:
                    if cat < 0:
                        cat = self._alloc_category()
                        if self._ledger is not None:
                            owner = self._ledger.owner_now(self._in_opt > 0, self._current_phase())
                    if cat == _HOST or self._wanted(dev):  # a host copy is booked whatever the device
                        self._add(st, cat, owner)
        self._check_peak()

    def _check_peak(self) -> None:
        total = self._total
        phase = self._current_phase()
        if phase is not None and total > self._phase_peaks.get(phase, -1):
            self._phase_peaks[phase] = total
        if total > self._peak:
            self._peak = total
            self._peak_cats = list(self._cur)
            self._peak_seq = self._seq
            self._peak_phase = phase
            self._host_at_peak = self._host
            if self._ledger is not None:
                self._ledger.snapshot()

    def _assign(self, t: torch.Tensor, cat: int, owner: str = OUTSIDE) -> None:
        """Give ``t``'s storages the role ``cat`` and (``by_module``) the owner ``owner``,
        tracking them if new."""
        for st, dev in leaf_storages(t):
            rec = self._records.get(id(st))
            if rec is None:
                if self._wanted(dev):
                    self._add(st, cat, owner)
                continue
            n = st.nbytes()
            if n != rec.nbytes:
                self._resized(rec, n)
            if cat >= rec.cat or rec.cat == _HOST:  # (a host copy never takes a device role)
                continue  # already this role, or a stronger one
            old = rec.cat
            rec.cat = cat
            self._cur[old] -= rec.nbytes
            self._cur[cat] += rec.nbytes
            if self._cur[cat] > self._cat_peaks[cat]:
                self._cat_peaks[cat] = self._cur[cat]
            if self._ledger is not None:
                self._ledger.move(rec.nbytes, (rec.owner, old), (owner, cat), rec.seq <= self._peak_seq)
                rec.owner = owner
            if rec.seq <= self._peak_seq:
                # Allocated before the peak and alive now, hence alive at the peak: report it
                # there in its real role.
                self._peak_cats[old] -= rec.nbytes
                self._peak_cats[cat] += rec.nbytes

    def _scan(self) -> None:
        """Walk model and optimizers: assign roles, count pre-existing tensors, hook grads."""
        ledger = self._ledger
        for model in self._models:
            for name, p in model.named_parameters():
                owner = ledger.param_owner(name, p) if ledger is not None else OUTSIDE
                self._assign(p, _PARAM, owner)
                if p.grad is not None:
                    self._assign(p.grad, _GRAD, owner)
                if self._depth and p.requires_grad and id(p) not in self._hooked:
                    self._hooked[id(p)] = p
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
            for name, b in model.named_buffers():
                self._assign(b, _PARAM, ledger.param_owner(name, b) if ledger is not None else OUTSIDE)
        for opt in self._optimizers:
            self._scan_optimizer(opt)
        self._check_peak()

    def _scan_optimizer(self, opt: torch.optim.Optimizer) -> None:
        ledger = self._ledger
        for param, state in opt.state.items():  # the state of a parameter belongs to its module
            owner = ledger.owner_of(param, OPTIMIZER) if ledger is not None else OUTSIDE
            for t in tensors_in(state):
                self._assign(t, _OPT, owner)
        owner = OPTIMIZER if ledger is not None else OUTSIDE
        for group in opt.param_groups:  # tensor hyper-parameters (capturable lr) are state too
            for k, v in group.items():
                if k != "params":
                    for t in tensors_in(v):
                        self._assign(t, _OPT, owner)

    def _on_grad(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self._assign(p.grad, _GRAD, self._ledger.owner_of(p, OUTSIDE) if self._ledger is not None else OUTSIDE)

    def _install_optimizer_hooks(self, opt: torch.optim.Optimizer) -> None:
        def pre(*_: Any) -> None:
            self._in_opt += 1

        def post(optimizer: torch.optim.Optimizer, *_: Any) -> None:
            self._in_opt -= 1
            self._scan_optimizer(optimizer)

        self._hooks.append(opt.register_step_pre_hook(pre))
        self._hooks.append(opt.register_step_post_hook(post))
