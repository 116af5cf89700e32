"""The roofline of one step: a GPU's roofs, each class's position, the reconciliation with the rule."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Optional

from memtrain.analysis.flops.classes import MATMUL_CLASSES, OP_CLASSES, PHASES, ClassCount, StepCount
from memtrain.analysis.flops.count import count_step
from memtrain.analysis.flops.inventory import inventory_step, not_covered
from memtrain.config.run import ConfigError, RunConfig
from memtrain.devices.gpu_kinds import GPU_KINDS, gpu_table_key, named_gpu_key, peak_of, unknown_gpu_line
from memtrain.runtime.extras import cpu_only_torch
from memtrain.techniques.facts import PRECISION_FACTS, precision_facts


# --------------------------------------------------------------------------- roofline
@dataclass(frozen=True)
class Roof:
    """A GPU's roofline for one precision: tensor-core peak (matmuls), FP32 vector peak
    (everything else) and memory bandwidth."""

    gpu: str
    key: str
    dtype: str
    peak_flops: float
    vector_flops: float
    bandwidth: float

    @property
    def ridge(self) -> float:
        """FLOP/byte where the matmul roof turns from memory- to compute-bound."""
        return self.peak_flops / self.bandwidth

    @property
    def vector_ridge(self) -> float:
        return self.vector_flops / self.bandwidth

    def peak_for(self, op_class: str) -> float:
        return self.peak_flops if op_class in MATMUL_CLASSES else self.vector_flops

    def attainable(self, intensity: float, op_class: str) -> float:
        return min(self.peak_for(op_class), self.bandwidth * intensity)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.gpu, "key": self.key, "dtype": self.dtype, "peak_flops": self.peak_flops,
                "vector_peak_flops": self.vector_flops, "mem_bandwidth": self.bandwidth,
                "ridge": self.ridge, "vector_ridge": self.vector_ridge}




def resolve_roof(gpu: Optional[str], precision: str) -> Roof:
    """The roof for ``gpu`` (a short name such as ``h100`` or a device name; None: the visible
    CUDA GPU, else H100 SXM) at the matmul type of ``precision``. Torch loads only to look for a
    visible GPU, and not where the installed torch is a CPU-only build."""
    key = _visible_gpu_key() if gpu is None else named_gpu_key(gpu)
    if key is None:
        raise ConfigError(f"--gpu {unknown_gpu_line(str(gpu))}; for a card not listed, name the closest one")
    kind = GPU_KINDS[key]
    dtype = precision_facts(precision).matmul_type
    peak = peak_of(kind.flops, dtype)
    vector = peak_of(kind.flops, "fp32")
    if not peak or not vector:
        # Name what this card runs: "fp16 or fp32" was offered to an A100 asked for fp8, whose
        # BF16 is the usual choice, while plan named FP8 cards for the same request.
        runs = [p for p, f in PRECISION_FACTS.items() if peak_of(kind.flops, f.matmul_type)]
        raise ConfigError(f"--gpu {key} has no {dtype.upper()} tensor cores for --precision {precision}; choose "
                          f"one of --precision {', '.join(runs)} (the matmul types it has)")
    return Roof(kind.name, key, dtype, float(peak), float(vector), float(kind.mem_bandwidth))


def _visible_gpu_key() -> str:
    """The kind of the visible CUDA GPU, else H100 SXM's."""
    if cpu_only_torch():  # no CUDA to look for: torch need not load
        return "h100-sxm"
    # torch loads only where a CUDA build may find a GPU
    import torch

    if not torch.cuda.is_available():
        return "h100-sxm"
    name = torch.cuda.get_device_name()
    key = gpu_table_key(name)
    if key is None:
        raise ConfigError(f"the visible GPU {name!r} has no peak figures here; "
                          f"name a similar one with --gpu ({', '.join(GPU_KINDS)})")
    return key


def roofline_ops(count: StepCount, roof: Roof, measured_s: Optional[dict[str, float]] = None) -> list[dict[str, Any]]:
    """One row per operation class: FLOPs, bytes, intensity, attainable FLOP/s, verdict, the
    roofline time estimate (max of compute time and memory time) and, when a measured profile
    is given, the measured time and achieved FLOP/s."""
    classes = count.by_class()
    rows: list[dict[str, Any]] = []
    for name, label in OP_CLASSES:
        c = classes.get(name)
        if c is None or (c.flops == 0 and c.bytes == 0):
            continue
        intensity = c.flops / c.bytes if c.bytes else math.inf
        ridge = roof.peak_for(name) / roof.bandwidth
        est = max(c.flops / roof.peak_for(name), c.bytes / roof.bandwidth)
        row: dict[str, Any] = {
            "name": name, "label": label, "flops": c.flops, "counted_flops": c.counted,
            "elementwise_flops": c.elementwise, "bytes": c.bytes, "intensity": intensity,
            "bound": "compute" if intensity >= ridge else "memory",
            "ridge": ridge, "unit": "tensor" if name in MATMUL_CLASSES else "vector",
            "attainable_flops_per_s": roof.attainable(intensity, name) if c.bytes else roof.peak_for(name),
            "est_time_s": est,
            **{f"{p}_flops": count.table.get(p, {}).get(name, ClassCount()).flops for p in PHASES},
        }
        if measured_s is not None:
            t = measured_s.get(name)
            row["measured_time_s"] = t
            row["achieved_flops_per_s"] = c.flops / t if t else None
        rows.append(row)
    total_est = sum(r["est_time_s"] for r in rows) or 1.0
    for r in rows:
        r["est_time_share"] = r["est_time_s"] / total_est
    if measured_s is not None:
        total_meas = sum(v for v in measured_s.values() if v) or 1.0
        for r in rows:
            r["measured_time_share"] = (r["measured_time_s"] or 0.0) / total_meas
    return rows


def reconcile(cfg: RunConfig, count: StepCount) -> dict[str, float]:
    """Why the counted forward+backward differs from the 6ND + attention rule, term by term.

    - the rule's 6N includes the vectors, biases and norm weights, whose work is element-wise:
      the counter counts no FLOPs for them (addmm's bias add is not in its formula);
    - with untied embeddings the rule also counts the token embedding, a lookup (no FLOPs);
    - the rule already drops the learned position table (a lookup) where the model has one;
    - a fused attention kernel's backward computes the scores Q K^T again (torch's formula for
      it counts five matmuls to the forward's two, the rule four): the backward's count beyond
      twice the forward's;
    - what is left (``unexplained``) is 0 for the plain model; techniques that change the work
      (LoRA computes no gradients of frozen weights, a window only the band) show up there.
    The parameters are those of the model counted (``count.rule_terms``: our GPT's parameter
    table, or the built transformers model's parameters). The attention term needs no
    correction: the counter counts the full (T x T) score matrix, as the rule does, masked half
    included.
    """
    tokens = count.tokens
    counted = count.phase_total("forward", "counted") + count.phase_total("backward", "counted")
    fused = {p: count.table.get(p, {}).get("attn_fused", ClassCount()).counted for p in ("forward", "backward")}
    terms = {
        "rule_flops": count.rule_flops,
        "bias_and_norm_params": -6.0 * count.rule_terms["vector_params"] * tokens,
        "untied_embedding_lookup": -6.0 * count.rule_terms["untied_embedding_params"] * tokens,
        "fused_attention_backward_scores": fused["backward"] - 2.0 * fused["forward"],
    }
    terms["unexplained"] = counted - sum(terms.values())
    terms["counted_forward_backward"] = counted
    return terms


def step_count(cfg: RunConfig, count: bool = False) -> StepCount:
    """The FLOPs and bytes of one step of ``cfg`` by phase and class: from the analytic
    inventory where it describes ``cfg`` (our GPT; :func:`~memtrain.analysis.flops.inventory.not_covered`
    names the rest), else, or with ``count``, counted on a fake-tensor step (torch). The two are
    the same table where both answer (``tests/test_flop_inventory.py``)."""
    step = inventory_step(cfg) if not count and not_covered(cfg) is None else count_step(cfg)
    budget = cfg.technique.compile_memory_budget
    if budget is not None:
        # Both describe the step eagerly; what the compiled partition recomputes is chosen by
        # inductor's min-cut at compile time, so it is named here rather than guessed.
        step = replace(step, notes=[*step.notes, f"--compile-memory-budget {budget:g}: the compiled partition's "
                                    "recompute in backward is not in these figures (the step is described eagerly); "
                                    "memtrain estimate --trace shows what the partition saves"])
    return step


def flops_report(cfg: RunConfig, gpu: Optional[str] = None, measured_s: Optional[dict[str, float]] = None,
                 measured_device: Optional[str] = None, count: bool = False) -> dict[str, Any]:
    """Everything ``memtrain flops`` prints or writes as JSON (the contract's keys first).
    ``count``: count the step under fake tensors even where the inventory answers."""
    roof = resolve_roof(gpu, cfg.technique.precision)
    step = step_count(cfg, count)
    ops = roofline_ops(step, roof, measured_s)
    phases = {p: {"flops": step.phase_total(p), "counted_flops": step.phase_total(p, "counted"),
                  "bytes": step.phase_total(p, "bytes")} for p in PHASES}
    report: dict[str, Any] = {
        "total_flops": step.total_flops,
        "rule_flops": step.rule_flops,
        "ops": ops,
        "counter_flops": step.counter_flops,
        "phases": phases,
        "rule": step.rule_terms,
        "reconciliation": reconcile(cfg, step),
        "tokens": step.tokens,
        "parameters": step.n_params,
        "trainable_parameters": step.trainable_params,
        "adapter_parameters": step.trainable_params if cfg.technique.lora_rank else 0,  # as train and estimate
        "gpu": roof.to_dict(),
        "ridge": roof.ridge,
        "total_bytes": sum(r["bytes"] for r in ops),
        "est_step_time_s": sum(r["est_time_s"] for r in ops),
        "config": {"model": cfg.to_dict()["model"], "technique": cfg.to_dict()["technique"],
                   "batch_size": cfg.train.batch_size, "seq_len": cfg.train.seq_len,
                   "grad_accum": cfg.train.grad_accum},
        "notes": step.notes,
        "method": ("FLOPs: torch.utils.flop_counter.FlopCounterMode on one training step under "
                   "FakeTensorMode (CPU); element-wise and optimizer FLOPs analytic; bytes: sum of "
                   "input and output sizes of each eager aten op"),
    }
    if measured_s is not None:
        report["measured"] = {"device": measured_device, "step_time_s": sum(v for v in measured_s.values() if v),
                              "by_class_s": measured_s}
    return report
