"""The estimate's explanation lines and its activations-per-layer figure."""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from memtrain.analysis.estimate.attention_nodes import resolve_backend
from memtrain.analysis.estimate.block_nodes import block_nodes
from memtrain.analysis.estimate.dims import Dims, precision_bytes
from memtrain.analysis.estimate.params import ParamInfo, has_bias, head_widths
from memtrain.analysis.estimate.simulator import Simulator
from memtrain.config.archs import Arch
from memtrain.config.run import ModelConfig, RunConfig, TechniqueConfig
from memtrain.techniques.facts import checkpoint_policy, effective_loss_chunk


def layer_activation_bytes(cfg: RunConfig, arch: Arch, dm: Dims, trainable_base: bool,
                           policy: Optional[str] = None) -> float:
    """Bytes one block keeps for backward between its forward and its backward, block input
    included, under the checkpointing ``policy`` (default: the configured one).

    none: everything autograd saves; full: the input the checkpoint holds (not the CPU RNG state
    it stores, which no meter sees: estimate.training); selective: that plus the outputs the policy keeps; every:K and sqrt: the
    mean over the blocks (1 in K checkpointed). The same bytes the timeline keeps per block.
    """
    nodes = block_nodes(dm, 0, arch, replace(cfg.technique, checkpointing="none"), trainable_base)
    sizes = {k: v for n in nodes for k, v, *_ in n.out}
    block_input = dm.n * dm.d * dm.r
    saved = {k for n in nodes for k in n.saves if k in sizes}
    none = sum(sizes[k] for k in saved) + block_input
    ck = checkpoint_policy(policy or cfg.technique.checkpointing)
    kind = ck.kind
    if kind == "none":
        return none
    full = block_input
    if kind == "full":
        return full
    if kind == "selective-matmul":
        kept = {k for n in nodes for k in n.sac_kept() if k in sizes}
        return full + sum(sizes[k] for k in kept)
    if kind == "selective":
        # Everything outside the attention core as without checkpointing, plus the core's
        # input (the qkv output q, k and v are views of).
        outside = {k for n in nodes if not n.core for k in n.saves if k in sizes}
        return sum(sizes[k] for k in outside | {"blocks.0.qkv"}) + block_input
    L = cfg.model.n_layers
    n_ck = ck.n_checkpointed(L)
    return (n_ck * full + (L - n_ck) * none) / L


def _layers_formula(m: ModelConfig, arch: Arch) -> tuple[str, str]:
    """The decoder layers' parameter count as a formula of this architecture: grouped-query k/v
    widths and SwiGLU's three MLP matrices where the model has them (``L*(4d^2+2d*d_ff)`` is
    only our GPT's), and biases only where there are some; and the q and k/v widths where they
    differ from d."""
    q, kv = head_widths(m, arch)
    attn = "4d^2" if q == kv == m.d_model else "2d*d_q + 2d*d_kv"
    mlp = "3d*d_ff" if arch.mlp == "swiglu" else "2d*d_ff"
    model_bias = m.bias and arch.name == "gpt2"  # as block_param_table reads ModelConfig.bias
    biases = " + biases" if any(has_bias(arch, s, model_bias) for s in ("qkv", "proj", "fc", "fc_out")) else ""
    widths = "" if attn == "4d^2" else f"; d_q = {q:,}, d_kv = {kv:,}"
    return f"L*({attn} + {mlp}{biases})", widths


def explanation_lines(cfg: RunConfig, arch: Arch, dm: Dims, params: list[ParamInfo], n_params: int, n_train: int,
             weights: float, opt_bytes: float, opt_lines: list[str], act_layer: float, sim: Simulator,
             shard: str, world: int, device_type: str) -> list[str]:
    m, tech, t = cfg.model, cfg.technique, cfg.train
    pb, ab, autocast = precision_bytes(tech.precision)
    N = dm.n
    layers, widths = _layers_formula(m, arch)
    lines = [
        f"parameters = {n_params:,} (V*d{' x2 untied' if m.untie_embeddings else ' tied'} + "
        f"{'max_seq*d + ' if arch.positional == 'learned' else ''}{layers} + norms{widths}); "
        + (f"LoRA adds {n_train:,} adapter parameters, the only trainable ones" if tech.lora_rank
           else f"trainable {n_train:,}"),
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
           else "Cut Cross-Entropy: no logits stored; N x 4 B log-sum-exp kept, backward makes grad_h (N x d) and "
                f"grad_w (V x d) at {dm.a:g} B" if tech.loss_kernel == "cce"
           else f"chunk {min(effective_loss_chunk(tech.loss_chunk, device_type, cfg.model.vocab_size), N)} x V in flight + grad_h (N x d) + fp32 grad_w (V x d)"),
        *([f"--loss-on completion: + N x 8 B int64 targets made safe for the loss ({N * 8:,} B; the standard loss "
           "keeps them to its backward, the fused ones to the forward's end) + a 4 B weight kept to the backward; "
           "every micro-batch assumed to hold answer tokens"] if cfg.data.loss_on == "completion" else []),
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
                     + (", gradients/N (each block's reduce-scattered as its backward ends, the root"
                        " group's after the embedding's; with --grad-accum all unsharded until the last"
                        " micro-batch)" if shard in ("zero2", "fsdp") else "")
                     + ("; gradients in DDP's buckets, alive across steps" if shard in ("none", "ddp", "zero1") else "")
                     + ("; weight shard + all weights gathered (compute dtype) from forward to end of backward"
                        if shard == "zero2" else "")
                     + (", weights/N + one gathered block + the root group gathered for the whole step"
                        if shard == "fsdp" else ""))
    return lines


def _act_formula(dm: Dims, tech: TechniqueConfig, arch: Arch, device_type: str) -> str:
    backend = resolve_backend(tech.attention, tech.window, dm)
    a, r = dm.a, dm.r
    # The MLP's saved outputs: a gated MLP (Llama's SwiGLU, Gemma's GeGLU, ...) keeps gate's, up's,
    # act(gate)'s and their product's; GPT-2's MLP its fc output and the activation's.
    mlp = (f"4*N*d_ff*{a:g} (gate, up, act(gate), their product)" if arch.mlp == "swiglu"
           else f"2*N*d_ff*{a:g} (fc out, gelu out)")
    parts = [f"N*d*({r:g} input + {r:g} after attn + {a:g}x(ln1+q,k,v copies+attn out+ln2) ...)", mlp]
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
