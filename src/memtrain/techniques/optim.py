"""Optimizer construction, and how much memory an optimizer's state takes.

``--optim`` chooses one of:

=================  ==========================================================  ==============
name               implementation                                              state / param
=================  ==========================================================  ==============
adamw              ``torch.optim.AdamW``, the device's kernel: fused on CUDA,   8 bytes
                   the per-tensor loop (``foreach=False``) on CPU
                   (:func:`default_adamw_kernel`)
adamw-foreach      ``torch.optim.AdamW(foreach=True)``: batched multi-tensor    8 bytes
adamw-fused        ``torch.optim.AdamW(fused=True)``: one fused kernel          8 bytes
                   (CPU and CUDA)
adafactor          ``torch.optim.Adafactor``: no first moment, second moment    ~0 (O(m+n) per
                   factored into row and column averages; ``--lr`` is the       m x n matrix)
                   step size unless ``--adafactor-relative-step``
adamw-8bit         ``torchao.optim.AdamW8bit``: block-wise 8-bit moments        ~2 bytes
adamw-4bit         ``torchao.optim.AdamW4bit``: block-wise 4-bit moments        ~1 byte
adamw-bnb-8bit     ``bitsandbytes.optim.AdamW8bit`` (CUDA only)                 ~2 bytes
sgd                ``torch.optim.SGD(momentum=0.9)``                            4 bytes
=================  ==========================================================  ==============

With ``--precision bf16-pure`` the weights are BF16 and there is no FP32 master copy: an update
smaller than half a BF16 step (1/256 of the weight) would be rounded away every time. The
optimizers that can run there use torchao's BF16 *stochastic rounding*
(``bf16_stochastic_round=True``): the FP32 result of the update is rounded up or down with
probability proportional to its distance, so small updates survive in expectation.
``adamw`` maps to ``torchao.optim._AdamW`` (plain AdamW whose state has the parameter dtype;
memtrain updates its small tensors a bucket per compiled call: :mod:`memtrain.techniques.sr_adamw`),
``adamw-8bit``/``adamw-4bit`` to the low-bit ones with the same flag; the others raise a
ConfigError.

torchao's low-bit optimizers quantize only tensors with at least 4096 elements whose element
count divides into the quantization block (``--optim-block``; by default 256 for 8-bit, 128 for
4-bit); every other tensor keeps FP32 state. Biases and LayerNorm weights are small and cost nothing noticeable, but GPT-2's
odd vocabulary (50257 rows) can leave the largest matrix, the token embedding, unquantized:
:func:`build_optimizer` warns (:class:`LowBitSkipWarning`) naming such tensors and the fix.

Weight decay goes to matrices and embeddings only; biases and LayerNorm weights are not
decayed (as GPT-2 and nanoGPT do), which needs two parameter groups.
"""

from __future__ import annotations

import importlib.util
import warnings
from typing import Any, Iterator

import torch
import torch.nn as nn

from memtrain.config.run import ConfigError, TechniqueConfig, TrainConfig
from memtrain.runtime.extras import import_extra
from memtrain.runtime.notices import NoticeWarning
from memtrain.techniques.facts import ADAMW_KERNELS, BF16_PURE_OPTIMS, LOW_BIT_BLOCK, LOW_BIT_MIN_NUMEL

__all__ = [
    "LOW_BIT_BLOCK",
    "LOW_BIT_MIN_NUMEL",
    "LowBitSkipWarning",
    "build_optimizer",
    "low_bit_block",
    "low_bit_skipped",
    "param_groups",
]

# torchao's quantization block per optimizer (its defaults), the size below which it keeps FP32
# state, and the optimizers bf16-pure can use come from the technique registry
# (memtrain.techniques.facts), which the estimate reads too.


def low_bit_block(tech: TechniqueConfig) -> int:
    """The quantization block ``tech`` gives its low-bit optimizer (``--optim-block``, else
    torchao's default for that optimizer)."""
    return tech.optim_block or LOW_BIT_BLOCK[tech.optim]

BNB_MESSAGE = (
    "--optim adamw-bnb-8bit needs CUDA and `pip install bitsandbytes`; "
    "use --optim adamw-8bit (torchao) on CPU"
)


class LowBitSkipWarning(NoticeWarning):
    """A large tensor keeps FP32 optimizer state under a low-bit optimizer."""


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Trainable parameters split into decayed (dim >= 2) and not decayed groups."""
    params = [p for p in model.parameters() if p.requires_grad]
    # parameters() already yields a tied weight once.
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def _trainable(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """Named trainable parameters, each once, without wrapper prefixes (compile, DDP)."""
    for name, p in model.named_parameters():
        if p.requires_grad:
            while name.startswith(("_orig_mod.", "module.")):
                name = name.split(".", 1)[1]
            yield name, p


def low_bit_skipped(model: nn.Module, block_size: int, min_numel: int = LOW_BIT_MIN_NUMEL) -> list[tuple[str, tuple[int, ...]]]:
    """Trainable tensors large enough to matter (>= ``min_numel`` elements) that a torchao
    low-bit optimizer with ``block_size`` leaves in FP32 because their size does not divide
    into the block. Small tensors (biases, norms) are skipped too but are not listed."""
    return [
        (name, tuple(p.shape))
        for name, p in _trainable(model)
        if p.numel() >= min_numel and p.numel() % block_size != 0
    ]


def _vocab_fix(model: nn.Module, shape: tuple[int, ...], block_size: int) -> str:
    """The --vocab-multiple that makes an embedding of ``shape`` quantizable."""
    base = getattr(model, "_orig_mod", model)
    cfg = getattr(base, "cfg", None)
    vocab = getattr(cfg, "vocab_size", shape[0])
    d = shape[1] if len(shape) > 1 else 1
    for multiple in (64, 128, 256, 512, 1024):
        padded = -(-vocab // multiple) * multiple
        if padded * d % block_size == 0:
            return f"--vocab-multiple {multiple} (pads {vocab} to {padded} rows)"
    return f"a --d-model divisible by {block_size}"


def _warn_low_bit_skips(model: nn.Module, optim: str, block: int) -> None:
    """Warn when a large share of the state would stay FP32 (the saving silently vanishes)."""
    params = list(_trainable(model))
    total = sum(p.numel() for _, p in params)
    skipped = low_bit_skipped(model, block)
    if skipped:
        lost = sum(torch.Size(s).numel() for _, s in skipped)
        names = ", ".join(f"{n} {tuple(s)}" for n, s in skipped)
        is_emb = [n.endswith(("wte.weight", "lm_head.weight")) for n, _ in skipped]
        fixes = []
        if any(is_emb):
            emb = skipped[is_emb.index(True)][1]
            fixes.append("pad the vocabulary with " + _vocab_fix(model, emb, block))
        if not all(is_emb):
            fixes.append(f"choose sizes whose element count is a multiple of {block}")
        warnings.warn(
            f"--optim {optim} keeps FP32 state for {names}: {lost / total:.0%} of the trainable "
            f"parameters, because {block} does not divide their element count; "
            f"{' and '.join(fixes)}",
            LowBitSkipWarning,
            stacklevel=3,
        )
    small = sum(p.numel() for _, p in params if p.numel() < LOW_BIT_MIN_NUMEL)
    if total and small / total >= 0.5:
        # Typical of LoRA: an r x d adapter is below the floor unless r * d >= 4096.
        warnings.warn(
            f"--optim {optim} keeps FP32 state for {small / total:.0%} of the trainable parameters "
            f"(tensors under {LOW_BIT_MIN_NUMEL} elements, e.g. small LoRA adapters); it saves little "
            f"here, use --optim adamw",
            LowBitSkipWarning,
            stacklevel=3,
        )


def uses_torchao(tech: TechniqueConfig) -> bool:
    """True when :func:`build_optimizer` builds one of torchao's optimizers for ``tech``."""
    return tech.optim in LOW_BIT_BLOCK or (tech.optim == "adamw" and tech.precision == "bf16-pure")


def check_optimizer_installed(tech: TechniqueConfig) -> None:
    """Refuse, before a run builds or tokenizes anything, an optimizer whose package (torchao,
    the ``lowbit`` extra) is not installed: one ConfigError naming the pip command."""
    if uses_torchao(tech):
        import_extra("torchao")


def _torchao_optim(name: str) -> Any:
    # Imported only when asked for: importing torchao is slow and prints loader noise; and it is
    # an optional extra (memtrain[lowbit]): import_extra() names the pip command when it is absent.
    import_extra("torchao")
    import torchao.optim as ao

    # torch.compile advises every tensor subclass to implement a cache hash; torchao's state
    # classes do not, which only costs a cache miss. Keep that advice out of users' logs.
    warnings.filterwarnings("ignore", message=r".*does not implement _stable_hash_for_caching")

    return getattr(ao, name)


def _first_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _adafactor_eps(relative_step: bool) -> tuple[None, float]:
    """``eps`` for torch.optim.Adafactor, whose step is always ``max(eps2, RMS(weight)) * lr``.

    Its default ``eps2 = 1e-3`` makes the step relative: GPT weights start with RMS ~0.02, so
    ``--lr 3e-4`` would move them by ~6e-6 per step, 50x less than AdamW or the Trainer's
    Adafactor at the same ``--lr`` (a far worse val PPL after the same steps: benchmarks/README.md,
    "Perplexity"). ``eps2 = 1`` floors the scale at 1, so every weight with RMS <= 1 (all of them at
    initialization, LayerNorm gains included) moves by ``--lr`` times the RMS-clipped update:
    transformers' Adafactor with scale_parameter=False and relative_step=False. torch offers no
    switch for this; the floor is the documented knob that has this effect.
    """
    return (None, 1e-3 if relative_step else 1.0)


def default_adamw_kernel(device: torch.device) -> dict[str, bool]:
    """The AdamW kernel ``--optim adamw`` uses on ``device`` (the user chose AdamW, not a kernel;
    ``adamw-foreach`` / ``adamw-fused`` pin one). All three compute the same update.

    - CUDA: the fused kernel (one launch for all tensors; what torch recommends for speed),
      else foreach where the probe finds no fused kernel.
    - CPU: the plain per-tensor loop (``foreach=False``), unchanged: it needs no scratch at the
      step, and the kernels' speed on CPU is a small share of a step (docs/performance.md).
    """
    if device.type == "cuda":
        from memtrain.devices.probe import probe  # looked up at call time: tests stand in for it

        caps = probe(device, measure=False)
        if caps.fused_adamw:
            return {"fused": True}
        if caps.foreach_adamw:
            return {"foreach": True}
    return {"foreach": False}


def build_optimizer(model: nn.Module, tech: TechniqueConfig, train: TrainConfig) -> torch.optim.Optimizer:
    """The optimizer named by ``tech.optim`` over the model's trainable parameters.

    Under ``tech.precision == "bf16-pure"`` the BF16-stochastic-rounding variant is built
    (see the module docstring); an optimizer without one is a ConfigError.
    """
    groups = param_groups(model, train.weight_decay)
    if not any(g["params"] for g in groups):
        raise ConfigError("the model has no trainable parameters; check --lora-rank / --lora-targets")
    betas = (train.beta1, train.beta2)
    name = tech.optim
    pure_bf16 = tech.precision == "bf16-pure"
    if pure_bf16 and name not in BF16_PURE_OPTIMS:
        raise ConfigError(
            f"--optim {name} cannot update BF16 weights without an FP32 copy; with --precision "
            f"bf16-pure use --optim {', '.join(BF16_PURE_OPTIMS)} (BF16 stochastic rounding), "
            f"or use --precision bf16 (autocast, FP32 weights)"
        )

    if name == "adamw" and pure_bf16:
        # torchao's _AdamW: AdamW whose update is computed in FP32 and stochastically rounded
        # into the BF16 weight; its moments are kept in the parameter dtype (BF16). Its small
        # tensors are updated a bucket per compiled call (memtrain.techniques.sr_adamw).
        _torchao_optim("_AdamW")
        # imported only here: it imports torchao, an optional extra (checked just above)
        from memtrain.techniques.sr_adamw import BucketedSRAdamW

        return BucketedSRAdamW(groups, lr=train.lr, betas=betas, bf16_stochastic_round=True)
    if name in ADAMW_KERNELS:
        kw = default_adamw_kernel(_first_device(model)) if name == "adamw" else (
            {"foreach": True} if name == "adamw-foreach" else {"fused": True})
        return torch.optim.AdamW(groups, lr=train.lr, betas=betas, **kw)
    if name in LOW_BIT_BLOCK:
        cls = _torchao_optim("AdamW8bit" if name == "adamw-8bit" else "AdamW4bit")
        block = low_bit_block(tech)
        _warn_low_bit_skips(model, name, block)
        return cls(groups, lr=train.lr, betas=betas, block_size=block, bf16_stochastic_round=pure_bf16)
    if name == "adafactor":
        return torch.optim.Adafactor(groups, lr=train.lr, eps=_adafactor_eps(tech.adafactor_relative_step))
    if name == "adamw-bnb-8bit":
        if _first_device(model).type != "cuda" or importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError(BNB_MESSAGE)
        import bitsandbytes as bnb

        # bitsandbytes pads blocks itself; it keeps 32-bit state only for tensors < LOW_BIT_MIN_NUMEL values.
        return bnb.optim.AdamW8bit(groups, lr=train.lr, betas=betas)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=train.lr, momentum=0.9)
    raise ConfigError(f"unknown --optim {name!r}")
