"""One Transformer block's op inventory (our GPT's, GPT-2's and a Llama-style transformers
decoder layer's): the norms, the q/k/v, output and MLP Linears around the attention
(:mod:`.attention_nodes`), the activations, the residual adds, which tensors require a gradient
(under LoRA the first block's input does not) and what the layer's frames hold until they return."""

from __future__ import annotations

from typing import Optional

from memtrain.analysis.estimate.attention_nodes import (
    attention_nodes,
    eager_reads_v_in_place,
    float32_weights_dropped,
    resolve_backend,
)
from memtrain.analysis.estimate.basic_nodes import dropout, norm_stats
from memtrain.analysis.estimate.dims import Dims
from memtrain.analysis.estimate.hf_nodes import (
    gelu_new_nodes,
    held_locals,
    hf_norm_node,
    hf_rope_node,
    masked_kv_dtypes,
    rope_k_apart,
)
from memtrain.analysis.estimate.linear_nodes import linear, runs_nf4
from memtrain.analysis.estimate.params import has_bias, lora_adapted, lora_split
from memtrain.analysis.estimate.simulator import Node
from memtrain.config.archs import Arch
from memtrain.config.run import TechniqueConfig


def _held_by_the_frame(nodes: list[Node], dm: Dims, lora: int, *held: str) -> None:
    """Our GPT's CausalSelfAttention.forward and MLP.forward hold their argument, the norm's
    output (the first of ``held``), and their locals (the rest) until they return (their last
    op: ``nodes[-1]``). No op may save them (under LoRA a frozen norm and base, under autocast
    the Linear's cast copy, under checkpointing nothing in the forward), yet they live through
    the attention or the MLP, in the forward and in a checkpoint's recompute."""
    # Without LoRA, on CPU kernels only (the H100 measurements: attention_nodes.attention_nodes' math_attention).
    if not dm.hf and (lora or not dm.cuda):
        nodes[-1].inputs += held


def _held_by_gpt2_attention(nodes: list[Node], dm: Dims, arch: Arch, p: str) -> None:
    """GPT2Attention.forward's q, k and v are views of c_attn's output, its locals until it
    returns, after c_proj and resid_dropout (``nodes[-1]``): eager attention saves copies of them,
    not the output, which then lives on unsaved (freed at v's copy, a GPT-2 whose c_proj under
    LoRA was the forward's peak, 2 x 2 tokens, was -1.6% forward under the trace)."""
    if dm.hf and arch.gpt2_layers:
        nodes[-1].inputs += [f"{p}.qkv"]


def block_nodes(dm: Dims, i: int, arch: Arch, tech: TechniqueConfig, trainable_base: bool) -> list[Node]:
    """The op inventory of one Transformer block (model.py: x + attn(ln_1(x)); + mlp(ln_2(.)))."""
    p = f"blocks.{i}"
    N, d, f, a, r = dm.n, dm.d, dm.f, dm.a, dm.r
    lora = tech.lora_rank
    adapted = lora_adapted(arch, tech)
    x = f"{p}.in"
    nodes: list[Node] = []
    layer = arch.norm == "layernorm"

    # Under LoRA the frozen embedding's output needs no gradient: in the first layer only what
    # an adapter (or a tensor made from an adapter's output) feeds requires one, and autograd
    # records no op whose inputs all lack it (the input norm, and with named targets whatever
    # comes before the first adapted Linear).
    needs = grad_flow(arch, adapted, trainable_base or i > 0)

    def norm(name: str, src: str, out: str, src_grad: bool) -> None:
        if dm.hf and not layer:
            nodes.append(hf_norm_node(dm, name, src, out, trainable_base, src_grad, arch.norm_offset, residual=True))
            return
        # LayerNorm saves its input and float32 mean + rstd per token (RMSNorm: rstd only);
        # nothing when neither its input nor its weights need a gradient (the first block's
        # input norm under LoRA: autograd records no node).
        pg = [(f"param:{name}.weight", 0.0)] if trainable_base else []
        if trainable_base and layer and dm.bias:
            pg.append((f"param:{name}.bias", 0.0))
        recorded = src_grad or trainable_base
        stats = norm_stats(dm, layer, name)
        nodes.append(Node(name, out=[(out, N * d * r), *stats],
                           inputs=[src], saves=[src, *(k for k, _ in stats)] if recorded else [], grad_out=(out,),
                           grads=[(src, N * d * r)] + pg if recorded else []))

    def lin(short: str, name: str, src: str, out: str, n_in: int, n_out: int, src_bytes: float, src_grad: bool,
            part: Optional[str] = None) -> None:
        """The Linear(s) of a table entry; ``part``: only that one of a fused entry's Linears
        (its name suffix), writing ``out + part``; ``src_grad``: whether ``src`` requires a
        gradient."""
        split = lora_split(arch, short, n_out, d, dm.kv)
        bias = has_bias(arch, short, dm.bias)
        if part is None:
            # (All of the entry's Linears or none of them are adapted here: a transformers layer
            # with some of q, k, v or gate, up adapted runs them one by one, ``per_linear``.)
            suffixes = tuple(suffix for suffix, _ in split)
            rank = lora if adapted & {(short, suffix) for suffix in suffixes} else 0
            linear(nodes, dm, name, src, out, n_in, n_out, trainable_base, rank, src_bytes, bias=bias,
                   lora_parts=suffixes, input_grad=src_grad)
            return
        rank = lora if (short, part) in adapted else 0
        width = dict(split)[part]
        linear(nodes, dm, name + part, src, out + part, n_in, width, trainable_base, rank, src_bytes,
               bias=bias, lora_parts=(part,), input_grad=src_grad, param_name=name, param_share=width / n_out)

    # With peft's adapters a transformers layer's separate Linears (q, k, v; gate, up) are
    # simulated one after the other: each one's LoRA tail (base output, B product, its scaled
    # copy, their sum) lives while the earlier ones' outputs do, not all of them at once. (The
    # frozen base's outputs alone sum to the fused one's, which stands for them otherwise.)
    per_linear = dm.hf and bool(lora) and not (arch.fused_proj or arch.gpt2_layers)
    # (A float32 v: QLoRA's bias added after the NF4 matmul, in float32.)
    v32 = per_linear and arch.qkv_bias and runs_nf4(dm, trainable_base, d, dm.kv)
    norm(f"{p}.ln_1", x, f"{p}.ln1", needs["in"])
    # Without adapters too, each of q_proj, k_proj and v_proj makes its own .grad in its own
    # backward (a 16-bit one cast to the float32 parameter's dtype under autocast, then gone):
    # one fused entry would hold the three 16-bit gradients at once. (--precision fp8's
    # Float8Linear keys its parameters by the Linear's own name: its entries stay fused.)
    per_qkv = per_linear or (dm.hf and not dm.fp8 and not (arch.fused_proj or arch.gpt2_layers))
    # Rope's float32 q and k under autocast (and a float32 v32) are the attention's locals, apart
    # from ``{p}.qkv`` (hf_nodes.held_locals).
    rope_locals = dm.hf and arch.positional == "rope" and held_locals(dm)
    # Rope's v as a storage of its own (hf_nodes.hf_rope_node), held until o_proj has run: apart
    # from the fused SDPA kernel's casts of q and k under autocast, and from rope's q and k where
    # eager attention reads v in place (attention_nodes.eager_reads_v_in_place).
    eager_v_in_place = (dm.repeat_kv and tech.attention == "math" and not rope_locals
                        and eager_reads_v_in_place(dm))
    v_apart = (per_qkv and arch.positional == "rope" and not v32 and not dm.masked_sdpa
               and ((rope_locals and resolve_backend(tech.attention, None, dm) == "flash") or eager_v_in_place))
    if per_qkv:
        for part in (".q", ".k", ".v"):
            lin("qkv", f"{p}.attn.qkv", f"{p}.ln1", f"{p}.qkv0", d, dm.qw + 2 * dm.kv, r, needs["in"], part)
        nodes.append(hf_rope_node(dm, [f"{p}.qkv0.q", f"{p}.qkv0.k", f"{p}.qkv0.v"], f"{p}.qkv",
                                  kernel_casts=tech.attention == "math", v32=v32, v_apart=v_apart))
    else:
        rope = dm.hf and arch.positional == "rope"
        lin("qkv", f"{p}.attn.qkv", f"{p}.ln1", f"{p}.qkv0" if rope else f"{p}.qkv", d, dm.qw + 2 * dm.kv, r,
            needs["in"])
        if rope:
            nodes.append(hf_rope_node(dm, [f"{p}.qkv0"], f"{p}.qkv", v_view=arch.fused_proj,
                                      kernel_casts=tech.attention == "math",
                                      k_apart=rope_k_apart(dm, arch.fused_proj, tech.attention, rope_locals)))
    start = len(nodes)
    # A transformers layer's window is in the mask the model builds (hf_model_input_nodes), not in
    # memtrain's banded kernel: its eager attention is the unwindowed one for memory.
    window = None if dm.hf else tech.window
    v_src = f"{p}.qkv0" if arch.fused_proj else (f"{p}.qkv.v" if v_apart else None)
    attention_nodes(nodes, dm, p, tech.attention, window, v_src=v_src,
                    qkv_grad=(needs["qkv.q"], needs["qkv.k"], needs["qkv.v"]),
                    kv_bytes=masked_kv_dtypes(dm, per_linear, v32), kv_locals=(rope_locals, rope_locals and v32))
    # The attention core is what model.attn_fn computes: everything after the q/k/v split up
    # to the (b, h, s, hd) output; the merge (transpose + contiguous) is outside it.
    for n in nodes[start + 1:]:
        n.core = not n.name.endswith(".merge")
    lin("proj", f"{p}.attn.proj", f"{p}.y", f"{p}.pr", dm.qw, d, a, needs["attn"])
    if dm.hf:
        nodes[-1].inputs += _hf_attention_locals(dm, p, arch, rope_locals, tech.attention) + [f"{p}.qkv.v"] * v_apart
    dropout(nodes, dm, f"{p}.resid_drop", f"{p}.pr", f"{p}.prd", N * d, a)
    _held_by_gpt2_attention(nodes, dm, arch, p)
    # (CausalSelfAttention.forward's q, k and v, views of the qkv output, are its locals too.)
    _held_by_the_frame(nodes, dm, lora, f"{p}.ln1", f"{p}.qkv")
    # Residual add: type promotion makes it float32 under autocast; the low-precision branch's
    # gradient is then a cast copy.
    nodes.append(Node(f"{p}.add1", out=[(f"{p}.x1", N * d * r)], inputs=[x, f"{p}.prd"],
                       grads=[(x, 0.0), (f"{p}.prd", 0.0 if a == r else N * d * a)]))
    norm(f"{p}.ln_2", f"{p}.x1", f"{p}.ln2", needs["x1"])
    # LlamaMLP's gate_proj and up_proj are separate Linears, adapted or not: in a checkpointed
    # layer, which saves nothing, gate's output goes once silu has read it, before up_proj runs,
    # where one fused output would keep both until the product; and each one's .grad is made by
    # its own backward. (--precision fp8's Float8Linear keys its parameters by the Linear's own
    # name: its entries stay fused.)
    per_mlp = per_linear or (dm.hf and not dm.fp8 and not (arch.fused_proj or arch.gpt2_layers))
    if arch.mlp == "swiglu" and per_mlp:
        # LlamaMLP: down(silu(gate(x)) * up(x)): silu runs before up_proj.
        lin("fc", f"{p}.mlp.fc", f"{p}.ln2", f"{p}.h1", d, 2 * f, r, needs["x1"], ".gate")
        gate, up = f"{p}.h1.gate", f"{p}.h1.up"
        nodes.append(Node(f"{p}.silu", out=[(f"{p}.g", N * f * a)], inputs=[gate], saves=[gate],
                           grads=[(gate, N * f * a)]))
        lin("fc", f"{p}.mlp.fc", f"{p}.ln2", f"{p}.h1", d, 2 * f, r, needs["x1"], ".up")
        nodes.append(_gated_product(dm, p, up, needs))
    elif arch.mlp == "swiglu":
        lin("fc", f"{p}.mlp.fc", f"{p}.ln2", f"{p}.h1", d, 2 * f, r, needs["x1"])
        nodes += _fused_swiglu_nodes(dm, p)
    else:
        lin("fc", f"{p}.mlp.fc", f"{p}.ln2", f"{p}.h1", d, f, r, needs["x1"])
        nodes += _gelu_nodes(dm, arch, p)
    lin("fc_out", f"{p}.mlp.fc_out", f"{p}.act", f"{p}.h2", f, d, a, needs["act"])
    if dm.hf:
        nodes[-1].inputs += _hf_mlp_locals(p, arch)
    dropout(nodes, dm, f"{p}.mlp_drop", f"{p}.h2", f"{p}.h2d", N * d, a)
    _held_by_the_frame(nodes, dm, lora, f"{p}.ln2")
    nodes.append(Node(f"{p}.add2", out=[(f"blocks.{i + 1}.in", N * d * r)], inputs=[f"{p}.x1", f"{p}.h2d"],
                       grads=[(f"{p}.x1", 0.0), (f"{p}.h2d", 0.0 if a == r else N * d * a)]))
    if dm.hf:
        dropped32 = float32_weights_dropped(dm, tech.attention)  # (the weights held: the dropped ones)
        nodes[-1].inputs += _hf_layer_locals(p, arch, tech.attention, dm.autocast and not dropped32)
    else:
        # GPT.hidden_states' loop (``x = block(x)``) rebinds the block's input only after the
        # block returns (the first block under LoRA saves it nowhere).
        nodes[-1].inputs.append(x)
    record_only_what_needs_grad(nodes, set(), everything=needs["in"])
    return nodes


def _fused_swiglu_nodes(dm: Dims, p: str) -> list[Node]:
    """``silu(gate) * up`` on one fused Linear's output ``{p}.h1`` (gate and up: views of it)."""
    E = dm.n * dm.f * dm.a
    h1, g = f"{p}.h1", f"{p}.g"
    if dm.fused_proj:
        # Phi-3's gate_up_proj output is chunked into gate and up (views): the product's backward
        # makes up's gradient and silu(gate)'s, silu's backward gate's, and the chunk's backward
        # concatenates the two into the fused output's (N, 2 d_ff) gradient, which the Linear's
        # backward reads (its NF4 dequantization, under --qlora, comes while it is alive).
        gate, up = f"{h1}.gate", f"{h1}.up"
        return [Node(f"{p}.chunk", inputs=[h1], grad_out=(gate, up), grads=[(h1, 2 * E)]),
                Node(f"{p}.silu", out=[(g, E)], inputs=[h1], saves=[h1], grad_out=(g,), grads=[(gate, E)]),
                Node(f"{p}.gmul", out=[(f"{p}.act", E)], inputs=[g, h1], saves=[g], grads=[(g, E), (up, E)])]
    # silu saves gate; the product saves silu(gate) and up (views of h1).
    return [Node(f"{p}.silu", out=[(g, E)], inputs=[h1], saves=[h1], grads=[(h1, 2 * E)]),
            Node(f"{p}.gmul", out=[(f"{p}.act", E)], inputs=[g, h1], saves=[g], grads=[(g, E), (h1, E)])]


def grad_flow(arch: Arch, adapted: set[tuple[str, str]], x_grad: bool) -> dict[str, bool]:
    """Which of a block's tensors require a gradient: ``in`` (the block's input: ``x_grad``),
    ``qkv.q``/``qkv.k``/``qkv.v`` (or ``qkv`` for a fused one), ``attn`` (the attention's
    output), ``proj``, ``x1`` (the first residual sum, the MLP's input), ``fc.gate``/``fc.up``
    (or ``fc``), ``act`` and ``fc_out``. A frozen Linear's output requires one when its input
    does, an adapted Linear's always (``adapted``: :func:`lora_adapted`'s pairs); anything else
    when one of its inputs does."""
    needs = {"in": x_grad}
    qkv = [f"qkv{s}" for s, _ in lora_split(arch, "qkv", 3, 1, 1)]
    fc = [f"fc{s}" for s, _ in lora_split(arch, "fc", 2, 1, 1)]
    for key in qkv:
        needs[key] = x_grad or ("qkv", key[3:]) in adapted
    needs["attn"] = any(needs[k] for k in qkv)
    needs["proj"] = needs["attn"] or ("proj", "") in adapted
    needs["x1"] = x_grad or needs["proj"]
    for key in fc:
        needs[key] = needs["x1"] or ("fc", key[2:]) in adapted
    for part in ("q", "k", "v"):
        needs[f"qkv.{part}"] = needs.get(f"qkv.{part}", needs.get("qkv", False))
    needs["fc.gate"] = needs.get("fc.gate", needs.get("fc", False))
    needs["fc.up"] = needs.get("fc.up", needs.get("fc", False))
    needs["act"] = any(needs[k] for k in fc)
    needs["fc_out"] = needs["act"] or ("fc_out", "") in adapted
    return needs


def record_only_what_needs_grad(nodes: list[Node], requiring: set[str], everything: bool = False) -> None:
    """Drop what autograd never records: a gradient for a tensor that requires none, and every
    save of an op none of whose inputs (nor parameters) requires one. ``requiring``: the keys
    made before ``nodes`` that require a gradient. A node's outputs (and the views its
    ``grad_out`` names) require one when a gradient it makes does (a parameter's, or an input's
    that requires one). ``everything``: every op records (a block whose input requires a
    gradient): nothing to drop."""
    if everything:
        return
    needs = set(requiring)
    for n in nodes:
        n.grads = [(k, b) for k, b in n.grads if k.startswith("param:") or k in needs]
        if not n.grads:
            n.saves = []
            continue
        if n.saves_for is not None and not any(k in needs for k in n.saves_for):
            n.saves, n.scratch = [], 0.0
        needs.update(o[0] for o in n.out)
        needs.update(n.grad_out or ())


def _gated_product(dm: Dims, p: str, up: str, needs: dict[str, bool]) -> Node:
    """LlamaMLP's ``silu(gate) * up`` (``{p}.g`` times ``up``, separate Linears' outputs). The
    product saves each factor for the other's gradient: silu(gate) only when up requires one,
    up only when gate does (not so in the first layer under LoRA on named targets)."""
    E = dm.n * dm.f * dm.a
    saves = ([f"{p}.g"] if needs["fc.up"] else []) + ([up] if needs["fc.gate"] else [])
    return Node(f"{p}.gmul", out=[(f"{p}.act", E)], inputs=[f"{p}.g", up], saves=saves,
                grads=[(f"{p}.g", E), (up, E)])


def _hf_attention_locals(dm: Dims, p: str, arch: Arch, rope_locals: bool, attention: str) -> list[str]:
    """What a transformers decoder layer holds, whether or not an op saved it (checkpointed,
    nothing is saved), until o_proj has run: the input norm's output (the layer's local until
    self_attn returns) and the attention's locals, rope's q and k (and v). ``rope_locals``: rope's
    q and k are float32 apart from ``qkv`` (:func:`hf_nodes.held_locals`), which then stands for
    v alone where the attention is eager (a local as well, read through repeat_kv's copy or the
    matmul's). With SDPA's mask (``Dims.masked_sdpa``) rope's k and v (``qkv.kv``: v alone when
    k is a float32 local) are held too, which SDPA does not save (it keeps their repeated copies)."""
    held = [f"{p}.ln1"]
    if arch.positional == "rope":
        held += ([f"{p}.qkv.locals"] + [f"{p}.qkv"] * (attention == "math")) if rope_locals else [f"{p}.qkv"]
        if rope_k_apart(dm, arch.fused_proj, attention, rope_locals):
            held.append(f"{p}.qkv.k")
        if dm.masked_sdpa:
            held.append(f"{p}.qkv.kv")
    if arch.fused_proj:
        # Phi3Attention.forward keeps ``qkv`` (qkv_proj's fused output, whose slices q, k and v
        # are) as a local until it returns, after o_proj: rope's new q and k replace q and k, and
        # eager attention reads v through repeat_kv's copy (or its matmul's), so no op may keep
        # it, yet it is live through the attention, in a checkpointed layer's forward and in its
        # recompute.
        held.append(f"{p}.qkv0")
    return held


def _hf_mlp_locals(p: str, arch: Arch) -> list[str]:
    """What a transformers decoder layer holds until down_proj has run: the second norm's output
    (the layer's local until the MLP returns), and Phi3MLP.forward's ``gate``, a chunk of
    gate_up_proj's output (a view of all of it), its local until down_proj returns (``up_states``
    is rebound to the product): the fused output outlives the product, saved by silu or not."""
    return [f"{p}.ln2"] + ([f"{p}.h1"] if arch.fused_proj and arch.mlp == "swiglu" else [])


def _hf_layer_locals(p: str, arch: Arch, attention: str, autocast: bool) -> list[str]:
    """What a transformers decoder layer's frame (and its caller's) holds until the layer
    returns, whether or not an op saved it (checkpointed, nothing is saved): GPT2Block's locals;
    a Llama-style layer's eager attention weights (``hidden_states, _ = self.self_attn(...)``);
    and the layer's input, which the model's loop (``hidden_states = layer(hidden_states, ...)``)
    rebinds only after the layer returns (the first layer under LoRA saves it nowhere).
    Under autocast those weights are the float32 softmax itself: rope multiplies the bf16
    projections by the float32 tables, so the query is float32 and ``.to(query.dtype)`` keeps
    the softmax's output (the bf16 copy the second matmul reads is autocast's, freed with it)."""
    if arch.gpt2_layers:
        held = _gpt2_block_locals(p, attention)
    else:
        held = [f"{p}.pf" if autocast else f"{p}.pd"] if attention == "math" else []
    return held + [f"{p}.in"]


def _gelu_nodes(dm: Dims, arch: Arch, p: str) -> list[Node]:
    """fc's output ``h1`` -> the activation ``act``: one GELU kernel (saving its input), or
    transformers' gelu_new formula (:func:`gelu_new_nodes`)."""
    if arch.mlp == "gelu_new":
        return gelu_new_nodes(dm, f"{p}.gelu", f"{p}.h1", f"{p}.act")
    E = dm.n * dm.f * dm.a
    return [Node(f"{p}.gelu", out=[(f"{p}.act", E)], inputs=[f"{p}.h1"], saves=[f"{p}.h1"], grads=[(f"{p}.h1", E)])]


def _gpt2_block_locals(p: str, attention: str) -> list[str]:
    """What GPT2Block's locals hold until the block returns (``attn_output, _ = self.attn(...)``):
    the attention's output after resid_dropout and, eager, the attention weights it returns; and
    ln_2's output, its ``hidden_states`` until ``residual + feed_forward_hidden_states`` rebinds it,
    through the MLP's closing dropout (which a checkpointed layer's recompute reaches)."""
    return [f"{p}.prd"] + ([f"{p}.pd"] if attention == "math" else []) + [f"{p}.ln2"]
