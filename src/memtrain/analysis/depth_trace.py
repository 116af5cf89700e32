"""Trace a deep transformers model from two shallow copies of it, in seconds.

A trace dispatches every op of every decoder layer under fake tensors, about a millisecond per
op on a CPU, so a 32-layer 8B step takes a minute and an 80-layer 70B step a quarter of an hour.
The decoder layers of one config are identical, and so is what each layer adds to a step's
memory: its weights, gradients and optimizer state, what it saves for backward, its share of
the recomputation under checkpointing. Every category at the peak, every phase's peak and the
parameter count are therefore affine in the number of layers ``L``::

    bytes(L) = bytes(L1) + (bytes(L2) - bytes(L1)) * (L - L1) / (L2 - L1)

:func:`extrapolated_trace` traces the same model built with ``L1`` and ``L2`` layers and
extrapolates. The unit of repetition is one layer, or ``K`` layers under ``every:K``
checkpointing (``sqrt`` is ``every:round(sqrt(L))`` of the real depth); the probes have the
same remainder modulo ``K`` as ``L``, and at least two layers, so the first and last layers
(which touch the embedding and the final norm) are never the same layer.

Checked against full traces: equal to the byte in every category on tiny configs of Llama,
Qwen2, Mistral, Gemma and GPT-2 under six technique sets (tests/test_hf_depth.py), and on the
full-size Llama-3-8B QLoRA step (docs/models.md). Refused, so that the caller traces every
layer instead, when the layers are not all of one kind (a ``layer_types`` list mixing sliding
and full attention), under ``--compile-memory-budget`` (the partition is one choice over the
whole graph), and when the two probes peak in different phases or the extrapolated
phase peaks put the peak in
another phase than the probes' (then the step's shape changes with depth and a straight line
through two points says nothing).
"""

from __future__ import annotations

import time
from typing import Any, Optional

from memtrain.analysis.estimate.training import estimate, traced_offload
from memtrain.analysis.trace import trace_step
from memtrain.config.run import RunConfig
from memtrain.models import is_hf
from memtrain.models.auto_config import load_config
from memtrain.models.depth import layer_count
from memtrain.models.spec import cost_arch
from memtrain.techniques.facts import checkpoint_policy

__all__ = ["probe_depths", "extrapolated_trace", "trace_any_depth", "traced_estimate", "NotAffine"]


class NotAffine(Exception):
    """The step's memory is not a straight line in the depth: trace every layer."""


def _period(cfg: RunConfig) -> tuple[int, str]:
    """(K, policy for the probes): the layers repeat every K; ``sqrt`` fixed at the real depth."""

    policy = cfg.technique.checkpointing
    parsed = checkpoint_policy(policy)
    k = parsed.period(cfg.model.n_layers)  # the one rule of the checkpointed blocks (facts)
    return k, (f"every:{k}" if parsed.kind == "sqrt" else policy)


def probe_depths(cfg: RunConfig) -> Optional[tuple[int, int, str]]:
    """(L1, L2, checkpointing policy of the probes), or None when tracing every layer is as
    cheap (L2 >= L) or the layers are not all of one kind."""

    n = cfg.model.n_layers
    types = getattr(load_config(cfg.model.model), "layer_types", None)
    if isinstance(types, list) and len(set(types[:n])) > 1:
        return None
    k, policy = _period(cfg)
    l1 = n % k
    while l1 < 2:
        l1 += k
    l2 = l1 + k
    if l2 >= n:
        return None
    return l1, l2, policy


def _line(a: float, b: float, l1: int, l2: int, n: int) -> int:
    """The value at depth n of the line through (l1, a) and (l2, b), as whole bytes."""
    return int(round(a + (b - a) * (n - l1) / (l2 - l1)))


def extrapolated_trace(cfg: RunConfig, device_type: str = "cpu") -> dict[str, Any]:
    """``memtrain.analysis.trace.trace_step``'s result for ``cfg`` from two shallow traces, plus
    ``method: "extrapolated"`` and ``probe_layers``. Raises :class:`NotAffine` when the
    depths cannot be extrapolated (see the module docstring)."""
    if cfg.technique.compile_memory_budget is not None:
        # In model scope the budget is one knapsack over every layer's ops: no straight line.
        raise NotAffine("torch.compile's partition under a memory budget is chosen for the whole graph: "
                        "trace every layer")
    probes = probe_depths(cfg)
    if probes is None:
        raise NotAffine("the model is shallow or its layers differ: trace every layer")
    l1, l2, policy = probes
    probe_cfg = cfg.replace(checkpointing=policy) if policy != cfg.technique.checkpointing else cfg
    runs = []
    for depth in (l1, l2):
        with layer_count(depth):
            runs.append(trace_step(probe_cfg, device_type))
    a, b = runs
    n = cfg.model.n_layers
    if a["peak_phase"] != b["peak_phase"]:
        raise NotAffine(f"the {l1}- and {l2}-layer probes peak in different phases "
                        f"({a['peak_phase']}, {b['peak_phase']})")
    phases = {p: _line(a["phase_peaks"][p], b["phase_peaks"][p], l1, l2, n)
              for p in a["phase_peaks"] if p in b["phase_peaks"]}
    by_cat = {c: _line(a["by_category"][c], b["by_category"][c], l1, l2, n) for c in a["by_category"]}
    peak = sum(by_cat.values())
    top = max(phases, key=lambda p: phases[p]) if phases else a["peak_phase"]
    if phases and (top != a["peak_phase"] or abs(phases[top] - peak) > len(by_cat)):  # rounding
        raise NotAffine(f"at {n} layers the peak moves to the {top} phase")
    out = dict(b)
    out.update(
        peak_bytes=peak, by_category=by_cat, phase_peaks=phases,
        category_peaks={c: _line(a["category_peaks"][c], b["category_peaks"][c], l1, l2, n) for c in a["category_peaks"]},
        current_bytes=_line(a["current_bytes"], b["current_bytes"], l1, l2, n),
        current_by_category={c: _line(a["current_by_category"][c], b["current_by_category"][c], l1, l2, n)
                             for c in a["current_by_category"]},
        parameters=_line(a["parameters"], b["parameters"], l1, l2, n),
        trainable_parameters=_line(a["trainable_parameters"], b["trainable_parameters"], l1, l2, n),
        method="extrapolated", probe_layers=[l1, l2],
    )
    for key in ("offloaded_peak_bytes", "offloaded_at_peak_bytes"):  # --offload-activations' host bytes
        out[key] = _line(a.get(key, 0), b.get(key, 0), l1, l2, n)
    if "offload" in b:  # what the offloader moved: one set of copies per layer, affine in depth too
        out["offload"] = {k: _line(a["offload"][k], v, l1, l2, n) for k, v in b["offload"].items()}
    return out


def trace_any_depth(cfg: RunConfig, device_type: str = "cpu", full: bool = False) -> dict[str, Any]:
    """The step's trace: extrapolated from two shallow probes when the model is deep enough
    and its memory is affine in depth, else (or with ``full``) every layer traced. The result
    says which in ``method`` ("extrapolated" or "trace")."""

    if not full and is_hf(cfg):
        try:
            return extrapolated_trace(cfg, device_type)
        except NotAffine as why:
            reason = str(why)
        else:  # pragma: no cover - returned above
            reason = ""
    else:
        reason = "full trace asked for" if full else "memtrain's GPT"
    out = trace_step(cfg, device_type)
    out.update(method="trace", probe_layers=None, full_trace_reason=reason)
    return out


def traced_estimate(cfg: Any, device_type: str, full_trace: bool = False) -> dict[str, Any]:
    """The estimate JSON of a transformers model: its traced step (fake tensors, nothing
    allocated), in the contract's keys; the logits are part of the traced ``activations``.
    ``method`` says how: "extrapolated" (two shallow copies of the model traced, every
    category extended affinely to the real depth: memtrain.analysis.depth_trace) or "trace" (every
    layer; with ``full_trace``, for shallow models, or where the depth is not affine)."""
    start = time.perf_counter()
    traced = trace_any_depth(cfg, device_type, full=full_trace)
    cats = traced["by_category"]
    # What is traced is what memtrain.analysis.estimate.hf does not model (other families, QLoRA,
    # ...). Our GPT's analytic model with the llama substitutions is shown beside the trace with
    # its error, so nobody mistakes it for the answer.
    analytic = None
    try:
        e = estimate(cfg, cost_arch(cfg.model.model), device_type)
        analytic = {"peak_bytes": e.peak_bytes, "bytes": e.bytes,
                    "error_vs_trace": e.peak_bytes / traced["peak_bytes"] - 1 if traced["peak_bytes"] else None}
    except Exception:  # noqa: BLE001 - the approximation is optional; the trace is the answer
        pass
    return {
        "model": cfg.model.model,
        "method": traced["method"],
        "probe_layers": traced["probe_layers"],
        "note": ("traced under fake tensors with " + " and ".join(map(str, traced["probe_layers"]))
                 + " decoder layers, every category extended to " + str(cfg.model.n_layers) + " layers"
                 if traced["method"] == "extrapolated" else
                 "traced under fake tensors, every layer (" + traced["full_trace_reason"] + ")"),
        "parameters": traced.get("parameters"),
        "trainable_parameters": traced.get("trainable_parameters"),
        # A traced LoRA run trains the adapters alone (its base is frozen): they are its trainable
        # count, under the key the analytic estimate gives them.
        "adapter_parameters": traced.get("trainable_parameters") if cfg.technique.lora_rank else 0,
        "bytes": {"weights": cats["parameters"], "gradients": cats["gradients"], "optimizer": cats["optimizer"],
                  "activations": cats["activations"], "logits": None, "temporaries": cats["temporaries"]},
        "peak_bytes": traced["peak_bytes"],
        "peak_phase": traced["peak_phase"],
        "device_type": traced["device_type"],
        "trace_seconds": time.perf_counter() - start,
        "analytic_approximation": analytic,
        "trace": {"peak_bytes": traced["peak_bytes"], "by_category": cats, "peak_phase": traced["peak_phase"],
                  "device_type": traced["device_type"], "error": 0.0,
                  **{k: traced[k] for k in ("optimizer_step",) if k in traced},
                  **({"offload": traced_offload(traced)} if "offload" in traced else {})},
        # --offload-activations: the traced offloader's host bytes, where an analytic estimate has its own
        **({"offload": traced_offload(traced)} if "offload" in traced else {}),
    }
