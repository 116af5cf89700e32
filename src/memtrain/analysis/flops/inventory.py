"""The FLOPs and bytes of one training step of memtrain's GPT, by arithmetic (no torch).

:func:`memtrain.analysis.flops.count.count_step` runs the step under FakeTensorMode and sums what
every dispatched aten op computes and moves. The GPT's step dispatches the same ops for every
shape, so this module writes that list down: each op the eager step runs, with the shapes and
dtypes it runs on, the class the recorder gives it, the FLOPs the counter (matmuls) or the
element-wise table (:data:`~memtrain.analysis.flops.classes.ELEMENTWISE_FLOPS`) assigns it and
the bytes :func:`~memtrain.analysis.flops.recorder.op_bytes` would sum. The result is the
counted table itself, not an approximation of it: ``tests/test_flop_inventory.py`` holds the two
equal, class by class and phase by phase, on a grid of odd sizes and technique combinations.

What it covers (:func:`not_covered` names the rest, which ``memtrain flops`` counts): our GPT,
every precision, ``--attention math`` and ``sdpa`` (without dropout), checkpointing none, full,
every:K and sqrt, the standard, naive and chunked losses, dropout on or off, biases, tied or untied
embeddings, a padded vocabulary, gradient accumulation, clipping and every optimizer. Not
covered, because their op lists depend on kernels chosen at run time, on another library's
internals or on layout accidents: LoRA (peft's adapter modules), ``--window`` (banded or dense masked kernels by size),
the CUDA-only attention kernels (counted with SDPA on CPU, with a note), selective and
selective-matmul checkpointing (torch's early-stopping recompute), SDPA with dropout (torch's
decomposed math path), shapes with a size-1 head count, head width or sequence (layout copies turn
into views), a vocabulary equal to another dimension (the recorder's logits test) and
transformers models.

The op lists mirror torch 2.13's CPU decompositions (FakeTensorMode on CPU): a torch whose
autograd formulas change would change the counted table and the grid test would say so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from memtrain.analysis.estimate.params import param_count
from memtrain.analysis.flops.classes import ClassCount, StepCount, classify, split_attention
from memtrain.analysis.flops.rules import assemble_step, table_rule_params
from memtrain.config.run import RunConfig
from memtrain.techniques.facts import checkpoint_policy, effective_loss_chunk, precision_facts

__all__ = ["inventory_step", "not_covered"]

F32 = 4  # bytes of float32: softmax, log-softmax and the loss run in it whatever the precision
I64 = 8  # bytes of int64: token ids, positions
BOOL = 1  # bytes of a bool (masks, dropout masks)


def not_covered(cfg: RunConfig) -> Optional[str]:
    """Why :func:`inventory_step` cannot describe ``cfg`` (None: it describes it exactly)."""
    t = cfg.technique
    if cfg.model.model is not None and _is_transformers(cfg):
        return f"--model {cfg.model.model} is a transformers model"
    if t.lora_rank:
        return "--lora-rank (peft's adapter modules)"
    if t.window is not None:
        return "--window (banded or dense masked attention, chosen by size)"
    if precision_facts(t.precision).fp8:
        return "--precision fp8 (torchao's Float8Linear casts each matmul's operands)"
    if t.attention not in ("math", "sdpa"):
        return f"--attention {t.attention} (a CUDA kernel, counted with SDPA on CPU)"
    if t.attention == "sdpa" and cfg.model.dropout > 0.0:
        return "--attention sdpa with dropout (SDPA's math path, decomposed by torch)"
    if 1 in (cfg.model.n_heads, cfg.model.head_dim, cfg.train.seq_len):
        # a size-1 dimension makes some of the math backend's layout copies views
        return "one attention head, a head of width 1 or a one-token sequence (layout copies become views)"
    if checkpoint_policy(t.checkpointing).kind in ("selective", "selective-matmul"):
        return f"--checkpointing {t.checkpointing} (torch's selective recompute)"
    m, tr = cfg.model, cfg.train
    tokens = tr.batch_size * tr.seq_len
    # The recorder tells an op outside the blocks that handles logits by a last dimension equal
    # to the (padded) vocabulary; a tensor of another kind with that last dimension would be
    # classed "loss" too, by an attribution this list does not follow.
    chunk = effective_loss_chunk(t.loss_chunk, tr.device, m.vocab_size)
    if m.padded_vocab_size in (m.d_model, tokens, tr.seq_len, chunk, tokens % chunk, 1):
        return "a vocabulary as large as another dimension of the step"
    return None


def _is_transformers(cfg: RunConfig) -> bool:
    # models.spec answers by name alone (no file is read, no torch): a GPT preset is ours
    from memtrain.models.spec import is_gpt_preset  # models.spec sits below analysis, read on demand

    return not is_gpt_preset(cfg.model.model or "")


def inventory_step(cfg: RunConfig) -> StepCount:
    """:func:`~memtrain.analysis.flops.count.count_step`'s answer for ``cfg``, by arithmetic.

    Raises ValueError when :func:`not_covered` names a reason: the caller counts instead.
    """
    why = not_covered(cfg)
    if why is not None:
        raise ValueError(f"the FLOP inventory does not cover {why}")
    step = _Step.of(cfg)
    step.forward_and_backward()
    table = step.tape.table
    for classes in table.values():
        split_attention(classes)
    n_params, trainable = param_count(cfg.model)
    counted = sum(c.counted for classes in table.values() for c in classes.values())
    return assemble_step(cfg, table, counted, n_params, trainable, [], table_rule_params(cfg.model))


@dataclass
class _Tape:
    """Per phase and class: counted FLOPs, element-wise FLOPs and bytes, as the recorder sums them."""

    phase: str = "forward"
    table: dict[str, dict[str, ClassCount]] = field(default_factory=dict)

    times: int = 1  # how many times the ops being written run (equal chunks of the loss)

    def op(self, cls: str, *, counted: float = 0, elementwise: float = 0, nbytes: float = 0) -> None:
        c = self.table.setdefault(self.phase, {}).setdefault(cls, ClassCount())
        c.counted += self.times * counted
        c.elementwise += self.times * elementwise
        c.bytes += self.times * nbytes
        c.ops += self.times


class _Shape:
    """A tensor's shape, for :func:`classify` (which reads ``dim()`` and ``shape``)."""

    def __init__(self, *shape: int) -> None:
        self.shape = shape

    def dim(self) -> int:
        return len(self.shape)


@dataclass
class _Step:
    """One micro-batch of the GPT: its sizes, dtypes (bytes per element) and techniques."""

    tape: _Tape
    B: int  # micro-batch
    T: int  # sequence length
    d: int  # d_model
    h: int  # heads
    f: int  # d_ff
    L: int  # blocks
    V: int  # vocab_size: rows of the LM head the loss sees
    Vp: int  # padded vocab: rows of the embedding table (the recorder's ``vocab``)
    P: int  # max_seq_len: rows of the position table
    w: int  # weights (and their gradients)
    c: int  # what matmuls compute in (the autocast dtype, else the weights')
    autocast: bool
    bias: bool
    tied: bool
    dropout: bool
    attention: str
    loss: str
    chunk: int
    checkpointed: tuple[bool, ...]

    @classmethod
    def of(cls, cfg: RunConfig) -> "_Step":
        m, t, tr = cfg.model, cfg.technique, cfg.train
        facts = precision_facts(t.precision)
        policy = checkpoint_policy(t.checkpointing)
        return cls(
            tape=_Tape(), B=tr.batch_size, T=tr.seq_len, d=m.d_model, h=m.n_heads, f=m.d_ff, L=m.n_layers,
            V=m.vocab_size, Vp=m.padded_vocab_size, P=m.max_seq_len, w=facts.param_bytes, c=facts.compute_bytes,
            autocast=facts.autocast, bias=m.bias, tied=not m.untie_embeddings, dropout=m.dropout > 0.0,
            attention=t.attention, loss=t.loss, chunk=effective_loss_chunk(t.loss_chunk, tr.device, m.vocab_size),
            checkpointed=tuple(policy.whole_block(i, m.n_layers) for i in range(m.n_layers)),
        )

    # ------------------------------------------------------------------ sizes
    @property
    def N(self) -> int:  # tokens of the micro-batch
        return self.B * self.T

    @property
    def hd(self) -> int:
        return self.d // self.h

    @property
    def r(self) -> int:
        """The residual stream's dtype: the embeddings' (the weights'), kept by the adds."""
        return self.w

    # ------------------------------------------------------------------ the step
    def forward_and_backward(self) -> None:
        tp = self.tape
        tp.phase = "forward"
        self.embed_forward()
        for _ in range(self.L):
            self.block_forward()
        self.layernorm_forward("layernorm")
        self.loss_forward()
        tp.phase = "backward"
        self.loss_backward()
        self.layernorm_backward()
        for i in reversed(range(self.L)):
            if self.checkpointed[i]:
                self.block_recompute()
            self.block_backward()
        self.embed_backward()

    # ------------------------------------------------------------------ embeddings
    def embed_forward(self) -> None:
        N, T, d, w = self.N, self.T, self.d, self.w
        op = self.tape.op
        op("other", nbytes=I64 * T)  # positions: arange
        op("embedding", nbytes=I64 * N + 2 * N * d * w)  # a gather: the indices and the rows read
        op("embedding", nbytes=I64 * T + 2 * T * d * w)
        op("other", elementwise=N * d, nbytes=(2 * N + T) * d * w)  # token + position
        self.dropout_forward(N * d, w)

    def embed_backward(self) -> None:
        N, T, d, w = self.N, self.T, self.d, self.w
        op = self.tape.op
        self.dropout_backward(N * d, w)
        op("other", elementwise=N * d, nbytes=(N + T) * d * w)  # the position gradient summed over the batch
        op("embedding", elementwise=T * d, nbytes=T * d * w + I64 * T + self.P * d * w)
        op("embedding", elementwise=N * d, nbytes=N * d * w + I64 * N + self.Vp * d * w)
        if self.tied:  # the head's and the lookup's gradients of the one (V x d) matrix
            op("embedding", elementwise=self.Vp * d, nbytes=3 * self.Vp * d * w)

    # ------------------------------------------------------------------ element-wise pieces
    def dropout_forward(self, n: int, size: int) -> None:
        if self.dropout:  # one fused native_dropout: output and mask in one pass
            self.tape.op("dropout", elementwise=2 * n, nbytes=2 * n * size + n * BOOL)

    def dropout_backward(self, n: int, size: int) -> None:
        if self.dropout:
            self.tape.op("dropout", elementwise=2 * n, nbytes=2 * n * size + n * BOOL)

    def cast(self, cls: str, n: int, src: int, dst: int) -> None:
        """A dtype conversion (``_to_copy``); none when the dtypes agree."""
        if src != dst:
            self.tape.op(cls, nbytes=n * (src + dst))

    def layernorm_forward(self, cls: str) -> None:
        N, d, r, w = self.N, self.d, self.r, self.w
        params = (2 if self.bias else 1) * d * w
        self.tape.op(cls, elementwise=7 * N * d, nbytes=2 * N * d * r + params + 2 * N * self.stat)

    def layernorm_backward(self) -> None:
        N, d, r, w = self.N, self.d, self.r, self.w
        params = (2 if self.bias else 1) * d * w
        # reads grad, input, mean, rstd and the weights; writes the input's and the weights' grads
        self.tape.op("layernorm", elementwise=12 * N * d, nbytes=3 * N * d * r + 2 * N * self.stat + 2 * params)

    @property
    def stat(self) -> int:
        """LayerNorm's saved mean and rstd: float32 for a float32 input, else the input's dtype."""
        return self.r

    # ------------------------------------------------------------------ Linear layers
    def linear_forward(self, cls: str, n_in: int, n_out: int, x: int, matmul: bool = True) -> None:
        """``nn.Linear`` on (N, n_in) in dtype ``x``: autocast casts the weight, the bias and a
        float32 input; then one addmm (mm without bias), unless ``matmul`` is False (a recompute
        that stops when the addmm's inputs are saved, before it runs)."""
        N, c, w = self.N, self.c, self.w
        op = self.tape.op
        if self.autocast:
            if self.bias:
                self.cast(cls, n_out, w, c)
            self.cast(cls, n_in * n_out, w, c)
            self.cast(cls, N * n_in, x, c)
        bias = n_out if self.bias else 0
        if matmul:
            op(cls, counted=2 * N * n_in * n_out, nbytes=(bias + N * n_in + n_in * n_out + N * n_out) * c)

    def linear_backward(self, cls: str, n_in: int, n_out: int, x: int) -> None:
        """The input's and the weight's gradients (two mm), the bias's (a sum over tokens), and
        autocast's casts undone."""
        N, c, w = self.N, self.c, self.w
        op = self.tape.op
        mm = (N * n_out + n_out * n_in + N * n_in) * c
        op(cls, counted=2 * N * n_in * n_out, nbytes=mm)
        op(cls, counted=2 * N * n_in * n_out, nbytes=mm)
        if self.bias:
            op(cls, elementwise=N * n_out, nbytes=(N * n_out + n_out) * c)
        if self.autocast:
            self.cast(cls, N * n_in, c, x)
            self.cast(cls, n_in * n_out, c, w)
            if self.bias:
                self.cast(cls, n_out, c, w)

    # ------------------------------------------------------------------ a block
    def block_forward(self) -> None:
        N, d, c, r = self.N, self.d, self.c, self.r
        self.attention_half()
        self.tape.op("other", elementwise=N * d, nbytes=N * d * (2 * r + c))  # residual add
        self.mlp_half()
        self.linear_forward("mlp_fc_out", self.f, d, c)
        self.dropout_forward(N * d, c)
        self.tape.op("other", elementwise=N * d, nbytes=N * d * (2 * r + c))

    def attention_half(self) -> None:
        """LayerNorm, qkv, attention, the output projection and its dropout (no residual add)."""
        d, c, r = self.d, self.c, self.r
        self.layernorm_forward("layernorm")
        self.linear_forward("qkv", d, 3 * d, r)
        self.attention_forward()
        self.linear_forward("attn_proj", d, d, c)
        self.dropout_forward(self.N * d, c)

    def mlp_half(self) -> None:
        """LayerNorm, fc and GELU: the MLP up to its output projection."""
        N, f = self.N, self.f
        self.layernorm_forward("layernorm")
        self.linear_forward("mlp_fc", self.d, f, self.r)
        self.tape.op("gelu", elementwise=9 * N * f, nbytes=2 * N * f * self.c)

    def block_recompute(self) -> None:
        """A checkpointed block's forward again, in the backward pass (non-reentrant checkpoint).

        The block's own forward runs without its module hooks (checkpoint calls the function,
        not the module), so its residual adds run in no module: the recorder counts the first
        as backward work of the module the backward is in when the recompute starts (the MLP's
        dropout, or fc_out when dropout is off). The recompute stops once the last tensor the
        backward needs is saved: after the MLP's dropout mask, or, without dropout, when fc_out
        saves its inputs (before its matmul runs); the second add never reruns."""
        N, d, c, r = self.N, self.d, self.c, self.r
        tp = self.tape
        tp.phase = "recompute"
        self.attention_half()
        tp.phase = "backward"
        tp.op("other" if self.dropout else "mlp_fc_out", elementwise=N * d, nbytes=N * d * (2 * r + c))
        tp.phase = "recompute"
        self.mlp_half()
        self.linear_forward("mlp_fc_out", self.f, d, c, matmul=self.dropout)
        self.dropout_forward(N * d, c)
        tp.phase = "backward"

    def block_backward(self) -> None:
        N, d, f, c, r = self.N, self.d, self.f, self.c, self.r
        op = self.tape.op
        self.cast("other", N * d, r, c)  # the residual add's gradient for its low-precision operand
        self.dropout_backward(N * d, c)
        self.linear_backward("mlp_fc_out", f, d, c)
        op("gelu", elementwise=17 * N * f, nbytes=3 * N * f * c)
        self.linear_backward("mlp_fc", d, f, r)
        self.layernorm_backward()
        op("other", elementwise=N * d, nbytes=3 * N * d * r)  # the two paths' gradients meet
        self.cast("other", N * d, r, c)
        self.dropout_backward(N * d, c)
        self.linear_backward("attn_proj", d, d, c)
        self.attention_backward()
        self.linear_backward("qkv", d, 3 * d, r)
        self.layernorm_backward()
        op("other", elementwise=N * d, nbytes=3 * N * d * r)

    # ------------------------------------------------------------------ attention
    def attention_forward(self) -> None:
        if self.attention == "math":
            self.math_attention_forward()
        else:
            self.sdpa_forward()

    def attention_backward(self) -> None:
        if self.attention == "math":
            self.math_attention_backward()
        else:
            self.sdpa_backward()

    def math_attention_forward(self) -> None:
        B, T, h, hd, c = self.B, self.T, self.h, self.hd, self.c
        op = self.tape.op
        qkv, s = B * h * T * hd, B * h * T * T  # one of q, k, v; the scores
        folds = B == 1  # (B, h) folds into bmm's batch as a view: no copies of q, k^T, v
        if not folds:
            op("other", nbytes=2 * qkv * c)  # q and k^T made contiguous for bmm
            op("other", nbytes=2 * qkv * c)
        op("attn_core", counted=2 * s * hd, nbytes=(2 * qkv + s) * c)  # q k^T
        op("other", elementwise=s, nbytes=2 * s * c)  # * 1/sqrt(hd)
        self.causal_mask()
        op("other", nbytes=2 * s * c + T * T * BOOL)  # masked_fill
        self.cast("other", s, c, F32)
        op("softmax", elementwise=5 * s, nbytes=2 * s * F32)
        self.cast("other", s, F32, c)
        self.dropout_forward(s, c)
        if not folds:
            op("other", nbytes=2 * qkv * c)  # v made contiguous
        op("attn_core", counted=2 * s * hd, nbytes=(2 * qkv + s) * c)  # probs @ v
        op("other", nbytes=2 * qkv * c)  # heads back to (B, T, d)

    def causal_mask(self) -> None:
        T = self.T
        op = self.tape.op
        op("other", nbytes=I64 * T)  # arange i
        op("other", nbytes=I64 * T)  # arange j
        op("other", elementwise=T * T, nbytes=2 * I64 * T + T * T * BOOL)  # j <= i
        op("other", elementwise=T * T, nbytes=2 * T * T * BOOL)  # ~mask

    def math_attention_backward(self) -> None:
        B, T, h, hd, c, d, N = self.B, self.T, self.h, self.hd, self.c, self.d, self.N
        op = self.tape.op
        qkv, s = B * h * T * hd, B * h * T * T
        bmm = (2 * qkv + s) * c
        if B > 1:
            op("other", nbytes=2 * qkv * c)  # the output's gradient back to (B, h, T, hd)
        op("attn_core", counted=2 * s * hd, nbytes=bmm)
        op("attn_core", counted=2 * s * hd, nbytes=bmm)
        self.dropout_backward(s, c)
        self.cast("other", s, c, F32)
        op("softmax", elementwise=4 * s, nbytes=3 * s * F32)
        self.cast("other", s, F32, c)
        op("other", nbytes=2 * s * c + T * T * BOOL)  # masked_fill
        op("other", elementwise=s, nbytes=2 * s * c)  # the scale
        op("attn_core", counted=2 * s * hd, nbytes=bmm)
        op("attn_core", counted=2 * s * hd, nbytes=bmm)
        op("other", nbytes=2 * qkv * c)
        op("other", nbytes=2 * qkv * c)
        op("other", nbytes=2 * 3 * N * d * c)  # q, k, v gradients concatenated (split's backward)

    def sdpa_forward(self) -> None:
        """SDPA without dropout on CPU: the flash kernel, reading q, k, v (strided views, no
        copies) and writing the output (already laid out as (B, T, d)) and its float32
        log-sum-exp. The counter counts the full (T x T) score matrix, causal half included."""
        B, T, h, hd, c = self.B, self.T, self.h, self.hd, self.c
        qkv = B * h * T * hd
        self.tape.op("attn_fused", counted=4 * B * h * T * T * hd, nbytes=4 * qkv * c + B * h * T * F32)

    def sdpa_backward(self) -> None:
        """The flash kernel's backward: reads the output's gradient, q, k, v, the output and the
        log-sum-exp; writes the three gradients (five (T x T) matmuls' worth of FLOPs)."""
        B, T, h, hd, c, d, N = self.B, self.T, self.h, self.hd, self.c, self.d, self.N
        qkv = B * h * T * hd
        self.tape.op("attn_fused", counted=10 * B * h * T * T * hd, nbytes=8 * qkv * c + B * h * T * F32)
        self.tape.op("other", nbytes=2 * 3 * N * d * c)  # q, k, v gradients concatenated (split's backward)

    # ------------------------------------------------------------------ LM head and loss
    def top(self, op_name: str, *shapes: tuple[int, ...]) -> str:
        """The class of an op the loss seam runs outside every module (the recorder's rule)."""
        return classify("GPT", op_name, [_Shape(*s) for s in shapes], self.Vp)

    def loss_forward(self) -> None:
        if self.loss == "chunked":
            self.chunked_loss_forward()
            return
        N, d, V, c, r, w = self.N, self.d, self.V, self.c, self.r, self.w
        op = self.tape.op
        if self.autocast:
            self.cast(self.top("_to_copy", (V, d)), V * d, w, c)
            self.cast(self.top("_to_copy", (N, d)), N * d, r, c)
        op("lm_head", counted=2 * N * d * V, nbytes=(N * d + d * V + N * V) * c)
        self.cast(self.top("_to_copy", (N, V)), N * V, c, F32)  # logits.float()
        op("loss", elementwise=5 * N * V, nbytes=2 * N * V * F32)
        op("loss", nbytes=I64 * N + N * F32 + 2 * F32)  # NLL: targets, one value per row, loss and weight

    def loss_backward(self) -> None:
        if self.loss == "chunked":
            self.chunked_loss_backward()
            return
        N, d, V, c, r, w = self.N, self.d, self.V, self.c, self.r, self.w
        op = self.tape.op
        op("other", nbytes=2 * F32)  # ones_like(loss)
        op("loss", nbytes=I64 * N + F32 + N * V * F32)
        op("loss", elementwise=4 * N * V, nbytes=3 * N * V * F32)
        self.cast(self.top("_to_copy", (N, V)), N * V, F32, c)
        mm = (N * V + N * d + V * d) * c
        op("lm_head", counted=2 * N * d * V, nbytes=mm)
        op("lm_head", counted=2 * N * d * V, nbytes=mm)
        if self.autocast:
            self.cast(self.top("_to_copy", (N, d)), N * d, c, r)
            self.cast(self.top("_to_copy", (V, d)), V * d, c, w)
        self.unpad_head_backward()

    def unpad_head_backward(self) -> None:
        V, d = self.V, self.d
        if self.Vp != V:  # the head is the real rows of the padded table: its gradient is padded back
            self.tape.op(self.top("slice_backward", (V, d)), nbytes=(V + self.Vp) * d * self.w)

    # ------------------------------------------------------------------ the chunked loss
    def chunked_loss_forward(self) -> None:
        """memtrain.techniques.loss's chunked loss: the gradients are computed in the forward,
        ``loss_chunk`` rows of logits at a time (equal chunks, then the remainder)."""
        N, d, V, c, r, w = self.N, self.d, self.V, self.c, self.r, self.w
        op, top = self.tape.op, self.top
        self.cast(top("_to_copy", (N, d)), N * d, r, c)  # explicit casts, autocast off
        self.cast(top("_to_copy", (V, d)), V * d, w, c)
        op(top("ne", (N,)), elementwise=N, nbytes=I64 * N + N * BOOL)  # 1 / n_valid
        op(top("sum", (N,)), elementwise=N, nbytes=N * BOOL + I64)
        op("other", nbytes=I64 + F32)
        op("other", elementwise=1, nbytes=2 * F32)  # reciprocal
        op("other", elementwise=1, nbytes=2 * F32)
        op("other", nbytes=F32)  # loss_sum = zeros(())
        op("other", nbytes=V * d * F32)  # grad_w = zeros((V, d)), float32
        full, rest = divmod(N, self.chunk)
        for n, times in ((self.chunk, full), (rest, 1)):
            if n and times:
                self.tape.times = times
                self.chunk_forward(n)
        self.tape.times = 1
        op("other", elementwise=1, nbytes=3 * F32)  # loss_sum * inv_n

    def chunk_forward(self, n: int) -> None:
        d, V, c, r = self.d, self.V, self.c, self.r
        op, top = self.tape.op, self.top
        op("lm_head", counted=2 * n * d * V, nbytes=(n * d + d * V + n * V) * c)
        self.cast(top("_to_copy", (n, V)), n * V, c, F32)
        op(top("logsumexp", (n, V)), elementwise=n * V, nbytes=n * V * F32 + n * F32)
        self.valid_targets(n)
        op(top("gather", (n, V), (n, 1)), nbytes=n * V * F32 + n * I64 + n * F32)
        op(top("sub", (n,), (n,)), elementwise=n, nbytes=3 * n * F32)
        op("other", nbytes=F32)  # scalar 0.0
        op(top("where", (n,), (n,)), nbytes=n * BOOL + n * F32 + F32 + n * F32)
        op(top("sum", (n,)), elementwise=n, nbytes=n * F32 + F32)
        op("other", elementwise=1, nbytes=3 * F32)  # loss_sum += (in place)
        op(top("sub_", (n, V), (n, 1)), elementwise=n * V, nbytes=2 * n * V * F32 + n * F32)
        op(top("exp_", (n, V)), elementwise=n * V, nbytes=2 * n * V * F32)
        self.valid_targets(n)
        op(top("_to_copy", (n, 1)), nbytes=n * (BOOL + F32))
        op(top("neg", (n, 1)), elementwise=n, nbytes=2 * n * F32)
        op(top("scatter_add_", (n, V), (n, 1), (n, 1)), nbytes=2 * n * V * F32 + n * I64 + n * F32)
        op(top("mul_", (n, V), (n, 1)), elementwise=n * V, nbytes=2 * n * V * F32 + n * BOOL)
        self.cast(top("_to_copy", (n, V)), n * V, F32, c)
        op("lm_head", counted=2 * n * V * d, nbytes=(n * V + V * d + n * d) * c)  # grad_h rows
        op(top("copy_", (n, d), (n, d)), nbytes=n * d * (r + c))
        if c == F32:  # grad_w.addmm_(g.t(), h)
            op("lm_head", counted=2 * V * n * d, nbytes=2 * V * d * F32 + (V * n + n * d) * F32)
        else:  # grad_w += g.t() @ h
            op("lm_head", counted=2 * V * n * d, nbytes=(V * n + n * d + V * d) * c)
            op(top("add_", (V, d), (V, d)), elementwise=V * d, nbytes=2 * V * d * F32 + V * d * c)

    def valid_targets(self, n: int) -> None:
        """``torch.where(targets != -100, targets, 0)`` on ``n`` targets."""
        op, top = self.tape.op, self.top
        op(top("ne", (n,)), elementwise=n, nbytes=I64 * n + n * BOOL)
        op("other", nbytes=I64)  # scalar 0
        op(top("where", (n,), (n,)), nbytes=n * BOOL + 2 * n * I64 + I64)

    def chunked_loss_backward(self) -> None:
        N, d, V, r, w = self.N, self.d, self.V, self.r, self.w
        op, top = self.tape.op, self.top
        op("other", nbytes=2 * F32)  # ones_like(loss)
        op("other", elementwise=1, nbytes=3 * F32)  # grad_out * inv_n
        op(top("mul_", (N, d)), elementwise=N * d, nbytes=2 * N * d * r + F32)
        op(top("mul_", (V, d)), elementwise=V * d, nbytes=2 * V * d * F32 + F32)
        self.cast(top("_to_copy", (V, d)), V * d, F32, w)  # to the weight's dtype
        self.unpad_head_backward()
