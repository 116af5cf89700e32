"""Causal self-attention kernels, kept apart from the model so backends can be swapped.

Every backend takes ``q, k, v`` shaped (batch, heads, seq, head_dim) and returns the
attention output in the same shape. The model holds a callable ``AttentionFn`` and never
knows which backend runs; :mod:`memtrain.attention.apply` picks one from the config.

The baseline here is "math": softmax(QK^T / sqrt(d)) V with the full (seq x seq) score
matrix materialized. It is the reference the other backends are checked against, and the
memory they are meant to save. The others:

* :func:`sdpa_attention`: ``scaled_dot_product_attention(is_causal=True)``, automatic or one
  forced SDPA backend (flash, memory-efficient).
* :func:`banded_attention`: sliding window (``--window W``) in O(seq * W) memory, with a math
  or an SDPA kernel per band; runs on CPU and GPU, forward and backward.
* :func:`flex_attention_fn`, :func:`flash_attn_fn`: CUDA kernels (FlexAttention with a
  block mask, the ``flash_attn`` package) that also skip the blocks outside a window.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Callable, ContextManager, Optional, Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


class AttentionFn(Protocol):
    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float
    ) -> torch.Tensor: ...


def causal_mask(seq_len: int, device: torch.device, window: Optional[int] = None) -> torch.Tensor:
    """Boolean (seq, seq) mask, True where query i may attend key j.

    Causal: j <= i. With a window W, also i - j < W (the token itself and the W-1 before it),
    so each query sees exactly W keys once it is W tokens into the sequence.
    """
    i = torch.arange(seq_len, device=device).unsqueeze(1)
    j = torch.arange(seq_len, device=device).unsqueeze(0)
    allowed = j <= i
    if window is not None:
        allowed = allowed & (i - j < window)
    return allowed


def math_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    window: Optional[int] = None,
) -> torch.Tensor:
    """Materialized attention: the (batch, heads, seq, seq) scores live in memory.

    Scores are computed in the input dtype (as a plain PyTorch model would under autocast),
    the softmax in float32 for stability, then cast back.
    """
    seq = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    mask = causal_mask(seq, q.device, window)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = F.softmax(scores.float(), dim=-1).to(q.dtype)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    return probs @ v


# --------------------------------------------------------------------------- SDPA
def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    backend: Optional[SDPBackend] = None,
) -> torch.Tensor:
    """Causal ``scaled_dot_product_attention``; the (seq x seq) scores are never stored by
    the fused kernels.

    ``backend=None`` lets PyTorch pick (flash, memory-efficient, cuDNN or math, by device,
    dtype and arguments). A named backend is forced with ``sdpa_kernel``: if it cannot run,
    SDPA raises instead of falling back, which is what a benchmark row that claims "flash"
    needs.
    """
    with _forced(backend):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)


def _forced(backend: Optional[SDPBackend]) -> ContextManager:
    return contextlib.nullcontext() if backend is None else sdpa_kernel([backend])


# --------------------------------------------------------------------------- sliding window
# Banded attention is written by hand: SDPA takes only a dense (seq x seq) mask, FlexAttention
# and the flash-attn package have no CPU backward, so no library gives sliding-window
# attention whose memory grows with seq * W on both CPU and GPU.


def _band_mask(n_blocks: int, block: int, window: int, device: torch.device) -> torch.Tensor:
    """Boolean (n_blocks, block, block + window - 1): query r of block n may see band key c.

    Block n holds queries [n*block, (n+1)*block) and its band holds keys
    [n*block - (window-1), (n+1)*block), so query offset r and key offset c are
    i - j = (window - 1) + r - c apart: allowed when 0 <= i - j < window, i.e. r <= c <= r + W - 1,
    and when the key is real (j >= 0, not left padding).
    """
    r = torch.arange(block, device=device).view(1, block, 1)
    c = torch.arange(block + window - 1, device=device).view(1, 1, -1)
    n = torch.arange(n_blocks, device=device).view(n_blocks, 1, 1)
    return (c >= r) & (c <= r + window - 1) & (n * block - (window - 1) + c >= 0)


def _bands(x: torch.Tensor, block: int, window: int, n_blocks: int) -> torch.Tensor:
    """(b, h, s, d) -> (b, h, n_blocks, block + window - 1, d): each block's key band.

    Pads window-1 zero rows on the left (masked out) and enough on the right to fill the last
    block, then takes overlapping windows with ``unfold`` (a view: the band is copied at most
    once, by the matmul that reads it, so its size is about 2x the keys, not seq x seq).
    """
    s = x.shape[-2]
    padded = F.pad(x, (0, 0, window - 1, n_blocks * block - s))
    return padded.unfold(-2, block + window - 1, block).transpose(-1, -2)


def banded_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    *,
    window: int,
    block: Optional[int] = None,
    kernel: str = "math",
    backend: Optional[SDPBackend] = None,
) -> torch.Tensor:
    """Causal sliding-window attention (query i sees keys i-W+1 .. i) in O(seq * W) memory.

    Queries are split into blocks of ``block`` tokens (default W); each block attends only to
    the band of keys [start - W + 1, end), i.e. its own block and the W-1 keys before it, so the
    scores held per query are block + W - 1 instead of seq. Autograd saves only these band
    tensors, so the backward pass stays O(seq * W) too.

    ``kernel="math"`` materializes the band scores (softmax in float32, like
    :func:`math_attention`); ``kernel="sdpa"`` runs ``scaled_dot_product_attention`` over every
    band at once with the band mask (optionally forced to ``backend``), so a fused kernel also
    skips the band scores.

    When the band would be no narrower than the full row (block + W - 1 >= seq; W >= seq among
    them) the dense masked form is used instead: it is then the smaller one.
    """
    b, h, s, d = q.shape
    blk = min(block or window, s)
    if blk + window - 1 >= s:
        return _dense_window(q, k, v, dropout_p, window, kernel, backend)
    return _banded(q, k, v, dropout_p, window, blk, kernel, backend)


def _dense_window(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
    window: int, kernel: str, backend: Optional[SDPBackend],
) -> torch.Tensor:
    s = q.shape[-2]
    if kernel == "math":
        return math_attention(q, k, v, dropout_p, window=None if window >= s else window)
    if window >= s:
        return sdpa_attention(q, k, v, dropout_p, backend)
    mask = causal_mask(s, q.device, window)
    with _forced(backend):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


def _banded(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
    window: int, block: int, kernel: str, backend: Optional[SDPBackend],
) -> torch.Tensor:
    """The band computation proper (always banded; ``banded_attention`` decides when)."""
    b, h, s, d = q.shape
    n_blocks = -(-s // block)
    qb = F.pad(q, (0, 0, 0, n_blocks * block - s)).view(b, h, n_blocks, block, d)
    kb = _bands(k, block, window, n_blocks)
    vb = _bands(v, block, window, n_blocks)
    mask = _band_mask(n_blocks, block, window, q.device)
    # Right-padding queries (i >= s) always see at least their own zero key, so no row of the
    # band is fully masked (no NaN); their outputs are cut off below and get no gradient.
    if kernel == "math":
        scores = (qb @ kb.transpose(-1, -2)) * (1.0 / math.sqrt(d))
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = F.softmax(scores.float(), dim=-1).to(q.dtype)
        if dropout_p > 0.0:
            probs = F.dropout(probs, p=dropout_p)
        out = probs @ vb
    else:
        # SDPA wants 4-D inputs with a 4-D mask: fold (batch, heads) into one dim and let the
        # blocks play the role of heads, so the (1, n_blocks, block, band) mask broadcasts.
        band = block + window - 1
        out = _sdpa_masked(
            qb.reshape(b * h, n_blocks, block, d),
            kb.reshape(b * h, n_blocks, band, d),
            vb.reshape(b * h, n_blocks, band, d),
            mask.unsqueeze(0), dropout_p, backend,
        )
    return out.reshape(b, h, n_blocks * block, d)[:, :, :s]


def _sdpa_masked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
    dropout_p: float, backend: Optional[SDPBackend],
) -> torch.Tensor:
    with _forced(backend):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


# --------------------------------------------------------------------------- CUDA-only kernels
_compiled_flex: Optional[Callable[..., torch.Tensor]] = None


def _flex() -> Callable[..., torch.Tensor]:
    """``flex_attention`` compiled once: uncompiled it runs a slow reference implementation
    that materializes the scores, which would defeat the point."""
    global _compiled_flex
    if _compiled_flex is None:
        # flex_attention is torch >= 2.5 (2.4 is supported): loaded only for --attention flex
        from torch.nn.attention.flex_attention import flex_attention

        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


@functools.lru_cache(maxsize=16)
def flex_block_mask(seq_len: int, window: Optional[int], device: str):
    """FlexAttention ``BlockMask`` for causal (and sliding-window) attention, built once per
    (seq, window, device): blocks outside the band are skipped entirely by the kernel."""
    # flex_attention is torch >= 2.5 (2.4 is supported): loaded only for --attention flex
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):  # noqa: ANN001 - traced by FlexAttention
        allowed = q_idx >= kv_idx
        if window is not None:
            allowed = allowed & (q_idx - kv_idx < window)
        return allowed

    return create_block_mask(mask_mod, None, None, seq_len, seq_len, device=device)


def flex_attention_fn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
    window: Optional[int] = None,
) -> torch.Tensor:
    """Causal (optionally windowed) attention with FlexAttention (CUDA; no dropout support)."""
    if dropout_p > 0.0:
        raise RuntimeError("flex_attention has no attention dropout")
    mask = flex_block_mask(q.shape[-2], window, str(q.device))
    return _flex()(q, k, v, block_mask=mask)


def flash_attn_fn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
    window: Optional[int] = None,
) -> torch.Tensor:
    """The ``flash_attn`` package's kernel (CUDA, fp16/bf16). It takes (batch, seq, heads,
    head_dim); ``window_size=(W-1, 0)`` is the same band as ``causal_mask(window=W)``."""
    from flash_attn import flash_attn_func

    size = (window - 1, 0) if window is not None else (-1, -1)
    out = flash_attn_func(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        dropout_p=dropout_p, causal=True, window_size=size,
    )
    return out.transpose(1, 2)
