"""Operation classes (qkv, softmax, lm_head...), how an aten op is classified, and the count tables."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Protocol, Sequence


class Shaped(Protocol):
    """What :func:`classify` reads of a tensor: a torch.Tensor, or the inventory's shapes."""

    @property
    def shape(self) -> Sequence[int]: ...

    def dim(self) -> int: ...


# --------------------------------------------------------------------------- operation classes
# (name, label) in display order. QK^T and AV are reported apart although the math backend
# runs both as ``aten.bmm`` inside the same module: see ``split_attention``.
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
# model (memtrain.models.gpt); everything dispatched inside it (matmul, bias gradient sum, LoRA
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
NO_FLOP_OPS = frozenset({
    "copy_", "_to_copy", "clone", "masked_fill", "masked_fill_", "where", "fill_", "zero_",
    "zeros_like", "ones_like", "full", "full_like", "zeros", "ones", "arange", "cat", "stack",
    "index_select", "gather", "scatter", "index", "embedding", "bernoulli_", "normal_",
    "uniform_", "constant_pad_nd", "_local_scalar_dense",
})
# Ops that neither read nor write tensor data (allocation, metadata, views).
NO_BYTE_OPS = frozenset({
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view",
    "_reshape_alias", "lift_fresh", "_local_scalar_dense", "detach", "alias", "set_",
    "resize_", "_has_compatible_shallow_copy_type", "_to_copy_noop",
})
# In-place ops whose mutated argument is overwritten without being read.
WRITE_ONLY = frozenset({"copy_", "fill_", "zero_", "normal_", "uniform_", "bernoulli_", "random_", "exponential_"})


# --------------------------------------------------------------------------- count tables
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


def split_attention(table: dict[str, ClassCount], only_scores: bool = False) -> None:
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


def classify(module_path: str, op: str, tensors: Iterable[Shaped], vocab: int) -> str:
    """Operation class of one aten op, from the module running it and the op's name.

    ``attn_core`` (the math backend's two bmm) is split into QK^T and AV afterwards.
    """
    if op in _ATTENTION_KERNELS:
        # A fused attention kernel is attention wherever the module tracker places it: with LoRA,
        # torch's ModuleTracker still holds the output projection while the kernel's backward runs.
        return "attn_fused"
    parts = module_path.split(".")
    for part in reversed(parts):
        if part in _MODULE_ROLES:
            return _MODULE_ROLES[part]
        if part == "c_proj":  # GPT-2 (transformers) names both output projections c_proj
            return "attn_proj" if "attn" in parts else "mlp_fc_out"
    if op in _OP_CLASS:
        return _OP_CLASS[op]
    in_block = "blocks" in parts or any(p in parts for p in _HF_BLOCK_LISTS)
    if op in _MATMUL_OPS:
        if in_block and ("attn" in parts or "self_attn" in parts):
            return "attn_core"
        if not in_block:
            return "lm_head"  # the loss seam calls F.linear with the (tied) head weight
    if not in_block and any(t.dim() > 0 and t.shape[-1] == vocab for t in tensors):
        return "loss"  # casts and copies of the (tokens x vocab) logits
    return "other"
