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
"""

from __future__ import annotations

import os
import shutil

import torch.nn as nn

from memtrain.config.run import ConfigError, TechniqueConfig

__all__ = ["apply_compile", "has_cpp_compiler"]


def has_cpp_compiler() -> bool:
    """Inductor's CPU backend writes C++ and needs a compiler (``$CXX``, g++ or clang++)."""
    cxx = os.environ.get("CXX")
    if cxx and shutil.which(cxx):
        return True
    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


def _compile_kwargs(tech: TechniqueConfig, backend: str) -> dict:
    if backend != "inductor":
        # Modes are inductor settings; other backends (used by fast tests) take none.
        return {"backend": backend}
    # mode "default" is torch.compile's own default; pass None so torch picks it.
    return {"backend": backend, "mode": None if tech.compile_mode == "default" else tech.compile_mode}


def apply_compile(model: nn.Module, tech: TechniqueConfig, backend: str = "inductor") -> nn.Module:
    """Compile ``model`` (or each of ``model.blocks``) in place; return ``model``.

    ``backend`` is torch.compile's; "aot_eager" traces the same graphs (dynamo and
    AOTAutograd) without generating kernels, which tests use to stay fast.
    """
    if not tech.compile:
        return model
    device_types = {p.device.type for p in model.parameters()}
    if backend == "inductor" and "cpu" in device_types and not has_cpp_compiler():
        raise ConfigError(
            "--compile on CPU needs a C++ compiler (g++ or clang++, or set $CXX); install one or drop --compile"
        )
    kwargs = _compile_kwargs(tech, backend)
    if tech.compile_scope == "model":
        model.compile(**kwargs)
    elif tech.compile_scope == "block":
        for block in model.blocks:  # type: ignore[union-attr]  # torch types nn.Module attributes as Tensor | Module
            block.compile(**kwargs)
    else:
        raise ConfigError(f"unknown --compile-scope {tech.compile_scope!r}; choose model or block")
    return model
