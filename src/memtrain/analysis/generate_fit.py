"""Whether ``memtrain generate`` fits a GPU or a memory budget, without running it.

``estimate --mode inference --new-tokens N --budget SIZE`` (or ``--gpu NAME``) answers a
sampler's questions: does this batch of prompts generate N tokens within the budget, how many
sequences would, and how many tokens this batch could generate. Everything comes from the
analytic generate estimate (:mod:`memtrain.analysis.estimate.generation`, checked against a
measured ``generate`` in the tests), so the searches cost milliseconds:

* what is compared: the live tensor bytes at generate's peak; with ``--gpu`` the card's CUDA
  context and cuBLAS workspace besides (:class:`memtrain.devices.gpu_kinds.AllocatorFacts`),
  a lower bound of what the card holds: the caching allocator's rounding, and the segments the
  cache's per-step ``torch.cat`` leaves behind, are not modelled for generate;
* the largest batch that fits (the grow-then-bisect of :func:`memtrain.analysis.fit.largest_fitting`);
* the most new tokens the asked batch fits, up to the model's positions (generate refuses more).

No torch import.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from memtrain.analysis.advice import size_text
from memtrain.analysis.estimate import Arch
from memtrain.analysis.estimate.inference import estimate_generate_run, generate_positions
from memtrain.analysis.fit import DEFAULT_SEARCH_CAP, largest_fitting, verdict_head
from memtrain.config.run import RunConfig
from memtrain.devices.gpu_kinds import allocator_facts

__all__ = ["GenerateFit", "MAX_NEW_TOKENS_SEARCHED", "generate_fit"]

# The most new tokens searched where the model's positions do not bound them (memtrain's GPT
# without --max-seq-len takes a position table as long as the run).
MAX_NEW_TOKENS_SEARCHED = 1 << 20


@dataclass
class GenerateFit:
    """The ``fit`` entry of ``memtrain estimate --mode inference --json`` (``--budget`` or ``--gpu``)."""

    budget_bytes: int
    budget_source: str
    batch_size: int
    new_tokens: int
    needed_bytes: int  # what is compared with the budget (see ``measure``)
    measure: str
    fits: bool
    headroom_bytes: int  # budget - needed; negative when it does not fit
    largest_batch: Optional[int]  # the most sequences that generate new_tokens; None: not even one
    largest_batch_capped: bool  # the search's upper bound, not the memory, stopped it
    most_new_tokens: Optional[int]  # the most tokens batch_size sequences generate; None: not even one
    most_new_tokens_bound: str  # what stops that search: "memory", "positions" or "search cap"
    # needed_bytes leaves the caching allocator out (--gpu): the card needs at least that much
    lower_bound: bool = False
    weights_bytes: int = 0  # the weights alone (what no batch or length change lowers)
    assumptions: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        """One line: the verdict, the largest batch and the most new tokens of the asked batch."""
        head = verdict_head(self.fits, self.budget_bytes, self.needed_bytes, self.headroom_bytes,
                            "before the caching allocator's rounding" if self.lower_bound else "")
        if self.largest_batch is None:
            head += f"; not even 1 sequence generates {self.new_tokens} tokens"
            if self.weights_bytes > self.budget_bytes:
                head += f": the weights alone are {size_text(self.weights_bytes)}"
        else:
            plus = "+" if self.largest_batch_capped else ""
            head += f"; largest batch {self.largest_batch}{plus} for {self.new_tokens} new tokens"
        if self.most_new_tokens is None:
            head += f"; batch {self.batch_size} cannot generate one token"
        else:
            bound = {"memory": "", "positions": ", as many as the model's positions allow",
                     "search cap": "+ (the search's cap)"}
            head += (f"; batch {self.batch_size} generates at most {self.most_new_tokens} new tokens"
                     f"{bound[self.most_new_tokens_bound]}")
        return head


def generate_fit(cfg: RunConfig, weights_dtype: str, arch: Optional[Arch], new_tokens: int,
                 budget: tuple[int, str], gpu: Optional[str] = None) -> GenerateFit:
    """Does ``memtrain generate`` of ``cfg`` (``--batch-size`` sequences of a ``--seq-len``
    prompt, ``new_tokens`` new tokens, weights in ``weights_dtype``; ``arch`` as
    :func:`~memtrain.analysis.estimate.inference.estimate_generate_run` takes it) fit ``budget``
    (bytes, its source)? ``gpu``: the card whose CUDA context and cuBLAS workspace are added."""
    budget_bytes, source = budget
    beside, measure, assumptions = 0, "live tensor bytes at generate's peak (what the memory meter counts)", []
    if gpu is not None:
        facts = allocator_facts(gpu)
        beside = facts.cuda_context_bytes + facts.cublas_workspace_bytes
        measure = ("live tensor bytes at generate's peak + the CUDA context and a cuBLAS workspace: a lower bound of "
                   "what the card holds (the caching allocator's rounding and the segments the growing cache leaves "
                   "are not modelled for generate)")
        measured = "measured" if facts.context_measured else "assumed"
        assumptions.append(f"CUDA context {size_text(facts.cuda_context_bytes)} ({measured} for {facts.label}), "
                           f"cuBLAS workspace {size_text(facts.cublas_workspace_bytes)}")
    if source != "--budget":
        assumptions.append(f"budget: {source}")
    batch = cfg.train.batch_size

    def need(b: int, n: int) -> float:
        return estimate_generate_run(cfg, weights_dtype, arch, n, b)["peak_bytes"] + beside

    asked = estimate_generate_run(cfg, weights_dtype, arch, new_tokens, batch)
    needed = asked["peak_bytes"] + beside
    cap = DEFAULT_SEARCH_CAP
    fits_one = need(1, new_tokens) <= budget_bytes
    best = largest_fitting(lambda b: need(b, new_tokens) <= budget_bytes, cap) if fits_one else None

    limit = generate_positions(cfg)
    top = MAX_NEW_TOKENS_SEARCHED if limit is None else min(limit - cfg.train.seq_len, MAX_NEW_TOKENS_SEARCHED)
    most: Optional[int] = None
    if top >= 1 and need(batch, 1) <= budget_bytes:
        most = largest_fitting(lambda n: need(batch, n) <= budget_bytes, top)
    if most is not None and most == top:
        bound = "positions" if limit is not None and top == limit - cfg.train.seq_len else "search cap"
    else:
        bound = "memory"
    return GenerateFit(budget_bytes=int(budget_bytes), budget_source=source, batch_size=batch, new_tokens=new_tokens,
                       needed_bytes=int(round(needed)), measure=measure, fits=needed <= budget_bytes,
                       headroom_bytes=int(round(budget_bytes - needed)), largest_batch=best,
                       largest_batch_capped=best == cap, most_new_tokens=most, most_new_tokens_bound=bound,
                       lower_bound=gpu is not None, weights_bytes=int(asked["bytes"]["weights"]),
                       assumptions=assumptions)
