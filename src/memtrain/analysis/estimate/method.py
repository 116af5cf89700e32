"""How one training step's memory is estimated: the choice of method, made once for every caller.

- memtrain's GPT (and the analytic presets): the analytic model (:func:`memtrain.analysis.estimate.estimate`),
  method "analytic", no torch.
- a transformers model whose family and techniques the analytic model covers
  (:func:`memtrain.analysis.estimate.hf.why_not_modelled`): the same analytic model with the
  transformers inventory, method "analytic". Reading the model's config goes through
  transformers, which loads torch; the estimate itself is arithmetic.
- any other transformers model, or one asked to be traced in full: its step traced under fake
  tensors (:func:`memtrain.analysis.depth_trace.traced_estimate`), method "extrapolated" (two
  shallow copies, every category extended to the depth) or "trace" (every layer).

``memtrain estimate`` and the bench worker's "estimate" of a row both call :func:`estimate_step`,
so a bench row of a transformers model shows that model's estimate, as the command does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from memtrain.analysis.estimate.compile_budget import interpolated_budget
from memtrain.analysis.estimate.hf import analytic_estimate, hf_arch, why_not_modelled
from memtrain.analysis.estimate.training import Estimate, estimate
from memtrain.config.archs import GPT2_ARCH, Arch
from memtrain.config.run import ConfigError, RunConfig
from memtrain.models.light_config import analytic_config
from memtrain.models.spec import is_hf, window_refusal
from memtrain.techniques.facts import transformers_checkpointing_error

__all__ = ["HF_ANALYTIC_MODEL", "StepEstimate", "estimate_step", "model_arch"]

HF_ANALYTIC_MODEL = "analytic model of transformers decoder layers (memtrain.analysis.estimate.hf)"
HF_ANALYTIC_NOTE = HF_ANALYTIC_MODEL + "; --trace to check it"


@dataclass
class StepEstimate:
    """One step's estimate and how it was made."""

    method: str  # "analytic", "extrapolated" or "trace"
    json: dict[str, Any]  # what `memtrain estimate --json` prints, before --budget/--gpu/--trace add theirs
    cfg: RunConfig  # the config estimated (a traced transformers model: one process, no sharding)
    analytic: Optional[Estimate] = None  # the analytic model's answer (method "analytic")
    arch: Optional[Arch] = None  # the architecture the analytic model used
    not_analytic: Optional[str] = None  # why a transformers model was traced


def model_arch(cfg: RunConfig) -> Optional[Arch]:
    """The analytic architecture of a run's config: memtrain's GPT's, or None for a transformers
    model (which :func:`estimate_step` resolves from its config)."""
    return None if is_hf(cfg) else GPT2_ARCH


def estimate_step(cfg: RunConfig, device_type: str, arch: Optional[Arch] = GPT2_ARCH, *, world_size: int = 1,
                  shard: Optional[str] = None, gpu: Optional[str] = None, full_trace: bool = False) -> StepEstimate:
    """The estimate of one training step of ``cfg`` with ``device_type`` kernel facts.

    ``arch`` is the analytic architecture of memtrain's GPT or of an analytic preset; None means
    ``cfg`` names a transformers model (:func:`model_arch`). ``world_size``/``shard``: one rank's
    share (analytic models only). ``gpu``: also the caching-allocator model (analytic, CUDA).
    ``full_trace``: trace every layer of a transformers model instead of using its analytic model."""
    if arch is not None:
        est = estimate(cfg, arch, device_type, world_size=world_size, shard=shard, gpu=gpu)
        out = est.to_dict()
        if cfg.technique.compile_memory_budget is not None:
            # The partition under a budget has no analytic rule: a labelled interpolation.
            out["compile_memory_budget"] = interpolated_budget(cfg, arch, device_type, world_size=world_size,
                                                               shard=shard)
        return StepEstimate("analytic", out, cfg, est, arch)
    refusal = transformers_checkpointing_error(cfg.technique.checkpointing)
    if refusal is None and cfg.technique.window is not None:
        assert cfg.model.model is not None  # a transformers model (arch is None)
        refusal = window_refusal(analytic_config(cfg.model.model))
    if refusal is not None:  # the run would refuse it: so does its estimate, analytic or traced
        raise ConfigError(refusal)
    reason = why_not_modelled(cfg, device_type)
    if world_size > 1:
        # One rank's share is the analytic model's (the same sharding rules as for our GPT);
        # a trace runs one process, which holds no shards. What is modelled depends on the shard
        # the rank holds (QLoRA's NF4 weights: not under FSDP2).
        if shard and shard != cfg.technique.distributed:
            reason = why_not_modelled(cfg.replace(distributed=shard), device_type)
        if reason is not None:
            raise ConfigError(f"--world-size for a transformers --model needs its analytic model, and {reason}; "
                              "drop --world-size to trace one process")
        return _hf_analytic(cfg, device_type, gpu, world_size, shard)
    # One process trains the unsharded model: the trace needs no process group.
    cfg = cfg.replace(distributed="none", cpu_offload=False) if cfg.technique.distributed != "none" else cfg
    if reason is None and not full_trace:
        return _hf_analytic(cfg, device_type, gpu, world_size, shard)
    # The torch line, crossed here only: a traced estimate builds the model under fake tensors.
    from memtrain.analysis.depth_trace import traced_estimate

    out = traced_estimate(cfg, device_type, full_trace=full_trace)
    out["not_analytic"] = reason or "--full-trace"
    return StepEstimate(out["method"], out, cfg, not_analytic=out["not_analytic"])


def _hf_analytic(cfg: RunConfig, device_type: str, gpu: Optional[str], world_size: int,
                 shard: Optional[str]) -> StepEstimate:
    est = analytic_estimate(cfg, device_type, gpu=gpu, world_size=world_size, shard=shard)
    assert est is not None and cfg.model.model is not None  # a transformers model why_not_modelled covers
    out = {"model": cfg.model.model, "method": "analytic", "note": HF_ANALYTIC_NOTE, **est.to_dict()}
    return StepEstimate("analytic", out, cfg, est, hf_arch(cfg.model.model))
