"""The step's op inventory (what each op allocates, saves and frees) as the simulator's segments:
the embedding (:mod:`.embedding_nodes`), each block (:mod:`.block_nodes`) with its checkpointing
(full, every:K, sqrt, Megatron's selective, torch's selective-matmul) and what it keeps of the
model's inputs, and the head (:mod:`.head_nodes`)."""

from __future__ import annotations

from memtrain.analysis.estimate.block_nodes import block_nodes
from memtrain.analysis.estimate.dims import Dims
from memtrain.analysis.estimate.embedding_nodes import embedding_nodes, layer_args, layer_positional_args
from memtrain.analysis.estimate.head_nodes import head_nodes
from memtrain.analysis.estimate.hf_nodes import CAUSAL_MASK, FULL_MASK
from memtrain.analysis.estimate.simulator import Compression, Segment
from memtrain.config.archs import Arch
from memtrain.config.run import RunConfig
from memtrain.techniques.facts import checkpoint_policy


def layer_held_inputs(dm: Dims, model_inputs: tuple[str, ...], i: int) -> tuple[str, ...]:
    """What of the model's ``model_inputs`` (:func:`layer_args`) decoder layer ``i`` is handed, so
    keeps when checkpointed: all of it, but for Qwen2's two masks (``Dims.full_mask``), of which a
    layer gets its kind's (the windowed CAUSAL_MASK where it slides, FULL_MASK where it attends in
    full); with every layer sliding, FULL_MASK is the model's alone. (Layers of both kinds repeat
    no period for Compression to lump: such a model is simulated block by block, estimate.)"""
    if not dm.full_mask:
        return model_inputs
    slides = dm.layer_slides[i] if dm.layer_slides else True
    mask = CAUSAL_MASK if slides else FULL_MASK
    return tuple(k for k in model_inputs if k not in (CAUSAL_MASK, FULL_MASK) or k == mask)


def block_segments(cfg: RunConfig, arch: Arch, dm: Dims, trainable_base: bool, grads_exist: bool,
              comp: Compression) -> list[Segment]:
    m, tech = cfg.model, cfg.technique
    policy = checkpoint_policy(tech.checkpointing)
    kind = policy.kind
    L = m.n_layers
    mode = "selective" if kind == "selective-matmul" else "full"
    segs = [Segment("embedding", embedding_nodes(dm, arch, trainable_base, tech.attention))]
    model_inputs = layer_args(dm, arch, tech.attention)
    positional = layer_positional_args(arch, tech.attention)
    for j in range(comp.blocks):
        i = comp.real(j)
        nodes = block_nodes(dm, j, arch, tech, trainable_base)
        held_inputs = layer_held_inputs(dm, model_inputs, i)
        if kind == "selective":
            # Megatron's selective recomputation: the block runs as usual around a checkpointed
            # attention core, which keeps only its input (q, k, v: views of the qkv output).
            # Its recompute is lazy as a block's: the output's cast back (SDPA's math path on
            # 16-bit inputs) runs its backward first, and the recompute stops as probs @ v saves
            # its inputs, before its output exists (+1.3% backward when made, bf16-pure, LoRA).
            a = next(x for x, n in enumerate(nodes) if n.core)
            b = a + sum(1 for n in nodes if n.core)
            segs += [Segment(f"block {i}", nodes[:a]),
                     Segment(f"block {i} attention core", nodes[a:b], checkpoint="full",
                              input_key=f"blocks.{j}.qkv", lazy_recompute=True),
                     Segment(f"block {i}", nodes[b:])]
            continue
        # torch's checkpoint recomputes lazily for our GPT as well: under autocast the residual
        # branch's gradient cast comes before the recompute (the last checkpointed block's
        # recompute end was -1.2% under without LoRA, where this held for LoRA alone), and under
        # LoRA the last adapter's B product is not recomputed.
        segs.append(Segment(f"block {i}", nodes,
                             checkpoint=mode if policy.whole_block(i, L) else "none", input_key=f"blocks.{j}.in",
                             lazy_recompute=True, held_inputs=held_inputs,
                             packed_inputs=tuple(k for k in held_inputs if k in positional)))
    # (The simulated depth is passed, not set on a copy of cfg.model: a transformers model's
    # ModelConfig mirrors its config.json again on every copy, n_layers included.)
    segs.append(Segment("head", head_nodes(dm, m, tech, arch, trainable_base, grads_exist, comp.blocks,
                                           answers_only=cfg.data.loss_on == "completion",
                                           ignores_targets=cfg.data.ignores_targets)))
    assert L == comp.blocks + comp.lumps * comp.period
    return segs
