"""The op inventory before the first block: the embedding lookup (with learned positions, Gemma's
scale and dropout), the step's token ids as the memory meter counts them, and what a transformers
model makes once and hands every layer (its masks, rope's tables)."""

from __future__ import annotations

from memtrain.analysis.estimate.basic_nodes import dropout
from memtrain.analysis.estimate.dims import Dims
from memtrain.analysis.estimate.hf_nodes import CAUSAL_MASK, hf_model_input_nodes, hf_model_inputs
from memtrain.analysis.estimate.simulator import Node
from memtrain.config.archs import Arch

# The step's int64 token ids as the memory meter sees them (docs/estimation.md, "Token ids"):
# made by the data loader outside the meter, each is counted from the first op that shows it
# (a view: GPT-2's input_ids.view, the loss's targets.reshape) until the step's list of
# micro-batches goes, after the optimizer step. Pinned keys: never freed within the step.
INPUT_IDS = "input_ids"
TARGETS = "targets"
TOKEN_KEYS = (INPUT_IDS, TARGETS)


def token_id_bytes(dm: Dims, arch: Arch) -> float:
    """Bytes of one micro-batch's token ids the meter counts: the labels (b x s x 8), and the
    inputs too where the model views them (GPT-2's ``input_ids.view``)."""
    return dm.n * 8 * (2 if arch.gpt2_layers else 1)


def embedding_nodes(dm: Dims, arch: Arch, trainable: bool, attention: str) -> list[Node]:
    """Token lookup (+ learned positions) and embedding dropout. Lookups are not autocast: the
    output has the table's dtype. (GPT-2's eager attention: the float causal mask
    GPT2Model.forward builds, in the embeddings' dtype, for every layer.)"""
    N, d, s, pe = dm.n, dm.d, dm.s, dm.p
    nodes = [Node("wte", out=[("tok", N * d * pe)], grads=[("param:wte.weight", 0.0)] if trainable else [])]
    if trainable:
        # The lookup saves its int64 indices for the weight's gradient: the loader's token ids,
        # counted from GPT-2's view of them (INPUT_IDS, below), never by the meter elsewhere; an
        # activation offloader moves them either way (left out, 8 bytes a token each way were
        # missing from the bytes moved).
        if arch.gpt2_layers:
            nodes[0].inputs, nodes[0].saves = [INPUT_IDS], [INPUT_IDS]
        else:
            nodes[0].external = ((INPUT_IDS, N * 8),)
    if arch.gpt2_layers:
        # GPT2Model.forward's ``input_ids.view(-1, s)``: the meter counts the step's token ids
        # (made by the data loader, outside it) from this first op that shows them, until the
        # step's batches go after the optimizer step (TOKEN_KEYS, pinned).
        nodes.insert(0, Node("input_ids", out=[(INPUT_IDS, N * 8)]))
    if arch.gpt2_layers and attention == "math":
        nodes.append(Node("causal_mask", out=[(CAUSAL_MASK, dm.b * s * s * pe)]))
    elif dm.hf and not arch.gpt2_layers:
        nodes += hf_model_input_nodes(dm, attention)
    src = "tok"
    if arch.positional == "learned":
        nodes.append(Node("pos", out=[("pos_idx", s * 8)]))
        # The lookup saves its position ids for the weight's gradient only: a frozen table (LoRA)
        # saves nothing (kept, an offloader moved s x 8 bytes more each way than the trace, GPT-2
        # under LoRA from 128 tokens).
        nodes.append(Node("wpe", out=[("posemb", s * d * pe)], inputs=["pos_idx"], saves=["pos_idx"] if trainable else [],
                           grads=[("param:wpe.weight", 0.0)] if trainable else []))
        # Broadcast add: the token side's gradient passes through, the position side is summed.
        nodes.append(Node("embed_add", out=[("emb", N * d * pe)], inputs=["tok", "posemb"],
                           grads=[("tok", 0.0), ("posemb", s * d * pe)]))
        src = "emb"
    if arch.embed_scale:
        # Gemma's embedding: the lookup times sqrt(hidden), a new tensor (the scale is a buffer:
        # nothing saved).
        nodes.append(Node("embed_scale", out=[("emb", N * d * pe)], inputs=[src], grads=[(src, N * d * pe)]))
        src = "emb"
    dropout(nodes, dm, "drop", src, "blocks.0.in", N * d, pe, requires_grad=trainable)
    return nodes


def layer_args(dm: Dims, arch: Arch, attention: str) -> tuple[str, ...]:
    """What a transformers model makes once and hands every layer besides its input: a
    checkpointed layer keeps it until its backward (``Segment.held_inputs``), the model until it
    returns. GPT-2: its eager causal mask; Llama-style: :func:`hf_model_input_nodes`' tensors."""
    if arch.gpt2_layers:
        return (CAUSAL_MASK,) if attention == "math" else ()
    return hf_model_inputs(attention, dm.masked_sdpa, dm.full_mask) if dm.hf else ()


def layer_positional_args(arch: Arch, attention: str) -> tuple[str, ...]:
    """Of :func:`layer_args`, those the model hands its layers as positional arguments, which
    torch's non-reentrant checkpoint saves through the saved-tensor hooks (an activation offloader
    copies them to the host: ``Segment.packed_inputs``) where it keeps keyword arguments by
    reference: GPT2Model passes its eager causal mask as GPT2Block's third argument; Llama-style
    models pass theirs, and the rotary tables, by keyword."""
    return (CAUSAL_MASK,) if arch.gpt2_layers and attention == "math" else ()
