"""The analytic model of transformers decoder layers against the fake-tensor trace on odd
shapes: widths 72-200, odd and even depths, grouped-query ratios from 1 (MQA) to equal heads,
for Llama, Qwen2, Mistral, Phi-3, Gemma and GPT-2 under fp32, bf16 autocast and bf16-pure, eager and SDPA attention,
with and without LoRA and full checkpointing; then named --lora-targets (TARGETS), head widths
and biases from config.json (SHAPED) and a sliding window with eager attention (WINDOWED) and with
SDPA (SDPA_WINDOWED), the loss alternating between the standard and the chunked one.

The measures are the forward peak and the backward peak, each within 1% (the larger of the two
alone hid forward peaks that were off where backward set the step's peak); the optimizer step has
tests of its own (tests/test_estimate.py, tests/test_estimate_bf16_pure_step.py), and is held
within 1% here where a test says so (bf16-pure's included: the trace holds what torchao's compiled
kernels hold). A handful of cases run by default; the whole product with -m slow.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from memtrain.config.run import build_config  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# (hidden, heads, key/value heads, layers): head dims 12-34, GQA ratios 1-6, 1 to 5 layers.
SIZES = [(72, 6, 2, 3), (96, 4, 4, 5), (120, 6, 3, 3), (200, 10, 2, 1), (136, 4, 1, 3), (168, 6, 6, 5)]
CONFIGS = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "mistral": "MistralConfig", "phi3": "Phi3Config",
           "gemma": "GemmaConfig", "gpt2": "GPT2Config"}
# GPT-2 (no grouped-query attention: the k/v heads of SIZES are left out): the MLP width is its
# n_inner; its dropouts (attn_pdrop, resid_pdrop, embd_pdrop) keep transformers' 0.1, so SDPA on
# the CPU falls back to its math path (in float32 on bf16 q, k, v).
GPT2_FIELDS = {"hidden_size": "n_embd", "intermediate_size": "n_inner", "num_hidden_layers": "n_layer",
               "num_attention_heads": "n_head", "max_position_embeddings": "n_positions"}


def _extra(fam: str, hidden: int, heads: int) -> dict:
    """Config fields beyond the sizes: Phi-3's default token ids (32000) lie outside the grid's
    small vocabularies; Gemma's head_dim defaults to 256 (its tanh-GELU and tied head stay)."""
    if fam == "phi3":
        return dict(pad_token_id=0, bos_token_id=0, eos_token_id=0)
    if fam == "gemma":
        return dict(head_dim=hidden // heads)
    if fam == "gpt2":
        return dict(bos_token_id=0, eos_token_id=0)
    return {}

PRECISIONS = ("fp32", "bf16", "bf16-pure")
ATTENTION = ("sdpa", "math")


def _cases() -> list[tuple[str, tuple[int, int, int, int], str, str, int, str]]:
    """Every combination, each on the next shape of SIZES (so every shape meets every technique)."""
    combos = itertools.product(CONFIGS, PRECISIONS, ATTENTION, (0, 4), ("none", "full"))
    return [(fam, SIZES[i % len(SIZES)], prec, attn, lora, ck)
            for i, (fam, prec, attn, lora, ck) in enumerate(combos)]


def _case_id(case) -> str:
    fam, (h, nh, kv, L), prec, attn, lora, ck = case
    return f"{fam}-h{h}-{nh}q{kv}kv-L{L}-{prec}-{attn}" + (f"-lora{lora}" if lora else "") + f"-ckpt_{ck}"


# Cases run by default: every family, precision, attention kind, LoRA and checkpointing at
# least once, on shapes with grouped-query attention and odd depths.
DEFAULT = {"llama-h72-6q2kv-L3-fp32-sdpa-ckpt_none", "llama-h96-4q4kv-L5-fp32-sdpa-ckpt_full",
           "llama-h200-10q2kv-L1-fp32-sdpa-lora4-ckpt_full", "qwen2-h136-4q1kv-L3-fp32-math-ckpt_none",
           "qwen2-h96-4q4kv-L5-fp32-math-lora4-ckpt_full", "qwen2-h120-6q3kv-L3-bf16-sdpa-ckpt_none",
           "mistral-h72-6q2kv-L3-bf16-math-ckpt_none", "mistral-h168-6q6kv-L5-bf16-pure-math-lora4-ckpt_full",
           "mistral-h120-6q3kv-L3-bf16-pure-math-ckpt_none",
           # peft's LoRA under autocast (casts of the input and of the adapters), recomputed under
           # checkpointing from the first op that saved something; the frozen first layer's input;
           # the float32 RMSNorm's backward.
           "llama-h200-10q2kv-L1-bf16-math-lora4-ckpt_full", "qwen2-h72-6q2kv-L3-fp32-math-lora4-ckpt_none",
           "mistral-h200-10q2kv-L1-bf16-pure-math-ckpt_full",
           # Phi-3: the fused q/k/v output kept whole by SDPA (v is a slice of it) and SDPA's
           # output copied by .contiguous(); one LoRA pair on each fused Linear, under autocast
           # and under bf16-pure with lazy recompute.
           "phi3-h72-6q2kv-L3-fp32-sdpa-ckpt_none", "phi3-h136-4q1kv-L3-bf16-sdpa-lora4-ckpt_none",
           "phi3-h96-4q4kv-L5-bf16-pure-sdpa-lora4-ckpt_full",
           # Gemma: the float32 x * (1 + w) norm, the scaled embedding and the tied head, with
           # LoRA under autocast and under bf16-pure with lazy recompute.
           "gemma-h72-6q2kv-L3-fp32-sdpa-ckpt_none", "gemma-h120-6q3kv-L3-bf16-math-lora4-ckpt_none",
           "gemma-h96-4q4kv-L5-bf16-pure-sdpa-lora4-ckpt_full",
           # GPT-2: gelu_new's saved intermediates, the fused Conv1D q/k/v with one LoRA pair, its
           # dropouts (SDPA's float32 math fallback under bf16), the softmax in bf16 under
           # bf16-pure eager attention, LoRA with lazy recompute.
           "gpt2-h72-6q2kv-L3-fp32-sdpa-ckpt_none", "gpt2-h136-4q1kv-L3-bf16-sdpa-lora4-ckpt_none",
           "gpt2-h120-6q3kv-L3-bf16-pure-math-ckpt_none", "gpt2-h96-4q4kv-L5-bf16-pure-sdpa-lora4-ckpt_full"}

# Measured gaps the analytic model still has (estimate / trace - 1 of a measure above, on
# torch 2.13 and transformers 5.24), each a case id mapped to its figure. Strict: a case that
# comes within 1% fails here until it leaves this table. None at present.
KNOWN: dict[str, float] = {}


def _known_reason(cid: str) -> str:
    return f"the analytic model is {KNOWN[cid]:+.1%} off the trace here (a known gap, not yet located)"


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[tuple, Path]:
    return {}


def _folder(folders: dict, root: Path, fam: str, size: tuple[int, int, int, int], name: str = "",
            fields: dict | None = None) -> Path:
    """The config folder of family ``fam`` on ``size`` (made once per module), with ``fields`` over
    the grid's own (a variant's, kept apart under its ``name``)."""
    name = name or fam
    if (name, size) not in folders:
        h, nh, kv, L = size
        kw = {**dict(hidden_size=h, intermediate_size=2 * h + 8, num_hidden_layers=L, num_attention_heads=nh,
                     num_key_value_heads=kv, max_position_embeddings=128, vocab_size=300 + h),
              **_extra(fam, h, nh), **(fields or {})}
        if fam == "gpt2":
            kw = {GPT2_FIELDS.get(k, k): v for k, v in kw.items() if k != "num_key_value_heads"}
        d = root / f"{name}-{h}-{nh}-{kv}-{L}"
        getattr(transformers, CONFIGS[fam])(**kw).save_pretrained(d)
        folders[(name, size)] = d
    return folders[(name, size)]


def _marked(cases: list, case_id, default: set[str]) -> list:
    """``cases`` as pytest params named by ``case_id``: those in ``default`` run by default, the
    rest with -m slow; those in KNOWN expected to fail."""
    out = []
    for c in cases:
        cid = case_id(c)
        marks = [] if cid in default else [pytest.mark.slow]
        if cid in KNOWN:
            marks.append(pytest.mark.xfail(reason=_known_reason(cid), strict=True))
        out.append(pytest.param(c, id=cid, marks=marks))
    return out


def _within_one_percent(d: Path, tech: dict, lora: bool) -> None:
    """The analytic estimate of a 3 x 40-token step on the model folder ``d`` with ``tech``
    against its trace: the forward and the backward peaks each within 1% (and, without LoRA,
    whose adapters the trace does not count, the same parameters)."""
    from memtrain.analysis.estimate.hf import analytic_estimate
    from memtrain.analysis.trace import trace_step

    cfg = build_config({"model": str(d), "batch_size": 3, "seq_len": 40, "device": "cpu", **tech})
    est = analytic_estimate(cfg, "cpu")
    assert est is not None
    traced = trace_step(cfg, "cpu")
    _each_phase_within_one_percent(est.phase_peaks, traced["phase_peaks"])
    if not lora:  # the trace's count is the base model's
        assert est.parameters == traced["parameters"]


def _each_phase_within_one_percent(ours: dict, theirs: dict) -> None:
    """The estimate's forward and backward peaks each within 1% of the trace's: either can be
    the step's peak (the forward's under checkpointing or a small loss)."""
    for phase in ("forward", "backward"):
        mine, traced = ours[phase], theirs[phase]
        assert abs(mine / traced - 1) < 0.01, (phase, mine, traced, mine / traced - 1)


@pytest.mark.parametrize("case", _marked(_cases(), _case_id, DEFAULT))
def test_analytic_within_one_percent_of_the_trace(case, folders, tmp_path_factory):
    fam, size, prec, attn, lora, ck = case
    d = _folder(folders, tmp_path_factory.getbasetemp(), fam, size)
    tech = {"precision": prec, "attention": attn, "checkpointing": ck, **({"lora_rank": lora} if lora else {})}
    _within_one_percent(d, tech, bool(lora))


# Named --lora-targets: a subset of each layer's Linears (peft matches a name as the last part of
# a module's path). Peft's default for Llama-style models is q_proj,v_proj. The first layer reads
# the frozen embedding, so there only what an adapter feeds requires a gradient: with MLP-only
# targets its attention records nothing, with q and v only its k does not (the eager q @ k^T then
# keeps k's copy alone), and a frozen Linear keeps its weight copy (autocast) only where its input
# requires a gradient.
TARGETS = {
    "llama": ("q_proj,v_proj", "q_proj,k_proj,v_proj,o_proj", "gate_proj,up_proj,down_proj"),
    "qwen2": ("q_proj,v_proj", "v_proj,down_proj", "gate_proj,up_proj,down_proj"),
    "mistral": ("q_proj,v_proj", "q_proj,k_proj,v_proj,o_proj", "up_proj"),
    "gemma": ("q_proj,v_proj", "k_proj,o_proj", "gate_proj,up_proj,down_proj"),
    "phi3": ("qkv_proj", "qkv_proj,o_proj", "gate_up_proj,down_proj"),
    # c_proj names the attention's output and the MLP's down projection; c_attn alone under
    # bf16-pure SDPA (the CPU's float32 math path, for GPT-2's attention dropout) was 1.4% under
    # before that path's float32 copies of q, k and v were counted.
    "gpt2": ("c_attn", "c_attn,c_proj", "c_fc", "c_proj"),
}


def _target_cases() -> list[tuple[str, tuple[int, int, int, int], str, str, str, str, str]]:
    """Every family x its target sets x precision x attention x checkpointing, each on the next
    shape of SIZES, the loss alternating between the standard and the chunked one."""
    combos = [(fam, t, prec, attn, ck) for fam in TARGETS for t in TARGETS[fam]
              for prec, attn, ck in itertools.product(PRECISIONS, ATTENTION, ("none", "full"))]
    return [(fam, SIZES[i % len(SIZES)], t, prec, attn, ck, ("standard", "chunked")[i // 2 % 2])
            for i, (fam, t, prec, attn, ck) in enumerate(combos)]


def _target_case_id(case) -> str:
    fam, (h, nh, kv, L), targets, prec, attn, ck, loss = case
    return f"{fam}-h{h}-{nh}q{kv}kv-L{L}-{targets.replace(',', '+')}-{prec}-{attn}-ckpt_{ck}-{loss}"


# Run by default: peft's Llama default under autocast (eager, first layer's k frozen) and
# bf16-pure with checkpointing, MLP-only targets (the first layer's attention records nothing)
# under eager autocast with checkpointing, Phi-3's fused q/k/v alone and Gemma's k and o (the first
# layer's q and v frozen) under eager autocast with the chunked loss, Phi-3's checkpointed eager
# layers under autocast (rope's float32 q and k, the fused q/k/v output held by the attention's
# frame); GPT-2's c_attn alone under bf16-pure SDPA with checkpointing.
TARGETS_DEFAULT = {"llama-h72-6q2kv-L3-q_proj+v_proj-bf16-math-ckpt_none-chunked",
                   "llama-h200-10q2kv-L1-q_proj+v_proj-bf16-pure-sdpa-ckpt_full-standard",
                   "llama-h96-4q4kv-L5-gate_proj+up_proj+down_proj-bf16-math-ckpt_full-chunked",
                   "phi3-h136-4q1kv-L3-qkv_proj-bf16-sdpa-ckpt_none-standard",
                   "gemma-h72-6q2kv-L3-k_proj+o_proj-bf16-math-ckpt_none-chunked",
                   "phi3-h96-4q4kv-L5-qkv_proj+o_proj-bf16-math-ckpt_full-chunked",
                   "gpt2-h200-10q2kv-L1-c_attn-bf16-pure-sdpa-ckpt_full-standard"}


@pytest.mark.parametrize("case", _marked(_target_cases(), _target_case_id, TARGETS_DEFAULT))
def test_named_lora_targets_within_one_percent_of_the_trace(case, folders, tmp_path_factory):
    fam, size, targets, prec, attn, ck, loss = case
    d = _folder(folders, tmp_path_factory.getbasetemp(), fam, size)
    tech = {"precision": prec, "attention": attn, "checkpointing": ck, "loss": loss, "lora_rank": 4,
            "lora_targets": targets, **({"loss_chunk": 50} if loss == "chunked" else {})}
    _within_one_percent(d, tech, True)


# At 40 tokens the (b, 1, s, s) float causal mask eager attention adds is under 1% of a step;
# at 97 it is not. These cases hold what a longer sequence exposes: the model-level mask, rotary
# tables and positions a checkpointed layer keeps until its backward (Segment.held_inputs),
# the attention weights eager layers hold until they return, the first layer's input held by
# the model (LoRA), and the final norm's output held by the loss under autocast; and eager
# attention under autocast, whose (b, h, s, s) scores the float32 mask makes float32 beside rope's
# float32 q and k and repeat_kv's float32 k (the two bf16 eager Llama cases without adapters and with
# them: +3.0% and +4.9% forward before).
LONG = [
    ("llama", (72, 6, 2, 3), "fp32", "math", 0, "full", "standard"),
    ("qwen2", (136, 4, 1, 3), "bf16", "math", 4, "full", "standard"),
    ("gemma", (96, 4, 4, 5), "bf16-pure", "math", 0, "full", "standard"),
    ("phi3", (120, 6, 3, 3), "bf16", "math", 0, "full", "standard"),
    ("mistral", (72, 6, 2, 3), "fp32", "math", 4, "full", "chunked"),
    ("llama", (200, 10, 2, 1), "bf16", "sdpa", 4, "none", "chunked"),
    ("qwen2", (168, 6, 6, 5), "bf16", "sdpa", 4, "none", "chunked"),
    ("gpt2", (72, 6, 2, 3), "bf16", "math", 0, "full", "standard"),
    ("llama", (200, 10, 2, 1), "bf16", "math", 0, "full", "chunked"),
    ("llama", (120, 6, 3, 3), "bf16", "math", 4, "full", "standard"),
    # A checkpointed float32 layer without adapters peaks in its MLP where the loss is small:
    # gate_proj's output goes once silu has read it, before up_proj runs (+2.7% and +6.4% forward
    # when gate and up were one fused Linear).
    ("llama", (96, 4, 4, 5), "fp32", "math", 0, "full", "standard"),
    ("gemma", (200, 10, 2, 1), "fp32", "sdpa", 0, "full", "standard"),
    # One k/v head: repeat_kv's k and v are views, which each matmul copies as it runs; a
    # checkpointed layer's forward keeps neither copy (+4.1% and +3.7% forward when counted as repeat_kv's
    # copies held until the attention returns).
    ("gemma", (90, 5, 1, 2), "fp32", "math", 0, "full", "chunked"),
    ("llama", (90, 5, 1, 2), "bf16", "math", 4, "full", "standard"),
]
LONG_DEFAULT = {0, 5, 7, 10, 12}


def _params(cases: list, default: set, case_id) -> list:
    """``cases`` as pytest params named by ``case_id``; those not in ``default`` (their indices)
    run with ``-m slow`` only."""
    return [pytest.param(case, id=case_id(*case), marks=[] if i in default else [pytest.mark.slow])
            for i, case in enumerate(cases)]


def _long_params():
    return _params(LONG, LONG_DEFAULT, lambda fam, size, prec, attn, lora, ck, loss:
                   f"{fam}-h{size[0]}-L{size[3]}-{prec}-{attn}" + (f"-lora{lora}" if lora else "") + f"-ckpt_{ck}-{loss}")


@pytest.mark.parametrize("case", _long_params())
def test_analytic_within_one_percent_of_the_trace_at_97_tokens(case, folders, tmp_path_factory):
    from memtrain.analysis.estimate.hf import analytic_estimate
    from memtrain.analysis.trace import trace_step

    fam, size, prec, attn, lora, ck, loss = case
    d = _folder(folders, tmp_path_factory.getbasetemp(), fam, size)
    tech = {"precision": prec, "attention": attn, "checkpointing": ck, "loss": loss,
            **({"lora_rank": lora} if lora else {}), **({"loss_chunk": 50} if loss == "chunked" else {})}
    cfg = build_config({"model": str(d), "batch_size": 3, "seq_len": 97, "device": "cpu", **tech})
    est = analytic_estimate(cfg, "cpu")
    assert est is not None
    traced = trace_step(cfg, "cpu")
    _each_phase_within_one_percent(est.phase_peaks, traced["phase_peaks"])


# Head widths and biases the families' layer code takes from config.json: a head_dim apart from
# hidden / heads (wider, as Gemma-7B's 16 x 256 for 3072; narrower, as Mistral-Nemo's 32 x 128 for
# 5120: q and the output projection's input are heads x head_dim wide), and Llama's
# attention_bias (q, k, v and o) and mlp_bias (gate, up, down), Gemma's attention_bias. Mistral's
# layers ignore attention_bias (no bias whatever the config says).
SHAPED = {
    "llama-wide_heads": ("llama", lambda hd: {"head_dim": hd + 8}),
    "qwen2-wide_heads": ("qwen2", lambda hd: {"head_dim": hd + 8}),
    "mistral-narrow_heads": ("mistral", lambda hd: {"head_dim": hd - 4, "attention_bias": True}),
    "gemma-wide_heads": ("gemma", lambda hd: {"head_dim": 2 * hd}),
    "phi3-wide_heads": ("phi3", lambda hd: {"head_dim": hd + 8}),
    "llama-biases": ("llama", lambda hd: {"attention_bias": True, "mlp_bias": True}),
    "gemma-biases": ("gemma", lambda hd: {"attention_bias": True}),
}


def _shape_cases() -> list[tuple[str, tuple[int, int, int, int], str, str, int, str, str]]:
    """Every entry of SHAPED x precision x attention x LoRA (every Linear) x checkpointing, each
    on the next shape of SIZES, the loss alternating between the standard and the chunked one."""
    combos = list(itertools.product(SHAPED, PRECISIONS, ATTENTION, (0, 4), ("none", "full")))
    return [(name, SIZES[i % len(SIZES)], prec, attn, lora, ck, ("standard", "chunked")[i // 2 % 2])
            for i, (name, prec, attn, lora, ck) in enumerate(combos)]


def _shape_case_id(case) -> str:
    name, (h, nh, kv, L), prec, attn, lora, ck, loss = case
    return f"{name}-h{h}-{nh}q{kv}kv-L{L}-{prec}-{attn}" + (f"-lora{lora}" if lora else "") + f"-ckpt_{ck}-{loss}"


def _shaped_folder(folders: dict, root: Path, name: str, size: tuple[int, int, int, int]) -> Path:
    """The config folder of SHAPED[name] on ``size``."""
    fam, fields = SHAPED[name]
    return _folder(folders, root, fam, size, name, fields(size[0] // size[1]))


# Run by default: a wide head under autocast with eager attention and LoRA, a narrow one (Mistral,
# whose attention_bias is ignored) under bf16-pure with SDPA and checkpointing, Gemma-7B's
# doubled head, Llama's biases under autocast (their cached bf16 copies) with LoRA, and Phi-3's
# wide heads in a checkpointed eager layer (the fused q/k/v output held until o_proj).
SHAPED_DEFAULT = {"llama-wide_heads-h120-6q3kv-L3-bf16-math-lora4-ckpt_none-chunked",
                  "mistral-narrow_heads-h168-6q6kv-L5-bf16-pure-sdpa-ckpt_full-standard",
                  "gemma-wide_heads-h72-6q2kv-L3-fp32-sdpa-ckpt_none-standard",
                  "llama-biases-h136-4q1kv-L3-bf16-sdpa-lora4-ckpt_none-chunked",
                  "phi3-wide_heads-h200-10q2kv-L1-bf16-pure-math-ckpt_full-standard"}


@pytest.mark.parametrize("case", _marked(_shape_cases(), _shape_case_id, SHAPED_DEFAULT))
def test_head_widths_and_biases_within_one_percent_of_the_trace(case, folders, tmp_path_factory):
    name, size, prec, attn, lora, ck, loss = case
    d = _shaped_folder(folders, tmp_path_factory.getbasetemp(), name, size)
    tech = {"precision": prec, "attention": attn, "checkpointing": ck, "loss": loss,
            **({"lora_rank": lora} if lora else {}), **({"loss_chunk": 50} if loss == "chunked" else {})}
    _within_one_percent(d, tech, bool(lora))


# Sliding windows with eager attention (--attention math): transformers adds the model's float
# mask, windowed or not, so the step's tensors are the unwindowed ones (SDPA with a window:
# SDPA_WINDOWED below). The window from config.json (Mistral, Phi-3) or --window (Qwen2, whose
# layers then all slide), shorter than the 40-token sequence. (Llama's layers have no window.)
WINDOWED = {"mistral-config_window": ("mistral", {"sliding_window": 16}, {}),
            "qwen2-flag_window": ("qwen2", {}, {"window": 16}),
            "phi3-config_window": ("phi3", {"sliding_window": 16}, {})}


def _window_cases() -> list[tuple[str, tuple[int, int, int, int], str, int, str]]:
    combos = list(itertools.product(WINDOWED, PRECISIONS, (0, 4), ("none", "full")))
    return [(name, SIZES[i % len(SIZES)], prec, lora, ck) for i, (name, prec, lora, ck) in enumerate(combos)]


def _window_case_id(case) -> str:
    name, (h, nh, kv, L), prec, lora, ck = case
    return f"{name}-h{h}-{nh}q{kv}kv-L{L}-{prec}-math" + (f"-lora{lora}" if lora else "") + f"-ckpt_{ck}"


WINDOW_DEFAULT = {"mistral-config_window-h72-6q2kv-L3-fp32-math-ckpt_none",
                  "qwen2-flag_window-h96-4q4kv-L5-bf16-math-lora4-ckpt_full"}


@pytest.mark.parametrize("case", _marked(_window_cases(), _window_case_id, WINDOW_DEFAULT))
def test_eager_sliding_window_within_one_percent_of_the_trace(case, folders, tmp_path_factory):
    name, size, prec, lora, ck = case
    fam, fields, flags = WINDOWED[name]
    d = _folder(folders, tmp_path_factory.getbasetemp(), fam, size, name, fields)
    tech = {"precision": prec, "attention": "math", "checkpointing": ck, **flags, **({"lora_rank": lora} if lora else {})}
    _within_one_percent(d, tech, bool(lora))


# Sliding windows with SDPA (--attention sdpa, CPU kernels): transformers hands SDPA the windowed
# bool mask instead of is_causal, repeats k and v to the q heads for it (a view with one k/v
# head, nothing with as many as q heads), SDPA's autocast casts rope's float32 k, and torch's CPU
# flash kernel saves a float copy of the mask per layer (attention_nodes._masked_sdpa_nodes). The
# windows of WINDOWED, the loss alternating between the standard and the chunked one.
def _sdpa_window_cases() -> list[tuple[str, tuple[int, int, int, int], str, int, str, str]]:
    combos = list(itertools.product(WINDOWED, PRECISIONS, (0, 4), ("none", "full")))
    return [(name, SIZES[i % len(SIZES)], prec, lora, ck, ("standard", "chunked")[i // 2 % 2])
            for i, (name, prec, lora, ck) in enumerate(combos)]


def _sdpa_window_case_id(case) -> str:
    name, (h, nh, kv, L), prec, lora, ck, loss = case
    return f"{name}-h{h}-{nh}q{kv}kv-L{L}-{prec}-sdpa" + (f"-lora{lora}" if lora else "") + f"-ckpt_{ck}-{loss}"


# Run by default: grouped-query heads copied by repeat_kv under fp32, one k/v head (a view, its
# float32 k cast as wide as q) under autocast, and Qwen2's --window under autocast with LoRA
# (rope's float32 k apart: repeated then cast; with as many k/v heads as q heads, cast alone,
# under checkpointing with the chunked loss).
SDPA_WINDOW_DEFAULT = {"mistral-config_window-h72-6q2kv-L3-fp32-sdpa-ckpt_none-standard",
                       "mistral-config_window-h136-4q1kv-L3-bf16-sdpa-ckpt_none-standard",
                       "qwen2-flag_window-h72-6q2kv-L3-bf16-sdpa-lora4-ckpt_none-chunked",
                       "qwen2-flag_window-h96-4q4kv-L5-bf16-sdpa-lora4-ckpt_full-chunked"}


@pytest.mark.parametrize("case", _marked(_sdpa_window_cases(), _sdpa_window_case_id, SDPA_WINDOW_DEFAULT))
def test_sdpa_sliding_window_within_one_percent_of_the_trace(case, folders, tmp_path_factory):
    name, size, prec, lora, ck, loss = case
    fam, fields, flags = WINDOWED[name]
    d = _folder(folders, tmp_path_factory.getbasetemp(), fam, size, name, fields)
    tech = {"precision": prec, "attention": "sdpa", "checkpointing": ck, "loss": loss, **flags,
            **({"lora_rank": lora} if lora else {}), **({"loss_chunk": 50} if loss == "chunked" else {})}
    _within_one_percent(d, tech, bool(lora))


# attention_dropout in config.json, a Llama-style layer's only dropout: it drops the attention
# weights (eager; SDPA on the CPU then runs its math path), never the embedding or the residual
# branches, whose masks the estimate counted before (+2.1% to +4.4% forward on these cases).
# Phi-3's resid_pdrop and embd_pdrop stay zero here (not modelled: traced).
ATTENTION_DROPOUT = [("llama", (72, 6, 2, 3), "fp32", "sdpa", 0, "none"),
                     ("qwen2", (136, 4, 1, 3), "bf16", "sdpa", 0, "none"),
                     ("gemma", (120, 6, 3, 3), "bf16-pure", "math", 4, "none"),
                     ("phi3", (96, 4, 4, 5), "fp32", "math", 0, "none"),
                     # Eager attention under autocast drops the float32 softmax (rope's float32 query
                     # keeps it float32) and the second matmul casts the dropped weights: counted in
                     # bf16 before, -3.2% forward and backward (-3.4% backward checkpointed).
                     ("llama", (72, 6, 2, 3), "bf16", "math", 0, "none"),
                     ("mistral", (120, 6, 3, 3), "fp16", "math", 4, "full"),
                     # SDPA's math path with grouped k/v heads (enable_gqa) repeats k and v to the q
                     # heads after its float32 copies, its locals until it returns: a checkpointed
                     # layer's forward was -2.3% (fp32) to -3.7% (bf16-pure) under.
                     ("llama", (72, 6, 2, 3), "fp32", "sdpa", 0, "full"),
                     ("phi3", (72, 6, 2, 3), "bf16-pure", "sdpa", 0, "full")]


@pytest.mark.parametrize("case", ATTENTION_DROPOUT, ids=lambda c: f"{c[0]}-{c[2]}-{c[3]}-lora{c[4]}-ckpt_{c[5]}")
def test_attention_dropout_within_one_percent_of_the_trace(case, folders, tmp_path_factory):
    fam, size, prec, attn, lora, ck = case
    fields = {"attention_dropout": 0.1, **({"resid_pdrop": 0.0, "embd_pdrop": 0.0} if fam == "phi3" else {})}
    d = _folder(folders, tmp_path_factory.getbasetemp(), fam, size, f"{fam}-attention_dropout", fields)
    tech = {"precision": prec, "attention": attn, "checkpointing": ck, **({"lora_rank": lora} if lora else {})}
    _within_one_percent(d, tech, bool(lora))


# Qwen2's config.json window (use_sliding_window: the layers from max_window_layers on slide) with
# eager attention: Qwen2Model makes the full causal mask beside the windowed one whenever a layer
# slides, and hands each layer its kind's, so checkpointed layers of both kinds keep two float
# (b, 1, s, s) masks until their backward. The estimate counted one: -1.9% forward at 3 x 97
# tokens on a 3-layer model with one full layer (fp32, full checkpointing). Every layer sliding
# (max_window_layers 0), the full mask is the model's alone, gone before the loss.
# Deep enough to be lumped (Compression) were its layers of one kind: a lump replayed the release
# of a mask, and the backward peak of 9 layers (6 of them full) came out 5.5% under the trace (the
# optimizer phase of a 14-layer one 45%); so under fp32 (torch's AdamW, traced exactly) that phase
# is held within 1% too.
QWEN2_WINDOWS = [((72, 6, 2, 3), 1, "fp32", 0, "full"), ((136, 4, 1, 3), 2, "bf16", 4, "full"),
                 ((120, 6, 3, 3), 0, "fp32", 0, "full"), ((96, 4, 4, 5), 2, "bf16-pure", 0, "every:2"),
                 ((72, 6, 2, 9), 6, "fp32", 0, "full")]


@pytest.mark.parametrize("case", QWEN2_WINDOWS,
                         ids=lambda c: f"h{c[0][0]}-L{c[0][3]}-full{c[1]}-{c[2]}-lora{c[3]}-ckpt_{c[4]}")
def test_qwen2_config_window_with_eager_attention_within_one_percent_of_the_trace(case, folders, tmp_path_factory):
    from memtrain.analysis.estimate.hf import analytic_estimate
    from memtrain.analysis.trace import trace_step

    size, full_layers, prec, lora, ck = case
    fields = {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": full_layers}
    d = _folder(folders, tmp_path_factory.getbasetemp(), "qwen2", size, f"qwen2-window-full{full_layers}", fields)
    cfg = build_config({"model": str(d), "batch_size": 3, "seq_len": 97, "device": "cpu", "precision": prec,
                        "attention": "math", "checkpointing": ck, **({"lora_rank": lora} if lora else {})})
    est = analytic_estimate(cfg, "cpu")
    assert est is not None
    traced = trace_step(cfg, "cpu")["phase_peaks"]
    _each_phase_within_one_percent(est.phase_peaks, traced)
    if prec == "fp32":
        assert abs(est.phase_peaks["optimizer"] / traced["optimizer"] - 1) < 0.01


# --checkpointing selective-matmul (torch's SAC): a layer's recompute stops at its last op that
# saved something (down_proj, or its lora_B), so the cached output of that matmul, read only by
# the residual add, is never handed back to the recompute; the checkpoint's frame drops it as the
# layer's backward ends. The estimate kept it past the backward: the optimizer phase of these
# cases +2.3%, +1.4%, +12.2% and +19.1% over the trace before (one per layer: three LoRA layers
# keep three). That phase is held within 1% too.
SELECTIVE_MATMUL = [("llama", (200, 10, 2, 1), "fp32", "sdpa", 0),
                    ("gemma", (200, 10, 2, 1), "bf16", "math", 0),
                    ("llama", (72, 6, 2, 3), "bf16", "sdpa", 4),
                    ("gemma", (120, 6, 3, 3), "fp32", "math", 4),
                    ("mistral", (136, 4, 1, 3), "bf16-pure", "sdpa", 0)]
SELECTIVE_MATMUL_DEFAULT = {0, 2}


def _selective_matmul_params():
    return _params(SELECTIVE_MATMUL, SELECTIVE_MATMUL_DEFAULT, lambda fam, size, prec, attn, lora:
                   f"{fam}-h{size[0]}-L{size[3]}-{prec}-{attn}" + (f"-lora{lora}" if lora else ""))


@pytest.mark.parametrize("case", _selective_matmul_params())
def test_selective_matmul_each_phase_within_one_percent_of_the_trace(case, folders, tmp_path_factory):
    from memtrain.analysis.estimate.hf import analytic_estimate
    from memtrain.analysis.trace import trace_step

    fam, size, prec, attn, lora = case
    d = _folder(folders, tmp_path_factory.getbasetemp(), fam, size)
    cfg = build_config({"model": str(d), "batch_size": 3, "seq_len": 97, "device": "cpu", "precision": prec,
                        "attention": attn, "checkpointing": "selective-matmul",
                        **({"lora_rank": lora} if lora else {})})
    est = analytic_estimate(cfg, "cpu")
    assert est is not None
    traced = trace_step(cfg, "cpu")["phase_peaks"]
    _each_phase_within_one_percent(est.phase_peaks, traced)
    mine = est.phase_peaks["optimizer"]
    assert abs(mine / traced["optimizer"] - 1) < 0.01, ("optimizer", mine, traced["optimizer"])


# Batch 1 with eager attention: the matmuls fold a (1, h, s, hd) view into bmm's batch dimension
# without copying it, so rope's q (laid out as the projection's (s, h, hd)), repeat_kv's view of one
# k/v head and Phi-3's v (a slice of the fused output) are read in place and saved as they are. The
# estimate counted the batch-3 copies there (at 1 x 63 tokens): one k/v head +2.1% to +3.9% forward (fp32),
# +1.7% to +3.0% (bf16-pure); Phi-3 with as many k/v heads as heads -1.1% to -3.9% (its whole fused output
# kept by the save of v).
BATCH_ONE = [("llama", (84, 7, 1, 2), "fp32", 0, "none"),
             ("gemma", (84, 7, 1, 2), "bf16-pure", 4, "full"),
             ("qwen2", (84, 7, 1, 2), "bf16", 4, "none"),
             ("phi3", (84, 7, 7, 2), "fp32", 4, "none"),
             ("phi3", (84, 7, 7, 2), "bf16", 0, "none"),
             ("mistral", (84, 6, 2, 2), "fp32", 0, "none")]
BATCH_ONE_DEFAULT = {0, 3}


def _batch_one_params():
    return _params(BATCH_ONE, BATCH_ONE_DEFAULT, lambda fam, size, prec, lora, ck:
                   f"{fam}-h{size[0]}-{size[1]}q{size[2]}kv-L{size[3]}-{prec}" + (f"-lora{lora}" if lora else "")
                   + f"-ckpt_{ck}")


@pytest.mark.parametrize("case", _batch_one_params())
def test_eager_attention_at_batch_one_within_one_percent_of_the_trace(case, folders, tmp_path_factory):
    from memtrain.analysis.estimate.hf import analytic_estimate
    from memtrain.analysis.trace import trace_step

    fam, size, prec, lora, ck = case
    d = _folder(folders, tmp_path_factory.getbasetemp(), fam, size)
    cfg = build_config({"model": str(d), "batch_size": 1, "seq_len": 40, "device": "cpu", "precision": prec,
                        "attention": "math", "checkpointing": ck, **({"lora_rank": lora} if lora else {})})
    est = analytic_estimate(cfg, "cpu")
    assert est is not None
    _each_phase_within_one_percent(est.phase_peaks, trace_step(cfg, "cpu")["phase_peaks"])


# Named targets with attention_dropout and SDPA (on the CPU, its math path): in the first layer only
# what an adapter feeds requires a gradient, so the math path's matmuls keep one operand for the
# other's gradient and nothing before the scores when neither q nor k requires one. The estimate
# kept every save there: v_proj alone +33% backward (batch 3 x 97 tokens, one layer, fp32,
# checkpointed), k_proj and up_proj +15%, q_proj (three layers, bf16-pure) +8%.
ATTENTION_DROPOUT_TARGETS = [("llama", (52, 2, 2, 1), "fp32", "v_proj", "full"),
                             ("llama", (52, 2, 1, 1), "fp32", "k_proj,up_proj", "full"),
                             ("qwen2", (72, 6, 2, 3), "bf16-pure", "q_proj", "none")]


@pytest.mark.parametrize("case", ATTENTION_DROPOUT_TARGETS, ids=lambda c: f"{c[0]}-{c[1][2]}kv-{c[2]}-{c[3]}-ckpt_{c[4]}")
def test_attention_dropout_with_named_targets_within_one_percent_of_the_trace(case, folders, tmp_path_factory):
    from memtrain.analysis.estimate.hf import analytic_estimate
    from memtrain.analysis.trace import trace_step

    fam, size, prec, targets, ck = case
    d = _folder(folders, tmp_path_factory.getbasetemp(), fam, size, f"{fam}-attention_dropout", {"attention_dropout": 0.1})
    cfg = build_config({"model": str(d), "batch_size": 3, "seq_len": 97, "device": "cpu", "precision": prec,
                        "attention": "sdpa", "checkpointing": ck, "lora_rank": 1, "lora_targets": targets})
    est = analytic_estimate(cfg, "cpu")
    assert est is not None
    _each_phase_within_one_percent(est.phase_peaks, trace_step(cfg, "cpu")["phase_peaks"])


# Batch 1 with attention_dropout and SDPA (its math path on the CPU): v folds into bmm's batch
# dimension as it is, and the save keeps v's own storage; the estimate kept the whole q/k/v output
# as GPT-2's fused one is kept (rope's q and k besides v): +2.1% forward (fp32, 2 layers, as many k/v
# heads as heads), +4.3% backward with q_proj alone as LoRA target. The path's scaled q and k, and
# under bf16-pure a Llama-style v's float32 copy, are read in place too and saved as they are: a
# checkpointed layer's recompute under LoRA counted their copies beside them (+3.8%, +1.9% with
# grouped k/v heads).
SDPA_DROPOUT_BATCH_ONE = [("llama", (72, 6, 6, 2), "fp32", 0, "", "none"),
                          ("qwen2", (52, 2, 2, 1), "fp32", 1, "q_proj", "full"),
                          ("llama", (72, 6, 6, 2), "bf16-pure", 4, "", "full"),
                          ("mistral", (72, 6, 2, 2), "bf16-pure", 4, "", "full")]


@pytest.mark.parametrize("case", SDPA_DROPOUT_BATCH_ONE, ids=lambda c: f"{c[0]}-{c[2]}-lora{c[3]}{c[4]}-ckpt_{c[5]}")
def test_sdpa_dropout_at_batch_one_within_one_percent_of_the_trace(case, folders, tmp_path_factory):
    from memtrain.analysis.estimate.hf import analytic_estimate
    from memtrain.analysis.trace import trace_step

    fam, size, prec, lora, targets, ck = case
    d = _folder(folders, tmp_path_factory.getbasetemp(), fam, size, f"{fam}-attention_dropout", {"attention_dropout": 0.1})
    cfg = build_config({"model": str(d), "batch_size": 1, "seq_len": 63, "device": "cpu", "precision": prec,
                        "attention": "sdpa", "checkpointing": ck,
                        **({"lora_rank": lora} if lora else {}), **({"lora_targets": targets} if targets else {})})
    est = analytic_estimate(cfg, "cpu")
    assert est is not None
    _each_phase_within_one_percent(est.phase_peaks, trace_step(cfg, "cpu")["phase_peaks"])


# Gradient accumulation with the chunked loss: every .grad exists from the first micro-batch on,
# and the loss's backward frees before it allocates, so the backward's peak is where it starts,
# with all the forward left (loss.backward() allocates the loss's gradient first). The estimate
# counted the backward's live total from its first allocation on: -1.8% to -2.5% backward. Under
# bf16-pure the float32 grad_w is cast to the weight's dtype before it is added into .grad: a
# new tensor, left out before (-2.7% backward).
GRAD_ACCUM_CHUNKED = [("qwen2", (90, 5, 1, 2), "fp16", "sdpa", "every:3", 1, 9),
                      ("llama", (90, 5, 1, 2), "fp32", "math", "none", 3, 9),
                      ("llama", (96, 4, 2, 2), "bf16-pure", "sdpa", "none", 2, 31)]


@pytest.mark.parametrize("case", GRAD_ACCUM_CHUNKED, ids=lambda c: f"{c[0]}-{c[2]}-{c[3]}-ckpt_{c[4]}-b{c[5]}")
def test_grad_accum_with_the_chunked_loss_within_one_percent_of_the_trace(case, folders, tmp_path_factory):
    from memtrain.analysis.estimate.hf import analytic_estimate
    from memtrain.analysis.trace import trace_step

    fam, size, prec, attn, ck, batch, seq = case
    d = _folder(folders, tmp_path_factory.getbasetemp(), fam, size)
    cfg = build_config({"model": str(d), "batch_size": batch, "seq_len": seq, "device": "cpu", "precision": prec,
                        "attention": attn, "checkpointing": ck, "grad_accum": 2, "loss": "chunked"})
    est = analytic_estimate(cfg, "cpu")
    assert est is not None
    _each_phase_within_one_percent(est.phase_peaks, trace_step(cfg, "cpu")["phase_peaks"])


# GPT-2 with one checkpointed layer under bf16 autocast, eager attention and the chunked loss: the
# backward peaks at the recompute's end, inside GPT2MLP's closing dropout. GPT2Block keeps ln_2's
# output (its ``hidden_states``) until ``residual + feed_forward_hidden_states``, and the CPU
# dropout draws its noise before the product that saves it, where the lazy recompute stops (the
# product never made). The estimate freed ln_2's output after c_proj and made the product: -1.6%,
# -1.4% and -1.8% backward.
GPT2_RECOMPUTE_END = [((48, 4, 4, 1), 100, 120, 5, "every:2"), ((40, 4, 4, 2), 88, 97, 5, "every:2"),
                      ((56, 4, 4, 1), 116, 130, 7, "full")]


@pytest.mark.parametrize("case", GPT2_RECOMPUTE_END, ids=lambda c: f"h{c[0][0]}-L{c[0][3]}-b{c[3]}-ckpt_{c[4]}")
def test_gpt2_recompute_end_within_one_percent_of_the_trace(case, folders, tmp_path_factory):
    from memtrain.analysis.estimate.hf import analytic_estimate
    from memtrain.analysis.trace import trace_step

    size, ff, vocab, batch, ck = case
    d = _folder(folders, tmp_path_factory.getbasetemp(), "gpt2", size, f"gpt2-ff{ff}-v{vocab}",
                {"intermediate_size": ff, "vocab_size": vocab})
    cfg = build_config({"model": str(d), "batch_size": batch, "seq_len": 33, "device": "cpu", "precision": "bf16",
                        "attention": "math", "checkpointing": ck, "loss": "chunked", "loss_chunk": 50})
    est = analytic_estimate(cfg, "cpu")
    assert est is not None
    _each_phase_within_one_percent(est.phase_peaks, trace_step(cfg, "cpu")["phase_peaks"])


# One layer whose LoRA targets leave q and k frozen (v_proj alone; the first layer reads the frozen
# embedding): rope's products on q and k record nothing, so the cos and sin tables are saved by
# no op and go when the model returns, before the loss. The estimate kept them saved (v, which
# rope passes on, requires a gradient): +2.1% backward at batch 1 x 97 whatever the attention
# dropout, SDPA or eager.
ROPE_UNSAVED = [("llama", (52, 2, 2, 1), "fp32", "sdpa", 0.1), ("qwen2", (52, 2, 1, 1), "bf16", "math", 0.0),
                ("mistral", (52, 2, 2, 1), "bf16-pure", "sdpa", 0.1)]


@pytest.mark.parametrize("case", ROPE_UNSAVED, ids=lambda c: f"{c[0]}-{c[1][2]}kv-{c[2]}-{c[3]}-dropout{c[4]}")
def test_v_proj_alone_saves_no_rope_tables(case, folders, tmp_path_factory):
    from memtrain.analysis.estimate.hf import analytic_estimate
    from memtrain.analysis.trace import trace_step

    fam, size, prec, attn, p = case
    d = _folder(folders, tmp_path_factory.getbasetemp(), fam, size, f"{fam}-attention_dropout{p}",
                {"attention_dropout": p})
    cfg = build_config({"model": str(d), "batch_size": 1, "seq_len": 97, "device": "cpu", "precision": prec,
                        "attention": attn, "checkpointing": "none", "lora_rank": 1, "lora_targets": "v_proj"})
    est = analytic_estimate(cfg, "cpu")
    assert est is not None
    _each_phase_within_one_percent(est.phase_peaks, trace_step(cfg, "cpu")["phase_peaks"])


# One position or one head: ``o.transpose(1, 2).contiguous()`` returns the attention's output as
# it is (torch ignores the strides of size-1 dimensions), so Phi-3's SDPA output (the one family
# whose merge copies after SDPA) and eager attention's are the projection's input themselves. The
# estimate counted a copy per layer: Phi-3 at one token +1.8% (one layer) and +2.0% (three) backward.
ONE_POSITION = [("phi3", {"hidden_size": 48, "intermediate_size": 100, "num_hidden_layers": 1, "num_attention_heads": 4,
                          "num_key_value_heads": 1, "vocab_size": 33},
                 {"batch_size": 16, "seq_len": 1, "precision": "fp32", "attention": "sdpa", "checkpointing": "none",
                  "loss": "chunked", "loss_chunk": 50, "lora_rank": 1}),
                ("phi3", {"hidden_size": 48, "intermediate_size": 100, "num_hidden_layers": 3, "num_attention_heads": 4,
                          "num_key_value_heads": 1, "vocab_size": 33},
                 {"batch_size": 16, "seq_len": 1, "precision": "fp32", "attention": "sdpa", "checkpointing": "none",
                  "loss": "chunked", "loss_chunk": 50, "lora_rank": 1})]

# Axes the grids above do not hold, from a random sweep of 120 odd configurations (2 of them over
# 1% before the fixes they name: ONE_POSITION, tests/test_estimate_token_ids.py): fp16 and
# bf16-pure, gradient accumulation over 2-3 micro-batches (every earlier micro-batch's token ids),
# LoRA with the chunked loss (chunks of 7 and 50 rows), 1-3 tokens, batches of 7-16, vocabularies
# of 17-64, tied and untied heads (tie_word_embeddings). (LoRA on lm_head is not modelled: traced.)
SWEPT = [
    ('phi3', {'hidden_size': 48, 'intermediate_size': 104, 'num_hidden_layers': 3, 'num_attention_heads': 4, 'num_key_value_heads': 1, 'vocab_size': 64, 'tie_word_embeddings': True},
     {'batch_size': 12, 'seq_len': 17, 'precision': 'bf16-pure', 'attention': 'math', 'checkpointing': 'sqrt', 'loss': 'chunked', 'grad_accum': 2, 'loss_chunk': 50, 'lora_rank': 4}),
    ('gpt2', {'n_embd': 126, 'n_inner': 136, 'n_layer': 2, 'n_head': 7, 'vocab_size': 64, 'tie_word_embeddings': False},
     {'batch_size': 9, 'seq_len': 17, 'precision': 'fp16', 'attention': 'sdpa', 'checkpointing': 'every:2', 'loss': 'chunked', 'grad_accum': 3, 'loss_chunk': 7, 'lora_rank': 1}),
    ('mistral', {'hidden_size': 154, 'intermediate_size': 136, 'num_hidden_layers': 1, 'num_attention_heads': 7, 'num_key_value_heads': 7, 'vocab_size': 17},
     {'batch_size': 9, 'seq_len': 3, 'precision': 'fp16', 'attention': 'sdpa', 'checkpointing': 'full', 'loss': 'chunked', 'grad_accum': 3, 'loss_chunk': 50, 'lora_rank': 4}),
    ('llama', {'hidden_size': 48, 'intermediate_size': 140, 'num_hidden_layers': 2, 'num_attention_heads': 4, 'num_key_value_heads': 4, 'vocab_size': 33, 'tie_word_embeddings': True},
     {'batch_size': 12, 'seq_len': 1, 'precision': 'fp16', 'attention': 'math', 'checkpointing': 'sqrt', 'loss': 'standard', 'grad_accum': 2, 'lora_rank': 4}),
    ('gemma', {'hidden_size': 80, 'intermediate_size': 136, 'num_hidden_layers': 2, 'num_attention_heads': 5, 'num_key_value_heads': 1, 'vocab_size': 33, 'head_dim': 16},
     {'batch_size': 12, 'seq_len': 2, 'precision': 'fp16', 'attention': 'math', 'checkpointing': 'every:2', 'loss': 'standard', 'grad_accum': 2, 'lora_rank': 1}),
    ('gemma', {'hidden_size': 48, 'intermediate_size': 140, 'num_hidden_layers': 1, 'num_attention_heads': 3, 'num_key_value_heads': 1, 'vocab_size': 33, 'head_dim': 16},
     {'batch_size': 9, 'seq_len': 2, 'precision': 'bf16', 'attention': 'math', 'checkpointing': 'full', 'loss': 'chunked', 'grad_accum': 2, 'loss_chunk': 50, 'lora_rank': 4}),
    ('gpt2', {'n_embd': 84, 'n_inner': 136, 'n_layer': 2, 'n_head': 6, 'vocab_size': 17, 'tie_word_embeddings': False},
     {'batch_size': 12, 'seq_len': 1, 'precision': 'bf16', 'attention': 'math', 'checkpointing': 'every:2', 'loss': 'chunked', 'grad_accum': 1, 'loss_chunk': 7, 'lora_rank': 4}),
    ('phi3', {'hidden_size': 56, 'intermediate_size': 136, 'num_hidden_layers': 2, 'num_attention_heads': 4, 'num_key_value_heads': 4, 'vocab_size': 33, 'tie_word_embeddings': True},
     {'batch_size': 16, 'seq_len': 1, 'precision': 'bf16', 'attention': 'sdpa', 'checkpointing': 'sqrt', 'loss': 'standard', 'grad_accum': 3, 'lora_rank': 32}),
    ('qwen2', {'hidden_size': 56, 'intermediate_size': 120, 'num_hidden_layers': 3, 'num_attention_heads': 4, 'num_key_value_heads': 4, 'vocab_size': 130},
     {'batch_size': 9, 'seq_len': 2, 'precision': 'fp16', 'attention': 'math', 'checkpointing': 'none', 'loss': 'chunked', 'grad_accum': 3, 'loss_chunk': 7, 'lora_rank': 1}),
    ('llama', {'hidden_size': 48, 'intermediate_size': 100, 'num_hidden_layers': 1, 'num_attention_heads': 2, 'num_key_value_heads': 2, 'vocab_size': 257, 'tie_word_embeddings': True},
     {'batch_size': 9, 'seq_len': 1, 'precision': 'bf16', 'attention': 'sdpa', 'checkpointing': 'full', 'loss': 'chunked', 'grad_accum': 3, 'loss_chunk': 50, 'lora_rank': 4}),
    ('gpt2', {'n_embd': 60, 'n_inner': 100, 'n_layer': 3, 'n_head': 5, 'vocab_size': 17, 'tie_word_embeddings': False},
     {'batch_size': 3, 'seq_len': 1, 'precision': 'bf16-pure', 'attention': 'math', 'checkpointing': 'none', 'loss': 'standard', 'grad_accum': 2, 'lora_rank': 32}),
    ('gpt2', {'n_embd': 60, 'n_inner': 100, 'n_layer': 3, 'n_head': 5, 'vocab_size': 17, 'tie_word_embeddings': False},
     {'batch_size': 12, 'seq_len': 17, 'precision': 'fp32', 'attention': 'sdpa', 'checkpointing': 'sqrt', 'loss': 'standard', 'grad_accum': 2}),
    ('qwen2', {'hidden_size': 132, 'intermediate_size': 100, 'num_hidden_layers': 2, 'num_attention_heads': 6, 'num_key_value_heads': 2, 'vocab_size': 130},
     {'batch_size': 7, 'seq_len': 3, 'precision': 'bf16-pure', 'attention': 'sdpa', 'checkpointing': 'sqrt', 'loss': 'standard', 'grad_accum': 3}),
    ('mistral', {'hidden_size': 48, 'intermediate_size': 140, 'num_hidden_layers': 2, 'num_attention_heads': 2, 'num_key_value_heads': 1, 'vocab_size': 64},
     {'batch_size': 2, 'seq_len': 1, 'precision': 'bf16-pure', 'attention': 'sdpa', 'checkpointing': 'full', 'loss': 'chunked', 'grad_accum': 1, 'loss_chunk': 7, 'lora_rank': 4}),
    ('qwen2', {'hidden_size': 66, 'intermediate_size': 136, 'num_hidden_layers': 1, 'num_attention_heads': 3, 'num_key_value_heads': 3, 'vocab_size': 17, 'tie_word_embeddings': True},
     {'batch_size': 2, 'seq_len': 40, 'precision': 'bf16', 'attention': 'sdpa', 'checkpointing': 'full', 'loss': 'chunked', 'grad_accum': 3, 'loss_chunk': 50, 'lora_rank': 32}),
    ('qwen2', {'hidden_size': 50, 'intermediate_size': 108, 'num_hidden_layers': 3, 'num_attention_heads': 5, 'num_key_value_heads': 5, 'vocab_size': 500},
     {'batch_size': 12, 'seq_len': 1, 'precision': 'fp32', 'attention': 'math', 'checkpointing': 'every:2', 'loss': 'chunked', 'grad_accum': 2, 'loss_chunk': 7, 'lora_rank': 4}),
    ('llama', {'hidden_size': 48, 'intermediate_size': 140, 'num_hidden_layers': 3, 'num_attention_heads': 2, 'num_key_value_heads': 2, 'vocab_size': 33, 'tie_word_embeddings': True},
     {'batch_size': 7, 'seq_len': 17, 'precision': 'bf16-pure', 'attention': 'math', 'checkpointing': 'full', 'loss': 'standard', 'grad_accum': 1, 'lora_rank': 1}),
    ('phi3', {'hidden_size': 50, 'intermediate_size': 136, 'num_hidden_layers': 2, 'num_attention_heads': 5, 'num_key_value_heads': 5, 'vocab_size': 33},
     {'batch_size': 7, 'seq_len': 17, 'precision': 'fp32', 'attention': 'math', 'checkpointing': 'none', 'loss': 'chunked', 'grad_accum': 2, 'loss_chunk': 7, 'lora_rank': 32}),
]
SWEPT_DEFAULT = {0, 2}
# A later sweep (seed 3003, 371 configurations: odd depths under every:K and sqrt, one head,
# windows, lora_dropout, fp16 with gradient accumulation, 1-3 tokens). Where the weights outweigh
# the activations (vocabulary 17, 2 x 3 tokens) the backward peaks at q/k/v's weight gradients:
# q_proj, k_proj and v_proj each make a 16-bit .grad in their own backward, cast to float32 and
# gone before the next one's; the estimate made them as one fused entry, the three 16-bit
# gradients at once: +1.35% backward (Llama, fp16), +1.66% (Qwen2, bf16 autocast, SDPA).
SWEPT_AGAIN = [
    ('llama', {'hidden_size': 30, 'intermediate_size': 90, 'num_hidden_layers': 1, 'num_attention_heads': 5, 'num_key_value_heads': 5, 'vocab_size': 17, 'tie_word_embeddings': True},
     {'batch_size': 2, 'seq_len': 3, 'precision': 'fp16', 'attention': 'math', 'checkpointing': 'every:3', 'loss': 'standard', 'grad_accum': 1}),
    ('qwen2', {'hidden_size': 30, 'intermediate_size': 90, 'num_hidden_layers': 1, 'num_attention_heads': 5, 'num_key_value_heads': 5, 'vocab_size': 17, 'tie_word_embeddings': True},
     {'batch_size': 2, 'seq_len': 3, 'precision': 'bf16', 'attention': 'sdpa', 'checkpointing': 'none', 'loss': 'standard', 'grad_accum': 1}),
]
# One head (the same sweep): the (b, 1, s, hd) views fold into bmm's batch dimension as at batch 1,
# so Phi-3's v, a slice of the fused q/k/v output, is read in place and its save keeps that
# output whole; the estimate counted a contiguous copy of v: -1.72% backward (attention dropout,
# bf16 autocast, full checkpointing) and -3.55% (window 5, LoRA on gate_up_proj with lora_dropout).
ONE_HEAD = [
    ('phi3', {'hidden_size': 6, 'intermediate_size': 18, 'num_hidden_layers': 5, 'num_attention_heads': 1, 'num_key_value_heads': 1, 'vocab_size': 17, 'tie_word_embeddings': False, 'attention_dropout': 0.1},
     {'batch_size': 5, 'seq_len': 40, 'precision': 'bf16', 'attention': 'math', 'checkpointing': 'full', 'loss': 'chunked', 'grad_accum': 1, 'loss_chunk': 50}),
    ('phi3', {'hidden_size': 8, 'intermediate_size': 24, 'num_hidden_layers': 3, 'num_attention_heads': 1, 'num_key_value_heads': 1, 'vocab_size': 301, 'tie_word_embeddings': True, 'sliding_window': 5},
     {'batch_size': 5, 'seq_len': 9, 'precision': 'bf16', 'attention': 'math', 'checkpointing': 'sqrt', 'loss': 'chunked', 'grad_accum': 1, 'loss_chunk': 50, 'lora_rank': 4, 'lora_targets': 'gate_up_proj', 'lora_dropout': 0.1}),
]
# Phi-3's rope ends in a cat, so q and k are contiguous (b, h, s, hd): SDPA's math path (attention
# dropout on the CPU) reads its scaled q and its scaled k^T (a transposed view) in place; the
# estimate counted contiguous copies of both: +3.4% forward (fp16, LoRA, 5 x 23 tokens; seed 4004).
PHI3_CONTIGUOUS_QK = [
    ('phi3', {'hidden_size': 16, 'intermediate_size': 18, 'num_hidden_layers': 1, 'num_attention_heads': 2, 'num_key_value_heads': 2, 'vocab_size': 97, 'tie_word_embeddings': False, 'attention_dropout': 0.1, 'resid_pdrop': 0.0, 'embd_pdrop': 0.0},
     {'batch_size': 5, 'seq_len': 23, 'precision': 'fp16', 'attention': 'sdpa', 'checkpointing': 'none', 'loss': 'chunked', 'grad_accum': 1, 'loss_chunk': 7, 'lora_rank': 4}),
    ('phi3', {'hidden_size': 16, 'intermediate_size': 18, 'num_hidden_layers': 1, 'num_attention_heads': 2, 'num_key_value_heads': 2, 'vocab_size': 97, 'tie_word_embeddings': False, 'attention_dropout': 0.1, 'resid_pdrop': 0.0, 'embd_pdrop': 0.0},
     {'batch_size': 5, 'seq_len': 23, 'precision': 'bf16', 'attention': 'sdpa', 'checkpointing': 'none', 'loss': 'chunked', 'grad_accum': 1, 'loss_chunk': 7}),
]
# SDPA's math path (attention dropout on the CPU) in float32 with one head: Phi-3's v, a slice of the
# fused q/k/v output, folds into bmm's batch dimension, so the second matmul reads it in place and its
# save keeps the whole fused output (648 B here), where the estimate counted a copy of v (216 B):
# -1.80% forward, -1.46% backward (the seed-7272 sweep's case, rebuilt: 3 x 9 tokens, LoRA dropout).
PHI3_SDPA_V_IN_PLACE = [
    ('phi3', {'hidden_size': 2, 'intermediate_size': 4, 'num_hidden_layers': 1, 'num_attention_heads': 1, 'num_key_value_heads': 1, 'vocab_size': 61, 'attention_dropout': 0.1},
     {'batch_size': 3, 'seq_len': 9, 'precision': 'fp32', 'attention': 'sdpa', 'checkpointing': 'none', 'loss': 'standard', 'lora_rank': 2, 'lora_dropout': 0.1}),
]
# The same contiguous q and k under eager attention (a random sweep of checkpointing variants, seed
# 8181): q @ k^T reads them in place at any batch and head count; the estimate counted copies of both
# (2 x 5,120 B a layer): +5.65% backward (every:2 over one layer, LoRA with dropout, 4 x 5 tokens).
PHI3_EAGER_QK = [
    ('phi3', {'hidden_size': 64, 'intermediate_size': 3, 'num_hidden_layers': 1, 'num_attention_heads': 4, 'num_key_value_heads': 4, 'vocab_size': 17, 'tie_word_embeddings': True},
     {'batch_size': 4, 'seq_len': 5, 'precision': 'fp32', 'attention': 'math', 'checkpointing': 'every:2', 'loss': 'standard', 'grad_accum': 2, 'lora_rank': 2, 'lora_dropout': 0.1}),
    ('phi3', {'hidden_size': 64, 'intermediate_size': 3, 'num_hidden_layers': 2, 'num_attention_heads': 4, 'num_key_value_heads': 4, 'vocab_size': 17},
     {'batch_size': 4, 'seq_len': 5, 'precision': 'fp32', 'attention': 'math', 'checkpointing': 'none', 'loss': 'standard', 'lora_rank': 2}),
]
# The same contiguous q with grouped k/v heads: q @ k^T reads rope's q in place and saves it for k's
# gradient, and k^T is a view of repeat_kv's contiguous copy (or, with one k/v head, the matmul's
# copy of its expanded view); rope's k goes when the attention returns. The estimate counted a copy
# of q (N x d a layer): +2.13% forward (2 k/v heads of 4, LoRA, an MLP 3 wide) and +1.89% (one k/v head).
PHI3_EAGER_GQA = [
    ('phi3', {'hidden_size': 64, 'intermediate_size': 3, 'num_hidden_layers': 2, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'vocab_size': 17, 'tie_word_embeddings': True},
     {'batch_size': 4, 'seq_len': 5, 'precision': 'fp32', 'attention': 'math', 'checkpointing': 'none', 'loss': 'standard', 'lora_rank': 2}),
    ('phi3', {'hidden_size': 64, 'intermediate_size': 3, 'num_hidden_layers': 1, 'num_attention_heads': 4, 'num_key_value_heads': 1, 'vocab_size': 17, 'tie_word_embeddings': True},
     {'batch_size': 4, 'seq_len': 5, 'precision': 'fp32', 'attention': 'math', 'checkpointing': 'none', 'loss': 'standard', 'lora_rank': 2}),
]
# A sweep of 400 random configurations (seed 6161: GPT-2, Gemma, Phi-3 and our GPT; fp16, bf16-pure,
# LoRA with dropout on a subset of targets, every checkpointing mode, windows, the chunked loss,
# batch 1, 1-3 tokens) left two transformers cases outside 1%. Under autocast with LoRA dropout, peft's
# dropped float32 copy is lora_A's argument, alive until lora_A returns, beside autocast's bf16 cast
# of it and A's output; the estimate freed it after the cast: GPT-2 -1.22% forward, -1.28% backward
# (the forward's peak is there, at mlp.c_proj's lora_A), Gemma -1.97% backward.
SWEPT_DROPOUT = [
    ('gpt2', {'n_embd': 8, 'n_inner': 29, 'n_layer': 2, 'n_head': 1, 'vocab_size': 130, 'tie_word_embeddings': False},
     {'batch_size': 7, 'seq_len': 9, 'precision': 'bf16', 'attention': 'math', 'checkpointing': 'every:3', 'loss': 'chunked', 'grad_accum': 2, 'loss_chunk': 5, 'lora_rank': 8, 'lora_dropout': 0.1, 'lora_targets': 'c_attn,c_proj'}),
]
# The same sweep's Gemma at width 4 (head_dim 2, d_ff 3), fully checkpointed under fp16 autocast with
# LoRA dropout on every Linear: the forward's peak is o_proj's lora_A. value_states is the attention's
# local until it returns, after o_proj, while SDPA's autocast casts of q and k go when SDPA returns;
# the estimate freed v with the casts (nothing is saved in a checkpointed forward), and cast
# lora_B's weight before lora_A's product: -3.15% (396 B) forward, now -0.16% (20 B: the scalars
# and rotary buffers the estimate leaves out).
SWEPT_V_LOCAL = [
    ('gemma', {'hidden_size': 4, 'intermediate_size': 3, 'num_hidden_layers': 1, 'num_attention_heads': 2, 'num_key_value_heads': 2, 'vocab_size': 61, 'tie_word_embeddings': False, 'head_dim': 2},
     {'batch_size': 3, 'seq_len': 17, 'precision': 'fp16', 'attention': 'sdpa', 'checkpointing': 'full', 'loss': 'chunked', 'grad_accum': 1, 'loss_chunk': 1, 'lora_rank': 4, 'lora_dropout': 0.1, 'lora_targets': 'down_proj,gate_proj,k_proj,o_proj,q_proj,up_proj,v_proj'}),
]
# A sweep of 260 random configurations (seed 5151: every family, --mode inference, QLoRA, fp16, the
# low-bit and other optimizers, gradient accumulation, batch 1, 1-3 tokens, widths 2-96) left these
# training cases outside 1% (forward, backward, or the optimizer step where no torchao step made
# the trace an upper bound):
# - Qwen2, one head over 5 x 40 tokens, eager attention in a checkpointed layer: the views of rope's
#   v fold into bmm's batch, so the probabilities' matmul saves v itself, which its backward frees
#   before the scores' backward (the softmax's backward the peak); one storage with q and k, v
#   stayed: +3.03% backward.
# - GPT-2 under LoRA on c_fc and c_proj, eager attention, 2 x 2 tokens: c_attn's output, whose views
#   q, k and v are GPT2Attention.forward's locals, lives through c_proj (the forward's peak); the
#   estimate freed it at v's copy: -1.61% forward.
# - Llama at width 6 with 42 LoRA tensors (QLoRA, fp16, SGD): clip_grad_norm_'s per-tensor norms and
#   their stack were the optimizer step's peak, left out: -2.06% optimizer.
SWEPT_5151 = [
    ('qwen2', {'hidden_size': 12, 'intermediate_size': 3, 'num_hidden_layers': 1, 'num_attention_heads': 1, 'num_key_value_heads': 1, 'vocab_size': 257, 'tie_word_embeddings': False, 'use_sliding_window': True, 'sliding_window': 8, 'max_window_layers': 0},
     {'batch_size': 5, 'seq_len': 40, 'precision': 'fp32', 'attention': 'math', 'checkpointing': 'full', 'loss': 'chunked', 'grad_accum': 2, 'loss_chunk': 7}),
    ('gpt2', {'n_embd': 36, 'n_inner': 3, 'n_layer': 1, 'n_head': 6, 'vocab_size': 61, 'tie_word_embeddings': False},
     {'batch_size': 2, 'seq_len': 2, 'precision': 'fp32', 'attention': 'math', 'checkpointing': 'sqrt', 'loss': 'chunked', 'grad_accum': 1, 'loss_chunk': 5, 'lora_rank': 2, 'lora_targets': 'c_fc,c_proj'}),
    ('llama', {'hidden_size': 6, 'intermediate_size': 20, 'num_hidden_layers': 3, 'num_attention_heads': 1, 'num_key_value_heads': 1, 'vocab_size': 131, 'tie_word_embeddings': True},
     {'batch_size': 2, 'seq_len': 3, 'precision': 'fp16', 'attention': 'math', 'checkpointing': 'sqrt', 'loss': 'standard', 'grad_accum': 2, 'lora_rank': 1, 'qlora': True, 'optim': 'sgd'}),
]
# The eager chunked loss's per-row tensors (memtrain.techniques.loss._chunk_step): its log-sum-exp,
# per-token loss and second valid mask are locals alive until the chunk returns, beside the float32
# logit gradient and its low-precision cast, where the forward peaks under a 16-bit compute dtype;
# left out (9 bytes a row), these forward peaks were under the trace (sweeps of checkpointing
# variants, seeds 8181 and 8282): a bf16-pure Gemma over 2 x 24 tokens -1.01% (546 B of 54,184 B),
# a one-head Phi-3 of width 2 under bf16 autocast with eager attention -1.09% (466 B of 42,724 B).
CHUNK_ROW_STATS = [
    ('gemma', {'hidden_size': 16, 'intermediate_size': 8, 'num_hidden_layers': 1, 'num_attention_heads': 4, 'num_key_value_heads': 4, 'vocab_size': 61, 'tie_word_embeddings': True, 'head_dim': 4},
     {'batch_size': 2, 'seq_len': 24, 'precision': 'bf16-pure', 'attention': 'sdpa', 'checkpointing': 'sqrt', 'loss': 'chunked', 'grad_accum': 3, 'loss_chunk': 50}),
    ('phi3', {'hidden_size': 2, 'intermediate_size': 12, 'num_hidden_layers': 2, 'num_attention_heads': 1, 'num_key_value_heads': 1, 'vocab_size': 17, 'tie_word_embeddings': True},
     {'batch_size': 5, 'seq_len': 17, 'precision': 'bf16', 'attention': 'math', 'checkpointing': 'every:2', 'loss': 'chunked', 'grad_accum': 1, 'loss_chunk': 50}),
]
# Gemma's norm multiplies by ``1 + w.float()``, a float32 (d,) tensor the product saves for the
# input's gradient: left out (96 B a norm here, five norms kept), a bf16-pure Gemma under LoRA over
# 4 x 2 tokens with the chunked loss was -1.03% forward (50,751 B of 51,281 B, after the chunked
# loss's per-row tensors above; -1.12% before them).
GEMMA_ONE_PLUS_W = [
    ('gemma', {'hidden_size': 24, 'intermediate_size': 3, 'num_hidden_layers': 3, 'num_attention_heads': 3, 'num_key_value_heads': 1, 'vocab_size': 130, 'tie_word_embeddings': False, 'head_dim': 8},
     {'batch_size': 4, 'seq_len': 2, 'precision': 'bf16-pure', 'attention': 'sdpa', 'checkpointing': 'every:3', 'loss': 'chunked', 'grad_accum': 2, 'loss_chunk': 5, 'lora_rank': 1, 'lora_dropout': 0.1}),
]
# Swept cases still outside 1% (strict expected failures, each with its figure, as
# "-1.2% forward (A B of B B)"). None at present.
SWEPT_GAPS: list = []
SWEPT_GAP_FIGURES: tuple[str, ...] = ()
_FIXED_IDS = {"pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0}


def _swept_id(fam: str, fields: dict, tech: dict) -> str:
    h = fields.get("hidden_size", fields.get("n_embd"))
    tied = {True: "-tied", False: "-untied"}.get(fields.get("tie_word_embeddings"), "")
    return (f"{fam}-h{h}-v{fields['vocab_size']}{tied}-b{tech['batch_size']}x{tech['seq_len']}-{tech['precision']}-"
            f"{tech['attention']}-ckpt_{tech['checkpointing']}-{tech['loss']}-ga{tech.get('grad_accum', 1)}"
            + (f"-lora{tech['lora_rank']}" if tech.get("lora_rank") else ""))


def _swept_params(cases: list, default: set) -> list:
    return _params(cases, default, _swept_id)


def _swept_gaps() -> list:
    """SWEPT_GAPS as slow params expected to fail (strict), each with its measured figures."""
    return [pytest.param(c, id=_swept_id(*c), marks=[pytest.mark.slow, pytest.mark.xfail(
        reason=f"the analytic model is {fig} off the trace here (a known gap, not yet located)", strict=True)])
            for c, fig in zip(SWEPT_GAPS, SWEPT_GAP_FIGURES)]


@pytest.mark.parametrize("case", _swept_params(ONE_POSITION, {0}) + _swept_params(SWEPT, SWEPT_DEFAULT)
                         + _swept_params(SWEPT_AGAIN, {0}) + _swept_params(ONE_HEAD, {0})
                         + _swept_params(PHI3_CONTIGUOUS_QK, {0}) + _swept_params(PHI3_SDPA_V_IN_PLACE, {0})
                         + _swept_params(PHI3_EAGER_QK, {0}) + _swept_params(PHI3_EAGER_GQA, {0, 1})
                         + _swept_params(SWEPT_DROPOUT, {0})
                         + _swept_params(SWEPT_V_LOCAL, {0}) + _swept_params(SWEPT_5151, {0, 1, 2})
                         + _swept_params(CHUNK_ROW_STATS, {0, 1}) + _swept_params(GEMMA_ONE_PLUS_W, {0})
                         + _swept_gaps())
def test_swept_axes_within_one_percent_of_the_trace(case, tmp_path_factory):
    from memtrain.analysis.estimate.hf import analytic_estimate
    from memtrain.analysis.trace import trace_step

    fam, fields, tech = case
    d = tmp_path_factory.mktemp(f"swept-{fam}")
    ids = _FIXED_IDS if fam in ("phi3", "gpt2") else {}
    getattr(transformers, CONFIGS[fam])(**{("n_positions" if fam == "gpt2" else "max_position_embeddings"): 128,
                                            **ids, **fields}).save_pretrained(d)
    cfg = build_config({"model": str(d), "device": "cpu", **tech})
    est = analytic_estimate(cfg, "cpu")
    assert est is not None
    traced = trace_step(cfg, "cpu")["phase_peaks"]
    _each_phase_within_one_percent(est.phase_peaks, traced)
    assert abs(est.phase_peaks["optimizer"] / traced["optimizer"] - 1) < 0.01, (est.phase_peaks, traced)


# An MLP narrower than the width on a float32 stream, one checkpointed layer: the post-attention
# RMSNorm's backward is the peak. x32 is the residual stream itself there, so the rstd multiply's
# gradient for it is summed with the residual's (which arrived first) into one tensor before pow's
# backward: one float32 (N, d) tensor fewer than on a 16-bit stream. Counted, +2.0% (Qwen2,
# every:2, the chunked loss in a ragged last chunk of 4 rows; Llama, full) and +1.6% (Gemma) backward.
# Then the MLP's backward: gate_proj's input gradient meets up_proj's, which arrived first, and
# under a dispatch mode (the trace's, the meter's) autograd sums them out of place, after
# gate_proj's weight gradient: both gradients and their sum beside it. Counted as added in place,
# -0.7% backward (the three cases above) and -1.04% (Llama, intermediate_size 60); within 0.03% now.
NARROW_MLP = [("qwen2", {"num_key_value_heads": 2}, "every:2", "chunked"),
              ("llama", {"num_key_value_heads": 2}, "full", "standard"),
              ("gemma", {"num_key_value_heads": 6, "head_dim": 32}, "full", "chunked"),
              ("llama", {"num_key_value_heads": 2, "intermediate_size": 60}, "full", "standard")]


@pytest.mark.parametrize("case", NARROW_MLP,
                         ids=lambda c: f"{c[0]}-ff{c[1].get('intermediate_size', 100)}-ckpt_{c[2]}-{c[3]}")
def test_fp32_norm_backward_beside_a_narrow_mlp_within_one_percent_of_the_trace(case, folders, tmp_path_factory):
    from memtrain.analysis.estimate.hf import analytic_estimate
    from memtrain.analysis.trace import trace_step

    fam, fields, ck, loss = case
    d = _folder(folders, tmp_path_factory.getbasetemp(), fam, (192, 6, fields["num_key_value_heads"], 1),
                f"{fam}-narrow_mlp{fields.get('intermediate_size', '')}",
                {"intermediate_size": 100, "vocab_size": 97, "tie_word_embeddings": True, **fields})
    cfg = build_config({"model": str(d), "batch_size": 7, "seq_len": 37, "device": "cpu", "precision": "fp32",
                        "attention": "sdpa", "checkpointing": ck, "loss": loss, "loss_chunk": 5})
    est = analytic_estimate(cfg, "cpu")
    assert est is not None
    traced = trace_step(cfg, "cpu")["phase_peaks"]
    _each_phase_within_one_percent(est.phase_peaks, traced)
    # What is left is a few hundred bytes (rope's inv_freq) to 1.7 KB (Gemma): -0.03% at most.
    assert abs(est.phase_peaks["backward"] / traced["backward"] - 1) < 0.001, (est.phase_peaks, traced)


def test_heads_that_do_not_divide_the_width_are_traced_not_modelled(tmp_path):
    """Gemma's config allows a head count that does not divide hidden_size (its head_dim is its
    own): the run's shape then carries one head, by which the inventory would size q, the scores
    and o_proj (24,208 parameters of 32,912, -20% forward). Not claimed: the estimate traces."""
    from memtrain.analysis.estimate.hf import analytic_estimate, why_not_modelled

    transformers.GemmaConfig(hidden_size=136, intermediate_size=8, num_hidden_layers=2, num_attention_heads=3,
                             num_key_value_heads=1, head_dim=8, vocab_size=61,
                             max_position_embeddings=128).save_pretrained(tmp_path)
    cfg = build_config({"model": str(tmp_path), "batch_size": 3, "seq_len": 5, "device": "cpu"})
    assert "3 attention heads that do not divide hidden_size 136" in why_not_modelled(cfg)
    assert analytic_estimate(cfg, "cpu") is None


# The RMSNorm backward's high point (pow's backward) comes after rsqrt's backward has released rstd,
# the float32 (N, 1) statistic the rstd multiply and rsqrt save. Held through it, the recomputed
# norm of a width-16 Gemma (CHUNK_ROW_STATS' first case) was +0.25% over the trace's backward
# (146 B of 59,572 B: rstd's 192 B over 48 tokens, less the rotary buffers' bytes the estimate leaves
# out); the same shapes as Llama under fp32 and bf16 autocast.
NORM_RSTD_RELEASED = [
    CHUNK_ROW_STATS[0],
    ("llama", {k: v for k, v in CHUNK_ROW_STATS[0][1].items() if k != "head_dim"}, CHUNK_ROW_STATS[0][2]),
    ("llama", {k: v for k, v in CHUNK_ROW_STATS[0][1].items() if k != "head_dim"},
     {**CHUNK_ROW_STATS[0][2], "precision": "bf16", "attention": "math", "checkpointing": "full"}),
]


@pytest.mark.parametrize("case", NORM_RSTD_RELEASED, ids=lambda c: _swept_id(*c))
def test_the_norm_backward_peaks_after_rstd_is_released(case, tmp_path_factory):
    from memtrain.analysis.estimate.hf import analytic_estimate
    from memtrain.analysis.trace import trace_step

    fam, fields, tech = case
    d = tmp_path_factory.mktemp(f"rstd-{fam}")
    getattr(transformers, CONFIGS[fam])(max_position_embeddings=128, **fields).save_pretrained(d)
    cfg = build_config({"model": str(d), "device": "cpu", **tech})
    est = analytic_estimate(cfg, "cpu")
    assert est is not None
    traced = trace_step(cfg, "cpu")["phase_peaks"]
    # What is left is the few bytes of rotary buffers and 0-d tensors the estimate leaves out (under 100 B).
    assert abs(est.phase_peaks["backward"] - traced["backward"]) < 100, (est.phase_peaks, traced)
