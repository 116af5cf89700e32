"""The op-inventory nodes of a transformers (Llama-style) decoder layer that differ from our
GPT's: the float32 RMSNorm and the rotary embedding (read by the inventory when ``Arch.hf``;
what they model: :mod:`memtrain.analysis.estimate.hf`)."""

from __future__ import annotations

from typing import Any

from memtrain.analysis.estimate.simulator import Node

__all__ = ["CAUSAL_MASK", "FULL_MASK", "ROPE_TABLES", "gelu_new_nodes", "held_locals", "masked_kv_dtypes", "hf_model_input_nodes", "hf_model_inputs", "hf_norm_node", "hf_rope_node", "rope_k_apart"]

# Keys of what a transformers Llama-style model makes once for all its layers (hf_model_input_nodes).
ROPE_TABLES = "rope.cos_sin"
POSITIONS = "cache_position"
CAUSAL_MASK = "causal_mask"
# Qwen2's full causal mask beside its windowed one (CAUSAL_MASK then: Dims.full_mask).
FULL_MASK = "causal_mask.full"


def hf_norm_node(dm: Any, name: str, src: str, out: str, trainable: bool, input_grad: bool = True,
                 offset: bool = False, residual: bool = False) -> Any:
    """LlamaRMSNorm: ``w * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(dtype)``. Saved:
    the float32 input (``src`` itself when the stream is float32), rstd, and (for a trainable
    weight) the normalized tensor in the stream's dtype; the output is read by the projections
    (saved by them). ``input_grad``: whether ``src`` requires a gradient. ``offset``: Gemma's
    ``(normalized * (1 + w.float())).type_as(x)``: the normalized tensor the weight's gradient
    keeps is float32, the float32 ``1 + w`` the input's gradient keeps, and the float32 product is
    cast back at the end. ``residual``: ``src`` is a
    block's residual stream, whose gradient from the residual add arrives before the norm's."""
    N, d, r = dm.n, dm.d, dm.r
    # On a float32 stream x32 is ``src`` itself: the rstd multiply's gradient for it is summed with
    # the residual's, which arrived first, into one tensor before pow's backward, so the high point
    # holds one float32 (N, d) tensor fewer beside that gradient (counted, a one-layer checkpointed
    # fp32 Llama-style model with an MLP narrower than its width was +1.6% to +2.0% over the trace's
    # backward).
    high = NORM_BACKWARD_HIGH_POINT - (1 if r == 4 and residual and input_grad else 0)
    x32 = src if r == 4 else f"{name}.x32"
    outs: list[tuple] = [(out, N * d * r), (f"{name}.stats", N * 4), (f"{name}.nrm", N * d * (4 if offset else r))]
    if r != 4:
        outs.append((x32, N * d * 4))
    # The weight multiply keeps the normalized tensor only for the weight's gradient: not when
    # the norm is frozen (LoRA). The float32 input and rstd are kept only for the input's
    # gradient: not when neither the input nor the weight needs one (the first layer's norm
    # under LoRA reads the frozen embedding's output: autograd records nothing there).
    saves = ([x32, f"{name}.stats"] if (input_grad or trainable) else []) + ([f"{name}.nrm"] if trainable else [])
    if offset:
        # Gemma's ``1 + w.float()``: a float32 (d,) tensor the weight product saves for the
        # normalized tensor's gradient (as it saves that tensor for the weight's), so for as long
        # as the input needs one; left out (96 B a norm at width 24, five norms kept), a bf16-pure
        # Gemma under LoRA over 4 x 2 tokens was -1.03% under the trace's forward peak.
        outs.append((f"{name}.onep", d * 4))
        saves += [f"{name}.onep"] if input_grad else []
    return Node(name, out=outs, inputs=[src], saves=saves, grad_out=(out,),
                 grads=([(src, N * d * r)] if input_grad else []) + ([(f"param:{name}.weight", 0.0)] if trainable else []),
                 fwd_scratch=N * d * _norm_forward_above_outputs(r, offset, input_grad or trainable, trainable),
                 scratch=high * N * d * 4, releases_first=(f"{name}.nrm", f"{name}.onep", f"{name}.stats"))


def _norm_forward_above_outputs(r: float, offset: bool, x32_saved: bool, nrm_saved: bool) -> float:
    """How far (in bytes per (N, d) element) the norm's forward rises above its outputs (the
    output, the normalized tensor, the float32 input; all counted at once), op by op. ``r``: the
    stream's bytes per element; ``x32_saved``/``nrm_saved``: what autograd keeps.

    LlamaRMSNorm: ``x32 = x.to(float32)``; ``pow(2)`` beside it (then gone); ``h = x32 * rstd``
    (float32, the local ``hidden_states`` until return; x32 goes unless saved); ``h.to(dtype)``
    (a new tensor unless float32) and the weight product. Gemma: ``_norm(x.float())`` the same
    up to ``h``; ``h * (1 + w)`` in float32 (h goes unless saved), then ``type_as(x)`` (a new
    tensor unless float32) beside the float32 product."""
    x32 = 4 if r != 4 else 0  # the float32 input is a new tensor only on a 16-bit stream
    kept_x32 = x32 if x32_saved else 0
    if offset:
        cast = r if r != 4 else 0
        highs = [x32 + 4, kept_x32 + 4 + 4, kept_x32 + (4 if nrm_saved else 0) + 4 + cast]
        outputs = r + 4 + x32
    else:
        cast = r if r != 4 else 0
        highs = [x32 + 4, kept_x32 + 4 + cast + r]
        outputs = r + r + x32
    return max(0.0, max(highs) - outputs)


# The RMSNorm backward's high point, in float32 (N, d) tensors: pow's backward
# (``grad * (2 * x32.pow(1))``), where the float32 gradient of x32 from the rstd multiply is alive
# next to mean's expanded gradient (``expand / d``, materialized), ``x32.pow(1)``, ``2 * that``
# and the product. By then the weight multiply (the first node) has consumed the incoming
# gradient and released the normalized tensor it saved, rsqrt's backward (after the rstd
# multiply's, the other op that saves it) has released rstd, the float32 (N, 1) statistic (held
# through the high point, a width-16 Gemma's recomputed norm was +0.25% over the trace's backward,
# 192 B at 48 tokens), and the input's gradient is not yet made
# (the cast back is the last node; a gradient that arrived first is added to after).
NORM_BACKWARD_HIGH_POINT = 5


def hf_model_input_nodes(dm: Any, attention: str) -> list[Any]:
    """What a Llama-style ``*Model.forward`` makes once, before its first layer, and passes to
    every layer (so a checkpointed layer keeps it until its backward: ``Segment.held_inputs``):
    ``cache_position`` (int64, (s,); ``position_ids`` is a view of it), the rotary tables cos and
    sin ((1, s, head_dim) each in the embeddings' dtype, computed in float32 and cast), and, for
    eager attention, the additive float causal mask (b, 1, s, s) in the embeddings' dtype,
    ``torch.where`` over a bool (s, s) comparison. The rope products save cos and sin in every
    layer; the mask is added to the scores (nothing saved) and lives until the model returns.
    SDPA with a sliding window (``dm.masked_sdpa``) gets the bool windowed mask instead
    (masking_utils' ``sdpa_mask``: the causal and the window comparisons, (1, 1, s, s) each, and
    their ``&``, expanded to the batch as a view)."""
    s, hd, p = dm.s, dm.qw // dm.h, dm.p
    table = s * hd
    nodes = [Node("positions", out=[(POSITIONS, s * 8)])]
    if attention == "math":
        nodes.append(Node("causal_mask", out=[(CAUSAL_MASK, dm.b * s * s * p)], fwd_scratch=s * s))
        if dm.full_mask:
            # Qwen2 with a sliding layer: the full causal mask too, made the same way.
            nodes.append(Node("full_mask", out=[(FULL_MASK, dm.b * s * s * p)], fwd_scratch=s * s))
    elif dm.masked_sdpa:
        nodes.append(Node("sliding_mask", out=[(CAUSAL_MASK, s * s)], fwd_scratch=2 * s * s))
    # freqs (s x hd/2) and their cat (s x hd) in float32 stay until both tables exist; a table
    # in another dtype than float32 is cast from a float32 one.
    nodes.append(Node("rotary", out=[(ROPE_TABLES, 2 * table * p)],
                      fwd_scratch=table * 4 * 1.5 + (table * 4 if p != 4 else 0.0)))
    return nodes


def hf_model_inputs(attention: str, masked_sdpa: bool = False, full_mask: bool = False) -> tuple[str, ...]:
    """The keys of :func:`hf_model_input_nodes` (``masked_sdpa``: ``Dims.masked_sdpa``;
    ``full_mask``: ``Dims.full_mask``)."""
    return ((POSITIONS, ROPE_TABLES) + ((CAUSAL_MASK,) if attention == "math" or masked_sdpa else ())
            + ((FULL_MASK,) if attention == "math" and full_mask else ()))


def rope_k_apart(dm: Any, fused_proj: bool, attention: str, rope_locals: bool) -> bool:
    """Whether rope's k is a storage apart from its q (``<out>.k``): Phi-3's eager attention with
    grouped k/v heads (``fused_proj``, ``attention`` math, fewer k/v heads than q heads; not
    rope's float32 ``rope_locals``). Rope's cat makes q contiguous, which q @ k^T reads in place
    and saves for k's gradient, while k is read through repeat_kv's copy (or its matmul's): k
    goes when the attention returns, q with the scores' backward."""
    return fused_proj and attention == "math" and dm.kv != dm.qw and not rope_locals


def hf_rope_node(dm: Any, qkv: list[str], out: str, v_view: bool = False, kernel_casts: bool = False,
                 v32: bool = False, v_apart: bool = False, k_apart: bool = False) -> Any:
    """apply_rotary_pos_emb: new q and k (``q * cos + rotate_half(q) * sin``); v passes on. For
    memory the q/k/v triple stays one storage (what SDPA saves); the forward's scratch is the
    products and the ``cat`` of rotate_half. ``qkv``: the projections' output, one key (the
    fused entry) or three (q, k, v: the Linears simulated one by one). ``v_view``: v is a slice
    of the one fused output (Phi-3's qkv_proj), which the attention keeps itself: ``out`` is
    then the new q and k alone. ``v_apart``: v is a storage of its own, ``<out>.v``, apart from
    SDPA's casts of q and k (autocast with the fused kernel, :func:`held_locals`) or from rope's q
    and k (eager attention reading v in place). ``k_apart``: k is a storage of its own, ``<out>.k``
    (:func:`rope_k_apart`)."""
    N, d, kv, a = dm.n, dm.qw, dm.kv, dm.a  # (d: q's width, n_heads x head_dim)
    widths = [d + 2 * kv] if len(qkv) == 1 else [d, kv, kv]
    # The products save cos and sin (ROPE_TABLES), views of the model's tables. The forward, q's
    # then k's: ``x * cos``, rotate_half's ``neg`` and ``cat``, ``cat * sin`` (the cat then goes),
    # and their sum: three x-sized tensors at once before the sum. k's come after q's result; the
    # output here already holds k's result and a copy of v (which passes through, still held as
    # the projection's output), so one k-sized temporary stands for k's three.
    Q, K = N * d * a, N * kv * a
    steps = (("alloc", "q_cos", Q), ("alloc", "q_cat", Q), ("alloc", "q_sin", Q), ("free", "q_cat", 0.0),
             ("free", "q_cos", 0.0), ("free", "q_sin", 0.0), ("outputs", "", 0.0), ("alloc", "k_sin", K))
    outs: list[tuple] = [(out, N * (d + (kv if v_view else 2 * kv)) * a)]
    if held_locals(dm):
        # Under autocast the tables are float32 (the embeddings' dtype) and the bf16 projections
        # times them make float32 q and k: the attention function's locals until o_proj has run
        # (:func:`held_locals`), saved by nothing, so they live through a checkpointed layer's
        # attention while the kernels' bf16 copies do not. ``out`` then stands for v (bf16 already:
        # a local too, and what SDPA saves) and, for SDPA, its autocast casts of q and k (saved);
        # eager attention's matmuls make their casts themselves (the attention's q and k copies:
        # ``kernel_casts``).
        # A float32 v (``v32``: a bias added after QLoRA's NF4 matmul, in float32) is a local too,
        # and the kernels cast it (SDPA's cast in ``out``; eager attention's matmul its own copy).
        # Phi-3's v (``v_view``) is a slice of the fused output, which Phi3Attention.forward holds
        # itself (its ``qkv``, until o_proj has run): ``out`` has no v of its own then.
        v_local = N * kv * 4 if v32 else 0.0
        v = 0.0 if v32 or v_view else N * kv * a
        sdpa_casts = N * (d + kv + (kv if v32 else 0)) * a
        outs = [(out, v if kernel_casts else v + sdpa_casts), (f"{out}.locals", N * (d + kv) * 4 + v_local)]
        if v_apart and v and not kernel_casts and not dm.masked_sdpa:
            # value_states is the attention's local until it returns, after o_proj, while SDPA's
            # casts of q and k go when SDPA returns: apart, so a checkpointed layer's forward
            # (nothing saved) holds v through o_proj (freed with the casts, a width-4 Gemma's
            # forward was -3.15% under the trace).
            outs[:1] = [(out, sdpa_casts), (f"{out}.v", v)]
        if dm.masked_sdpa:
            # SDPA's casts are of q and of the repeated k and v (masked_kv_dtypes): ``out`` is q's,
            # ``out.kv`` v itself (none where v is float32, a local already, or Phi-3's slice).
            outs[:1] = [(out, N * d * a), (f"{out}.kv", v)]
    elif v_apart and not v_view and not dm.masked_sdpa:
        # Eager attention reading rope's v in place (as many k/v heads as q heads, the views
        # folding into bmm's batch: batch 1 or one head): v is its own storage, saved by the
        # probabilities' matmul alone and freed when that matmul's backward has run, before
        # q @ k^T's (as one storage with q and k it stayed to the scores' backward: +3.0% backward
        # where the softmax's backward was the peak, one head over 5 x 40 tokens).
        outs = [(out, N * (d + kv) * a), (f"{out}.v", N * kv * a)]
    elif k_apart:
        outs = [(out, N * d * a), (f"{out}.k", N * kv * a)]
    elif dm.masked_sdpa:
        # SDPA with a mask keeps q and the repeated k and v: rope's k (and v) go when the attention
        # returns, so they are a storage apart, ``out.kv`` (Phi-3: k alone; v is a view of the fused
        # output).
        outs = [(out, N * d * a), (f"{out}.kv", N * (kv if v_view else 2 * kv) * a)]
    return Node(f"{out}.rope", out=outs,
                 inputs=list(qkv) + [ROPE_TABLES], saves=[ROPE_TABLES],
                 grads=[(k, N * w * a) for k, w in zip(qkv, widths)], fwd_steps=steps,
                 # The tables are saved (and the backward's temporaries made) for q's and k's
                 # gradients: with separate projections v may need one where q and k do not (the
                 # first layer under LoRA on v_proj alone).
                 saves_for=tuple(qkv[:2]) if len(qkv) == 3 else None,
                 # Backward, k's then q's: ``grad * sin``, rotate_half's backward (neg, two
                 # slice_backward) and their sum, then ``grad * cos`` and the sum: two x-sized
                 # temporaries beside x's gradient, k's gone before q's (q is the wider).
                 scratch=2 * N * d * a)


def masked_kv_dtypes(dm: Any, per_linear: bool, v32: bool) -> tuple[float, float]:
    """Bytes per element of k and of v as transformers' ``repeat_kv`` copies them for SDPA's
    mask (``Dims.masked_sdpa``): under autocast rope's k is float32 (the bf16 projection times
    the float32 tables); v is the projection's output (float32 only where QLoRA's bias is added in
    float32, ``v32``, with q, k and v from separate Linears, ``per_linear``)."""
    k = 4.0 if dm.autocast else dm.a
    v = 4.0 if dm.autocast and per_linear and v32 else dm.a
    return k, v


def held_locals(dm: Any) -> bool:
    """Whether :func:`hf_rope_node` keeps rope's float32 q and k (and v) apart as
    ``<out>.locals``: under autocast, whose float32 rotary tables make q and k float32 however
    the projections run (one Linear each, peft's adapters one after the other, or Phi-3's fused
    qkv_proj); the layer's o_proj then holds those locals (and, with eager attention, v)."""
    return bool(dm.autocast) and dm.a != 4


def gelu_new_nodes(dm: Any, name: str, src: str, out: str) -> list[Any]:
    """transformers' NewGELUActivation (GPT-2's ``gelu_new``), a formula in Python ops:
    ``0.5 * x * (1 + tanh(c * (x + 0.044715 * x ** 3)))``. Each op makes a new (N, d_ff) tensor
    in the input's dtype; pow saves ``x``, tanh its output, the last product both of its
    factors (``0.5 * x`` and ``1 + tanh``): three (N, d_ff) tensors per layer kept beyond a fused
    GELU's input."""
    E = dm.n * dm.f * dm.a
    half, cube, scaled, inner, arg, th, one = (f"{name}.{k}" for k in ("half", "cube", "scaled", "inner", "arg",
                                                                       "tanh", "one_plus"))
    return [
        Node(f"{name}.half", out=[(half, E)], inputs=[src], grads=[(src, E)]),
        # pow's backward: grad * 3 * x.pow(2): x.pow(2) and 3 * it beside the result.
        Node(f"{name}.pow", out=[(cube, E)], inputs=[src], saves=[src], grads=[(src, E)], scratch=2 * E),
        Node(f"{name}.scale_cube", out=[(scaled, E)], inputs=[cube], grads=[(cube, E)]),
        Node(f"{name}.add", out=[(inner, E)], inputs=[src, scaled], grads=[(src, 0.0), (scaled, 0.0)]),
        Node(f"{name}.scale", out=[(arg, E)], inputs=[inner], grads=[(inner, E)]),
        Node(f"{name}.tanh", out=[(th, E)], inputs=[arg], saves=[th], grads=[(arg, E)]),
        Node(f"{name}.add_one", out=[(one, E)], inputs=[th], grads=[(th, 0.0)]),
        # (The caller's local holds x until the activation returns, saved or not.)
        Node(f"{name}.mul", out=[(out, E)], inputs=[half, one, src], saves=[half, one], grads=[(half, E), (one, E)]),
    ]
