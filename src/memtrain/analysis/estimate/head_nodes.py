"""The op inventory after the last block: the final norm, the LM head and the loss (standard: the
full logits; memtrain's chunked loss: chunk x vocab at a time; Cut Cross-Entropy: no logits)."""

from __future__ import annotations

import math
from dataclasses import replace

from memtrain.analysis.estimate.basic_nodes import norm_stats
from memtrain.analysis.estimate.dims import Dims
from memtrain.analysis.estimate.embedding_nodes import TARGETS, layer_args
from memtrain.analysis.estimate.hf_nodes import hf_norm_node
from memtrain.analysis.estimate.simulator import Node
from memtrain.config.archs import Arch
from memtrain.config.run import ModelConfig, TechniqueConfig
from memtrain.techniques.facts import aligned_vocab, cce_forward_locks, cce_lock_table_shape, effective_loss_chunk

# --loss-on completion (memtrain.models.gpt.answer_targets): the targets made safe for the loss (an
# int64 copy) and the float32 weight the loss is multiplied by.
ANSWER_TARGETS = "answers.y"
# The 0-d float32 loss the loss kernel returns, and under --loss-on completion its product with
# the answer weight: the step's loss (training.step_loss_key).
LOSS = "loss"
WEIGHTED_LOSS = "loss.weighted"
ANSWER_WEIGHT = "answers.w"


def head_nodes(dm: Dims, m: ModelConfig, tech: TechniqueConfig, arch: Arch, trainable: bool,
               grads_exist: bool, n_blocks: int, answers_only: bool = False,
               ignores_targets: bool = False) -> list[Node]:
    """Final norm, LM head and loss (standard: full logits; chunked: fused, chunk x vocab).
    ``n_blocks``: the simulated blocks, the last of which makes the head's input.
    ``answers_only`` (--loss-on completion): the loss runs on :func:`answer_nodes`' targets and
    is multiplied by their weight. ``ignores_targets`` (DataConfig.ignores_targets: --loss-on
    completion's prompts, --packing pad's pads): some targets are -100, which Cut Cross-Entropy
    answers with an index of the valid ones kept to backward (--packing pad has no answer copy or
    weight: every row holds a target)."""
    nodes = _head_nodes(dm, m, tech, arch, trainable, n_blocks, answers_only or ignores_targets)
    return with_answer_targets(nodes, dm.n, tech.loss) if answers_only else nodes


def _head_nodes(dm: Dims, m: ModelConfig, tech: TechniqueConfig, arch: Arch, trainable: bool,
                n_blocks: int, ignores_targets: bool = False) -> list[Node]:
    """:func:`head_nodes` before the answers-only copy (``ignores_targets``: some targets are -100)."""
    N, d, V, a, r = dm.n, dm.d, dm.V, dm.a, dm.r
    x = f"blocks.{n_blocks}.in"
    layer = arch.norm == "layernorm"
    head = "lm_head.weight" if m.untie_embeddings else "wte.weight"
    pg = [("param:ln_f.weight", 0.0)] if trainable else []
    if trainable and layer and dm.bias:
        pg.append(("param:ln_f.bias", 0.0))
    stats = norm_stats(dm, layer, "ln_f")
    nodes = [Node("ln_f", out=[("hf", N * d * r), *stats], inputs=[x],
                   saves=[x, *(k for k, _ in stats)], grad_out=("hf",), grads=[(x, N * d * r)] + pg)]
    if dm.hf and not layer:
        nodes = [hf_norm_node(dm, "ln_f", x, "hf", trainable, offset=arch.norm_offset)]
    # The loss's ``targets.reshape(-1)`` (our GPT's forward and memtrain's transformers wrapper,
    # after the final norm): from there the meter counts the micro-batch's int64 labels, which
    # the step's list of batches holds through the optimizer step (TOKEN_KEYS, pinned).
    nodes.append(Node("targets", out=[(TARGETS, N * 8)]))
    if arch.positional == "learned":
        # The position ids are a local of the model's forward (our GPT's hidden_states,
        # GPT2Model.forward) until it returns, after ln_f, saved for backward or not (a frozen
        # table under LoRA saves nothing).
        nodes[0].inputs.append("pos_idx")
    if arch.gpt2_layers:
        # GPT2Model.forward's locals (the token and position embeddings, the causal mask) live
        # until it returns, after ln_f.
        nodes[0].inputs += ["tok", "posemb"] + list(layer_args(dm, arch, tech.attention))
    elif dm.hf:
        # The Llama-style model's locals live until it returns, after the norm: what it made for
        # every layer (hf_model_input_nodes) and ``inputs_embeds``, the first layer's input.
        nodes[0].inputs += list(layer_args(dm, arch, tech.attention)) + ["blocks.0.in"]
    if tech.loss == "chunked" and tech.loss_kernel == "cce":
        return nodes + _cce_nodes(dm, head, trainable, keeps_valids=ignores_targets)
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
        # Its first output is the 0-d float32 loss it returns (a step of one micro-batch keeps it),
        # here made where its float32 accumulator is (before the chunks: the two are never both
        # counted at a peak), and 1 / n_valid, a float32 0-d saved for backward.
        nodes.append(Node("loss", out=[(LOSS, 4), ("loss.grad_h", N * d * r), ("loss.grad_w", gw), ("loss.inv_n", 4)],
                           inputs=["hf"], saves=["loss.grad_h", "loss.grad_w", "loss.inv_n"], fwd_steps=tuple(steps),
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
    # nll_loss returns the 0-d loss and its 0-d float32 total_weight, which it saves for its
    # backward with the targets (the loader's labels, pinned, which an offloader copies).
    nodes.append(Node("loss", out=[(LOSS, 4), ("loss.total_weight", 4)], inputs=["logp", "logits", "hf"],
                       saves=["logp", TARGETS, "loss.total_weight"], tag="logits", grads=[("logp", N * V * 4)]))
    return nodes


def _cce_nodes(dm: Dims, head: str, trainable: bool, keeps_valids: bool = False) -> list[Node]:
    """``--loss-kernel cce``: Cut Cross-Entropy as memtrain calls it (memtrain.techniques.loss's
    ``cce_lm_loss`` and ``_CutCrossEntropyBuffers``, which lists what the library allocates).
    The hidden states and the head are cast to the compute dtype where they are not in it, and
    both casts are kept for backward with one float32 log-sum-exp per token; no logits are ever
    stored. Backward makes both gradients in the compute dtype (zero-filled, with int32 lock
    tables), which the casts' backward turns into the float32 ones. A frozen head (LoRA) gets no
    gradient but is still cast and kept. ``keeps_valids`` (``--loss-on completion``'s prompt
    targets or ``--packing pad``'s pads are ignored): the library keeps its int32 index of the valid targets with its saved
    tensors until backward, sized (as the log-sum-exp) for every target: an upper bound. It saves
    the targets as well (``ctx.save_for_backward(e, c, bias, lse, params.targets, ...)``, cce.py):
    the loader's labels, pinned anyway, which an offloader copies to the host."""
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
    index: tuple[tuple[str, str, float], ...] = (
        ("alloc", "mask", N), ("alloc", "index", N * 8), ("free", "mask", 0.0), ("alloc", "index32", N * 4),
        ("free", "index", 0.0))
    kept: list[str] = []
    if keeps_valids:
        # The int32 copy is the valid targets' index, saved with the log-sum-exp.
        nodes.append(Node("cce.valids", out=[("cce.valids", N * 4)], tag="logits",
                          fwd_steps=(index[0], index[1], index[2], ("outputs", "", 0.0), index[4])))
        index, kept = (), ["cce.valids"]
    else:
        index += (("free", "index32", 0.0),)
    steps = index + (("outputs", "", 0.0), ("alloc", "locks", cce_forward_locks(N) * 4), ("alloc", "neg_dot", N * 4))
    lock_tables = sum(math.prod(cce_lock_table_shape(rows, d)) * 4 for rows in (N, V))
    # The caller's hidden states ("hf") stay alive through the call, cast or not.
    nodes.append(Node("loss", out=[("cce.lse", N * 4), (LOSS, 4)], inputs=sorted({"hf", xin}) + w_saved + kept,
                      saves=[xin] + w_saved + ["cce.lse", TARGETS] + kept, fwd_steps=steps, tag="logits", grad_out=("loss",),
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
        steps += [("alloc", "g", c * V * 4)] + _eager_row_stats(c)
    else:
        steps += [("alloc", "logits", c * V * a), ("alloc", "logits32", c * V * 4), ("free", "logits", 0.0)]
        steps += _eager_row_stats(c) + [("alloc", "g", c * V * a), ("free", "logits32", 0.0)]
    steps += [("alloc", "gh", c * d * a), ("free", "gh", 0.0)]
    if grad_w and a != 4:
        steps += [("alloc", "gw", V * d * a), ("free", "gw", 0.0)]
    # _chunk_step's locals lse, per_token and valid go as it returns, after the matmuls.
    return steps + [("free", "g", 0.0), ("free", "lse", 0.0), ("free", "per_token", 0.0), ("free", "valid", 0.0)]


def _eager_row_stats(c: int) -> list[tuple[str, str, float]]:
    """The eager chunk's per-row tensors on its ``c`` float32 logits, in the order
    memtrain.techniques.loss._chunk_stats and _chunk_step make them: the log-sum-exp (float32),
    the valid mask (a bool per row), the safe targets (int64, after a 0-d int64 zero), the target
    logit and ``lse - target_logit`` (float32), the per-token loss (float32, after a 0-d float32
    zero) and its 0-d sum; then, building the gradient in place, a second mask, its int64 safe
    targets and the float32 ``-valid``. ``lse``, ``per_token`` and the second mask are
    _chunk_step's locals, alive until it returns (after the low-precision cast and the matmuls):
    left out, a bf16-pure Gemma's forward peak was 432 B (c = 48) under the trace."""
    return [("alloc", "lse", c * 4), ("alloc", "valid0", c), ("alloc", "zero_i64", 8), ("alloc", "safe0", c * 8),
            ("free", "zero_i64", 0.0), ("alloc", "target_logit", c * 4), ("alloc", "diff", c * 4),
            ("alloc", "zero_f32", 4), ("alloc", "per_token", c * 4), ("free", "zero_f32", 0.0),
            ("free", "diff", 0.0), ("free", "valid0", 0.0), ("free", "safe0", 0.0), ("free", "target_logit", 0.0),
            ("alloc", "sum", 4), ("free", "sum", 0.0),
            ("alloc", "valid", c), ("alloc", "zero_i64", 8), ("alloc", "safe", c * 8), ("free", "zero_i64", 0.0),
            ("alloc", "valid_f32", c * 4), ("alloc", "neg", c * 4), ("free", "valid_f32", 0.0),
            ("free", "safe", 0.0), ("free", "neg", 0.0)]


def answer_nodes(n: int) -> list[Node]:
    """``answer_targets(targets.reshape(-1))`` of our GPT's and the transformers wrapper's forward
    (``--loss-on completion``), tensor by tensor over ``n`` targets: ``(targets != -100).any()``
    (a bool per target, then one byte, ``has``), ``arange(n) == 0`` (int64, then a bool per
    target, ``first``), ``has | ~first`` (two bool tensors, one freed), ``zeros_like`` (int64) and
    the ``where`` they feed, whose int64 output is the loss's targets; ``has.to(float32)`` is the
    weight (4 bytes)."""
    steps: tuple[tuple[str, str, float], ...] = (
        ("alloc", "ne", n), ("alloc", "has", 1), ("free", "ne", 0.0),
        ("alloc", "arange", n * 8), ("alloc", "first", n), ("free", "arange", 0.0),
        ("alloc", "not_first", n), ("alloc", "cond", n), ("free", "not_first", 0.0),
        ("alloc", "zeros", n * 8), ("outputs", "", 0.0), ("free", "cond", 0.0), ("free", "zeros", 0.0))
    return [Node("answer_targets", out=[(ANSWER_TARGETS, n * 8)], inputs=[TARGETS], fwd_steps=steps),
            Node("answer_weight", out=[(ANSWER_WEIGHT, 4)])]


def with_answer_targets(nodes: list[Node], n: int, loss: str) -> list[Node]:
    """``nodes`` (the head, every token a target) as ``--loss-on completion`` runs it: the
    :func:`answer_nodes` after the targets, the loss kernel reading their targets (the standard
    and naive losses' nll_loss and Cut Cross-Entropy save them for their backward, wherever the
    kernel saves the labels; memtrain's chunked loss saves none, and the forward's local holds
    them until it returns), then ``loss * weight``, which saves
    the weight and is the step's loss (the backward's first node: it hands the kernel's output
    its gradient, 4 bytes as the step's own 1/N product was, and lets the weight go)."""
    at = next(i for i, node in enumerate(nodes) if node.name == "targets") + 1
    kernel = nodes[-1]
    saves_targets = TARGETS in kernel.saves
    kernel = replace(kernel, name="loss.kernel", inputs=kernel.inputs + [ANSWER_TARGETS],
                     saves=[k for k in kernel.saves if k != TARGETS] + ([ANSWER_TARGETS] if saves_targets else []))
    out_key = kernel.out_keys()[0]
    weighted = Node("loss", out=[(WEIGHTED_LOSS, 4)], inputs=[out_key, ANSWER_WEIGHT, ANSWER_TARGETS],
                    saves=[ANSWER_WEIGHT], grads=[(out_key, 0.0)], tag=kernel.tag)
    return nodes[:at] + answer_nodes(n) + nodes[at:-1] + [kernel, weighted]
