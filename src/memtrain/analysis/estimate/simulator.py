"""The storage-lifetime simulator: nodes, segments, the step's timeline and its peak.

Generic over the op inventory (:mod:`memtrain.analysis.estimate.inventory` builds the nodes);
it knows only a step's structure (embedding, blocks, head; forward, loss, backward, optimizer
step) and, for deep models, which blocks stand in for the rest (:class:`Compression`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional

from memtrain.config.run import RunConfig
from memtrain.techniques.facts import OFFLOAD_PREFETCH, checkpoint_policy

# loss.backward()'s seed: a 0-d float32 gradient of the (float32) loss.
LOSS_GRAD_BYTES = 4.0

# The JSON contract's component names (training._CATEGORY_OF maps each to a meter category).
COMPONENTS = ("weights", "gradients", "optimizer", "activations", "logits", "temporaries")


# --------------------------------------------------------------------------- the simulator
class Simulator:
    """Live-storage accounting: allocations, frees and the peak with its breakdown.

    Each storage has a category (final role, as MemoryMeter reports it at the peak) and a
    component tag (weights, gradients, optimizer, activations, logits, temporaries).
    """

    def __init__(self) -> None:
        self.live: dict[int, tuple[float, str]] = {}
        self.by_tag: dict[str, float] = {c: 0.0 for c in COMPONENTS}
        self.total = 0.0
        self.peak = -1.0
        self.peak_tags: dict[str, float] = {}
        self.peak_phase = ""
        self.peak_detail = ""
        self.phase = ""
        self.detail = ""
        self.phase_peaks: dict[str, float] = {}
        self._next = 0
        # (op, storage id, bytes) in order, for the CUDA caching-allocator replay; None = off.
        self.events: Optional[list[tuple[str, int, float]]] = None
        # --offload-activations: host bytes held (never part of the device total), their most,
        # and what they were at the device peak.
        self.host = 0.0
        self.host_peak = 0.0
        self.host_at_peak = 0.0

    def host_alloc(self, nbytes: float) -> None:
        self.host += nbytes
        self.host_peak = max(self.host_peak, self.host)

    def host_free(self, nbytes: float) -> None:
        self.host -= nbytes

    def alloc(self, nbytes: float, tag: str) -> int:
        self._next += 1
        sid = self._next
        if self.events is not None:
            self.events.append(("alloc", sid, nbytes))
        self.live[sid] = (nbytes, tag)
        self.by_tag[tag] += nbytes
        self.total += nbytes
        self._check()
        return sid

    def free(self, sid: Optional[int]) -> None:
        if sid is None or sid not in self.live:
            return
        if self.events is not None:
            self.events.append(("free", sid, 0.0))
        nbytes, tag = self.live.pop(sid)
        self.by_tag[tag] -= nbytes
        self.total -= nbytes

    def transient(self, nbytes: float, tag: str = "temporaries") -> None:
        if nbytes > 0:
            self.free(self.alloc(nbytes, tag))

    def retag(self, sid: int, tag: str) -> None:
        nbytes, old = self.live[sid]
        self.by_tag[old] -= nbytes
        self.by_tag[tag] += nbytes
        self.live[sid] = (nbytes, tag)

    def at(self, phase: str, detail: str) -> None:
        self.phase, self.detail = phase, detail

    def count_live(self) -> None:
        """Count what is live toward the current phase's peak: a phase that allocates nothing
        (a fused optimizer step, which updates in place) still holds it."""
        self._check()

    def _check(self) -> None:
        if self.total > self.phase_peaks.get(self.phase, -1.0):
            self.phase_peaks[self.phase] = self.total
        if self.total > self.peak:
            self.peak = self.total
            self.peak_tags = dict(self.by_tag)
            self.peak_phase = self.phase
            self.peak_detail = self.detail
            self.host_at_peak = self.host


@dataclass
class Node:
    """One op of the forward pass, as far as memory is concerned.

    ``out``: new storages it allocates, (key, bytes) or (key, bytes, tag); ``inputs``: keys it
    reads (for lifetimes); ``saves``: keys autograd keeps for its backward; ``grads``: (key,
    bytes) gradients its backward produces (``param:NAME`` for a parameter, bytes 0.0 there
    meaning "the parameter's size"; bytes 0.0 for a tensor: the output's gradient passed through
    without a copy); ``grad_out``: the key(s) whose gradient it consumes (default: first output);
    ``grad_from``: gradients that are forward storages handed over (the chunked loss computes
    them in forward); ``hold``: outputs live until the forward ends (autocast's weight cache);
    ``matmul``: selective checkpointing keeps its outputs; ``scratch``/``fwd_scratch``: transient
    bytes of its backward/forward; ``fwd_steps``: the forward's temporaries one by one where their
    sizes and order matter to the caching allocator, ``("alloc", label, bytes)`` / ``("free",
    label, 0)`` with ``("outputs", "", 0)`` where the outputs are made (first when absent); what
    is still allocated at the end is freed then.
    """

    name: str
    out: list[tuple] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)
    saves: list[str] = field(default_factory=list)
    grads: list[tuple[str, float]] = field(default_factory=list)
    grad_out: Optional[tuple[str, ...]] = None
    grad_from: dict[str, str] = field(default_factory=dict)
    hold: bool = False
    matmul: bool = False
    keep: Optional[tuple[str, ...]] = None
    scratch: float = 0.0
    fwd_scratch: float = 0.0
    fwd_steps: tuple[tuple[str, str, float], ...] = ()
    tag: str = "activations"
    core: bool = False  # part of the attention core (q, k, v -> output) that selective recomputes
    # A composite op (transformers' RMSNorm: several autograd nodes) whose backward high point
    # ``scratch`` comes after its first node has consumed the incoming gradient and released
    # the saves named here, and before its last node makes the input's gradient: the simulator
    # frees those first, then counts the scratch, then makes ``grads``.
    releases_first: Optional[tuple[str, ...]] = None
    # Transient bytes its backward holds before it makes its gradients (``scratch`` comes after):
    # torchao's NF4 Linear dequantizes its weight before the matmul.
    scratch_first: float = 0.0
    # A custom autograd Function (torchao's LinearNF4): its ``ctx.save_for_backward`` is packed as
    # its forward returns, so a checkpoint's recompute that stops at its save has run it whole.
    packs_after_forward: bool = False
    # Outputs the op has made when autograd packs its saves, the rest coming after: the CPU
    # dropout draws its noise (an output here, ``saves``) and multiplies the input by it, a
    # product that saves the noise as its input before the product exists. A lazy recompute
    # that stops at such an op makes only these.
    made_before_save: tuple[str, ...] = ()
    # The inputs whose gradients ``saves`` and ``scratch`` serve, where the op passes others on
    # (rope rotates q and k and hands v on): without one of them requiring a gradient autograd
    # records neither (block_nodes.record_only_what_needs_grad). None: any input's.
    saves_for: Optional[tuple[str, ...]] = None
    # One Linear of a fused table entry (a transformers layer's gate_proj of ``mlp.fc``): its
    # parameters are tensors of their own, whose .grad it makes when its own backward runs, this
    # share of the entry's bytes (the ``param:`` placeholders: that share of the entry's size).
    param_share: float = 1.0
    # Saved tensors made outside the meter, (key, bytes): the data loader's token ids, which an
    # embedding saves for its weight's gradient. Never device bytes here (the meter never sees
    # them), but an activation offloader copies them to the host and back like any save.
    external: tuple[tuple[str, float], ...] = ()
    # How many of ``grads`` (the last ones) autograd's engine makes after the op's backward
    # function has returned: a broadcast input's gradient summed to its shape (validate_outputs'
    # sum_to), which is how addmm's bias gets its gradient. By then the function's locals are
    # gone, among them the device copies an activation offloader handed it for the last time.
    reduced_grads: int = 0

    def sac_kept(self) -> tuple[str, ...]:
        """Outputs selective checkpointing keeps (those of the matmul/attention kernel itself)."""
        if not self.matmul:
            return ()
        return self.keep if self.keep is not None else tuple(o[0] for o in self.out)

    @property
    def gemm(self) -> bool:
        """Whether the op's backward runs a cuBLAS matmul (a Linear, the LM head): the first one
        the backward meets makes the autograd thread's cuBLAS workspace. Attention kernels carry
        ``matmul`` too (for selective checkpointing) though a fused one calls no cuBLAS; the
        backward meets a block's output Linear before its attention, so that never decides."""
        return self.matmul or self.name == "lm_head"

    def out_keys(self) -> tuple[str, ...]:
        if self.grad_out is not None:
            return self.grad_out
        return (self.out[0][0],) if self.out else ()


@dataclass
class Segment:
    """A run of nodes: a Transformer block (maybe checkpointed), the embedding or the head."""

    name: str
    nodes: list[Node]
    checkpoint: str = "none"  # none | full | selective
    input_key: Optional[str] = None
    # Recompute when backward reaches the first op that saved something (torch's non-reentrant
    # checkpoint unpacks lazily: the ops after it, which save nothing, run their backward
    # first) and stops as the last op that saved something saves its inputs, before its
    # outputs exist; False recomputes as the segment's backward begins, through that op's
    # outputs (our GPT's model).
    lazy_recompute: bool = False
    # The checkpointed function's other tensor arguments (transformers' layers get the model's
    # causal mask and rotary tables): the checkpoint keeps them until the segment's backward ends.
    held_inputs: tuple[str, ...] = ()
    # Of ``held_inputs``, those handed as positional arguments: torch's non-reentrant checkpoint
    # saves its positional arguments through the saved-tensor hooks (so an activation offloader
    # copies them, once per storage however many layers save it) and keyword arguments only by
    # reference (on the device). GPT2Model passes its causal mask positionally.
    packed_inputs: tuple[str, ...] = ()

    def records(self) -> bool:
        """Whether any op of the segment saves a tensor for backward. torch's non-reentrant
        checkpoint keeps its inputs through the saved-tensor hooks of what it packs: where nothing
        is packed (selective's attention core on q, k and v that require no gradient, under LoRA
        on other Linears) the inputs go with the forward (kept, they were +3.2% to +6.7%, our GPT)."""
        return any(n.saves for n in self.nodes)


class Graph:
    """Runs forward and backward of a list of segments through a :class:`Simulator`."""

    def __init__(self, sim: Simulator, segments: list[Segment], param_grad: dict[str, float],
                 grads_exist: bool) -> None:
        self.sim = sim
        self.segments = segments
        self.param_grad = param_grad  # trainable param name -> bytes of its .grad
        self.store: dict[str, int] = {}  # key -> storage id (forward tensors)
        self.saved_refs: dict[str, int] = {}
        self.grad_sid: dict[str, int] = {}  # key -> storage id of its gradient
        self.grad_refs: dict[int, int] = {}
        # Gradient accumulation: every .grad exists already (sid -1: counted by the caller).
        self.param_grad_sid: dict[str, int] = {k: -1 for k in param_grad} if grads_exist else {}
        # A table entry whose Linears make their .grads one by one (Node.param_share): the later
        # parts' storages, and the bytes of the entry's gradient no part has made yet.
        self.param_grad_parts: dict[str, list[int]] = {}
        self.param_grad_left: dict[str, float] = {}
        self._shared: dict[int, str] = {}  # gradient storage id -> forward key it belongs to
        self.tied: set[str] = set()  # parameters used twice (the tied embedding / LM head)
        self.deferred: dict[str, Any] = {}  # tied parameter -> its buffered first gradient (key or sid)
        # Deep models: lumped periods of blocks (see Compression); their storages by tag.
        self.comp: Optional[Compression] = None
        # --loss naive: forward keys a caller keeps past the step, and actions after a node's forward.
        self.pinned: set[str] = set()
        self.after_forward: dict[str, Any] = {}
        self.lump_kept: list[int] = []  # freed in backward
        self.lump_flush: list[int] = []  # autocast weight copies no op saved: freed when forward ends
        self.lump_grads: list[int] = []  # what the lumped periods leave after backward (gradients)
        self._kept_by_tag: dict[str, float] = {}
        # --offload-activations (memtrain.techniques.offload): saves of at least offload_min bytes
        # are copied to the host as the forward saves them (one copy per storage) and brought
        # back, with OFFLOAD_PREFETCH more ahead, when the backward reaches their op.
        self.offload_min: Optional[float] = None
        self._offloading = False  # in the forward pass (the recompute saves into checkpoint's hooks)
        self.off: dict[str, _Offloaded] = {}
        self.off_list: list[Optional[_Offloaded]] = []
        self.d2h = 0.0
        self.h2d = 0.0
        self.lump_host = 0.0
        self._late_sums: list[int] = []  # second gradients of a tensor, summed out of place (_grad_alloc)
        self._late_tied: list[tuple[str, int]] = []  # tied weights' second gradients, summed after their op
        # Index in sim.events where the backward's first matmul runs (None: not yet, or no event
        # log): autograd runs the backward on its own device thread, whose cuBLAS handle gets a
        # workspace of its own there (memtrain.analysis.device_replay).
        self.backward_gemm_at: Optional[int] = None
        self._in_backward = False
        self._loss_grad: Optional[int] = None  # the loss gradient's storage while it lives (backward)
        # Actions run as the backward of segment i ends (before a lumped period's backward is
        # measured): FSDP2's post-backward of a block's parameter group (training._FSDPReduce).
        self.after_backward: dict[int, Any] = {}
        # Actions run as the forward of segment i begins (inside a measured period, so the
        # lumped periods repeat what they allocate): FSDP2's all-gather of a block's group.
        self.before_forward: dict[int, Any] = {}
        # Bytes (cumulative, by tag) that the measured period's backward allocates once and the
        # lumped periods do not repeat: FSDP2's first reduce-scatter input buffer, which each
        # later group's post-backward replaces by one of its own.
        self.lump_exclude: Optional[Any] = None

    def _note_gemm(self, n: Node, start: int) -> None:
        """Record where the backward's first matmul (``n``, whose allocations began at event
        ``start``) takes its workspace: after the kernel's first output, which at::mm allocates
        before it calls cuBLAS."""
        events = self.sim.events
        if not (self._in_backward and n.gemm and self.backward_gemm_at is None and events is not None):
            return
        first_alloc = next((i for i in range(start, len(events)) if events[i][0] == "alloc"), None)
        self.backward_gemm_at = start if first_alloc is None else first_alloc + 1

    def _snapshot(self) -> dict[str, float]:
        return dict(self.sim.by_tag)

    def _lump_forward(self, before: dict[str, float], held: list[str], n_held_before: int) -> None:
        """After the measured period's forward: allocate ``lumps`` copies of what it kept."""
        comp, sim = self.comp, self.sim
        assert comp is not None
        flush: dict[str, float] = {}
        for k in held[n_held_before:]:
            if k not in self.saved_refs and k in self.store:
                nbytes, tag = sim.live[self.store[k]]
                flush[tag] = flush.get(tag, 0.0) + nbytes
        for tag in COMPONENTS:
            delta = sim.by_tag[tag] - before[tag]
            kept = delta - flush.get(tag, 0.0)
            self._kept_by_tag[tag] = kept
            if kept:
                self.lump_kept.append(sim.alloc(comp.lumps * kept, tag))
            if flush.get(tag):
                self.lump_flush.append(sim.alloc(comp.lumps * flush[tag], tag))

    def _lump_backward(self, before: dict[str, float], excluded: dict[str, float]) -> None:
        """After the backward of the period above the lump: the lumped periods' backward, each
        changing the live bytes by what that period's backward changed them by (less what
        :attr:`lump_exclude` says it made once; ``excluded``: that before the period)."""
        comp, sim = self.comp, self.sim
        assert comp is not None
        once = self.lump_exclude() if self.lump_exclude is not None else {}
        delta = {tag: sim.by_tag[tag] - before[tag] - (once.get(tag, 0.0) - excluded.get(tag, 0.0))
                 for tag in COMPONENTS}
        for sid in self.lump_kept:
            sim.free(sid)
        self.lump_kept = []
        for tag in COMPONENTS:
            left = comp.lumps * (self._kept_by_tag.get(tag, 0.0) + delta[tag])
            if left:
                self.lump_grads.append(sim.alloc(left, tag))

    # ---- forward
    def _release(self, key: str) -> None:
        n = self.saved_refs.get(key, 0)
        if n > 1:
            self.saved_refs[key] = n - 1
            return
        self.saved_refs.pop(key, None)
        if key in self.pinned:
            return
        self.sim.free(self.store.pop(key, None))

    # ---- activation offloading
    def _offload(self, key: str) -> bool:
        """Copy ``key`` to the host if offloading takes it; whether it did (or had)."""
        if not self._offloading or self.offload_min is None or key not in self.store:
            return False
        return self._offload_bytes(key, self.sim.live[self.store[key]][0])

    def _offload_bytes(self, key: str, nbytes: float) -> bool:
        """:meth:`_offload` of ``nbytes`` saved as ``key`` (a storage or a :attr:`Node.external`)."""
        if not self._offloading or self.offload_min is None:
            return False
        entry = self.off.get(key)
        if entry is not None:
            entry.waiting += 1
            return True
        if nbytes < self.offload_min:
            return False
        entry = _Offloaded(key, nbytes, len(self.off_list))
        self.off[key] = entry
        self.off_list.append(entry)
        self.sim.host_alloc(nbytes)
        self.d2h += nbytes
        return True

    def _bring_back(self, entry: "_Offloaded") -> None:
        if entry.back is None and not entry.returned:
            entry.back = self.sim.alloc(entry.nbytes, "temporaries")
            self.h2d += entry.nbytes

    def _unpack(self, key: str) -> Optional[int]:
        """The backward takes ``key``'s device copy (brought back now unless prefetched), and
        the ``OFFLOAD_PREFETCH`` copies saved before it start their way back."""
        entry = self.off.get(key)
        if entry is None:
            return None
        self._bring_back(entry)
        ahead, j = 0, entry.index - 1
        while j >= 0 and ahead < OFFLOAD_PREFETCH:
            other = self.off_list[j]
            if other is not None:
                self._bring_back(other)
                ahead += 1
            j -= 1
        return entry.back

    def _unpack_held(self, keys: list[str]) -> tuple[list[int], float]:
        """A checkpointed segment's recompute unpacks the held inputs it saved to the host
        (``Segment.packed_inputs``), after its input. One copy serves every layer that saved it:
        the offloader keeps the device copy it brought back until the last of them has unpacked
        it. Returns the device copies that last unpack handed over (freed as the recompute ends)
        and their host bytes (freed as the segment's backward ends, with its saved inputs)."""
        returned: list[int] = []
        host = 0.0
        for key in keys:
            entry = self.off[key]
            back = self._unpack(key)
            entry.waiting -= 1
            if entry.waiting > 0:
                continue
            del self.off[key]
            self.off_list[entry.index] = None
            if back is not None:
                returned.append(back)
            host += entry.nbytes
        return returned, host

    def _function_returned(self, keys: list[str]) -> None:
        """The op's backward function has returned: the device copies it unpacked for the last
        time (its locals) are freed, while their host copies stay until autograd releases the
        op's saved variables (:meth:`_done_with`), as torch's engine does."""
        for key in set(keys):
            entry = self.off.get(key)
            if entry is not None and entry.waiting <= keys.count(key):
                self.sim.free(entry.back)
                entry.back = None
                entry.returned = True

    def _done_with(self, key: str) -> None:
        """One saved variable of ``key`` has run its backward: the last frees both copies."""
        entry = self.off.get(key)
        if entry is None:
            return
        entry.waiting -= 1
        if entry.waiting > 0:
            return
        self.sim.free(entry.back)
        self.sim.host_free(entry.nbytes)
        del self.off[key]
        self.off_list[entry.index] = None

    def _run_forward(self, nodes: list[Node], keep_saves: bool, tag_override: Optional[str],
                     keep_keys: set[str], later: Any) -> list[str]:
        """Allocate outputs, keep saved tensors, free the rest at last use; returns the keys held
        by autocast's cache (freed when the autocast region ends)."""
        last: dict[str, int] = {}
        for i, n in enumerate(nodes):
            for k in n.inputs:
                last[k] = i
        held: list[str] = []
        for i, n in enumerate(nodes):
            start = len(self.sim.events) if self.sim.events is not None else 0
            steps = list(n.fwd_steps)
            split = next((j for j, step in enumerate(steps) if step[0] == "outputs"), 0)
            scratch: dict[str, int] = {}
            self._scratch_steps(steps[:split], scratch, tag_override or n.tag)
            # Autograd packs the saves of what the op has made by then (``made_before_save``: the
            # CPU dropout's noise, an input of its product) before the rest of its outputs exist,
            # so an offloader's host copy of them is made first.
            early = [o for o in n.out if o[0] in n.made_before_save]
            self._alloc_outputs(n, early, tag_override)
            packed_early = [k for k in n.saves if k in n.made_before_save] if keep_saves else []
            self._keep_saves(packed_early)
            self._alloc_outputs(n, [o for o in n.out if o[0] not in n.made_before_save], tag_override)
            self._note_gemm(n, start)  # a recompute in backward runs on autograd's thread
            self.sim.transient(n.fwd_scratch, tag_override or n.tag)
            self._scratch_steps(steps[split:], scratch, tag_override or n.tag)
            for sid in scratch.values():
                self.sim.free(sid)
            if keep_saves:
                self._keep_saves([k for k in n.saves if k not in packed_early])
                for k, nbytes in n.external:
                    self._offload_bytes(k, nbytes)
            if n.hold:
                held.extend(o[0] for o in n.out)
            if n.name in self.after_forward:
                self.after_forward.pop(n.name)()
            for k in set(n.inputs) | {o[0] for o in n.out}:
                if (last.get(k, -1) > i or k in later or k in keep_keys or k in self.saved_refs or k in held
                        or k in self.pinned):
                    continue
                self.sim.free(self.store.pop(k, None))
        return held

    def _scratch_steps(self, steps: list[tuple[str, str, float]], scratch: dict[str, int], tag: str) -> None:
        """Run a node's ``fwd_steps`` (see :class:`Node`); ``scratch``: label -> live storage id."""
        for op, label, nbytes in steps:
            if op == "alloc" and nbytes > 0:
                scratch[label] = self.sim.alloc(nbytes, tag)
            elif op == "free":
                self.sim.free(scratch.pop(label, None))

    def _flush(self, held: list[str]) -> None:
        for k in held:
            if k not in self.saved_refs:
                self.sim.free(self.store.pop(k, None))

    # ---- backward
    def _grad_alloc(self, n: Node, key: str, nbytes: float, through: Optional[int]) -> None:
        sim = self.sim
        if key.startswith("param:"):
            name = key[6:]
            if name not in self.param_grad:
                return  # frozen parameter
            if name in self.deferred:
                # The tied weight's second gradient (the embedding's), made by the op; autograd
                # sums it with the buffered first one once the op has returned and dropped its
                # output's gradient (_sum_tied).
                self._late_tied.append((name, sim.alloc(nbytes, "temporaries")))
                return
            if name in self.param_grad_left:
                # A later Linear of the entry: its .grad is a new tensor, not added into the first's.
                self.param_grad_parts.setdefault(name, []).append(sim.alloc(nbytes, "gradients"))
                self._part_made(name, nbytes)
                return
            if name in self.param_grad_sid and name not in self.tied:
                self._added_into_grad(n, key, name, nbytes)
                return
            if name in self.tied:
                # A tied weight has two gradient edges: autograd buffers the first (the LM
                # head's; for the chunked loss, its grad_w itself) until the embedding's arrives.
                # A grad_w in another dtype than the weight (float32 next to bf16-pure weights)
                # is cast to the weight's dtype first (autograd's validate_outputs): the buffer
                # then holds that copy, and grad_w goes with the loss's saved tensors.
                src = n.grad_from.get(key)
                if src is not None and src in self.store and {o[0]: o[1] for o in n.out}.get(src) == self.param_grad[name]:
                    self.deferred[name] = src
                    self.saved_refs[src] = self.saved_refs.get(src, 0) + 1
                else:
                    self.deferred[name] = sim.alloc(self.param_grad[name] if src is not None else nbytes,
                                                    "temporaries")
                return
            src = n.grad_from.get(key)
            if src is not None and src in self.store and sim.live[self.store[src]][0] == self.param_grad[name]:
                # A gradient of the parameter's size and dtype that only the op's saves hold (the
                # chunked loss's grad_w): autograd releases the saves before AccumulateGrad runs,
                # which then steals the tensor as .grad. The storage changes roles; nothing is copied.
                sid = self.store.pop(src)
                self.saved_refs.pop(src, None)
                sim.retag(sid, "gradients")
                self.param_grad_sid[name] = sid
                return
            if n.param_share < 1.0:
                # The first Linear of the entry to run its backward makes only its own .grad.
                self.param_grad_sid[name] = sim.alloc(nbytes, "gradients")
                self.param_grad_left[name] = self.param_grad[name]
                self._part_made(name, nbytes)
                return
            self.param_grad_sid[name] = sim.alloc(self.param_grad[name], "gradients")
            return
        src = n.grad_from.get(key)
        if src is not None and src in self.store and key not in self.grad_sid:
            # A forward buffer handed on as this gradient: shared, freed with its last user.
            sid = self.store[src]
            self.saved_refs[src] = self.saved_refs.get(src, 0) + 1
            self.grad_sid[key] = sid
            self.grad_refs[sid] = self.grad_refs.get(sid, 0) + 1
            self._shared[sid] = src
            return
        if key in self.grad_sid:
            # A second gradient for the same tensor. autograd adds in place only where no Python
            # dispatch mode is on (at::isTensorSubclassLike); the meter, torch's MemTracker and
            # the trace are such modes, so the sum is a new tensor, made once this op has returned
            # and dropped its output's gradient and its saves (_sum_late). Counted as added in
            # place, a narrow MLP's gate_proj (whose input gradient meets up_proj's) was -0.7%
            # backward in float32.
            self._late_sums.append(sim.alloc(nbytes, "temporaries"))
            return
        if nbytes == 0 and through is not None:
            self.grad_sid[key] = through
            self.grad_refs[through] = self.grad_refs.get(through, 0) + 1
            return
        sid = sim.alloc(nbytes, "temporaries")
        self.grad_sid[key] = sid
        self.grad_refs[sid] = 1

    def _added_into_grad(self, n: Node, key: str, name: str, nbytes: float) -> None:
        """The op's gradient of parameter ``name``, whose .grad exists (gradient accumulation),
        added in place into it: a transient, unless the op hands on a tensor it holds (the
        chunked loss's grad_w), which is added as it is, or cast first when its dtype is not the
        weight's (float32 next to bf16-pure weights: a new tensor the weight's size)."""
        src = n.grad_from.get(key)
        if src is None:
            self.sim.transient(nbytes)
        elif src in self.store and self.sim.live[self.store[src]][0] != self.param_grad[name]:
            self.sim.transient(self.param_grad[name])

    def _drop_grad(self, key: str) -> None:
        if key not in self.grad_sid:
            return
        sid = self.grad_sid.pop(key)
        self.grad_refs[sid] -= 1
        if self.grad_refs[sid] <= 0:
            self.grad_refs.pop(sid)
            if sid in self._shared:
                self._release(self._shared.pop(sid))
            else:
                self.sim.free(sid)

    def _alloc_outputs(self, n: Node, outs: list[tuple], tag_override: Optional[str]) -> None:
        """Allocate ``outs`` (some of ``n.out``) in the forward, but those a selective
        checkpoint cached from the forward pass."""
        for o in outs:
            key, nbytes = o[0], o[1]
            if key in self.store:
                continue  # selective checkpointing: output cached from the forward pass
            tag = tag_override or (o[2] if len(o) > 2 else n.tag)
            self.store[key] = self.sim.alloc(nbytes, tag)

    def _keep_saves(self, keys: list[str]) -> None:
        """Autograd keeps ``keys`` (saved by one op) for the backward: copied to the host where
        an activation offloader takes them, else held on the device by one more saved reference."""
        for k in keys:
            if k in self.store and not self._offload(k):
                self.saved_refs[k] = self.saved_refs.get(k, 0) + 1

    def _backward_nodes(self, nodes: list[Node]) -> None:
        for n in reversed(nodes):
            keys = n.out_keys()
            has_grad = any(k in self.grad_sid for k in keys)
            offloaded = [k for k in [*n.saves, *(k for k, _ in n.external)] if k in self.off]
            for k in offloaded:
                self._unpack(k)
            composite = has_grad and n.releases_first is not None
            if composite:
                self._composite_backward(n, keys)
            elif has_grad or n.name == "loss":
                through = next((self.grad_sid[k] for k in keys if k in self.grad_sid), None)
                self.sim.transient(n.scratch_first)
                start = len(self.sim.events) if self.sim.events is not None else 0
                made = len(n.grads) - n.reduced_grads
                for key, nbytes in n.grads[:made]:
                    self._grad_alloc(n, key, nbytes, through)
                if made < len(n.grads):
                    self._function_returned(offloaded)
                for key, nbytes in n.grads[made:]:
                    self._grad_alloc(n, key, nbytes, through)
                if n.grads:
                    self._note_gemm(n, start)
                self.sim.transient(n.scratch)
                for k in keys:
                    self._drop_grad(k)
            for k in n.saves:
                if k in self.saved_refs and not (composite and k in (n.releases_first or ())):
                    self._release(k)
            for k in offloaded:
                self._done_with(k)
            if n.name == "loss":
                self.sim.free(self._loss_grad)
                self._loss_grad = None
            self._sum_late()
            self._sum_tied()

    def _part_made(self, name: str, nbytes: float) -> None:
        """One Linear of the fused entry ``name`` has made its ``nbytes`` of .grad: once all have
        (less than a byte left: the shares are fractions of the entry's size), none is pending."""
        left = self.param_grad_left[name] - nbytes
        if left < 1.0:
            del self.param_grad_left[name]
        else:
            self.param_grad_left[name] = left

    def param_grad_sids(self, name: str) -> list[int]:
        """The storages of parameter ``name``'s .grad made in this backward (none where they
        existed before it: gradient accumulation), every part's of a fused entry."""
        first = self.param_grad_sid.get(name, -1)
        return ([first] if first > 0 else []) + self.param_grad_parts.get(name, [])

    def pop_param_grads(self, name: str) -> list[int]:
        """:meth:`param_grad_sids`, forgotten here (the caller frees them)."""
        sids = self.param_grad_sids(name)
        self.param_grad_sid.pop(name, None)
        self.param_grad_parts.pop(name, None)
        return sids

    def _composite_backward(self, n: Node, keys: tuple[str, ...]) -> None:
        """:attr:`Node.releases_first`'s order: the incoming gradient and the named saves go,
        the scratch peaks, then the gradients are made."""
        for k in keys:
            self._drop_grad(k)
        for k in n.releases_first or ():
            if k in self.saved_refs:
                self._release(k)
        self.sim.transient(n.scratch)
        for key, nbytes in n.grads:
            self._grad_alloc(n, key, nbytes, None)

    def _sum_tied(self) -> None:
        """The tied weights' sums (see :meth:`_grad_alloc`): out of place; the sum becomes the
        .grad, or, where a .grad exists (a later micro-step of gradient accumulation), is added
        into it and freed. Then both edges' gradients are freed."""
        sim = self.sim
        for name, second in self._late_tied:
            if name in self.param_grad_sid:
                sim.transient(self.param_grad[name])
            else:
                self.param_grad_sid[name] = sim.alloc(self.param_grad[name], "gradients")
            sim.free(second)
            buffered = self.deferred.pop(name)
            if isinstance(buffered, str):
                self._release(buffered)
            else:
                sim.free(buffered)
        self._late_tied = []

    def _sum_late(self) -> None:
        """Out-of-place sums (:meth:`_grad_alloc`): the first gradient, the second
        and their sum live together; the sum then stands for the first."""
        for sid in self._late_sums:
            self.sim.transient(self.sim.live[sid][0])
            self.sim.free(sid)
        self._late_sums = []

    # ---- the step
    def forward(self) -> None:
        sim = self.sim
        last_seg: dict[str, int] = {}
        for idx, seg in enumerate(self.segments):
            for n in seg.nodes:
                for k in n.inputs:
                    last_seg[k] = idx
        held: list[str] = []
        lump = self.comp is not None and self.comp.lumps > 0
        self._offloading = True
        for idx, seg in enumerate(self.segments):
            if lump and idx == self.comp.fwd_segments.start:  # type: ignore[union-attr]  # self.comp is set when lump is true
                before, n_held, host_before = self._snapshot(), len(held), sim.host
            if idx in self.before_forward:
                self.before_forward[idx]()
            self._forward_segment(idx, seg, _Later(last_seg, idx), held)
            if lump and idx == self.comp.fwd_segments.stop - 1:  # type: ignore[union-attr]  # self.comp is set when lump is true
                self._lump_forward(before, held, n_held)
                # The lumped periods offload what the measured one did (freed in their backward).
                self.lump_host = self.comp.lumps * (sim.host - host_before)  # type: ignore[union-attr]  # as above
                sim.host_alloc(self.lump_host)
                self.d2h += self.lump_host
        self._offloading = False
        # Leaving autocast drops its weight cache: casts no op saved are freed now.
        self._flush(held)
        for sid in self.lump_flush:
            sim.free(sid)

    def _forward_segment(self, idx: int, seg: Segment, later: "_Later", held: list[str]) -> None:
        sim = self.sim
        sim.at("forward", seg.name)
        if seg.checkpoint == "none":
            held += self._run_forward(seg.nodes, True, None, set(), later)
            return
        # Checkpointed: nothing saved but the block input (held by the checkpoint) and, for
        # selective checkpointing, the matmul outputs (the RNG state it stores on CPU no meter
        # sees: estimate.training).
        if seg.records():
            if seg.input_key and seg.input_key in self.store and not self._offload(seg.input_key):
                self.saved_refs[seg.input_key] = self.saved_refs.get(seg.input_key, 0) + 1
            for k in seg.held_inputs:
                if k in self.store and not (k in seg.packed_inputs and self._offload(k)):
                    self.saved_refs[k] = self.saved_refs.get(k, 0) + 1
        keep = {k for n in seg.nodes for k in n.sac_kept()} if seg.checkpoint == "selective" else set()
        held += self._run_forward(seg.nodes, False, None, keep, later)

    def backward(self) -> None:
        self._in_backward = True
        # loss.backward() begins by allocating the loss's gradient: everything the forward left
        # is live in the backward phase before anything is freed (its peak under gradient
        # accumulation with the chunked loss, whose backward frees before it allocates).
        self.sim.at("backward", "loss backward")
        # The loss's gradient (autograd's 0-d float32 ones) lives until the first node's backward
        # (the node named "loss") has run.
        self._loss_grad = self.sim.alloc(LOSS_GRAD_BYTES, "temporaries")
        self.sim.count_live()
        lump = self.comp is not None and self.comp.lumps > 0
        for idx in range(len(self.segments) - 1, -1, -1):
            seg = self.segments[idx]
            if lump and idx == self.comp.bwd_segments.stop - 1:  # type: ignore[union-attr]  # self.comp is set when lump is true
                before = self._snapshot()
                excluded = self.lump_exclude() if self.lump_exclude is not None else {}
            self._backward_segment(seg)
            if idx in self.after_backward:
                self.after_backward[idx]()
            if lump and idx == self.comp.bwd_segments.start:  # type: ignore[union-attr]  # self.comp is set when lump is true
                self._lump_backward(before, excluded)
                self.sim.host_free(self.lump_host)
                self.h2d += self.lump_host
                self.lump_host = 0.0

    def _backward_segment(self, seg: Segment) -> None:
        sim = self.sim
        label = "loss backward" if seg.name == "head" else f"backward {seg.name}"
        nodes = seg.nodes
        back, ckpt_host = None, 0.0
        # Held inputs the forward copied to the host (checked before the recompute unpacks them).
        off_held = [k for k in seg.packed_inputs if k in self.off] if seg.checkpoint != "none" and seg.records() else []
        if seg.checkpoint != "none":
            # Recompute up to the last op whose tensors backward needs (non-reentrant
            # checkpoint stops there); the recomputed saves live until their op's backward.
            last_saver = max((i for i, n in enumerate(seg.nodes) if n.saves), default=-1)
            if seg.lazy_recompute:
                sim.at("backward", label)
                self._backward_nodes(seg.nodes[last_saver + 1:])
                nodes = seg.nodes[: last_saver + 1]
            sim.at("backward", f"recompute {seg.name}")
            back = self._unpack(seg.input_key) if seg.input_key and seg.records() else None
            if back is not None:
                # The recompute reads the input brought back; its own saves keep it from here on,
                # and the host copy goes when the checkpoint's saved inputs do (after its backward).
                key: str = seg.input_key  # type: ignore[assignment]  # set when back is
                entry = self.off.pop(key)
                self.off_list[entry.index] = None
                self.store[key] = back
                ckpt_host = entry.nbytes
            returned, held_host = self._unpack_held(off_held)
            ckpt_host += held_host
            # A tensor that an op past the stop would read (the base output and the input of a
            # LoRA Linear whose adapter is the last saver) lives until the recompute stops.
            recompute = list(seg.nodes[: last_saver + 1])
            stop = recompute[-1] if recompute else None
            if (seg.lazy_recompute and stop is not None and not stop.packs_after_forward
                    and not set(stop.saves) & {o[0] for o in stop.out}):
                # autograd saves an op's inputs before its kernel runs: the recompute stops
                # there, before the last saver's outputs exist.
                recompute[-1] = replace(stop, out=[], fwd_scratch=0.0, fwd_steps=(), hold=False)
            elif seg.lazy_recompute and stop is not None and stop.made_before_save:
                recompute[-1] = replace(stop, out=[o for o in stop.out if o[0] in stop.made_before_save],
                                        fwd_scratch=0.0, fwd_steps=(), hold=False)
            made = {o[0] for n in recompute for o in n.out}
            past_stop = {k for n in seg.nodes[last_saver + 1:] for k in n.inputs} & made
            held = self._run_forward(recompute, True, "temporaries", past_stop, set())
            self._flush(held + sorted(past_stop))
            # The checkpoint's unpack hook held the inputs it unpacked until the recompute ended.
            for sid in returned:
                sim.free(sid)
        sim.at("backward", label)
        self._backward_nodes(nodes)
        if seg.checkpoint != "none" and seg.records() and seg.input_key and seg.input_key in self.saved_refs:
            self._release(seg.input_key)
        if seg.checkpoint != "none" and seg.records():
            for k in seg.held_inputs:
                if k in self.saved_refs and k not in off_held:
                    self._release(k)
        if seg.checkpoint == "selective":
            self._free_unconsumed_kept(seg)
        if ckpt_host:
            sim.host_free(ckpt_host)

    def _free_unconsumed_kept(self, seg: Segment) -> None:
        """Selective checkpointing's kept outputs that the recompute never read: torch's SAC
        storage hands a cached output over (and drops it) only when the recompute replays its
        op, so one past the recompute's stop (a lazy recompute ends at the last op that saved
        something: a transformers layer's down_proj, or its adapter's lora_B, whose output only
        the residual add reads) stays in the checkpoint's frame, which goes with the segment's
        last saved tensor, as its backward ends. Without this it outlived the step (the optimizer
        step's peak of a one-layer Llama 5.5% over the trace)."""
        for k in {k for n in seg.nodes for k in n.sac_kept()}:
            if k in self.store and k not in self.saved_refs and k not in self.pinned:
                self.sim.free(self.store.pop(k))


@dataclass
class _Offloaded:
    """A saved storage copied to the host: its bytes, its place in the forward's order, the
    saved variables still to read it, and its device copy once brought back."""

    key: str
    nbytes: float
    index: int
    waiting: int = 1
    back: Optional[int] = None
    returned: bool = False  # its last reader's function has returned (its device copy freed)


class _Later:
    """``key in later``: the key is read by a segment after ``idx``."""

    __slots__ = ("last", "idx")

    def __init__(self, last: dict[str, int], idx: int) -> None:
        self.last, self.idx = last, idx

    def __contains__(self, key: str) -> bool:
        return self.last.get(key, -1) > self.idx


@dataclass
class Compression:
    """Which blocks the simulation runs when the model is deep (layer kinds, not layers).

    Block kinds repeat with a period ``P`` (1 without checkpointing or with full/selective;
    K for ``every:K``; round(sqrt(L)) for ``sqrt``). The simulation runs the first two periods,
    then stands ``lumps`` periods in as one allocation per category (what a period keeps after
    its forward; what it changes in backward, measured on the period right after the lump),
    then the last two periods plus the remainder. Exact, not an approximation: every lumped period
    is the same sequence of allocations as its simulated neighbours, its live total differs
    from theirs by a constant per period (forward: it only grows; backward: an affine function
    of the position), so the largest total over the lumped periods is reached at a simulated
    neighbour. ``real`` maps a simulated block to the model's block index (for labels).
    """

    period: int
    lumps: int
    blocks: int  # simulated blocks
    per_block: int = 1  # segments per block (3 under selective: before, attention core, after)

    def real(self, j: int) -> int:
        return j if j < 2 * self.period else j + self.lumps * self.period

    @property
    def fwd_segments(self) -> range:
        """Segment indices (embedding is 0) of the period whose forward is measured (period 1)."""
        w = self.period * self.per_block
        return range(1 + w, 1 + 2 * w)

    @property
    def bwd_segments(self) -> range:
        """Segment indices of the period right after the lump (measured in backward)."""
        w = self.period * self.per_block
        return range(1 + 2 * w, 1 + 3 * w)


def compression_of(cfg: RunConfig) -> Compression:
    policy = checkpoint_policy(cfg.technique.checkpointing)
    L = cfg.model.n_layers
    # The period of the block kinds: blocks i % K == 0 are checkpointed under every:K and sqrt.
    P = policy.period(L)
    # Two periods, the lumps, then the last two periods and the remainder. Two after the lump:
    # the backward's first period differs from every later one (FSDP2's first reduce-scatter
    # leaves its input buffer behind, the next ones only replace it), so the period whose
    # backward the lump repeats, and the one the lump's backward starts from, must be later ones.
    lumps = max(0, (L - 2 * P) // P - 2)
    return Compression(P, lumps, L - lumps * P, 3 if policy.kind == "selective" else 1)
