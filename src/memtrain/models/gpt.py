"""A decoder-only Transformer language model (GPT-2 shape), readable in one sitting.

Token + learned position embeddings -> n_layers pre-LayerNorm blocks
(x + Attn(LN(x)), then x + MLP(LN(x))) -> final LayerNorm -> LM head, tied to the token
embedding unless ``untie_embeddings``.

Two seams let the techniques change the model without subclassing it:

* ``CausalSelfAttention.attn_fn``: the attention kernel (see :mod:`memtrain.attention.kernels`).
* ``GPT.loss_fn``: how hidden states become a loss. The standard one materializes the
  full (tokens x vocab) logits; a chunked one never does. With GPT-2's 50257-token
  vocabulary the logits are the largest single tensor of the default model, so the loss
  is a first-class, swappable part of the model.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from memtrain.attention.kernels import AttentionFn, math_attention
from memtrain.config.run import ModelConfig

# (hidden (N, d), lm_head weight (V, d), targets (N,)) -> mean loss over targets != -100
LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def standard_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy through the full logits (N x V), computed in float32 for stability.

    Under autocast the matmul runs in bf16/fp16 but cross_entropy upcasts to float32, so the
    logits exist once in low precision and once in float32: that pair is the memory peak
    the chunked loss removes.
    """
    logits = F.linear(hidden, weight)
    return F.cross_entropy(logits.float(), targets, ignore_index=-100)


def answer_targets(targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``targets`` made safe for a loss, and its weight: 1.0 when they hold a target, 0.0 when
    every one is ignored (-100; ``--loss-on completion``'s micro-batch of prompt tokens only).

    Every loss kernel divides by the count of targets, so such a micro-batch's loss is 0 / 0
    (NaN) and so is its gradient. Its first target is set to token 0 instead, so the kernel
    divides by one, and the weight, multiplying the loss, leaves it 0 with a zero gradient.
    Decided on the device: no host sync. A micro-batch with a target is left as it is (the
    weight's 1.0 multiplies exactly)."""
    has = (targets != -100).any()
    flat = targets.reshape(-1)
    first = torch.arange(flat.numel(), device=flat.device) == 0
    safe = torch.where(has | ~first, flat, torch.zeros_like(flat)).view_as(targets)
    return safe, has.to(torch.float32)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.head_dim
        # One fused projection for q, k, v: one matmul instead of three.
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.attn_dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.attn_fn: AttentionFn = math_attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        # (b, t, d) -> (b, heads, t, head_dim)
        q, k, v = (z.view(b, t, self.n_heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = self.attn_fn(q, k, v, self.attn_dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(b, t, d)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.fc_out = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # tanh approximation as in GPT-2.
        return self.dropout(self.fc_out(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def _padded(module: nn.Module, cfg: ModelConfig) -> nn.Module:
    """Grow ``module``'s (vocab_size x d) weight to padded_vocab_size rows of zeros at the end."""
    extra = cfg.padded_vocab_size - cfg.vocab_size
    if extra:
        w = module.weight.data
        module.weight = nn.Parameter(torch.cat([w, w.new_zeros(extra, w.shape[1])]))  # type: ignore[arg-type,index,list-item,operator]  # torch types nn.Module attributes as Tensor | Module
        if isinstance(module, nn.Embedding):
            module.num_embeddings = cfg.padded_vocab_size
        else:
            module.out_features = cfg.padded_vocab_size  # type: ignore[assignment]  # torch types nn.Module attributes as Tensor | Module
        module._vocab_padded = True  # type: ignore[assignment,attr-defined]  # torch types nn.Module attributes as Tensor | Module
    return module


class GPT(nn.Module):
    """The language model. ``forward(idx, targets)`` returns the mean loss when targets are
    given, else the logits of every position."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # Padding (--vocab-multiple) only changes the storage: modules are built and
        # initialised with vocab_size rows, so a padded model draws the same random numbers
        # and starts from the same weights as the unpadded one; the extra rows are zeros
        # that no token uses and the loss never sees (see ``head_weight``).
        self.wte = _padded(nn.Embedding(cfg.vocab_size, cfg.d_model), cfg)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.lm_head = _padded(nn.Linear(cfg.d_model, cfg.vocab_size, bias=False), cfg)
        if not cfg.untie_embeddings:
            # Weight tying (Press & Wolf 2017): one (V x d) matrix serves input and output.
            self.lm_head.weight = self.wte.weight
        self.loss_fn: LossFn = standard_lm_loss
        # --loss-on completion: a micro-batch may hold no target at all (answer_targets).
        self.answers_only = False
        self.apply(lambda m: self._init_weights(m, cfg.vocab_size))
        # GPT-2: scale the residual projections by 1/sqrt(2 * n_layers) so the residual
        # stream's variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("fc_out.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init_weights(module: nn.Module, vocab_size: int) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            w = module.weight
            if getattr(module, "_vocab_padded", False):
                # Draw exactly what the unpadded model draws; padded rows stay zero.
                with torch.no_grad():
                    nn.init.normal_(w[:vocab_size], mean=0.0, std=0.02)
                    w[vocab_size:].zero_()
            else:
                nn.init.normal_(w, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def hidden_states(self, idx: torch.Tensor) -> torch.Tensor:
        """Final-LayerNorm output (batch, seq, d_model): everything before the LM head."""
        b, t = idx.shape
        if t > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {t} tokens exceeds max_seq_len {self.cfg.max_seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)

    def head_weight(self) -> torch.Tensor:
        """The LM-head rows of real tokens: padded rows (if any) are sliced off (a view, no
        copy), so padding never changes the logits, the loss or the gradients."""
        w = self.lm_head.weight
        return w if w.shape[0] == self.cfg.vocab_size else w[: self.cfg.vocab_size]  # type: ignore[index,return-value]  # torch types nn.Module attributes as Tensor | Module

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = self.hidden_states(idx)
        if targets is None:
            return F.linear(h, self.head_weight())
        if self.answers_only:
            y, weight = answer_targets(targets.reshape(-1))
            return self.loss_fn(h.reshape(-1, h.shape[-1]), self.head_weight(), y) * weight
        return self.loss_fn(h.reshape(-1, h.shape[-1]), self.head_weight(), targets.reshape(-1))

    def num_parameters(self, trainable_only: bool = False, exclude_positional: bool = False) -> int:
        """Count parameters once each (the tied head is not counted twice)."""
        seen: set[int] = set()
        total = 0
        for p in self.parameters():
            if id(p) in seen or (trainable_only and not p.requires_grad):
                continue
            seen.add(id(p))
            total += p.numel()
        if exclude_positional:
            total -= self.wpe.weight.numel()
        return total

    def summary(self) -> str:
        """A readable table: each top-level part, its shape and parameter count."""
        c = self.cfg
        rows = [
            ("token embedding", f"{c.padded_vocab_size} x {c.d_model}", self.wte.weight.numel()),  # type: ignore[operator]  # torch types nn.Module attributes as Tensor | Module
            ("position embedding", f"{c.max_seq_len} x {c.d_model}", self.wpe.weight.numel()),
        ]
        per_block = sum(p.numel() for p in self.blocks[0].parameters()) if c.n_layers else 0
        rows.append((f"blocks ({c.n_layers})", f"{c.n_heads} heads, d_ff {c.d_ff}", per_block * c.n_layers))
        rows.append(("final LayerNorm", f"{c.d_model}", sum(p.numel() for p in self.ln_f.parameters())))
        head = 0 if not c.untie_embeddings else self.lm_head.weight.numel()  # type: ignore[operator]  # torch types nn.Module attributes as Tensor | Module
        rows.append(("LM head", "tied to token embedding" if not c.untie_embeddings else f"{c.d_model} x {c.padded_vocab_size}", head))
        width = max(len(r[0]) for r in rows)
        lines = [f"GPT: d_model {c.d_model}, {c.n_layers} layers, {c.n_heads} heads, vocab {c.vocab_size}"]
        for name, shape, n in rows:
            lines.append(f"  {name:<{width}}  {shape:<28} {n:>12,}")
        trainable = self.num_parameters(trainable_only=True)
        lines.append(f"  {'total':<{width}}  {'':<28} {self.num_parameters():>12,}  ({trainable:,} trainable)")
        return "\n".join(lines)
