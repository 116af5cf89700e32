"""FLOP and byte arithmetic for a training step: the rule of thumb, counted FLOPs, the roofline.

The rule of thumb (Kaplan et al. 2020; PaLM appendix B): a training step costs
6 FLOPs per parameter per token (2 forward, 4 backward) for the matmuls against weights,
plus the attention matmuls QK^T and AV, which have no parameters:
2 matmuls x 2 FLOPs x seq x d_model per token per layer forward, x3 with backward
= 12 * n_layers * d_model * seq per token. The position embedding is a lookup (no FLOPs),
so it is left out of the parameter term; the tied token embedding is counted once, for
the LM-head matmul. Causal masking does not halve the count: the math and SDPA kernels
compute the full score matrix.

Counted FLOPs (:func:`count_step`, :func:`counted_flops_per_step`) come from
``torch.utils.flop_counter.FlopCounterMode`` on one real training step of the configured
model (techniques applied), run under ``FakeTensorMode``: every aten op is dispatched with
its true shapes and dtypes but no memory is allocated and no arithmetic done, so the default
model at batch 64 counts in about a second on a CPU. A second dispatch mode, stacked on the
counter, sees the same ops and attributes each one to an operation class (``qkv``,
``softmax``, ``lm_head``...) by the module running it (the counter's own module tracker)
and the op's name; it also sums the bytes each op reads and writes. The per-class FLOPs add
up to the counter's total exactly (checked on every count).

Three things the counter does not count are added analytically, with the constants below:

* element-wise work (softmax, LayerNorm, GELU, dropout, the loss's log-softmax, adds):
  ``FlopCounterMode`` registers formulas for matmuls and attention kernels only, so it counts
  0 for these. They are a fraction of a percent of the step but they decide the roofline:
  their FLOP/byte is tiny.
* the optimizer update (``OPTIMIZER_FLOPS_PER_PARAM``), and gradient clipping;
* their bytes (``optimizer_bytes_per_param``), as the minimum a fused kernel moves.

Why bytes are summed per dispatched op rather than derived by hand for each class: the same
code then measures any technique (LoRA adapters, a fused attention kernel, a chunked loss)
without a formula per technique. The model is eager PyTorch, where every aten op is a kernel
that reads its inputs from memory and writes its outputs back, so the sum of input and output
sizes per op is the traffic an eager step moves (caches ignored). A compiled model fuses
element-wise chains and moves less; the bytes here describe eager execution.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Iterable, Optional

from memtrain.config import ConfigError, ModelConfig, RunConfig
from memtrain.limits import check_analytic_size
from memtrain.techniques.facts import OPTIMIZER_STATE_RULES, checkpoint_policy, precision_facts

if TYPE_CHECKING:  # torch stays out of import time for ``memtrain --help``
    import torch


def rule_flops_per_token(cfg: ModelConfig, seq_len: int, n_params: int) -> float:
    """Training FLOPs per token by the 6N + attention rule."""
    matmul_params = n_params - cfg.max_seq_len * cfg.d_model  # drop the position lookup table
    return 6.0 * matmul_params + 12.0 * cfg.n_layers * cfg.d_model * seq_len


# --------------------------------------------------------------------------- operation classes
# (name, label) in display order. QK^T and AV are reported apart although the math backend
# runs both as ``aten.bmm`` inside the same module: see ``_split_attention``.
OP_CLASSES: tuple[tuple[str, str], ...] = (
    ("embedding", "embedding"),
    ("layernorm", "LayerNorm"),
    ("qkv", "qkv (Linear)"),
    ("attn_scores", "scores QK^T"),
    ("softmax", "softmax"),
    ("attn_values", "values AV"),
    ("attn_fused", "attention (fused kernel)"),
    ("attn_proj", "attn proj (Linear)"),
    ("mlp_fc", "mlp fc (Linear)"),
    ("gelu", "GELU"),
    ("mlp_fc_out", "mlp fc_out (Linear)"),
    ("dropout", "dropout"),
    ("lm_head", "LM head"),
    ("loss", "loss (log-softmax, NLL)"),
    ("optimizer", "optimizer update"),
    ("other", "other (adds, mask, scale, copies)"),
)
LABELS = dict(OP_CLASSES)
# Classes whose FLOPs run on tensor cores (matmuls); the rest run on the vector (FP32) units.
MATMUL_CLASSES = frozenset({"qkv", "attn_scores", "attn_values", "attn_fused", "attn_proj", "mlp_fc", "mlp_fc_out", "lm_head"})

# A Linear module (or an adapter nested inside it) is identified by its attribute name in the
# model (memtrain.model); everything dispatched inside it (matmul, bias gradient sum, LoRA
# adapter ops) belongs to that layer.
_MODULE_ROLES = {
    "qkv": "qkv", "proj": "attn_proj", "fc": "mlp_fc", "fc_out": "mlp_fc_out",
    "lm_head": "lm_head", "wte": "embedding", "wpe": "embedding",
    # transformers models (memtrain.models): Llama/Qwen2/Mistral/Gemma/Phi-3 and GPT-2 names
    "q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "qkv_proj": "qkv", "c_attn": "qkv",
    "o_proj": "attn_proj", "dense": "attn_proj", "gate_proj": "mlp_fc", "up_proj": "mlp_fc",
    "gate_up_proj": "mlp_fc", "c_fc": "mlp_fc", "down_proj": "mlp_fc_out", "embed_tokens": "embedding",
}
_HF_BLOCK_LISTS = ("layers", "h")  # the decoder-layer ModuleList of transformers models
_MATMUL_OPS = frozenset({"mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_", "matmul", "linear", "_scaled_mm"})
_ATTENTION_KERNELS = frozenset({
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_flash_attention_forward", "_flash_attention_backward",
    "_efficient_attention_forward", "_efficient_attention_backward",
    "flex_attention", "flex_attention_backward",
})
_OP_CLASS = {
    "native_layer_norm": "layernorm", "native_layer_norm_backward": "layernorm",
    "_softmax": "softmax", "_softmax_backward_data": "softmax",
    "gelu": "gelu", "gelu_backward": "gelu",
    "native_dropout": "dropout", "native_dropout_backward": "dropout",
    "embedding": "embedding", "embedding_dense_backward": "embedding",
    "_log_softmax": "loss", "_log_softmax_backward_data": "loss",
    "nll_loss_forward": "loss", "nll_loss_backward": "loss",
    "nll_loss2d_forward": "loss", "nll_loss2d_backward": "loss",
}

# FLOPs per element that FlopCounterMode does not count (it has formulas for matmuls and
# attention kernels only). A transcendental (exp, tanh, rsqrt) counts as one FLOP, as in
# most roofline work; these are conventions, not measurements, and they matter only for the
# roofline position of the memory-bound classes, which are far below any ridge point.
#   op: (FLOPs per element, which tensor's elements: "max" = the largest operand, "arg0")
ELEMENTWISE_FLOPS: dict[str, tuple[float, str]] = {
    "_softmax": (5, "max"),                    # max, subtract, exp, sum, divide
    "_softmax_backward_data": (4, "max"),      # y * (g - sum(g * y)): mul, sum, sub, mul
    "_log_softmax": (5, "max"),                # max, subtract, exp, sum, log-subtract
    "_log_softmax_backward_data": (4, "max"),  # g - exp(y) * sum(g)
    "native_layer_norm": (7, "max"),           # mean, center, square+sum, scale, weight, bias
    "native_layer_norm_backward": (12, "max"),  # input grad (9) + weight and bias grads (3)
    "gelu": (9, "max"),                        # tanh form: x^3, 2 mul, add, tanh, add, 2 mul
    "gelu_backward": (17, "max"),              # derivative of the tanh form, times the grad
    "native_dropout": (2, "max"),              # draw + compare, scale-multiply
    "native_dropout_backward": (2, "max"),     # mask-multiply, scale
    "embedding_dense_backward": (1, "arg0"),   # scatter-add of each gradient element
    "nll_loss_forward": (0, "max"),            # a gather
    "nll_loss_backward": (0, "max"),           # a fill and a scatter
    "addcmul": (2, "max"), "addcmul_": (2, "max"), "addcdiv": (2, "max"), "addcdiv_": (2, "max"),
    "lerp": (3, "max"), "lerp_": (3, "max"),
}
# Ops that move data but compute nothing.
_NO_FLOP_OPS = frozenset({
    "copy_", "_to_copy", "clone", "masked_fill", "masked_fill_", "where", "fill_", "zero_",
    "zeros_like", "ones_like", "full", "full_like", "zeros", "ones", "arange", "cat", "stack",
    "index_select", "gather", "scatter", "index", "embedding", "bernoulli_", "normal_",
    "uniform_", "constant_pad_nd", "_local_scalar_dense",
})
# Ops that neither read nor write tensor data (allocation, metadata, views).
_NO_BYTE_OPS = frozenset({
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view",
    "_reshape_alias", "lift_fresh", "_local_scalar_dense", "detach", "alias", "set_",
    "resize_", "_has_compatible_shallow_copy_type", "_to_copy_noop",
})
# In-place ops whose mutated argument is overwritten without being read.
_WRITE_ONLY = frozenset({"copy_", "fill_", "zero_", "normal_", "uniform_", "bernoulli_", "random_", "exponential_"})

# Optimizer update FLOPs per trainable parameter, counted from torch's single-tensor update
# (torch/optim/adam.py, decoupled weight decay), a transcendental counted as one FLOP:
#   AdamW: p *= 1 - lr*wd (1); m.lerp_(g, 1-b1) (3); v = b2*v + (1-b2)*g*g (4);
#          denom = sqrt(v)/bc2 + eps (3); p -= step * m / denom (3)        = 14
# (the often quoted "~12" drops the decay and bias corrections; the difference is 2 FLOPs
# per parameter, about 0.01% of the default step). The low-bit AdamW variants do the same
# arithmetic on dequantized values (their (de)quantization is not counted).
#   SGD with momentum and weight decay: g += wd*p (2); buf = mu*buf + g (2); p -= lr*buf (2).
#   Adafactor: factored second moment (row/col means of g^2, their outer product), RMS
#   clipping and the update: about 12 (approximate).
OPTIMIZER_FLOPS_PER_PARAM: dict[str, float] = {
    "adamw": 14, "adamw-fused": 14, "adamw-foreach": 14, "adamw-8bit": 14, "adamw-4bit": 14,
    "adamw-bnb-8bit": 14, "sgd": 6, "adafactor": 12,
}
# Gradient clipping by global norm: square and accumulate (2), scale (1) per gradient element.
CLIP_FLOPS_PER_PARAM = 3


def optimizer_bytes_per_param(optim: str, param_bytes: int, grad_clip: bool) -> float:
    """Minimum memory traffic of one update per parameter, as a fused kernel does it: read the
    weight, its gradient and each state tensor, write the weight and each state tensor back
    (the eager single-tensor loop moves several times this). Clipping reads the gradients
    twice (norm, then scale) and writes them once."""
    # The state rule of memtrain.techniques.facts: full-size state tensors (Adafactor's factored
    # state is O(rows + cols): none), quantized, or in the weight's dtype (bf16-pure: 2 B).
    rule = OPTIMIZER_STATE_RULES.get(optim, OPTIMIZER_STATE_RULES["adamw"])
    n_states, state_bytes = rule.states, rule.state_bytes(param_bytes)
    update = 2 * param_bytes + param_bytes + 2 * n_states * state_bytes
    return update + (3 * param_bytes if grad_clip else 0)


# --------------------------------------------------------------------------- counting
@dataclass
class ClassCount:
    """One operation class in one phase: FLOPs the counter counted, FLOPs added analytically
    (element-wise), bytes read + written, and the number of dispatched ops."""

    counted: float = 0.0
    elementwise: float = 0.0
    bytes: float = 0.0
    ops: int = 0

    @property
    def flops(self) -> float:
        return self.counted + self.elementwise

    def add(self, other: "ClassCount", scale: float = 1.0) -> None:
        self.counted += scale * other.counted
        self.elementwise += scale * other.elementwise
        self.bytes += scale * other.bytes
        self.ops += int(scale * other.ops)


PHASES = ("forward", "backward", "recompute", "optimizer")


@dataclass
class StepCount:
    """Counted FLOPs and bytes of one optimizer step, by phase and operation class."""

    # phase -> class -> count; forward/backward/recompute are per optimizer step (all
    # micro-batches of gradient accumulation), optimizer holds the one update.
    table: dict[str, dict[str, ClassCount]]
    counter_flops: float  # FlopCounterMode's own total for the step (forward+backward+recompute)
    tokens: int
    n_params: int
    trainable_params: int
    rule_flops: float
    rule_terms: dict[str, float]
    notes: list[str] = field(default_factory=list)

    def phase_total(self, phase: str, kind: str = "flops") -> float:
        return sum(getattr(c, kind) for c in self.table.get(phase, {}).values())

    def by_class(self) -> dict[str, ClassCount]:
        out: dict[str, ClassCount] = defaultdict(ClassCount)
        for phase in PHASES:
            for name, c in self.table.get(phase, {}).items():
                out[name].add(c)
        return dict(out)

    @property
    def total_flops(self) -> float:
        return sum(self.phase_total(p) for p in PHASES)


def _unique_elements(t: "torch.Tensor") -> int:
    """Elements a kernel touches: a broadcast (stride-0) dimension is read once, not per copy."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n


def _tensors(value: Any) -> Iterable["torch.Tensor"]:
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
    if getattr(func, "is_view", False) or name in _NO_BYTE_OPS:
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
                total += n if name in _WRITE_ONLY else 2 * n
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
    import torch

    name = func._overloadpacket.__name__
    if name in _NO_FLOP_OPS or getattr(func, "is_view", False) or name in _NO_BYTE_OPS:
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


def classify(module_path: str, op: str, tensors: Iterable["torch.Tensor"], vocab: int) -> str:
    """Operation class of one aten op, from the module running it and the op's name.

    ``attn_core`` (the math backend's two bmm) is split into QK^T and AV afterwards.
    """
    parts = module_path.split(".")
    for part in reversed(parts):
        if part in _MODULE_ROLES:
            return _MODULE_ROLES[part]
        if part == "c_proj":  # GPT-2 (transformers) names both output projections c_proj
            return "attn_proj" if "attn" in parts else "mlp_fc_out"
    if op in _OP_CLASS:
        return _OP_CLASS[op]
    if op in _ATTENTION_KERNELS:
        return "attn_fused"
    in_block = "blocks" in parts or any(p in parts for p in _HF_BLOCK_LISTS)
    if op in _MATMUL_OPS:
        if in_block and ("attn" in parts or "self_attn" in parts):
            return "attn_core"
        if not in_block:
            return "lm_head"  # the loss seam calls F.linear with the (tied) head weight
    if not in_block and any(t.dim() > 0 and t.shape[-1] == vocab for t in tensors):
        return "loss"  # casts and copies of the (tokens x vocab) logits
    return "other"


def _leaf_module(parents: Iterable[str]) -> str:
    """The innermost running module among the tracker's parents (``Global`` when none)."""
    names = [p for p in parents if p != "Global"]
    return max(names, key=lambda n: n.count(".")) if names else "Global"


def _make_recorder(model: Any, tracker: Any, registry: dict, vocab: int, profile: bool = False) -> Any:
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
            if self.stack or _CORE_STACK:
                module = self.stack[-1] if self.stack else _CORE_STACK[-1]
                if phase == "backward":
                    phase = "recompute"
            else:
                module = _leaf_module(tracker.parents) if phase == "backward" else "GPT"
            cls = classify(module, name, _tensors((args, kwargs)), vocab)
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


def _split_attention(table: dict[str, ClassCount], only_scores: bool = False) -> None:
    """Split the math backend's ``attn_core`` bmm into QK^T and AV, half each.

    Exact, not an estimate: QK^T multiplies (T x hd)(hd x T) and AV (T x T)(T x hd), so in
    the forward both are 2*T*T*hd FLOPs reading one (T,T) and two (T,hd)-sized operands
    (inputs and output together); in the backward each produces two gradients with the same
    shapes. The two matmuls run as the same aten op (bmm) inside the same module, so the
    dispatcher alone cannot tell them apart, but they are equal in FLOPs and bytes."""
    core = table.pop("attn_core", None)
    if core is None:
        return
    if only_scores:
        # Selective checkpointing's recompute of the attention core stops (non-reentrant
        # checkpoint's early stop) once q k^T's softmax and v are back: probs @ v never reruns.
        table.setdefault("attn_scores", ClassCount()).add(core)
        return
    for name in ("attn_scores", "attn_values"):
        table.setdefault(name, ClassCount()).add(core, 0.5)


def _precision_for_count(name: str) -> Any:
    """The run's precision on CPU, built without make_precision's global TF32 switches (a
    count must not change the settings of a run in the same process)."""
    from memtrain.techniques.precision import precision_for_count

    return precision_for_count(name, "cpu")


def _extra_flop_formulas() -> dict:
    """Formulas the counter lacks in torch 2.13, with the counts of torch's own formulas:

    * in-place ``addmm_`` / ``baddbmm_`` (the chunked loss accumulates the LM-head weight
      gradient with ``addmm_``; without this a third of the LM head would go uncounted);
    * the CPU flash-attention kernels SDPA picks on CPU (torch registers the CUDA ones only).
    """
    import torch
    from torch.utils import flop_counter as fc

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
    return mapping


def _counting_config(cfg: RunConfig, **overrides: Any) -> RunConfig:
    """The config a count runs: the same model and techniques on CPU, eager (compile fuses
    kernels but does not change the FLOPs), single process."""
    return cfg.replace(compile=False, distributed="none", cpu_offload=False, device="cpu", **overrides)


# Attention modules whose checkpointed core (selective checkpointing) is running: a core
# recomputed during backward runs outside any module's forward, so the recorder looks here.
_CORE_STACK: list[str] = []


def _in_core(name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    _CORE_STACK.append(name)
    try:
        return fn(*args, **kwargs)
    finally:
        _CORE_STACK.pop()


def _use_fused_dropout(model: Any) -> None:
    """Make this (throwaway) model run dropout as CUDA does: one fused ``native_dropout`` kernel
    (output and mask in one pass). On CPU ``F.dropout`` decomposes into bernoulli_, div_ and
    mul kernels, three passes over the tensor; counting those would describe bytes no GPU
    moves. FLOPs are unaffected. ``nn.Dropout`` modules get an instance ``forward``; attention
    functions (which call ``F.dropout`` inside, e.g. the math backend) run under a
    TorchFunctionMode that rewrites the call. Both act again in checkpointing's recompute,
    which must see the same ops as the forward did."""
    import functools

    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    from memtrain.techniques.checkpointing import _checkpointed_call

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

    names = {m: ("GPT." + n if n else "GPT") for n, m in model.named_modules()}
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.forward = (lambda m: lambda x: fused(x, m.p, m.training))(module)  # type: ignore[method-assign]  # patches this instance's forward on purpose
        fn = getattr(module, "attn_fn", None)
        if isinstance(fn, functools.partial) and fn.func is _checkpointed_call:
            # Selective checkpointing checkpoints the attention core: the mode must be active
            # inside it, where its recompute runs too, not around it. The core is no module,
            # so it names its attention module on _CORE_STACK for the recorder.
            inner = wrap_attention(fn.args[0])
            core = (lambda f, name: lambda *a, **k: _in_core(name, f, *a, **k))(inner, names[module])
            module.attn_fn = functools.partial(fn.func, core, *fn.args[1:], **fn.keywords)
        elif callable(fn):
            module.attn_fn = wrap_attention(fn)


def _empty_model(cfg: ModelConfig, build: Any = None) -> Any:
    """A GPT whose weights are allocated but never initialized: built on the meta device (no
    init arithmetic), then given uninitialized CPU storage (pages are not touched until read).
    A count needs shapes, not values. ``to_empty`` unties shared weights, so ties are restored."""
    import torch

    from memtrain.model import GPT

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


def _trace(cfg: RunConfig, fake: bool = True) -> tuple[dict[str, dict[str, ClassCount]], float, int, int]:
    """One micro-batch forward + backward of the configured model under FakeTensorMode with
    FlopCounterMode and the recorder; returns (table, counter total, params, trainable).
    ``fake=False`` runs the same step with real tensors (tests check both agree)."""
    import contextlib

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    from memtrain.techniques import prepare_model

    t = cfg.train
    precision = _precision_for_count(cfg.technique.precision)
    from memtrain.models import build_model, is_hf

    if fake:
        base = _empty_model(cfg.model, (lambda: build_model(cfg, with_weights=False)) if is_hf(cfg) else None)
    else:
        base = build_model(cfg)
    n_params = base.num_parameters()
    model = prepare_model(base, cfg, torch.device("cpu"), precision)
    model.train()
    _use_fused_dropout(model)
    # Parameters are real (uninitialized) CPU tensors: modules built inside FakeTensorMode
    # cannot be moved with .to(), which prepare_model does. Everything the step computes is fake.
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
        trainable = sum({id(p): p.numel() for p in model.parameters() if p.requires_grad}.values())
        idx = torch.randint(0, cfg.model.vocab_size, (t.batch_size, t.seq_len))
        targets = torch.randint(0, cfg.model.vocab_size, (t.batch_size, t.seq_len))
        counter = FlopCounterMode(display=False, custom_mapping=_extra_flop_formulas())
        with counter:
            recorder = _make_recorder(model, counter.mod_tracker, counter.flop_registry, cfg.model.padded_vocab_size)
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
        _split_attention(v, only_scores=phase == "recompute" and checkpoint_policy(cfg.technique.checkpointing).kind == "selective")
    return table, total, n_params, trainable


# Models deeper than this are counted per layer kind (below), not traced whole.
_TRACE_LAYERS = 8
_LORA_TRACE_LAYERS = 128


def _trace_by_kind(cfg: RunConfig) -> tuple[dict[str, dict[str, ClassCount]], float, int, int]:
    """:func:`_trace`, in O(1) of the depth: every block of one kind (checkpointed or not)
    dispatches the same ops, so a deep model's count is a 1-block model's plus (L - 1) times
    one block's (the difference of a 2-block and a 1-block trace), per kind. Shallow models are
    traced whole, as before."""
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
    first = True
    for ck, n in counts.items():
        t1, c1, p1, tr1 = _trace(cfg.replace(n_layers=1, checkpointing=ck))
        t2, c2, p2, tr2 = _trace(cfg.replace(n_layers=2, checkpointing=ck))
        if first:  # the embedding and the head, once: the 1-block trace minus its block
            _accumulate(out, t1, 1.0)
            _accumulate(out, t2, -1.0)
            _accumulate(out, t1, 1.0)
            total += 2 * c1 - c2
            n_params += 2 * p1 - p2
            trainable += 2 * tr1 - tr2
            first = False
        _accumulate(out, t2, float(n))
        _accumulate(out, t1, -float(n))
        total += n * (c2 - c1)
        n_params += n * (p2 - p1)
        trainable += n * (tr2 - tr1)
    for phase in list(out):
        out[phase] = {name: c for name, c in out[phase].items() if c.ops or c.counted or c.bytes or c.elementwise}
        if not out[phase]:
            del out[phase]
    return out, total, n_params, trainable


def _accumulate(into: dict[str, dict[str, ClassCount]], table: dict[str, dict[str, ClassCount]], scale: float) -> None:
    for phase, classes in table.items():
        dest = into.setdefault(phase, {})
        for name, c in classes.items():
            d = dest.setdefault(name, ClassCount())
            d.counted += scale * c.counted
            d.elementwise += scale * c.elementwise
            d.bytes += scale * c.bytes
            d.ops += round(scale * c.ops)


def _rule_terms(cfg: RunConfig, n_params: int, tokens: int) -> dict[str, float]:
    """The rule's two terms and the parameters it names, for the side-by-side."""
    m = cfg.model
    matmul_params = n_params - m.max_seq_len * m.d_model
    return {
        "six_n_d": 6.0 * matmul_params * tokens,
        "attention": 12.0 * m.n_layers * m.d_model * cfg.train.seq_len * tokens,
        "rule_params": float(matmul_params),
    }


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
    from memtrain.config import build_config

    cfg = _counting_config(build_config(json.loads(key)))
    t = cfg.train
    notes: list[str] = []
    try:
        table, counter_total, n_params, trainable = _trace_by_kind(cfg)
    except ConfigError as exc:
        # Some kernels exist on CUDA only (mem-efficient, flex backward, flash-attn). The count
        # runs on CPU, so it runs the same model with SDPA: torch counts every fused attention
        # kernel with the same formula (full seq x seq), so the FLOPs are the same; the
        # attention bytes are those of the CPU SDPA path.
        if cfg.technique.attention in ("math", "sdpa"):
            raise
        table, counter_total, n_params, trainable = _trace_by_kind(cfg.replace(attention="sdpa"))
        notes.append(f"--attention {cfg.technique.attention} cannot run on CPU ({exc}); counted with "
                     f"--attention sdpa: same FLOPs, attention bytes of the CPU SDPA path")
    forward = table.get("forward", {})
    backward = table.get("backward", {})
    recompute = table.get("recompute", {})
    accum = t.grad_accum
    scaled: dict[str, dict[str, ClassCount]] = {}
    for phase, classes in (("forward", forward), ("backward", backward), ("recompute", recompute)):
        scaled[phase] = {}
        for name, c in classes.items():
            s = ClassCount()
            s.add(c, accum)
            scaled[phase][name] = s
    param_bytes = precision_facts(cfg.technique.precision).param_bytes
    per_param = OPTIMIZER_FLOPS_PER_PARAM.get(cfg.technique.optim, 14) + (CLIP_FLOPS_PER_PARAM if t.grad_clip > 0 else 0)
    scaled["optimizer"] = {"optimizer": ClassCount(
        0.0, float(per_param * trainable),
        float(optimizer_bytes_per_param(cfg.technique.optim, param_bytes, t.grad_clip > 0) * trainable), 1)}
    tokens = t.batch_size * t.seq_len * accum
    terms = _rule_terms(cfg, n_params, tokens)
    return StepCount(
        table=scaled, counter_flops=counter_total * accum, tokens=tokens, n_params=n_params,
        trainable_params=trainable, rule_flops=terms["six_n_d"] + terms["attention"],
        rule_terms=terms, notes=notes,
    )


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
    CUDA GPU, else H100 SXM) at the matmul type of ``precision``."""
    from memtrain.metrics import PEAK_FLOPS, device_gpu, lookup_gpu

    if gpu is None:
        import torch

        spec = device_gpu("cuda") if torch.cuda.is_available() else lookup_gpu("h100")
        if spec is None:
            raise ConfigError(f"the visible GPU {torch.cuda.get_device_name()!r} has no peak figures here; "
                              f"name a similar one with --gpu ({', '.join(PEAK_FLOPS)})")
    else:
        spec = lookup_gpu(gpu)
        if spec is None:
            raise ConfigError(f"unknown --gpu {gpu!r}; choose one of {', '.join(PEAK_FLOPS)}")
    key = next(k for k, v in PEAK_FLOPS.items() if v is spec)
    dtype = precision_facts(precision).matmul_type
    peak = spec.peak(dtype)
    vector = spec.peak("fp32")
    if not peak or not vector:
        raise ConfigError(f"--gpu {key} has no {dtype} tensor cores; choose --precision fp16 or fp32")
    return Roof(spec.name, key, dtype, float(peak), float(vector), float(spec.mem_bandwidth))


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

    - the rule's 6N includes biases and LayerNorm weights, whose work is element-wise: the
      counter counts no FLOPs for them (addmm's bias add is not in its formula);
    - with untied embeddings the rule also counts the token embedding, a lookup (no FLOPs);
    - what is left (``unexplained``) is 0 for the plain model; techniques that change the work
      (LoRA computes no gradients of frozen weights) show up there.
    The attention term needs no correction: the counter counts the full (T x T) score matrix,
    as the rule does, masked half included.
    """
    # Local, and the one upward import left (benchmarks/import_graph.py): the parameter
    # catalogue lives in estimate until that module is split along its seams.
    from memtrain.estimate import param_table

    # One block's vectors times the depth (param_table lists model.named_parameters(); the
    # model itself is not built: O(1) in n_layers).
    one = param_table(replace(cfg.model, n_layers=1))
    non_matmul = sum(p.numel * (cfg.model.n_layers if p.block is not None else 1) for p in one if len(p.shape) < 2)
    tokens = count.tokens
    untied = cfg.model.padded_vocab_size * cfg.model.d_model if cfg.model.untie_embeddings else 0
    counted = count.phase_total("forward", "counted") + count.phase_total("backward", "counted")
    terms = {
        "rule_flops": count.rule_flops,
        "bias_and_norm_params": -6.0 * non_matmul * tokens,
        "untied_embedding_lookup": -6.0 * untied * tokens,
    }
    terms["unexplained"] = counted - sum(terms.values())
    terms["counted_forward_backward"] = counted
    return terms


def flops_report(cfg: RunConfig, gpu: Optional[str] = None, measured_s: Optional[dict[str, float]] = None,
                 measured_device: Optional[str] = None) -> dict[str, Any]:
    """Everything ``memtrain flops`` prints or writes as JSON (the contract's keys first)."""
    roof = resolve_roof(gpu, cfg.technique.precision)
    count = count_step(cfg)
    ops = roofline_ops(count, roof, measured_s)
    phases = {p: {"flops": count.phase_total(p), "counted_flops": count.phase_total(p, "counted"),
                  "bytes": count.phase_total(p, "bytes")} for p in PHASES}
    report: dict[str, Any] = {
        "total_flops": count.total_flops,
        "rule_flops": count.rule_flops,
        "ops": ops,
        "counter_flops": count.counter_flops,
        "phases": phases,
        "rule": count.rule_terms,
        "reconciliation": reconcile(cfg, count),
        "tokens": count.tokens,
        "parameters": count.n_params,
        "trainable_parameters": count.trainable_params,
        "gpu": roof.to_dict(),
        "ridge": roof.ridge,
        "total_bytes": sum(r["bytes"] for r in ops),
        "est_step_time_s": sum(r["est_time_s"] for r in ops),
        "config": {"model": cfg.to_dict()["model"], "technique": cfg.to_dict()["technique"],
                   "batch_size": cfg.train.batch_size, "seq_len": cfg.train.seq_len,
                   "grad_accum": cfg.train.grad_accum},
        "notes": count.notes,
        "method": ("FLOPs: torch.utils.flop_counter.FlopCounterMode on one training step under "
                   "FakeTensorMode (CPU); element-wise and optimizer FLOPs analytic; bytes: sum of "
                   "input and output sizes of each eager aten op"),
    }
    if measured_s is not None:
        report["measured"] = {"device": measured_device, "step_time_s": sum(v for v in measured_s.values() if v),
                              "by_class_s": measured_s}
    return report
