"""What Liger-Kernel's patched causal-LM forward reads and passes, against the installed transformers.

``use_liger_kernel=True`` replaces ``<Family>ForCausalLM.forward`` with Liger's ``lce_forward``,
written against some transformers release. It reads ``self.config`` attributes and calls the
inner model, ``self.model(...)``, with that release's keyword arguments: Liger 0.8.5 passes
``past_key_values``, ``output_attentions``, ``output_hidden_states``, ``return_dict`` and
``cache_position``, where transformers 5.24's ``Qwen2Model.forward`` names ``cache`` (with
``past_key_values`` a deprecated alias until 5.40) and takes the rest through ``**kwargs``, which
it hands on to every decoder layer and from there to the attention. A config attribute or a
keyword that no level takes fails at the first step, on the GPU.

Both are read here without running Liger: its forward from the source file (importing
``liger_kernel.transformers`` imports its Triton kernels), transformers' side from signatures and
decorators.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import inspect
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable, Optional

__all__ = ["liger_call_gaps", "liger_config_gaps"]


def lce_forward_tree(model_type: str) -> Optional[ast.FunctionDef]:
    """Liger's ``liger_kernel/transformers/model/<model_type>.py`` ``lce_forward``, parsed from
    the installed file (None: no Liger, no such module or no such function)."""
    try:
        spec = importlib.util.find_spec("liger_kernel")  # the top package's spec: nothing imported
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / "transformers" / "model" / f"{model_type}.py"
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == "lce_forward":
                return node
    return None


def _self_attribute(node: ast.AST, owner: str) -> Optional[str]:
    """``NAME`` when ``node`` is ``self.<owner>.NAME`` (``owner`` empty: ``self.NAME``)."""
    if not isinstance(node, ast.Attribute):
        return None
    base = node.value
    if not owner:
        return node.attr if isinstance(base, ast.Name) and base.id == "self" else None
    if isinstance(base, ast.Attribute) and base.attr == owner and isinstance(base.value, ast.Name) \
            and base.value.id == "self":
        return node.attr
    return None


def config_reads(forward: ast.FunctionDef) -> list[str]:
    """The ``self.config.NAME`` attributes ``forward`` reads."""
    return sorted({name for node in ast.walk(forward) if (name := _self_attribute(node, "config"))})


def model_call_keywords(forward: ast.FunctionDef) -> list[str]:
    """The keyword names ``forward`` passes by name to ``self.model(...)`` (``**kwargs`` aside:
    what the caller gave is passed on as the unpatched forward passes it)."""
    names = {kw.arg for node in ast.walk(forward) if isinstance(node, ast.Call)
             and _self_attribute(node.func, "") == "model" for kw in node.keywords if kw.arg}
    return sorted(names)


def liger_config_gaps(model_type: str, config: Any) -> list[str]:
    """The ``self.config`` attributes Liger's patched forward for ``model_type`` reads and
    ``config`` lacks ([] when there is no such forward to read)."""
    forward = lce_forward_tree(model_type)
    return [] if forward is None else [n for n in config_reads(forward) if not hasattr(config, n)]


def _takes_var_keyword(function: Callable[..., Any]) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(function).parameters.values())


def _named_parameters(function: Callable[..., Any]) -> set[str]:
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {n for n, p in inspect.signature(function).parameters.items() if p.kind in kinds}


def _version_reached(version: str) -> bool:
    """Whether the installed transformers is at ``version`` or later."""
    from packaging.version import InvalidVersion, Version  # a transformers dependency; only needed here

    try:
        return Version(importlib.metadata.version("transformers")) >= Version(version)
    except (InvalidVersion, importlib.metadata.PackageNotFoundError):
        return False


def _literal(node: Optional[ast.expr]) -> Any:
    try:
        return ast.literal_eval(node) if node is not None else None
    except ValueError:
        return None


def renamed_keywords(function: Callable[..., Any]) -> dict[str, Optional[str]]:
    """Old name -> what ``@deprecate_kwarg(old, version, new_name=...)`` on ``function`` does with
    it: the new name it is renamed to, or None where it raises (told to from ``version`` on, and
    that version installed). A deprecation without a new name that does not raise is left out: the
    keyword goes on as it came."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return {}
    renames: dict[str, Optional[str]] = {}
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for deco in node.decorator_list:
            if not (isinstance(deco, ast.Call) and getattr(deco.func, "id", getattr(deco.func, "attr", None))
                    == "deprecate_kwarg"):
                continue
            kw = {k.arg: k.value for k in deco.keywords if k.arg}
            args = [_literal(a) for a in deco.args]
            old = args[0] if args else _literal(kw.get("old_name"))
            version = args[1] if len(args) > 1 else _literal(kw.get("version"))
            new = args[2] if len(args) > 2 else _literal(kw.get("new_name"))
            if not isinstance(old, str):
                continue
            if _literal(kw.get("raise_if_greater_or_equal_version")) is True and isinstance(version, str) \
                    and _version_reached(version):
                renames[old] = None
            elif isinstance(new, str):
                renames[old] = new
    return renames


def _inner_model_class(config: Any) -> Any:
    """The installed transformers' base model class for ``config`` (``Qwen2Model``)."""
    # transformers imports torch: only where a row asks for Liger
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    try:
        found = MODEL_MAPPING[type(config)]
    except KeyError:  # a config with no base model class in this transformers
        return None
    # a few model types map to several classes (a tuple); from_config takes the first unless the
    # config's architectures name another, and Liger's forwards are written for the first
    return found[0] if isinstance(found, tuple) else found


def _kwargs_receivers(model_class: Any) -> list[Callable[..., Any]]:
    """Where ``model_class.forward`` hands the keywords its ``**kwargs`` caught: the forwards of
    its modeling module's decoder-layer and attention classes, and the attention functions."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # as above: torch, only when asked

    module = sys.modules[model_class.__module__]
    receivers: list[Callable[..., Any]] = [
        vars(obj)["forward"] for name, obj in sorted(vars(module).items())
        if isinstance(obj, type) and obj.__module__ == module.__name__
        and name.endswith(("DecoderLayer", "Attention")) and "forward" in vars(obj)]
    eager = getattr(module, "eager_attention_forward", None)
    receivers += [eager] if callable(eager) else []
    receivers += [ALL_ATTENTION_FUNCTIONS[k] for k in ALL_ATTENTION_FUNCTIONS.keys()]
    return receivers


def _stop(keyword: str, function: Callable[..., Any]) -> Optional[str]:
    """Why ``function`` refuses ``keyword`` (None: it names it or takes ``**kwargs``)."""
    if keyword in _named_parameters(function) or _takes_var_keyword(function):
        return None
    return f"{keyword} ({function.__qualname__} takes no such argument)"


def liger_call_gaps(model_type: str, config: Any) -> list[str]:
    """The keywords Liger's patched forward for ``model_type`` passes to ``self.model(...)`` that
    the installed transformers does not take, each with the function that refuses it: the base
    model's forward (by name, by a ``deprecate_kwarg`` alias, or through ``**kwargs``), and for a
    keyword its ``**kwargs`` caught, every decoder layer, attention module and attention function
    it is handed on to. [] when there is no forward to read or no base model class for ``config``."""
    forward = lce_forward_tree(model_type)
    model_class = _inner_model_class(config) if forward is not None else None
    if forward is None or model_class is None:
        return []
    target = model_class.forward
    named, renames = _named_parameters(target), renamed_keywords(target)
    gaps: list[str] = []
    for keyword in model_call_keywords(forward):
        if keyword in renames and renames[keyword] is None:
            gaps.append(f"{keyword} ({target.__qualname__} refuses it, deprecated, in this transformers)")
            continue
        if keyword in named or renames.get(keyword) in named:
            continue
        stop = _stop(keyword, target)
        if stop is None:  # caught by **kwargs: handed on down the model
            stop = next((s for f in _kwargs_receivers(model_class) if (s := _stop(keyword, f))), None)
        if stop is not None:
            gaps.append(stop)
    return gaps
