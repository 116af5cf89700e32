"""Predict the memory of a training step by component, without running it.

Pure arithmetic on the same config objects a run uses (no torch import), so an estimate and a
measurement always describe the same run. Three parts:

1. **Model state** (exact for any size): parameter counts from the model shape, then weights,
   gradients and optimizer state in bytes for the configured precision, optimizer, LoRA and
   sharding (:func:`param_table`, :func:`optimizer_state_bytes`).
2. **The step's timeline**: a small storage-lifetime simulation over the op inventory of *our*
   model (what each op allocates, what autograd saves, when it is freed, what backward
   allocates). It replays forward, loss, backward block by block (with recomputation under
   activation checkpointing) and the optimizer step, and reports the largest total with its
   phase and its breakdown in the five categories that :class:`memtrain.metrics.MemoryMeter`
   measures. Walking the timeline instead of adding closed-form terms is what makes the peak
   right when it moves (loss backward for a large vocabulary, the top block's backward for long
   sequences, the optimizer step for large models).
3. **Rules of thumb** from the literature (:data:`OPTIMIZER_RULES`, :func:`model_state_rule`):
   the bytes per parameter quoted by the Hugging Face docs and the ZeRO paper, reported next to
   the implementation-exact numbers so a reader can see where they agree.

The formulas, their sources (HF "model memory anatomy", ZeRO, Korthikanti et al. 2022) and what
differs in this implementation are in docs/estimation.md.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterable, Optional

from memtrain.config import ConfigError, ModelConfig, RunConfig, TechniqueConfig
from memtrain.limits import MAX_LAYERS, MAX_PARAMS, check_analytic_size
from memtrain.techniques.facts import checkpoint_policy, optimizer_state_rule, precision_facts

__all__ = [
    "Arch",
    "GPT2_ARCH",
    "LLAMA_ARCH",
    "OPTIMIZER_RULES",
    "Estimate",
    "ParamInfo",
    "estimate",
    "estimate_inference",
    "model_state_rule",
    "optimizer_state_bytes",
    "check_analytic_size",
    "param_count",
    "param_table",
    "parse_count",
    "shape_for_params",
]

from memtrain.archs import GPT2_ARCH, LLAMA_ARCH, Arch  # noqa: E402

DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "int8": 1, "int4": 0.5}
CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporaries")
# The JSON contract's component names, and which meter category each one is part of.
COMPONENTS = ("weights", "gradients", "optimizer", "activations", "logits", "temporaries")
_CATEGORY_OF = {"weights": "parameters", "gradients": "gradients", "optimizer": "optimizer",
                "activations": "activations", "logits": "activations", "temporaries": "temporaries"}

# Bytes of torch.get_rng_state() on CPU: non-reentrant checkpointing stores one per block call
# (preserve_rng_state=True) so that dropout draws the same masks during the recompute.
_CPU_RNG_STATE_BYTES = 5056


# --------------------------------------------------------------------------- architecture
# Arch, GPT2_ARCH and LLAMA_ARCH live in memtrain.archs (a leaf module); re-exported here.


# --------------------------------------------------------------------------- parameters
@dataclass(frozen=True)
class ParamInfo:
    """One parameter tensor: its name, shape and whether it is trained."""

    name: str
    shape: tuple[int, ...]
    trainable: bool = True
    block: Optional[int] = None  # index of the Transformer block it belongs to
    # How many tensors of this shape the entry stands for: a compressed table (one per layer
    # *kind*, see :func:`param_count`) counts a block's parameters once with repeat = n_layers.
    repeat: int = 1

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _lora_targets(tech: TechniqueConfig) -> set[str]:
    return {t.strip() for t in tech.lora_targets.split(",") if t.strip()}


def param_table(m: ModelConfig, arch: Arch = GPT2_ARCH, tech: Optional[TechniqueConfig] = None) -> list[ParamInfo]:
    """Every parameter tensor of the model, in ``model.parameters()`` order (tied head once).

    With LoRA (``tech.lora_rank > 0``) the base weights are frozen and each targeted Linear
    gets ``A (r x in)`` and ``B (out x r)`` adapters (peft's layout); only those train.
    One entry per tensor, so O(n_layers): :func:`param_count` answers counts in O(1).
    """
    check_analytic_size(m)
    return _param_table(m, arch, tech, range(m.n_layers))


def param_count(m: ModelConfig, arch: Arch = GPT2_ARCH, tech: Optional[TechniqueConfig] = None) -> tuple[int, int]:
    """(parameters, trainable parameters) counted per layer kind: one block's tensors times
    ``n_layers`` plus the rest, so the cost does not grow with the depth."""
    check_analytic_size(m)
    total = trainable = 0
    for p in _param_table(m, arch, tech, range(min(1, m.n_layers))):
        k = p.numel * (m.n_layers if p.block is not None else 1)
        total += k
        trainable += k if p.trainable else 0
    return total, trainable


def _param_table(m: ModelConfig, arch: Arch, tech: Optional[TechniqueConfig], blocks: Iterable[int],
                 repeat: Optional[dict[int, int]] = None) -> list[ParamInfo]:
    """The table with only the blocks ``blocks`` (indices used in the names); ``repeat``
    gives a block's entries a multiplicity (the compressed simulation's lumped periods)."""
    d, f, V = m.d_model, m.d_ff, m.padded_vocab_size
    kv = (arch.n_kv_heads or m.n_heads) * m.head_dim
    bias = m.bias and arch.name == "gpt2"
    lora = tech.lora_rank if tech is not None else 0
    targets = _lora_targets(tech) if lora else set()  # type: ignore[arg-type]  # lora > 0 implies tech is not None
    frozen = bool(lora)
    out: list[ParamInfo] = [ParamInfo("wte.weight", (V, d), not frozen)]
    if arch.positional == "learned":
        out.append(ParamInfo("wpe.weight", (m.max_seq_len, d), not frozen))

    rep = repeat or {}

    def norm(name: str, i: Optional[int]) -> None:
        k = rep.get(i, 1) if i is not None else 1
        out.append(ParamInfo(f"{name}.weight", (d,), not frozen, i, k))
        if bias and arch.norm == "layernorm":
            out.append(ParamInfo(f"{name}.bias", (d,), not frozen, i, k))

    def linear(name: str, short: str, n_in: int, n_out: int, i: int) -> None:
        k = rep.get(i, 1)
        out.append(ParamInfo(f"{name}.weight", (n_out, n_in), not frozen, i, k))
        if bias:
            out.append(ParamInfo(f"{name}.bias", (n_out,), not frozen, i, k))
        if lora and short in targets:
            out.append(ParamInfo(f"{name}.lora_A", (lora, n_in), True, i, k))
            out.append(ParamInfo(f"{name}.lora_B", (n_out, lora), True, i, k))

    for i in blocks:
        p = f"blocks.{i}"
        norm(f"{p}.ln_1", i)
        linear(f"{p}.attn.qkv", "qkv", d, d + 2 * kv, i)
        linear(f"{p}.attn.proj", "proj", d, d, i)
        norm(f"{p}.ln_2", i)
        if arch.mlp == "swiglu":
            linear(f"{p}.mlp.fc", "fc", d, 2 * f, i)  # gate and up fused
        else:
            linear(f"{p}.mlp.fc", "fc", d, f, i)
        linear(f"{p}.mlp.fc_out", "fc_out", f, d, i)
    norm("ln_f", None)
    if m.untie_embeddings:
        out.append(ParamInfo("lm_head.weight", (V, d), not frozen))
    return out


def parse_count(text: str | int | float) -> int:
    """``3B``, ``124M``, ``7e9``, ``350k`` -> a parameter count."""
    if isinstance(text, (int, float)):
        return int(text)
    s = str(text).strip().replace("_", "").replace(",", "")
    mult = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
    unit = s[-1:].lower()
    try:
        value = float(s[:-1]) * mult[unit] if unit in mult else float(s)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"cannot read parameter count {text!r}; write it like 3B, 124M or 7e9")
    if value > MAX_PARAMS:
        raise ConfigError(f"parameter count {text!r} is beyond what memtrain estimates (at most {MAX_PARAMS:.0e}); "
                          f"give a real size such as 175B")
    return int(value)


# GPT-3 paper (Brown et al. 2020, table 2.1): (n_layers, d_model, n_heads) by size. Used to give
# a bare parameter count a plausible GPT-2-style shape.
_GPT3_SHAPES = [(4, 256, 8), (8, 512, 8), (12, 768, 12), (24, 1024, 16), (24, 1536, 16), (24, 2048, 16), (32, 2560, 32),
                (32, 4096, 32), (40, 5120, 40), (96, 12288, 96)]


def shape_for_params(target: int, base: Optional[ModelConfig] = None) -> ModelConfig:
    """A GPT-2-style ModelConfig with about ``target`` parameters (within 0.1%).

    Width and heads come from the GPT-3 size ladder entry nearest in count; depth is scaled to
    the target; ``d_ff`` (4 x d_model to start) is then adjusted so the total lands on the
    target. Vocabulary, context length, dropout, bias and tying come from ``base``.
    """
    base = base or ModelConfig()

    def count(n_layers: int, d: int, h: int, f: int) -> int:
        cfg = replace(base, d_model=d, n_heads=h, n_layers=n_layers, d_ff=f)
        return param_count(cfg)[0]

    best = None
    for n_layers, d, h in _GPT3_SHAPES:
        c = count(n_layers, d, h, 4 * d)
        if best is None or abs(math.log(c / target)) < abs(math.log(best[0] / target)):
            best = (c, n_layers, d, h)
    assert best is not None
    _, n_layers, d, h = best
    per_layer = count(2, d, h, 4 * d) - count(1, d, h, 4 * d)
    fixed = count(1, d, h, 4 * d) - per_layer
    n_layers = max(1, round((target - fixed) / per_layer))
    if n_layers > MAX_LAYERS:
        raise ConfigError(f"--params {target:,} would need {n_layers:,} layers at d_model {d} (the widest GPT-3 "
                          f"shape); memtrain estimates at most {MAX_LAYERS:,}: give the shape with "
                          f"--d-model/--n-layers/--d-ff")
    # Per layer, d_ff contributes (2 d + 1) parameters for each unit (fc and fc_out, fc bias).
    per_ff = count(n_layers, d, h, 4 * d + 1) - count(n_layers, d, h, 4 * d)
    f = max(1, 4 * d + round((target - count(n_layers, d, h, 4 * d)) / per_ff))
    got = count(n_layers, d, h, f)
    if abs(got / target - 1) > 0.01:
        raise ConfigError(
            f"--params {target:,} cannot be matched by a GPT-2-style shape with vocabulary "
            f"{base.vocab_size} (closest {got:,}); give the shape with --d-model/--n-layers/--d-ff instead")
    return replace(base, d_model=d, n_heads=h, n_layers=n_layers, d_ff=f)


# --------------------------------------------------------------------------- optimizer rules
# Literature bytes per parameter of optimizer state (not weights, not gradients). Each entry:
# (bytes per trainable parameter, where the number comes from).
OPTIMIZER_RULES: dict[str, tuple[float, str]] = {
    "adamw": (8.0, "HF docs, model memory anatomy: 2 fp32 states (exp_avg, exp_avg_sq)"),
    "adafactor": (4.0, "HF docs, efficient training on one GPU: 'slightly more than 4 bytes'; "
                       "that is a fp32 first moment (Adafactor with beta1) plus the factored "
                       "second moment (row + column vectors, ~0 B/param)"),
    "adamw-8bit": (2.0, "HF docs / bitsandbytes: 2 states x 1 byte (block-wise scales not counted)"),
    "adamw-4bit": (1.0, "2 states x 4 bits (torchao; scales not counted)"),
    "sgd": (4.0, "HF docs: SGD with momentum keeps 1 fp32 state"),
    # ZeRO paper (Rajbhandari et al. 2020), K = 12 for mixed-precision Adam: the fp32 master
    # copy of the weights (4) counts as optimizer state next to the two fp32 moments (4 + 4).
    "adamw-mixed": (12.0, "ZeRO paper K=12: fp32 master weights + 2 fp32 Adam states"),
}
_RULE_ALIASES = {"adamw-fused": "adamw", "adamw-foreach": "adamw", "adamw-bnb-8bit": "adamw-8bit"}


def model_state_rule(params: int, optim: str = "adamw", trainable: Optional[int] = None,
                     mixed_precision: bool = False) -> dict[str, Any]:
    """The literature's model-state memory: bytes per parameter times the count.

    ``trainable`` (LoRA) restricts optimizer state to the trained parameters. With
    ``mixed_precision`` and an Adam-type optimizer the ZeRO K=12 rule applies (fp32 master
    weights held by the optimizer); e.g. a 7B model with 0.2B LoRA parameters: 0.2e9 x 12 =
    2.4 GB of optimizer memory, against 7e9 x 12 = 84 GB for full fine-tuning.
    """
    name = _RULE_ALIASES.get(optim, optim)
    if mixed_precision and name == "adamw":
        name = "adamw-mixed"
    if name not in OPTIMIZER_RULES:
        raise ConfigError(f"no literature rule for --optim {optim}; known: {', '.join(sorted(OPTIMIZER_RULES))}")
    per, source = OPTIMIZER_RULES[name]
    n = params if trainable is None else trainable
    return {"optimizer": name, "bytes_per_param": per, "optimizer_bytes": per * n,
            "parameters": params, "trainable_parameters": n, "source": source}


def _rule_key(optim: str, precision: str) -> tuple[str, bool]:
    return optim, precision in ("bf16", "fp16")


# --------------------------------------------------------------------------- optimizer (ours)
def _quantizable(numel: int, block: int) -> bool:
    # torchao's low-bit optimizers quantize only tensors with >= 4096 elements whose size is a
    # multiple of the block; others keep fp32 state (design.md, "pitfalls").
    return numel >= 4096 and numel % block == 0


def optimizer_state_bytes(params: Iterable[ParamInfo], optim: str, param_bytes: float,
                          block: int = 0) -> tuple[float, list[str]]:
    """Steady-state optimizer state for *our* optimizers over the trainable ``params``.

    ``block``: the low-bit optimizers' quantization block (``--optim-block``; 0 = torchao's
    default for ``optim``; bitsandbytes always uses 256 here).

    Returns (bytes, explanation lines). ``param_bytes`` is the dtype size of the weights (AdamW
    keeps its moments in the parameters' dtype: 2 x 4 B in fp32, 2 x 2 B under bf16-pure).
    """
    rule = optimizer_state_rule(optim)  # the one state rule (memtrain.techniques.facts)
    ps = [p for p in params if p.trainable]
    n = sum(p.numel * p.repeat for p in ps)
    n_tensors = sum(p.repeat for p in ps)
    if rule.factored:
        # torch.optim.Adafactor: no first moment; the second moment of a matrix (R, C) is factored
        # into a row (R) and a column (C) vector, full for vectors; plus a step tensor.
        total = 0.0
        for p in ps:
            if len(p.shape) >= 2:
                r, c = p.shape[-2], p.shape[-1]
                lead = math.prod(p.shape[:-2])
                total += (4 * lead * (r + c) + 4) * p.repeat
            else:
                total += (4 * p.numel + 4) * p.repeat
        return total, ["Adafactor: factored second moment (rows + columns per matrix), no first moment"]
    if rule.quantized:
        return _quantized_state_bytes(ps, rule, n, block)
    if rule.step_tensor:
        # AdamW: exp_avg + exp_avg_sq per parameter, plus a 4-byte float32 ``step`` tensor each.
        return (rule.states * param_bytes * n + 4 * n_tensors,
                [f"AdamW: 2 moments x {param_bytes:g} B x {n:,} trainable params"])
    return param_bytes * n, [f"SGD momentum: 1 buffer x {param_bytes:g} B x {n:,}"]


def _quantized_state_bytes(ps: list[ParamInfo], rule: Any, n: int, block: int) -> tuple[float, list[str]]:
    """A low-bit AdamW's state: quantized codes + block scales on the tensors it quantizes."""
    bits = rule.state_bits
    block = rule.quant_block(block)
    total = 0.0
    q = 0
    for p in ps:
        if _quantizable(p.numel, block):
            q += p.numel * p.repeat
            # codes + one fp32 scale per block, for each of the 2 states; torchao also keeps
            # a 256-entry (8-bit) or 16-entry (4-bit) fp32 lookup table per state.
            codes = p.numel * bits / 8
            scales = 4 * p.numel / block
            qmap = 4 * (2 ** bits) if rule.qmap else 0
            total += (2 * (codes + scales + qmap) + 4) * p.repeat
        else:
            total += (2 * 4 * p.numel + 4) * p.repeat
    lines = [f"{bits}-bit AdamW: 2 states x {bits} bits + fp32 scale per {block} elements on "
             f"{q:,} of {n:,} params; the rest (tensors < 4096 elements or not a multiple of "
             f"{block}) keep fp32 states"]
    return total, lines


def _optimizer_temporaries(params: list[ParamInfo], optim: str, param_bytes: float, weight_decay: float) -> float:
    """Scratch the optimizer step allocates at its worst moment (steady state)."""
    ps = [p for p in params if p.trainable]
    if not ps:
        return 0.0
    largest = max(p.numel for p in ps) * param_bytes
    if optim == "adamw":
        # Single-tensor AdamW works one parameter at a time: denom = sqrt(v) / c builds two
        # buffers of the parameter's size, and the local ``denom`` keeps the previous
        # parameter's alive until it is replaced. So the peak of a param group (memtrain's two:
        # matrices, then vectors, each in model order) is max(previous + 2 x current). Measured
        # with MemoryMeter on torch 2.13: 2 x 51,463,168 B for a lone 50257 x 256 embedding,
        # 3 x 262,144 B for two consecutive 128 x 512 FFN matrices.
        worst = 0.0
        for group in ([p for p in ps if len(p.shape) >= 2], [p for p in ps if len(p.shape) < 2]):
            previous = 0.0
            for p in group:
                current = p.numel * param_bytes
                worst = max(worst, previous + 2 * current)
                previous = current
        return worst
    if optim == "adamw-foreach":
        # _foreach_sqrt(exp_avg_sqs) materializes one buffer per parameter of a param group.
        decay = sum(p.numel * p.repeat for p in ps if len(p.shape) >= 2) * param_bytes
        no_decay = sum(p.numel * p.repeat for p in ps if len(p.shape) < 2) * param_bytes
        return max(decay, no_decay)
    if optim == "sgd":
        # d_p = grad.add(param, alpha=weight_decay): one buffer for the largest parameter.
        return largest if weight_decay else 0.0
    if optim == "adafactor":
        # torch.optim.Adafactor works on one parameter at a time with two parameter-sized
        # buffers (the squared gradient, then the normalized update). Measured (torch 2.13).
        return 2 * largest
    # torchao's low-bit step is one compiled (fused) kernel per parameter that dequantizes,
    # updates and requantizes in registers: measured no scratch above the backward peak
    # (34.51 MB peak in backward for a 3.3M-parameter model, torch 2.13, CPU). Fused AdamW and
    # bitsandbytes update in place too.
    return 0.0  # fused kernels (adamw-fused, bitsandbytes) update in place


# --------------------------------------------------------------------------- the simulator
class _Sim:
    """Live-storage accounting: allocations, frees and the peak with its breakdown.

    Each storage has a category (final role, as MemoryMeter reports it at the peak) and a
    component tag (weights, gradients, optimizer, activations, logits, temporaries).
    """

    def __init__(self) -> None:
        self.live: dict[int, tuple[float, str]] = {}
        self.by_tag: dict[str, float] = {c: 0.0 for c in COMPONENTS}
        self.total = 0.0
        self.peak = -1.0
        self.peak_tags: dict[str, float] = {}
        self.peak_phase = ""
        self.peak_detail = ""
        self.phase = ""
        self.detail = ""
        self.phase_peaks: dict[str, float] = {}
        self._next = 0
        # (op, storage id, bytes) in order, for the CUDA caching-allocator replay; None = off.
        self.events: Optional[list[tuple[str, int, float]]] = None

    def alloc(self, nbytes: float, tag: str) -> int:
        self._next += 1
        sid = self._next
        if self.events is not None:
            self.events.append(("alloc", sid, nbytes))
        self.live[sid] = (nbytes, tag)
        self.by_tag[tag] += nbytes
        self.total += nbytes
        self._check()
        return sid

    def free(self, sid: Optional[int]) -> None:
        if sid is None or sid not in self.live:
            return
        if self.events is not None:
            self.events.append(("free", sid, 0.0))
        nbytes, tag = self.live.pop(sid)
        self.by_tag[tag] -= nbytes
        self.total -= nbytes

    def transient(self, nbytes: float, tag: str = "temporaries") -> None:
        if nbytes > 0:
            self.free(self.alloc(nbytes, tag))

    def retag(self, sid: int, tag: str) -> None:
        nbytes, old = self.live[sid]
        self.by_tag[old] -= nbytes
        self.by_tag[tag] += nbytes
        self.live[sid] = (nbytes, tag)

    def at(self, phase: str, detail: str) -> None:
        self.phase, self.detail = phase, detail

    def _check(self) -> None:
        if self.total > self.phase_peaks.get(self.phase, -1.0):
            self.phase_peaks[self.phase] = self.total
        if self.total > self.peak:
            self.peak = self.total
            self.peak_tags = dict(self.by_tag)
            self.peak_phase = self.phase
            self.peak_detail = self.detail


@dataclass
class _Node:
    """One op of the forward pass, as far as memory is concerned.

    ``out``: new storages it allocates, (key, bytes) or (key, bytes, tag); ``inputs``: keys it
    reads (for lifetimes); ``saves``: keys autograd keeps for its backward; ``grads``: (key,
    bytes) gradients its backward produces (``param:NAME`` for a parameter, bytes 0.0 there
    meaning "the parameter's size"; bytes 0.0 for a tensor: the output's gradient passed through
    without a copy); ``grad_out``: the key(s) whose gradient it consumes (default: first output);
    ``grad_from``: gradients that are forward storages handed over (the chunked loss computes
    them in forward); ``hold``: outputs live until the forward ends (autocast's weight cache);
    ``matmul``: selective checkpointing keeps its outputs; ``scratch``/``fwd_scratch``: transient
    bytes of its backward/forward.
    """

    name: str
    out: list[tuple] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)
    saves: list[str] = field(default_factory=list)
    grads: list[tuple[str, float]] = field(default_factory=list)
    grad_out: Optional[tuple[str, ...]] = None
    grad_from: dict[str, str] = field(default_factory=dict)
    hold: bool = False
    matmul: bool = False
    keep: Optional[tuple[str, ...]] = None
    scratch: float = 0.0
    fwd_scratch: float = 0.0
    tag: str = "activations"
    core: bool = False  # part of the attention core (q, k, v -> output) that selective recomputes

    def sac_kept(self) -> tuple[str, ...]:
        """Outputs selective checkpointing keeps (those of the matmul/attention kernel itself)."""
        if not self.matmul:
            return ()
        return self.keep if self.keep is not None else tuple(o[0] for o in self.out)

    def out_keys(self) -> tuple[str, ...]:
        if self.grad_out is not None:
            return self.grad_out
        return (self.out[0][0],) if self.out else ()


@dataclass
class _Segment:
    """A run of nodes: a Transformer block (maybe checkpointed), the embedding or the head."""

    name: str
    nodes: list[_Node]
    checkpoint: str = "none"  # none | full | selective
    input_key: Optional[str] = None


class _Graph:
    """Runs forward and backward of a list of segments through a :class:`_Sim`."""

    def __init__(self, sim: _Sim, segments: list[_Segment], param_grad: dict[str, float],
                 grads_exist: bool, rng_state_bytes: float) -> None:
        self.sim = sim
        self.segments = segments
        self.param_grad = param_grad  # trainable param name -> bytes of its .grad
        self.rng_state_bytes = rng_state_bytes
        self.store: dict[str, int] = {}  # key -> storage id (forward tensors)
        self.saved_refs: dict[str, int] = {}
        self.grad_sid: dict[str, int] = {}  # key -> storage id of its gradient
        self.grad_refs: dict[int, int] = {}
        # Gradient accumulation: every .grad exists already (sid -1: counted by the caller).
        self.param_grad_sid: dict[str, int] = {k: -1 for k in param_grad} if grads_exist else {}
        self._shared: dict[int, str] = {}  # gradient storage id -> forward key it belongs to
        self.tied: set[str] = set()  # parameters used twice (the tied embedding / LM head)
        self.deferred: dict[str, Any] = {}  # tied parameter -> its buffered first gradient (key or sid)
        # Deep models: lumped periods of blocks (see _Compression); their storages by tag.
        self.comp: Optional[_Compression] = None
        # --loss naive: forward keys a caller keeps past the step, and actions after a node's forward.
        self.pinned: set[str] = set()
        self.after_forward: dict[str, Any] = {}
        self.lump_kept: list[int] = []  # freed in backward
        self.lump_flush: list[int] = []  # autocast weight copies no op saved: freed when forward ends
        self.lump_grads: list[int] = []  # what the lumped periods leave after backward (gradients)
        self._kept_by_tag: dict[str, float] = {}

    def _snapshot(self) -> dict[str, float]:
        return dict(self.sim.by_tag)

    def _lump_forward(self, before: dict[str, float], held: list[str], n_held_before: int) -> None:
        """After the measured period's forward: allocate ``lumps`` copies of what it kept."""
        comp, sim = self.comp, self.sim
        assert comp is not None
        flush: dict[str, float] = {}
        for k in held[n_held_before:]:
            if k not in self.saved_refs and k in self.store:
                nbytes, tag = sim.live[self.store[k]]
                flush[tag] = flush.get(tag, 0.0) + nbytes
        for tag in COMPONENTS:
            delta = sim.by_tag[tag] - before[tag]
            kept = delta - flush.get(tag, 0.0)
            self._kept_by_tag[tag] = kept
            if kept:
                self.lump_kept.append(sim.alloc(comp.lumps * kept, tag))
            if flush.get(tag):
                self.lump_flush.append(sim.alloc(comp.lumps * flush[tag], tag))

    def _lump_backward(self, before: dict[str, float]) -> None:
        """After the backward of the period above the lump: the lumped periods' backward, each
        changing the live bytes by what that period's backward changed them by."""
        comp, sim = self.comp, self.sim
        assert comp is not None
        delta = {tag: sim.by_tag[tag] - before[tag] for tag in COMPONENTS}
        for sid in self.lump_kept:
            sim.free(sid)
        self.lump_kept = []
        for tag in COMPONENTS:
            left = comp.lumps * (self._kept_by_tag.get(tag, 0.0) + delta[tag])
            if left:
                self.lump_grads.append(sim.alloc(left, tag))

    # ---- forward
    def _release(self, key: str) -> None:
        n = self.saved_refs.get(key, 0)
        if n > 1:
            self.saved_refs[key] = n - 1
            return
        self.saved_refs.pop(key, None)
        if key in self.pinned:
            return
        self.sim.free(self.store.pop(key, None))

    def _run_forward(self, nodes: list[_Node], keep_saves: bool, tag_override: Optional[str],
                     keep_keys: set[str], later: Any) -> list[str]:
        """Allocate outputs, keep saved tensors, free the rest at last use; returns the keys held
        by autocast's cache (freed when the autocast region ends)."""
        last: dict[str, int] = {}
        for i, n in enumerate(nodes):
            for k in n.inputs:
                last[k] = i
        held: list[str] = []
        for i, n in enumerate(nodes):
            for o in n.out:
                key, nbytes = o[0], o[1]
                if key in self.store:
                    continue  # selective checkpointing: output cached from the forward pass
                tag = tag_override or (o[2] if len(o) > 2 else n.tag)
                self.store[key] = self.sim.alloc(nbytes, tag)
            self.sim.transient(n.fwd_scratch, tag_override or n.tag)
            if keep_saves:
                for k in n.saves:
                    if k in self.store:
                        self.saved_refs[k] = self.saved_refs.get(k, 0) + 1
            if n.hold:
                held.extend(o[0] for o in n.out)
            if n.name in self.after_forward:
                self.after_forward.pop(n.name)()
            for k in set(n.inputs) | {o[0] for o in n.out}:
                if (last.get(k, -1) > i or k in later or k in keep_keys or k in self.saved_refs or k in held
                        or k in self.pinned):
                    continue
                self.sim.free(self.store.pop(k, None))
        return held

    def _flush(self, held: list[str]) -> None:
        for k in held:
            if k not in self.saved_refs:
                self.sim.free(self.store.pop(k, None))

    # ---- backward
    def _grad_alloc(self, n: _Node, key: str, nbytes: float, through: Optional[int]) -> None:
        sim = self.sim
        if key.startswith("param:"):
            name = key[6:]
            if name not in self.param_grad:
                return  # frozen parameter
            if name in self.deferred:
                # The tied weight's second gradient (the embedding's): autograd sums it with the
                # buffered first one out of place into the .grad; then both are freed.
                tmp = sim.alloc(nbytes, "temporaries")
                self.param_grad_sid[name] = sim.alloc(self.param_grad[name], "gradients")
                sim.free(tmp)
                buffered = self.deferred.pop(name)
                if isinstance(buffered, str):
                    self._release(buffered)
                else:
                    sim.free(buffered)
                return
            if name in self.param_grad_sid:
                if key not in n.grad_from:
                    sim.transient(nbytes)  # the op's gradient, added in place into .grad
                return
            if name in self.tied:
                # A tied weight has two gradient edges: autograd buffers the first (the LM
                # head's; for the chunked loss, its grad_w itself) until the embedding's arrives.
                src = n.grad_from.get(key)
                if src is not None and src in self.store:
                    self.deferred[name] = src
                    self.saved_refs[src] = self.saved_refs.get(src, 0) + 1
                else:
                    self.deferred[name] = sim.alloc(nbytes, "temporaries")
                return
            self.param_grad_sid[name] = sim.alloc(self.param_grad[name], "gradients")
            return
        src = n.grad_from.get(key)
        if src is not None and src in self.store and key not in self.grad_sid:
            # A forward buffer handed on as this gradient: shared, freed with its last user.
            sid = self.store[src]
            self.saved_refs[src] = self.saved_refs.get(src, 0) + 1
            self.grad_sid[key] = sid
            self.grad_refs[sid] = self.grad_refs.get(sid, 0) + 1
            self._shared[sid] = src
            return
        if key in self.grad_sid:
            sim.transient(nbytes)  # a second gradient for the same tensor is added in
            return
        if nbytes == 0 and through is not None:
            self.grad_sid[key] = through
            self.grad_refs[through] = self.grad_refs.get(through, 0) + 1
            return
        sid = sim.alloc(nbytes, "temporaries")
        self.grad_sid[key] = sid
        self.grad_refs[sid] = 1

    def _drop_grad(self, key: str) -> None:
        if key not in self.grad_sid:
            return
        sid = self.grad_sid.pop(key)
        self.grad_refs[sid] -= 1
        if self.grad_refs[sid] <= 0:
            self.grad_refs.pop(sid)
            if sid in self._shared:
                self._release(self._shared.pop(sid))
            else:
                self.sim.free(sid)

    def _backward_nodes(self, nodes: list[_Node]) -> None:
        for n in reversed(nodes):
            keys = n.out_keys()
            has_grad = any(k in self.grad_sid for k in keys)
            if has_grad or n.name == "loss":
                through = next((self.grad_sid[k] for k in keys if k in self.grad_sid), None)
                for key, nbytes in n.grads:
                    self._grad_alloc(n, key, nbytes, through)
                self.sim.transient(n.scratch)
                for k in keys:
                    self._drop_grad(k)
            for k in n.saves:
                if k in self.saved_refs:
                    self._release(k)

    # ---- the step
    def forward(self) -> None:
        sim = self.sim
        last_seg: dict[str, int] = {}
        for idx, seg in enumerate(self.segments):
            for n in seg.nodes:
                for k in n.inputs:
                    last_seg[k] = idx
        held: list[str] = []
        lump = self.comp is not None and self.comp.lumps > 0
        for idx, seg in enumerate(self.segments):
            if lump and idx == self.comp.fwd_segments.start:  # type: ignore[union-attr]  # self.comp is set when lump is true
                before, n_held = self._snapshot(), len(held)
            self._forward_segment(idx, seg, _Later(last_seg, idx), held)
            if lump and idx == self.comp.fwd_segments.stop - 1:  # type: ignore[union-attr]  # self.comp is set when lump is true
                self._lump_forward(before, held, n_held)
        # Leaving autocast drops its weight cache: casts no op saved are freed now.
        self._flush(held)
        for sid in self.lump_flush:
            sim.free(sid)

    def _forward_segment(self, idx: int, seg: _Segment, later: "_Later", held: list[str]) -> None:
        sim = self.sim
        sim.at("forward", seg.name)
        if seg.checkpoint == "none":
            held += self._run_forward(seg.nodes, True, None, set(), later)
            return
        # Checkpointed: nothing saved but the block input (held by the checkpoint) and, for
        # selective checkpointing, the matmul outputs; plus the RNG state it stores.
        if seg.input_key and seg.input_key in self.store:
            self.saved_refs[seg.input_key] = self.saved_refs.get(seg.input_key, 0) + 1
        keep = {k for n in seg.nodes for k in n.sac_kept()} if seg.checkpoint == "selective" else set()
        held += self._run_forward(seg.nodes, False, None, keep, later)
        if self.rng_state_bytes:
            sim.alloc(self.rng_state_bytes, "activations")

    def backward(self) -> None:
        lump = self.comp is not None and self.comp.lumps > 0
        for idx in range(len(self.segments) - 1, -1, -1):
            seg = self.segments[idx]
            if lump and idx == self.comp.bwd_segments.stop - 1:  # type: ignore[union-attr]  # self.comp is set when lump is true
                before = self._snapshot()
            self._backward_segment(seg)
            if lump and idx == self.comp.bwd_segments.start:  # type: ignore[union-attr]  # self.comp is set when lump is true
                self._lump_backward(before)

    def _backward_segment(self, seg: _Segment) -> None:
        sim = self.sim
        label = "loss backward" if seg.name == "head" else f"backward {seg.name}"
        if seg.checkpoint != "none":
            sim.at("backward", f"recompute {seg.name}")
            # Recompute up to the last op whose tensors backward needs (non-reentrant
            # checkpoint stops there); the recomputed saves live until their op's backward.
            last_saver = max((i for i, n in enumerate(seg.nodes) if n.saves), default=-1)
            held = self._run_forward(seg.nodes[: last_saver + 1], True, "temporaries", set(), set())
            self._flush(held)
        sim.at("backward", label)
        self._backward_nodes(seg.nodes)
        if seg.checkpoint != "none" and seg.input_key and seg.input_key in self.saved_refs:
            self._release(seg.input_key)


class _Later:
    """``key in later``: the key is read by a segment after ``idx``."""

    __slots__ = ("last", "idx")

    def __init__(self, last: dict[str, int], idx: int) -> None:
        self.last, self.idx = last, idx

    def __contains__(self, key: str) -> bool:
        return self.last.get(key, -1) > self.idx


# --------------------------------------------------------------------------- node builders
@dataclass
class _Dims:
    """Sizes the builders share."""

    b: int
    s: int
    d: int
    f: int
    h: int
    kv: int  # width of k and of v (grouped-query attention)
    V: int
    a: float  # bytes per element of the compute dtype (autocast / bf16-pure: 2, fp32: 4)
    r: float  # residual stream dtype
    p: float  # parameter dtype
    autocast: bool
    dropout: bool
    cuda: bool
    bias: bool = True
    # FSDP2 under autocast gathers weights already in the compute dtype: autocast casts nothing
    # (no cached copies) and the gathered weights are counted by the sharding rule instead.
    weights_in_compute_dtype: bool = False

    @property
    def n(self) -> int:
        return self.b * self.s


def _rename_key(nodes: list[_Node], old: str, new: str) -> None:
    """Let ``new`` name the storage ``old`` named (an op that allocates nothing)."""
    for n in nodes:
        n.out = [(new,) + tuple(o[1:]) if o[0] == old else o for o in n.out]
        n.inputs = [new if k == old else k for k in n.inputs]
        n.saves = [new if k == old else k for k in n.saves]
        n.grads = [(new if k == old else k, v) for k, v in n.grads]
        if n.grad_out is not None:
            n.grad_out = tuple(new if k == old else k for k in n.grad_out)


def _linear(nodes: list[_Node], dm: _Dims, name: str, x: str, out: str, n_in: int, n_out: int,
            trainable_base: bool, lora: int, x_bytes: float) -> None:
    """A Linear layer: autocast casts of input/weight/bias, the matmul, LoRA adapters."""
    N, a, bias = dm.n, dm.a, dm.bias
    w, bname = f"param:{name}.weight", f"param:{name}.bias"
    w_in = w
    if dm.autocast:
        # autocast casts the fp32 weight once per forward and caches the copy until the
        # autocast region ends; the copy is what the matmul saves for backward.
        nodes.append(_Node(f"{name}.cast_w", out=[(f"{name}.wc", 0.0 if dm.weights_in_compute_dtype else n_in * n_out * a)], hold=True,
                           grads=[(w, 0.0)] if trainable_base else []))
        w_in = f"{name}.wc"
        if bias:
            nodes.append(_Node(f"{name}.cast_b", out=[(f"{name}.bc", 0.0 if dm.weights_in_compute_dtype else n_out * a)], hold=True,
                               grads=[(bname, 0.0)] if trainable_base else []))
        if x_bytes != a:
            nodes.append(_Node(f"{name}.cast_x", out=[(f"{x}@{name}", N * n_in * a)], inputs=[x],
                               grads=[(x, N * n_in * x_bytes)]))
            x = f"{x}@{name}"
    base_out = f"{out}.base" if lora else out
    grads = [(x, N * n_in * a)]
    if trainable_base:
        grads.append((w_in, n_in * n_out * a if dm.autocast else 0.0))
        if bias:
            grads.append((f"{name}.bc" if dm.autocast else bname, n_out * a if dm.autocast else 0.0))
    extra = [w_in] if dm.autocast else []
    nodes.append(_Node(name, out=[(base_out, N * n_out * a)], inputs=[x] + extra, saves=[x] + extra,
                       grads=grads, matmul=True))
    if lora:
        # peft: out = base(x) + lora_B(lora_A(x)) * scale. The adapters are float32; under
        # autocast they compute in the autocast dtype, on a bf16-pure base peft casts x up to
        # float32 for them and the result back down.
        ad = 4 if (not dm.autocast and a != 4) else a
        la, lb = f"{name}.lora_a", f"{name}.lora_b"
        xa = x
        if ad != a:
            nodes.append(_Node(f"{name}.lora_cast", out=[(f"{x}@lora", N * n_in * ad)], inputs=[x],
                               grads=[(x, N * n_in * a)]))
            xa = f"{x}@lora"
        nodes.append(_Node(la, out=[(la, N * lora * ad)], inputs=[xa], saves=[xa], matmul=True,
                           grads=[(xa, N * n_in * ad), (f"param:{name}.lora_A", 0.0)]))
        nodes.append(_Node(lb, out=[(lb, N * n_out * ad)], inputs=[la], saves=[la], matmul=True,
                           grads=[(la, N * lora * ad), (f"param:{name}.lora_B", 0.0)]))
        nodes.append(_Node(f"{name}.lora_scale", out=[(f"{lb}.s", N * n_out * ad)], inputs=[lb],
                           grads=[(lb, N * n_out * ad)]))
        src = f"{lb}.s"
        if ad != a:
            nodes.append(_Node(f"{name}.lora_back", out=[(f"{lb}.c", N * n_out * a)], inputs=[src],
                               grads=[(src, N * n_out * ad)]))
            src = f"{lb}.c"
        nodes.append(_Node(f"{name}.lora_add", out=[(out, N * n_out * a)], inputs=[base_out, src],
                           grads=[(base_out, 0.0), (src, 0.0)]))


def _dropout(nodes: list[_Node], dm: _Dims, name: str, x: str, out: str, numel: float, elt: float) -> None:
    """Dropout in training: the CPU kernel keeps a float noise tensor (input dtype) for
    backward, CUDA's fused kernel a bool mask; either way the output is a new tensor. Without
    dropout the op returns its input: ``out`` is another name for ``x``."""
    if not dm.dropout:
        _rename_key(nodes, x, out)
        return
    mask = f"{name}.mask"
    nodes.append(_Node(name, out=[(out, numel * elt), (mask, numel * (1 if dm.cuda else elt))],
                       inputs=[x], saves=[mask], grads=[(x, numel * elt)]))


def _resolve_backend(kind: str, window: Optional[int], dm: _Dims) -> str:
    """The memory shape of an attention choice here: math (s x s), flash (fused), banded."""
    if window is not None and window < dm.s:
        if kind in ("flex", "flash-attn"):
            return "flash"
        if min(window, dm.s) + window - 1 < dm.s:
            return "banded" if kind == "math" else "banded-sdpa"
        # A window this wide runs the dense masked form.
        if kind == "math" or (not dm.cuda and dm.dropout) or kind == "sdpa":
            return "math"
        return "flash"
    if kind == "math":
        return "math"
    if kind == "sdpa" and not dm.cuda and dm.dropout:
        return "math"  # the CPU flash kernel has no dropout: SDPA falls back to its math path
    return "flash"


def _scores_softmax(nodes: list[_Node], dm: _Dims, p: str, score_elems: float, mask_elems: float) -> str:
    """s0 (the q @ k^T product, already added by the caller) -> scale -> masked_fill -> float32
    softmax -> cast back -> dropout. Returns the key of the probabilities the second matmul reads."""
    a, sc = dm.a, score_elems
    nodes.append(_Node(f"{p}.scale", out=[(f"{p}.s1", sc * a)], inputs=[f"{p}.s0"], grads=[(f"{p}.s0", sc * a)]))
    # causal_mask: the bool mask and its negation (saved by masked_fill), plus aranges.
    nodes.append(_Node(f"{p}.mask", out=[(f"{p}.m", mask_elems)], fwd_scratch=mask_elems))
    nodes.append(_Node(f"{p}.masked", out=[(f"{p}.s2", sc * a)], inputs=[f"{p}.s1", f"{p}.m"],
                       saves=[f"{p}.m"], grads=[(f"{p}.s1", sc * a)]))
    src = f"{p}.s2"
    if a != 4:
        nodes.append(_Node(f"{p}.float", out=[(f"{p}.sf", sc * 4)], inputs=[src], grads=[(src, sc * a)]))
        src = f"{p}.sf"
    nodes.append(_Node(f"{p}.softmax", out=[(f"{p}.pf", sc * 4)], inputs=[src], saves=[f"{p}.pf"],
                       grads=[(src, sc * 4)]))
    src = f"{p}.pf"
    if a != 4:
        nodes.append(_Node(f"{p}.tocast", out=[(f"{p}.pa", sc * a)], inputs=[src], grads=[(src, sc * 4)]))
        src = f"{p}.pa"
    _dropout(nodes, dm, f"{p}.attn_drop", src, f"{p}.pd", sc, a)
    return f"{p}.pd"


def _attention_nodes(nodes: list[_Node], dm: _Dims, p: str, kind: str, window: Optional[int]) -> None:
    """q, k, v (views of the fused qkv output) -> y (batch, seq, d), the proj input."""
    b, s, d, h, a = dm.b, dm.s, dm.d, dm.h, dm.a
    N, kvw, hd = dm.n, dm.kv, dm.d // dm.h
    qkv, q, k, v, y = f"{p}.qkv", f"{p}.q", f"{p}.k", f"{p}.v", f"{p}.y"
    # split + view + transpose are views; backward reshapes each gradient (a copy, the
    # gradients being transposed) and concatenates the three.
    nodes.append(_Node(f"{p}.split", inputs=[qkv], grad_out=(q, k, v), scratch=N * d * a,
                       grads=[(qkv, N * (d + 2 * kvw) * a)]))
    backend = _resolve_backend(kind, window, dm)
    if backend == "flash":
        # Fused kernel (SDPA flash/mem-efficient/cuDNN, flex, flash-attn): saves q, k, v (views
        # of qkv), its output and a float32 log-sum-exp (b, h, s); nothing s x s. The CPU
        # kernel writes the output as (b, s, h, hd), so .contiguous() afterwards is free.
        nodes.append(_Node(f"{p}.sdpa", out=[(y, N * d * a), (f"{p}.lse", b * h * s * 4)], inputs=[qkv],
                           saves=[qkv, y, f"{p}.lse"], matmul=True, grad_out=(y,),
                           grads=[(q, N * d * a), (k, N * kvw * a), (v, N * kvw * a)]))
        return
    if backend in ("banded", "banded-sdpa"):
        W = window or s
        blk = min(W, s)
        nb = -(-s // blk)
        band = blk + W - 1
        q_pad = b * h * nb * blk * hd * a
        kv_pad = b * h * (nb * blk + W - 1) * hd * a
        kv_band = b * h * nb * band * hd * a
        sc = b * h * nb * blk * band
        # F.pad copies q, k, v; the matmuls copy the overlapping band views of k and v.
        nodes.append(_Node(f"{p}.pad", out=[(f"{p}.qp", q_pad), (f"{p}.kp", kv_pad), (f"{p}.vp", kv_pad)],
                           inputs=[qkv], grad_out=(f"{p}.qp", f"{p}.kp", f"{p}.vp"),
                           grads=[(q, N * d * a), (k, N * kvw * a), (v, N * kvw * a)]))
        # The band views of k and v: copied by the math kernel's matmuls, read in place by SDPA
        # (which saves the padded tensors); unfold's backward scatters into a padded buffer.
        copy = kv_band if backend == "banded" else 0
        nodes.append(_Node(f"{p}.kband", out=[(f"{p}.kb", copy)], inputs=[f"{p}.kp"], grads=[(f"{p}.kp", kv_pad)]))
        nodes.append(_Node(f"{p}.vband", out=[(f"{p}.vb", copy)], inputs=[f"{p}.vp"], grads=[(f"{p}.vp", kv_pad)]))
        mask_elems = nb * blk * band
        if backend == "banded-sdpa":
            # The bool band mask becomes an additive float mask, saved with q, k, v, out, lse.
            nodes.append(_Node(f"{p}.mask", out=[(f"{p}.m", mask_elems * 4)], fwd_scratch=2 * mask_elems))
            nodes.append(_Node(f"{p}.sdpa", out=[(f"{p}.o", q_pad), (f"{p}.lse", b * h * nb * blk * 4)],
                               inputs=[f"{p}.qp", f"{p}.kp", f"{p}.vp", f"{p}.kb", f"{p}.vb", f"{p}.m"], matmul=True,
                               keep=(f"{p}.o", f"{p}.lse"),
                               saves=[f"{p}.qp", f"{p}.kp", f"{p}.vp", f"{p}.o", f"{p}.lse", f"{p}.m"],
                               grads=[(f"{p}.qp", q_pad), (f"{p}.kb", kv_band), (f"{p}.vb", kv_band)]))
        else:
            nodes.append(_Node(f"{p}.qk", out=[(f"{p}.s0", sc * a)], inputs=[f"{p}.qp", f"{p}.kb"],
                               saves=[f"{p}.qp", f"{p}.kb"], matmul=True, keep=(f"{p}.s0",),
                               grads=[(f"{p}.qp", q_pad), (f"{p}.kb", kv_band)]))
            probs = _scores_softmax(nodes, dm, p, sc, mask_elems)
            nodes.append(_Node(f"{p}.pv", out=[(f"{p}.o", q_pad)], inputs=[probs, f"{p}.vb"],
                               saves=[probs, f"{p}.vb"], matmul=True,
                               grads=[(probs, sc * a), (f"{p}.vb", kv_band)]))
        # out[:, :, :s] then transpose(1, 2).contiguous(): one copy.
        nodes.append(_Node(f"{p}.merge", out=[(y, N * d * a)], inputs=[f"{p}.o"], grads=[(f"{p}.o", q_pad)]))
        return
    # Materialized attention (math, or SDPA's math fallback): (b, h, s, s) scores. matmul on
    # the transposed views copies q and k^T into contiguous buffers, which bmm saves.
    sc = b * h * s * s
    nodes.append(_Node(f"{p}.qk", out=[(f"{p}.qc", N * d * a), (f"{p}.kc", N * d * a), (f"{p}.s0", sc * a)],
                       inputs=[qkv], saves=[f"{p}.qc", f"{p}.kc"], matmul=True, grad_out=(f"{p}.s0",),
                       keep=(f"{p}.s0",),
                       grads=[(q, N * d * a), (k, N * kvw * a)]))
    probs = _scores_softmax(nodes, dm, p, sc, s * s)
    nodes.append(_Node(f"{p}.vcopy", out=[(f"{p}.vc", N * kvw * a)], inputs=[qkv]))
    nodes.append(_Node(f"{p}.pv", out=[(f"{p}.o", N * d * a)], inputs=[probs, f"{p}.vc"],
                       saves=[probs, f"{p}.vc"], matmul=True,
                       grads=[(probs, sc * a), (v, N * kvw * a)]))
    # y.transpose(1, 2).contiguous(): a copy; its backward passes the gradient through.
    nodes.append(_Node(f"{p}.merge", out=[(y, N * d * a)], inputs=[f"{p}.o"], grads=[(f"{p}.o", 0.0)]))


def _block_nodes(dm: _Dims, i: int, arch: Arch, tech: TechniqueConfig, trainable_base: bool) -> list[_Node]:
    """The op inventory of one Transformer block (model.py: x + attn(ln_1(x)); + mlp(ln_2(.)))."""
    p = f"blocks.{i}"
    N, d, f, a, r = dm.n, dm.d, dm.f, dm.a, dm.r
    lora = tech.lora_rank
    targets = _lora_targets(tech) if lora else set()
    x = f"{p}.in"
    nodes: list[_Node] = []
    layer = arch.norm == "layernorm"

    def norm(name: str, src: str, out: str) -> None:
        # LayerNorm saves its input and float32 mean + rstd per token (RMSNorm: rstd only).
        pg = [(f"param:{name}.weight", 0.0)] if trainable_base else []
        if trainable_base and layer and dm.bias:
            pg.append((f"param:{name}.bias", 0.0))
        nodes.append(_Node(name, out=[(out, N * d * r), (f"{name}.stats", (2 if layer else 1) * N * 4)],
                           inputs=[src], saves=[src, f"{name}.stats"], grad_out=(out,),
                           grads=[(src, N * d * r)] + pg))

    def lin(short: str, name: str, src: str, out: str, n_in: int, n_out: int, src_bytes: float) -> None:
        _linear(nodes, dm, name, src, out, n_in, n_out, trainable_base,
                lora if short in targets else 0, src_bytes)

    norm(f"{p}.ln_1", x, f"{p}.ln1")
    lin("qkv", f"{p}.attn.qkv", f"{p}.ln1", f"{p}.qkv", d, d + 2 * dm.kv, r)
    start = len(nodes)
    _attention_nodes(nodes, dm, p, tech.attention, tech.window)
    # The attention core is what model.attn_fn computes: everything after the q/k/v split up
    # to the (b, h, s, hd) output; the merge (transpose + contiguous) is outside it.
    for n in nodes[start + 1:]:
        n.core = not n.name.endswith(".merge")
    lin("proj", f"{p}.attn.proj", f"{p}.y", f"{p}.pr", d, d, a)
    _dropout(nodes, dm, f"{p}.resid_drop", f"{p}.pr", f"{p}.prd", N * d, a)
    # Residual add: type promotion makes it float32 under autocast; the low-precision branch's
    # gradient is then a cast copy.
    nodes.append(_Node(f"{p}.add1", out=[(f"{p}.x1", N * d * r)], inputs=[x, f"{p}.prd"],
                       grads=[(x, 0.0), (f"{p}.prd", 0.0 if a == r else N * d * a)]))
    norm(f"{p}.ln_2", f"{p}.x1", f"{p}.ln2")
    if arch.mlp == "swiglu":
        lin("fc", f"{p}.mlp.fc", f"{p}.ln2", f"{p}.h1", d, 2 * f, r)
        # silu(gate) * up: silu saves gate; the product saves silu(gate) and up (views of h1).
        nodes.append(_Node(f"{p}.silu", out=[(f"{p}.g", N * f * a)], inputs=[f"{p}.h1"], saves=[f"{p}.h1"],
                           grads=[(f"{p}.h1", 2 * N * f * a)]))
        nodes.append(_Node(f"{p}.gmul", out=[(f"{p}.act", N * f * a)], inputs=[f"{p}.g", f"{p}.h1"],
                           saves=[f"{p}.g"], grads=[(f"{p}.g", N * f * a), (f"{p}.h1", N * f * a)]))
    else:
        lin("fc", f"{p}.mlp.fc", f"{p}.ln2", f"{p}.h1", d, f, r)
        nodes.append(_Node(f"{p}.gelu", out=[(f"{p}.act", N * f * a)], inputs=[f"{p}.h1"], saves=[f"{p}.h1"],
                           grads=[(f"{p}.h1", N * f * a)]))
    lin("fc_out", f"{p}.mlp.fc_out", f"{p}.act", f"{p}.h2", f, d, a)
    _dropout(nodes, dm, f"{p}.mlp_drop", f"{p}.h2", f"{p}.h2d", N * d, a)
    nodes.append(_Node(f"{p}.add2", out=[(f"blocks.{i + 1}.in", N * d * r)], inputs=[f"{p}.x1", f"{p}.h2d"],
                       grads=[(f"{p}.x1", 0.0), (f"{p}.h2d", 0.0 if a == r else N * d * a)]))
    return nodes


def _embedding_nodes(dm: _Dims, arch: Arch, trainable: bool) -> list[_Node]:
    """Token lookup (+ learned positions) and embedding dropout. Lookups are not autocast: the
    output has the table's dtype."""
    N, d, s, pe = dm.n, dm.d, dm.s, dm.p
    nodes = [_Node("wte", out=[("tok", N * d * pe)], grads=[("param:wte.weight", 0.0)] if trainable else [])]
    src = "tok"
    if arch.positional == "learned":
        nodes.append(_Node("pos", out=[("pos_idx", s * 8)]))
        nodes.append(_Node("wpe", out=[("posemb", s * d * pe)], inputs=["pos_idx"], saves=["pos_idx"],
                           grads=[("param:wpe.weight", 0.0)] if trainable else []))
        # Broadcast add: the token side's gradient passes through, the position side is summed.
        nodes.append(_Node("embed_add", out=[("emb", N * d * pe)], inputs=["tok", "posemb"],
                           grads=[("tok", 0.0), ("posemb", s * d * pe)]))
        src = "emb"
    _dropout(nodes, dm, "drop", src, "blocks.0.in", N * d, pe)
    if not dm.dropout:
        pass
    return nodes


def _head_nodes(dm: _Dims, m: ModelConfig, tech: TechniqueConfig, arch: Arch, trainable: bool,
                grads_exist: bool) -> list[_Node]:
    """Final norm, LM head and loss (standard: full logits; chunked: fused, chunk x vocab)."""
    N, d, V, a, r = dm.n, dm.d, dm.V, dm.a, dm.r
    x = f"blocks.{m.n_layers}.in"
    layer = arch.norm == "layernorm"
    head = "lm_head.weight" if m.untie_embeddings else "wte.weight"
    pg = [("param:ln_f.weight", 0.0)] if trainable else []
    if trainable and layer and dm.bias:
        pg.append(("param:ln_f.bias", 0.0))
    nodes = [_Node("ln_f", out=[("hf", N * d * r), ("ln_f.stats", (2 if layer else 1) * N * 4)], inputs=[x],
                   saves=[x, "ln_f.stats"], grad_out=("hf",), grads=[(x, N * d * r)] + pg)]
    if tech.loss == "chunked":
        c = min(tech.loss_chunk, N)
        # _ChunkedLinearCrossEntropy.forward: casts of hidden and weight (when the compute dtype
        # differs), grad_h (N x d) and a float32 grad_w (V x d) kept for backward, and per chunk
        # the logits, their float32 copy, the gradient cast back and the chunk's matmuls.
        casts = (N * d * a if a != r else 0) + (V * d * a if a != dm.p else 0)
        if a == 4:
            # float32 logits, turned into their gradient in place; g @ w for grad_h.
            per_chunk: float = c * V * 4 + c * d * 4
        else:
            # low-precision logits -> float32 copy (both alive for a moment); then the gradient
            # cast back, after which the float32 buffer is freed before g @ w (c x d) or
            # g.t() @ h (V x d) arrive next to the cast gradient.
            per_chunk = max(c * V * 4 + c * V * a, c * V * a + max(c * d * a, V * d * a))
        # backward hands grad_h on as the hidden states' gradient; grad_w, still referenced by
        # ctx, cannot be stolen by AccumulateGrad, which clones it into .grad (or adds it in).
        nodes.append(_Node("loss", out=[("loss.grad_h", N * d * r), ("loss.grad_w", V * d * 4)],
                           inputs=["hf"], saves=["loss.grad_h", "loss.grad_w"], fwd_scratch=casts + per_chunk,
                           tag="logits", grad_from={"hf": "loss.grad_h", f"param:{head}": "loss.grad_w"},
                           grads=[("hf", N * d * r)] + ([(f"param:{head}", 0.0)] if trainable else [])))
        return nodes
    # Standard: F.linear (autocast casts hidden and weight), .float(), log_softmax (saved),
    # nll_loss. Backward: grad of the log-probs, grad of the logits (fp32), cast back, matmuls.
    xin = "hf"
    extra: list[str] = []
    if dm.autocast:
        nodes.append(_Node("head.cast_w", out=[("head.wc", 0.0 if dm.weights_in_compute_dtype else V * d * a)], hold=True,
                           grads=[(f"param:{head}", 0.0)] if trainable else []))
        nodes.append(_Node("head.cast_x", out=[("hfc", N * d * a)], inputs=["hf"], grads=[("hf", N * d * r)]))
        xin, extra = "hfc", ["head.wc"]
    w_grad = [("head.wc", V * d * a)] if dm.autocast else [(f"param:{head}", 0.0)]
    nodes.append(_Node("lm_head", out=[("logits", N * V * a)], inputs=[xin] + extra, saves=[xin] + extra,
                       tag="logits", grads=[(xin, N * d * a)] + (w_grad if trainable else [])))
    src = "logits"
    if a != 4:
        nodes.append(_Node("logits.float", out=[("logits32", N * V * 4)], inputs=[src], tag="logits",
                           grads=[(src, N * V * a)]))
        src = "logits32"
    nodes.append(_Node("log_softmax", out=[("logp", N * V * 4)], inputs=[src], saves=["logp"], tag="logits",
                       grads=[(src, N * V * 4)]))
    nodes.append(_Node("loss", out=[("loss", 8)], inputs=["logp"], saves=["logp"], tag="logits",
                       grads=[("logp", N * V * 4)]))
    return nodes


# --------------------------------------------------------------------------- the estimate
@dataclass
class Estimate:
    """What :func:`estimate` returns (``to_dict`` is the JSON of ``memtrain estimate --json``)."""

    parameters: int
    trainable_parameters: int
    bytes: dict[str, float]
    peak_bytes: float
    peak_phase: str
    peak_detail: str
    by_category: dict[str, float]
    phase_peaks: dict[str, float]
    activations_per_layer: float  # under the configured checkpointing (mean over blocks)
    explanation: list[str]
    rules: dict[str, Any]
    shape: dict[str, Any]
    mode: str = "train"
    world_size: int = 1
    shard: str = "none"
    extra: dict[str, Any] = field(default_factory=dict)
    activations_per_layer_no_checkpointing: float = 0.0
    # With estimate(gpu=...): the CUDA caching allocator's view (memtrain.allocator.DeviceMemory).
    device_memory: Optional[dict[str, Any]] = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["bytes"] = {k: int(round(v)) for k, v in self.bytes.items()}
        d["by_category"] = {k: int(round(v)) for k, v in self.by_category.items()}
        d["phase_peaks"] = {k: int(round(v)) for k, v in self.phase_peaks.items()}
        d["peak_bytes"] = int(round(self.peak_bytes))
        d["activations_per_layer"] = int(round(self.activations_per_layer))
        d["activations_per_layer_no_checkpointing"] = int(round(self.activations_per_layer_no_checkpointing))
        return d


def _precision_bytes(precision: str) -> tuple[int, int, bool]:
    """(param bytes, compute bytes, autocast) of ``--precision`` (memtrain.techniques.facts)."""
    f = precision_facts(precision)
    return f.param_bytes, f.compute_bytes, f.autocast


def _dims(cfg: RunConfig, arch: Arch, device_type: str, batch: Optional[int] = None) -> _Dims:
    m, t = cfg.model, cfg.train
    pb, ab, autocast = _precision_bytes(cfg.technique.precision)
    dm = _Dims(b=batch or t.batch_size, s=t.seq_len, d=m.d_model, f=m.d_ff, h=m.n_heads,
               kv=(arch.n_kv_heads or m.n_heads) * m.head_dim, V=m.padded_vocab_size, a=ab,
               r=pb, p=pb, autocast=autocast, dropout=m.dropout > 0, cuda=device_type == "cuda",
               bias=m.bias and arch.name == "gpt2")
    return dm


@dataclass
class _Compression:
    """Which blocks the simulation runs when the model is deep (layer kinds, not layers).

    Block kinds repeat with a period ``P`` (1 without checkpointing or with full/selective;
    K for ``every:K``; round(sqrt(L)) for ``sqrt``). The simulation runs the first two periods,
    then stands ``lumps`` periods in as one allocation per category (what a period keeps after
    its forward; what it changes in backward, measured on the period right after the lump),
    then the last period plus the remainder. Exact, not an approximation: every lumped period
    is the same sequence of allocations as its simulated neighbours, its live total differs
    from theirs by a constant per period (forward: it only grows; backward: an affine function
    of the position), so the largest total over the lumped periods is reached at a simulated
    neighbour. ``real`` maps a simulated block to the model's block index (for labels).
    """

    period: int
    lumps: int
    blocks: int  # simulated blocks
    per_block: int = 1  # segments per block (3 under selective: before, attention core, after)

    def real(self, j: int) -> int:
        return j if j < 2 * self.period else j + self.lumps * self.period

    @property
    def fwd_segments(self) -> range:
        """Segment indices (embedding is 0) of the period whose forward is measured (period 1)."""
        w = self.period * self.per_block
        return range(1 + w, 1 + 2 * w)

    @property
    def bwd_segments(self) -> range:
        """Segment indices of the period right after the lump (measured in backward)."""
        w = self.period * self.per_block
        return range(1 + 2 * w, 1 + 3 * w)


def _compression(cfg: RunConfig) -> _Compression:
    policy = checkpoint_policy(cfg.technique.checkpointing)
    L = cfg.model.n_layers
    # The period of the block kinds: blocks i % K == 0 are checkpointed under every:K and sqrt.
    P = policy.period(L)
    # Two periods, the lumps, then the last period and the remainder.
    lumps = max(0, (L - 2 * P) // P - 1)
    return _Compression(P, lumps, L - lumps * P, 3 if policy.kind == "selective" else 1)


def _segments(cfg: RunConfig, arch: Arch, dm: _Dims, trainable_base: bool, grads_exist: bool,
              comp: _Compression) -> list[_Segment]:
    m, tech = cfg.model, cfg.technique
    policy = checkpoint_policy(tech.checkpointing)
    kind = policy.kind
    L = m.n_layers
    mode = "selective" if kind == "selective-matmul" else "full"
    segs = [_Segment("embedding", _embedding_nodes(dm, arch, trainable_base))]
    for j in range(comp.blocks):
        i = comp.real(j)
        nodes = _block_nodes(dm, j, arch, tech, trainable_base)
        if kind == "selective":
            # Megatron's selective recomputation: the block runs as usual around a checkpointed
            # attention core, which keeps only its input (q, k, v: views of the qkv output).
            a = next(x for x, n in enumerate(nodes) if n.core)
            b = a + sum(1 for n in nodes if n.core)
            segs += [_Segment(f"block {i}", nodes[:a]),
                     _Segment(f"block {i} attention core", nodes[a:b], checkpoint="full",
                              input_key=f"blocks.{j}.qkv"),
                     _Segment(f"block {i}", nodes[b:])]
            continue
        segs.append(_Segment(f"block {i}", nodes,
                             checkpoint=mode if policy.whole_block(i, L) else "none", input_key=f"blocks.{j}.in"))
    segs.append(_Segment("head", _head_nodes(dm, replace(m, n_layers=comp.blocks), tech, arch, trainable_base,
                                             grads_exist)))
    assert L == comp.blocks + comp.lumps * comp.period
    return segs


def _validate(cfg: RunConfig, arch: Arch, device_type: str) -> None:
    tech = cfg.technique
    if tech.compile:
        pass  # compile changes kernels, not (to first order) what is saved; estimated as eager
    if arch.n_kv_heads and cfg.model.n_heads % arch.n_kv_heads:
        raise ConfigError(f"n_kv_heads {arch.n_kv_heads} must divide --n-heads {cfg.model.n_heads}")
    if device_type not in ("cpu", "cuda"):
        raise ConfigError(f"--trace-device/--device-type {device_type!r}: use cpu or cuda")


def estimate(  # noqa: C901 - the step timeline in order; splits with the analysis package
    cfg: RunConfig,
    arch: Arch = GPT2_ARCH,
    device_type: Optional[str] = None,
    world_size: int = 1,
    shard: Optional[str] = None,
    gpu: Optional[str] = None,
    *,
    _compress: bool = True,
) -> Estimate:
    """Memory of one steady-state training step (the second step: optimizer state exists).

    ``gpu`` (with CUDA kernels): also replay the timeline through the CUDA caching-allocator
    model (:mod:`memtrain.allocator`) and report ``device_memory`` {``allocated``, ``reserved``,
    ``device_total``} as torch.cuda and nvidia-smi would show them, for that GPU kind's assumed
    CUDA context ("default" for any other name). Runs the per-layer timeline: up to 1024 layers.

    ``device_type`` (cpu|cuda; default from ``cfg.train.device``, auto = cuda) decides the few
    kernel facts that differ: dropout keeps a float noise tensor on CPU but a 1-byte mask on
    CUDA; SDPA on CPU has no dropout in its fused kernel. ``world_size``/``shard``
    (zero1|zero2|fsdp, default ``cfg.technique.distributed``) give the memory of one rank.
    """
    device_type = device_type or ("cpu" if cfg.train.device == "cpu" else "cuda")
    _validate(cfg, arch, device_type)
    m, tech, t = cfg.model, cfg.technique, cfg.train
    shard = shard or tech.distributed
    if shard in ("deepspeed-zero2",):
        shard = "zero2"
    if shard in ("deepspeed-zero3",):
        shard = "fsdp"
    if world_size < 1:
        raise ConfigError(f"--world-size must be >= 1, got {world_size}")
    check_analytic_size(m)
    # Deep models run a few blocks and lump the rest (per layer kind: O(1) in n_layers); the
    # table has one entry per simulated tensor, the lumped blocks' counted by ``repeat``.
    comp = _compression(cfg)
    if not _compress:
        comp = replace(comp, lumps=0, blocks=m.n_layers)
    rep = {j: 1 + comp.lumps for j in range(comp.period, 2 * comp.period)} if comp.lumps else None
    params = _param_table(m, arch, tech, range(comp.blocks), rep)
    n_params = sum(p.numel * p.repeat for p in params)
    trainable = [p for p in params if p.trainable]
    n_train = sum(p.numel * p.repeat for p in trainable)
    pb, ab, autocast = _precision_bytes(tech.precision)
    dm = _dims(cfg, arch, device_type)
    if autocast and world_size > 1 and shard in ("zero2", "fsdp"):
        dm = replace(dm, weights_in_compute_dtype=True)
    # DDP (and zero1, which runs on DDP) keeps the gradients in its communication buckets
    # (gradient_as_bucket_view) from the first step on: they exist before every backward, as
    # under gradient accumulation, and each op's gradient is added into them.
    ddp_buckets = world_size > 1 and shard in ("none", "ddp", "zero1")
    grads_exist = t.grad_accum > 1 or ddp_buckets
    lora = tech.lora_rank > 0
    # LoRA adapters are created in float32 next to the (possibly bf16) frozen base.
    adapter_bytes = 4 if lora else pb
    pbytes: dict[str, float] = {p.name: p.numel * (adapter_bytes if "lora_" in p.name else pb) for p in params}
    repeat = {p.name: p.repeat for p in params}
    weights = sum(v * repeat[k] for k, v in pbytes.items())
    grad_bytes = {p.name: pbytes[p.name] for p in trainable}
    grad_total = sum(v * repeat[k] for k, v in grad_bytes.items())
    opt_bytes, opt_lines = optimizer_state_bytes(trainable, tech.optim, adapter_bytes, tech.optim_block)
    opt_tmp = _optimizer_temporaries(trainable, tech.optim, adapter_bytes, t.weight_decay)
    zero1: Optional[dict[str, Any]] = None
    if shard == "zero1" and world_size > 1 and sum(p.repeat for p in trainable) <= _ZERO1_MAX_TENSORS:
        # memtrain's ZeRO-1 gives each rank the dim-0 chunk of every tensor (ceil(rows/N) rows,
        # the last ranks fewer): the rank with the most state (rank 0) is reported.
        ranks = _zero1_partition(trainable, world_size)
        per_rank = [optimizer_state_bytes(ps, tech.optim, adapter_bytes, tech.optim_block)[0] for ps in ranks]
        worst = per_rank.index(max(per_rank))
        zero1 = {"rank": worst, "optimizer_per_rank": per_rank,
                 "scratch": _optimizer_temporaries(ranks[worst], tech.optim, adapter_bytes, t.weight_decay)}

    # ---- sharding (one rank's share)
    n = world_size
    shard_div = {"weights": 1, "gradients": 1, "optimizer": 1}
    if n > 1 and shard in ("zero1", "zero2", "fsdp"):
        shard_div["optimizer"] = n
        if shard in ("zero2", "fsdp"):
            shard_div["gradients"] = n
        if shard == "fsdp":
            shard_div["weights"] = n

    if gpu is not None and device_type == "cuda" and _compress:
        if m.n_layers > 1024:
            raise ConfigError(f"--gpu (the CUDA allocator model) replays every layer: at most 1024, got {m.n_layers}")
        est = estimate(cfg, arch, device_type, world_size, shard, gpu, _compress=False)
        est.device_memory = est.extra.pop("_device_memory")
        return est
    sim = _Sim()
    if gpu is not None and device_type == "cuda":
        sim.events = []
    sim.at("start", "weights and optimizer state")
    w_rank = weights / shard_div["weights"]
    gathered_bytes = 0.0
    if shard == "zero2" and n > 1:
        # FSDP2 with reshard_after_forward=False: each rank holds its 1/N shard, and the
        # all-gathered full weights (in the compute dtype: FSDP2's MixedPrecisionPolicy gathers
        # bf16 under autocast) from the forward until the end of backward.
        w_rank = weights / n
        gathered_bytes = sum(p.numel * p.repeat * (ab if autocast else pb) for p in params)
    opt_share = zero1["optimizer_per_rank"][zero1["rank"]] if zero1 else opt_bytes / shard_div["optimizer"]
    tmp_share = zero1["scratch"] if zero1 else opt_tmp / shard_div["optimizer"]
    state_sids = [sim.alloc(w_rank, "weights"), sim.alloc(opt_share, "optimizer")]
    if shard == "fsdp" and n > 1:
        # FSDP all-gathers one block's parameters at a time (forward and backward).
        per_block = max((sum(pbytes[p.name] for p in params if p.block == i) for i in range(comp.blocks)), default=0)
        sim.alloc(per_block, "temporaries")
        # The root group (embeddings, final norm, tied head) is gathered at the first forward
        # and kept until its backward ends: the whole step (in the compute dtype, as for zero2).
        gathered_bytes = sum(p.numel * p.repeat * (ab if autocast else pb) for p in params if p.block is None)
    if grads_exist:
        sim.alloc(grad_total / shard_div["gradients"], "gradients")

    segs = _segments(cfg, arch, dm, not lora, grads_exist, comp)
    _fill_param_grads(segs, pbytes)
    graph = _Graph(sim, segs, grad_bytes, grads_exist, _CPU_RNG_STATE_BYTES if device_type == "cpu" else 0)
    graph.comp = comp
    if tech.loss == "naive":
        # The caller's `logits` holds the previous step's logits until model(x) returns the new
        # ones, and the new ones past the end of this step.
        previous = sim.alloc(dm.n * dm.V * dm.a, "logits")
        graph.after_forward["lm_head"] = lambda: sim.free(previous)
        graph.pinned.add("logits")
    if not m.untie_embeddings:
        graph.tied.add("wte.weight")
    gathered = sim.alloc(gathered_bytes, "weights") if gathered_bytes else None
    graph.forward()
    graph.backward()
    sim.free(gathered)
    if shard_div["gradients"] > 1:
        # ZeRO-2 / FSDP: after the reduce-scatter a rank keeps 1/N of the gradients.
        lumped = [sid for sid in graph.lump_grads if sim.live.get(sid, (0, ""))[1] == "gradients"]
        for sid in [v for v in graph.param_grad_sid.values() if v > 0] + lumped:
            sim.free(sid)
        sim.alloc(grad_total / shard_div["gradients"], "gradients")

    # Optimizer step: weights + grads + states + scratch, then zero_grad frees the grads.
    sim.at("optimizer", f"{tech.optim} step")
    sim.transient(tmp_share, "temporaries")

    device_memory = None
    if sim.events is not None:
        from memtrain.allocator import replay

        # The weights and optimizer state are one number each in the timeline but one tensor
        # per parameter (per state) on the device: the allocator sees them tensor by tensor.
        n_states = {"adamw": 2, "adamw-foreach": 2, "adamw-fused": 2, "sgd": 1}.get(tech.optim)
        per_tensor = [pbytes[p.name] / shard_div["weights"] for p in params]
        if n_states:
            per_tensor += [pbytes[p.name] / shard_div["optimizer"] for p in trainable for _ in range(n_states)]
        else:
            per_tensor.append(opt_share)
        events = [e for e in sim.events if e[1] not in state_sids]
        device_memory = replay(events, gpu, sim.peak, per_tensor).to_dict()

    peak_tags = sim.peak_tags
    by_category = {c: 0.0 for c in CATEGORIES}
    for tag, v in peak_tags.items():
        by_category[_CATEGORY_OF[tag]] += v
    rng = _CPU_RNG_STATE_BYTES if device_type == "cpu" else 0
    act_layer = _activations_per_layer(cfg, arch, dm, not lora, rng)
    act_layer_none = _activations_per_layer(cfg, arch, dm, not lora, rng, "none")
    expl = _explain(cfg, arch, dm, params, n_params, n_train, weights, opt_bytes, opt_lines, act_layer_none,
                    sim, shard, n, device_type)
    rule = model_state_rule(n_params, tech.optim, trainable=n_train if lora else None,
                            mixed_precision=autocast)
    return Estimate(
        parameters=n_params,
        trainable_parameters=n_train,
        bytes=dict(peak_tags),
        peak_bytes=sim.peak,
        peak_phase=sim.peak_phase,
        peak_detail=sim.peak_detail,
        by_category=by_category,
        phase_peaks={k: v for k, v in sim.phase_peaks.items() if k},
        activations_per_layer=act_layer,
        activations_per_layer_no_checkpointing=act_layer_none,
        explanation=expl,
        rules=rule,
        shape={"arch": arch.name, "d_model": m.d_model, "n_layers": m.n_layers, "n_heads": m.n_heads,
               "d_ff": m.d_ff, "vocab": m.padded_vocab_size, "tied": not m.untie_embeddings,
               "batch_size": t.batch_size, "seq_len": t.seq_len, "grad_accum": t.grad_accum},
        world_size=n,
        shard=shard if n > 1 else "none",
        extra={"model_state": {"weights": weights / shard_div["weights"],
                               "gradients": grad_total / shard_div["gradients"],
                               "optimizer": opt_share,
                               "optimizer_step_scratch": tmp_share},
               **({"zero1": {"rank": zero1["rank"], "optimizer_per_rank": zero1["optimizer_per_rank"]}}
                  if zero1 else {}),
               "device_type": device_type, **({"_device_memory": device_memory} if device_memory else {})},
    )


# Above this many trainable tensors ZeRO-1's per-rank split is not replayed (the even split is used).
_ZERO1_MAX_TENSORS = 1_000_000


def _zero1_partition(params: list[ParamInfo], world: int) -> list[list[ParamInfo]]:
    """The tensors whose state each rank keeps under ``--distributed zero1``
    (:class:`memtrain.techniques.zero1.ShardedZeRO1`): rank r's dim-0 chunk of every tensor,
    ``torch.chunk``'s split (ceil(rows / N) rows each, the last ranks fewer or none)."""
    from memtrain.techniques.zero1 import dim0_range

    out: list[list[ParamInfo]] = [[] for _ in range(world)]
    for p in params:
        rows = p.shape[0] if p.shape else 1
        for r in range(world):
            start, end = dim0_range(rows, r, world)
            if end > start:
                out[r].append(replace(p, shape=(end - start, *p.shape[1:])))
    return out


def _fill_param_grads(segs: list[_Segment], pbytes: dict[str, float]) -> None:
    """Replace the 0.0 placeholders of parameter gradients by the parameter's size."""
    for seg in segs:
        for n in seg.nodes:
            n.grads = [(k, pbytes.get(k[6:], 0.0) if (k.startswith("param:") and v == 0.0) else v)
                       for k, v in n.grads]


def _activations_per_layer(cfg: RunConfig, arch: Arch, dm: _Dims, trainable_base: bool,
                           rng_state_bytes: float = 0.0, policy: Optional[str] = None) -> float:
    """Bytes one block keeps for backward between its forward and its backward, block input
    included, under the checkpointing ``policy`` (default: the configured one).

    none: everything autograd saves; full: the input the checkpoint holds (+ the RNG state it
    stores on CPU); selective: that plus the outputs the policy keeps; every:K and sqrt: the
    mean over the blocks (1 in K checkpointed). The same bytes the timeline keeps per block.
    """
    nodes = _block_nodes(dm, 0, arch, replace(cfg.technique, checkpointing="none"), trainable_base)
    sizes = {k: v for n in nodes for k, v, *_ in n.out}
    block_input = dm.n * dm.d * dm.r
    saved = {k for n in nodes for k in n.saves if k in sizes}
    none = sum(sizes[k] for k in saved) + block_input
    ck = checkpoint_policy(policy or cfg.technique.checkpointing)
    kind = ck.kind
    if kind == "none":
        return none
    full = block_input + rng_state_bytes
    if kind == "full":
        return full
    if kind == "selective-matmul":
        kept = {k for n in nodes for k in n.sac_kept() if k in sizes}
        return full + sum(sizes[k] for k in kept)
    if kind == "selective":
        # Everything outside the attention core as without checkpointing, plus the core's
        # input (the qkv output q, k and v are views of) and the RNG state its checkpoint stores.
        outside = {k for n in nodes if not n.core for k in n.saves if k in sizes}
        return sum(sizes[k] for k in outside | {"blocks.0.qkv"}) + block_input + rng_state_bytes
    L = cfg.model.n_layers
    n_ck = ck.n_checkpointed(L)
    return (n_ck * full + (L - n_ck) * none) / L


def _explain(cfg: RunConfig, arch: Arch, dm: _Dims, params: list[ParamInfo], n_params: int, n_train: int,
             weights: float, opt_bytes: float, opt_lines: list[str], act_layer: float, sim: _Sim,
             shard: str, world: int, device_type: str) -> list[str]:
    m, tech, t = cfg.model, cfg.technique, cfg.train
    pb, ab, autocast = _precision_bytes(tech.precision)
    N = dm.n
    lines = [
        f"parameters = {n_params:,} (V*d{' x2 untied' if m.untie_embeddings else ' tied'} + "
        f"{'max_seq*d + ' if arch.positional == 'learned' else ''}L*(4d^2+2d*d_ff+biases) + norms); "
        f"trainable {n_train:,}",
        f"weights = parameters x {pb} B ({tech.precision}{'; autocast keeps fp32 master weights and casts bf16/fp16 copies per forward' if autocast else ''})"
        + (" ; LoRA adapters in fp32" if tech.lora_rank else ""),
        f"gradients = trainable x {pb if not tech.lora_rank else 4} B (same dtype as the parameter)"
        + (f"; alive across the {t.grad_accum} micro-batches" if t.grad_accum > 1 else ""),
        *[f"optimizer = {line}" for line in opt_lines],
        f"activations per block{' (no checkpointing)' if tech.checkpointing != 'none' else ''} = "
        f"{act_layer / 2**20:.2f} MiB for b={dm.b} s={dm.s}: "
        + _act_formula(dm, tech, arch, device_type),
        f"logits ({tech.loss}) = "
        + (f"N x V x 4 B saved log-probs ({N:,} x {dm.V:,}); peak 3 x that at loss backward "
           f"(log-probs + their grad + grad of logits)"
           + (f"; naive: + the N x V x {dm.a:g} B logits the caller keeps (the previous step's until "
              f"model(x) returns)" if tech.loss == "naive" else "") if tech.loss in ("standard", "naive")
           else f"chunk {min(tech.loss_chunk, N)} x V in flight + grad_h (N x d) + fp32 grad_w (V x d)"),
        f"checkpointing {tech.checkpointing}: "
        + {"none": "all blocks keep their activations",
           "full": "each block keeps only its input; one block is recomputed at a time in backward",
           "selective": "blocks keep everything but the attention core (scores, softmax, dropout), "
                        "which keeps q, k, v and is recomputed in backward (Megatron's selective)",
           "selective-matmul": "blocks keep input + matmul outputs; the rest is recomputed in backward"}.get(
               checkpoint_policy(tech.checkpointing).kind, "blocks i % K == 0 keep only their input"),
        f"peak = {sim.peak / 2**20:.2f} MiB in {sim.peak_phase} ({sim.peak_detail})",
    ]
    if world > 1:
        lines.append(f"sharding {shard} over {world} ranks: "
                     + ("optimizer by dim-0 chunks of every tensor (ceil(rows/N) rows; largest rank)"
                        if shard == "zero1" else "DDP, everything replicated" if shard in ("none", "ddp") else "optimizer/N")
                     + (", gradients/N" if shard in ("zero2", "fsdp") else "")
                     + ("; gradients in DDP's buckets, alive across steps" if shard in ("none", "ddp", "zero1") else "")
                     + ("; weight shard + all weights gathered (compute dtype) from forward to end of backward"
                        if shard == "zero2" else "")
                     + (", weights/N + one gathered block + the root group gathered for the whole step"
                        if shard == "fsdp" else ""))
    return lines


def _act_formula(dm: _Dims, tech: TechniqueConfig, arch: Arch, device_type: str) -> str:
    backend = _resolve_backend(tech.attention, tech.window, dm)
    a, r = dm.a, dm.r
    parts = [f"N*d*({r:g} input + {r:g} after attn + {a:g}x(ln1+q,k,v copies+attn out+ln2) ...)",
             f"2*N*d_ff*{a:g} (fc out, gelu out)"]
    if backend == "math":
        parts.append(f"b*h*s^2*({4:g} softmax{' + ' + str(a) + ' cast' if a != 4 else ''}"
                     f"{' + 2 x dropout' if dm.dropout else ''}) + s^2 mask")
    elif backend.startswith("banded"):
        parts.append(f"b*h*s*(2W-1) band scores (W={tech.window})")
    else:
        parts.append("b*h*s*4 log-sum-exp (fused kernel, no s^2)")
    if dm.dropout:
        parts.append(f"dropout masks ({'float noise, input dtype' if device_type == 'cpu' else '1 B bool'})")
    if dm.autocast:
        parts.append("bf16/fp16 weight copies held until each layer's backward")
    return " + ".join(parts)


# --------------------------------------------------------------------------- inference
def estimate_inference(cfg: RunConfig, weights_dtype: str = "fp32", arch: Arch = GPT2_ARCH,
                       batch: Optional[int] = None) -> dict[str, Any]:
    """Forward-only memory: weights in ``weights_dtype`` plus one forward without autograd.

    Without grad nothing is saved, so the activations are transient: the residual stream, one
    block's largest intermediates (the attention scores and softmax for the math kernel, the MLP
    hidden) and, at the end, the logits of every position (b x s x V in the compute dtype).
    Compared with the rule of thumb "about 1.2 x the weights" (EleutherAI's Transformer Math 101).
    """
    if weights_dtype not in ("fp32", "bf16", "fp16", "int8"):
        raise ConfigError(f"--weights-dtype {weights_dtype!r}: choose fp32, bf16, fp16 or int8")
    m, t = cfg.model, cfg.train
    n_params = param_count(m, arch)[0]
    wb = DTYPE_BYTES[weights_dtype]
    weights = n_params * wb
    a = 4 if weights_dtype == "fp32" else 2  # int8 weights dequantize to 16-bit compute
    b, s, d, f, h = batch or t.batch_size, t.seq_len, m.d_model, m.d_ff, m.n_heads
    V = m.padded_vocab_size
    N = b * s
    kv = (arch.n_kv_heads or h) * m.head_dim
    dm = _Dims(b, s, d, f, h, kv, V, a, a, wb, autocast=False, dropout=False, cuda=False)
    backend = _resolve_backend(cfg.technique.attention, cfg.technique.window, dm)
    x = N * d * a
    qkv = N * (d + 2 * kv) * a
    if backend == "math":
        sc = b * h * s * s
        # q, k copies + scores + scaled + masked; then float32 softmax next to the masked scores.
        attn = qkv + 2 * N * d * a + max(2 * sc * a, sc * a + 2 * sc * 4)
    elif backend.startswith("banded"):
        W = cfg.technique.window or s
        sc = b * h * s * (2 * W - 1)
        attn = qkv + 4 * N * d * a + 2 * sc * 4
    else:
        attn = qkv + N * d * a + b * h * s * 4
    mlp = N * f * a * (2 if arch.mlp == "gelu" else 3) + N * d * a
    block_peak = x + max(attn, mlp)
    logits = N * V * a + N * d * a
    activations = max(block_peak, logits)
    peak = weights + activations
    rule = 1.2 * weights
    return {
        "mode": "inference",
        "parameters": n_params,
        "weights_dtype": weights_dtype,
        "bytes": {"weights": weights, "activations": block_peak, "logits": logits},
        "peak_bytes": peak,
        "peak_phase": "lm_head logits" if logits >= block_peak else f"block forward ({backend} attention)",
        "rule_of_thumb_bytes": rule,
        "ratio_to_weights": peak / weights,
        "rule_holds": peak <= rule,
        "explanation": [
            f"weights = {n_params:,} x {wb:g} B ({weights_dtype})",
            f"one block's forward (no autograd, transient): residual + qkv + "
            f"{'s^2 scores and fp32 softmax' if backend == 'math' else 'fused attention'} or the MLP hidden",
            f"logits = b*s*V*{a} B = {N:,} x {V:,} (every position, as model(x) returns them)",
            f"rule of thumb 1.2 x weights = {rule / 2**30:.2f} GiB; here {peak / weights:.2f} x weights"
            + ("" if peak <= rule else ": the rule breaks because batch*seq activations (logits above all) "
               "outgrow 20% of the weights"),
        ],
    }
