"""Memory by module: which module holds the tracked bytes at the peak (``--memory-by-module``).

:class:`ModuleLedger` rides along a :class:`memtrain.metrics.MemoryMeter` (created only when
``--memory-by-module`` is on; without it no hook is installed and the meter is unchanged). It
gives every storage the meter tracks an *owner*, keeps the live bytes per (owner, category) and
copies them at each new peak, so the table it returns is the meter's ``by_category`` split by
owner: its entries sum to ``peak_bytes``, category by category.

Who owns a storage:

* parameters and buffers, their ``.grad`` and their optimizer state: the module the parameter
  belongs to (by its ``named_parameters`` name; a tied weight belongs to its first name);
* activations and temporaries: the innermost module whose forward (or backward) was running
  when the storage was allocated, as torch's ``ModTracker`` (the module tracker of
  ``torch.distributed._tools``, which torch's ``MemTracker`` uses) reports it: its global module
  hooks and multi-grad hooks follow the forward and the backward, activation checkpointing's
  recomputation included. Not the public ``torch.utils.module_tracker.ModuleTracker``: it also
  registers gradient hooks on the tensors a checkpointed block recomputes during backward, and
  those keep recomputed tensors alive longer (the tiny GPT with ``--checkpointing full``
  measured an 83 KB higher peak under it, the same peak under ``ModTracker``);
* the loss: ``(loss)``. memtrain's models compute it in ``model.loss_fn``, a plain function
  that no module hook sees; while the ledger is active, ``loss_fn`` runs through a tiny
  module call (:class:`LossScope`) so that the same tracker follows the loss's forward and
  backward (the full logits of the standard loss are allocated there);
* ``(optimizer)``: the optimizer step's scratch, the clipping and unscaling of the optimizer
  phase, and optimizer state of tensors the model does not own;
* ``(model)``: the model's own forward outside its children (the embedding sum of our GPT);
* ``(outside modules)``: the rest (``loss / grad_accum`` and the step's loss total under accumulation;
  a step of one micro-batch keeps the loss module's own output as its loss).

Paths are ``named_modules`` names with wrapper levels left out (a module, other than a
container, holding nothing but one child: memtrain's transformers wrapper ``lm``, DDP's
``module``, ``torch.compile``'s ``_orig_mod``), cut to ``depth`` parts. The default depth makes
each Transformer block one entry: ``blocks.0`` for our GPT, ``model.layers.0`` for a
transformers Llama.

Hand-written here, and why: torch's ``MemTracker`` (torch.distributed._tools.mem_tracker)
attributes memory to modules too, but per module and per phase at *each module's own* peak,
with its own optimizer attribution (see :mod:`memtrain.metrics.memory` for why the meter does
not use it); the question here is who holds the bytes at the *step's* peak, in the meter's
five categories. So the owner bookkeeping (a dictionary beside the meter's counters, copied at
each new peak as the meter copies its categories) is ours; which module is running comes from
torch's ``ModuleTracker``.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional

import torch
from torch import nn

from memtrain.techniques.facts import MEMORY_CATEGORIES

__all__ = [
    "LOSS",
    "MODEL",
    "OPTIMIZER",
    "OUTSIDE",
    "LossScope",
    "ModuleLedger",
    "default_module_depth",
    "module_paths",
]

LOSS = "(loss)"
OPTIMIZER = "(optimizer)"
MODEL = "(model)"
OUTSIDE = "(outside modules)"

Key = tuple[str, int]  # (owner, category index into MEMORY_CATEGORIES)


class LossScope(nn.Module):
    """A module call around ``loss_fn(hidden, weight, targets)``, so that module hooks see the loss.

    Only ``hidden`` and ``targets`` are positional: ModuleTracker ends the scope's backward
    once the gradients of its positional inputs are computed, and the LM-head weight, tied to
    the embedding, gets its gradient only at the very end of the backward pass.
    """

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor, *, weight: torch.Tensor,
                loss_fn: Callable[..., torch.Tensor]) -> torch.Tensor:
        return loss_fn(hidden, weight, targets)


def _is_wrapper(module: nn.Module) -> bool:
    """A module that holds nothing but one child (its name is left out of paths). A container
    (ModuleList, ModuleDict, Sequential) is not one: its one child of a one-layer model is
    ``blocks.0``."""
    if isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
        return False
    children = iter(module.children())
    if next(children, None) is None or next(children, None) is not None:
        return False
    return not any(True for _ in module.parameters(recurse=False)) and not any(True for _ in module.buffers(recurse=False))


def module_paths(root: nn.Module) -> dict[str, str]:
    """Each ``named_modules`` name of ``root`` -> its path without wrapper levels."""
    paths = {"": ""}
    modules = dict(root.named_modules())
    for name in modules:
        if not name:
            continue
        parent, _, child = name.rpartition(".")
        above = paths[parent]
        keep = not _is_wrapper(modules[parent])
        paths[name] = f"{above}.{child}".lstrip(".") if keep else above
    return paths


def default_module_depth(root: nn.Module) -> int:
    """The depth at which each Transformer block is one entry (``blocks.0``, ``model.layers.0``):
    one below the model's block list (``root.blocks``, memtrain's seam for both model families);
    2 for a model without one."""
    blocks = getattr(root, "blocks", None)
    if isinstance(blocks, nn.Module):
        paths = module_paths(root)
        for name, module in root.named_modules():
            if module is blocks and paths[name]:
                return len(paths[name].split(".")) + 1
    return 2


def _natural(name: str) -> list[Any]:
    """A sort key that orders the numbers inside a name by value."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name)]


class ModuleLedger:
    """Live bytes per (owner, category), and their copy at the meter's peak.

    The meter calls :meth:`owner_now` for each new allocation, :meth:`param_owner` for the
    roles it finds by walking the model and optimizer, :meth:`add` / :meth:`move` as storages
    appear, die, resize or change role, and :meth:`snapshot` at each new peak.
    """

    def __init__(self, root: nn.Module, depth: Optional[int] = None) -> None:
        if depth is not None and depth < 1:
            raise ValueError(f"module depth must be >= 1, got {depth}")
        self.depth = depth if depth is not None else default_module_depth(root)
        self._root = root
        self._paths = module_paths(root)
        # ModTracker names a module by the class name of the first module it saw run (the
        # root) followed by its named_children path: "GPT.blocks.0.attn"; a module outside the
        # model (the loss scope) by its class name alone.
        self._root_name = prefix = type(root).__name__
        self._owner: dict[str, str] = {prefix: MODEL, LossScope.__name__: LOSS}
        self._nesting: dict[str, int] = {prefix: 0}
        for name, path in self._paths.items():
            if name:
                self._owner[f"{prefix}.{name}"] = self._cut(path)
                self._nesting[f"{prefix}.{name}"] = name.count(".") + 1
        self._param_owner: dict[int, str] = {}
        self._cur: dict[Key, int] = {}
        self._peak: dict[Key, int] = {}
        self._tracker: Any = None  # the ModTracker while active
        self._entered: dict[str, int] = {}  # module name -> when its forward or backward last began
        self._clock = 0
        self._scope = LossScope()
        self._loss_fns: list[tuple[nn.Module, Any]] = []

    # ----------------------------------------------------------------------------- owners

    def _cut(self, path: str) -> str:
        return ".".join(path.split(".")[: self.depth]) if path else MODEL

    def param_owner(self, name: str, param: torch.Tensor) -> str:
        """The owner of parameter (or buffer) ``name`` of the root; remembered for its grad and state."""
        module, _, _ = name.rpartition(".")
        owner = self._cut(self._paths.get(module, module))
        self._param_owner[id(param)] = owner
        return owner

    def owner_of(self, tensor: torch.Tensor, default: str = OPTIMIZER) -> str:
        """The owner of a parameter seen by :meth:`param_owner`; ``default`` for any other tensor."""
        return self._param_owner.get(id(tensor), default)

    def owner_now(self, in_optimizer_step: bool, phase: Optional[str]) -> str:
        """The owner of a storage allocated now (see the module docstring)."""
        if in_optimizer_step:
            return OPTIMIZER
        running = self._running_module()
        if running is not None:
            return self._owner.get(running, f"({running})")  # a module outside the model: its class name
        return OPTIMIZER if phase == "optimizer" else OUTSIDE

    def _running_module(self) -> Optional[str]:
        """The tracker name of the module whose forward or backward runs now, or None.

        ModTracker's ``parents`` is a set, and in backward it can hold names that stay after
        their module's backward ended: a module whose output is its input (a dropout with
        p=0, an identity) has its "backward ended" hook run before its "backward began" one.
        So: of the names whose every ancestor that ran is present too (a stale name's block has
        ended, so it drops out), the one that began last; then the innermost present inside
        it, because modules that share one output tensor begin their backward inner first.
        """
        parents = self._tracker.parents
        live = [name for name in parents if name != "Global" and self._ancestors_present(name, parents)]
        if not live:
            return None
        latest = max(live, key=lambda name: self._entered.get(name, 0))
        inside = [name for name in live if self._inside(name, latest)]
        return max(inside, key=lambda name: self._nesting.get(name, 1))

    def _ancestors_present(self, name: str, parents: set[str]) -> bool:
        if name not in self._nesting:  # outside the model (the loss scope): the root's child
            return self._root_name in parents or self._root_name not in self._entered
        parts = name.split(".")
        for i in range(1, len(parts)):
            above = ".".join(parts[:i])
            if above not in parents and above in self._entered:  # containers never run: skipped
                return False
        return True

    def _inside(self, name: str, outer: str) -> bool:
        if name == outer or name.startswith(outer + "."):
            return True
        return outer == self._root_name and name not in self._nesting  # the loss scope is in the root

    def _on_enter(self, module: Optional[nn.Module], _: Any) -> None:
        """ModTracker's user hook as a module's forward or backward begins: remember when."""
        name = self._tracker.get_known_fqn(module) if module is not None else None
        if name is not None:
            self._clock += 1
            self._entered[name] = self._clock

    # ----------------------------------------------------------------------------- bytes

    def add(self, owner: str, cat: int, nbytes: int) -> None:
        """``nbytes`` more (or fewer, when negative) live bytes of ``owner`` in ``cat``."""
        key = (owner, cat)
        self._cur[key] = self._cur.get(key, 0) + nbytes

    def move(self, nbytes: int, old: Key, new: Key, alive_at_peak: bool) -> None:
        """A storage changed owner and role; ``alive_at_peak``: in the peak's copy too."""
        tables = (self._cur, self._peak) if alive_at_peak else (self._cur,)
        for table in tables:
            table[old] = table.get(old, 0) - nbytes
            table[new] = table.get(new, 0) + nbytes

    def snapshot(self) -> None:
        """The live bytes now are the peak's (called when the meter records a new peak)."""
        self._peak = dict(self._cur)

    def table(self) -> list[dict[str, Any]]:
        """Every owner holding bytes at the peak: ``{"module", "bytes", <category>: bytes...}``,
        largest first (ties by name, numbers in order: blocks.2 before blocks.10)."""
        rows: dict[str, dict[str, Any]] = {}
        for (owner, cat), nbytes in self._peak.items():
            if nbytes == 0:
                continue
            row = rows.setdefault(owner, {"module": owner, "bytes": 0, **{c: 0 for c in MEMORY_CATEGORIES}})
            row[MEMORY_CATEGORIES[cat]] += nbytes
            row["bytes"] += nbytes
        return sorted(rows.values(), key=lambda r: (-r["bytes"], _natural(r["module"])))

    # ----------------------------------------------------------------------------- hooks

    def __enter__(self) -> ModuleLedger:
        # Imported here: torch.distributed._tools loads FSDP and DTensor (seconds), which only a
        # run with --memory-by-module should pay for.
        from torch.distributed._tools.mod_tracker import ModTracker

        self._tracker = ModTracker()
        self._tracker.register_user_hooks(pre_fw_hook=self._on_enter, pre_bw_hook=self._on_enter)
        self._tracker.__enter__()
        self._entered = {}
        self._loss_fns = [(m, m.__dict__["loss_fn"]) for m in self._root.modules()
                          if callable(m.__dict__.get("loss_fn"))]
        for module, loss_fn in self._loss_fns:
            module.loss_fn = self._scoped(loss_fn)  # type: ignore[assignment]  # restored in __exit__
        return self

    def __exit__(self, *exc: Any) -> None:
        for module, loss_fn in self._loss_fns:
            module.loss_fn = loss_fn  # type: ignore[assignment]
        self._loss_fns = []
        if self._tracker is not None:
            self._tracker.__exit__(*exc)
            self._tracker = None

    def _scoped(self, loss_fn: Any) -> Callable[..., torch.Tensor]:
        scope = self._scope

        def scoped_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return scope(hidden, targets, weight=weight, loss_fn=loss_fn)

        # The model may ask which loss it runs (a transformers head with a bias accepts only
        # the standard one): it finds it here.
        scoped_loss.__wrapped__ = loss_fn  # type: ignore[attr-defined]
        return scoped_loss

