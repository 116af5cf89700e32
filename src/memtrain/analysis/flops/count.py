"""Counted FLOPs and bytes of one training step (FlopCounterMode under FakeTensorMode)."""

from __future__ import annotations

import contextlib
import functools
import json
import math
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from memtrain.analysis.flops.classes import ClassCount, StepCount, split_attention
from memtrain.analysis.flops.recorder import in_core, make_recorder
from memtrain.analysis.flops.rules import RuleParams, assemble_step, model_rule_params
from memtrain.analysis.limits import check_analytic_size
from memtrain.config.run import ConfigError, ModelConfig, RunConfig
from memtrain.techniques.facts import checkpoint_policy

if TYPE_CHECKING:  # torch stays out of import time for ``memtrain --help``
    import torch


def _precision_for_count(name: str) -> Any:
    """The run's precision on CPU, built without make_precision's global TF32 switches (a
    count must not change the settings of a run in the same process)."""
    from memtrain.techniques.precision import precision_for_count  # torch-free --help/estimate/plan

    return precision_for_count(name, "cpu")


def _extra_flop_formulas() -> dict:
    """Formulas the counter lacks in torch 2.13, with the counts of torch's own formulas:

    * in-place ``addmm_`` / ``baddbmm_`` (the chunked loss accumulates the LM-head weight
      gradient with ``addmm_``; without this a third of the LM head would go uncounted);
    * the CPU flash-attention kernels SDPA picks on CPU (torch registers the CUDA ones only);
    * ``grouped_mm``, the experts' matmuls of a mixture-of-experts layer (Mixtral, Qwen3-MoE).
    """
    # torch loads only when this runs: the CLI's start-up and the analytic commands import this module
    import torch
    from torch.utils import flop_counter as fc

    from memtrain.analysis.flops.fake_ops import grouped_mm_flops  # imports torch: loaded only for a count

    aten = torch.ops.aten
    mapping: dict = {}
    if aten.addmm_ not in fc.flop_registry:
        mapping[aten.addmm_] = lambda self, a, b, *args, out_shape=None, **kw: fc.mm_flop(a, b)
    if aten.baddbmm_ not in fc.flop_registry:
        mapping[aten.baddbmm_] = lambda self, a, b, *args, out_shape=None, **kw: fc.bmm_flop(a, b)
    fwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if fwd is not None and fwd not in fc.flop_registry:
        mapping[fwd] = lambda q, k, v, *a, out_shape=None, **kw: fc.sdpa_flop_count(q, k, v)
    if bwd is not None and bwd not in fc.flop_registry:
        mapping[bwd] = lambda g, q, k, v, *a, out_shape=None, **kw: fc.sdpa_backward_flop_count(g, q, k, v)
    if aten._grouped_mm not in fc.flop_registry:
        mapping[aten._grouped_mm] = grouped_mm_flops
    return mapping


def _counting_config(cfg: RunConfig, **overrides: Any) -> RunConfig:
    """The config a count runs: the same model and techniques on CPU, eager (compile fuses
    kernels but does not change the FLOPs), single process."""
    return cfg.replace(compile=False, compile_memory_budget=None, distributed="none", cpu_offload=False,
                       device="cpu", **overrides)


def _use_fused_dropout(model: Any) -> None:
    """Make this (throwaway) model run dropout as CUDA does: one fused ``native_dropout`` kernel
    (output and mask in one pass). On CPU ``F.dropout`` decomposes into bernoulli_, div_ and
    mul kernels, three passes over the tensor; counting those would describe bytes no GPU
    moves. FLOPs are unaffected. ``nn.Dropout`` modules get an instance ``forward``; attention
    functions (which call ``F.dropout`` inside, e.g. the math backend) run under a
    TorchFunctionMode that rewrites the call. Both act again in checkpointing's recompute,
    which must see the same ops as the forward did."""

    # torch loads only when this runs: the CLI's start-up and the analytic commands import this module
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    from memtrain.techniques.checkpointing import checkpointed_call  # torch-free --help/estimate/plan

    def fused(x: torch.Tensor, p: float, train: bool) -> torch.Tensor:
        return torch.native_dropout(x, p, True)[0] if train and p > 0.0 else x

    targets = {F.dropout, torch.dropout}

    class _FusedDropout(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            if func in targets:
                p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
                train = kwargs.get("training", kwargs.get("train", args[2] if len(args) > 2 else True))
                return fused(args[0], p, train)
            return func(*args, **kwargs)

    def wrap_attention(fn: Any) -> Any:
        def attn_fn(*args: Any, **kwargs: Any) -> Any:
            with _FusedDropout():
                return fn(*args, **kwargs)
        return attn_fn

    def module_dropout(x: torch.Tensor, p: float, train: bool) -> torch.Tensor:
        # A module must return a new tensor even when it drops nothing (p = 0): were its output
        # its input, torch's ModuleTracker (the counter's backward attribution) would see the
        # one tensor enter and leave the module, fire its exit before its entry and keep the
        # module "running" for the rest of the backward, so every later op's class would depend
        # on the iteration order of a set of strings (the process's hash seed). A view moves no
        # bytes and computes nothing.
        out = fused(x, p, train)
        return x.view_as(x) if out is x else out

    names = {m: ("GPT." + n if n else "GPT") for n, m in model.named_modules()}
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.forward = (lambda m: lambda x: module_dropout(x, m.p, m.training))(module)  # type: ignore[method-assign]  # patches this instance's forward on purpose
        elif isinstance(module, nn.Identity):
            # The same for an Identity (peft's LoRA dropout at --lora-dropout 0): with LoRA the
            # backward's classes varied from one process to the next.
            module.forward = lambda x, *args, **kwargs: x.view_as(x)  # type: ignore[method-assign]  # this instance only
        fn = getattr(module, "attn_fn", None)
        if isinstance(fn, functools.partial) and fn.func is checkpointed_call:
            # Selective checkpointing checkpoints the attention core: the mode must be active
            # inside it, where its recompute runs too, not around it. The core is no module,
            # so it names its attention module on _CORE_STACK for the recorder.
            inner = wrap_attention(fn.args[0])
            core = (lambda f, name: lambda *a, **k: in_core(name, f, *a, **k))(inner, names[module])
            module.attn_fn = functools.partial(fn.func, core, *fn.args[1:], **fn.keywords)
        elif callable(fn):
            module.attn_fn = wrap_attention(fn)


def _empty_model(cfg: ModelConfig, build: Any = None) -> Any:
    """A GPT whose weights are allocated but never initialized: built on the meta device (no
    init arithmetic), then given uninitialized CPU storage (pages are not touched until read).
    A count needs shapes, not values. ``to_empty`` unties shared weights, so ties are restored."""
    # torch loads only when this runs: the CLI's start-up and the analytic commands import this module
    import torch

    from memtrain.models.gpt import GPT  # torch-free --help/estimate/plan

    with torch.device("meta"):
        model = build() if build is not None else GPT(cfg)  # build: a transformers --model
    first: dict[int, tuple[Any, str]] = {}
    ties: list[tuple[Any, str, Any, str]] = []
    for mod in model.modules():
        for name, p in mod._parameters.items():
            if p is None:
                continue
            if id(p) in first:
                ties.append((mod, name, *first[id(p)]))
            else:
                first[id(p)] = (mod, name)
    model.to_empty(device="cpu")
    for mod, name, src_mod, src_name in ties:
        setattr(mod, name, getattr(src_mod, src_name))
    return model


# (table, counter total, parameters, trainable parameters, the parameters that do no matmul work)
Traced = tuple[dict[str, dict[str, ClassCount]], float, int, int, RuleParams]


def _trace(cfg: RunConfig, fake: bool = True) -> Traced:
    """One micro-batch forward + backward of the configured model under FakeTensorMode with
    FlopCounterMode and the recorder; returns (table, counter total, params, trainable, the
    model's :class:`~memtrain.analysis.flops.rules.RuleParams`: position table, untied token
    embedding and vectors, counted on the model as built, before LoRA adds adapters).
    ``fake=False`` runs the same step with real tensors (tests check both agree)."""
    # torch loads only when this runs: the CLI's start-up and the analytic commands import this module
    import torch

    # Building the model draws random numbers (peft's adapter init): a count made at the end of
    # training (the MFU numerator) must leave the RNG that the final checkpoint saves where the
    # last step left it, or a run resumed from that checkpoint draws other dropout masks.
    with torch.random.fork_rng(devices=[]):
        return _traced_step(cfg, fake)


def _traced_step(cfg: RunConfig, fake: bool) -> Traced:
    """:func:`_trace`'s step, drawing from the global RNG."""
    # torch loads only when this runs: the CLI's start-up and the analytic commands import this module
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from memtrain.analysis.flops.fake_ops import CpuStepFakeMode  # imports torch: loaded only for a count
    from memtrain.techniques import prepare_model  # torch-free --help/estimate/plan

    t = cfg.train
    precision = _precision_for_count(cfg.technique.precision)
    from memtrain.models import build_model, is_hf  # torch-free --help/estimate/plan

    if fake:
        base = _empty_model(cfg.model, (lambda: build_model(cfg, with_weights=False)) if is_hf(cfg) else None)
    else:
        base = build_model(cfg)
    n_params = base.num_parameters()
    rule_params = model_rule_params(base)
    model = prepare_model(base, cfg, torch.device("cpu"), precision)
    model.train()
    _use_fused_dropout(model)
    # Parameters are real (uninitialized) CPU tensors: modules built inside FakeTensorMode
    # cannot be moved with .to(), which prepare_model does. Everything the step computes is fake.
    fake_mode = CpuStepFakeMode(allow_non_fake_inputs=True) if fake else None
    if fake_mode is not None and _has_adapted_parameters(model):
        _make_parameters_fake(model, fake_mode)
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        trainable = sum({id(p): p.numel() for p in model.parameters() if p.requires_grad}.values())
        idx = torch.randint(0, cfg.model.vocab_size, (t.batch_size, t.seq_len))
        targets = torch.randint(0, cfg.model.vocab_size, (t.batch_size, t.seq_len))
        counter = FlopCounterMode(display=False, custom_mapping=_extra_flop_formulas())
        with counter:
            recorder = make_recorder(model, counter.mod_tracker, counter.flop_registry, cfg.model.padded_vocab_size)
            with recorder:
                with precision.autocast():
                    loss = model(idx, targets)
                recorder.phase = "backward"
                loss.backward()
    total = float(counter.get_total_flops())
    table = {p: dict(v) for p, v in recorder.table.items()}
    attributed = sum(c.counted for v in table.values() for c in v.values())
    if not math.isclose(attributed, total, rel_tol=1e-9, abs_tol=1.0):
        raise RuntimeError(f"FLOP attribution lost FLOPs: classes sum to {attributed:.6g}, counter {total:.6g}")
    for phase, v in table.items():
        split_attention(v, only_scores=phase == "recompute" and checkpoint_policy(cfg.technique.checkpointing).kind == "selective")
    return table, total, n_params, trainable, rule_params


def _has_adapted_parameters(model: Any) -> bool:
    """Whether peft adapts tensors of ``model`` that belong to no Linear layer: a mixture-of-experts
    layer's router and stacked expert tensors (peft's ``all-linear`` on Mixtral gives them
    ``target_parameters``), each wrapped in a ``ParamWrapper``."""
    return any(type(m).__name__ == "ParamWrapper" for m in model.modules())


def _make_parameters_fake(model: Any, mode: Any) -> None:
    """Swap every parameter and buffer of ``model`` for a fake tensor of ``mode`` (same shape,
    dtype, requires_grad; a tied parameter stays one tensor). peft's ``ParamWrapper``
    re-registers the tensor it adapts as a parametrization in every forward, which ``set_``s the
    parameter: a metadata change that a fake mode refuses on a real tensor (an AssertionError
    about ``aten.set_``) and makes on a fake one. Counting needs shapes only, so nothing is lost."""
    # torch loads only when this runs: the CLI's start-up and the analytic commands import this module
    import torch.nn as nn

    fakes: dict[int, Any] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                if id(p) not in fakes:
                    fakes[id(p)] = nn.Parameter(mode.from_tensor(p.detach()), requires_grad=p.requires_grad)
                module._parameters[name] = fakes[id(p)]
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = mode.from_tensor(b)


# Models deeper than this are counted per layer kind (below), not traced whole.
_TRACE_LAYERS = 8
_LORA_TRACE_LAYERS = 128


def _trace_by_kind(cfg: RunConfig) -> Traced:
    """:func:`_trace`, in O(1) of the depth: every block of one kind (checkpointed or not)
    dispatches the same ops, so a deep model's count is a 1-block model's plus (L - 1) times
    one block's (the difference of a 2-block and a 1-block trace), per kind; the parameter
    counts likewise. Shallow models are traced whole, as before."""
    check_analytic_size(cfg.model)
    L = cfg.model.n_layers
    if cfg.technique.lora_rank and L > _LORA_TRACE_LAYERS:
        # peft's adapters make the counter's module tracker attribute backward ops to a
        # neighbouring block's class, so per-class counts are not additive per block.
        raise ConfigError(f"memtrain flops with --lora-rank traces the whole model, at most "
                          f"{_LORA_TRACE_LAYERS} layers; got --n-layers {L}")
    if L <= _TRACE_LAYERS or cfg.technique.lora_rank:
        return _trace(cfg)
    policy = checkpoint_policy(cfg.technique.checkpointing)
    if not policy.mixed:
        counts = {policy.text: L}
    else:
        n_ck = policy.n_checkpointed(L)  # blocks i % K == 0
        counts = {"full": n_ck, "none": L - n_ck}
    out: dict[str, dict[str, ClassCount]] = {}
    total = 0.0
    n_params = trainable = 0
    rule_params = RuleParams()
    first = True
    for ck, n in counts.items():
        t1, c1, p1, tr1, r1 = _trace(cfg.replace(n_layers=1, checkpointing=ck))
        t2, c2, p2, tr2, r2 = _trace(cfg.replace(n_layers=2, checkpointing=ck))
        if first:  # the embedding and the head, once: the 1-block trace minus its block
            _accumulate(out, t1, 1.0)
            _accumulate(out, t2, -1.0)
            _accumulate(out, t1, 1.0)
            total += 2 * c1 - c2
            n_params += 2 * p1 - p2
            trainable += 2 * tr1 - tr2
            rule_params = RuleParams(*(r + 2 * a - b for r, a, b in zip(rule_params, r1, r2)))
            first = False
        _accumulate(out, t2, float(n))
        _accumulate(out, t1, -float(n))
        total += n * (c2 - c1)
        n_params += n * (p2 - p1)
        trainable += n * (tr2 - tr1)
        rule_params = RuleParams(*(r + n * (b - a) for r, a, b in zip(rule_params, r1, r2)))
    for phase in list(out):
        out[phase] = {name: c for name, c in out[phase].items() if c.ops or c.counted or c.bytes or c.elementwise}
        if not out[phase]:
            del out[phase]
    return out, total, n_params, trainable, rule_params


def _accumulate(into: dict[str, dict[str, ClassCount]], table: dict[str, dict[str, ClassCount]], scale: float) -> None:
    for phase, classes in table.items():
        dest = into.setdefault(phase, {})
        for name, c in classes.items():
            d = dest.setdefault(name, ClassCount())
            d.counted += scale * c.counted
            d.elementwise += scale * c.elementwise
            d.bytes += scale * c.bytes
            d.ops += round(scale * c.ops)


def count_step(cfg: RunConfig) -> StepCount:
    """Counted FLOPs and bytes of one optimizer step of ``cfg``, by phase and operation class.

    Forward and backward are counted on one micro-batch and multiplied by ``grad_accum`` (the
    micro-batches have the same shapes). With activation checkpointing, ops that run inside a
    module's forward during the backward pass are the recomputation; they are counted as phase
    ``recompute``, whatever the policy (full, every:K, selective).
    """
    return _count_step_cached(_cache_key(cfg))


def _cache_key(cfg: RunConfig) -> str:
    """What a count depends on: model, techniques, micro-batch shape, accumulation, clipping."""
    d = cfg.to_dict()
    keep = {k: d["train"][k] for k in ("batch_size", "seq_len", "grad_accum", "grad_clip")}
    return json.dumps({"model": d["model"], "technique": d["technique"], "train": keep}, sort_keys=True)


@lru_cache(maxsize=32)
def _count_step_cached(key: str) -> StepCount:
    from memtrain.config.run import build_config  # torch-free --help/estimate/plan

    cfg = _counting_config(build_config(json.loads(key)))
    # A library loss kernel (--loss-kernel liger|cce) is Triton code, which runs on CUDA only:
    # memtrain's chunked loss runs the same head matmuls in the trace, and assemble_step adds
    # what the kernel computes beyond them (rules.with_loss_kernel).
    traced = cfg.replace(loss_kernel="memtrain")
    notes: list[str] = []
    try:
        table, counter_total, n_params, trainable, rule_params = _trace_by_kind(traced)
    except ConfigError as exc:
        # Some kernels exist on CUDA only (mem-efficient, flex backward, flash-attn). The count
        # runs on CPU, so it runs the same model with SDPA: torch counts every fused attention
        # kernel with the same formula (full seq x seq), so the FLOPs are the same; the
        # attention bytes are those of the CPU SDPA path.
        if cfg.technique.attention in ("math", "sdpa"):
            raise
        table, counter_total, n_params, trainable, rule_params = _trace_by_kind(traced.replace(attention="sdpa"))
        notes.append(f"--attention {cfg.technique.attention} cannot run on CPU ({exc}); counted with "
                     f"--attention sdpa: same FLOPs, attention bytes of the CPU SDPA path")
    return assemble_step(cfg, table, counter_total, n_params, trainable, notes, rule_params)


def counted_flops_per_step(cfg: RunConfig) -> dict[str, float]:
    """FLOPs of one optimizer step of ``cfg`` (all micro-batches), for MFU and reports.

    Keys: ``forward``, ``backward``, ``recompute`` (FlopCounterMode counts: matmuls and
    attention kernels), ``elementwise`` (analytic, all phases), ``optimizer`` (analytic update
    and clipping), ``total`` (all of these), ``model_flops`` (forward + backward: the MFU
    numerator by the PaLM convention, which leaves recomputation out so checkpointing does
    not look faster), ``hardware_flops`` (``model_flops`` + recompute), ``rule`` (6ND +
    attention) and ``tokens``. Cached per config (a count traces the model with fake tensors,
    about a second for the default model).
    """
    s = count_step(cfg)
    fwd, bwd, rec = (s.phase_total(p, "counted") for p in ("forward", "backward", "recompute"))
    elementwise = sum(s.phase_total(p, "elementwise") for p in ("forward", "backward", "recompute"))
    optimizer = s.phase_total("optimizer")
    return {
        "forward": fwd, "backward": bwd, "recompute": rec, "elementwise": elementwise,
        "optimizer": optimizer, "total": fwd + bwd + rec + elementwise + optimizer,
        "model_flops": fwd + bwd, "hardware_flops": fwd + bwd + rec,
        "rule": s.rule_flops, "tokens": float(s.tokens),
    }
