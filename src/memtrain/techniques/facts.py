"""What each technique *is*, as typed values parsed once: the one home of these facts.

The techniques that change a run (``memtrain.techniques.*``), the analytic estimate
(:mod:`memtrain.analysis.estimate`), the FLOP rules and counter (:mod:`memtrain.analysis.flops`), the planner
(:mod:`memtrain.analysis.plan`) and the transformers mapping (:mod:`memtrain.models.hf`) all read
these values instead of re-deriving them from the option strings:

* :class:`CheckpointPolicy`: ``--checkpointing`` parsed (kind, K), and which blocks it
  checkpoints for a given depth;
* :class:`PrecisionFacts`: per ``--precision``, the weight dtype, the autocast (compute)
  dtype, the loss scaler, TF32, and their byte sizes; for ``fp8`` (torchao float8 training) the
  dtype each Linear's matmul operands are cast to, which Linears qualify
  (:func:`fp8_converts`) and the GPUs that run it (:data:`FP8_MIN_CAPABILITY`);
* :class:`OptimizerStateRule`: per ``--optim``, the state tensors each parameter gets and
  their element size (the dtype of the weights, or quantized bits with a block of scales);
  the low-bit optimizers' blocks and size floor, and which optimizers can train BF16 weights;
* the memory categories every meter, estimate and table reports (:data:`MEMORY_CATEGORIES`).

The choices the configuration accepts (``--precision``, ``--optim``, ``--checkpointing``) are
the keys of these tables (:mod:`memtrain.config.run` reads them). The GPU kinds have their own
torch-free table, :mod:`memtrain.devices.gpu_kinds`.

No torch here: the analytic commands answer without loading it (dtypes are named by their
``torch`` attribute names; :mod:`memtrain.techniques.precision` turns them into dtypes).
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from memtrain.errors import ConfigError

__all__ = [
    "ADAMW_KERNELS", "BF16_PURE_OPTIMS", "CHECKPOINT_KINDS", "DTYPE_MATMUL_TYPE", "FP8_DIM_MULTIPLE",
    "FOREIGN_LOSS_KERNELS", "FP8_MIN_CAPABILITY", "ForeignLossKernel", "LOW_BIT_BLOCK", "LOW_BIT_MIN_NUMEL",
    "NF4_BLOCK", "NF4_SCALER_BLOCK", "nf4_bytes", "nf4_quantizes",
    "CCE_FORWARD_LOCK_TOKENS", "cce_forward_locks", "cce_lock_table_shape", "fp8_converts", "foreign_loss_kernel", "loss_kernel_precision_error", "loss_kernel_refusal",
    "MATMUL_TYPES", "MEMORY_CATEGORIES", "OFFLOAD_MIN_BYTES", "OFFLOAD_PREFETCH", "OPTIMIZER_STATE_RULES",
    "PRECISION_FACTS", "CheckpointPolicy",
    "OptimizerStateRule", "PrecisionFacts", "SR_ADAMW_ALONE_NUMEL", "SR_ADAMW_BUCKET_NUMEL",
    "checkpoint_policy", "half_matmul_type", "low_bit_quantizes",
    "matmul_type", "optimizer_state_rule", "parse_checkpointing", "precision_facts", "transformers_checkpointing_error",
    "sr_adamw_buckets", "sr_adamw_scratch_numel", "torchao_compiled_step",
]


# --------------------------------------------------------------------------- memory categories
# What a tracked meter counts live tensor bytes by (result.json's memory.by_category), in the
# order tables and plots show them.
MEMORY_CATEGORIES: tuple[str, ...] = ("parameters", "gradients", "optimizer", "activations", "temporaries")


# --------------------------------------------------------------------------- checkpointing
# The policies without a parameter; ``every:K`` is the one with one.
CHECKPOINT_KINDS = ("none", "full", "sqrt", "selective", "selective-matmul")


def parse_checkpointing(policy: str) -> tuple[str, int]:
    """Split a checkpointing policy into (kind, every). ``every:K`` -> ("every", K)."""
    if policy in CHECKPOINT_KINDS:
        return policy, 1
    if policy.startswith("every:"):
        try:
            k = int(policy.split(":", 1)[1])
        except ValueError:
            k = 0
        if not k > 0:
            raise ConfigError(f"--checkpointing {policy!r}: K in every:K must be a positive integer, e.g. every:2")
        return "every", k
    raise ConfigError(f"unknown --checkpointing {policy!r}; choose none, full, every:K, sqrt, selective or selective-matmul")


@dataclass(frozen=True)
class CheckpointPolicy:
    """``--checkpointing`` as a value (policies: :mod:`memtrain.techniques.checkpointing`).

    ``kind`` is none | full | every | sqrt | selective | selective-matmul; ``every`` is the K
    of ``every:K`` (1 otherwise); ``text`` the option as given.
    """

    text: str
    kind: str
    every: int = 1

    @property
    def mixed(self) -> bool:
        """Whether some blocks are checkpointed whole and the others not (every:K, sqrt)."""
        return self.kind in ("every", "sqrt")

    def period(self, n_layers: int) -> int:
        """K of the blocks ``i % K == 0`` a mixed policy checkpoints (sqrt: round(sqrt(L)));
        1 for the policies that treat every block alike."""
        if self.kind == "sqrt":
            return max(1, round(math.sqrt(n_layers)))
        return self.every if self.kind == "every" else 1

    def blocks(self, n_layers: int) -> list[int]:
        """Indices of the blocks the policy wraps (whole, or their attention core under selective)."""
        if self.kind == "none":
            return []
        k = self.period(n_layers)
        return [i for i in range(n_layers) if i % k == 0]

    def n_checkpointed(self, n_layers: int) -> int:
        """How many blocks :meth:`blocks` names."""
        return 0 if self.kind == "none" else -(-n_layers // self.period(n_layers))

    def whole_block(self, i: int, n_layers: int) -> bool:
        """Whether block ``i`` is checkpointed whole (keeps only its input; selective-matmul
        keeps the matmul outputs too). Megatron's selective keeps the block and checkpoints
        only its attention core, so it is False there."""
        if self.kind in ("none", "selective"):
            return False
        return i % self.period(n_layers) == 0


@lru_cache(maxsize=None)
def checkpoint_policy(text: str) -> CheckpointPolicy:
    """Parse ``--checkpointing`` once (a ConfigError naming the choices when it is unknown)."""
    kind, every = parse_checkpointing(text)
    return CheckpointPolicy(text, kind, every)


def transformers_checkpointing_error(text: str) -> Optional[str]:
    """Why a transformers ``--model`` cannot take ``--checkpointing text`` on any device (None:
    it can). Megatron's selective policy recomputes only the attention core, which memtrain
    reaches through its own GPT's attention seam (block.attn.attn_fn); transformers' layers call
    their attention function from inside forward, so there is no such seam to wrap yet. Train
    and the estimate both refuse it with this line."""
    if checkpoint_policy(text).kind != "selective":
        return None
    return ("--checkpointing selective (recompute the attention core) is not available for a "
            "transformers --model yet; use selective-matmul, full, every:K or sqrt")


# --------------------------------------------------------------------------- precision
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
# The matmul types a GPU's peak FLOP/s are listed for (memtrain.devices.gpu_kinds), and the one
# a matmul in each dtype runs on (TF32 is a switch on FP32 matmuls, not a dtype of its own).
MATMUL_TYPES: tuple[str, ...] = ("bf16", "fp16", "tf32", "fp32", "fp8")
DTYPE_MATMUL_TYPE = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
                     "float8_e4m3fn": "fp8", "float8_e5m2": "fp8"}
# The weights dtypes `memtrain generate --dtype` loads a model in (and `estimate --mode inference
# --weights-dtype` models for it): float weights, no quantized kernels.
GENERATE_DTYPES: tuple[str, ...] = ("fp32", "bf16", "fp16")
# FP8 tensor cores arrive with compute capability 8.9 (Ada: L4, L40S, RTX 4090; then Hopper:
# H100, H200); torch's float8 matmul (torch._scaled_mm) refuses older GPUs.
FP8_MIN_CAPABILITY: tuple[int, int] = (8, 9)
# torch._scaled_mm needs both dimensions of a weight to be multiples of 16; torchao's own
# filters (float8_linear_utils._auto_filter_for_*) leave any other Linear in high precision.
FP8_DIM_MULTIPLE = 16


def fp8_converts(n_in: int, n_out: int) -> bool:
    """Whether ``--precision fp8`` runs a Linear of these dimensions in FP8 (else it keeps it in
    the autocast dtype): both must divide by :data:`FP8_DIM_MULTIPLE`."""
    return n_in % FP8_DIM_MULTIPLE == 0 and n_out % FP8_DIM_MULTIPLE == 0


# --qlora's NF4 weights (torchao's ``to_nf4``, memtrain.models.qlora): 4-bit codes in blocks of
# NF4_BLOCK values, each block's absmax scale quantized to int8 in blocks of NF4_SCALER_BLOCK
# scales (double quantization). A weight whose size does not divide into NF4_BLOCK x
# NF4_SCALER_BLOCK values stays in its dtype.
NF4_BLOCK = 64
NF4_SCALER_BLOCK = 256


def nf4_quantizes(numel: int) -> bool:
    """Whether ``--qlora`` stores a frozen Linear weight of ``numel`` values in NF4."""
    return numel > 0 and numel % (NF4_BLOCK * NF4_SCALER_BLOCK) == 0


def nf4_bytes(numel: int, elt: float) -> float:
    """Bytes of an NF4 weight of ``numel`` values quantized from ``elt``-byte elements: the inner
    tensors of torchao's NF4Tensor (``NF4Tensor.from_tensor``): ``quantized_data`` (two 4-bit codes
    a byte), ``quantized_scalers`` (an int8 scale per block), ``quantization_factor`` (one per
    block of scales) and ``scaler_mean`` (a scalar), both in the weight's dtype, and its own
    16-entry code table ``nf4`` in that dtype too. ``quantization_factor`` is
    ``(256 / (2 * absmax))[:, 0].view(n).contiguous()``, the first column of an (n,
    NF4_SCALER_BLOCK) tensor: copied out for n > 1 scale blocks, but for one block the column is
    already contiguous, so the view keeps the whole row's storage."""
    blocks = numel // NF4_BLOCK
    factors = blocks // NF4_SCALER_BLOCK
    return numel / 2 + blocks + (factors if factors > 1 else NF4_SCALER_BLOCK) * elt + elt + 16 * elt
# Other libraries' precision names (Lightning's) that callers of the FLOP/s tables may pass.
_FOREIGN_PRECISION_TYPE = {"bf16-mixed": "bf16", "fp16-mixed": "fp16"}


@dataclass(frozen=True)
class PrecisionFacts:
    """One ``--precision``: the dtypes a run computes and stores in (see
    :mod:`memtrain.techniques.precision` for what each mode means)."""

    name: str
    param_dtype: str  # the weights (and so gradients and torch's optimizer states)
    autocast_dtype: Optional[str] = None  # matmuls and saved activations under autocast
    scaler: bool = False  # a GradScaler (FP16's narrow exponent)
    tf32: bool = False  # TF32 matmuls (a process-wide switch)
    matmul_type: str = "fp32"  # the tensor-core type of the matmuls (a GPU's roof)
    # fp8 (torchao float8 training): the dtype each converted Linear casts its input and weight
    # to, per matmul (dynamic per-tensor scales; the gradient takes e5m2). The weights stay in
    # param_dtype and no autocast copy of them is kept: torchao's Float8Linear saves the
    # autocast-dtype input and the weight itself for backward (``ctx.save_for_backward(input_hp,
    # weight_hp_t)``) and casts both again in backward; the FP8 copies are temporaries. Under
    # torch.compile the partitioner may save the 1-byte casts instead.
    linear_cast_dtype: Optional[str] = None
    min_capability: Optional[tuple[int, int]] = None  # the CUDA compute capability it needs

    @property
    def autocast(self) -> bool:
        return self.autocast_dtype is not None

    @property
    def param_bytes(self) -> int:
        return _DTYPE_BYTES[self.param_dtype]

    @property
    def fp8(self) -> bool:
        """Whether the Linears' matmuls run in FP8 (torchao float8 training)."""
        return self.linear_cast_dtype is not None

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of what the forward computes and saves for backward."""
        return _DTYPE_BYTES[self.autocast_dtype or self.param_dtype]


PRECISION_FACTS: dict[str, PrecisionFacts] = {
    "fp32": PrecisionFacts("fp32", "float32"),
    "tf32": PrecisionFacts("tf32", "float32", tf32=True, matmul_type="tf32"),
    "bf16": PrecisionFacts("bf16", "float32", autocast_dtype="bfloat16", matmul_type="bf16"),
    "fp16": PrecisionFacts("fp16", "float32", autocast_dtype="float16", scaler=True, matmul_type="fp16"),
    "bf16-pure": PrecisionFacts("bf16-pure", "bfloat16", matmul_type="bf16"),
    # torchao float8 training under BF16 autocast: FP32 master weights, gradients and optimizer
    # state as bf16; the Linears' matmuls in FP8 (the LM head, embeddings and attention core stay BF16).
    "fp8": PrecisionFacts("fp8", "float32", autocast_dtype="bfloat16", matmul_type="fp8",
                          linear_cast_dtype="float8_e4m3fn", min_capability=FP8_MIN_CAPABILITY),
}


def precision_facts(name: str) -> PrecisionFacts:
    """The facts of ``--precision name`` (a ConfigError naming the choices when it is unknown)."""
    try:
        return PRECISION_FACTS[name]
    except KeyError:
        raise ConfigError(f"unknown --precision {name!r}; choose one of {', '.join(PRECISION_FACTS)}") from None


def matmul_type(name: str) -> Optional[str]:
    """The matmul type (one of :data:`MATMUL_TYPES`) of a ``--precision``, a matmul type, or a
    dtype's ``torch`` attribute name ("bfloat16"), case-insensitive; None when it names none."""
    key = name.lower()
    if key in PRECISION_FACTS:
        return PRECISION_FACTS[key].matmul_type
    if key in MATMUL_TYPES:
        return key
    return DTYPE_MATMUL_TYPE.get(key) or _FOREIGN_PRECISION_TYPE.get(key)


def half_matmul_type(precision: str) -> Optional[str]:
    """"bf16" or "fp16" for a ``--precision`` whose matmuls run in half precision (the ones a
    device may have no fast kernel for), None for the others and for an unknown name."""
    facts = PRECISION_FACTS.get(precision)
    return facts.matmul_type if facts is not None and facts.matmul_type in ("bf16", "fp16") else None


# --------------------------------------------------------------------------- optimizer state
@dataclass(frozen=True)
class OptimizerStateRule:
    """The state one ``--optim`` keeps per trainable parameter (steady state, after step 1).

    ``states`` full-size state tensors per parameter, each element ``state_bits`` wide when
    quantized (else in the weight's dtype: torch keeps AdamW's and SGD's moments in it);
    quantized optimizers keep a 4-byte scale per ``block`` elements, and (torchao) a lookup
    table of ``2**bits`` fp32 entries per state. ``step_tensor``: a 4-byte step count per
    parameter tensor. ``factored``: Adafactor's row + column second moment instead.
    """

    name: str
    states: int
    state_bits: Optional[int] = None
    block: int = 0  # default quantization block (0: not quantized)
    fixed_block: bool = False  # bitsandbytes always uses its own block
    qmap: bool = False  # torchao's per-state lookup table
    # A tensor it leaves unquantized keeps float32 state (bitsandbytes makes it float32); else the
    # state is in the weight's dtype (torchao's ``zeros_like(p)``: bf16 under --precision bf16-pure).
    unquantized_fp32: bool = False
    step_tensor: bool = False
    factored: bool = False

    @property
    def quantized(self) -> bool:
        return self.state_bits is not None

    def state_bytes(self, param_bytes: float) -> float:
        """Bytes per element of one full-size state tensor (scales and tables not counted)."""
        if self.state_bits is None:
            return param_bytes
        return self.state_bits // 8 if self.state_bits % 8 == 0 else self.state_bits / 8

    def quant_block(self, block: int = 0) -> int:
        """The quantization block a run uses (``--optim-block``, 0 = the optimizer's default)."""
        return self.block if (self.fixed_block or not block) else block


_ADAMW = OptimizerStateRule("adamw", states=2, step_tensor=True)
# In the order ``--optim``'s help and errors list the choices.
OPTIMIZER_STATE_RULES: dict[str, OptimizerStateRule] = {
    "adamw": _ADAMW,
    "adamw-fused": _ADAMW,
    "adamw-foreach": _ADAMW,
    "adafactor": OptimizerStateRule("adafactor", states=0, step_tensor=True, factored=True),
    "adamw-8bit": OptimizerStateRule("adamw-8bit", states=2, state_bits=8, block=256, qmap=True, step_tensor=True),
    "adamw-4bit": OptimizerStateRule("adamw-4bit", states=2, state_bits=4, block=128, qmap=True, step_tensor=True),
    "adamw-bnb-8bit": OptimizerStateRule("adamw-bnb-8bit", states=2, state_bits=8, block=256, fixed_block=True,
                                         unquantized_fp32=True, step_tensor=True),
    "sgd": OptimizerStateRule("sgd", states=1),
}
# The optimizers that are torch's AdamW (one algorithm, three kernels).
ADAMW_KERNELS: tuple[str, ...] = tuple(name for name, rule in OPTIMIZER_STATE_RULES.items() if rule is _ADAMW)
# torchao's low-bit optimizers and their default quantization block (``--optim-block`` changes
# it; bitsandbytes' block is fixed, so it is not listed).
LOW_BIT_BLOCK: dict[str, int] = {name: rule.block for name, rule in OPTIMIZER_STATE_RULES.items()
                                 if rule.quantized and not rule.fixed_block}
# torchao's low-bit optimizers keep FP32 state for a tensor below this many elements (the rule it
# copies from bitsandbytes, which keeps 32-bit state below it too), and for one whose size is not
# a multiple of the block (docs/architecture.md, "Pitfalls already found").
LOW_BIT_MIN_NUMEL = 4096
# Optimizers that can update BF16 weights without an FP32 master copy (``--precision bf16-pure``):
# torchao's, whose update is rounded stochastically.
BF16_PURE_OPTIMS: tuple[str, ...] = ("adamw", "adamw-8bit", "adamw-4bit")
# The eps every AdamW memtrain builds uses: none passes its own, and this is torch's, torchao's
# and bitsandbytes' default (and the Trainer's --adam_epsilon default, which is accepted at it).
ADAM_EPSILON = 1e-8


def optimizer_kernel(optim: str, precision: str, device_type: str) -> str:
    """The kernel ``--optim`` runs on ``device_type``, named as the ``--optim`` that pins it:
    plain ``adamw`` is torch's fused AdamW on CUDA (memtrain.techniques.optim.default_adamw_kernel,
    where a GPU has it) and the per-tensor loop elsewhere; under bf16-pure it is torchao's own
    step, unchanged."""
    if optim == "adamw" and device_type == "cuda" and precision != "bf16-pure":
        return "adamw-fused"
    return optim


def torchao_compiled_step(optim: str, precision: str) -> bool:
    """Whether ``--optim`` under ``--precision`` steps with one of torchao's optimizers, whose
    step ``torch.compile`` turns into one fused kernel per parameter: the low-bit AdamWs always,
    and every bf16-pure optimizer (``--optim adamw`` there is torchao's stochastic-rounding
    ``_AdamW``, memtrain.techniques.optim)."""
    return optim in LOW_BIT_BLOCK or (precision == "bf16-pure" and optim in BF16_PURE_OPTIMS)


# bf16-pure's ``--optim adamw`` (memtrain.techniques.sr_adamw) updates tensors of at most
# SR_ADAMW_ALONE_NUMEL values in flat buckets of at most SR_ADAMW_BUCKET_NUMEL values: one compiled
# call per bucket instead of one per tensor. The bucket bounds the step's scratch (four copies:
# weights, gradients, both moments); a larger tensor's own kernel outweighs a call, so it is
# updated alone as torchao does.
SR_ADAMW_ALONE_NUMEL = 1 << 20
SR_ADAMW_BUCKET_NUMEL = 1 << 22


def sr_adamw_buckets(numels: list[int]) -> list[list[int]]:
    """The buckets bf16-pure's AdamW updates together, as indices into ``numels`` (one param
    group's tensors of one dtype, in order): filled greedily up to SR_ADAMW_BUCKET_NUMEL values,
    tensors above SR_ADAMW_ALONE_NUMEL left out; a bucket of one tensor is left out too (a copy
    for nothing: torchao updates it alone)."""
    buckets: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i, n in enumerate(numels):
        if n > SR_ADAMW_ALONE_NUMEL:
            continue
        if current and total + n > SR_ADAMW_BUCKET_NUMEL:
            buckets.append(current)
            current, total = [], 0
        current.append(i)
        total += n
    if current:
        buckets.append(current)
    return [b for b in buckets if len(b) > 1]


def sr_adamw_scratch_numel(numels: list[int]) -> int:
    """Values in the largest bucket of :func:`sr_adamw_buckets`: the step holds four copies of it
    (weights, gradients and both moments, in the weights' dtype) while it updates that bucket."""
    return max((sum(numels[i] for i in b) for b in sr_adamw_buckets(numels)), default=0)


def low_bit_quantizes(numel: int, block: int) -> bool:
    """Whether torchao's low-bit optimizer with ``block`` quantizes the state of a tensor of
    ``numel`` elements (else it keeps FP32 state for it)."""
    return numel >= LOW_BIT_MIN_NUMEL and numel % block == 0


def optimizer_state_rule(optim: str) -> OptimizerStateRule:
    """The state rule of ``--optim`` (a ConfigError when it is unknown)."""
    try:
        return OPTIMIZER_STATE_RULES[optim]
    except KeyError:
        raise ConfigError(f"unknown --optim {optim!r}") from None


# --------------------------------------------------------------------------- the loss kernel
@dataclass(frozen=True)
class ForeignLossKernel:
    """A ``--loss-kernel`` other than memtrain's own chunked loss: a library's Triton kernel,
    which runs on CUDA only. The estimate says what it models for it (:attr:`note`)."""

    name: str  # the --loss-kernel value
    title: str  # what it is, for messages
    modules: tuple[str, ...]  # what must import
    pip: str  # what installs it
    sixteen_bit: bool = False  # its backward takes 16-bit operands only (a 16-bit compute dtype)
    # Its backward computes the logits again (one more (tokens x d) @ (d x vocab) matmul a step),
    # where memtrain's chunked loss makes both gradients in the forward from the logits it has.
    recomputes_logits: bool = False
    modelled: str = ""  # how the estimate models its buffers ("": as memtrain's chunked loss)
    memory: str = ""  # how its buffers differ from memtrain's chunked loss (when not modelled)

    @property
    def note(self) -> str:
        if self.modelled:
            return f"--loss-kernel {self.name} runs {self.title}; this estimate models {self.modelled}"
        return (f"--loss-kernel {self.name} runs {self.title}; this estimate models memtrain's own chunked loss, "
                f"whose buffers {self.memory}")


FOREIGN_LOSS_KERNELS: dict[str, ForeignLossKernel] = {
    "liger": ForeignLossKernel(
        "liger", "Liger-Kernel's fused linear cross-entropy", ("liger_kernel", "triton"), "liger-kernel",
        memory="Liger's kernel does not share (it picks its own chunk size)"),
    # Apple's Cut Cross-Entropy (Wijmans et al. 2024, the `cut-cross-entropy` package): the logits
    # are computed block by block in on-chip memory and never written out; the forward keeps one
    # float32 log-sum-exp per token and the backward computes them again, with the gradients of
    # the hidden states and the head (accumulated in the 16-bit compute dtype). Its backward
    # asserts 16-bit embeddings, hence sixteen_bit. The estimate models its buffers
    # (memtrain.analysis.estimate.head_nodes._cce_nodes; the trace sees
    # memtrain.techniques.loss._CutCrossEntropyBuffers), read from its source.
    "cce": ForeignLossKernel(
        "cce", "Apple's Cut Cross-Entropy", ("cut_cross_entropy", "triton"), "cut-cross-entropy",
        sixteen_bit=True, recomputes_logits=True,
        modelled="its buffers as cut-cross-entropy 25.1.1 allocates them (a float32 log-sum-exp per token kept "
                 "from forward to backward, both gradients made in backward; no logits), read from its source "
                 "and not yet checked against a GPU's allocator"),
}


# Cut Cross-Entropy's lock tables (cut-cross-entropy 25.1.1), which memtrain.techniques.loss's
# _CutCrossEntropyBuffers allocates for the trace and the analytic estimate counts: its forward
# locks one 4-byte word per CCE_FORWARD_LOCK_TOKENS tokens; its backward one int32 table per
# gradient (rows of the hidden states, of the head), cce_lock_table_shape's.
CCE_FORWARD_LOCK_TOKENS = 128


def cce_forward_locks(tokens: int) -> int:
    """How many int32 locks Cut Cross-Entropy's forward takes for ``tokens`` tokens (its ``cdiv``)."""
    return -(-tokens // CCE_FORWARD_LOCK_TOKENS)


def cce_lock_table_shape(rows: int, d: int) -> tuple[int, int]:
    """The (rows, columns) of Cut Cross-Entropy's backward lock table for a ``rows x d`` gradient:
    one column per 64 of ``d``, as many rows as cover ``rows`` with them (its ``cdiv``s)."""
    columns = -(-d // 64)
    return -(-rows // columns), columns


def foreign_loss_kernel(loss: str, loss_kernel: str, device_type: str) -> Optional[ForeignLossKernel]:
    """The library kernel the run would use for its loss (``--loss chunked --loss-kernel liger|cce``
    on CUDA, the one device they run on), or None where memtrain's own loss runs; the estimate then
    says that it models memtrain's chunked loss instead. Torch-free: the analytic commands load no
    torch."""
    if loss != "chunked" or device_type != "cuda":
        return None
    return FOREIGN_LOSS_KERNELS.get(loss_kernel)


def loss_kernel_precision_error(loss_kernel: str, precision: str) -> Optional[str]:
    """Why ``--loss-kernel`` cannot compute under ``--precision`` (one line), or None. The
    configuration checks it, on any device."""
    kernel = FOREIGN_LOSS_KERNELS.get(loss_kernel)
    if kernel is None or not kernel.sixteen_bit or precision_facts(precision).compute_bytes == 2:
        return None
    return (f"--loss-kernel {kernel.name} computes in 16 bits ({kernel.title}'s backward takes bf16 or fp16 "
            f"operands), not under --precision {precision}: add --precision bf16, or drop --loss-kernel")


def loss_kernel_refusal(loss: str, loss_kernel: str, device_type: str) -> Optional[str]:
    """Why ``--loss-kernel`` cannot run on ``device_type`` (one line that says what to change), or
    None where it can or memtrain's own kernel was asked for.
    :func:`memtrain.techniques.loss.make_loss_fn` raises it."""
    kernel = FOREIGN_LOSS_KERNELS.get(loss_kernel)
    if loss != "chunked" or kernel is None:
        return None
    if device_type != "cuda":
        return (f"--loss-kernel {kernel.name} runs on CUDA only ({kernel.title} is Triton code), not on "
                f"{device_type}; drop --loss-kernel for memtrain's chunked loss")
    missing = [name for name in kernel.modules if importlib.util.find_spec(name) is None]
    if missing:
        return (f"--loss-kernel {kernel.name} needs {' and '.join(missing)}: pip install {kernel.pip}, or drop "
                "--loss-kernel for memtrain's chunked loss")
    return None


# --------------------------------------------------------------------------- activation offloading
# ``--offload-activations`` (memtrain.techniques.offload) and its estimate (the simulator) share
# these. A saved tensor smaller than OFFLOAD_MIN_BYTES stays on the device: its copy's fixed cost
# (a kernel launch, a pinned allocation, an event) outweighs the bytes it would free; 1024 bytes is
# torchtune's default (OffloadActivations' min_offload_size). OFFLOAD_PREFETCH: how many saved
# tensors the backward brings back ahead of the one in use (the side stream's look-ahead).
OFFLOAD_MIN_BYTES = 1024
OFFLOAD_PREFETCH = 2


# ---------------------------------------------------------------------------- the chunked loss
# cuBLAS's fast tensor-core GEMMs want every row of a 16-bit operand to start on a 16-byte
# boundary; a (chunk x 50257) logits buffer (GPT-2's odd vocabulary) has none after its first, so
# each of a chunk's three matmuls falls back to a slower kernel (on an H200 the compiled seed GPT's
# head matmuls took 11.5 ms a step that way and 1.9 ms aligned: benchmarks/results/gpu-h200). On
# CUDA the chunked loss's fused path therefore lays the logits out LOSS_ALIGN_VOCAB columns wide
# (inductor pads such buffers itself: torch._inductor.config.comprehensive_padding), at most 63
# more columns, masked in the loss; the estimate sizes its CUDA buffers the same way.
LOSS_ALIGN_VOCAB = 64


def aligned_vocab(vocab: int, multiple: int = LOSS_ALIGN_VOCAB) -> int:
    """``vocab`` rounded up to a multiple of ``multiple`` (the fused chunked loss's logits width)."""
    return -(-vocab // multiple) * multiple


# --loss-chunk 0 (the default): tokens per chunk by device. On a CPU the chunk's buffers set the
# step's peak and its launches cost little, so small chunks keep it low: 256 tokens. On CUDA each
# chunk costs a fixed price that a small chunk cannot hide: its compiled call's host time, and one
# pass over the (V x d) weight gradient (``g.t() @ h`` written in the compute dtype, then added into
# the float32 grad_w: about 12 V d bytes of device traffic a chunk, whatever the chunk's size). That
# pass grows with the vocabulary as the chunk's arithmetic does, so a larger vocabulary does not hide
# it better: the chunk has to be large everywhere. Measured: on an H200 (benchmarks/results/gpu-h200)
# the seed GPT's eager step took 25.5 ms at 256 tokens a chunk, 13.6 ms at 1024 and 16.2 ms at 4096
# (the standard loss: 29.6 ms), with 1.03, 1.17 and 1.75 GiB allocated; Qwen2.5-0.5B (151,936-token
# head, batch 4 x 1024) took 109.3 ms a step at 256 against the standard loss's 85.3 ms (1.28x), and
# on an H100 (benchmarks/results/gpu-h100/runbook-2026-11-26) 85.6 / 75.9 / 74.1 ms at 256 / 1024 /
# 4096 against 82.0 ms, with 13.52 / 14.06 / 15.51 GiB allocated against 19.61. So on CUDA the chunk is
# 1024 tokens, halved (down to 256) only while its logits would hold more than LOSS_CHUNK_CUDA_VALUES
# values (512 MiB in BF16): 1024 for every vocabulary up to 262,144 (GPT-2's, Llama-3's, Qwen2.5's,
# Gemma's), 512 past it.
LOSS_CHUNK_CPU = 256
LOSS_CHUNK_CUDA_MAX = 1024
LOSS_CHUNK_CUDA_VALUES = 2**28


def effective_loss_chunk(loss_chunk: int, device_type: str, vocab: int) -> int:
    """The tokens per chunk ``--loss-chunk loss_chunk`` runs with on ``device_type`` ("cpu",
    "cuda", "cuda:N"; any other as a CPU) for an LM head of ``vocab`` rows: the value given, or
    for 0 the device's default (see above)."""
    if loss_chunk:
        return loss_chunk
    if not device_type.startswith("cuda"):
        return LOSS_CHUNK_CPU
    chunk = LOSS_CHUNK_CUDA_MAX
    while chunk > LOSS_CHUNK_CPU and chunk * aligned_vocab(vocab) > LOSS_CHUNK_CUDA_VALUES:
        chunk //= 2
    return chunk
