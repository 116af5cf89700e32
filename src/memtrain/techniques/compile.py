"""torch.compile: ``--compile [--compile-mode MODE] [--compile-scope model|block]``.

Both scopes compile IN PLACE with ``nn.Module.compile`` (which compiles the module's call)
and return the same object, instead of wrapping it in an ``OptimizedModule``:

* the model stays a ``GPT``: ``model.loss_fn``, ``model.hidden_states``, ``model.blocks``
  and ``model.cfg`` are the real attributes, not forwarded ones;
* ``state_dict`` keys keep their plain names (no ``_orig_mod.`` prefix), so checkpoints
  load into compiled and eager models alike;
* the distributed wrap that follows sees ordinary modules.

``model`` scope compiles the whole forward (embeddings, blocks, head and loss) into one
graph: the most fusion, the longest compile. ``block`` scope compiles each Transformer
block separately (as torchtitan does): blocks share one code object, so they compile once
and reuse the graph; embeddings and loss stay eager. Note that ``model.hidden_states``
called directly runs eagerly under ``model`` scope (only ``model(...)`` is compiled); under
``block`` scope its blocks run compiled.

Compile runs after activation checkpointing: dynamo traces ``torch.utils.checkpoint`` as
a higher-order op, so the recompute is kept in the compiled graph.

``--compile-memory-budget F`` sets ``torch._functorch.config.activation_memory_budget`` for
the compiled graphs: AOTAutograd's min-cut partitioner (inductor's, and the
``aot_eager_decomp_partition`` backend's) then saves at most F of the activations it saves by
default, above the graph's inputs, choosing what to recompute in backward by a knapsack over
the ops' FLOPs. Backends with another partitioner (``aot_eager``'s default one) ignore it.
"""

from __future__ import annotations

import functools
import os
import shutil
from typing import Any, Callable, Optional, Union

import torch._functorch.config as functorch_config
import torch.nn as nn

from memtrain.config.run import ConfigError, TechniqueConfig

__all__ = ["apply_compile", "has_cpp_compiler", "under_memory_budget"]


def has_cpp_compiler() -> bool:
    """Inductor's CPU backend writes C++ and needs a compiler (``$CXX``, g++ or clang++)."""
    cxx = os.environ.get("CXX")
    if cxx and shutil.which(cxx):
        return True
    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


def _compile_kwargs(tech: TechniqueConfig, backend: Union[str, Callable[..., Any]]) -> dict:
    if backend != "inductor":
        # Modes are inductor settings; other backends (used by fast tests) take none.
        return {"backend": backend}
    # mode "default" is torch.compile's own default; pass None so torch picks it.
    return {"backend": backend, "mode": None if tech.compile_mode == "default" else tech.compile_mode}


def under_memory_budget(compiled: Callable[..., Any], budget: float) -> Callable[..., Any]:
    """``compiled`` called with the partitioner's activation memory budget set to ``budget``.

    The budget is a global of ``torch._functorch.config`` that torch.compile does not capture:
    the partitioner reads it when dynamo compiles a frame, which is at the first call and again
    at every recompile (a new shape, a guard that fails), not when ``torch.compile`` is called.
    So it is set around every call of the compiled function, and only there: other compiled code
    of the process (torchao's optimizer step, another model) keeps torch's default. The patch is
    a few attribute writes per call; it also enters the AOTAutograd cache key, so a graph cached
    on disk under another budget is not reused. dynamo's in-process cache does not guard on it:
    a process that compiles a module under one budget and then another module of the same class
    under another reuses the first graph unless ``torch.compiler.reset()`` runs between them
    (the tracer does; a run compiles one model).
    """

    @functools.wraps(compiled)
    def call(*args: Any, **kwargs: Any) -> Any:
        with functorch_config.patch(activation_memory_budget=budget):
            return compiled(*args, **kwargs)

    return call


def _compile_in_place(module: nn.Module, kwargs: dict, budget: Optional[float]) -> None:
    """``module.compile(**kwargs)``, its compiled call under ``budget`` when one is given."""
    module.compile(**kwargs)
    if budget is not None:
        # nn.Module.compile stores the compiled call here and Module.__call__ runs it.
        module._compiled_call_impl = under_memory_budget(module._compiled_call_impl, budget)  # type: ignore[arg-type]


def apply_compile(model: nn.Module, tech: TechniqueConfig, backend: Union[str, Callable[..., Any]] = "inductor"
                  ) -> nn.Module:
    """Compile ``model`` (or each of ``model.blocks``) in place; return ``model``.

    ``backend`` is torch.compile's; "aot_eager" traces the same graphs (dynamo and
    AOTAutograd) without generating kernels, which tests use to stay fast;
    "aot_eager_decomp_partition" also partitions them as inductor does (decompositions and
    min-cut partitioner, so ``--compile-memory-budget`` applies), still without kernels. A
    callable backend (the tracer's) is passed as is.
    """
    if not tech.compile:
        return model
    device_types = {p.device.type for p in model.parameters()}
    if backend == "inductor" and "cpu" in device_types and not has_cpp_compiler():
        raise ConfigError(
            "--compile on CPU needs a C++ compiler (g++ or clang++, or set $CXX); install one or drop --compile"
        )
    kwargs = _compile_kwargs(tech, backend)
    budget = tech.compile_memory_budget
    if tech.compile_scope == "model":
        _compile_in_place(model, kwargs, budget)
    elif tech.compile_scope == "block":
        for block in model.blocks:  # type: ignore[union-attr]  # torch types nn.Module attributes as Tensor | Module
            _compile_in_place(block, kwargs, budget)
    else:
        raise ConfigError(f"unknown --compile-scope {tech.compile_scope!r}; choose model or block")
    return model
