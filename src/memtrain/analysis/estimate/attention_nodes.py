"""The attention's op inventory: from the q/k/v split to the merged (b, s, d) output that the
output projection reads, for each kernel (memory shape: :func:`resolve_backend`): math attention
(s x s scores), SDPA's fused kernels (flash, mem-efficient, cuDNN, flex) and its math fallback,
the banded and the dense sliding window, and transformers' eager attention and windowed-mask SDPA.
Its callers place the nodes: the block (:func:`~memtrain.analysis.estimate.block_nodes.block_nodes`)
and, for selective recomputation, the block's segments."""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from memtrain.analysis.estimate.basic_nodes import dropout, rename_key
from memtrain.analysis.estimate.dims import Dims
from memtrain.analysis.estimate.hf_nodes import CAUSAL_MASK, rope_k_apart
from memtrain.analysis.estimate.simulator import Node


def resolve_backend(kind: str, window: Optional[int], dm: Dims) -> str:
    """The memory shape of an attention choice here: math (s x s), flash (fused), banded."""
    if window is not None and window < dm.s:
        if kind in ("flex", "flash-attn"):
            return "flash"
        if min(window, dm.s) + window - 1 < dm.s:
            # SDPA on the CPU has no dropout: with it, each band runs SDPA's math path, whose
            # buffers are the math kernel's.
            return "banded" if kind == "math" or (not dm.cuda and dm.dropout) else "banded-sdpa"
        # A window this wide runs the dense masked form.
        if kind == "math" or (not dm.cuda and dm.dropout) or kind == "sdpa":
            return "math"
        return "flash"
    if kind == "math":
        return "math"
    if kind == "sdpa" and not dm.cuda and dm.dropout:
        return "math"  # the CPU flash kernel has no dropout: SDPA falls back to its math path
    return "flash"


def _scores_softmax(nodes: list[Node], dm: Dims, p: str, score_elems: float, mask_elems: float,
                    kind: str = "math", mask_made: bool = False) -> str:
    """s0 (the q @ k^T product, already added by the caller) -> scale -> masked_fill -> float32
    softmax -> cast back -> dropout. Returns the key of the probabilities the second matmul reads.
    ``mask_made``: the caller made the additive mask ``{p}.m`` already (SDPA's math path)."""
    a, sc = dm.a, score_elems
    s2_bytes = a  # the masked scores' bytes per element
    nodes.append(Node(f"{p}.scale", out=[(f"{p}.s1", sc * a)], inputs=[f"{p}.s0"], grads=[(f"{p}.s0", sc * a)]))
    if dm.additive_mask or mask_made:
        # GPT-2's layers add a float mask (nothing saved): eager attention the one GPT2Model
        # built for every layer (its embedding nodes), SDPA's math fallback one of its own,
        # from a bool ones(s, s).tril().
        own = [(f"{p}.m", mask_elems * 4)] if kind != "math" else []
        if not mask_made:
            nodes.append(Node(f"{p}.mask", out=own, fwd_scratch=2 * mask_elems if own else 0.0))
        # Eager attention adds the model's mask, made in the embeddings' dtype (the parameters':
        # float32 under autocast): type promotion makes the sum of the low-precision scores and
        # it a float32 tensor, which the softmax then reads without a cast, and whose gradient
        # the add's backward casts back to the scores' dtype (a copy).
        s2_bytes = max(a, dm.p) if kind == "math" and dm.autocast else a
        nodes.append(Node(f"{p}.masked", out=[(f"{p}.s2", sc * s2_bytes)], inputs=[f"{p}.s1"] + [o[0] for o in own],
                           grads=[(f"{p}.s1", 0.0 if s2_bytes == a else sc * a)]))
    else:
        # causal_mask: the bool mask ``cm`` and its negation ``m`` (saved by masked_fill).
        nodes.append(Node(f"{p}.mask", out=[(f"{p}.m", mask_elems), (f"{p}.cm", mask_elems)]))
        nodes.append(Node(f"{p}.masked", out=[(f"{p}.s2", sc * a)], inputs=[f"{p}.s1", f"{p}.m", f"{p}.cm"],
                           saves=[f"{p}.m"], grads=[(f"{p}.s1", sc * a)]))
    src = f"{p}.s2"
    float_scores = a != 4 and (dm.softmax_fp32 or dm.autocast)  # a float32 softmax on low-precision scores
    up = float_scores and s2_bytes != 4  # ... which casts them first (unless the mask promoted them)
    sm = 4 if float_scores else a
    # transformers' Llama-style ``softmax(attn_weights, dtype=float32)`` casts inside the call:
    # the caller's local holds the low-precision scores until softmax returns.
    caller_held = [src] if up and dm.hf and dm.softmax_fp32 else []
    if up:
        nodes.append(Node(f"{p}.float", out=[(f"{p}.sf", sc * 4)], inputs=[src], grads=[(src, sc * a)]))
        src = f"{p}.sf"
    nodes.append(Node(f"{p}.softmax", out=[(f"{p}.pf", sc * sm)], inputs=[src] + caller_held, saves=[f"{p}.pf"],
                       grads=[(src, sc * sm)]))
    src = f"{p}.pf"
    if float_scores and float32_weights_dropped(dm, kind):
        # A Llama-style layer under autocast: ``.to(query.dtype)`` keeps the float32 softmax
        # (rope's float32 query), so the attention dropout runs on it in float32 (its output and
        # the CPU kernel's noise), and the second matmul's autocast casts the dropped weights.
        dropout(nodes, dm, f"{p}.attn_drop", src, f"{p}.pd", sc, 4, attention=True)
        nodes.append(Node(f"{p}.tocast", out=[(f"{p}.pa", sc * a)], inputs=[f"{p}.pd"], grads=[(f"{p}.pd", sc * 4)]))
        return f"{p}.pa"
    if float_scores:
        nodes.append(Node(f"{p}.tocast", out=[(f"{p}.pa", sc * a)], inputs=[src], grads=[(src, sc * 4)]))
        src = f"{p}.pa"
    dropout(nodes, dm, f"{p}.attn_drop", src, f"{p}.pd", sc, a, attention=True)
    return f"{p}.pd"


def float32_weights_dropped(dm: Dims, kind: str) -> bool:
    """Whether a transformers Llama-style eager attention drops its float32 softmax output under
    autocast (the weights its layer then holds: ``block_nodes._hf_layer_locals``)."""
    return kind == "math" and dm.repeat_kv and dm.autocast and dm.a != 4 and dm.dropout and not dm.cuda


def attention_nodes(nodes: list[Node], dm: Dims, p: str, kind: str, window: Optional[int],
                    v_src: Optional[str] = None, qkv_grad: tuple[bool, bool, bool] = (True, True, True),
                    kv_bytes: tuple[float, float] = (0.0, 0.0),
                    kv_locals: tuple[bool, bool] = (False, False)) -> None:
    """q, k, v (views of the fused qkv output) -> y (batch, seq, d), the proj input. ``v_src``:
    the storage v is a view of, when it is not ``qkv`` (Phi-3: the projection's fused output).
    ``qkv_grad``: whether q, k and v require a gradient (not all of them in the first layer of a
    transformers model under LoRA on named targets). ``kv_bytes``: k's and v's bytes per element
    as transformers repeats them for SDPA's mask (``Dims.masked_sdpa``: hf_nodes.masked_kv_dtypes);
    ``kv_locals``: whether k and v are rope's float32 locals (autocast: hf_nodes.held_locals),
    which eager attention's repeat_kv copies in float32 too."""
    # (Inside the attention every q-sized tensor is n_heads x head_dim wide: ``d`` is that here.)
    b, s, d, h, a = dm.b, dm.s, dm.qw, dm.h, dm.a
    N, kvw = dm.n, dm.kv
    qkv, q, k, v, y = f"{p}.qkv", f"{p}.q", f"{p}.k", f"{p}.v", f"{p}.y"
    # What the kernels read and save for q, k and v: v's storage too when it is another one.
    qkv_keys = [qkv] if v_src is None else [qkv, v_src]
    # split + view + transpose are views; backward reshapes each gradient (a copy, the
    # gradients being transposed) and concatenates the three.
    nodes.append(Node(f"{p}.split", inputs=[qkv], grad_out=(q, k, v), scratch=N * d * a,
                       grads=[(qkv, N * (d + 2 * kvw) * a)]))
    backend = resolve_backend(kind, window, dm)
    if backend == "flash" and dm.masked_sdpa:
        _masked_sdpa_nodes(nodes, dm, p, v_src, kv_bytes, kv_locals)
        return
    if backend == "math" and _dense_window_on_cpu_flash(dm, kind, window):
        # attention.kernels._dense_window hands SDPA the bool (s, s) window mask (made per call:
        # int64 i - j beside three bool (s, s) comparisons), and torch's CPU flash kernel turns it
        # into a float mask in q's dtype, which it saves with q, k, v (views of qkv), its output
        # (written as (b, s, h, hd): the merge's .contiguous() is free) and the log-sum-exp:
        # nothing (b, h, s, s), as the math path would keep.
        # causal_mask's peak is at ``i - j < window``: the int64 aranges and difference beside the
        # causal bool and the comparison; the bool window mask it returns is _dense_window's local
        # until SDPA returns, beside the float copy (made with both: +3.1% forward at 1 x 23 tokens).
        nodes.append(Node(f"{p}.wmask", out=[(f"{p}.cm", s * s)], fwd_scratch=s * s * 9 + s * 16))
        nodes.append(Node(f"{p}.mask", out=[(f"{p}.m", s * s * a)], inputs=[f"{p}.cm"]))
        nodes.append(Node(f"{p}.sdpa", out=[(y, N * d * a), (f"{p}.lse", b * h * s * 4)],
                          inputs=qkv_keys + [f"{p}.m", f"{p}.cm"],
                          saves=qkv_keys + [y, f"{p}.lse", f"{p}.m"], matmul=True, grad_out=(y,),
                          grads=[(q, N * d * a), (k, N * kvw * a), (v, N * kvw * a)]))
        return
    if backend == "flash":
        # Fused kernel (SDPA flash/mem-efficient/cuDNN, flex, flash-attn): saves q, k, v (views
        # of qkv), its output and a float32 log-sum-exp (b, h, s); nothing s x s. The CPU
        # kernel writes the output as (b, s, h, hd), so .contiguous() afterwards is free.
        # (Phi-3's contiguous q makes the output (b, h, s, hd): the transpose's .contiguous()
        # copies it, and the copy is the proj input.)
        o = f"{p}.o" if dm.fused_proj else y
        nodes.append(Node(f"{p}.sdpa", out=[(o, N * d * a), (f"{p}.lse", b * h * s * 4)], inputs=qkv_keys,
                           saves=qkv_keys + [o, f"{p}.lse"], matmul=True, grad_out=(o,),
                           grads=[(q, N * d * a), (k, N * kvw * a), (v, N * kvw * a)]))
        if dm.fused_proj:
            _merge_heads(nodes, dm, p, o, y, N * d * a)
        return
    if backend in ("banded", "banded-sdpa"):
        _banded_nodes(nodes, dm, p, kind, backend, window)
        return
    # Materialized attention (math, or SDPA's math fallback): (b, h, s, s) scores. matmul on
    # the transposed views copies q and k^T into contiguous buffers, which bmm saves.
    # SDPA's math fallback: the buffers of math attention, in float32 on the CPU.
    low_a = a
    if kind == "sdpa":
        dm = _math_fallback_dims(dm)
        a = dm.a
    upcast = a != low_a
    sc = b * h * s * s
    # The matmul copies v into a contiguous buffer. transformers' eager attention repeats the
    # k/v heads first (repeat_kv: a copy as wide as q under grouped-query attention), so its v
    # copy is N x d; the copies of q and k^T it does not make (rope's q and k are contiguous),
    # but it makes the repeated k and the contiguous k^T the matmul reads: for memory the same
    # as our GPT's q and k copies.
    v_width = d if dm.hf else kvw
    # (GPT-2's SDPA math fallback on float32 v at batch 1: bmm reads the (h, s, hd) view of v
    # in place, and its save keeps the whole q/k/v output. A Llama-style layer's v is a storage of
    # its own, apart from rope's q and k, which ``qkv`` stands for too: the copy's bytes are v's.)
    # Our GPT's v is a view of its fused q/k/v output as GPT-2's is: the same at batch 1.
    # (Our GPT's math_attention reads it in place too.)
    v_view = ((dm.additive_mask and kind != "math") or not dm.hf) and not dm.repeat_kv and not upcast and _folds(dm)
    v_saved = qkv_keys if v_view else [f"{p}.vc"]
    if v_src is not None and _fused_v_folds(dm, kind, upcast):
        v_view, v_saved = True, [v_src]
    qk_saves = [f"{p}.qc", f"{p}.kc"]
    kernel_locals: list[str] = []  # what the attention function holds until it returns
    if dm.repeat_kv and kind == "math":
        held = _eager_hf_attention_nodes(nodes, dm, p, qkv_keys, v_src, qkv_grad, kv_locals, a)
    else:
        # Each matmul keeps one operand for the other operand's gradient (not every one of q, k
        # and v requires one in the first layer under LoRA on named targets: ``qkv_grad``).
        q_grad, k_grad, v_grad = qkv_grad
        qk_in, gqa_v = [qkv], None
        if kind == "sdpa":
            kernel_locals, gqa_v = _sdpa_math_inputs(nodes, dm, p, kvw, upcast, qkv_keys)
            qk_in = [f"{p}.qs", f"{p}.ks"]
        qk_saves, v_saved, q_copy, k_copy, gqa_v = _math_path_reads(dm, p, kind, upcast, gqa_v, qk_saves, v_saved)
        nodes.append(Node(f"{p}.qk", out=[(f"{p}.qc", N * d * a * q_copy), (f"{p}.kc", N * d * a * k_copy),
                                          (f"{p}.s0", sc * a)],
                           inputs=qk_in, saves=qk_saves[:1] * k_grad + qk_saves[1:] * q_grad, matmul=True,
                           grad_out=(f"{p}.s0",), keep=(f"{p}.s0",),
                           grads=[(q, N * d * a)] * q_grad + [(k, N * kvw * a)] * k_grad))
        probs = _scores_softmax(nodes, dm, p, sc, s * s, kind, mask_made=kind == "sdpa")
        if kind == "sdpa":
            # The kernel returns the attention weights too, cast to the inputs' dtype (a new
            # tensor when it upcast), made before the second matmul (GCC builds the returned
            # tuple's elements last to first); they and the (dropped) weights it multiplies by
            # are its locals until it returns.
            if upcast:
                nodes.append(Node(f"{p}.weights_down", out=[(f"{p}.pw", sc * low_a)], inputs=[probs]))
                kernel_locals.append(f"{p}.pw")
            kernel_locals += [probs] + qkv_keys  # (q, k and v: the caller's, held through the call)
        elif kind == "math" and not dm.hf and not dm.cuda:
            # memtrain's math_attention: its ``scores`` (the masked ones) and ``mask`` locals live
            # until it returns (``probs`` is a new name, the softmax's output), its arguments q, k
            # and v (views of qkv) too. Counted on CPU kernels, where the trace shows them; on CUDA
            # the replay without them is what the committed H100 runs measured (reserved within
            # 1.5%: tests/test_allocator.py), and with them 20% under: not yet explained.
            kernel_locals = [f"{p}.s2", f"{p}.cm"] + qkv_keys
        nodes.append(Node(f"{p}.vcopy", out=[] if v_view or gqa_v else [(f"{p}.vc", N * v_width * a)], inputs=qkv_keys))
        nodes.append(Node(f"{p}.pv", out=[(f"{p}.o", N * d * a)], inputs=[probs] + v_saved,
                           saves=[probs] * v_grad + v_saved * (q_grad or k_grad), matmul=True,
                           grads=[(probs, sc * a)] * (q_grad or k_grad) + [(v, N * kvw * a)] * v_grad))
        held = []
    o = _cast_back(nodes, p, f"{p}.o", N * d, a, low_a)
    nodes[-1].inputs += kernel_locals  # (the kernel's last op: the cast back, or the matmul)
    # y.transpose(1, 2).contiguous(): a copy; its backward passes the gradient through.
    _merge_heads(nodes, dm, p, o, y, N * d * low_a, tuple(held))


def _banded_nodes(nodes: list[Node], dm: Dims, p: str, kind: str, backend: str, window: Optional[int]) -> None:
    """``kernels._banded``: the banded kernel (``backend`` "banded": the math kernel, or SDPA's math
    path per band where the CPU has dropout; "banded-sdpa": a fused SDPA kernel over the bands),
    from q, k, v (views of ``{p}.qkv``) to the merged output ``{p}.y``."""
    b, s, d, h, a = dm.b, dm.s, dm.qw, dm.h, dm.a
    N, kvw, hd = dm.n, dm.kv, dm.qw // dm.h
    qkv, q, k, v, y = f"{p}.qkv", f"{p}.q", f"{p}.k", f"{p}.v", f"{p}.y"
    W = window or s
    blk = min(W, s)
    nb = -(-s // blk)
    if backend == "banded" and kind != "math":  # SDPA's math path, band by band
        _band_sdpa_math_nodes(nodes, _math_fallback_dims(dm), p, (q, k, v, qkv), (N * d, N * kvw), (nb, blk, W), a)
        return
    band = blk + W - 1
    q_pad = b * h * nb * blk * hd * a
    kv_pad = b * h * (nb * blk + W - 1) * hd * a
    kv_band = b * h * nb * band * hd * a
    sc = b * h * nb * blk * band
    # F.pad copies q, k, v; the matmuls copy the overlapping band views of k and v.
    nodes.append(Node(f"{p}.pad", out=[(f"{p}.qp", q_pad), (f"{p}.kp", kv_pad), (f"{p}.vp", kv_pad)],
                       inputs=[qkv], grad_out=(f"{p}.qp", f"{p}.kp", f"{p}.vp"),
                       grads=[(q, N * d * a), (k, N * kvw * a), (v, N * kvw * a)]))
    # The band views of k and v: copied by the math kernel's matmuls, read in place by SDPA
    # (which saves the padded tensors); unfold's backward scatters into a padded buffer.
    copy = kv_band if backend == "banded" else 0
    nodes.append(Node(f"{p}.kband", out=[(f"{p}.kb", copy)], inputs=[f"{p}.kp"], grads=[(f"{p}.kp", kv_pad)]))
    # (The math kernel's second matmul copies v's band, after the softmax and the dropout; the
    # fused SDPA kernel reads it in place.)
    vband = Node(f"{p}.vband", out=[(f"{p}.vb", copy)], inputs=[f"{p}.vp"], grads=[(f"{p}.vp", kv_pad)])
    if kind != "math":
        nodes.append(vband)
    mask_elems = nb * blk * band
    if backend == "banded-sdpa":
        # The bool band mask becomes an additive float mask, saved with q, k, v, out, lse.
        nodes.append(Node(f"{p}.mask", out=[(f"{p}.m", mask_elems * 4)], fwd_scratch=2 * mask_elems))
        nodes.append(Node(f"{p}.sdpa", out=[(f"{p}.o", q_pad), (f"{p}.lse", b * h * nb * blk * 4)],
                           inputs=[f"{p}.qp", f"{p}.kp", f"{p}.vp", f"{p}.kb", f"{p}.vb", f"{p}.m"], matmul=True,
                           keep=(f"{p}.o", f"{p}.lse"),
                           saves=[f"{p}.qp", f"{p}.kp", f"{p}.vp", f"{p}.o", f"{p}.lse", f"{p}.m"],
                           grads=[(f"{p}.qp", q_pad), (f"{p}.kb", kv_band), (f"{p}.vb", kv_band)]))
    else:
        _band_math_nodes(nodes, dm, p, kind, vband, sc, mask_elems, q_pad, kv_band)
    # out[:, :, :s] then transpose(1, 2).contiguous(): one copy.
    nodes.append(Node(f"{p}.merge", out=[(y, N * d * a)], inputs=[f"{p}.o"], grads=[(f"{p}.o", q_pad)]))


def _band_math_nodes(nodes: list[Node], dm: Dims, p: str, kind: str, vband: Node, sc: float, mask_elems: float,
                     q_pad: float, kv_band: float) -> None:
    """The banded kernel's materialized band scores (``kernels._banded`` with the math kernel;
    SDPA's math path per band: :func:`_band_sdpa_math_nodes`), from the padded q and k's band to
    the band output ``{p}.o``. ``vband``: the node of v's band; ``sc``/``mask_elems``: the band
    scores' and mask's elements; ``q_pad``/``kv_band``: bytes of the padded q and of a band."""
    a = dm.a
    nodes.append(Node(f"{p}.qk", out=[(f"{p}.s0", sc * a)], inputs=[f"{p}.qp", f"{p}.kb"],
                       saves=[f"{p}.qp", f"{p}.kb"], matmul=True, keep=(f"{p}.s0",),
                       grads=[(f"{p}.qp", q_pad), (f"{p}.kb", kv_band)]))
    probs = _scores_softmax(nodes, dm, p, sc, mask_elems)
    if kind == "math":
        nodes.append(vband)
    nodes.append(Node(f"{p}.pv", out=[(f"{p}.o", q_pad)], inputs=[probs, f"{p}.vb"],
                       saves=[probs, f"{p}.vb"], matmul=True,
                       grads=[(probs, sc * a), (f"{p}.vb", kv_band)]))
    # kernels._banded's locals live until it returns, saved or not (a checkpointed block's
    # forward saves nothing): the padded q, k and v, the bool band mask, and with the math
    # kernel its masked ``scores`` beside the softmax and the dropout.
    nodes[-1].inputs += [f"{p}.qp", f"{p}.kp", f"{p}.vp", f"{p}.cm"] + ([f"{p}.s2"] if kind == "math" else [])


def _band_sdpa_math_nodes(nodes: list[Node], dm: Dims, p: str, keys: tuple[str, str, str, str],
                          numels: tuple[float, float], band_dims: tuple[int, int, int], low_a: float) -> None:
    """``kernels._banded`` with SDPA where the CPU has dropout: torch's math path
    (``_scaled_dot_product_attention_math``) runs over every band at once, through to the merged
    output ``{p}.y``. ``dm``: the math path's float32 Dims; ``keys``: q, k, v and the q/k/v output;
    ``numels``: q's and k's elements; ``band_dims``: the blocks, the block and the window;
    ``low_a``: the inputs' bytes per element. F.pad copies q, k and v in their own dtype; on
    16-bit inputs the math path casts q and k's and v's band views to float32 copies; it scales q
    and k^T (copies) and adds the band mask as a float mask in q's dtype. All of it but the scaled
    k^T (and the caller's padded tensors and bool mask) lives until the kernel returns: a
    checkpointed block's forward peak, which counted the pads in float32 and none of the copies
    (-5.0% forward, fp16, window 5 over 40 tokens)."""
    q, k, v, qkv = keys
    b, h, a = dm.b, dm.h, dm.a
    upcast = a != low_a
    hd = dm.qw // h
    nb, blk, W = band_dims
    q_len, band = nb * blk, blk + W - 1
    q_pad, kv_pad = b * h * q_len * hd, b * h * (q_len + W - 1) * hd  # elements
    kv_band, sc, mask_elems = b * h * nb * band * hd, b * h * q_len * band, q_len * band
    nodes.append(Node(f"{p}.pad", out=[(f"{p}.qp", q_pad * low_a), (f"{p}.kp", kv_pad * low_a),
                                       (f"{p}.vp", kv_pad * low_a)],
                      inputs=[qkv], grad_out=(f"{p}.qp", f"{p}.kp", f"{p}.vp"),
                      grads=[(q, numels[0] * low_a), (k, numels[1] * low_a), (v, numels[1] * low_a)]))
    # F.pad by nothing keeps q's transposed strides, so folding (batch, heads) copies it.
    q_in, k_in = f"{p}.qp", f"{p}.kp"
    local = [f"{p}.qp", f"{p}.kp", f"{p}.vp", f"{p}.cm", f"{p}.m"]
    if q_len == dm.s and b > 1 and h > 1:
        nodes.append(Node(f"{p}.qfold", out=[(f"{p}.qr", q_pad * low_a)], inputs=[q_in], grads=[(q_in, q_pad * low_a)]))
        q_in = f"{p}.qr"
        local.append(q_in)
    nodes.append(Node(f"{p}.mask", out=[(f"{p}.cm", mask_elems), (f"{p}.m", mask_elems * low_a)]))
    if upcast:
        nodes.append(Node(f"{p}.upcast", out=[(f"{p}.q32", q_pad * a), (f"{p}.k32", kv_band * a),
                                              (f"{p}.vb", kv_band * a)],
                          inputs=[q_in, f"{p}.kp", f"{p}.vp"], grad_out=(f"{p}.q32", f"{p}.k32", f"{p}.vb"),
                          grads=[(q_in, q_pad * low_a), (f"{p}.kp", kv_pad * low_a), (f"{p}.vp", kv_pad * low_a)]))
        q_in, k_in = f"{p}.q32", f"{p}.k32"
        local += [f"{p}.q32", f"{p}.k32", f"{p}.vb"]
    nodes.append(Node(f"{p}.qscale", out=[(f"{p}.qs", q_pad * a)], inputs=[q_in], grads=[(q_in, q_pad * a)]))
    nodes.append(Node(f"{p}.kscale", out=[(f"{p}.kb", kv_band * a)], inputs=[k_in], grads=[(k_in, kv_band * a)]))
    local.append(f"{p}.qs")
    # At batch 1 those strides reach the scaled q, which the matmul then copies to fold (heads,
    # blocks) into bmm's batch: the copy is what it saves.
    qs = f"{p}.qs"
    if q_len == dm.s and b == 1 and h > 1:
        nodes.append(Node(f"{p}.qsfold", out=[(f"{p}.qf", q_pad * a)], inputs=[qs], grads=[(qs, q_pad * a)]))
        qs = f"{p}.qf"
    nodes.append(Node(f"{p}.qk", out=[(f"{p}.s0", sc * a)], inputs=[qs, f"{p}.kb"],
                      saves=[qs, f"{p}.kb"], matmul=True, keep=(f"{p}.s0",),
                      grads=[(qs, q_pad * a), (f"{p}.kb", kv_band * a)]))
    probs = _scores_softmax(nodes, dm, p, sc, mask_elems, "sdpa", mask_made=True)
    local.append(probs)
    if upcast:
        # The attention weights it returns too, cast to q's dtype before the second matmul.
        nodes.append(Node(f"{p}.weights_down", out=[(f"{p}.pw", sc * low_a)], inputs=[probs]))
        local.append(f"{p}.pw")
    else:
        # The second matmul copies v's band view (a float32 copy is contiguous already).
        nodes.append(Node(f"{p}.vband", out=[(f"{p}.vb", kv_band * a)], inputs=[f"{p}.vp"],
                          grads=[(f"{p}.vp", kv_pad * a)]))
    nodes.append(Node(f"{p}.pv", out=[(f"{p}.o", q_pad * a)], inputs=[probs, f"{p}.vb"],
                      saves=[probs, f"{p}.vb"], matmul=True,
                      grads=[(probs, sc * a), (f"{p}.vb", kv_band * a)]))
    o = _cast_back(nodes, p, f"{p}.o", q_pad, a, low_a)
    nodes[-1].inputs += local
    nodes.append(Node(f"{p}.merge", out=[(f"{p}.y", numels[0] * low_a)], inputs=[o], grads=[(o, q_pad * low_a)]))


def _merge_heads(nodes: list[Node], dm: Dims, p: str, o: str, y: str, nbytes: float,
                 held: tuple[str, ...] = ()) -> None:
    """``y = o.transpose(1, 2).contiguous()`` on a (b, h, s, hd) attention output ``o``: a copy whose
    backward passes the gradient through, but where the transposed view is contiguous already
    (one position or one head: torch ignores the strides of size-1 dimensions) ``.contiguous()``
    returns it and ``y`` is ``o`` (a Phi-3 model at one token: +1.0% backward when counted).
    ``held``: keys the attention holds until then."""
    if dm.s > 1 and dm.h > 1:
        nodes.append(Node(f"{p}.merge", out=[(y, nbytes)], inputs=[o, *held], grads=[(o, 0.0)]))
        return
    rename_key(nodes, o, y)
    nodes.append(Node(f"{p}.merge", inputs=[y, *held]))


def _dense_window_on_cpu_flash(dm: Dims, kind: str, window: Optional[int]) -> bool:
    """Whether our GPT's --attention sdpa with a window too wide to band (block + window - 1 >= s,
    :func:`memtrain.attention.kernels.banded_attention`) runs torch's CPU flash kernel with the
    dense bool window mask: on CPU kernels without dropout (with dropout SDPA takes its math
    path). On CUDA which fused kernel takes the mask is not modelled: counted as the math path."""
    return kind == "sdpa" and window is not None and window < dm.s and not dm.cuda and not dm.dropout and not dm.hf


def _folds(dm: Dims) -> bool:
    """Whether a (b, h, s, hd) view of a projection's output (heads split by a transpose) folds
    into bmm's (b h) batch dimension as it is: where b or h is 1, torch ignores the size-1
    dimension's stride, so the matmul reads the view in place and saves it (no contiguous copy)."""
    return dm.b == 1 or dm.h == 1


def eager_reads_v_in_place(dm: Dims) -> bool:
    """Whether transformers' eager attention of a Llama-style layer reads rope's v in place, so
    that the probabilities' matmul alone saves v's storage and its backward frees it, before
    q @ k^T's: where repeat_kv hands v on as a view and the view folds into bmm's batch
    dimension. As many k/v heads as q heads: v itself, folding at batch 1 or with one head
    (:func:`_folds`). One k/v head: repeat_kv's ``expand`` + ``reshape`` is a view (stride 0
    across the heads), folding at batch 1 only (at batch 2 and up the matmul copies it). Counted
    in one storage with q and k, the one-k/v-head case held v to the scores' backward: a tiny
    Llama (2 heads, 1 k/v head) at 1 x 64 tokens under an activation offloader had 81,920 B on
    the host at the device peak for the traced 77,824."""
    if dm.kv == dm.qw:
        return _folds(dm)
    return dm.kv * dm.h == dm.qw and dm.b == 1


def _fused_v_folds(dm: Dims, kind: str, upcast: bool) -> bool:
    """Whether SDPA's math path reads Phi-3's v, a slice of the fused q/k/v output, in
    place: in float32 (no upcast copy) where its (b, h, s, hd) view folds into bmm's batch dimension
    (batch 1, one head), the second matmul reads the view as it is and its save keeps the whole
    fused output, as eager attention's does (:func:`_eager_hf_attention_nodes`). Counted as a copy
    of v, a one-head Phi-3 with attention dropout was -1.80% forward, -1.46% backward."""
    return kind == "sdpa" and dm.fused_proj and not upcast and _folds(dm)


def _math_path_reads(dm: Dims, p: str, kind: str, upcast: bool, gqa_v: Optional[str], qk_saves: list[str],
                     v_saved: list[str]) -> tuple[list[str], list[str], bool, bool, Optional[str]]:
    """What the materialized attention's matmuls read in place rather than copy (:func:`attention_nodes`):
    returns the first matmul's saves (q's for k's gradient, k's for q's), the second's v, whether
    q and k are copied, and the v read in place (None where it is copied, or read by
    ``v_saved`` as it is). ``gqa_v``: SDPA's math path's repeated v (:func:`_sdpa_math_inputs`)."""
    # (SDPA: our GPT's as well as a transformers layer's; math: our GPT's math_attention, whose
    # q @ k^T reads q and k, views of the q/k/v output, as they are: a recompute at batch 1 that
    # copied them was 2.0% over the trace's backward, fp32, selective checkpointing, LoRA.)
    q_copy = k_copy = not ((kind == "sdpa" or not dm.hf) and _folds(dm))
    if not q_copy and upcast and gqa_v is None:
        # (v's float32 copy keeps the projection's layout, a Llama-style layer's or a view of our
        # GPT's and GPT-2's fused q/k/v output: read in place too. Copied, one head under bf16
        # autocast with a checkpointed block was +1.2% to +1.7% over the trace's backward.)
        gqa_v = f"{p}.v32"
    if gqa_v is not None:
        # The repeated (contiguous) k and v are read in place: the scaled k is saved for q's
        # gradient, the repeated v (or its float32 copy) for the probabilities'.
        qk_saves, v_saved, k_copy = [f"{p}.qc", f"{p}.ks"], [gqa_v], False
    if kind == "sdpa" and dm.fused_proj:
        # Phi-3's rope (a cat) makes q and k contiguous (b, h, s, hd): the math path's scaled q
        # is too and its scaled k^T a transposed view of a contiguous tensor, which bmm reads and
        # saves as they are (fp16 with LoRA: +3.4% forward when copied).
        q_copy = k_copy = False
    if not q_copy:
        # At batch 1 the math path's scaled q and k (math_attention's q and k, views of the
        # q/k/v output) fold into bmm's batch dimension as they are: read in place and saved,
        # no copies.
        qk_saves = [f"{p}.qs", f"{p}.ks"] if kind == "sdpa" else [f"{p}.qkv", f"{p}.qkv"]
    return qk_saves, v_saved, q_copy, k_copy, gqa_v


def _eager_hf_attention_nodes(nodes: list[Node], dm: Dims, p: str, qkv_keys: list[str], v_src: Optional[str],
                              qkv_grad: tuple[bool, bool, bool], kv_locals: tuple[bool, bool], a: float) -> list[str]:
    """transformers' eager attention of a Llama-style layer (:func:`attention_nodes`' arguments),
    from repeat_kv to the probabilities times v; returns what the function holds until it
    returns (repeat_kv's copies)."""
    b, s, d, h = dm.b, dm.s, dm.qw, dm.h
    N, kvw = dm.n, dm.kv
    qkv, q, k, v = f"{p}.qkv", f"{p}.q", f"{p}.k", f"{p}.v"
    sc = b * h * s * s
    v_saved = [f"{p}.vc"]
    # repeat_kv runs first, k's then v's, and its copies stay (the function's locals) until
    # it returns, saved or not (checkpointed). The matmuls' gradients are as wide as the
    # copies; each copy's backward sums its gradient down to the k/v heads, after the
    # scores' backward (autograd runs the later ops first).
    q_grad, k_grad, v_grad = qkv_grad
    # (With as many k/v heads as q heads repeat_kv returns k and v themselves: the matmuls
    # then copy q, k^T and v, as our GPT's do, except where the views fold (``own_fold``), and
    # nothing is held.)
    repeated = kvw != d
    k_in, v_in = (f"{p}.kc", f"{p}.vc") if repeated else (k, v)
    # repeat_kv copies k in its dtype: a float32 k (rope's under autocast) makes a float32
    # copy, and the matmul then casts that to the compute dtype, a copy of its own (saved
    # in its place).
    k_cast = repeated and kv_locals[0] and a != 4
    # One k/v head: repeat_kv's expand + reshape is a view (stride 0 across the heads), which
    # each matmul copies into a contiguous (b h, s, hd) buffer as it runs (``kt``, ``vt``: gone
    # with the matmul unless saved), except at batch 1, where the view folds into bmm's batch
    # dimension as it is: no copy, and the matmuls save the views, so rope's k and v (their
    # storages: ``qkv``, or the float32 locals) stay for backward.
    view_kv = repeated and kvw * h == d
    in_place = view_kv and b == 1
    # With as many k/v heads as q heads the matmuls read rope's q and k (and v) in place where the
    # (b, h, s, hd) views fold (batch 1, one head); only autocast's casts of a float32 q and k are
    # new tensors, laid out as their sources, so read in place too (counted as copies, QLoRA's
    # o_proj dequantizing beside them at 1 x 33 tokens was +1.6% to +4.3% forward).
    own_fold = not repeated and _folds(dm)
    # Phi-3's rope ends in a cat, so its q and k are contiguous (b, h, s, hd): q @ k^T reads q and
    # the transposed view of k in place at any batch and head count, as SDPA's math path does
    # (counted as copies, a 4-head Phi-3 with LoRA over 4 x 5 tokens was +6.6% forward).
    # (Under autocast the casts of rope's float32 q and k are new tensors, counted as copies.)
    qk_in_place = own_fold or (dm.fused_proj and not repeated)
    # With grouped heads Phi-3's q is read in place too (k is repeat_kv's copy or view): the
    # matmul saves rope's storage itself for k's gradient (counted as a copy of q, a 4-head
    # Phi-3 with 2 k/v heads under LoRA was +2.1% forward).
    q_in_place = (in_place or qk_in_place or dm.fused_proj) and not kv_locals[0]
    # Rope's k, where it is a storage apart from q (hf_nodes.rope_k_apart), else with q in ``qkv``.
    k_rope = f"{qkv}.k" if rope_k_apart(dm, dm.fused_proj, "math", kv_locals[0]) else qkv
    k_src = f"{qkv}.locals" if kv_locals[0] else k_rope
    k_saved = f"{p}.kc16" if k_cast else (k_src if in_place or (qk_in_place and not kv_locals[0]) else
                                           (f"{p}.kt" if view_kv else f"{p}.kc"))
    if repeated:
        nodes.append(Node(f"{p}.repeat_k", out=[(f"{p}.kc", 0.0 if view_kv else N * d * (4 if k_cast else a))],
                           inputs=[k_rope], grads=[(k, N * kvw * a)] if k_grad else []))
        nodes.append(Node(f"{p}.repeat_v", out=[(f"{p}.vc", 0.0 if view_kv else N * d * a)],
                           inputs=[v_src or qkv], grads=[(v, N * kvw * a)] if v_grad else []))
        if in_place:
            # The view of rope's v (its own storage ``v_src`` where the caller made it one:
            # eager_reads_v_in_place), saved for the probabilities' gradient.
            v_saved = [v_src] if v_src is not None else qkv_keys
        elif view_kv:
            v_saved = [f"{p}.vt"]
    if view_kv and not in_place and not k_cast:
        nodes.append(Node(f"{p}.kcopy", out=[(f"{p}.kt", N * d * a)], inputs=[k_rope]))
    # Each matmul keeps one operand's copy for the other operand's gradient: q's (``qc``,
    # not otherwise held) only when k requires one, k's only when q does; the
    # probabilities only when v requires one, v's copy only when they do.
    # (Where the matmul reads rope's q in place, at batch 1 too, it saves rope's storage ``qkv``
    # for k's gradient, unless autocast casts a float32 q.)
    q_bytes = 0.0 if q_in_place else N * d * a
    q_saved = qkv if q_in_place else f"{p}.qc"
    nodes.append(Node(f"{p}.qk", out=[(f"{p}.qc", q_bytes)] + ([] if repeated else [(f"{p}.kc", q_bytes)])
                       + ([(k_saved, N * d * a)] if k_cast else [])
                       + [(f"{p}.s0", sc * a)], inputs=[qkv] + ([f"{p}.kc"] if repeated else [])
                       + ([k_saved] if k_saved == f"{p}.kt" else []),
                       saves=[q_saved] * k_grad + [k_saved] * q_grad, matmul=True, grad_out=(f"{p}.s0",),
                       keep=(f"{p}.s0",),
                       grads=[(q, N * d * a)] * q_grad + [(k_in, N * d * a)] * k_grad))
    probs = _scores_softmax(nodes, dm, p, sc, s * s, "math")
    probs_grad = q_grad or k_grad
    if not repeated and v_src is not None and _folds(dm):
        # Phi-3's v, a slice of the fused output, folds into bmm's batch dimension at batch 1:
        # read in place, and the save keeps the whole fused output.
        v_saved = [v_src]
    elif own_fold and not kv_locals[1]:
        v_saved = qkv_keys  # (rope's v, folded: read in place)
    elif not repeated or (view_kv and not in_place):
        v_copy = f"{p}.vt" if repeated else f"{p}.vc"
        nodes.append(Node(f"{p}.vcopy", out=[(v_copy, N * d * a)], inputs=[qkv]))
    nodes.append(Node(f"{p}.pv", out=[(f"{p}.o", N * d * a)], inputs=[probs] + v_saved,
                       saves=[probs] * v_grad + v_saved * probs_grad, matmul=True,
                       grads=[(probs, sc * a)] * probs_grad + [(v_in, N * d * a)] * v_grad))
    held = [f"{p}.kc", f"{p}.vc"] if repeated and not view_kv else []
    return held


def _masked_sdpa_nodes(nodes: list[Node], dm: Dims, p: str, v_src: Optional[str],
                       kv_bytes: tuple[float, float], kv_locals: tuple[bool, bool]) -> None:
    """transformers' ``sdpa_attention_forward`` with the model's windowed bool mask (``Dims.masked_sdpa``),
    on the CPU. ``repeat_kv`` copies k and v to the q heads (``expand`` + ``reshape``: a view where
    there is one k/v head, k and v themselves where there are as many as q heads); SDPA's autocast
    casts what is float32 (``kv_bytes``: rope's k under autocast), a copy as wide as q when it is a
    repeated view; the kernel turns the bool mask into a float one in q's dtype ((b, 1, s, s),
    ``where`` over its ``logical_not``); and the flash kernel saves q, the k and v it got, that
    mask, its output and the log-sum-exp. The float32 copies are the function's locals, gone
    when it returns; rope's k and v (``{p}.qkv.kv``, or the float32 ``{p}.qkv.locals`` where
    ``kv_locals`` says so: :func:`hf_nodes.held_locals`) the attention module's, gone when o_proj
    has run. Backward: each repeat's sums its (N, d) gradient down to the k/v heads."""
    b, s, d, h, a = dm.b, dm.s, dm.qw, dm.h, dm.a
    N, kvw = dm.n, dm.kv
    qkv, q, k, v, o = f"{p}.qkv", f"{p}.q", f"{p}.k", f"{p}.v", f"{p}.y"
    copies = kvw != d and kvw * dm.h // d > 1  # (one k/v head: a view)
    keys, grads, locals_ = {}, [(q, N * d * a)], []
    for part, src, grad, elt, local in (("k", f"{qkv}.kv", k, kv_bytes[0], kv_locals[0]),
                                        ("v", v_src or f"{qkv}.kv", v, kv_bytes[1], kv_locals[1])):
        rep, width = (f"{qkv}.locals" if local else src), kvw  # what SDPA gets, and its gradient's width
        if copies:
            nodes.append(Node(f"{p}.repeat_{part}", out=[(f"{p}.{part}r", N * d * elt)], inputs=[rep],
                               grads=[(grad, N * kvw * elt)]))
            rep = grad = f"{p}.{part}r"
            width = d
            if elt != a:
                locals_.append(rep)
        if elt != a and (copies or local or kvw != d):
            nodes.append(Node(f"{p}.cast_{part}", out=[(f"{p}.{part}c", N * d * a)], inputs=[rep],
                               grads=[(grad, N * width * elt)]))
            rep = grad = f"{p}.{part}c"
            width = d
        keys[part] = rep
        grads.append((grad, N * width * a))
    nodes.append(Node(f"{p}.mask", out=[(f"{p}.m", b * s * s * a)], inputs=[CAUSAL_MASK], fwd_scratch=b * s * s))
    saved = list(dict.fromkeys([qkv, keys["k"], keys["v"], f"{p}.m"]))
    if dm.fused_proj:
        o = f"{p}.o"
    nodes.append(Node(f"{p}.sdpa", out=[(o, N * d * a), (f"{p}.lse", b * h * s * 4)], inputs=saved + locals_,
                       saves=saved + [o, f"{p}.lse"], matmul=True, grad_out=(o,), grads=grads))
    if dm.fused_proj:
        _merge_heads(nodes, dm, p, o, f"{p}.y", N * d * a)


def _sdpa_math_inputs(nodes: list[Node], dm: Dims, p: str, kvw: int, upcast: bool,
                      qkv_keys: list[str]) -> tuple[list[str], Optional[str]]:
    """The tensors torch's SDPA math path (``_scaled_dot_product_attention_math``) makes before
    its first matmul, beyond what that matmul copies and saves: float32 copies of q, k and v when
    they are 16-bit (``upcast``), the scaled q (``q * sqrt(scale)``) and the additive float mask
    it builds from ``is_causal`` (a bool ``ones(s, s).tril()`` turned into 0 / -inf, added to the
    scores: nothing saved), all its locals until it returns; and the scaled k^T, a temporary of
    the matmul's argument, gone once it returns. Returns the locals' keys (the scaled q is
    ``{p}.qs``, the scaled k ``{p}.ks``, the mask ``{p}.m``), and, where transformers hands it
    grouped k/v heads (a Llama-style layer: ``enable_gqa``), the key of the repeated v that the
    second matmul reads in place (else None): after the float32 copies the math path repeats k and
    v to the q heads (``repeat_interleave``: contiguous copies as wide as q), its locals as well,
    so the scaled k is as wide as q, and the matmuls copy neither the scaled k nor v."""
    N, d, a = dm.n, dm.qw, dm.a
    locals_: list[str] = []
    gqa_v = None
    if upcast:
        nodes.append(Node(f"{p}.upcast", out=[(f"{p}.q32", N * d * a), (f"{p}.k32", N * kvw * a),
                                               (f"{p}.v32", N * kvw * a)], inputs=list(qkv_keys)))
        locals_ += [f"{p}.q32", f"{p}.k32", f"{p}.v32"]
    if dm.repeat_kv and kvw != d:
        nodes.append(Node(f"{p}.gqa_repeat", out=[(f"{p}.kg", N * d * a), (f"{p}.vg", N * d * a)],
                          inputs=list(qkv_keys)))
        locals_ += [f"{p}.kg", f"{p}.vg"]
        kvw, gqa_v = d, f"{p}.vg"
    nodes.append(Node(f"{p}.qscale", out=[(f"{p}.qs", N * d * a)], inputs=list(qkv_keys)))
    locals_.append(f"{p}.qs")
    s = dm.s
    nodes.append(Node(f"{p}.mask", out=[(f"{p}.m", s * s * 4)], fwd_scratch=2 * s * s))
    locals_.append(f"{p}.m")
    nodes.append(Node(f"{p}.kscale", out=[(f"{p}.ks", N * kvw * a)], inputs=list(qkv_keys)))
    return locals_, gqa_v


def _math_fallback_dims(dm: Dims) -> Dims:
    """The Dims of SDPA's math path: on the CPU it computes in float32 whatever the inputs' dtype
    (it casts q, k and v up, and its output back down: :func:`_cast_back`); on CUDA in theirs."""
    return replace(dm, a=4) if not dm.cuda and dm.a != 4 else dm


def _cast_back(nodes: list[Node], p: str, o: str, numel: float, a: float, low_a: float) -> str:
    """SDPA's math path's output ``o`` (``numel`` elements in ``a`` bytes each) cast back to the
    inputs' ``low_a``: a new tensor; returns its key (``o`` itself when nothing was cast)."""
    if low_a == a:
        return o
    nodes.append(Node(f"{p}.o_down", out=[(f"{p}.ol", numel * low_a)], inputs=[o], grads=[(o, numel * a)]))
    return f"{p}.ol"
