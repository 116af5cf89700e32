"""QLoRA: the frozen base weights stored in 4-bit NormalFloat (NF4), Dettmers et al. 2023.

Every Linear of the decoder that is not trainable (the base layers under peft's LoRA, and
every other frozen Linear; never the LM head or the embedding) gets its weight replaced:

* on CPU by torchao's ``NF4Tensor`` (``to_nf4``: 64-value blocks, double-quantized scales).
  ``F.linear`` on an NF4Tensor dispatches to torchao's ``linear_nf4``, which dequantizes
  the weight per call and keeps only the NF4 bytes for backward, so the nn.Linear module,
  and peft's wrapper around it, stay unchanged;
* on CUDA by bitsandbytes' ``Params4bit`` with ``matmul_4bit`` (the PEFT/Trainer QLoRA path).

torchao's NF4 needs a weight whose size divides into 64 x 256 values (its scales are
quantized in blocks of 256): smaller or odd weights stay in their dtype, and the number left
is returned so a run can say so.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Iterator

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake

from memtrain.config.run import ConfigError
from memtrain.runtime.extras import import_extra
from memtrain.runtime.notices import QLoRASkipWarning
from memtrain.techniques.facts import NF4_BLOCK, NF4_SCALER_BLOCK, nf4_quantizes


def _frozen_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    head = model.head if hasattr(model, "head") else None
    out = []
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and m is not head and "lora_" not in name and not m.weight.requires_grad:
            out.append((name, m))
    return out


def quantize_base_weights(model: nn.Module, device: torch.device) -> int:
    """Store the frozen Linear weights of ``model`` in NF4 in place; return how many stayed
    unquantized (their size does not fit torchao's blocks)."""
    linears = _frozen_linears(model)
    if not linears:
        raise ConfigError("--qlora found no frozen Linear weights to quantize; it needs --lora-rank")
    # Under the tracer's fake tensors bitsandbytes cannot run (Params4bit quantizes real
    # storage), so a CUDA trace stores torchao's NF4 instead: the same bytes per weight
    # (4 bits a value, an 8-bit scale per 64 values, an fp32 scale per 256 of those).
    if device.type == "cuda" and not is_fake(linears[0][1].weight):
        return _quantize_bnb(linears, device)
    import_extra("torchao")  # an optional extra (memtrain[lowbit]): one error line naming the pip command
    from torchao.quantization import to_nf4

    skipped = []
    for name, m in linears:
        w = m.weight
        if not nf4_quantizes(w.numel()):
            skipped.append(name)
            continue
        with _one_chunk_if_fake(w):
            q = to_nf4(w.detach(), NF4_BLOCK, NF4_SCALER_BLOCK)
        m.weight = nn.Parameter(q, requires_grad=False)
    if skipped:
        warnings.warn(f"--qlora: {len(skipped)} of {len(linears)} frozen Linear weights are not a multiple of "
                      f"{NF4_BLOCK * NF4_SCALER_BLOCK} values and stay unquantized (e.g. {skipped[0]})",
                      QLoRASkipWarning, stacklevel=2)
    _say_stacked_weights_stay(model)
    return len(skipped)


def _shown_name(name: str) -> str:
    """A parameter's name as the model folder has it: no wrapper's ``lm.`` or peft's ``base_layer``."""
    return name.removeprefix("lm.").replace(".base_layer", "")


def _say_stacked_weights_stay(model: nn.Module) -> None:
    """Warn when frozen weights of no Linear layer stay in their dtype: a mixture-of-experts
    layer's stacked experts (Mixtral's gate_up_proj and down_proj, most of its parameters) are
    3-D tensors, and memtrain's QLoRA quantizes Linear weights only (torchao and bitsandbytes
    alike); the run then holds them at full width, which nothing said."""
    stacked = [(name, p) for name, p in model.named_parameters()
               if p.dim() >= 3 and not p.requires_grad and "lora_" not in name]
    if not stacked:
        return
    total = sum({id(p): p.numel() for p in model.parameters()}.values())
    share = sum(p.numel() for _, p in stacked) / total
    name = _shown_name(stacked[0][0])
    kind = ": a mixture-of-experts layer's stacked experts" if ".experts." in f".{name}." else ""
    warnings.warn(f"--qlora: {len(stacked)} frozen weights of no Linear layer ({share:.0%} of the parameters, e.g. "
                  f"{name}{kind}) stay unquantized in their dtype", QLoRASkipWarning, stacklevel=3)


@contextlib.contextmanager
def _one_chunk_if_fake(w: torch.Tensor) -> Iterator[None]:
    """Quantize a fake (traced) weight in one chunk instead of torchao's 1M-value chunks.

    torchao maps values to NF4 codes chunk by chunk to bound the real scratch memory; the
    chunks write into one preallocated buffer, so the NF4Tensor it returns is the same whatever
    the chunk size. Under fake tensors a chunk allocates nothing but costs a few milliseconds
    of dispatch, and a full-size weight has hundreds (a 70B MLP weight: 224), which made
    quantization most of a traced QLoRA step. Real weights keep torchao's chunking.
    """
    from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor

    if not is_fake(w) or w.numel() <= nf4_tensor.CHUNK_SIZE:
        yield
        return
    saved = nf4_tensor.CHUNK_SIZE
    nf4_tensor.CHUNK_SIZE = w.numel()
    try:
        yield
    finally:
        nf4_tensor.CHUNK_SIZE = saved


def _bnb_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    import bitsandbytes as bnb

    w = self.weight
    return bnb.matmul_4bit(x, w.t(), bias=self.bias, quant_state=w.quant_state)  # type: ignore[attr-defined]


def _quantize_bnb(linears: list[tuple[str, nn.Linear]], device: torch.device) -> int:
    """bitsandbytes NF4 on CUDA (needs a GPU; not exercised by the CPU tests)."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise ConfigError("--qlora on CUDA uses bitsandbytes: pip install bitsandbytes") from None

    for _, m in linears:
        # Quantized where the weight already is (the model is built on the GPU): Params4bit's
        # .to(device) quantizes on that device, and a round trip through the host would copy every
        # frozen weight twice over PCIe and hold it in host memory.
        w = m.weight.detach()
        q = bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4",  # type: ignore[misc]  # bitsandbytes' .to overload confuses mypy where it is installed
                              compress_statistics=True).to(device)
        m.weight = q
        m.forward = functools.partial(_bnb_forward, m)  # type: ignore[method-assign]
    return 0


def nf4_unshardable(model: nn.Module, world_size: int) -> list[str]:
    """Names of the NF4 weights FSDP2 cannot split into ``world_size`` dim-0 shards.

    torchao's ``NF4Tensor`` shards by splitting its packed data, its per-block scales and its
    per-(64 x 256)-values scale factors into equal parts (``nf4_split``); a weight whose rows,
    or whose number of 64 x 256 scale blocks, do not divide by the rank count fails inside
    ``fully_shard`` with an assertion. Said before sharding instead."""
    out = []
    for name, m in model.named_modules():
        w = getattr(m, "weight", None) if isinstance(m, nn.Linear) else None
        if w is None or not hasattr(w, "quantization_factor"):  # not torchao NF4
            continue
        blocks = w.numel() // (NF4_BLOCK * NF4_SCALER_BLOCK)
        if w.shape[0] % world_size or blocks % world_size:
            out.append(name)
    return out
