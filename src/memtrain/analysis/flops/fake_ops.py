"""Fake-tensor answers for the ops whose fake kernel refuses what a real CPU step runs.

torch's fake (meta) kernel of ``aten._grouped_mm`` checks the CUDA kernel's bf16-only inputs,
while the CPU kernel a real step of a mixture-of-experts layer runs (transformers' Mixtral,
Qwen3-MoE: the experts are stacked tensors multiplied by ``grouped_mm``) takes float32 too. The
trace (memory) and the FLOP count both run such a step under fake tensors: each answers a
non-bf16 CPU ``grouped_mm`` with the output the CPU kernel makes.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensorMode


def grouped_mm_output(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: Optional[torch.Tensor] = None,
                      bias: Optional[torch.Tensor] = None,
                      out_dtype: Optional[torch.dtype] = None) -> tuple[list[int], torch.dtype]:
    """The shape and dtype of ``aten._grouped_mm(mat_a, mat_b, offs)``'s output, as its CPU kernel
    makes it (torch's ``_create_grouped_mm_output_tensor`` without the CUDA row padding): a
    2-D ``mat_a`` split into groups by ``offs`` against 3-D ``mat_b`` (experts' forward), 2-D by
    2-D (their weight gradients, one matrix per group), 3-D by 2-D, or 3-D by 3-D (batched)."""
    groups = offs.size(0) if offs is not None else mat_b.size(0)
    if mat_a.dim() == 2:
        shape = [groups, mat_a.size(0), mat_b.size(1)] if mat_b.dim() == 2 else [mat_a.size(0), mat_b.size(-1)]
    else:
        shape = [mat_a.size(1), mat_b.size(1)] if mat_b.dim() == 2 else [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    return shape, out_dtype or mat_a.dtype


def needs_cpu_grouped_mm(func: Any, args: tuple) -> bool:
    """Whether ``func(*args)`` is a CPU ``grouped_mm`` that torch's fake kernel would refuse."""
    return (func is torch.ops.aten._grouped_mm.default and args[0].device.type == "cpu"
            and args[0].dtype != torch.bfloat16)


def grouped_mm_flops(mat_a: Any, mat_b: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """FLOPs of ``aten._grouped_mm`` from its operands' shapes (torch 2.13's counter has no
    formula: a mixture-of-experts step counted without its experts). Each row of a 2-D operand
    meets one group's matrix, so the groups split the work rather than repeat it: 2 x M x K x N
    over the whole operands, and each group's for 3-D by 3-D."""
    a, b = list(mat_a), list(mat_b)
    if len(a) == 2 and len(b) == 2:  # (M, K) x (K, N), K split into groups
        return 2 * a[0] * a[1] * b[1]
    if len(a) == 2:  # (M, K) x (G, K, N), M split into groups
        return 2 * a[0] * a[1] * b[2]
    if len(b) == 2:  # (G, M, K) x (K, N), N split into groups
        return 2 * a[1] * a[2] * b[1]
    return 2 * a[0] * a[1] * a[2] * b[2]  # (G, M, K) x (G, K, N)


class CpuStepFakeMode(FakeTensorMode):
    """``FakeTensorMode`` that runs what a CPU step runs: a float32 ``grouped_mm`` gets the output
    the CPU kernel makes (allocated by the fake mode, so a meter counts it) instead of the fake
    kernel's bf16-only refusal."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if needs_cpu_grouped_mm(func, args):
            shape, dtype = grouped_mm_output(*args, **(kwargs or {}))
            return super().__torch_dispatch__(torch.ops.aten.empty.memory_format, types, (shape,),
                                              {"dtype": dtype, "device": args[0].device})
        return super().__torch_dispatch__(func, types, args, kwargs)
