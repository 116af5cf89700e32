"""Parameter catalogue: every tensor of our model (and its LoRA adapters) from the model shape;
parameter counts, and a plausible shape for a bare parameter count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterable, Optional

from memtrain.analysis.limits import MAX_LAYERS, MAX_PARAMS, check_analytic_size
from memtrain.config.archs import GPT2_ARCH, Arch
from memtrain.config.run import ConfigError, ModelConfig, TechniqueConfig
from memtrain.models.spec import GPT_LORA_TARGETS, every_decoder_linear
from memtrain.techniques.facts import nf4_bytes, nf4_quantizes


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
    # --qlora: the sizes (values) of the Linears of this entry stored in NF4 (a fused entry
    # stands for several Linears, each quantized on its own, or not: facts.nf4_quantizes); the
    # rest of the entry keeps the parameters' dtype.
    nf4: tuple[int, ...] = ()
    # The element counts of the model's own tensors behind a fused entry (a transformers Llama's
    # q_proj, k_proj, v_proj; gate_proj, up_proj: :func:`lora_split`), () where the entry is one
    # tensor. An optimizer keeps its state per tensor, so whether a low-bit AdamW quantizes it is
    # decided on each of them (a narrow k_proj may keep FP32 state where the fused entry would not).
    parts: tuple[int, ...] = ()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def stored_bytes(self, elt: float) -> float:
        """Bytes the tensor(s) hold with ``elt``-byte elements, NF4 parts as torchao stores them."""
        return (self.numel - sum(self.nf4)) * elt + sum(nf4_bytes(n, elt) for n in self.nf4)

    @property
    def is_adapter(self) -> bool:
        """A LoRA A or B matrix (peft's ``lora_A`` / ``lora_B``), added to the model as built."""
        return ".lora_" in self.name


def lora_target_names(tech: TechniqueConfig) -> set[str]:
    """The table entries ``--lora-targets`` adapts. peft's ``all-linear`` is every decoder Linear,
    the entries memtrain's default names: on a transformers model as
    ``techniques.hf_mapping.lora_target_modules`` hands peft either, on our GPT as
    ``techniques.lora`` reads it. (A transformers model's named targets: :func:`lora_adapted`.)"""
    if every_decoder_linear(tech.lora_targets):
        return set(GPT_LORA_TARGETS.split(","))
    return {t.strip() for t in tech.lora_targets.split(",") if t.strip()}


def hf_lora_modules(arch: Arch) -> dict[str, tuple[tuple[str, str], ...]]:
    """A transformers layer's Linear names (peft's ``target_modules``, matched as the last part of
    a module's path) -> the (table entry, :func:`lora_split` suffix) pairs each one adapts.
    GPT-2's ``c_proj`` names two Conv1Ds, the attention's output and the MLP's down projection."""
    if arch.gpt2_layers:
        return {"c_attn": (("qkv", ""),), "c_proj": (("proj", ""), ("fc_out", "")), "c_fc": (("fc", ""),)}
    if arch.fused_proj:
        return {"qkv_proj": (("qkv", ""),), "o_proj": (("proj", ""),), "gate_up_proj": (("fc", ""),),
                "down_proj": (("fc_out", ""),)}
    return {"q_proj": (("qkv", ".q"),), "k_proj": (("qkv", ".k"),), "v_proj": (("qkv", ".v"),),
            "o_proj": (("proj", ""),), "gate_proj": (("fc", ".gate"),), "up_proj": (("fc", ".up"),),
            "down_proj": (("fc_out", ""),)}


def lora_adapted(arch: Arch, tech: TechniqueConfig) -> set[tuple[str, str]]:
    """The (table entry, :func:`lora_split` suffix) pairs that get a LoRA pair: every Linear of
    a named entry (our GPT's names, or every decoder Linear), or on a transformers model the
    Linears ``--lora-targets`` names (:func:`hf_lora_modules`; a name it does not list adapts
    nothing here: :func:`memtrain.analysis.estimate.hf.why_not_modelled` traces such runs)."""
    if not tech.lora_rank:
        return set()
    names = {t.strip() for t in tech.lora_targets.split(",") if t.strip()}
    if arch.hf and not every_decoder_linear(tech.lora_targets):
        modules = hf_lora_modules(arch)
        return {pair for name in names for pair in modules.get(name, ())}
    entries = lora_target_names(tech)
    suffixes = {short: [s for s, _ in lora_split(arch, short, 1, 1, 1)] for short in ("qkv", "proj", "fc", "fc_out")}
    return {(short, s) for short in entries for s in suffixes.get(short, ())}


def lora_split(arch: Arch, short: str, n_out: int, d: int, kv: int) -> list[tuple[str, int]]:
    """The Linears a fused table entry stands for, each with its own LoRA pair: (name suffix,
    output width). Our GPT's q/k/v and its MLP input are one Linear each; a transformers layer
    has q_proj, k_proj and v_proj (q: ``n_out - 2 kv`` wide, ``d`` unless ``Arch.head_dim`` says
    otherwise), and gate_proj and up_proj, and peft gives every one of them an ``A (r x in)`` and
    a ``B (out x r)``."""
    if arch.fused_proj or arch.gpt2_layers:
        return [("", n_out)]
    if arch.hf and short == "qkv":
        return [(".q", n_out - 2 * kv), (".k", kv), (".v", kv)]
    if arch.hf and short == "fc" and arch.mlp == "swiglu":
        return [(".gate", n_out // 2), (".up", n_out // 2)]
    return [("", n_out)]


def head_widths(m: ModelConfig, arch: Arch) -> tuple[int, int]:
    """(q width, k and v width): n_heads and n_kv_heads times the head width (``Arch.head_dim``
    where a transformers config sets one apart from d_model / n_heads)."""
    hd = arch.head_dim or m.head_dim
    return m.n_heads * hd, (arch.n_kv_heads or m.n_heads) * hd


def has_bias(arch: Arch, short: str, model_bias: bool) -> bool:
    """Whether a table entry's Linear has a bias: all of them by ``model_bias`` (our GPT's
    ``ModelConfig.bias``), else q/k/v (``Arch.qkv_bias``), the attention's output projection
    (``Arch.proj_bias``) or the MLP's (``Arch.mlp_bias``)."""
    return model_bias or {"qkv": arch.qkv_bias, "proj": arch.proj_bias, "fc": arch.mlp_bias,
                          "fc_out": arch.mlp_bias}.get(short, False)


def param_table(m: ModelConfig, arch: Arch = GPT2_ARCH, tech: Optional[TechniqueConfig] = None) -> list[ParamInfo]:
    """Every parameter tensor of the model, in ``model.parameters()`` order (tied head once).

    With LoRA (``tech.lora_rank > 0``) the base weights are frozen and each targeted Linear
    gets ``A (r x in)`` and ``B (out x r)`` adapters (peft's layout); only those train.
    One entry per tensor, so O(n_layers): :func:`param_count` answers counts in O(1).
    """
    check_analytic_size(m)
    return block_param_table(m, arch, tech, range(m.n_layers))


def param_count(m: ModelConfig, arch: Arch = GPT2_ARCH, tech: Optional[TechniqueConfig] = None) -> tuple[int, int]:
    """(parameters, trainable parameters) counted per layer kind: one block's tensors times
    ``n_layers`` plus the rest, so the cost does not grow with the depth."""
    check_analytic_size(m)
    total = trainable = 0
    for p in block_param_table(m, arch, tech, range(min(1, m.n_layers))):
        k = p.numel * (m.n_layers if p.block is not None else 1)
        total += k
        trainable += k if p.trainable else 0
    return total, trainable


def block_param_table(m: ModelConfig, arch: Arch, tech: Optional[TechniqueConfig], blocks: Iterable[int],
                 repeat: Optional[dict[int, int]] = None) -> list[ParamInfo]:
    """The table with only the blocks ``blocks`` (indices used in the names); ``repeat``
    gives a block's entries a multiplicity (the compressed simulation's lumped periods)."""
    d, f, V = m.d_model, m.d_ff, m.padded_vocab_size
    q, kv = head_widths(m, arch)
    bias = m.bias and arch.name == "gpt2"
    lora = tech.lora_rank if tech is not None else 0
    adapted = lora_adapted(arch, tech) if lora else set()  # type: ignore[arg-type]  # lora > 0 implies tech is not None
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

    # (GPT-2's Conv1D projections are no nn.Linear: QLoRA leaves them alone.)
    qlora = frozen and tech is not None and tech.qlora and not arch.gpt2_layers

    def linear(name: str, short: str, n_in: int, n_out: int, i: int) -> None:
        k = rep.get(i, 1)
        # QLoRA quantizes every frozen decoder Linear whose weight fits torchao's blocks (q_proj,
        # k_proj and v_proj of a fused entry each on its own: a narrow k/v may not).
        split = lora_split(arch, short, n_out, d, kv)
        nf4 = tuple(width * n_in for _, width in split if qlora and nf4_quantizes(width * n_in))
        parts = tuple(width * n_in for _, width in split) if len(split) > 1 else ()
        out.append(ParamInfo(f"{name}.weight", (n_out, n_in), not frozen, i, k, nf4, parts))
        if has_bias(arch, short, bias):
            out.append(ParamInfo(f"{name}.bias", (n_out,), not frozen, i, k))
        for suffix, width in lora_split(arch, short, n_out, d, kv):
            if (short, suffix) in adapted:
                out.append(ParamInfo(f"{name}.lora_A{suffix}", (lora, n_in), True, i, k))
                out.append(ParamInfo(f"{name}.lora_B{suffix}", (width, lora), True, i, k))

    for i in blocks:
        p = f"blocks.{i}"
        norm(f"{p}.ln_1", i)
        if arch.fused_proj:
            # Phi3Attention registers o_proj before qkv_proj: the model's parameter order, which
            # the single-tensor optimizer steps walk (their scratch pairs neighbours).
            linear(f"{p}.attn.proj", "proj", q, d, i)
            linear(f"{p}.attn.qkv", "qkv", d, q + 2 * kv, i)
        else:
            linear(f"{p}.attn.qkv", "qkv", d, q + 2 * kv, i)
            linear(f"{p}.attn.proj", "proj", q, d, i)
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
    if not math.isfinite(value) or value < 1:  # 0.5 would become 0 parameters
        raise ConfigError(f"cannot read parameter count {text!r}; write a count of at least 1 like 3B, 124M or 7e9")
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
