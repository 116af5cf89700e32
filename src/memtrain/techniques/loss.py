"""LM-head loss: ``--loss standard`` (full logits) or ``--loss chunked --loss-chunk N``.

The standard loss builds the (tokens x vocab) logits, keeps a log-softmax of the same size
for backward and builds two more of that size in backward. With GPT-2's 50257-token
vocabulary that is the largest memory item of a small model.

The chunked loss never holds more than ``chunk x vocab`` logits, in forward or backward.
It is a fused "linear + cross-entropy": for each chunk of tokens it computes the logits,
their log-sum-exp and the target logit, and, while the chunk's logits are still alive,
the logit gradient ``softmax - onehot`` and from it the gradients with respect to the
chunk's hidden states and to the LM-head weight (accumulated in float32). The forward
pass thus leaves behind only ``grad_hidden`` (tokens x d) and ``grad_weight`` (vocab x d);
backward scales them, in place, by ``grad_output / n_valid``. This is the method of Liger-Kernel's
``LigerFusedLinearCrossEntropyLoss``. Liger (and Apple's Cut Cross-Entropy) are Triton
kernels that need CUDA, so the torch version here is written by hand. ``--loss-kernel liger``
runs Liger's kernel instead (CUDA, ``liger_kernel`` installed; it picks its own chunk size and
ignores ``--loss-chunk``), ``--loss-kernel cce`` Cut Cross-Entropy's (CUDA, ``cut_cross_entropy``
installed, 16-bit compute), which never writes the logits to device memory: it keeps one
float32 log-sum-exp per token from forward to backward and computes the logits again there, block
by block, with both gradients (:func:`_cce_loss`; not yet timed on a GPU). memtrain's is the
default on CUDA too: on an H100 (torch 2.11, Liger 0.8.5;
benchmarks/results/gpu-h100/runbook-2026-11-26) a Qwen2.5-0.5B step at batch 4 x 1024 took
85.6 ms with it, 141.2 ms with Liger's and 82.0 ms with the standard loss, and the compiled seed
GPT's 27.9 ms against Liger's 31.8 ms. Liger sizes its chunks from vocab / hidden (32 tokens for
Qwen's 151,936 x 896 head), which makes many small matmuls.

Precision matches the standard loss: under autocast the logits are computed in the autocast
dtype (as ``F.linear`` would), the softmax statistics in float32. The weight gradient is
accumulated across chunks in float32; each chunk's 16-bit product is rounded once before it is
added, unless ``MEMTRAIN_LOSS_FP32_ADDMM=1`` (CUDA, opt-in until timed) adds it in the GEMM's
float32 epilogue (:func:`_addmm_fp32_`).

Speed on a GPU: on CUDA each chunk's whole body (the logits matmul, the element-wise logit gradient
``softmax - onehot``, ``g @ w`` and ``g.t() @ h``) is one function compiled by inductor
(:func:`_chunk_body`): one call per chunk instead of about eight launches, the element-wise work
fused into a read of the logits and one write of their gradient, the matmuls cuBLAS's. The logits
are laid out 64 columns wide there (:data:`ALIGN_VOCAB`; GPT-2's 50257 would leave cuBLAS its
slow unaligned kernels), the padding masked. Each call still costs host time, so small chunks
cost more than their arithmetic: ``--loss-chunk 0`` (the default) runs up to 1024 tokens a chunk
on CUDA (1024 for every vocabulary up to 262,144 tokens: each chunk also makes one pass over
the (V x d) weight gradient, which a small chunk cannot hide either) and 256 on a CPU
(:func:`memtrain.techniques.facts.effective_loss_chunk`). On an H200 the
seed GPT's eager step took 13.6 ms with it against the standard loss's 29.6 ms; compiled, 11.1 ms
against 8.7 ms, and 8.8 ms under ``--compile-mode reduce-overhead``, whose CUDA graphs replay the
calls without their host time (benchmarks/results/gpu-h200). Elsewhere (CPU, where inductor's C++
build costs more than it saves on short runs, and fake tensors of the estimator) the in-place eager
body runs, whose buffers the estimator models.

Under ``--compile`` the chunk loop is one opaque operator in the model's graph
(:func:`_chunked_forward_op`, a ``torch.library`` custom op): dynamo would otherwise unroll the
loop, one copy of the loss per chunk, so the first compiled step's cost grew with batch x
sequence / chunk. Liger's kernel is left out of the graph instead (it calls ``.item()``).
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from memtrain.config.run import ConfigError, TechniqueConfig
from memtrain.models.gpt import LossFn, standard_lm_loss
from memtrain.techniques.facts import (
    LOSS_ALIGN_VOCAB,
    aligned_vocab,
    cce_forward_locks,
    cce_lock_table_shape,
    effective_loss_chunk,
    loss_kernel_refusal,
)

IGNORE_INDEX = -100

__all__ = ["apply_loss", "chunked_lm_loss", "make_loss_fn", "NaiveLoss", "IGNORE_INDEX"]


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear(hidden, weight)`` would compute the logits in."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _chunk_stats(
    h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float32 logits of one chunk, their log-sum-exp and the per-token loss (0 where ignored)."""
    logits = (h @ w.t()).float()  # no copy when already float32
    lse = torch.logsumexp(logits, dim=-1)
    valid = targets != IGNORE_INDEX
    safe = torch.where(valid, targets, 0)
    target_logit = logits.gather(1, safe.unsqueeze(1)).squeeze(1)
    return logits, lse, torch.where(valid, lse - target_logit, 0.0)


def _logit_gradient(logits_lp: torch.Tensor, targets: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's summed loss and its logit gradient ``softmax - onehot`` (0 on ignored rows),
    the gradient in the logits' dtype. ``logits_lp`` may be wider than ``vocab``: its columns from
    ``vocab`` on are padding (the row-aligned layout of :data:`ALIGN_VOCAB`), left out of the
    log-sum-exp and given a zero gradient. Pure functions of the inputs (no in-place updates), so
    that inductor fuses them; numerically the same steps as the eager loop body below."""
    columns = torch.arange(logits_lp.shape[1], device=logits_lp.device).unsqueeze(0)
    logits = torch.where(columns < vocab, logits_lp.float(), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    valid = (targets != IGNORE_INDEX).unsqueeze(1)
    safe = torch.where(valid, targets.unsqueeze(1), 0)
    per_token = torch.where(valid, lse - logits.gather(1, safe), 0.0)
    # exp(-inf - lse) = 0: padded columns get no gradient.
    grad = torch.where(valid, torch.exp(logits - lse) - (columns == safe).float(), 0.0)
    return per_token.sum(), grad.to(logits_lp.dtype)


# The fused (CUDA) path's logits are ALIGN_VOCAB columns wide: see
# memtrain.techniques.facts.LOSS_ALIGN_VOCAB for why. A module attribute, so that a benchmark can
# time the unaligned layout beside it (benchmarks/loss_profile.py, "unaligned").
ALIGN_VOCAB = LOSS_ALIGN_VOCAB


def _chunk_head(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, grad_h_rows: Optional[torch.Tensor],
                loss_sum: torch.Tensor, vocab: int) -> torch.Tensor:
    """One chunk's work up to the weight gradient: the logits matmul, the logit gradient
    (:func:`_logit_gradient`), ``g @ w`` written into the chunk's rows of grad_h and the chunk's
    loss added into ``loss_sum``; returns ``g`` (the logits' dtype)."""
    chunk_loss, g = _logit_gradient(h @ w.t(), t, vocab)
    loss_sum.add_(chunk_loss)
    if grad_h_rows is not None:
        grad_h_rows.copy_(g @ w)
    return g


def _chunk_body(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, grad_h_rows: Optional[torch.Tensor],
                grad_w: Optional[torch.Tensor], loss_sum: torch.Tensor, vocab: int) -> None:
    """One chunk's whole work as one function, for inductor: :func:`_chunk_head`, then
    ``g.t() @ h`` added into the float32 grad_w (the product rounded to the compute dtype first).

    On CUDA this runs compiled, one call per chunk: run op by op from Python, the chunk's eight
    or so launches cost more host time than the device spends on them (on an H200 the compiled
    seed GPT's step was bound by that loop: benchmarks/results/gpu-h200)."""
    g = _chunk_head(h, w, t, grad_h_rows, loss_sum, vocab)
    if grad_w is not None:
        grad_w.add_(g.t() @ h)  # float32 accumulation, whatever the compute dtype


ChunkBody = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor],
                      torch.Tensor, int], None]


@functools.lru_cache(maxsize=1)
def _compiled_chunk_body() -> ChunkBody:
    return torch.compile(_chunk_body)  # type: ignore[return-value]  # compile keeps the signature


# ---- The weight gradient's float32 accumulation in the GEMM's epilogue (opt-in until timed on a GPU)
#
# The default adds each chunk's ``g.t() @ h`` into the float32 grad_w as a separate product: with a
# 16-bit compute dtype the matmul writes its (V x d) output rounded to that dtype (2 V d bytes), which
# is read back with grad_w and grad_w written (10 V d): about 12 V d bytes of memory traffic and one
# 16-bit rounding of every chunk's product. ``torch.addmm(grad_w, g.t(), h, out_dtype=torch.float32,
# out=grad_w)`` (aten ``addmm.dtype_out``, CUDA only; an earlier form of its kernel refused a float32
# ``self`` beside 16-bit operands, "self and mat2 must have the same dtype", hence the probe
# :func:`_fp32_addmm_supported`) lets cuBLAS add the float32 accumulator into grad_w in its epilogue: grad_w read and written once (8 V d bytes), no rounding of the product.
#
# What inductor does with it (read in torch 2.13's source): ``addmm.dtype`` and ``addmm.dtype_out`` are
# in its decomposition table (torch/_decomp/decompositions.py ``addmm_dtype``: ``mm(out_dtype=float32)``
# then ``+ self``), and ``mm`` with an ``out_dtype`` lowers to the extern ``at::mm_dtype_out`` kernel
# (torch/_inductor/kernel/mm.py ``tuned_mm``; a Triton template only under max-autotune). Inside the
# compiled chunk body the epilogue would thus be lost: a float32 product written and read back, a
# separate add kernel, 16 V d bytes. So this path runs the compiled :func:`_chunk_head` and then the
# addmm eagerly, one more launch per chunk (:func:`_fp32_addmm_chunk_body`);
# benchmarks/loss_profile.py times both (``chunked-N-addmm`` and ``chunked-N-addmm-inductor``).
FP32_ADDMM_ENV = "MEMTRAIN_LOSS_FP32_ADDMM"
# None: as the environment variable says ("1": on); True or False: forced (a benchmark times both
# in one process: benchmarks/loss_profile.py).
FP32_ADDMM: Optional[bool] = None


def fp32_addmm_env_problem() -> Optional[str]:
    """A one-line refusal of a ``MEMTRAIN_LOSS_FP32_ADDMM`` value other than unset, empty, 0 or 1."""
    value = os.environ.get(FP32_ADDMM_ENV, "")
    if value in ("", "0", "1"):
        return None
    return f"{FP32_ADDMM_ENV}={value!r}: set it to 1 (the chunked loss's float32-epilogue addmm) or 0, or unset it"


def fp32_addmm_requested() -> bool:
    """Whether the float32-epilogue accumulation is asked for (:data:`FP32_ADDMM`, else the environment)."""
    if FP32_ADDMM is not None:
        return FP32_ADDMM
    return os.environ.get(FP32_ADDMM_ENV, "") == "1"


@functools.lru_cache(maxsize=None)
def _fp32_addmm_supported(device: torch.device) -> bool:
    """Whether this torch's kernel for ``device`` adds a 16-bit product into a float32 tensor in
    place (``addmm.dtype_out``): one 1 x 1 try, once per device and process (it reads the result
    back: one host sync). Its absence (a torch without the ``out_dtype`` overload, a kernel that
    refuses the float32 ``self``, a backend without the operator) reads as False and today's path runs."""
    try:
        one = torch.ones((1, 1), dtype=torch.bfloat16, device=device)
        acc = torch.ones((1, 1), dtype=torch.float32, device=device)
        torch.addmm(acc, one, one, out_dtype=torch.float32, out=acc)
        return float(acc) == 2.0
    except (RuntimeError, NotImplementedError, TypeError):  # no such overload, or a kernel that refuses it
        return False


def _fp32_addmm_path(device: torch.device, compute_dtype: torch.dtype, fake: bool, need_grad_weight: bool) -> bool:
    """Whether the chunk loop adds each chunk's weight gradient with :func:`_addmm_fp32_`: asked for,
    a real CUDA tensor (fake tensors, the estimator's, keep today's path and its buffers), a 16-bit
    compute dtype (in float32 ``addmm_`` already adds without rounding) and a kernel that takes it."""
    return (need_grad_weight and device.type == "cuda" and not fake
            and compute_dtype in (torch.bfloat16, torch.float16)
            and fp32_addmm_requested() and _fp32_addmm_supported(device))


def _uses_fp32_addmm(hidden: torch.Tensor, compute_dtype: torch.dtype, need_grad_weight: bool) -> bool:
    """:func:`_fp32_addmm_path` for this forward's hidden states. The device is looked at first:
    elsewhere than CUDA is_fake is not called (dynamo cannot trace it, and a chunk loop traced into
    a compiled graph, benchmarks/loss_profile.py's "traced", runs this)."""
    return hidden.device.type == "cuda" and _fp32_addmm_path(hidden.device, compute_dtype, is_fake(hidden),
                                                             need_grad_weight)


def _addmm_fp32_(grad_w: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``grad_w += g.t() @ h`` with the 16-bit product accumulated in float32 and added into the
    float32 ``grad_w`` in the GEMM's epilogue, in place (``out=grad_w``)."""
    return torch.addmm(grad_w, g.t(), h, out_dtype=torch.float32, out=grad_w)


@functools.lru_cache(maxsize=1)
def _compiled_chunk_head() -> Callable[..., torch.Tensor]:
    return torch.compile(_chunk_head)


def _fp32_addmm_chunk_body(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, grad_h_rows: Optional[torch.Tensor],
                           grad_w: Optional[torch.Tensor], loss_sum: torch.Tensor, vocab: int) -> None:
    """:func:`_chunk_body` with the weight gradient added by :func:`_addmm_fp32_`, outside the
    compiled call (inside it inductor would split the addmm into a matmul and an add: see above)."""
    g = _compiled_chunk_head()(h, w, t, grad_h_rows, loss_sum, vocab)
    if grad_w is not None:
        _addmm_fp32_(grad_w, g, h)


def _fused_chunk_body(hidden: torch.Tensor) -> Optional[ChunkBody]:
    """The compiled :func:`_chunk_body` where it pays (a real CUDA tensor with Triton), else None."""
    if hidden.device.type != "cuda" or is_fake(hidden):
        return None
    from torch.utils._triton import has_triton  # torch's own check that inductor can emit GPU kernels

    return _compiled_chunk_body() if has_triton() else None


def _chunked_forward(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int, compute_dtype: torch.dtype,
    need_grad_hidden: bool, need_grad_weight: bool,
) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], torch.Tensor]:
    """The loss sum, the unscaled gradients (float32 for the weight) and ``1 / n_valid``."""
    fused = _fused_chunk_body(hidden)
    fp32_addmm = _uses_fp32_addmm(hidden, compute_dtype, need_grad_weight)
    if fused is not None and fp32_addmm:
        fused = _fp32_addmm_chunk_body
    # Casts are explicit below; autocast must not recast inside the loop.
    with torch.autocast(hidden.device.type, enabled=False):
        h_all = hidden.to(compute_dtype)
        vocab, d = weight.shape
        # The fused path's weight is ``aligned_vocab(vocab)`` rows, the extra ones zero: the logits' rows
        # and grad_w's stay 16-byte aligned (see ALIGN_VOCAB). One (V x d) copy either way when
        # the compute dtype differs, as autocast's weight cache makes.
        width = aligned_vocab(vocab, ALIGN_VOCAB) if fused is not None else vocab
        if width == vocab:
            w = weight.to(compute_dtype)
        else:
            w = weight.new_zeros((width, d), dtype=compute_dtype)
            w[:vocab].copy_(weight)
        n = h_all.shape[0]
        # float32 division as F.cross_entropy does (no host sync on the count).
        inv_n = 1.0 / (targets != IGNORE_INDEX).sum().float()
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_grad_hidden else None
        # float32 accumulation across chunks, whatever the compute dtype.
        grad_w = torch.zeros((width, d), dtype=torch.float32, device=weight.device) if need_grad_weight else None
        for start in range(0, n, chunk):
            rows = slice(start, start + chunk)
            _chunk_step(h_all[rows], w, targets[rows], None if grad_h is None else grad_h[rows], grad_w, loss_sum,
                        fused, vocab, fp32_addmm)
    # The real rows of an aligned grad_w (a view: no copy).
    return loss_sum, grad_h, None if grad_w is None else grad_w[:vocab], inv_n


def _chunk_step(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, grad_h_rows: Optional[torch.Tensor],
                grad_w: Optional[torch.Tensor], loss_sum: torch.Tensor, fused: Optional[ChunkBody],
                vocab: int, fp32_addmm: bool = False) -> None:
    """One chunk (``h``: its hidden states in the compute dtype): its loss added into
    ``loss_sum``, its logit gradient's contributions written into ``grad_h_rows`` (the chunk's
    rows of grad_h) and added into ``grad_w``. ``fused``: CUDA's compiled :func:`_chunk_body`
    (``w`` may then have padding rows past ``vocab``), else the in-place eager body below, whose
    buffers the estimator's trace sees. ``fp32_addmm``: the eager body adds the weight gradient
    with :func:`_addmm_fp32_` (:func:`_fp32_addmm_path` chose it)."""
    if fused is not None:
        fused(h, w, t, grad_h_rows, grad_w, loss_sum, vocab)
        return
    logits, lse, per_token = _chunk_stats(h, w, t)
    loss_sum += per_token.sum()
    # d loss / d logits = (softmax - onehot) / n_valid on valid rows, 0 elsewhere.
    # Built in place on the chunk's logits (at most ~2 chunk-sized buffers alive).
    # The 1/n_valid factor and the upstream gradient are applied in backward, in
    # float32: scaling before the cast to a 16-bit compute dtype would flush small
    # gradients to zero before an fp16 GradScaler could lift them.
    g = logits.sub_(lse.unsqueeze(1)).exp_()
    valid = t != IGNORE_INDEX
    g.scatter_add_(1, torch.where(valid, t, 0).unsqueeze(1), -valid.unsqueeze(1).to(g.dtype))
    g.mul_(valid.unsqueeze(1))
    g_lp = g.to(h.dtype)  # the same tensor when computing in float32
    del logits, g  # the float32 buffer goes before the matmuls' outputs arrive
    _accumulate(grad_h_rows, grad_w, g_lp, h, w, fp32_addmm)


@torch.library.custom_op("memtrain::chunked_linear_cross_entropy", mutates_args=())
def _chunked_forward_op(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int, compute_dtype: torch.dtype,
    need_grad_hidden: bool, need_grad_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_chunked_forward` as one opaque operator for torch.compile: dynamo records a single
    node instead of unrolling the chunk loop (one copy of the loss per chunk: the first compiled
    step's cost grew with batch x sequence / chunk, minutes at the seed's batch). It runs the
    same eager loop at run time. A gradient not needed comes back empty (an operator returns
    tensors, not None)."""
    loss_sum, grad_h, grad_w, inv_n = _chunked_forward(hidden, weight, targets, chunk, compute_dtype,
                                                       need_grad_hidden, need_grad_weight)
    empty = hidden.new_empty(0)
    return loss_sum, empty if grad_h is None else grad_h, empty if grad_w is None else grad_w, inv_n


@_chunked_forward_op.register_fake
def _chunked_forward_fake(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int, compute_dtype: torch.dtype,
    need_grad_hidden: bool, need_grad_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    scalar = hidden.new_empty((), dtype=torch.float32)
    grad_h = torch.empty_like(hidden) if need_grad_hidden else hidden.new_empty(0)
    grad_w = weight.new_empty(weight.shape, dtype=torch.float32) if need_grad_weight else hidden.new_empty(0)
    return scalar, grad_h, grad_w, hidden.new_empty((), dtype=torch.float32)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``hidden @ weight.T``; gradients computed during forward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        chunk: int,
        compute_dtype: torch.dtype,
        need_grad_hidden: bool,
        need_grad_weight: bool,
    ) -> torch.Tensor:
        args = (hidden, weight, targets, chunk, compute_dtype, need_grad_hidden, need_grad_weight)
        grad_h: Optional[torch.Tensor]
        grad_w: Optional[torch.Tensor]
        if torch.compiler.is_compiling():  # torch.compile: one opaque node, not the unrolled loop
            loss_sum, grad_h, grad_w, inv_n = _chunked_forward_op(*args)
            grad_h = grad_h if need_grad_hidden else None
            grad_w = grad_w if need_grad_weight else None
        else:  # eager, and the estimator's fake tensors, which must see every chunk's buffers
            loss_sum, grad_h, grad_w, inv_n = _chunked_forward(*args)
        # Intermediaries, not inputs or outputs: saving them is allowed (no double backward).
        ctx.save_for_backward(grad_h, grad_w, inv_n)  # type: ignore[arg-type]  # save_for_backward accepts None
        ctx.weight_dtype = weight.dtype  # type: ignore[attr-defined]  # autograd ctx carries attributes set in forward
        return loss_sum * inv_n

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor):  # type: ignore[override]
        grad_h, grad_w, inv_n = ctx.saved_tensors  # type: ignore[attr-defined]  # autograd ctx carries attributes set in forward
        scale = grad_out.float() * inv_n
        # Scale in place: no second (V x d) buffer at the start of backward, where the model's
        # activations peak. A second backward through the same graph (retain_graph=True)
        # would see the bumped version counter and raise instead of reusing scaled values.
        if grad_h is not None:
            grad_h = grad_h.mul_(scale)
        if grad_w is not None:
            grad_w = grad_w.mul_(scale).to(ctx.weight_dtype)  # type: ignore[attr-defined]  # autograd ctx carries attributes set in forward
        return grad_h, grad_w, None, None, None, None, None


def _accumulate(grad_h_rows: Optional[torch.Tensor], grad_w: Optional[torch.Tensor], g_lp: torch.Tensor,
                h: torch.Tensor, w: torch.Tensor, fp32_addmm: bool = False) -> None:
    """Add one chunk's contribution to the hidden-state and LM-head weight gradients
    (``fp32_addmm``: the weight's with :func:`_addmm_fp32_`)."""
    if grad_h_rows is not None:
        grad_h_rows.copy_(g_lp @ w)
    if grad_w is not None:
        if fp32_addmm:
            _addmm_fp32_(grad_w, g_lp, h)
        elif g_lp.dtype == torch.float32:
            grad_w.addmm_(g_lp.t(), h)
        else:
            grad_w += g_lp.t() @ h


def chunked_lm_loss(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int = 0
) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``targets`` (``-100`` ignored),
    never materializing more than ``chunk`` rows of logits (0: the device's default for this
    vocabulary, :func:`memtrain.techniques.facts.effective_loss_chunk`). Same contract as
    :func:`memtrain.models.gpt.standard_lm_loss`.
    """
    if chunk < 0:
        raise ValueError(f"chunk must be positive (or 0: by device), got {chunk}")
    chunk = effective_loss_chunk(chunk, hidden.device.type, weight.shape[0])
    compute_dtype = _compute_dtype(hidden, weight)
    grad_on = torch.is_grad_enabled()
    need_h = grad_on and hidden.requires_grad
    need_w = grad_on and weight.requires_grad
    if not (need_h or need_w):
        # Evaluation: the loss only, chunk by chunk, no gradient work.
        with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
            h_all, w = hidden.to(compute_dtype), weight.to(compute_dtype)
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for start in range(0, h_all.shape[0], chunk):
                total += _chunk_stats(h_all[start : start + chunk], w, targets[start : start + chunk])[2].sum()
            return total / (targets != IGNORE_INDEX).sum().float()
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, chunk, compute_dtype, need_h, need_w)


def _liger_loss(fallback: LossFn) -> Optional[LossFn]:
    """Liger-Kernel's fused linear cross-entropy, when installed (CUDA + Triton only).
    ``fallback`` (memtrain's own chunked loss) runs under the tracer's fake tensors, where a
    Triton kernel cannot: the trace then describes memtrain's kernel, not Liger's."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except Exception:  # noqa: BLE001 - not only ImportError: a Triton or transformers it does not fit raises others
        return None
    # The weight is handed over in the 16-bit compute dtype (below), and Liger then accumulates its
    # gradient over the chunks in that dtype; with the FP32 weight autocast would have given it, it
    # accumulates in FP32. accum_dtype keeps FP32 (as memtrain's own chunked loss does), where the
    # installed Liger takes it (0.6.2 on).
    accum = ({"accum_dtype": torch.float32}
             if "accum_dtype" in inspect.signature(LigerFusedLinearCrossEntropyLoss).parameters else {})
    module = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="mean", **accum)

    def liger_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if is_fake(hidden):
            return fallback(hidden, weight, targets)
        # Liger's kernel has mixed float32/bfloat16 operand bugs under autocast
        # (linkedin/Liger-Kernel#305, #501): hand it both operands already in the compute
        # dtype, with autocast off; autograd casts the gradients back to the parameters' dtype.
        dt = _compute_dtype(hidden, weight)
        with torch.autocast(hidden.device.type, enabled=False):
            return module(weight.to(dt), hidden.to(dt), targets).float()

    return liger_lm_loss


# Cut Cross-Entropy's gradient filter: None (memtrain's choice) computes every block of its backward,
# the gradients of the standard loss. Its own default, "high", skips each block of logits whose every
# |softmax - onehot| is below the compute dtype's eps / 32 (2.4e-4 in bf16). That suits a trained
# model's peaked softmax; a model trained from scratch starts near uniform (1/50257 = 2e-5 a token
# for GPT-2's vocabulary), where the filter would drop most of the softmax's pull on the head's rows.
# A module attribute, so that a benchmark can time both (benchmarks/loss_profile.py, "cce-filter").
CCE_FILTER_EPS: Optional[str] = None


class _CutCrossEntropyBuffers(torch.autograd.Function):
    """What Cut Cross-Entropy allocates, in its order, without its arithmetic: the tracer's fake
    tensors cannot enter its Triton kernels, so the trace (and the estimate checked against it)
    sees these instead. Read from cut-cross-entropy 25.1.1 (``cce.py``, ``cce_lse_forward.py``,
    ``indexed_dot.py``, ``cce_backward.py``, ``utils.py``), as memtrain calls it: exact (no
    gradient filter, so no per-vocabulary average and no sort).

    Forward: the valid-target mask and its ``nonzero()`` (int64, then an int32 copy), one float32
    log-sum-exp per token (kept for backward with both operands and the targets), 128-token locks and the float32
    target-logit dot (freed). The int32 copy, the valid positions' index, is dropped when every
    target counts (``_build_flat_valids`` returns None); where some may be ignored
    (``keeps_valids``: ``--loss-on completion``'s prompt tokens) the library keeps it with its
    saved tensors until backward. Sized here as if every target were valid (the library's index
    and log-sum-exp hold one entry per valid target): an upper bound, as the fake targets' values
    are unknown. Backward: the gradients of both operands in the compute dtype, zero-filled, and
    two int32 lock tables."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, e: torch.Tensor, c: torch.Tensor,  # type: ignore[override]
                targets: torch.Tensor, keeps_valids: bool) -> torch.Tensor:
        n = e.shape[0]
        mask = targets != IGNORE_INDEX
        index = mask.new_empty((n, 1), dtype=torch.int64)  # nonzero()'s shape when every target counts
        del mask
        valids = index.to(torch.int32)
        del index
        kept = (valids.squeeze(1),) if keeps_valids else ()  # (a view, as the library's)
        del valids
        lse = e.new_empty((n,), dtype=torch.float32)
        locks = e.new_zeros((cce_forward_locks(n),), dtype=torch.int32)
        neg_dot = e.new_zeros((n,), dtype=torch.float32)
        loss = neg_dot.add_(lse).mean()
        del locks, neg_dot
        # The library saves its targets too (``params.targets``, the flattened input: the caller's
        # tensor itself, never a copy here), so an offloader copies them to the host as it does there.
        ctx.save_for_backward(e, c, lse, targets, *kept)
        return loss

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor):  # type: ignore[override]
        e, c, lse, *_ = ctx.saved_tensors  # type: ignore[attr-defined]  # autograd ctx carries what forward saved
        de = torch.zeros_like(e)
        need_dc = ctx.needs_input_grad[1]  # type: ignore[attr-defined]  # autograd ctx carries it
        dc = torch.zeros_like(c, dtype=e.dtype) if need_dc else None
        de_locks = e.new_zeros(cce_lock_table_shape(e.shape[0], e.shape[1]), dtype=torch.int32)
        dc_locks = c.new_zeros(cce_lock_table_shape(c.shape[0], c.shape[1]), dtype=torch.int32)
        del de_locks, dc_locks
        return de, None if dc is None else dc.to(c.dtype), None, None


def _cce_loss(ignores_targets: bool = False) -> Optional[LossFn]:
    """Apple's Cut Cross-Entropy (``cut_cross_entropy.linear_cross_entropy``), when installed
    (CUDA + Triton only): the logits are made block by block in on-chip memory, never in the
    device's memory. Under the tracer's fake tensors, where a Triton kernel cannot run,
    :class:`_CutCrossEntropyBuffers` makes its buffers instead (``ignores_targets``: some targets
    may be ignored, so the library keeps its index of the valid ones)."""
    try:
        from cut_cross_entropy import linear_cross_entropy
    except Exception:  # noqa: BLE001 - not only ImportError: a Triton it does not fit raises others
        return None

    def cce_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # Both operands in the compute dtype (16-bit: the configuration refuses others), autocast
        # off, as for Liger; autograd casts the gradients back to the parameters' dtype.
        dt = _compute_dtype(hidden, weight)
        with torch.autocast(hidden.device.type, enabled=False):
            e, c = hidden.to(dt), weight.to(dt)
            if is_fake(hidden):
                loss = _CutCrossEntropyBuffers.apply(e, c, targets, ignores_targets)
            else:
                loss = linear_cross_entropy(e, c, targets, ignore_index=IGNORE_INDEX, reduction="mean",
                                            filter_eps=CCE_FILTER_EPS)
        return loss.float()

    return cce_lm_loss


# --loss-kernel -> (the module its loss imports, the maker of its loss, given memtrain's own: Liger's
# runs it under fake tensors). Looked up at call time (the lambdas), so that a test can stand in for either kernel.
_FOREIGN_LOSSES: dict[str, tuple[str, Callable[[LossFn, bool], Optional[LossFn]]]] = {
    "liger": ("liger_kernel.transformers", lambda own, ignores: _liger_loss(own)),
    "cce": ("cut_cross_entropy", lambda own, ignores: _cce_loss(ignores)),
}


def make_loss_fn(tech: TechniqueConfig, device: torch.device, ignores_targets: bool = False) -> LossFn:
    """The ``model.loss_fn`` that ``tech.loss`` names for ``device``; ``ignores_targets``: some
    targets may be ignored (-100, ``--loss-on completion``)."""
    if tech.loss == "standard":
        return standard_lm_loss
    if tech.loss == "chunked":
        env_problem = fp32_addmm_env_problem()
        if env_problem is not None:  # refused before the first step, not in its forward
            raise ConfigError(env_problem)
        # --loss-chunk 0 is resolved at each call, from the hidden states' device and the head's rows.
        own = functools.partial(chunked_lm_loss, chunk=tech.loss_chunk)
        refusal = loss_kernel_refusal(tech.loss, tech.loss_kernel, device.type)
        if refusal is not None:
            raise ConfigError(refusal)
        if tech.loss_kernel in _FOREIGN_LOSSES:
            module, make = _FOREIGN_LOSSES[tech.loss_kernel]
            foreign = make(own, ignores_targets)
            if foreign is None:  # found by find_spec but failed to import
                raise ConfigError(f"--loss-kernel {tech.loss_kernel}: {module} is installed but does not import "
                                  f"(python -c 'import {module}' shows why); drop --loss-kernel")
            # Outside the compiled graph: Liger's kernel calls .item(), Cut Cross-Entropy's finds
            # the ignored targets with .nonzero() (graph breaks), and both launch Triton kernels
            # that tune themselves on first use.
            return torch.compiler.disable(foreign)
        return own
    if tech.loss == "naive":
        return NaiveLoss()
    raise ConfigError(f"unknown --loss {tech.loss!r}; choose standard, chunked or naive")


class NaiveLoss:
    """``--loss naive``: the standard loss, with the logits kept alive by the caller.

    The common training loop ``logits = model(x); loss = F.cross_entropy(logits.view(-1, V),
    y); loss.backward(); opt.step()`` holds ``logits`` through backward, the optimizer step and
    the next forward, until ``logits = model(x)`` rebinds the name. Published memory tables
    (e.g. the seed's RTX 4090 table) measured that loop, so memtrain can run it: this loss keeps
    a reference to the logits until the next call replaces it, which is the same lifetime.
    """

    def __init__(self) -> None:
        self.logits: Optional[torch.Tensor] = None

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, weight)
        self.logits = logits  # the previous step's logits die here, as at the loop's rebinding
        return F.cross_entropy(logits.float(), targets, ignore_index=-100)



def apply_loss(model: nn.Module, tech: TechniqueConfig, device: torch.device, ignores_targets: bool = False) -> None:
    """Set ``model.loss_fn`` as ``tech.loss`` says (``ignores_targets``: see :func:`make_loss_fn`)."""
    model.loss_fn = make_loss_fn(tech, device, ignores_targets)  # type: ignore[assignment]  # torch types nn.Module attributes as Tensor | Module
