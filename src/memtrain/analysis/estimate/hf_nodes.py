"""The op-inventory nodes of a transformers (Llama-style) decoder layer that differ from our
GPT's: the float32 RMSNorm and the rotary embedding (read by the inventory when ``Arch.hf``;
what they model: :mod:`memtrain.analysis.estimate.hf`)."""

from __future__ import annotations

from typing import Any

from memtrain.analysis.estimate.simulator import Node

__all__ = ["hf_norm_node", "hf_rope_node"]


def hf_norm_node(dm: Any, name: str, src: str, out: str, trainable: bool) -> Any:
    """LlamaRMSNorm: ``w * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(dtype)``. Saved:
    the float32 input (``src`` itself when the stream is float32), rstd, and (for a trainable
    weight) the normalized tensor in the stream's dtype; the output is read by the projections
    (saved by them)."""
    N, d, r = dm.n, dm.d, dm.r
    x32 = src if r == 4 else f"{name}.x32"
    outs: list[tuple] = [(out, N * d * r), (f"{name}.stats", N * 4), (f"{name}.nrm", N * d * r)]
    if r != 4:
        outs.append((x32, N * d * 4))
    # The weight multiply keeps the normalized tensor only for the weight's gradient: not when
    # the norm is frozen (LoRA).
    saves = [x32, f"{name}.stats"] + ([f"{name}.nrm"] if trainable else [])
    return Node(name, out=outs, inputs=[src], saves=saves, grad_out=(out,),
                 grads=[(src, N * d * r)] + ([(f"param:{name}.weight", 0.0)] if trainable else []),
                 # pow's output, and the float32 normalized tensor before its cast back
                 fwd_scratch=N * d * 4 * (2 if r != 4 else 1),
                 # backward: the float32 gradient through the cast, mul and pow
                 scratch=2 * N * d * 4)


def hf_rope_node(dm: Any, qkv: str, out: str) -> Any:
    """apply_rotary_pos_emb: new q and k (``q * cos + rotate_half(q) * sin``); v passes on. For
    memory the q/k/v triple stays one storage (what SDPA saves); the forward's scratch is the
    products and the ``cat`` of rotate_half."""
    N, d, kv, a = dm.n, dm.d, dm.kv, dm.a
    return Node(f"{out}.rope", out=[(out, N * (d + 2 * kv) * a)], inputs=[qkv],
                 grads=[(qkv, N * (d + 2 * kv) * a)], fwd_scratch=3 * N * (d + kv) * a,
                 scratch=2 * N * (d + kv) * a)
