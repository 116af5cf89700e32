"""Our GPT's op inventory: what each op allocates, saves and frees, as simulator nodes."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

from memtrain.analysis.estimate.hf_nodes import (
    CAUSAL_MASK,
    FULL_MASK,
    gelu_new_nodes,
    held_locals,
    hf_model_input_nodes,
    hf_model_inputs,
    hf_norm_node,
    hf_rope_node,
    masked_kv_dtypes,
)
from memtrain.analysis.estimate.params import has_bias, head_widths, lora_adapted, lora_split
from memtrain.analysis.estimate.simulator import Compression, Node, Segment
from memtrain.config.archs import Arch
from memtrain.config.run import ModelConfig, RunConfig, TechniqueConfig
from memtrain.techniques.facts import (
    NF4_BLOCK,
    aligned_vocab,
    cce_forward_locks,
    cce_lock_table_shape,
    checkpoint_policy,
    effective_loss_chunk,
    fp8_converts,
    nf4_quantizes,
    precision_facts,
)

# The step's int64 token ids as the memory meter sees them (docs/estimation.md, "Token ids"):
# made by the data loader outside the meter, each is counted from the first op that shows it
# (a view: GPT-2's input_ids.view, the loss's targets.reshape) until the step's list of
# micro-batches goes, after the optimizer step. Pinned keys: never freed within the step.
INPUT_IDS = "input_ids"
TARGETS = "targets"
TOKEN_KEYS = (INPUT_IDS, TARGETS)


def token_id_bytes(dm: "Dims", arch: Arch) -> float:
    """Bytes of one micro-batch's token ids the meter counts: the labels (b x s x 8), and the
    inputs too where the model views them (GPT-2's ``input_ids.view``)."""
    return dm.n * 8 * (2 if arch.gpt2_layers else 1)


# --------------------------------------------------------------------------- node builders
@dataclass
class Dims:
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
    # Whether ``dropout`` also drops the embedding and the residual branches (our GPT's and GPT-2's
    # layers) rather than the attention weights alone (a Llama-style transformers layer: its
    # config's attention_dropout is its only dropout).
    branch_dropout: bool = True
    bias: bool = True
    # FSDP2 under autocast gathers weights already in the compute dtype: autocast casts nothing
    # (no cached copies) and the gathered weights are counted by the sharding rule instead.
    weights_in_compute_dtype: bool = False
    hf: bool = False  # a transformers decoder layer (Arch.hf; memtrain.analysis.estimate.hf)
    fp8: bool = False  # --precision fp8: block Linears are torchao Float8Linears (_fp8_linear)
    # Phi-3's layers (Arch.fused_proj): v is a slice of the fused q/k/v output, and rope's cat
    # makes q contiguous as (b, h, s, hd), so SDPA's output is laid out that way too.
    fused_proj: bool = False
    # --lora-dropout > 0: peft drops each adapter's input before lora_A (_lora_dropout).
    lora_dropout: bool = False
    # The eager attention's softmax runs in float32 outside autocast too (Llama's
    # ``softmax(dtype=float32)``); GPT-2's runs in the scores' dtype (float32 under autocast only).
    softmax_fp32: bool = True
    # The attention mask is added as a float tensor, nothing saved (transformers' layers), rather
    # than applied by a masked_fill that saves its bool mask (our GPT).
    additive_mask: bool = False
    # transformers' Llama-style eager attention repeats the k/v heads (repeat_kv) before the
    # scores and holds the copies until it returns.
    repeat_kv: bool = False
    # Width of q and of the attention's output (n_heads x head_dim) where it is not d (a
    # transformers config's head_dim: Arch.head_dim); 0: d.
    hq: int = 0
    # --qlora: a frozen Linear whose weight fits torchao's blocks holds it in NF4 and runs
    # torchao's linear_nf4 (_nf4_linear).
    qlora: bool = False
    # transformers hands SDPA its windowed bool mask instead of ``is_causal`` (a sliding window no
    # longer than the sequence, --attention sdpa): k and v repeated to the q heads, a float copy of
    # the mask per layer, both saved, as the CPU kernels do (_masked_sdpa_nodes; on CUDA kernels
    # hf.why_not_modelled traces the step).
    masked_sdpa: bool = False
    # Eager attention in a Qwen2 model with a sliding layer (Arch.full_mask_beside_window): the model
    # makes the full causal mask beside the windowed one (hf_nodes.FULL_MASK), until it returns.
    full_mask: bool = False
    # ... and some layers attend in full (Arch.layer_slides, in layer order): each layer is handed its
    # kind's mask, the full ones FULL_MASK, so a checkpointed layer keeps that one until its backward.
    layer_slides: tuple[bool, ...] = ()

    @property
    def n(self) -> int:
        return self.b * self.s

    @property
    def qw(self) -> int:
        """The width of q and of the attention's output (the output projection's input)."""
        return self.hq or self.d


def _rename_key(nodes: list[Node], old: str, new: str) -> None:
    """Let ``new`` name the storage ``old`` named (an op that allocates nothing)."""
    for n in nodes:
        n.out = [(new,) + tuple(o[1:]) if o[0] == old else o for o in n.out]
        n.inputs = [new if k == old else k for k in n.inputs]
        n.saves = [new if k == old else k for k in n.saves]
        n.grads = [(new if k == old else k, v) for k, v in n.grads]
        if n.grad_out is not None:
            n.grad_out = tuple(new if k == old else k for k in n.grad_out)


def fp8_cast_bytes(numel: float, hp_bytes: float) -> float:
    """The most a torchao dynamic FP8 cast of a ``numel``-element tensor in ``hp_bytes``-byte
    elements holds at once, eager (torchao.float8.float8_training_tensor._ToFloat8ConstrFunc):
    its FP32 copy (none for an FP32 tensor), the scaled copy, the clamped copy
    (float8_utils.to_fp8_saturated) and the 1-byte result."""
    return numel * ((4 if hp_bytes != 4 else 0) + 4 + 4 + 1)


def _fp8_linear(nodes: list[Node], dm: Dims, name: str, x: str, out: str, n_in: int, n_out: int,
                trainable_base: bool, x_bytes: float, bias: bool, copies: int) -> None:
    """A torchao Float8Linear (``--precision fp8``), eager. Its forward casts the input to the
    autocast dtype (as autocast would) and saves that copy and the FP32 weight itself
    (``ctx.save_for_backward(input_hp, weight_hp_t)``): no autocast weight copy is kept. The FP8
    casts of input and weight live only through the matmul; backward casts the output gradient
    twice (one per gradient matmul), the weight and the input again, and keeps them, with the
    BF16 weight gradient, until it returns (they are its locals)."""
    N, a, p = dm.n, dm.a, dm.p
    w, bname = f"param:{name}.weight", f"param:{name}.bias"
    if x_bytes != a:
        nodes.append(Node(f"{name}.cast_x", out=[(f"{x}@{name}", N * n_in * a * copies)], inputs=[x],
                           grads=[(x, N * n_in * x_bytes)]))
        x = f"{x}@{name}"
    x8, w8, go8 = N * n_in, n_in * n_out, N * n_out  # bytes of the FP8 copies
    fwd = max(fp8_cast_bytes(N * n_in, a), x8 + fp8_cast_bytes(n_in * n_out, p))
    bwd = max(fp8_cast_bytes(N * n_out, a), go8 + fp8_cast_bytes(n_in * n_out, p),
              go8 + w8 + fp8_cast_bytes(N * n_out, a), 2 * go8 + w8 + fp8_cast_bytes(N * n_in, a),
              2 * go8 + w8 + x8 + n_in * n_out * a)
    grads = [(x, N * n_in * a)]
    if trainable_base:
        grads.append((w, 0.0))
        if bias:
            grads.append((bname, 0.0))
    nodes.append(Node(name, out=[(out, N * n_out * a)], inputs=[x], saves=[x], grads=grads, matmul=True,
                       fwd_scratch=fwd, scratch=bwd))


def nf4_dequantize_steps(numel: int, elt: float) -> list[tuple[str, str, float]]:
    """torchao's ``NF4Tensor.get_original_weight`` of a ``numel``-value weight whose dtype has
    ``elt``-byte elements, tensor by tensor (:class:`Node` ``fwd_steps``): the high and the low
    4-bit codes (``quantized_data >> 4`` and ``& 0b1111``, uint8, numel / 2 each) cast to int64
    indices, which stay (locals) until it returns; the table lookups ``nf4[codes]``; the scales
    (``quantized_scalers / quantization_factor`` + ``scaler_mean``, one per 64-value block); the
    scales repeated for each half (``expand(...).flatten()``: a copy per multiply) and the two scaled
    halves; ``torch.stack`` of those, the dequantized weight (label ``"w"``), which is all that is
    left when it returns."""
    n, half, scales = float(numel), numel / 2 * elt, numel / NF4_BLOCK * elt
    steps: list[tuple[str, str, float]] = [
        ("alloc", "hi", n / 2), ("alloc", "hi64", 4 * n), ("free", "hi", 0.0),
        ("alloc", "lo", n / 2), ("alloc", "lo64", 4 * n), ("free", "lo", 0.0),
        ("alloc", "dq_hi", half), ("alloc", "dq_lo", half),
        ("alloc", "scale_div", scales), ("alloc", "scales", scales), ("free", "scale_div", 0.0),
        ("alloc", "rep_hi", half), ("alloc", "scaled_hi", half), ("free", "rep_hi", 0.0),
        ("alloc", "rep_lo", half), ("alloc", "scaled_lo", half), ("free", "rep_lo", 0.0),
        ("alloc", "w", n * elt)]
    return steps + [("free", k, 0.0) for k in ("hi64", "lo64", "dq_hi", "dq_lo", "scales", "scaled_hi", "scaled_lo")]


def _steps_peak(steps: list[tuple[str, str, float]]) -> float:
    """The most bytes ``fwd_steps``-style ``steps`` hold at once."""
    live: dict[str, float] = {}
    top = 0.0
    for op, label, nbytes in steps:
        if op == "alloc":
            live[label] = live.get(label, 0.0) + nbytes
        elif op == "free":
            live.pop(label, None)
        top = max(top, sum(live.values()))
    return top


def _runs_nf4(dm: Dims, trainable_base: bool, n_in: int, n_out: int) -> bool:
    """Whether a frozen ``n_in`` x ``n_out`` Linear holds its weight in NF4 under --qlora and runs
    torchao's LinearNF4 (:func:`_nf4_linear`): its weight fits torchao's blocks."""
    return dm.qlora and not trainable_base and nf4_quantizes(n_in * n_out)


def _nf4_linear(nodes: list[Node], dm: Dims, name: str, x: str, out: str, n_in: int, n_out: int, x_bytes: float,
                *, bias: bool, input_grad: bool, param_name: str) -> float:
    """A frozen Linear with an NF4 weight (``--qlora``): ``F.linear`` dispatches to torchao's
    ``LinearNF4`` (nf4_tensor.py), whose forward is ``F.linear(x, w.to(x.dtype))`` with
    ``ctx.save_for_backward(w)`` and whose backward is ``grad @ w.to(grad.dtype)``. Each call
    dequantizes the weight (:func:`nf4_dequantize_steps`, in the dtype it was quantized from) and
    casts it to the input's dtype; under autocast ``F.linear`` then casts the input and that copy to
    the compute dtype (a tensor that requires no grad: not cached). The function saves only the NF4
    parameter (no storage of its own), and only when ``x`` requires a gradient; it packs it as
    forward returns, so a checkpoint's recompute that stops at it runs it whole
    (``Node.packs_after_forward``). Backward dequantizes again (a frozen weight gets no gradient)
    and autograd casts the input's gradient to ``x``'s dtype. A bias is added after the function
    (``out + bias``), a new tensor; under autocast the bias is float32 and the sum too. Returns the
    bytes per element of the Linear's output."""
    N, a, p = dm.n, dm.a, dm.p
    numel = n_in * n_out
    deq = nf4_dequantize_steps(numel, p)
    fwd = list(deq)
    if x_bytes != p:  # weight.to(input.dtype)
        fwd += [("alloc", "wx", numel * x_bytes), ("free", "w", 0.0)]
    if dm.autocast:  # F.linear's autocast casts, input then weight
        if x_bytes != a:
            fwd.append(("alloc", "xc", N * n_in * a))
            fwd.append(("alloc", "wc", numel * a))
    fwd.append(("outputs", "", 0.0))
    mm_out = f"{out}.nf4" if bias else out
    g_out_bytes = N * n_in * a  # grad @ w: in the output's dtype
    g_x = N * n_in * x_bytes
    # Backward: the dequantization (and the cast to the gradient's dtype) before the matmul, then
    # the matmul's output beside the weight, then autograd's cast of it to x's dtype.
    before = _steps_peak(deq + ([("alloc", "wa", numel * a), ("free", "w", 0.0)] if p != a else []))
    after = max(numel * a + g_out_bytes - g_x, g_out_bytes if x_bytes != a else 0.0, 0.0)
    nodes.append(Node(name, out=[(mm_out, N * n_out * a)], inputs=[x],
                      saves=[f"param:{param_name}.weight"] if input_grad else [],
                      grads=[(x, g_x)] if input_grad else [], matmul=True, fwd_steps=tuple(fwd),
                      scratch_first=before, scratch=after, packs_after_forward=True))
    if not bias:
        return a
    # ``out + bias``, the bias frozen (no gradient for it). Type promotion: under autocast the
    # bf16 product plus the float32 bias is float32, and the product's gradient a bf16 copy of
    # the sum's; otherwise the gradient passes through.
    ob = max(a, p)
    nodes.append(Node(f"{name}.bias_add", out=[(out, N * n_out * ob)], inputs=[mm_out],
                      grads=[(mm_out, 0.0 if ob == a else N * n_out * a)]))
    return ob


def _linear(nodes: list[Node], dm: Dims, name: str, x: str, out: str, n_in: int, n_out: int,
            trainable_base: bool, lora: int, x_bytes: float, *, bias: Optional[bool] = None,
            lora_parts: tuple[str, ...] = ("",), input_grad: bool = True, param_name: Optional[str] = None,
            x_requires_grad: Optional[bool] = None, param_share: float = 1.0) -> None:
    """A Linear layer: autocast casts of input/weight/bias, the matmul, LoRA adapters.
    ``bias``: this Linear's (default: the model's rule, ``dm.bias``); ``lora_parts``: the name
    suffixes of the Linears the entry stands for (:func:`lora_split`), one adapter pair each;
    ``input_grad``: whether ``x`` requires a gradient (False only for a transformers model's
    first q/k/v under LoRA, whose input comes from the frozen embedding through a frozen norm);
    ``param_name``: the table entry its parameters belong to (default ``name``; one Linear of
    a fused entry names its nodes apart); ``x_requires_grad``: whether autograd really records a
    gradient for ``x`` (default ``input_grad``; our GPT models its first q/k/v as taking one);
    ``param_share``: the share of the entry's parameters this Linear's are (one of a fused entry's:
    its .grads are made apart, :attr:`Node.param_share`)."""
    N, a = dm.n, dm.a
    bias = dm.bias if bias is None else bias
    if dm.fp8 and not lora and fp8_converts(n_in, n_out):
        # (--precision fp8 refuses LoRA; a fused entry's parts are taken to divide by 16 as it does.)
        _fp8_linear(nodes, dm, name, x, out, n_in, n_out, trainable_base, x_bytes, bias, len(lora_parts))
        return
    if _runs_nf4(dm, trainable_base, n_in, n_out):
        base_out = f"{out}.base" if lora else out
        out_bytes = _nf4_linear(nodes, dm, name, x, base_out, n_in, n_out, x_bytes, bias=bias, input_grad=input_grad,
                                param_name=param_name or name)
        if lora:
            _peft_lora(nodes, dm, name, x, x_bytes, base_out, out, n_in, n_out, lora, lora_parts, input_grad,
                       param_name or name, out_bytes=out_bytes)
        return
    n_linears = len(lora_parts)  # the separate Linears this entry stands for
    # autograd saves a matmul's input only for the weight's gradient: a frozen base weight
    # (our GPT's or a transformers layer's, under LoRA) keeps none; the adapters' lora_A saves
    # the input it reads itself.
    keeps_input = trainable_base
    # autocast caches its casts of leaf tensors that require grad only: a frozen base weight is
    # cast at each call, and the copy lives only as long as the matmul keeps it, which it does
    # for the input's gradient alone (the cast's ``hold`` below: cached only for a trainable one).
    keeps_weight = trainable_base or input_grad
    x_own, x_own_bytes = x, x_bytes  # the Linear's own input (peft hands it to the adapters)
    param_name = param_name or name
    w, bname = f"param:{param_name}.weight", f"param:{param_name}.bias"
    w_in = w
    if dm.autocast:
        # autocast casts the fp32 weight once per forward and caches the copy until the
        # autocast region ends; the copy is what the matmul saves for backward.
        nodes.append(Node(f"{name}.cast_w", out=[(f"{name}.wc", 0.0 if dm.weights_in_compute_dtype else n_in * n_out * a)],
                           hold=trainable_base, grads=[(w, 0.0)] if trainable_base else [], param_share=param_share))
        w_in = f"{name}.wc"
        if bias:
            nodes.append(Node(f"{name}.cast_b", out=[(f"{name}.bc", 0.0 if dm.weights_in_compute_dtype else n_out * a)],
                               hold=trainable_base, grads=[(bname, 0.0)] if trainable_base else [],
                               param_share=param_share))
        if x_bytes != a:
            # autocast caches the casts of leaf weights only: each Linear casts its input
            # itself, and its matmul saves that copy (q, k and v: three copies of one input).
            # (A frozen transformers Linear keeps no input: its casts live one at a time.)
            copies = n_linears if keeps_input else 1
            nodes.append(Node(f"{name}.cast_x", out=[(f"{x}@{name}", N * n_in * a * copies)], inputs=[x],
                               grads=[(x, N * n_in * x_bytes)] if input_grad else []))
            x = f"{x}@{name}"
    base_out = f"{out}.base" if lora else out
    grads = [(x, N * n_in * a)] if input_grad else []
    if trainable_base:
        grads.append((w_in, n_in * n_out * a if dm.autocast else 0.0))
        if bias:
            grads.append((f"{name}.bc" if dm.autocast else bname, n_out * a if dm.autocast else 0.0))
    extra = [w_in] if dm.autocast else []
    # Without autocast the matmul saves the parameter itself for the input's gradient: no new
    # storage, but a save all the same, which is what makes a checkpointed layer's backward
    # recompute when it reaches this op (a frozen Linear whose input requires a gradient).
    weight_saved = extra if dm.autocast else [w_in]
    nodes.append(Node(name, out=[(base_out, N * n_out * a)], inputs=[x] + extra,
                       saves=([x] if keeps_input else []) + (weight_saved if keeps_weight else []), grads=grads, matmul=True,
                       sums_out_of_place=_adapter_grad_is_a_view(dm, lora), param_share=param_share))
    # Under autocast peft's adapters on our GPT (float32, as on a transformers base) make the
    # casts _peft_lora counts: a bf16 input's float32 copy, lora_A's own bf16 copy of its input
    # (the base's cast is another) and the adapters' cached weight copies.
    if lora and (dm.hf or dm.autocast):
        _peft_lora(nodes, dm, name, x_own, x_own_bytes, base_out, out, n_in, n_out, lora, lora_parts, input_grad,
                   param_name)
    elif lora:
        # memtrain's LoRA: out = base(x) + lora_B(lora_A(x)) * scale. The adapters are float32;
        # under autocast they compute in the autocast dtype, on a bf16-pure base x is cast up to
        # float32 for them and the result back down.
        ad = 4 if (not dm.autocast and a != 4) else a
        la, lb = f"{name}.lora_a", f"{name}.lora_b"
        xa = x
        if ad != a:
            nodes.append(Node(f"{name}.lora_cast", out=[(f"{x}@lora", N * n_in * ad)], inputs=[x],
                               grads=[(x, N * n_in * a)]))
            xa = f"{x}@lora"
        # One A product per Linear the entry stands for (q, k, v each read x); the B products
        # together are as wide as the fused output.
        n_a = len(lora_parts)
        if dm.lora_dropout:
            keep_mask = input_grad if x_requires_grad is None else x_requires_grad
            xa = _lora_dropout(nodes, dm, name, xa if ad != a else x_own, 4 if ad != a else x_own_bytes, n_in, n_a,
                               keep_mask)
        nodes.append(Node(la, out=[(la, N * lora * ad * n_a)], inputs=[xa], saves=[xa], matmul=True,
                           grads=[(xa, N * n_in * ad)] + [(f"param:{name}.lora_A{s}", 0.0) for s in lora_parts]))
        nodes.append(Node(lb, out=[(lb, N * n_out * ad)], inputs=[la], saves=[la], matmul=True,
                           grads=[(la, N * lora * ad * n_a)] + [(f"param:{name}.lora_B{s}", 0.0) for s in lora_parts]))
        nodes.append(Node(f"{name}.lora_scale", out=[(f"{lb}.s", N * n_out * ad)], inputs=[lb],
                           grads=[(lb, N * n_out * ad)]))
        src = f"{lb}.s"
        # peft's forward holds its argument x (the caller's) and its cast for the adapters (the
        # rebound local x) until it returns.
        held = [x_own] + ([f"{x}@lora"] if ad != a else [])
        if ad != a:
            # The bf16 base output plus the float32 product promotes to a float32 sum, which peft
            # casts back; in backward the add casts the sum's gradient down for the base, a new
            # tensor beside the adapters' (a checkpointed block's lazy recompute starts after it:
            # -1.3% backward without it, bf16-pure, LoRA, window 2).
            nodes.append(Node(f"{name}.lora_add", out=[(f"{out}.f", N * n_out * ad)], inputs=[base_out, src],
                              grads=[(base_out, N * n_out * a), (src, 0.0)]))
            nodes.append(Node(f"{name}.lora_back", out=[(out, N * n_out * a)], inputs=[f"{out}.f"] + held,
                              grads=[(f"{out}.f", N * n_out * ad)]))
        else:
            nodes.append(Node(f"{name}.lora_add", out=[(out, N * n_out * a)], inputs=[base_out, src] + held,
                              grads=[(base_out, 0.0), (src, 0.0)]))


def _adapter_grad_is_a_view(dm: Dims, lora: int) -> bool:
    """Whether our GPT's LoRA Linear gets its input's two gradients summed out of place: in
    float32 without LoRA dropout lora_A reads x itself, and its gradient for x (a view of its
    matmul's output, as any 3-d matmul's input gradient is) arrives first. autograd adds in
    place only into a tensor it holds the last reference to, so the base's gradient and their
    sum are new tensors next to it (a cast or a dropout in between hands over a fresh one)."""
    return bool(lora) and not dm.hf and not dm.autocast and dm.a == 4 and not dm.lora_dropout


def _lora_dropout(nodes: list[Node], dm: Dims, name: str, x: str, x_bytes: float, n_in: int, n_a: int,
                  keep_mask: bool, adapter_bytes: float = 4) -> str:
    """peft's ``lora_A(dropout(x.to(A.dtype)))``; returns the key lora_A reads and saves.
    ``x``: the adapters' input as it reaches peft (``x_bytes`` per element); ``adapter_bytes``:
    the adapters' dtype (our GPT's are float32). peft casts x to it first (a new tensor only
    when the dtypes differ, which lives only through the dropout); the dropout's output is a
    new tensor in the adapters' dtype, and its
    backward keeps the mask (:func:`_dropout`: CUDA's bool mask, the CPU kernel's float noise)
    only when ``x`` requires a gradient (``keep_mask``).
    Under autocast lora_A casts the dropped copy to the compute dtype and saves that copy (the
    adapters'-dtype one is then freed); otherwise it saves the dropped copy itself. One of each
    per adapted Linear the entry stands for."""
    N, numel, ad = dm.n, dm.n * n_in * n_a, adapter_bytes
    src = x
    if x_bytes != ad:
        src = f"{x}@{name}.lora_in"
        nodes.append(Node(f"{name}.lora_up", out=[(src, numel * ad)], inputs=[x],
                           grads=[(x, N * n_in * x_bytes)] if keep_mask else []))
    dropped, mask = f"{name}.lora_drop", f"{name}.lora_drop.mask"
    nodes.append(Node(f"{name}.lora_dropout", out=[(dropped, numel * ad), (mask, numel * (1 if dm.cuda else ad))],
                       inputs=[src], saves=[mask] if keep_mask else [], grads=[(src, numel * ad)] if keep_mask else []))
    if not dm.autocast:
        return dropped
    cast = f"{dropped}@{name}"
    nodes.append(Node(f"{name}.lora_cast_drop", out=[(cast, numel * dm.a)], inputs=[dropped],
                       grads=[(dropped, numel * ad)] if keep_mask else []))
    return cast


def _peft_lora(nodes: list[Node], dm: Dims, name: str, x: str, x_bytes: float, base_out: str, out: str,
               n_in: int, n_out: int, r: int, parts: tuple[str, ...], input_grad: bool, param_name: str,
               out_bytes: Optional[float] = None) -> None:
    """peft's LoRA Linear on a transformers base (``x``: the Linear's own input, before any
    autocast cast): ``base(x) + lora_B(lora_A(x.to(A.dtype))) * scale``. The adapters have the
    parameters' dtype (float32 under autocast, bf16 under bf16-pure). ``out_bytes``: the base's
    output element size where it is not the compute dtype's (a float32 sum under autocast: the
    result is float32 too, and the adapters' branch gets a bf16 copy of its gradient)."""
    N, a = dm.n, dm.a
    n_a = len(parts)  # one adapter pair per Linear the entry stands for (q, k, v)
    la, lb = f"{name}.lora_a", f"{name}.lora_b"
    # The Linear's input lives until the Linear returns (the caller holds it), peft's float32
    # copy of it too: both outlive the adapters' products.
    xa, until_return = x, [x]
    w_a: list[str] = []
    w_b: list[str] = []
    if dm.autocast:
        src = x
        if x_bytes != 4:
            # peft casts x to the adapters' float32 first: a new tensor when x is bf16 (the
            # attention output into o_proj, the SwiGLU product into down_proj), which its
            # forward keeps in a local until the Linear returns.
            src = f"{x}@{name}.lora32"
            nodes.append(Node(f"{name}.lora_up", out=[(src, N * n_in * 4)], inputs=[x],
                               grads=[(x, N * n_in * x_bytes)] if input_grad else []))
            until_return.append(src)
        # lora_A's autocast casts that float32 input to bf16, once per adapted Linear (q, k and
        # v each), and saves the copy for A's gradient; the bf16 input x itself, if nothing
        # else saves it, is freed (its copy is what stays).
        if dm.lora_dropout:
            # peft drops that float32 input; lora_A casts and saves the dropped copy instead.
            xa = _lora_dropout(nodes, dm, name, src, 4, n_in, n_a, input_grad)
        else:
            xa = f"{x}@{name}.lora"
            nodes.append(Node(f"{name}.lora_cast_x", out=[(xa, N * n_in * a * n_a)], inputs=[src],
                               grads=[(src, N * n_in * 4)] if input_grad else []))
        # The adapters are leaves that require grad: autocast caches their bf16 copies until
        # the forward ends. lora_B's matmul saves its copy (for the gradient of A's output),
        # lora_A's only when its input needs a gradient.
        w_a, w_b = [f"{name}.lora_wa"], [f"{name}.lora_wb"]
        nodes.append(Node(f"{name}.lora_cast_w", out=[(w_a[0], n_a * r * n_in * a), (w_b[0], r * n_out * a)],
                           hold=True))
    elif dm.lora_dropout:
        xa = _lora_dropout(nodes, dm, name, x, x_bytes, n_in, n_a, input_grad, adapter_bytes=dm.p)
    nodes.append(Node(la, out=[(la, N * r * a * n_a)], inputs=[xa] + w_a, saves=[xa] + (w_a if input_grad else []),
                       matmul=True, grads=([(xa, N * n_in * a)] if input_grad else [])
                       + [(f"param:{param_name}.lora_A{s}", 0.0) for s in parts]))
    nodes.append(Node(lb, out=[(lb, N * n_out * a)], inputs=[la] + w_b, saves=[la] + w_b, matmul=True,
                       grads=[(la, N * r * a * n_a)] + [(f"param:{param_name}.lora_B{s}", 0.0) for s in parts]))
    nodes.append(Node(f"{name}.lora_scale", out=[(f"{lb}.s", N * n_out * a)], inputs=[lb],
                       grads=[(lb, N * n_out * a)]))
    ob = out_bytes or a
    nodes.append(Node(f"{name}.lora_add", out=[(out, N * n_out * ob)], inputs=[base_out, f"{lb}.s"] + until_return,
                       grads=[(base_out, 0.0), (f"{lb}.s", 0.0 if ob == a else N * n_out * a)]))


def _dropout(nodes: list[Node], dm: Dims, name: str, x: str, out: str, numel: float, elt: float,
             requires_grad: bool = True, attention: bool = False) -> None:
    """Dropout in training: the CPU kernel keeps a float noise tensor (input dtype) for
    backward, CUDA's fused kernel a bool mask; either way the output is a new tensor. Without
    dropout the op returns its input: ``out`` is another name for ``x``. ``requires_grad``:
    whether ``x`` needs a gradient; when it does not (a frozen embedding's output under LoRA)
    autograd records nothing and the mask is freed with the op. ``attention``: the attention
    weights' dropout, the only one a Llama-style layer has (``Dims.branch_dropout``)."""
    if not dm.dropout or not (attention or dm.branch_dropout):
        _rename_key(nodes, x, out)
        return
    mask = f"{name}.mask"
    # (The CPU kernel draws the noise, then multiplies: the product saves the noise before the
    # output exists, where a lazy recompute that stops at this op stops. CUDA's one kernel makes both.)
    nodes.append(Node(name, out=[(out, numel * elt), (mask, numel * (1 if dm.cuda else elt))],
                       inputs=[x], saves=[mask] if requires_grad else [],
                       grads=[(x, numel * elt)] if requires_grad else [],
                       made_before_save=() if dm.cuda else (mask,)))


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
    if float_scores and _float32_weights_dropped(dm, kind):
        # A Llama-style layer under autocast: ``.to(query.dtype)`` keeps the float32 softmax
        # (rope's float32 query), so the attention dropout runs on it in float32 (its output and
        # the CPU kernel's noise), and the second matmul's autocast casts the dropped weights.
        _dropout(nodes, dm, f"{p}.attn_drop", src, f"{p}.pd", sc, 4, attention=True)
        nodes.append(Node(f"{p}.tocast", out=[(f"{p}.pa", sc * a)], inputs=[f"{p}.pd"], grads=[(f"{p}.pd", sc * 4)]))
        return f"{p}.pa"
    if float_scores:
        nodes.append(Node(f"{p}.tocast", out=[(f"{p}.pa", sc * a)], inputs=[src], grads=[(src, sc * 4)]))
        src = f"{p}.pa"
    _dropout(nodes, dm, f"{p}.attn_drop", src, f"{p}.pd", sc, a, attention=True)
    return f"{p}.pd"


def _float32_weights_dropped(dm: Dims, kind: str) -> bool:
    """Whether a transformers Llama-style eager attention drops its float32 softmax output under
    autocast (the weights its layer then holds: :func:`_hf_layer_locals`)."""
    return kind == "math" and dm.repeat_kv and dm.autocast and dm.a != 4 and dm.dropout and not dm.cuda


def _attention_nodes(nodes: list[Node], dm: Dims, p: str, kind: str, window: Optional[int],
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


def _norm_stats_bytes(dm: Dims, layer: bool) -> float:
    """Bytes of a norm's saved statistics: LayerNorm's mean and rstd per token, RMSNorm's rstd.
    The CPU LayerNorm kernel makes them in its input's dtype where the weights share it (bf16-pure:
    2 bytes; +1.4% forward over the trace at 4 bytes, 7 layers of width 12), float32 otherwise
    (autocast runs it in float32) and on CUDA."""
    if not layer:
        return dm.n * 4
    return 2 * dm.n * (4 if dm.cuda else dm.r)


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
    _rename_key(nodes, o, y)
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


def _math_path_reads(dm: Dims, p: str, kind: str, upcast: bool, gqa_v: Optional[str], qk_saves: list[str],
                     v_saved: list[str]) -> tuple[list[str], list[str], bool, bool, Optional[str]]:
    """What the materialized attention's matmuls read in place rather than copy (:func:`_attention_nodes`):
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
    """transformers' eager attention of a Llama-style layer (:func:`_attention_nodes`' arguments),
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
    k_src = f"{qkv}.locals" if kv_locals[0] else qkv
    k_saved = f"{p}.kc16" if k_cast else (k_src if in_place or (own_fold and not kv_locals[0]) else
                                           (f"{p}.kt" if view_kv else f"{p}.kc"))
    if repeated:
        nodes.append(Node(f"{p}.repeat_k", out=[(f"{p}.kc", 0.0 if view_kv else N * d * (4 if k_cast else a))],
                           inputs=[qkv], grads=[(k, N * kvw * a)] if k_grad else []))
        nodes.append(Node(f"{p}.repeat_v", out=[(f"{p}.vc", 0.0 if view_kv else N * d * a)], inputs=[qkv],
                           grads=[(v, N * kvw * a)] if v_grad else []))
        if in_place:
            v_saved = qkv_keys
        elif view_kv:
            v_saved = [f"{p}.vt"]
    if view_kv and not in_place and not k_cast:
        nodes.append(Node(f"{p}.kcopy", out=[(f"{p}.kt", N * d * a)], inputs=[qkv]))
    # Each matmul keeps one operand's copy for the other operand's gradient: q's (``qc``,
    # not otherwise held) only when k requires one, k's only when q does; the
    # probabilities only when v requires one, v's copy only when they do.
    # (At batch 1 the matmul reads rope's q in place too: ``qc`` is q itself, kept by ``qkv``'s
    # save there, unless autocast casts a float32 q.)
    q_bytes = 0.0 if (in_place or own_fold) and not kv_locals[0] else N * d * a
    nodes.append(Node(f"{p}.qk", out=[(f"{p}.qc", q_bytes)] + ([] if repeated else [(f"{p}.kc", q_bytes)])
                       + ([(k_saved, N * d * a)] if k_cast else [])
                       + [(f"{p}.s0", sc * a)], inputs=[qkv] + ([f"{p}.kc"] if repeated else [])
                       + ([k_saved] if k_saved == f"{p}.kt" else []),
                       saves=[f"{p}.qc"] * k_grad + [k_saved] * q_grad, matmul=True, grad_out=(f"{p}.s0",),
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


def _held_by_the_frame(nodes: list[Node], dm: Dims, lora: int, *held: str) -> None:
    """Our GPT's CausalSelfAttention.forward and MLP.forward hold their argument, the norm's
    output (the first of ``held``), and their locals (the rest) until they return (their last
    op: ``nodes[-1]``). No op may save them (under LoRA a frozen norm and base, under autocast
    the Linear's cast copy, under checkpointing nothing in the forward), yet they live through
    the attention or the MLP, in the forward and in a checkpoint's recompute."""
    # Without LoRA, on CPU kernels only (the H100 measurements: see _attention_nodes' math_attention).
    if not dm.hf and (lora or not dm.cuda):
        nodes[-1].inputs += held


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
        nodes.append(Node(name, out=[(out, N * d * r), (f"{name}.stats", _norm_stats_bytes(dm, layer))],
                           inputs=[src], saves=[src, f"{name}.stats"] if recorded else [], grad_out=(out,),
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
            _linear(nodes, dm, name, src, out, n_in, n_out, trainable_base, rank, src_bytes, bias=bias,
                    lora_parts=suffixes, input_grad=src_grad)
            return
        rank = lora if (short, part) in adapted else 0
        width = dict(split)[part]
        _linear(nodes, dm, name + part, src, out + part, n_in, width, trainable_base, rank, src_bytes,
                bias=bias, lora_parts=(part,), input_grad=src_grad, param_name=name, param_share=width / n_out)

    # With peft's adapters a transformers layer's separate Linears (q, k, v; gate, up) are
    # simulated one after the other: each one's LoRA tail (base output, B product, its scaled
    # copy, their sum) lives while the earlier ones' outputs do, not all of them at once. (The
    # frozen base's outputs alone sum to the fused one's, which stands for them otherwise.)
    per_linear = dm.hf and bool(lora) and not (arch.fused_proj or arch.gpt2_layers)
    # (A float32 v: QLoRA's bias added after the NF4 matmul, in float32.)
    v32 = per_linear and arch.qkv_bias and _runs_nf4(dm, trainable_base, d, dm.kv)
    norm(f"{p}.ln_1", x, f"{p}.ln1", needs["in"])
    # Without adapters too, each of q_proj, k_proj and v_proj makes its own .grad in its own
    # backward (a 16-bit one cast to the float32 parameter's dtype under autocast, then gone):
    # one fused entry would hold the three 16-bit gradients at once. (--precision fp8's
    # Float8Linear keys its parameters by the Linear's own name: its entries stay fused.)
    per_qkv = per_linear or (dm.hf and not dm.fp8 and not (arch.fused_proj or arch.gpt2_layers))
    if per_qkv:
        for part in (".q", ".k", ".v"):
            lin("qkv", f"{p}.attn.qkv", f"{p}.ln1", f"{p}.qkv0", d, dm.qw + 2 * dm.kv, r, needs["in"], part)
        nodes.append(hf_rope_node(dm, [f"{p}.qkv0.q", f"{p}.qkv0.k", f"{p}.qkv0.v"], f"{p}.qkv",
                                  kernel_casts=tech.attention == "math", v32=v32))
    else:
        rope = dm.hf and arch.positional == "rope"
        lin("qkv", f"{p}.attn.qkv", f"{p}.ln1", f"{p}.qkv0" if rope else f"{p}.qkv", d, dm.qw + 2 * dm.kv, r,
            needs["in"])
        if rope:
            nodes.append(hf_rope_node(dm, [f"{p}.qkv0"], f"{p}.qkv", v_view=arch.fused_proj,
                                      kernel_casts=tech.attention == "math"))
    start = len(nodes)
    # A transformers layer's window is in the mask the model builds (hf_model_input_nodes), not in
    # memtrain's banded kernel: its eager attention is the unwindowed one for memory.
    window = None if dm.hf else tech.window
    # Rope's float32 q and k under autocast (and a float32 v32) are the attention's locals, apart
    # from ``{p}.qkv`` (hf_nodes.held_locals).
    rope_locals = dm.hf and arch.positional == "rope" and held_locals(dm)
    _attention_nodes(nodes, dm, p, tech.attention, window, v_src=f"{p}.qkv0" if arch.fused_proj else None,
                     qkv_grad=(needs["qkv.q"], needs["qkv.k"], needs["qkv.v"]),
                     kv_bytes=masked_kv_dtypes(dm, per_linear, v32), kv_locals=(rope_locals, rope_locals and v32))
    # The attention core is what model.attn_fn computes: everything after the q/k/v split up
    # to the (b, h, s, hd) output; the merge (transpose + contiguous) is outside it.
    for n in nodes[start + 1:]:
        n.core = not n.name.endswith(".merge")
    lin("proj", f"{p}.attn.proj", f"{p}.y", f"{p}.pr", dm.qw, d, a, needs["attn"])
    if dm.hf:
        nodes[-1].inputs += _hf_attention_locals(dm, p, arch, rope_locals, tech.attention)
    _dropout(nodes, dm, f"{p}.resid_drop", f"{p}.pr", f"{p}.prd", N * d, a)
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
    _dropout(nodes, dm, f"{p}.mlp_drop", f"{p}.h2", f"{p}.h2d", N * d, a)
    _held_by_the_frame(nodes, dm, lora, f"{p}.ln2")
    nodes.append(Node(f"{p}.add2", out=[(f"blocks.{i + 1}.in", N * d * r)], inputs=[f"{p}.x1", f"{p}.h2d"],
                       grads=[(f"{p}.x1", 0.0), (f"{p}.h2d", 0.0 if a == r else N * d * a)]))
    if dm.hf:
        dropped32 = _float32_weights_dropped(dm, tech.attention)  # (the weights held: the dropped ones)
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


def _embedding_nodes(dm: Dims, arch: Arch, trainable: bool, attention: str) -> list[Node]:
    """Token lookup (+ learned positions) and embedding dropout. Lookups are not autocast: the
    output has the table's dtype. (GPT-2's eager attention: the float causal mask
    GPT2Model.forward builds, in the embeddings' dtype, for every layer.)"""
    N, d, s, pe = dm.n, dm.d, dm.s, dm.p
    nodes = [Node("wte", out=[("tok", N * d * pe)], grads=[("param:wte.weight", 0.0)] if trainable else [])]
    if arch.gpt2_layers:
        # GPT2Model.forward's ``input_ids.view(-1, s)``: the meter counts the step's token ids
        # (made by the data loader, outside it) from this first op that shows them, until the
        # step's batches go after the optimizer step (TOKEN_KEYS, pinned).
        nodes.insert(0, Node("input_ids", out=[(INPUT_IDS, N * 8)]))
    if arch.gpt2_layers and attention == "math":
        nodes.append(Node("causal_mask", out=[(CAUSAL_MASK, dm.b * s * s * pe)]))
    elif dm.hf and not arch.gpt2_layers:
        nodes += hf_model_input_nodes(dm, attention)
    src = "tok"
    if arch.positional == "learned":
        nodes.append(Node("pos", out=[("pos_idx", s * 8)]))
        nodes.append(Node("wpe", out=[("posemb", s * d * pe)], inputs=["pos_idx"], saves=["pos_idx"],
                           grads=[("param:wpe.weight", 0.0)] if trainable else []))
        # Broadcast add: the token side's gradient passes through, the position side is summed.
        nodes.append(Node("embed_add", out=[("emb", N * d * pe)], inputs=["tok", "posemb"],
                           grads=[("tok", 0.0), ("posemb", s * d * pe)]))
        src = "emb"
    if arch.embed_scale:
        # Gemma's embedding: the lookup times sqrt(hidden), a new tensor (the scale is a buffer:
        # nothing saved).
        nodes.append(Node("embed_scale", out=[("emb", N * d * pe)], inputs=[src], grads=[(src, N * d * pe)]))
        src = "emb"
    _dropout(nodes, dm, "drop", src, "blocks.0.in", N * d, pe, requires_grad=trainable)
    return nodes


def _head_nodes(dm: Dims, m: ModelConfig, tech: TechniqueConfig, arch: Arch, trainable: bool,
                grads_exist: bool, n_blocks: int) -> list[Node]:
    """Final norm, LM head and loss (standard: full logits; chunked: fused, chunk x vocab).
    ``n_blocks``: the simulated blocks, the last of which makes the head's input."""
    N, d, V, a, r = dm.n, dm.d, dm.V, dm.a, dm.r
    x = f"blocks.{n_blocks}.in"
    layer = arch.norm == "layernorm"
    head = "lm_head.weight" if m.untie_embeddings else "wte.weight"
    pg = [("param:ln_f.weight", 0.0)] if trainable else []
    if trainable and layer and dm.bias:
        pg.append(("param:ln_f.bias", 0.0))
    nodes = [Node("ln_f", out=[("hf", N * d * r), ("ln_f.stats", _norm_stats_bytes(dm, layer))], inputs=[x],
                   saves=[x, "ln_f.stats"], grad_out=("hf",), grads=[(x, N * d * r)] + pg)]
    if dm.hf and not layer:
        nodes = [hf_norm_node(dm, "ln_f", x, "hf", trainable, offset=arch.norm_offset)]
    # The loss's ``targets.reshape(-1)`` (our GPT's forward and memtrain's transformers wrapper,
    # after the final norm): from there the meter counts the micro-batch's int64 labels, which
    # the step's list of batches holds through the optimizer step (TOKEN_KEYS, pinned).
    nodes.append(Node("targets", out=[(TARGETS, N * 8)]))
    if arch.gpt2_layers:
        # GPT2Model.forward's locals (the token and position embeddings, the causal mask) live
        # until it returns, after ln_f.
        nodes[0].inputs += ["tok", "posemb"] + list(layer_args(dm, arch, tech.attention))
    elif dm.hf:
        # The Llama-style model's locals live until it returns, after the norm: what it made for
        # every layer (hf_model_input_nodes) and ``inputs_embeds``, the first layer's input.
        nodes[0].inputs += list(layer_args(dm, arch, tech.attention)) + ["blocks.0.in"]
    if tech.loss == "chunked" and tech.loss_kernel == "cce":
        return nodes + _cce_nodes(dm, head, trainable)
    if tech.loss == "chunked":
        c = min(effective_loss_chunk(tech.loss_chunk, "cuda" if dm.cuda else "cpu", m.vocab_size), N)
        # _ChunkedLinearCrossEntropy.forward, tensor by tensor (the caching allocator places each
        # on its own): casts of hidden and weight (when the compute dtype differs), then its
        # outputs grad_h (N x d) and a float32 grad_w (V x d), kept for backward, then the chunks.
        # (No weight cast under FSDP2's bf16 gather: the gathered weight is in the compute dtype.)
        # On CUDA the weight, the logits and grad_w are laid out aligned_vocab rows wide (a zero-padded
        # copy of the weight, even in the compute dtype); elsewhere exactly V.
        Vw = aligned_vocab(V) if dm.cuda else V
        cast_w = (a != dm.p and not dm.weights_in_compute_dtype) or Vw != V
        steps: list[tuple[str, str, float]] = [("alloc", "h", N * d * a if a != r else 0.0),
                                               ("alloc", "w", Vw * d * a if cast_w else 0.0),
                                               ("outputs", "", 0.0)]
        # Every full chunk repeats the first one's allocations, which find the blocks the one before
        # freed: the first and the shorter last one set both the peak and the allocator's cache.
        sizes = [c] + ([N % c] if N % c else [])
        for cc in sizes:
            steps += _chunk_steps(cc, Vw, d, a, dm.cuda, trainable)
        # backward hands grad_h on as the hidden states' gradient; grad_w, still referenced by
        # ctx, cannot be stolen by AccumulateGrad, which clones it into .grad (or adds it in).
        # (A frozen head, as under LoRA, gets no grad_w: need_grad_weight is False.)
        gw = Vw * d * 4 if trainable else 0.0
        nodes.append(Node("loss", out=[("loss.grad_h", N * d * r), ("loss.grad_w", gw)],
                           inputs=["hf"], saves=["loss.grad_h", "loss.grad_w"], fwd_steps=tuple(steps),
                           tag="logits", grad_from={"hf": "loss.grad_h", f"param:{head}": "loss.grad_w"},
                           grads=[("hf", N * d * r)] + ([(f"param:{head}", 0.0)] if trainable else [])))
        return nodes
    # Standard: F.linear (autocast casts hidden and weight), .float(), log_softmax (saved),
    # nll_loss. Backward: grad of the log-probs, grad of the logits (fp32), cast back, matmuls.
    xin = "hf"
    extra: list[str] = []
    if dm.autocast:
        nodes.append(Node("head.cast_w", out=[("head.wc", 0.0 if dm.weights_in_compute_dtype else V * d * a)], hold=True,
                           grads=[(f"param:{head}", 0.0)] if trainable else []))
        nodes.append(Node("head.cast_x", out=[("hfc", N * d * a)], inputs=["hf"], grads=[("hf", N * d * r)]))
        xin, extra = "hfc", ["head.wc"]
    w_grad = [("head.wc", V * d * a)] if dm.autocast else [(f"param:{head}", 0.0)]
    # A frozen LM head (LoRA) keeps no input: the matmul saves it only for the weight's
    # gradient (the input's gradient needs the weight alone).
    x_saved = [xin] if trainable else []
    nodes.append(Node("lm_head", out=[("logits", N * V * a)], inputs=[xin] + extra, saves=x_saved + extra,
                       tag="logits", grads=[(xin, N * d * a)] + (w_grad if trainable else [])))
    src = "logits"
    if a != 4:
        nodes.append(Node("logits.float", out=[("logits32", N * V * 4)], inputs=[src], tag="logits",
                           grads=[(src, N * V * a)]))
        src = "logits32"
    nodes.append(Node("log_softmax", out=[("logp", N * V * 4)], inputs=[src], saves=["logp"], tag="logits",
                       grads=[(src, N * V * 4)]))
    # standard_lm_loss's local holds the low-precision logits until cross_entropy returns, and
    # the caller the hidden state it handed over (the final norm's output; under autocast not the
    # cast the matmul saved, and under LoRA saved by nothing: the head is frozen).
    nodes.append(Node("loss", out=[("loss", 8)], inputs=["logp", "logits", "hf"], saves=["logp"], tag="logits",
                       grads=[("logp", N * V * 4)]))
    return nodes


def _cce_nodes(dm: Dims, head: str, trainable: bool) -> list[Node]:
    """``--loss-kernel cce``: Cut Cross-Entropy as memtrain calls it (memtrain.techniques.loss's
    ``cce_lm_loss`` and ``_CutCrossEntropyBuffers``, which lists what the library allocates).
    The hidden states and the head are cast to the compute dtype where they are not in it, and
    both casts are kept for backward with one float32 log-sum-exp per token; no logits are ever
    stored. Backward makes both gradients in the compute dtype (zero-filled, with int32 lock
    tables), which the casts' backward turns into the float32 ones. A frozen head (LoRA) gets no
    gradient but is still cast and kept."""
    N, d, V, a, r = dm.n, dm.d, dm.V, dm.a, dm.r
    nodes: list[Node] = []
    xin, w_saved = "hf", []
    if a != r:
        nodes.append(Node("cce.cast_x", out=[("cce.hc", N * d * a)], inputs=["hf"], grads=[("hf", N * d * r)]))
        xin = "cce.hc"
    if a != dm.p and not dm.weights_in_compute_dtype:
        nodes.append(Node("cce.cast_w", out=[("cce.wc", V * d * a)],
                          grads=[(f"param:{head}", 0.0)] if trainable else []))
        w_saved = ["cce.wc"]
        w_grad = [("cce.wc", V * d * a)] if trainable else []
    else:
        w_grad = [(f"param:{head}", 0.0)] if trainable else []
    # Forward, in the library's order: the valid-target mask and its nonzero() (int64, an int32
    # copy), dropped when every target counts; the log-sum-exp (an output: kept); 128-token locks
    # and the float32 target-logit dot, freed on return.
    steps: tuple[tuple[str, str, float], ...] = (
        ("alloc", "mask", N), ("alloc", "index", N * 8), ("free", "mask", 0.0), ("alloc", "index32", N * 4),
        ("free", "index", 0.0), ("free", "index32", 0.0), ("outputs", "", 0.0),
        ("alloc", "locks", cce_forward_locks(N) * 4), ("alloc", "neg_dot", N * 4))
    lock_tables = sum(math.prod(cce_lock_table_shape(rows, d)) * 4 for rows in (N, V))
    # The caller's hidden states ("hf") stay alive through the call, cast or not.
    nodes.append(Node("loss", out=[("cce.lse", N * 4), ("loss", 4)], inputs=sorted({"hf", xin}) + w_saved,
                      saves=[xin] + w_saved + ["cce.lse"], fwd_steps=steps, tag="logits", grad_out=("loss",),
                      grads=[(xin, N * d * a)] + w_grad, scratch=lock_tables))
    return nodes


def _chunk_steps(c: int, V: int, d: int, a: float, cuda: bool, grad_w: bool) -> list[tuple[str, str, float]]:
    """One chunk of memtrain's chunked loss (memtrain.techniques.loss._chunked_forward), tensor
    by tensor: the logits, the logit gradient, ``g @ w`` (c x d, copied into grad_h) and, for a
    trainable head, ``g.t() @ h`` (V x d, added into the float32 grad_w; in place, no temporary,
    when computing in float32).

    On CUDA each chunk's body is one inductor-compiled function (its logits and their gradient, in
    the compute dtype; ``V`` is then the aligned width, memtrain.techniques.facts.aligned_vocab).
    Elsewhere the eager body: float32 logits (a float copy of the
    low-precision matmul output, which then goes), turned into the gradient in place and cast
    back, the float32 buffer freed before the matmuls."""
    steps: list[tuple[str, str, float]] = []
    if cuda:
        steps += [("alloc", "logits", c * V * a), ("alloc", "g", c * V * a), ("free", "logits", 0.0)]
    elif a == 4:
        steps += [("alloc", "g", c * V * 4)]
    else:
        steps += [("alloc", "logits", c * V * a), ("alloc", "logits32", c * V * 4), ("free", "logits", 0.0),
                  ("alloc", "g", c * V * a), ("free", "logits32", 0.0)]
    steps += [("alloc", "gh", c * d * a), ("free", "gh", 0.0)]
    if grad_w and a != 4:
        steps += [("alloc", "gw", V * d * a), ("free", "gw", 0.0)]
    return steps + [("free", "g", 0.0)]


def precision_bytes(precision: str) -> tuple[int, int, bool]:
    """(param bytes, compute bytes, autocast) of ``--precision`` (memtrain.techniques.facts)."""
    f = precision_facts(precision)
    return f.param_bytes, f.compute_bytes, f.autocast


def run_dims(cfg: RunConfig, arch: Arch, device_type: str, batch: Optional[int] = None) -> Dims:
    m, t = cfg.model, cfg.train
    pb, ab, autocast = precision_bytes(cfg.technique.precision)
    q, kv = head_widths(m, arch)
    dm = Dims(b=batch or t.batch_size, s=t.seq_len, d=m.d_model, f=m.d_ff, h=m.n_heads, kv=kv,
               hq=q if q != m.d_model else 0, V=m.padded_vocab_size, a=ab,
               r=pb, p=pb, autocast=autocast, dropout=m.dropout > 0, cuda=device_type == "cuda",
               # (A Llama-style config's dropout is its attention_dropout, mirrored as ModelConfig.dropout:
               # its layers and embedding drop nothing else; hf.why_not_modelled refuses Phi-3's others.)
               branch_dropout=not (arch.hf and not arch.gpt2_layers),
               bias=m.bias and arch.name == "gpt2", hf=arch.hf, fp8=precision_facts(cfg.technique.precision).fp8,
               fused_proj=arch.fused_proj, lora_dropout=cfg.technique.lora_rank > 0 and cfg.technique.lora_dropout > 0,
               softmax_fp32=not arch.gpt2_layers, additive_mask=arch.hf,
               repeat_kv=arch.hf and not arch.gpt2_layers,
               qlora=cfg.technique.qlora and arch.hf and not arch.gpt2_layers)
    window = cfg.technique.window if cfg.technique.window is not None else arch.sliding_window
    # (hf.why_not_modelled keeps the rest of a windowed SDPA step out: CUDA kernels, attention
    # dropout, layers of both kinds.)
    dm.masked_sdpa = (arch.hf and not arch.gpt2_layers and cfg.technique.attention == "sdpa"
                      and window is not None and window <= t.seq_len and not dm.dropout)
    # Eager attention materializes the masks whatever the sequence's length; --window slides every layer.
    dm.full_mask = arch.full_mask_beside_window and cfg.technique.attention == "math" and window is not None
    dm.layer_slides = arch.layer_slides if dm.full_mask and cfg.technique.window is None else ()
    return dm


def layer_args(dm: Dims, arch: Arch, attention: str) -> tuple[str, ...]:
    """What a transformers model makes once and hands every layer besides its input: a
    checkpointed layer keeps it until its backward (``Segment.held_inputs``), the model until it
    returns. GPT-2: its eager causal mask; Llama-style: :func:`hf_model_input_nodes`' tensors."""
    if arch.gpt2_layers:
        return (CAUSAL_MASK,) if attention == "math" else ()
    return hf_model_inputs(attention, dm.masked_sdpa, dm.full_mask) if dm.hf else ()


def layer_held_inputs(dm: Dims, model_inputs: tuple[str, ...], i: int) -> tuple[str, ...]:
    """What of the model's ``model_inputs`` (:func:`layer_args`) decoder layer ``i`` is handed, so
    keeps when checkpointed: all of it, but for Qwen2's two masks (``Dims.full_mask``), of which a
    layer gets its kind's (the windowed CAUSAL_MASK where it slides, FULL_MASK where it attends in
    full); with every layer sliding, FULL_MASK is the model's alone. (Layers of both kinds repeat
    no period for Compression to lump: such a model is simulated block by block, estimate.)"""
    if not dm.full_mask:
        return model_inputs
    slides = dm.layer_slides[i] if dm.layer_slides else True
    mask = CAUSAL_MASK if slides else FULL_MASK
    return tuple(k for k in model_inputs if k not in (CAUSAL_MASK, FULL_MASK) or k == mask)


def block_segments(cfg: RunConfig, arch: Arch, dm: Dims, trainable_base: bool, grads_exist: bool,
              comp: Compression) -> list[Segment]:
    m, tech = cfg.model, cfg.technique
    policy = checkpoint_policy(tech.checkpointing)
    kind = policy.kind
    L = m.n_layers
    mode = "selective" if kind == "selective-matmul" else "full"
    segs = [Segment("embedding", _embedding_nodes(dm, arch, trainable_base, tech.attention))]
    model_inputs = layer_args(dm, arch, tech.attention)
    for j in range(comp.blocks):
        i = comp.real(j)
        nodes = block_nodes(dm, j, arch, tech, trainable_base)
        held_inputs = layer_held_inputs(dm, model_inputs, i)
        if kind == "selective":
            # Megatron's selective recomputation: the block runs as usual around a checkpointed
            # attention core, which keeps only its input (q, k, v: views of the qkv output).
            # Its recompute is lazy as a block's: the output's cast back (SDPA's math path on
            # 16-bit inputs) runs its backward first, and the recompute stops as probs @ v saves
            # its inputs, before its output exists (+1.3% backward when made, bf16-pure, LoRA).
            a = next(x for x, n in enumerate(nodes) if n.core)
            b = a + sum(1 for n in nodes if n.core)
            segs += [Segment(f"block {i}", nodes[:a]),
                     Segment(f"block {i} attention core", nodes[a:b], checkpoint="full",
                              input_key=f"blocks.{j}.qkv", lazy_recompute=True),
                     Segment(f"block {i}", nodes[b:])]
            continue
        # torch's checkpoint recomputes lazily for our GPT as well: under autocast the residual
        # branch's gradient cast comes before the recompute (the last checkpointed block's
        # recompute end was -1.2% under without LoRA, where this held for LoRA alone), and under
        # LoRA the last adapter's B product is not recomputed.
        segs.append(Segment(f"block {i}", nodes,
                             checkpoint=mode if policy.whole_block(i, L) else "none", input_key=f"blocks.{j}.in",
                             lazy_recompute=True, held_inputs=held_inputs))
    # (The simulated depth is passed, not set on a copy of cfg.model: a transformers model's
    # ModelConfig mirrors its config.json again on every copy, n_layers included.)
    segs.append(Segment("head", _head_nodes(dm, m, tech, arch, trainable_base, grads_exist, comp.blocks)))
    assert L == comp.blocks + comp.lumps * comp.period
    return segs
