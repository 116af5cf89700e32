"""Whether a training step fits a GPU or a memory budget, without running it.

What a step needs of the budget:

* with CUDA kernels, what the card holds: the estimator's two-step timeline replayed through
  the caching-allocator model (its reserved segments, rounding and fragmentation included) plus
  the CUDA context of the GPU kind (:mod:`memtrain.analysis.allocator`: measured on an H100,
  an assumption elsewhere, said in ``assumptions``);
* with CPU kernels, the live tensor bytes (the tracked peak): a CPU has no caching allocator
  of its own in this model.

From that number: the verdict (fits, and the headroom), the largest batch that fits (the same
grow-then-bisect over the analytic estimate that starts ``memtrain maxbatch``'s search:
:func:`largest_batch`), and when the asked batch does not fit, the cheapest changes that make it
fit (``memtrain plan``'s search over technique sets and micro-batch splits,
:func:`memtrain.analysis.plan.plan`). Everything here is arithmetic: no torch import.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

from memtrain.analysis.advice import save_memory_clause, size_text
from memtrain.analysis.dips import bisect_fitting, climb_past_dips, grow_from, largest_fitting
from memtrain.analysis.estimate import Arch, Estimate, estimate
from memtrain.analysis.limits import MAX_WIDTH
from memtrain.analysis.plan import default_space, plan
from memtrain.config.run import ConfigError, ModelConfig, RunConfig
from memtrain.devices.gpu_memory import gpu_memory
from memtrain.devices.numerics import fewest_changes_first, numerics_note
from memtrain.models.spec import is_hf, rotary_positions

__all__ = ["ContextBound", "DEFAULT_LENGTH_MULTIPLE", "FitVerdict", "at_seq_len", "bisect_fitting", "budget_for",
           "context_bound", "context_line", "fit_verdict", "largest_batch", "largest_fitting", "largest_fitting_from",
           "largest_fitting_past_dips",
           "length_multiple", "length_search_bound", "less_need_clause", "longer_fits_mark", "longest_context", "past_the_bound",
           "step_need", "verdict_head"]

GiB = 1 << 30
DEFAULT_SEARCH_CAP = 4096  # the largest batch searched, as maxbatch's and plan's --max-batch default


def largest_fitting_from(fits: Callable[[int], bool], cap: int, start: int, start_fits: bool) -> Optional[int]:
    """The largest k in [1, cap] with ``fits(k)`` (fitting monotone), searched outward from a
    guess ``start`` whose answer ``start_fits`` is known: step away from it in doubling steps until
    the answer flips, then bisect. A guess off by a few costs a few probes, not a search from 1.
    None when not even 1 fits."""
    if start_fits:
        return grow_from(fits, start, cap)
    lo: Optional[int] = None  # fits
    hi, step = start, 1  # hi does not fit
    while lo is None:
        k = max(hi - step, 1)
        if fits(k):
            lo = k
        elif k == 1:
            return None
        else:
            hi, step = k, step * 2
    return bisect_fitting(fits, lo, hi)


def largest_fitting_past_dips(fits: Callable[[int], bool], cap: int, start: Optional[int] = None) -> Optional[int]:
    """The largest k in [1, cap] with ``fits(k)`` where fitting need not be monotone: a monotone
    search (outward from a guess ``start`` by :func:`largest_fitting_from`, else grow-then-bisect
    from 1), then :func:`climb_past_dips` past a spike up to DIP_WINDOW values wide. None when the
    monotone search finds nothing (not even 1 fits). ``fits`` should cache: the climb revisits."""
    if start:
        found = largest_fitting_from(fits, cap, start, fits(start))
    else:
        found = largest_fitting(fits, cap) if fits(1) else None
    return None if found is None else climb_past_dips(fits, found, cap)


def require_search_budget(device_type: str, budget_bytes: Optional[int], what: str) -> None:
    """A search off CUDA (the max batch, the longest context) has no device memory to fill: a
    budget is needed. Torch-free, so the command says it before the search's modules load (they
    took ~10 s to import before this line was said)."""
    if device_type != "cuda" and budget_bytes is None:
        raise ConfigError(f"on CPU {what} needs a budget; pass --memory-budget, e.g. 4GiB")


def check_batch_bounds(max_batch: Optional[int], multiple_of: int) -> int:
    """The batch search's upper bound (``max_batch``, default 4096), refusing a ``multiple_of``
    that leaves no batch to search; torch-free for the same reason as :func:`require_search_budget`."""
    limit = max_batch or 4096
    if multiple_of < 1:
        raise ConfigError(f"--multiple-of must be >= 1, got {multiple_of}")
    if multiple_of > limit:  # no batch to search: refused before any probe
        raise ConfigError(f"--multiple-of {multiple_of:,} is larger than the search's bound --max-batch {limit:,}; "
                          "lower --multiple-of or raise --max-batch")
    return limit


def largest_batch(need: Callable[[RunConfig], float], cfg: RunConfig, budget_bytes: float, multiple_of: int = 1,
                  cap: int = DEFAULT_SEARCH_CAP) -> Optional[int]:
    """The largest k <= ``cap`` whose batch ``k * multiple_of`` needs at most ``budget_bytes``
    (``need`` of the config at that batch), or None when not even one fits. A batch that fits
    above a spike of the modelled peak up to DIP_WINDOW batches wide is found."""

    @functools.cache  # each batch probed once: the climb below revisits the bisection's
    def fits(k: int) -> bool:
        return need(cfg.replace(batch_size=k * multiple_of)) <= budget_bytes

    # The modelled peak can dip as the batch grows (memtrain.analysis.dips): look past the bisection.
    return largest_fitting_past_dips(fits, cap)


# ---------------------------------------------------------------------------- the longest context
# The length search's default step: a multiple of the attention kernels' tiles (64 or 128 rows)
# and of tensor cores' 8/16, small enough that the answer is within 64 tokens of the memory's.
DEFAULT_LENGTH_MULTIPLE = 64


def length_multiple(cfg: RunConfig, multiple_of: Optional[int] = None) -> int:
    """The step of a length search: ``multiple_of`` when given, else the ``--window`` (a length
    below the window is no valid run, and a multiple of it keeps every band whole), else
    :data:`DEFAULT_LENGTH_MULTIPLE`."""
    if multiple_of is not None:
        if multiple_of < 1:
            raise ConfigError(f"--multiple-of must be >= 1, got {multiple_of}")
        return multiple_of
    return cfg.technique.window or DEFAULT_LENGTH_MULTIPLE


@dataclass(frozen=True)
class ContextBound:
    """How far a length search goes, and what its position table does on the way."""

    max_len: int  # the longest length searched
    grow_positions: bool  # each probe's max_seq_len is raised to its length (memtrain's check, our GPT's table)
    model_positions: Optional[int]  # the positions the model defines; None: our GPT's table follows the length
    note: str  # one sentence for the output: what bounds the search
    # How to search past the model's positions: a transformers model's rotary positions run there
    # (--max-len), our GPT's learned table takes more rows (--max-seq-len).
    beyond: str = "memtrain maxbatch --search seq-len --max-len N searches past them"

    def capped_note(self, length: int, past: Optional[PastBound] = None, peak: Optional[float] = None) -> str:
        """Why a search that found ``length`` == its bound stopped there. ``past``: the probe of
        the next length past the bound (:func:`past_the_bound`), which says whether the memory
        would have stopped it too; None where it could not be probed (then only the bound is said).
        ``peak``: ``length``'s need, to say so where the length past the bound needs less."""
        positions = self.model_positions is not None and length == self.model_positions == self.max_len
        if past is None:
            return (f"the search stopped at the model's {length:,} positions; {self.beyond}" if positions else
                    f"the search stopped at its upper bound, {length:,}: raise --max-len to search further")
        nxt, need, fits = past
        if fits:
            assert need is not None  # fitting takes a peak
            less = less_need_clause(length, peak, need)
            if positions:
                return (f"{length:,} is the model's position count, not the memory's limit: {nxt:,} fits too "
                        f"({size_text(need)}{less}); {self.beyond}")
            return (f"{length:,} is the search's upper bound, not the memory's: raise --max-len to search further "
                    f"({nxt:,} fits too: {size_text(need)}{less})")
        over = "runs out of device memory" if need is None else f"does not fit ({size_text(need)})"
        what = "the model's position count" if positions else "the search's upper bound"
        return f"{length:,} is {what} and the memory's limit too: {nxt:,} {over}"


# The probe of the length just past a search's bound: (that length, its step's need or peak in
# bytes, None where it ran out of device memory; whether it fits).
PastBound = tuple[int, Optional[float], bool]


def past_the_bound(cfg: RunConfig, bound: ContextBound, step: int, batch: int,
                   need: Callable[[RunConfig], Optional[float]], fits: Callable[[Optional[float]], bool]
                   ) -> Optional[PastBound]:
    """One probe of ``cfg`` one ``step`` past ``bound``, its position count raised with it (the
    memory a longer table or rotary positions there would take), so that a capped search says
    whether the memory would have stopped it too, as an uncapped one says of its next length.
    None where nothing can be built there (past :data:`MAX_WIDTH`) or the probe fails."""
    length = bound.max_len + step
    if length > MAX_WIDTH:
        return None
    try:
        peak = need(at_seq_len(cfg, length, dataclasses.replace(bound, grow_positions=True), batch))
    except Exception:  # noqa: BLE001 - a step that cannot be built there: the note says only what is known
        return None
    return length, peak, fits(peak)


def context_bound(cfg: RunConfig, max_len: Optional[int] = None) -> ContextBound:
    """The bound of a length search over ``cfg`` (``max_len``: ``--max-len``, None for the default).

    * memtrain's GPT with no ``--max-seq-len`` given: the learned position table is sized to each
      probed length (``max_seq_len`` = the length, at least the default 512, as ``train --seq-len
      N`` sizes it), so the table's bytes are counted at every length; the search goes up to
      ``max_len``, by default :data:`memtrain.analysis.limits.MAX_WIDTH` tokens.
    * ``--max-seq-len P`` given, a GPT preset or a transformers model: the model has P positions
      (a transformers config's ``max_position_embeddings``) and the search stops there by default.
      A transformers model with rotary positions may be searched beyond P (``max_len`` > P): the
      step builds and runs there, and the answer says that the model was not trained there.
      A learned table has no row beyond P: refused.
    """
    if max_len is not None and max_len < 1:
        raise ConfigError(f"--max-len must be >= 1, got {max_len}")
    if max_len is not None and max_len > MAX_WIDTH:
        raise ConfigError(f"--max-len {max_len:,} is beyond what memtrain builds or estimates (at most {MAX_WIDTH:,})")
    given = getattr(cfg, "given_settings", None) or frozenset()
    positions = cfg.model.max_seq_len
    if cfg.model.model is None and "max_seq_len" not in given:
        return ContextBound(max_len or MAX_WIDTH, True, None,
                            "the learned position table is sized to each probed length (--max-seq-len = the "
                            "length, at least 512, as train sizes it); --max-seq-len N fixes the table and bounds the search")
    hf = is_hf(cfg)
    name = "max_position_embeddings" if hf else "--max-seq-len"
    if max_len is not None and max_len < positions:
        return ContextBound(max_len, False, positions, f"searched up to --max-len {max_len:,} (the model's {name} is "
                                                       f"{positions:,})")
    if max_len is None or max_len == positions:
        beyond = ("memtrain maxbatch --search seq-len --max-len N searches past them where its positions are rotary"
                  if hf else "a larger --max-seq-len gives its learned position table more rows")
        return ContextBound(positions, False, positions, f"searched up to the model's {name} ({positions:,})", beyond)
    if not (hf and cfg.model.model is not None and rotary_positions(cfg.model.model)):
        raise ConfigError(f"--max-len {max_len:,} is beyond the model's {name} ({positions:,}) and its positions are a "
                          f"learned table with no row past it; lower --max-len to {positions:,}"
                          + ("" if hf else " or raise --max-seq-len"))
    return ContextBound(max_len, True, positions,
                        f"lengths beyond the model's max_position_embeddings ({positions:,}) are memory only: its rotary "
                        "positions run there but were not trained there (a config with RoPE scaling and a longer "
                        "max_position_embeddings, as Llama-3.1's 131,072, trains there at the same memory)")


# The position table memtrain's GPT gets without --max-seq-len, unless --seq-len is longer
# (cli.config_from_args, derive_max_seq_len).
_DEFAULT_POSITIONS = ModelConfig().max_seq_len


def at_seq_len(cfg: RunConfig, length: int, bound: ContextBound, batch: Optional[int] = None) -> RunConfig:
    """``cfg`` at sequence length ``length`` (and micro-batch ``batch``), its position count as
    ``bound`` says. Built with ``dataclasses.replace``: ``RunConfig.replace`` re-reads a
    ``--model``'s shape fields from the model, which would undo a count raised past it. The
    settings a command line named carry over (``defaults_note`` reads them)."""
    model = cfg.model
    if bound.grow_positions:
        # As the CLI derives --max-seq-len: the default table, grown to a longer --seq-len (sized
        # to the length itself, a length under the default's counted fewer rows than `estimate
        # --seq-len` at that length, and than train holds).
        floor = _DEFAULT_POSITIONS if bound.model_positions is None else bound.model_positions
        model = dataclasses.replace(model, max_seq_len=max(length, floor))
    train = dataclasses.replace(cfg.train, seq_len=length,
                                batch_size=cfg.train.batch_size if batch is None else batch)
    out = dataclasses.replace(cfg, model=model, train=train)
    given = getattr(cfg, "given_settings", None)
    if given is not None:
        out.given_settings = given  # type: ignore[attr-defined]  # read with getattr(..., None)
    return out


def length_search_bound(cfg: RunConfig, max_len: Optional[int] = None,
                        multiple_of: Optional[int] = None) -> tuple[int, ContextBound]:
    """(the step, the bound) of a length search (:func:`longest_context`, and ``maxbatch --search
    seq-len``: :mod:`memtrain.analysis.context`), refused where the step is longer than the
    bound: no length to search."""
    step = length_multiple(cfg, multiple_of)
    bound = context_bound(cfg, max_len)
    if step > bound.max_len and max_len is None and multiple_of is None and not cfg.technique.window:
        # A model whose positions are fewer than the default step (a toy model): search its own
        # lengths in eighths of them rather than refuse a flag nobody gave.
        return max(1, bound.max_len // 8), bound
    if step > bound.max_len and max_len is not None and multiple_of is None:
        # the --max-len given is the flag to change (estimate and plan have no --multiple-of)
        raise ConfigError(f"--max-len {max_len:,} is shorter than the longest context's step ({step:,} tokens): "
                          f"raise --max-len to at least {step:,}")
    if step > bound.max_len:
        raise ConfigError(f"--multiple-of {step:,} is longer than the longest length searched ({bound.max_len:,}); "
                          "lower --multiple-of or raise --max-len")
    return step, bound


def longest_context(need: Callable[[RunConfig], float], cfg: RunConfig, budget_bytes: float, batch: int,
                    multiple_of: Optional[int] = None, max_len: Optional[int] = None) -> dict[str, Any]:
    """The longest sequence length (a multiple of :func:`length_multiple`, at most the bound of
    :func:`context_bound`) whose step at micro-batch ``batch`` needs at most ``budget_bytes``
    (``need`` of the config at that length), by the grow-then-bisect of :func:`largest_fitting`,
    then :func:`climb_past_dips` (the caching-allocator model's need is not monotone in the length).

    The ``longest_context`` entry of ``estimate --json``'s ``fit`` and of ``plan --json``:
    ``seq_len`` (None: not even the shortest length fits), its ``peak_bytes``, the next length
    ``next_seq_len`` and its ``next_peak_bytes`` (None when the bound stopped the search,
    ``capped``), the ``batch_size``, ``multiple_of``, ``max_len`` and the bound's ``note``; when
    capped, ``capped_note`` and ``past_fits`` (whether the length past the bound fits: None where
    it could not be probed)."""
    step, bound = length_search_bound(cfg, max_len, multiple_of)
    cap = bound.max_len // step
    needs: dict[int, float] = {}

    def need_at(k: int) -> float:
        if k not in needs:
            needs[k] = need(at_seq_len(cfg, k * step, bound, batch))
        return needs[k]

    def fits(k: int) -> bool:
        return need_at(k) <= budget_bytes

    # The caching-allocator model's device total is not monotone in the length (its 2 MiB segment
    # rounding, best fit and the 1 MiB / 10 MiB pool thresholds): Llama-3-8B LoRA on an RTX 4090
    # needs less at 8,256 tokens than at 8,128. Look past the bisection, as the batch search does.
    found = largest_fitting_past_dips(fits, cap)
    nxt = None if found is None else (found + 1 if found < cap else None)
    past = past_the_bound(cfg, bound, step, batch, need, lambda p: p is not None and p <= budget_bytes) \
        if found == cap else None
    capped_note = bound.capped_note(found * step, past, need_at(found)) if found == cap else None
    return {"batch_size": batch, "seq_len": None if found is None else found * step,
            "peak_bytes": None if found is None else int(round(need_at(found))),
            "next_seq_len": None if nxt is None else nxt * step,
            "next_peak_bytes": None if nxt is None else int(round(need_at(nxt))),
            "shortest_peak_bytes": int(round(need_at(1))), "capped": found == cap,
            "multiple_of": step, "max_len": bound.max_len, "note": bound.note,
            "capped_note": capped_note,
            "past_fits": None if past is None else past[2]}


def less_need_clause(length: int, peak: Optional[float], past_need: float) -> str:
    """Where the length past a search's bound needs ``past_need``, less than ``length``'s ``peak``:
    a clause saying that a longer context needing less is the need's shape, not a slip ("" otherwise)."""
    if peak is None or past_need >= peak:
        return ""
    return (f"; less than {length:,}'s {size_text(peak)}: the caching-allocator model's need is not monotone in "
            "the length, its segments rounded to 2 MiB and reused best-fit")


def longer_fits_mark(capped: bool, past_fits: Optional[bool]) -> str:
    """"+" after a length the bound stopped, unless the probe past the bound did not fit either."""
    return "+" if capped and past_fits is not False else ""


def context_line(ctx: dict[str, Any]) -> str:
    """``longest context at batch B: N tokens`` with its peak and the next length's need."""
    head = f"longest context at batch {ctx['batch_size']}: "
    if ctx["seq_len"] is None:
        return head + (f"none: even {ctx['multiple_of']:,} tokens need {size_text(ctx['shortest_peak_bytes'])}")
    head += f"{ctx['seq_len']:,}{longer_fits_mark(ctx['capped'], ctx.get('past_fits'))} tokens (needs {size_text(ctx['peak_bytes'])}"
    if ctx["next_seq_len"] is not None:
        head += f"; {ctx['next_seq_len']:,} needs {size_text(ctx['next_peak_bytes'])}"
    return head + f"; lengths in multiples of {ctx['multiple_of']})"


def step_need(cfg: RunConfig, arch: Arch, device_type: str, gpu: Optional[str], world_size: int = 1,
              shard: Optional[str] = None) -> tuple[float, Estimate]:
    """(bytes the step needs of the budget, the estimate): on CUDA the modelled device total
    (reserved + CUDA context of ``gpu``'s kind, "default" when None), else the tracked peak."""
    if device_type == "cuda":
        est = estimate(cfg, arch, "cuda", world_size, shard, gpu=gpu or "default")
        assert est.device_memory is not None
        return float(est.device_memory["device_total"]), est
    est = estimate(cfg, arch, device_type, world_size, shard)
    return est.peak_bytes, est


def budget_for(budget_bytes: Optional[int], gpu: Optional[str]) -> Optional[tuple[int, str]]:
    """(budget, where it comes from): ``--budget`` when given, else the named card's memory;
    None when neither gives one (no budget, or a GPU name without a single memory figure)."""
    if budget_bytes is not None:
        if budget_bytes <= 0:
            raise ConfigError(f"--budget must be positive, e.g. 24GiB; got {budget_bytes} bytes")
        return budget_bytes, "--budget"
    return gpu_memory(gpu) if gpu else None


@dataclass
class FitVerdict:
    """The ``fit`` entry of ``memtrain estimate --json`` (``--budget`` or ``--gpu``)."""

    budget_bytes: int
    budget_source: str
    batch_size: int
    needed_bytes: int  # what is compared with the budget (see ``measure``)
    measure: str
    fits: bool
    headroom_bytes: int  # budget - needed; negative when it does not fit
    largest_batch: Optional[int]  # None: not even batch 1 fits
    largest_batch_capped: bool  # the search's upper bound, not the memory, stopped it
    suggestions: list[dict[str, Any]] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)
    # The longest sequence length whose step at the asked micro-batch fits (longest_context's
    # entry); None where it was not searched.
    longest_context: Optional[dict[str, Any]] = None
    # When no technique set or micro-batch split fits: what to change instead
    # (memtrain.analysis.advice: the model-state flags when the state alone is over the budget).
    advice: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        """One line: the verdict, the largest batch, and what to change when it does not fit."""
        head = verdict_head(self.fits, self.budget_bytes, self.needed_bytes, self.headroom_bytes)
        if self.largest_batch is None:
            head += "; not even batch 1 fits"
        else:
            head += f"; largest batch {self.largest_batch}" + ("+" if self.largest_batch_capped else "")
        if self.suggestions:
            head += f"; to fit batch {self.batch_size}: " + ", or ".join(
                f"{s['flags']} (est. {size_text(s['needed_bytes'])})" for s in self.suggestions)
        elif not self.fits:
            head += f"; no technique set or micro-batch split fits batch {self.batch_size}: {self.advice or 'lower --seq-len'}"
        return head


def verdict_head(fits: bool, budget_bytes: int, needed_bytes: int, headroom_bytes: int, qualifier: str = "") -> str:
    """A fit line's opening: "fits BUDGET with HEADROOM headroom", or "does not fit BUDGET: needs
    NEEDED (OVER over)"; ``qualifier`` follows the figure compared ("before the caching
    allocator's rounding" where it is a lower bound)."""
    after = f" {qualifier}" if qualifier else ""
    if fits:
        return f"fits {size_text(budget_bytes)} with {size_text(headroom_bytes)} headroom{after}"
    return f"does not fit {size_text(budget_bytes)}: needs {size_text(needed_bytes)}{after} ({size_text(-headroom_bytes)} over)"


def fit_verdict(cfg: RunConfig, arch: Arch, device_type: str, budget: tuple[int, str], gpu: Optional[str] = None,
                world_size: int = 1, shard: Optional[str] = None, n_suggestions: int = 3,
                max_len: Optional[int] = None) -> FitVerdict:
    """Does the step of ``cfg`` fit ``budget`` (bytes, its source)? See the module docstring.
    ``max_len`` (``--max-len``) bounds the longest context's search (:func:`context_bound`)."""
    budget_bytes, source = budget
    need, est = step_need(cfg, arch, device_type, gpu, world_size, shard)

    def need_of(c: RunConfig) -> float:
        return step_need(c, arch, device_type, gpu, world_size, shard)[0]

    cap = DEFAULT_SEARCH_CAP
    best = largest_batch(need_of, cfg, budget_bytes, cap=cap)
    fits = need <= budget_bytes
    suggestions: list[dict[str, Any]] = []
    advice = ""
    if not fits and world_size == 1:
        suggestions = cheapest_changes(cfg, arch, device_type, budget_bytes, gpu, n_suggestions)
        if not suggestions:
            advice = save_memory_clause(cfg, budget_bytes, device_type).text
    if device_type == "cuda":
        measure = "device total: the caching allocator's reserved memory + the CUDA context (nvidia-smi's view)"
        assumptions = list(est.device_memory["assumptions"]) if est.device_memory else []
    else:
        measure = "tracked peak: live tensor bytes (CPU kernels; no caching-allocator overhead modelled)"
        assumptions = []
    if source != "--budget":
        assumptions.append(f"budget: {source}")
    context = longest_context(need_of, cfg, budget_bytes, cfg.train.batch_size, max_len=max_len)
    return FitVerdict(budget_bytes=int(budget_bytes), budget_source=source, batch_size=cfg.train.batch_size,
                      needed_bytes=int(round(need)), measure=measure, fits=fits,
                      headroom_bytes=int(round(budget_bytes - need)), largest_batch=best,
                      largest_batch_capped=best == cap, suggestions=suggestions, assumptions=assumptions,
                      longest_context=context, advice=advice)


def cheapest_changes(cfg: RunConfig, arch: Arch, device_type: str, budget_bytes: int, gpu: Optional[str],
                     limit: int = 3) -> list[dict[str, Any]]:
    """Up to ``limit`` changes that make the asked batch (``batch_size x grad_accum``) fit, those
    that change the numerics least first (the standard ones), then by ``plan``'s modelled step time. Each: the flags to
    add (only those that differ from ``cfg``), the bytes it needs, its modelled time relative to
    plan's baseline and what it changes in the numerics. [] when nothing fits."""

    tech = cfg.technique
    space = default_space(cfg, device_type)
    for key, values in space.items():
        current = getattr(tech, key)
        if current not in values:
            space[key] = [current, *values]  # a change of one flag alone is a candidate too
    try:
        res = plan(cfg, budget_bytes, device_type, arch, margin=0.0, top=10**6, space=space,
                   gpu=(gpu or "default") if device_type == "cuda" else None)
    except ConfigError:  # nothing in the space fits
        return []
    current = {k: getattr(tech, k) for k in space}
    # plan's rule: the fewest numerics changes first, then the fastest, so that with no standard
    # choice the first suggestion adds no 8-bit optimizer state or pure BF16 weights the others do without.
    order = fewest_changes_first([{**current, **c.techniques} for c in res.candidates])
    ranked = [res.candidates[i] for i in order]
    out = []
    for c in ranked[:limit]:
        flags = [f"--{k.replace('_', '-')} {v}" for k, v in c.techniques.items() if v != current[k]]
        if c.batch_size != cfg.train.batch_size:
            flags.append(f"--batch-size {c.batch_size} --grad-accum {c.grad_accum}")
        out.append({"flags": " ".join(flags), "techniques": dict(c.techniques), "batch_size": c.batch_size,
                    "grad_accum": c.grad_accum, "needed_bytes": int(round(c.peak_bytes)),
                    "relative_time": c.relative_time, "numerics": numerics_note({**current, **c.techniques})})
    return out

