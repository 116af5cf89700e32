"""A Linear layer's op inventory: autocast's casts of its input and weight, the matmul, and what
replaces or wraps it: LoRA adapters (memtrain's and peft's, with their dropout), torchao's
Float8Linear (``--precision fp8``) and QLoRA's NF4 weights (``--qlora``)."""

from __future__ import annotations

from typing import Optional

from memtrain.analysis.estimate.dims import Dims
from memtrain.analysis.estimate.simulator import Node
from memtrain.techniques.facts import NF4_BLOCK, fp8_converts, nf4_quantizes


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


def runs_nf4(dm: Dims, trainable_base: bool, n_in: int, n_out: int) -> bool:
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


def linear(nodes: list[Node], dm: Dims, name: str, x: str, out: str, n_in: int, n_out: int,
           trainable_base: bool, lora: int, x_bytes: float, *, bias: Optional[bool] = None,
           lora_parts: tuple[str, ...] = ("",), input_grad: bool = True, param_name: Optional[str] = None,
           x_requires_grad: Optional[bool] = None, param_share: float = 1.0) -> None:
    """A Linear layer: autocast casts of input/weight/bias, the matmul, LoRA adapters.
    ``bias``: this Linear's (default: the model's rule, ``dm.bias``); ``lora_parts``: the name
    suffixes of the Linears the entry stands for (:func:`.params.lora_split`), one adapter pair each;
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
    if runs_nf4(dm, trainable_base, n_in, n_out):
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
                       param_share=param_share, reduced_grads=1 if trainable_base and bias else 0))
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


def _lora_dropout(nodes: list[Node], dm: Dims, name: str, x: str, x_bytes: float, n_in: int, n_a: int,
                  keep_mask: bool, adapter_bytes: float = 4) -> str:
    """peft's ``lora_A(dropout(x.to(A.dtype)))``; returns the key lora_A reads and saves.
    ``x``: the adapters' input as it reaches peft (``x_bytes`` per element); ``adapter_bytes``:
    the adapters' dtype (our GPT's are float32). peft casts x to it first (a new tensor only
    when the dtypes differ, which lives only through the dropout); the dropout's output is a
    new tensor in the adapters' dtype, and its
    backward keeps the mask (:func:`.basic_nodes.dropout`: CUDA's bool mask, the CPU kernel's float noise)
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
    call_args: list[str] = []  # what lora_A's caller holds while lora_A runs (its argument)
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
            # lora_A(dropout(x)): the dropped float32 copy is lora_A's argument, alive until
            # lora_A returns, beside autocast's bf16 cast of it and A's output (freed after the
            # cast, GPT-2 under autocast with LoRA dropout on c_proj was -1.2% under the trace).
            call_args = [f"{name}.lora_drop"]
        else:
            xa = f"{x}@{name}.lora"
            nodes.append(Node(f"{name}.lora_cast_x", out=[(xa, N * n_in * a * n_a)], inputs=[src],
                               grads=[(src, N * n_in * 4)] if input_grad else []))
        # The adapters are leaves that require grad: autocast caches their bf16 copies until
        # the forward ends. lora_B's matmul saves its copy (for the gradient of A's output),
        # lora_A's only when its input needs a gradient. Each is cast when its matmul runs: B's
        # after A's product (both before it, a width-4 Gemma's forward peak at o_proj's lora_A
        # was counted 32 B over the trace).
        w_a, w_b = [f"{name}.lora_wa"], [f"{name}.lora_wb"]
        nodes.append(Node(f"{name}.lora_cast_wa", out=[(w_a[0], n_a * r * n_in * a)], hold=True))
    elif dm.lora_dropout:
        xa = _lora_dropout(nodes, dm, name, x, x_bytes, n_in, n_a, input_grad, adapter_bytes=dm.p)
    nodes.append(Node(la, out=[(la, N * r * a * n_a)], inputs=[xa] + w_a + call_args,
                       saves=[xa] + (w_a if input_grad else []),
                       matmul=True, grads=([(xa, N * n_in * a)] if input_grad else [])
                       + [(f"param:{param_name}.lora_A{s}", 0.0) for s in parts]))
    if w_b:
        nodes.append(Node(f"{name}.lora_cast_wb", out=[(w_b[0], r * n_out * a)], hold=True))
    nodes.append(Node(lb, out=[(lb, N * n_out * a)], inputs=[la] + w_b, saves=[la] + w_b, matmul=True,
                       grads=[(la, N * r * a * n_a)] + [(f"param:{param_name}.lora_B{s}", 0.0) for s in parts]))
    nodes.append(Node(f"{name}.lora_scale", out=[(f"{lb}.s", N * n_out * a)], inputs=[lb],
                       grads=[(lb, N * n_out * a)]))
    ob = out_bytes or a
    nodes.append(Node(f"{name}.lora_add", out=[(out, N * n_out * ob)], inputs=[base_out, f"{lb}.s"] + until_return,
                       grads=[(base_out, 0.0), (f"{lb}.s", 0.0 if ob == a else N * n_out * a)]))
