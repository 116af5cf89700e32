"""FLOP and byte rules: the 6N + attention rule of thumb, the optimizer update and clipping, and\nthe step they complete (:func:`assemble_step`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, NamedTuple, Optional

from memtrain.analysis.estimate.params import param_table
from memtrain.analysis.flops.classes import ClassCount, StepCount
from memtrain.config.run import ModelConfig, RunConfig
from memtrain.models.auto_config import load_config
from memtrain.models.spec import is_gpt_preset, model_head_dim, rotary_positions
from memtrain.techniques.facts import FOREIGN_LOSS_KERNELS, OPTIMIZER_STATE_RULES, precision_facts


def attention_width(cfg: ModelConfig) -> int:
    """Width of q and of the attention's output, heads x head width: d_model, or n_heads x the
    head_dim a transformers config sets apart from d_model / n_heads (Gemma-7B: 16 x 256 = 4096
    for d_model 3072), which the attention's matmuls run at (PaLM's 12 L H Q T)."""
    return cfg.n_heads * (model_head_dim(cfg.model) or cfg.head_dim)


class RuleParams(NamedTuple):
    """The parameters of a model that the 6N rule names but no matmul multiplies: the learned
    position table (a lookup: the rule drops it), the token embedding where the LM head does not
    share it (a lookup) and the vectors, biases and norm weights (element-wise work: the
    counter's ``addmm`` formula leaves the bias add out). Counts of distinct tensors."""

    positions: int = 0
    untied_embedding: int = 0
    vectors: int = 0
    # A mixture-of-experts layer's stacked experts that a token does not meet: of E experts it
    # runs top-k, so (E - k) / E of them do no work for it (the rule drops them, as the usual
    # "active parameters" 6ND of an MoE does).
    inactive_experts: int = 0


def table_rule_params(m: ModelConfig) -> RuleParams:
    """:class:`RuleParams` of memtrain's GPT from its parameter table (the model is not built):
    one block's vectors times the depth, so O(1) in n_layers. The shape is already resolved, so
    the one-block copy drops the model's name (a named preset would otherwise keep its depth)."""
    one = param_table(replace(m, model=None, n_layers=1))
    vectors = sum(p.numel * (m.n_layers if p.block is not None else 1) for p in one if len(p.shape) < 2)
    untied = m.padded_vocab_size * m.d_model if m.untie_embeddings else 0
    return RuleParams(positions=m.max_seq_len * m.d_model, untied_embedding=untied, vectors=vectors)


def model_rule_params(model: Any) -> RuleParams:
    """:class:`RuleParams` of a built model (memtrain's GPT or a transformers model as
    :class:`memtrain.models.hf.HFCausalLM` wraps it), from its parameters: every embedding table
    but the token embedding is a position table (GPT-2's ``wpe``, OPT's ``embed_positions``;
    rotary models have none), the token embedding is a lookup unless a matmul (the tied head)
    shares its weight, and every parameter with fewer than two dimensions is a vector. Tied
    tensors count once, as ``num_parameters`` counts them."""
    # torch loads only when a built model is counted: the analytic commands import this module
    import torch.nn as nn

    lm = getattr(model, "lm", model)  # HFCausalLM holds the transformers model as ``lm``
    get_input = getattr(lm, "get_input_embeddings", None)
    token_module = get_input() if get_input is not None else getattr(model, "wte", None)
    token = getattr(token_module, "weight", None)  # None: a model without one, all tables are positions
    tables: dict[int, int] = {}  # embedding tables: id -> elements
    matmul: set[int] = set()  # tensors some other module uses (the tied head)
    vectors: dict[int, int] = {}
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            if isinstance(mod, nn.Embedding):
                tables[id(p)] = p.numel()
            else:
                matmul.add(id(p))
            if p.dim() < 2:
                vectors[id(p)] = p.numel()
    positions = sum(n for i, n in tables.items() if i != id(token) and i not in matmul)
    untied = token.numel() if token is not None and id(token) not in matmul else 0
    return RuleParams(positions=positions, untied_embedding=untied, vectors=sum(vectors.values()),
                      inactive_experts=_inactive_experts(model, getattr(lm, "config", None)))


# The config fields that count a mixture-of-experts layer's experts (Mixtral, Qwen3-MoE, DeepSeek).
EXPERT_COUNT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")


def _inactive_experts(model: Any, config: Any) -> int:
    """The stacked expert weights a token does not meet (:class:`RuleParams`): (E - k) / E of
    the 3-D ``experts`` tensors whose first dimension is the E experts, k the experts per token."""
    experts = next((v for v in (getattr(config, n, None) for n in EXPERT_COUNT_FIELDS)
                    if isinstance(v, int) and v > 1), 0)
    top_k = getattr(config, "num_experts_per_tok", None)
    if not experts or not isinstance(top_k, int) or not 0 < top_k < experts:
        return 0
    stacked = {id(p): p.numel() for name, p in model.named_parameters()
               if p.dim() >= 3 and p.shape[0] == experts and ".experts." in f".{name}."}
    return sum(stacked.values()) * (experts - top_k) // experts


def config_position_params(cfg: ModelConfig) -> int:
    """The learned position table's parameters where no built model is at hand: memtrain's GPT's
    ``max_seq_len x d_model``; none for a transformers model that rotates positions (RoPE: Llama,
    Qwen2, Mistral, Gemma, Phi-3), known from its config; else :func:`model_rule_params` of the
    model built on the meta device (no memory, no init): GPT-2's ``wpe``, OPT's table with its two
    offset rows, none for ALiBi models (BLOOM, MPT), whatever ``max_position_embeddings`` says."""
    if cfg.model is None or is_gpt_preset(cfg.model):
        return cfg.max_seq_len * cfg.d_model
    if rotary_positions(cfg.model):
        return 0
    # torch and transformers load only here: the analytic commands import this module
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_config(cfg.model), trust_remote_code=False)
    return model_rule_params(model).positions


def rule_flops_per_token(cfg: ModelConfig, seq_len: int, n_params: int, positions: Optional[int] = None) -> float:
    """Training FLOPs per token by the 6N + attention rule. ``positions``: the parameters the rule
    drops, as :func:`model_rule_params` counts them on the built model (its learned position
    table, a lookup, and a mixture-of-experts model's experts a token does not meet:
    ``RuleParams.positions + RuleParams.inactive_experts``); None: the position table by the
    config (:func:`config_position_params`)."""
    table = config_position_params(cfg) if positions is None else positions
    return 6.0 * (n_params - table) + 12.0 * cfg.n_layers * attention_width(cfg) * seq_len


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


def with_loss_kernel(cfg: RunConfig, table: dict[str, dict[str, ClassCount]],
                     counter_total: float) -> tuple[dict[str, dict[str, ClassCount]], float, list[str]]:
    """One micro-batch's table with memtrain's chunked loss in it, made the table of the library
    kernel ``--loss-kernel`` names (the kernels are Triton code: neither the CPU count nor the
    inventory can run them, so both describe memtrain's chunked loss, which runs the same three
    head matmuls: the logits and both gradients). What a kernel computes beyond them is added here,
    Cut Cross-Entropy's second pass over the logits in its backward as recompute (outside the MFU
    numerator, as checkpointing's is), and the note says what the figures leave as they are."""
    tech = cfg.technique
    kernel = FOREIGN_LOSS_KERNELS.get(tech.loss_kernel) if tech.loss == "chunked" else None
    if kernel is None:
        return table, counter_total, []
    note = (f"--loss-kernel {kernel.name}: counted as memtrain's chunked loss (the same logits and gradient "
            f"matmuls); its bytes are those of memtrain's kernel, which writes each chunk's logits out")
    if not kernel.recomputes_logits:
        return table, counter_total, [note]
    m = cfg.model
    tokens = cfg.train.batch_size * cfg.train.seq_len
    flops = 2.0 * tokens * m.d_model * m.vocab_size
    c = precision_facts(tech.precision).compute_bytes
    out = {phase: {name: ClassCount(x.counted, x.elementwise, x.bytes, x.ops) for name, x in classes.items()}
           for phase, classes in table.items()}
    # Reads the hidden states and the head again; the logits stay on-chip and are never written.
    out.setdefault("recompute", {}).setdefault("lm_head", ClassCount()).add(
        ClassCount(flops, 0.0, float((tokens + m.vocab_size) * m.d_model * c), 1))
    return out, counter_total + flops, [
        f"{note}; {kernel.title} computes the logits again in its backward: "
        f"{flops * cfg.train.grad_accum / 1e9:.2f} GFLOP a step, counted as recompute"]


def rule_terms(cfg: RunConfig, n_params: int, tokens: int, params: RuleParams) -> dict[str, float]:
    """The rule's two terms, the parameters it names (``n_params`` less the position table) and
    the attention width (:func:`attention_width`) it takes, for the side-by-side; and the
    parameters in 6N whose work is no matmul (``params``), for the reconciliation."""
    m = cfg.model
    matmul_params = n_params - params.positions - params.inactive_experts
    width = attention_width(m)
    return {
        "six_n_d": 6.0 * matmul_params * tokens,
        "attention": 12.0 * m.n_layers * width * cfg.train.seq_len * tokens,
        "rule_params": float(matmul_params),
        "attention_width": float(width),
        "position_params": float(params.positions),
        "untied_embedding_params": float(params.untied_embedding),
        "vector_params": float(params.vectors),
        "inactive_expert_params": float(params.inactive_experts),
    }


def assemble_step(cfg: RunConfig, table: dict[str, dict[str, ClassCount]], counter_total: float, n_params: int,
                  trainable: int, notes: list[str], params: RuleParams) -> StepCount:
    """One optimizer step from one micro-batch's table (forward, backward, recompute by class):
    the micro-batches of gradient accumulation (same shapes, so ``grad_accum`` times the table),
    the optimizer update and clipping (analytic), the tokens and the rule's terms (``params``: the
    counted model's parameters that do no matmul work, :class:`RuleParams`). The counted
    step (:func:`memtrain.analysis.flops.count.count_step`) and the inventory
    (:func:`memtrain.analysis.flops.inventory.inventory_step`) both end here."""
    t = cfg.train
    accum = t.grad_accum
    table, counter_total, kernel_notes = with_loss_kernel(cfg, table, counter_total)
    notes = [*notes, *kernel_notes]
    scaled: dict[str, dict[str, ClassCount]] = {}
    for phase in ("forward", "backward", "recompute"):
        scaled[phase] = {}
        for name, c in table.get(phase, {}).items():
            s = ClassCount()
            s.add(c, accum)
            scaled[phase][name] = s
    param_bytes = precision_facts(cfg.technique.precision).param_bytes
    per_param = OPTIMIZER_FLOPS_PER_PARAM.get(cfg.technique.optim, 14) + (CLIP_FLOPS_PER_PARAM if t.grad_clip > 0 else 0)
    scaled["optimizer"] = {"optimizer": ClassCount(
        0.0, float(per_param * trainable),
        float(optimizer_bytes_per_param(cfg.technique.optim, param_bytes, t.grad_clip > 0) * trainable), 1)}
    tokens = t.batch_size * t.seq_len * accum
    terms = rule_terms(cfg, n_params, tokens, params)
    return StepCount(
        table=scaled, counter_flops=counter_total * accum, tokens=tokens, n_params=n_params,
        trainable_params=trainable, rule_flops=terms["six_n_d"] + terms["attention"],
        rule_terms=terms, notes=notes,
    )
