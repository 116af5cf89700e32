"""The estimate of one steady-state training step: the timeline replayed, by component and phase."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Optional

from memtrain.analysis.device_replay import StepTimeline, replay_two_steps
from memtrain.analysis.estimate.dims import precision_bytes, run_dims
from memtrain.analysis.estimate.embedding_nodes import TOKEN_KEYS, token_id_bytes
from memtrain.analysis.estimate.explain import explanation_lines, layer_activation_bytes
from memtrain.analysis.estimate.head_nodes import LOSS, WEIGHTED_LOSS
from memtrain.analysis.estimate.inventory import block_segments
from memtrain.analysis.estimate.optimizer import clip_scratch, optimizer_temporaries, predicted_optimizer_state
from memtrain.analysis.estimate.params import ParamInfo, block_param_table
from memtrain.analysis.estimate.rules import model_state_rule
from memtrain.analysis.estimate.simulator import Graph, Segment, Simulator, compression_of
from memtrain.analysis.limits import check_analytic_size
from memtrain.config.archs import GPT2_ARCH, Arch
from memtrain.config.run import ConfigError, RunConfig
from memtrain.models.spec import is_hf
from memtrain.techniques.facts import MEMORY_CATEGORIES, OFFLOAD_MIN_BYTES, OPTIMIZER_STATE_RULES, optimizer_kernel

# Which meter category each of the JSON contract's components (simulator.COMPONENTS) is part of.
_CATEGORY_OF = {"weights": "parameters", "gradients": "gradients", "optimizer": "optimizer",
                "activations": "activations", "logits": "activations", "temporaries": "temporaries"}

# Not estimated: the RNG state non-reentrant checkpointing stores per block call on CPU
# (torch.get_rng_state(), 5,056 B; preserve_rng_state=True, so that dropout draws the same masks
# during the recompute). The tensor is made outside the dispatcher, so the memory meter (which
# counts op outputs), traced or real, never sees it. The timeline once counted it for our GPT on
# CPU (from the block's forward to the end of the step): a checkpointed tiny model's backward up
# to +3.3% and its optimizer step up to +3.8% over the meter; a transformers model's never did.


# --------------------------------------------------------------------------- the estimate
@dataclass
class Estimate:
    """What :func:`estimate` returns (``to_dict`` is the JSON of ``memtrain estimate --json``)."""

    # The model's weights as built, LoRA adapters not included: what train's result.json and
    # flops report as ``parameters``; the adapters are ``adapter_parameters``.
    parameters: int
    trainable_parameters: int
    bytes: dict[str, float]
    peak_bytes: float
    peak_phase: str
    peak_detail: str
    by_category: dict[str, float]
    phase_peaks: dict[str, float]
    activations_per_layer: float  # under the configured checkpointing (mean over blocks)
    explanation: list[str]
    rules: dict[str, Any]
    shape: dict[str, Any]
    mode: str = "train"
    world_size: int = 1
    shard: str = "none"
    extra: dict[str, Any] = field(default_factory=dict)
    activations_per_layer_no_checkpointing: float = 0.0
    # With estimate(gpu=...): the CUDA caching allocator's view (memtrain.analysis.allocator.DeviceMemory).
    device_memory: Optional[dict[str, Any]] = None
    # --offload-activations: host bytes and the bytes moved each way per step (offload_figures);
    # None (and left out of the JSON) when off.
    offload: Optional[dict[str, float]] = None
    adapter_parameters: int = 0  # LoRA's A and B matrices (trainable; not in ``parameters``)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if d["offload"] is None:
            del d["offload"]
        else:
            d["offload"] = {k: int(round(v)) for k, v in self.offload.items()}  # type: ignore[union-attr]  # not None here
        d["bytes"] = {k: int(round(v)) for k, v in self.bytes.items()}
        d["by_category"] = {k: int(round(v)) for k, v in self.by_category.items()}
        d["phase_peaks"] = {k: int(round(v)) for k, v in self.phase_peaks.items()}
        d["peak_bytes"] = int(round(self.peak_bytes))
        d["activations_per_layer"] = int(round(self.activations_per_layer))
        d["activations_per_layer_no_checkpointing"] = int(round(self.activations_per_layer_no_checkpointing))
        return d


def _validate(cfg: RunConfig, arch: Arch, device_type: str) -> None:
    tech = cfg.technique
    if arch is GPT2_ARCH and is_hf(cfg):
        # A transformers model read with memtrain's GPT layout would be a quiet wrong answer
        # (tied head, GPT's LoRA targets: Llama-3-8B came out 1.83 GiB low).
        raise ConfigError(f"{cfg.model.model!r} is a transformers model: estimate it with "
                          "memtrain.analysis.estimate.method.estimate_step (its own layer model or a trace), "
                          "not with memtrain's GPT architecture")
    if tech.compile:
        pass  # compile changes kernels, not (to first order) what is saved; estimated as eager
    if arch.n_kv_heads and cfg.model.n_heads % arch.n_kv_heads:
        raise ConfigError(f"n_kv_heads {arch.n_kv_heads} must divide --n-heads {cfg.model.n_heads}")
    if device_type not in ("cpu", "cuda"):
        raise ConfigError(f"--trace-device/--device-type {device_type!r}: use cpu or cuda")


def _shard_kind(shard: str) -> str:
    """The sharding the estimate models for a ``--shard``/``--distributed`` choice: DeepSpeed's
    ZeRO-2 is ``zero2``, its ZeRO-3 ``fsdp``; any other is itself."""
    return {"deepspeed-zero2": "zero2", "deepspeed-zero3": "fsdp"}.get(shard, shard)


def _gathered_weights(params: list[ParamInfo], shard: str, n: int, dtype_bytes: float, blocks: int,
                      ) -> tuple[float, dict[int, float]]:
    """What FSDP2 (zero2, fsdp) all-gathers on one of ``n`` ranks, in ``dtype_bytes`` a value: the root
    group's bytes (embeddings, final norm, tied head: gathered at the first forward and kept until
    its post-backward at the end of backward, the whole step; 0 without FSDP2), and under zero2
    each simulated block's (its full weights from its forward until its post-backward reshards
    them, reshard_after_backward being on by default, as the block's backward ends)."""
    root = (sum(p.numel * p.repeat * dtype_bytes for p in params if p.block is None)
            if n > 1 and shard in ("zero2", "fsdp") else 0.0)
    if shard != "zero2" or n <= 1:
        return root, {}
    # Without ``repeat``: a lumped period repeats what the measured one allocates and frees.
    return root, {j: sum(p.numel * dtype_bytes for p in params if p.block == j) for j in range(blocks)}


def _zero1_state(cfg: RunConfig, trainable: list[ParamInfo], world_size: int, step_kernel: str,
                 adapter_bytes: float) -> dict[str, Any]:
    """memtrain's ZeRO-1 gives each rank the dim-0 chunk of every tensor (ceil(rows/N) rows,
    the last ranks fewer): the rank with the most state (rank 0) is reported, with every rank's
    optimizer state and that rank's optimizer-step scratch."""
    tech = cfg.technique
    ranks = _zero1_partition(trainable, world_size)
    per_rank = [predicted_optimizer_state(ps, tech.optim, adapter_bytes, tech.optim_block)[0] for ps in ranks]
    worst = per_rank.index(max(per_rank))
    return {"rank": worst, "optimizer_per_rank": per_rank,
            "scratch": optimizer_temporaries(ranks[worst], step_kernel, adapter_bytes, cfg.train.weight_decay,
                                             tech.precision)}


def _shard_divisors(shard: str, n: int) -> dict[str, int]:
    """What one of ``n`` ranks holds of the weights, gradients and optimizer state, as the divisor
    of each: ZeRO-1 shards the optimizer state, ZeRO-2 the gradients too, FSDP the weights too."""
    shard_div = {"weights": 1, "gradients": 1, "optimizer": 1}
    if n > 1 and shard in ("zero1", "zero2", "fsdp"):
        shard_div["optimizer"] = n
        if shard in ("zero2", "fsdp"):
            shard_div["gradients"] = n
        if shard == "fsdp":
            shard_div["weights"] = n
    return shard_div


def _by_category(peak_tags: dict[str, float]) -> dict[str, float]:
    """The peak's bytes by memory category (every category, 0 where none)."""
    by_category = {c: 0.0 for c in MEMORY_CATEGORIES}
    for tag, v in peak_tags.items():
        by_category[_CATEGORY_OF[tag]] += v
    return by_category


def estimate(  # noqa: C901 - the step timeline in order; splits with the analysis package
    cfg: RunConfig,
    arch: Arch = GPT2_ARCH,
    device_type: Optional[str] = None,
    world_size: int = 1,
    shard: Optional[str] = None,
    gpu: Optional[str] = None,
    *,
    _compress: bool = True,
    _first_step: bool = False,
) -> Estimate:
    """Memory of one steady-state training step (the second step: optimizer state exists).

    ``gpu`` (with CUDA kernels): also replay the timeline through the CUDA caching-allocator
    model (:mod:`memtrain.analysis.allocator`) and report ``device_memory`` {``allocated``, ``reserved``,
    ``device_total``} as torch.cuda and nvidia-smi would show them, for that GPU kind's assumed
    CUDA context ("default" for any other name). Runs the per-layer timeline: up to 1024 layers.

    ``device_type`` (cpu|cuda; default from ``cfg.train.device``, auto = cuda) decides the few
    kernel facts that differ: dropout keeps a float noise tensor on CPU but a 1-byte mask on
    CUDA; SDPA on CPU has no dropout in its fused kernel. ``world_size``/``shard``
    (zero1|zero2|fsdp, default ``cfg.technique.distributed``) give the memory of one rank.
    """
    device_type = device_type or ("cpu" if cfg.train.device == "cpu" else "cuda")
    _validate(cfg, arch, device_type)
    m, tech, t = cfg.model, cfg.technique, cfg.train
    shard = _shard_kind(shard or tech.distributed)
    if world_size < 1:
        raise ConfigError(f"--world-size must be >= 1, got {world_size}")
    check_analytic_size(m)
    # Deep models run a few blocks and lump the rest (per layer kind: O(1) in n_layers); the
    # table has one entry per simulated tensor, the lumped blocks' counted by ``repeat``.
    dm = run_dims(cfg, arch, device_type)
    comp = compression_of(cfg)
    # Layers of two kinds, each handed its own mask (Qwen2's full and sliding ones under eager
    # attention: Dims.layer_slides), repeat no period: a lump would replay a mask's release.
    if not _compress or dm.layer_slides:
        comp = replace(comp, lumps=0, blocks=m.n_layers)
    rep = {j: 1 + comp.lumps for j in range(comp.period, 2 * comp.period)} if comp.lumps else None
    params = block_param_table(m, arch, tech, range(comp.blocks), rep)
    n_params = sum(p.numel * p.repeat for p in params if not p.is_adapter)
    n_adapters = sum(p.numel * p.repeat for p in params if p.is_adapter)
    trainable = [p for p in params if p.trainable]
    n_train = sum(p.numel * p.repeat for p in trainable)
    pb, ab, autocast = precision_bytes(tech.precision)
    if autocast and world_size > 1 and shard in ("zero2", "fsdp"):
        dm = replace(dm, weights_in_compute_dtype=True)
    # DDP (and zero1, which runs on DDP) keeps the gradients in its communication buckets
    # (gradient_as_bucket_view) from the first step on: they exist before every backward, as
    # under gradient accumulation, and each op's gradient is added into them.
    ddp_buckets = world_size > 1 and shard in ("none", "ddp", "zero1")
    grads_exist = t.grad_accum > 1 or ddp_buckets
    lora = tech.lora_rank > 0
    # LoRA adapters are created in float32 next to the (possibly bf16) frozen base.
    adapter_bytes = (pb if arch.hf else 4) if lora else pb  # peft makes them in the base's dtype
    # (--qlora: the frozen Linears' NF4 weights are smaller: ParamInfo.stored_bytes.)
    pbytes: dict[str, float] = {p.name: p.numel * adapter_bytes if "lora_" in p.name else p.stored_bytes(pb)
                                for p in params}
    repeat = {p.name: p.repeat for p in params}
    weights = sum(v * repeat[k] for k, v in pbytes.items())
    grad_bytes = {p.name: pbytes[p.name] for p in trainable}
    grad_total = sum(v * repeat[k] for k, v in grad_bytes.items())
    opt_bytes, opt_lines = predicted_optimizer_state(trainable, tech.optim, adapter_bytes, tech.optim_block)
    # `--optim adamw` runs the device's kernel: on CUDA the fused one, which updates in place, not
    # the CPU's per-tensor loop with its scratch.
    step_kernel = optimizer_kernel(tech.optim, tech.precision, device_type)
    opt_tmp = optimizer_temporaries(trainable, step_kernel, adapter_bytes, t.weight_decay, tech.precision)
    zero1 = (_zero1_state(cfg, trainable, world_size, step_kernel, adapter_bytes)
             if shard == "zero1" and world_size > 1 and sum(p.repeat for p in trainable) <= _ZERO1_MAX_TENSORS
             else None)

    # ---- sharding (one rank's share)
    n = world_size
    shard_div = _shard_divisors(shard, n)

    if gpu is not None and device_type == "cuda" and _compress:
        if m.n_layers > 1024:
            raise ConfigError(f"--gpu (the CUDA allocator model) replays every layer: at most 1024, got {m.n_layers}")
        est = estimate(cfg, arch, device_type, world_size, shard, gpu, _compress=False)
        est.device_memory = est.extra.pop("_device_memory")
        return est
    sim = Simulator()
    if gpu is not None and device_type == "cuda":
        sim.events = []
    sim.at("start", "weights and optimizer state")
    w_rank = weights / shard_div["weights"]
    if shard == "zero2" and n > 1:
        # FSDP2 with reshard_after_forward=False: each rank holds its 1/N shard (_gathered_weights).
        w_rank = weights / n
    gathered_dtype = ab if autocast else pb  # FSDP2's MixedPrecisionPolicy gathers bf16 under autocast
    gathered_bytes, gathered_blocks = _gathered_weights(params, shard, n, gathered_dtype, comp.blocks)
    opt_share = zero1["optimizer_per_rank"][zero1["rank"]] if zero1 else opt_bytes / shard_div["optimizer"]
    tmp_share = zero1["scratch"] if zero1 else opt_tmp / shard_div["optimizer"]
    # _first_step (the allocator replay's first step): no optimizer state yet (created lazily
    # by the first optimizer step) and no previous step's logits (--loss naive).
    state_sids = [sim.alloc(w_rank, "weights")] + ([] if _first_step else [sim.alloc(opt_share, "optimizer")])
    # The step's 0-d tensors: train_step's float32 loss total, alive to the end of the step, and,
    # with clipping, the previous step's total gradient norm (``Precision.last_grad_norm``, in the
    # gradients' dtype, replaced by this step's clip). A few bytes, but a model a few bytes wide
    # holds little else. A step of one micro-batch keeps the loss node's own output as its total
    # (step_loss_key): it appears with the loss, not before the forward. Under accumulation the
    # total is a copy of the first loss, counted from the start.
    kept_loss = step_loss_key(cfg)
    if kept_loss is None:
        sim.alloc(4.0, "activations")
    if world_size > 1 and cfg.data.loss_on == "completion":
        _answer_loss_scales(sim, t.grad_accum)
    if t.grad_clip > 0 and not _first_step:
        sim.alloc(adapter_bytes, "temporaries")
    if shard == "fsdp" and n > 1:
        # FSDP all-gathers one block's parameters at a time (forward and backward).
        per_block = max((sum(pbytes[p.name] for p in params if p.block == i) for i in range(comp.blocks)), default=0)
        sim.alloc(per_block, "temporaries")
    # FSDP2 (zero2, fsdp) under gradient accumulation skips the reduce-scatter on all micro-batches
    # but the last (set_requires_gradient_sync(False)): each group keeps its *unsharded* gradients
    # (full size) as its accumulated gradient, so the last micro-batch starts with all of them.
    fsdp_accum = t.grad_accum > 1 and n > 1 and shard in ("zero2", "fsdp")
    grads_lump = None
    if grads_exist:
        grads_lump = sim.alloc(grad_total / (1 if fsdp_accum else shard_div["gradients"]), "gradients")

    # FSDP2 (zero2, fsdp) reduce-scatters each parameter group's gradients as the group's
    # backward ends (a block's after that block, the root's after the embedding): the block's
    # unsharded gradients are freed then, only its 1/N shard stays (_FSDPReduce). Under
    # gradient accumulation the last micro-batch starts with every unsharded gradient (above).
    per_group = shard_div["gradients"] > 1 and not fsdp_accum
    unsharded = pbytes
    if per_group and dm.weights_in_compute_dtype:
        # Gathered in bf16 (MixedPrecisionPolicy), the parameters' gradients are bf16 too.
        unsharded = {p.name: p.numel * ab for p in params}
    segs = block_segments(cfg, arch, dm, not lora, grads_exist, comp)
    _fill_param_grads(segs, unsharded)
    graph = Graph(sim, segs, {k: unsharded[k] for k in grad_bytes}, grads_exist)
    reduce = _FSDPReduce(sim, graph, n, device_type, pbytes) if per_group else None
    if reduce is not None:
        graph.lump_exclude = lambda: {"temporaries": reduce.opened}
        for j in range(comp.blocks):
            # Block j's segments start at 1 + j * per_block; its backward ends with the first.
            graph.after_backward[1 + j * comp.per_block] = (
                lambda group=[p for p in trainable if p.block == j], j=j: reduce(group, f"block {comp.real(j)}"))
    if gathered_blocks:
        _reshard_blocks_after_backward(sim, graph, comp, gathered_blocks)
    graph.comp = comp
    if tech.offload_activations:
        graph.offload_min = OFFLOAD_MIN_BYTES
    previous: Optional[int] = None
    if tech.loss == "naive":
        graph.pinned.add("logits")
    if tech.loss == "naive" and not _first_step:
        # The caller's `logits` holds the previous step's logits until model(x) returns the new
        # ones, and the new ones past the end of this step.
        previous = sim.alloc(dm.n * dm.V * dm.a, "logits")
        graph.after_forward["lm_head"] = lambda: sim.free(previous)
    if not m.untie_embeddings:
        graph.tied.add("wte.weight")
    # The token ids: counted from the first op that shows them, held by the step's list of
    # micro-batches until it ends (embedding_nodes.TOKEN_KEYS); by the last micro-batch every earlier
    # one's are counted.
    graph.pinned.update(TOKEN_KEYS)
    if kept_loss is not None:
        graph.pinned.add(kept_loss)
    if t.grad_accum > 1:
        sim.at("forward", "earlier micro-batches' token ids")
        sim.alloc((t.grad_accum - 1) * token_id_bytes(dm, arch), "activations")
    gathered = sim.alloc(gathered_bytes, "weights") if gathered_bytes else None
    if gathered_bytes and n > 1:
        # FSDP2 all-gathers a group into one flat buffer and copies it out into the unsharded
        # parameters: for a moment both exist, the root group's (embeddings, norm, head) first,
        # before the first layer. The peak when nothing later outgrows it (a frozen LM head
        # under LoRA and the chunked loss: no vocabulary-sized gradient in backward).
        sim.at("forward", "FSDP2 all-gather of the root group")
        sim.transient(gathered_bytes)
    graph.forward()
    graph.backward()
    sim.free(gathered)
    if reduce is not None:
        # The root group's post-backward (FSDP2's final callback): embeddings, final norm, head.
        reduce([p for p in trainable if p.block is None], "the root group")
        reduce.finish()
    elif shard_div["gradients"] > 1:
        # ZeRO-2 / FSDP: after the reduce-scatter a rank keeps 1/N of the gradients.
        lumped = [sid for sid in graph.lump_grads if sim.live.get(sid, (0, ""))[1] == "gradients"]
        for sid in [sid for name in list(graph.param_grad_sid) for sid in graph.param_grad_sids(name)] + lumped:
            sim.free(sid)
        if fsdp_accum:
            sim.free(grads_lump)  # the last micro-batch's reduce-scatter replaces them with the shards
        sim.alloc(grad_total / shard_div["gradients"], "gradients")

    # Optimizer step: weights + grads + states + scratch, then zero_grad frees the grads.
    sim.at("optimizer", f"{tech.optim} step")
    sim.count_live()  # the step holds the weights, gradients and state even where it adds no scratch
    optimizer_at = len(sim.events) if sim.events is not None else 0
    if t.grad_clip > 0 and shard_div["gradients"] == 1:
        # clip_grad_norm_ runs before the step, its per-tensor norms gone when it returns.
        sim.transient(clip_scratch(trainable, adapter_bytes), "temporaries")
    sim.transient(tmp_share, "temporaries")

    device_memory = None
    if sim.events is not None:
        step = StepTimeline(events=sim.events, optimizer_at=optimizer_at, state_sids=state_sids, carried_in=previous,
                            live_at_end=dict(sim.live), peak=sim.peak, backward_gemm_at=graph.backward_gemm_at)
        if _first_step:
            return step  # type: ignore[return-value]  # internal: the replay's first step
        first: Any = estimate(cfg, arch, device_type, world_size, shard, gpu, _compress=False, _first_step=True)
        device_memory = replay_two_steps(
            first, step, gpu, weights=[pbytes[p.name] / shard_div["weights"] for p in params],
            lazy_state=_lazy_optimizer_state(trainable, pbytes, tech.optim, shard_div["optimizer"], opt_share),
        ).to_dict()

    peak_tags = sim.peak_tags
    by_category = _by_category(peak_tags)
    act_layer = layer_activation_bytes(cfg, arch, dm, not lora)
    act_layer_none = layer_activation_bytes(cfg, arch, dm, not lora, "none")
    expl = explanation_lines(cfg, arch, dm, params, n_params, n_train, weights, opt_bytes, opt_lines, act_layer_none,
                    sim, shard, n, device_type)
    rule = model_state_rule(n_params, tech.optim, trainable=n_train if lora else None,
                            mixed_precision=autocast)
    return Estimate(
        parameters=n_params,
        trainable_parameters=n_train,
        adapter_parameters=n_adapters,
        bytes=dict(peak_tags),
        peak_bytes=sim.peak,
        peak_phase=sim.peak_phase,
        peak_detail=sim.peak_detail,
        by_category=by_category,
        phase_peaks={k: v for k, v in sim.phase_peaks.items() if k},
        activations_per_layer=act_layer,
        activations_per_layer_no_checkpointing=act_layer_none,
        explanation=expl,
        rules=rule,
        shape={"arch": arch.name, "d_model": m.d_model, "n_layers": m.n_layers, "n_heads": m.n_heads,
               "d_ff": m.d_ff, "vocab": m.padded_vocab_size, "tied": not m.untie_embeddings,
               "batch_size": t.batch_size, "seq_len": t.seq_len, "grad_accum": t.grad_accum,
               # Named only off its default, so that every other estimate's JSON stays as it was.
               **({"loss_on": cfg.data.loss_on} if cfg.data.loss_on != "all" else {}),
               # Always named: a pad step differs from a concat one (--packing pad's pads are
               # ignored targets, which Cut Cross-Entropy keeps an index for), so the shape says which.
               "packing": cfg.data.packing},
        world_size=n,
        shard=shard if n > 1 else "none",
        offload=offload_figures(sim, graph, t.grad_accum) if tech.offload_activations else None,
        extra={"model_state": {"weights": weights / shard_div["weights"],
                               "gradients": grad_total / shard_div["gradients"],
                               "optimizer": opt_share,
                               "optimizer_step_scratch": tmp_share},
               **({"zero1": {"rank": zero1["rank"], "optimizer_per_rank": zero1["optimizer_per_rank"]}}
                  if zero1 else {}),
               "device_type": device_type, **({"_device_memory": device_memory} if device_memory else {})},
    )


def step_loss_key(cfg: RunConfig) -> Optional[str]:
    """The loss node output train_step keeps as the step's loss total, or None where the total is
    a tensor of its own (under accumulation: a copy of the first loss). With one micro-batch
    ``_add_loss`` returns the loss itself: the kernel's 0-d output, or ``loss * weight`` under
    --loss-on completion. (Data parallelism's answer scale multiplies that once more: a 0-d
    product that replaces the model's loss as it is made, the same 4 bytes.)"""
    if cfg.train.grad_accum > 1:
        return None
    return WEIGHTED_LOSS if cfg.data.loss_on == "completion" else LOSS


def _answer_loss_scales(sim: Simulator, micro_batches: int) -> None:
    """--loss-on completion under data parallelism: ``MicroBatches.loss_scales`` weighs each
    micro-batch by the global answer count, all-reduced on the device before the first forward.
    The float64 count (made, reduced in place), its ``clamp_min`` and ``ranks / clamped`` (torch's
    ``__rtruediv__``: a reciprocal, freed, times ranks), then per micro-batch a float64 product and
    its float32 cast: the casts (4 bytes each) are the step's scales, kept to its end; the float64
    values go as the method returns. (On one process the scales are Python floats: nothing on the
    device.)"""
    count, clamped, reciprocal, per_token = (sim.alloc(8.0, "activations") for _ in range(4))
    sim.free(reciprocal)
    sim.free(clamped)
    for _ in range(micro_batches):
        product = sim.alloc(8.0, "activations")
        sim.alloc(4.0, "activations")
        sim.free(product)
    sim.free(count)
    sim.free(per_token)


def offload_figures(sim: Simulator, graph: Graph, grad_accum: int) -> dict[str, float]:
    """What --offload-activations holds on the host and moves over the host link: the most host
    bytes at once (``host_peak_bytes``), those at the device peak, and the bytes copied each way
    in one optimizer step (every micro-batch offloads and brings back its own activations)."""
    return {"host_peak_bytes": sim.host_peak, "host_at_peak_bytes": sim.host_at_peak,
            "d2h_bytes_per_step": graph.d2h * grad_accum, "h2d_bytes_per_step": graph.h2d * grad_accum,
            "transfer_bytes_per_step": (graph.d2h + graph.h2d) * grad_accum}


def traced_offload(traced: dict[str, Any]) -> dict[str, int]:
    """The ``offload`` entry of a traced step (memtrain.analysis.trace runs the offloader itself):
    what it held on the host and moved, under :func:`offload_figures`' names so the estimate and
    the trace read side by side, then the offloader's counts of saved tensors it copied
    (``tensors``) and left on the device (``kept_small``, ``kept_parameters``)."""
    moved = traced["offload"]
    return {"host_peak_bytes": int(traced.get("offloaded_peak_bytes", 0)),
            "host_at_peak_bytes": int(traced.get("offloaded_at_peak_bytes", 0)),
            "d2h_bytes_per_step": int(moved["d2h_bytes"]), "h2d_bytes_per_step": int(moved["h2d_bytes"]),
            "transfer_bytes_per_step": int(moved["d2h_bytes"] + moved["h2d_bytes"]),
            **{k: int(moved[k]) for k in ("tensors", "kept_small", "kept_parameters") if k in moved}}


def _lazy_optimizer_state(trainable: list[ParamInfo], pbytes: dict[str, float], optim: str, div: int,
                          total: float) -> list[float]:
    """The optimizer state tensors in the order the first ``optimizer.step()`` creates them:
    per parameter, AdamW's exp_avg then exp_avg_sq (SGD: one momentum buffer); other
    optimizers as one tensor of their whole state."""
    rule = OPTIMIZER_STATE_RULES.get(optim)
    # Full-size, unquantized state tensors only: quantized and factored states are one lump.
    n_states = rule.states if rule is not None and not (rule.quantized or rule.factored) else 0
    if not n_states:
        return [total]
    return [pbytes[p.name] / div for p in trainable for _ in range(n_states)]


# Above this many trainable tensors ZeRO-1's per-rank split is not replayed (the even split is used).
_ZERO1_MAX_TENSORS = 1_000_000


def _zero1_partition(params: list[ParamInfo], world: int) -> list[list[ParamInfo]]:
    """The tensors whose state each rank keeps under ``--distributed zero1``
    (:class:`memtrain.distributed.zero1.ShardedZeRO1`): rank r's dim-0 chunk of every tensor,
    ``torch.chunk``'s split (ceil(rows / N) rows each, the last ranks fewer or none)."""
    from memtrain.distributed.zero1 import dim0_range  # torch-free --help/estimate/plan

    out: list[list[ParamInfo]] = [[] for _ in range(world)]
    for p in params:
        rows = p.shape[0] if p.shape else 1
        for r in range(world):
            start, end = dim0_range(rows, r, world)
            if end > start:
                # (A chunk of a fused entry's rows is no longer its tensors: ParamInfo.parts dropped.)
                out[r].append(replace(p, shape=(end - start, *p.shape[1:]), parts=()))
    return out


class _FSDPReduce:
    """FSDP2's post-backward of one parameter group (``foreach_reduce``), as a rank's memory
    sees it: the reduce-scatter input (the group's gradients, each padded to a multiple of N
    rows, in the reduce dtype: the parameters') is allocated and filled, the unsharded gradients
    are freed, the output (the rank's 1/N shard, which stays as its ``.grad``) is allocated and
    the collective runs (gloo, on CPU, reduces a copy of the whole input). The input is kept
    until the next group's post-backward (``reduce_scatter_states``, at most one in flight),
    the last one until the backward's final callback (:meth:`finish`)."""

    def __init__(self, sim: Simulator, graph: Graph, world: int, device_type: str, pbytes: dict[str, float]) -> None:
        self.sim, self.graph, self.world, self.pbytes = sim, graph, world, pbytes
        self.gloo = device_type == "cpu"
        self.pending: Optional[int] = None
        self.opened = 0.0  # input bytes allocated with no earlier buffer freed (Graph.lump_exclude)

    def __call__(self, group: list[ParamInfo], label: str) -> None:
        sim, graph = self.sim, self.graph
        with_grad = [p for p in group if graph.param_grad_sid.get(p.name, 0) > 0]
        previous = sim.live.get(self.pending, (0.0, ""))[0] if self.pending is not None else 0.0
        sim.free(self.pending)  # the previous group's input buffer
        self.pending = None
        if not with_grad:
            self.opened -= previous
            return
        sim.at("backward", f"FSDP2 reduce-scatter of {label}")
        nbytes = sum(self.pbytes[p.name] * _padded_rows(p, self.world) / max(1, p.shape[0] if p.shape else 1)
                     for p in with_grad)
        self.opened += nbytes - previous
        self.pending = sim.alloc(nbytes, "temporaries")
        for p in with_grad:
            for sid in graph.pop_param_grads(p.name):
                sim.free(sid)
        sim.alloc(nbytes / self.world, "gradients")
        if self.gloo:
            sim.transient(nbytes)

    def finish(self) -> None:
        self.sim.free(self.pending)
        self.pending = None


def _reshard_blocks_after_backward(sim: Simulator, graph: Graph, comp: Any, gathered: dict[int, float]) -> None:
    """FSDP2 zero2 (reshard_after_forward=False): simulated block ``j``'s full weights
    (``gathered[j]`` bytes) are all-gathered as its forward begins and kept through the rest of
    the forward; its post-backward reshards them before reducing its gradients (the hook added
    here runs before the reduce-scatter already set for that block)."""
    live: dict[int, int] = {}

    def hooks(j: int, nbytes: float, then: Optional[Callable[[], None]]) -> tuple[Callable[[], None], Callable[[], None]]:
        def gather() -> None:
            sim.at("forward", f"FSDP2 all-gather of block {comp.real(j)}")
            live[j] = sim.alloc(nbytes, "weights")

        def reshard() -> None:
            sim.free(live.pop(j, None))
            if then is not None:
                then()

        return gather, reshard

    for j, nbytes in gathered.items():
        seg = 1 + j * comp.per_block  # the block's first segment: its forward starts, its backward ends there
        graph.before_forward[seg], graph.after_backward[seg] = hooks(j, nbytes, graph.after_backward.get(seg))


def _padded_rows(p: ParamInfo, world: int) -> int:
    """A parameter's dim-0 rows padded to a multiple of the rank count (FSDP2's even shards)."""
    rows = p.shape[0] if p.shape else 1
    return -(-rows // world) * world


def _fill_param_grads(segs: list[Segment], pbytes: dict[str, float]) -> None:
    """Replace the 0.0 placeholders of parameter gradients by the parameter's size (a fused
    entry's Linear's: its share of it, :attr:`Node.param_share`)."""
    for seg in segs:
        for n in seg.nodes:
            n.grads = [(k, pbytes.get(k[6:], 0.0) * n.param_share if (k.startswith("param:") and v == 0.0) else v)
                       for k, v in n.grads]
