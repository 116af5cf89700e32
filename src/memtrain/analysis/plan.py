"""``memtrain plan``: the fastest technique set whose training step fits a memory budget.

1. Enumerate technique sets: precision x attention x checkpointing x loss x optimizer, and for
   each the largest micro-batch (a divisor of the target batch, the rest made up by gradient
   accumulation) whose *estimated* peak, plus a safety margin, fits the budget
   (:func:`memtrain.analysis.estimate.estimate`).
2. Rank the sets that fit by a relative step-time model
   (:func:`memtrain.analysis.step_time.step_cost`).
3. Optionally verify the best one by training it for a few steps and comparing the tracked
   peak with the prediction: :func:`verify_config` is the run, :func:`verification` the
   comparison; ``memtrain plan --verify`` trains it through memtrain.training, so this search
   imports no training code (and no torch for memtrain's GPT).

The cost model (:mod:`memtrain.analysis.step_time`) is a model, not a measurement: its job is
to order candidates sensibly; use ``memtrain bench`` to time the ones that matter.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import shlex
from dataclasses import asdict, dataclass, field
from itertools import product
from typing import Any, Callable, Optional

from tqdm.auto import tqdm

from memtrain.analysis.advice import ADVICE_LORA_RANK, size_text
from memtrain.analysis.dips import bisect_fitting, climb_past_dips, largest_fitting
from memtrain.analysis.estimate import GPT2_ARCH, Arch, estimate
from memtrain.analysis.estimate.compile_budget import interpolated_budget
from memtrain.analysis.estimate.hf import hf_arch, modelled_arch, why_not_modelled
from memtrain.analysis.step_time import HOST_BANDWIDTH, offload_exposed_s, step_cost
from memtrain.config.run import ConfigError, RunConfig
from memtrain.config.train_flags import train_flags
from memtrain.devices.gpu_kinds import allocator_facts, has_fp8
from memtrain.models.spec import cost_arch, is_gpt_preset
from memtrain.runtime.extras import cpu_only_torch
from memtrain.runtime.notices import shows_progress
from memtrain.techniques.facts import (
    ADAMW_KERNELS,
    BF16_PURE_OPTIMS,
    precision_facts,
)

__all__ = ["Candidate", "PlanResult", "default_space", "plan", "verification", "verify_config"]


# --------------------------------------------------------------------------- enumeration
@dataclass
class Candidate:
    """One technique set at its micro-batch, with its prediction."""

    techniques: dict[str, Any]
    batch_size: int
    grad_accum: int
    peak_bytes: float
    peak_phase: str
    step_time_s: float
    relative_time: float = 1.0
    fits: bool = True
    # The `memtrain train` arguments that run this candidate: the planned config in full (model,
    # sequence length, LoRA, every flag given to plan), not only the technique choices.
    train_flags: list[str] = field(default_factory=list)

    def label(self) -> str:
        t = self.techniques
        parts = [t["precision"], f"attention {t['attention']}", f"checkpointing {t['checkpointing']}",
                 f"loss {t['loss']}", t["optim"]] + (["offload activations"] if t.get("offload_activations") else [])
        if t.get("compile_memory_budget") is not None:
            parts.append(f"compile budget {t['compile_memory_budget']:g} (interpolated)")
        return ", ".join(parts) + f", micro-batch {self.batch_size} x {self.grad_accum}"


@dataclass
class PlanResult:
    budget_bytes: int
    margin: float
    device_type: str
    target_batch: Optional[int]
    candidates: list[Candidate]
    evaluated: int
    baseline_step_time_s: float
    verified: Optional[dict[str, Any]] = None
    notes: list[str] = field(default_factory=list)
    # Why the other technique sets are not among ``candidates`` (:meth:`dropped`): the sets
    # that fit no micro-batch (each at micro-batch 1, its peak), how many fit but rank below
    # the shown ones, and the values the search left out on this device.
    unfit: list[Candidate] = field(default_factory=list)
    slower: int = 0
    unavailable: list[dict[str, Any]] = field(default_factory=list)

    def dropped(self) -> dict[str, Any]:
        """The sets not shown, grouped by what a user can do about each: ``does_not_fit`` (how
        many, and the closest one: its need with the margin and how far over the budget),
        ``unavailable`` (values the search leaves out on this device, and why) and ``slower``
        (sets that fit but rank below the shown ones)."""
        closest = min(self.unfit, key=lambda c: c.peak_bytes, default=None)
        no_fit: dict[str, Any] = {"count": len(self.unfit), "closest": None}
        if closest is not None:
            need = closest.peak_bytes * (1 + self.margin)
            no_fit["closest"] = {"techniques": dict(closest.techniques), "batch_size": closest.batch_size,
                                 "grad_accum": closest.grad_accum, "peak_bytes": int(round(closest.peak_bytes)),
                                 "need_bytes": int(round(need)), "over_bytes": int(round(need - self.budget_bytes)),
                                 "label": closest.label()}
        return {"does_not_fit": no_fit, "unavailable": self.unavailable,
                "slower": {"count": self.slower, "shown": len(self.candidates)}}

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for c in d["candidates"]:
            c["peak_bytes"] = int(round(c["peak_bytes"]))
            c["config_flags"] = shlex.join(c["train_flags"])
        del d["unfit"], d["slower"], d["unavailable"]  # summarized, not listed: one set per combination
        d["dropped"] = self.dropped()
        return d


def default_space(cfg: RunConfig, device_type: str, gpu: Optional[str] = None) -> dict[str, list[str]]:
    """The technique values ``plan`` tries by default on ``device_type``.

    Only choices that keep the training algorithm: the configured optimizer's family (on CPU
    the low-bit optimizers are left out: their torch.compile'd step takes minutes to build
    there), no sliding window (it changes the model), no fp16 (it needs loss scaling). fp8 only
    on CUDA for a ``gpu`` kind with FP8 tensor cores, and not under LoRA/QLoRA (it refuses them).
    """
    cpu = device_type == "cpu"
    optim = cfg.technique.optim
    if optim in ADAMW_KERNELS:
        # On CUDA the fused kernel, which plain adamw already is there (no flag to suggest for it).
        optims = [optim] if cpu else ["adamw" if optim == "adamw" else "adamw-fused", "adamw-8bit"]
    else:
        optims = [optim]
    lowbit = torchao_installed()
    if not lowbit:
        # torchao runs the 8-bit state and bf16-pure's stochastic rounding: without it neither runs.
        optims = [o for o in optims if o not in LOW_BIT_OPTIMS]
    attentions = ["math"] if (cpu and cfg.model.dropout > 0) else ["math", "sdpa"]
    if not cpu:
        attentions = ["sdpa", "math"]

    checkpointings = ["none", "selective", "every:2", "full"] if cfg.model.n_layers > 1 else ["none", "full"]
    if not is_gpt_preset(cfg.model.model):
        # Megatron's selective policy needs our GPT's attention seam (techniques/hf_mapping.py);
        # torch's selective-matmul runs on any model and is the fastest fitting choice on a
        # full Qwen2.5-0.5B fine-tune (docs/estimation.md, the planner's cost model). every:3,
        # every:4 and sqrt never were, and would double the search.
        checkpointings = [c if c != "selective" else "selective-matmul" for c in checkpointings]
    space: dict[str, list[Any]] = {
        "precision": ["fp32", "bf16"] if cpu else ["bf16", "tf32"] + (["bf16-pure"] if lowbit else []) + _fp8_choice(cfg, gpu),
        "attention": attentions,
        "checkpointing": checkpointings,
        "loss": ["standard", "chunked"],
        "optim": optims,
    }
    if not cpu:
        # Activation offloading, with each checkpointing choice: on a CPU the host is the device.
        space["offload_activations"] = [False, True]
    if cfg.technique.compile and is_gpt_preset(cfg.model.model):
        # With --compile, torch's activation memory budget is a knob between no checkpointing
        # and full: None is torch's default partition.
        space["compile_memory_budget"] = [None, *COMPILE_BUDGETS]
    return space


# The low-bit optimizers torchao provides (techniques/optim.py).
LOW_BIT_OPTIMS = ("adamw-8bit", "adamw-4bit")


def torchao_installed() -> bool:
    """Whether torchao can be imported, without importing it (and torch with it)."""
    return importlib.util.find_spec("torchao") is not None


def unavailable(cfg: RunConfig, device_type: str, gpu: Optional[str], space: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """The technique values :func:`default_space` leaves out on this device and are not in
    ``space`` (a --precisions etc. that names one searches it), each with the reason in words a
    user can act on, for plan's "not shown" section."""
    cpu = device_type == "cpu"
    tech = cfg.technique
    out: list[tuple[str, list[str], str]] = []
    if cpu:
        out.append(("precision", ["fp8"], "needs a CUDA GPU with FP8 tensor cores: --device-type cuda --gpu h100"))
    elif tech.lora_rank or tech.qlora:
        out.append(("precision", ["fp8"], "torchao's float8 training refuses LoRA/QLoRA"))
    elif not has_fp8(gpu):
        card = f"--gpu {gpu} has no FP8 tensor cores" if gpu and gpu != "default" else "no --gpu names the card"
        out.append(("precision", ["fp8"], f"needs FP8 tensor cores and {card}: --gpu h100, l4, ..."))
    if tech.optim in ADAMW_KERNELS:
        if cpu:
            out.append(("optim", list(LOW_BIT_OPTIMS), "their compiled step takes minutes to build on a CPU: "
                        "--optims adamw-8bit searches it"))
        elif not torchao_installed():
            out.append(("optim", list(LOW_BIT_OPTIMS), 'need torchao: pip install -e ".[lowbit]"'))
    if not cpu and not torchao_installed():
        out.append(("precision", ["bf16-pure"], 'needs torchao\'s stochastic-rounding AdamW: pip install -e ".[lowbit]"'))
    if cpu and cfg.model.dropout > 0:
        out.append(("attention", ["sdpa"], "with dropout a CPU runs it as math attention: --dropout 0 searches it"))
    if not is_gpt_preset(cfg.model.model) and cfg.model.n_layers > 1:
        out.append(("checkpointing", ["selective"], "Megatron's selective policy needs memtrain's GPT's attention"))
    kept = []
    for technique, values, why in out:
        left = [v for v in values if v not in space.get(technique, [])]
        if left:
            kept.append({"technique": technique, "values": left, "reason": why})
    return kept


def _fp8_choice(cfg: RunConfig, gpu: Optional[str]) -> list[str]:
    """["fp8"] where a CUDA plan's GPU kind has FP8 tensor cores and the run could take it."""
    tech = cfg.technique
    return ["fp8"] if has_fp8(gpu) and not (tech.lora_rank or tech.qlora) else []


# The budgets plan tries with --compile (torch.compile's activation_memory_budget).
COMPILE_BUDGETS = (0.75, 0.5, 0.25)


def _sets(space: dict[str, list[Any]]) -> list[dict[str, Any]]:
    keys = list(space)
    out = []
    for values in product(*(space[k] for k in keys)):
        t = dict(zip(keys, values))
        if t["precision"] == "bf16-pure" and t["optim"] not in BF16_PURE_OPTIMS:
            continue  # bf16-pure needs a stochastic-rounding optimizer (techniques/optim.py)
        if t.get("compile_memory_budget") is not None and t["checkpointing"] != "none":
            continue  # the budget is the knob between none and full; its model has no other end
        out.append(t)
    return out


def _divisors(n: int) -> list[int]:
    return sorted({d for i in range(1, int(math.isqrt(n)) + 1) if n % i == 0 for d in (i, n // i)}, reverse=True)


# A candidate is skipped without the allocator replay when its live tensor bytes exceed the
# limit by this factor (1%: far above any difference between the compressed and the full
# simulation, which tests hold equal).
PRUNE_SLACK = 1.01
# A traced candidate is skipped when the analytic estimate puts it this far over the limit: 5%,
# five times the analytic model's largest difference from the trace on the families it claims
# (tests/test_hf_estimate_grid.py).
TRACE_PRUNE_SLACK = 1.05
# plan --max-batch on a traced model: the traces at most (one candidate config each). A trace near the
# limit takes seconds, and a minute at a few thousand sequences under the chunked loss (its loop runs
# once per chunk), so tracing every set's bisection took over 13 minutes for tiny-llama under 8 GiB.
MAX_BATCH_TRACES = 8


def _short_label(c: RunConfig) -> str:
    """A candidate in a few words, for the progress bar."""
    t = c.technique
    return (f"{t.precision} {t.attention} ckpt {t.checkpointing} {t.loss} {t.optim} "
            f"{c.train.batch_size}x{c.train.grad_accum}")


def _smallest_option(
    options: list[tuple[dict[str, str], RunConfig]],
    quick_peak: Callable[[RunConfig], Optional[tuple[float, str, float]]],
    exact_peak: Callable[[RunConfig], float],
    accum: int,
) -> tuple[float, dict[str, str], int, int]:
    """The option with the smallest exact peak (replayed or traced), the first of ``options``
    on a tie (the search's own order), found without computing every option's: in the order of
    their quick figures, each exact peak is computed until the next quick figure, divided by its
    slack, exceeds the smallest found (an exact peak is at least that). An option without a
    quick figure is always computed. A Llama-3-8B full fine-tune on CPU kernels at 24 GiB, where
    nothing fits, took over ten minutes when every option was traced."""
    quick = [quick_peak(c) for _, c in options]

    def rank(i: int) -> tuple[bool, float, int]:
        q = quick[i]
        return q is not None, q[0] if q is not None else 0.0, i

    order = sorted(range(len(options)), key=rank)
    best: Optional[tuple[float, int]] = None  # (exact peak, position in options)
    for i in order:
        q = quick[i]
        if best is not None and q is not None and q[0] / q[2] > best[0]:
            break  # sorted: every later option's quick figure is larger still
        candidate = (exact_peak(options[i][1]), i)
        best = candidate if best is None or candidate < best else best
    assert best is not None
    return best[0], options[best[1]][0], 1, accum


def plan(
    cfg: RunConfig,
    budget_bytes: int,
    device_type: str = "cpu",
    arch: Optional[Arch] = GPT2_ARCH,
    max_batch: bool = False,
    margin: float = 0.10,
    top: int = 5,
    space: Optional[dict[str, list[str]]] = None,
    max_batch_limit: int = 4096,
    gpu: Optional[str] = None,
    host_bandwidth: Optional[float] = None,
    progress: Optional[bool] = False,
    max_traces: int = MAX_BATCH_TRACES,
    _prune: bool = True,
) -> PlanResult:
    """Rank technique sets that fit ``budget_bytes`` (with ``margin`` of safety) by modelled
    step time. The target batch is ``cfg.train.batch_size x cfg.train.grad_accum`` sequences;
    with ``max_batch`` each set instead gets the largest batch that fits and sets are ranked
    by modelled time per token. ``gpu`` (CUDA, analytic models): a candidate's peak is what the
    card holds, the caching-allocator model's reserved memory plus that GPU kind's CUDA context
    (:mod:`memtrain.analysis.allocator`), instead of the live tensor bytes. ``host_bandwidth``
    (bytes/s each way, default :data:`HOST_BANDWIDTH`) costs --offload-activations' copies
    (:func:`offload_exposed_s`). ``max_traces`` (``max_batch`` on a traced model): at most that many
    candidate configs traced (:func:`_fit_max_batch`). ``progress``: a bar on stderr counting the slow calls (a trace
    takes seconds at full size, an allocator replay a tenth of one); None: only on a terminal
    (:func:`memtrain.runtime.notices.shows_progress`).

    With ``gpu``, a candidate whose live tensor bytes (the compressed analytic estimate,
    milliseconds) plus the CUDA context and a cuBLAS workspace exceed the limit is not replayed
    through the allocator model (a tenth of a second at 32 layers): what the card holds is at
    least that. A traced transformers candidate (CPU kernels) of a family the analytic model
    claims is not traced when that model puts it far over the limit (``_prune=False``: every
    candidate replayed or traced). When nothing fits, the smallest option it reports is a
    replayed or traced peak all the same: the candidates at micro-batch 1 are replayed or traced
    in the order of those quick figures until the next one's quick figure exceeds the smallest
    peak found (:func:`_smallest_option`)."""
    if budget_bytes <= 0:
        raise ConfigError("--budget must be positive, e.g. 24GiB")
    traced = arch is None  # a transformers --model: each candidate's peak is traced, not modelled
    notes: list[str] = []
    if arch is None:
        arch, traced, why = _transformers_arch(cfg, device_type)
        notes += [why] if why else []
    assert arch is not None
    if not 0 <= margin < 1:
        raise ConfigError(f"--margin must be in [0, 1), got {margin}")
    space = space or default_space(cfg, device_type, gpu)
    sets = _sets(space)
    target = cfg.train.batch_size * cfg.train.grad_accum
    limit = budget_bytes / (1 + margin)
    base_cfg = cfg.replace(precision="fp32", attention="math", checkpointing="none", loss="standard",
                           window=None, batch_size=target, grad_accum=1)
    baseline, _ = step_cost(base_cfg, device_type, arch)
    search = _Search(cfg, arch, device_type, gpu, traced, limit, host_bandwidth, progress, _prune)
    with search.bar:  # closed however the search ends (an answer, nothing fits, Ctrl-C)
        search.count_beside_tensors()
        if not max_batch:
            fits, unfit, visited, smallest, order = _fit_target_batch(search, sets, target, top, baseline)
        else:
            fits, unfit, visited, smallest = _fit_max_batch(search, sets, max_batch_limit, max_traces)
            order = sets
        fits = _ranked(fits, max_batch)
        ranked = len(fits)
        fits = _without_idle_offload(fits)
        # Slower than the shown: the sets the branch and bound never reached (their lower bound is
        # above the top's), the offload twins that only add copies, and those ranked below the top.
        slower = (len(sets) - visited) + (ranked - len(fits)) + max(0, len(fits) - top)
        if not fits:
            _refuse_nothing_fits(search, order, smallest, 1 if max_batch else target, budget_bytes, margin)
        for cand in fits[:top]:
            cand.train_flags = train_flags(command_config(cfg, cand, device_type))
        notes = _notes(search, space, notes)
        return PlanResult(budget_bytes, margin, device_type, None if max_batch else target, fits[:top],
                          search.evaluated, baseline, notes=notes, unfit=unfit, slower=slower,
                          unavailable=unavailable(cfg, device_type, gpu, space))


class _Search:
    """What plan's steps share: the run planned, how a candidate's peak and step time are found
    (estimated, replayed through the allocator model or traced; one estimate or trace per
    candidate config), the progress bar, and what the search has counted."""

    def __init__(self, cfg: RunConfig, arch: Arch, device_type: str, gpu: Optional[str], traced: bool, limit: float,
                 host_bandwidth: Optional[float], progress: Optional[bool], prune: bool) -> None:
        self.cfg, self.arch, self.device_type, self.gpu = cfg, arch, device_type, gpu
        self.traced, self.limit, self.prune = traced, limit, prune
        self.link = host_bandwidth or HOST_BANDWIDTH[device_type]
        # One estimate (or trace) per candidate config: the peak search and an offload candidate's
        # bytes moved read the same step, which costs the most of a plan (a trace: seconds).
        self.steps: dict[str, Any] = {}
        self.replay = gpu is not None and device_type == "cuda" and not traced
        slow = traced or self.replay
        self.bar = tqdm(desc="plan", unit="trace" if traced else "replay", leave=False, dynamic_ncols=True,
                        disable=not (slow and shows_progress(progress)))
        self.beside_tensors = 0
        self.evaluated = 0
        self.pruned = False
        self.modelled_inside = 0  # traced plans: candidates whose peak is the analytic model's (far inside the limit)
        self.trace_capped = 0  # plan --max-batch, traced: sets whose batch the trace cap left below their largest
        self.raise_cut = False  # the set being raised met the trace cap

    def count_beside_tensors(self) -> None:
        """What the card holds besides the live tensors, for certain: its CUDA context and the first
        cuBLAS workspace (the allocator model allocates both; its reserved memory rounds up)."""
        facts = allocator_facts(self.gpu) if self.replay else None
        self.beside_tensors = facts.cuda_context_bytes + facts.cublas_workspace_bytes if facts is not None else 0

    def at(self, t: dict[str, str], micro: int, accum: int) -> RunConfig:
        return self.cfg.replace(**t, batch_size=micro, grad_accum=accum)

    def cost_of(self, c: RunConfig) -> float:
        """The modelled step time, with the copies of --offload-activations compute does not hide."""
        cost, detail = step_cost(c, self.device_type, self.arch)
        if c.technique.offload_activations:
            d2h, h2d = self.transfer(c)
            cost += offload_exposed_s(d2h, h2d, detail["compute_s"], self.link)
        return cost

    def step_of(self, c: RunConfig) -> Any:
        """The Estimate of ``c`` (analytic models), or its trace_any_depth dict (``traced``)."""
        key = _config_key(c)
        if key not in self.steps:
            self.bar.set_postfix_str(_short_label(c), refresh=False)
            self.bar.update(1)
            if self.traced:
                # The torch line, crossed for a transformers model only: its candidates are traced.
                from memtrain.analysis.depth_trace import trace_any_depth

                self.steps[key] = trace_any_depth(c, self.device_type)  # 2 + 3 layers extended to the depth when exact
            else:
                self.steps[key] = estimate(c, self.arch, self.device_type,
                                           gpu=self.gpu if self.device_type == "cuda" else None)
        return self.steps[key]

    @property
    def traces(self) -> int:
        """How many candidate configs were traced (0 for the analytic models)."""
        return len(self.steps) if self.traced else 0

    def surely_fits(self, c: RunConfig) -> Optional[bool]:
        """Without a trace: True where the quick figure puts ``c`` inside the limit whatever the
        trace would add, False where far over it, None where only a trace can tell."""
        quick = self.quick_peak(c)
        if quick is None:
            return None
        if quick[0] * quick[2] <= self.limit:
            return True
        return False if quick[0] > self.limit * quick[2] else None

    def transfer(self, c: RunConfig) -> tuple[float, float]:
        """Bytes --offload-activations copies each way in one step (estimated or traced)."""
        if self.traced:
            moved = self.step_of(c).get("offload") or {}
            return float(moved.get("d2h_bytes", 0)), float(moved.get("h2d_bytes", 0))
        off = self.step_of(c).offload or {}
        return off.get("d2h_bytes_per_step", 0.0), off.get("h2d_bytes_per_step", 0.0)

    def quick_peak(self, c: RunConfig) -> Optional[tuple[float, str, float]]:
        """A figure that takes milliseconds where the exact peak takes long, with its slack
        (the exact peak is at least the figure / slack), or None where there is none.
        With --gpu: the live tensors plus the CUDA context and a cuBLAS workspace, a lower bound
        of what the card holds (the slack covers rounding between the compressed and the full
        simulation). Traced, for a family the analytic model claims: that model's peak (within
        1% of the trace on the forward and backward peaks; below it in a compiled optimizer step)."""
        if c.technique.compile_memory_budget is not None:
            return None
        if self.replay:
            e = estimate(c, self.arch, self.device_type)
            return e.peak_bytes + self.beside_tensors, e.peak_phase, PRUNE_SLACK
        modelled = modelled_arch(c, self.device_type) if self.traced else None
        if modelled is not None:
            e = estimate(c, modelled, self.device_type)
            return e.peak_bytes, e.peak_phase, TRACE_PRUNE_SLACK
        return None

    def peak(self, c: RunConfig, exact: bool = False) -> tuple[float, str]:
        """``c``'s peak: replayed, traced or estimated; with the shortcut (``prune`` and not
        ``exact``), the quick figure where it puts ``c`` far over the limit."""
        self.evaluated += 1
        if self.prune and not exact:
            quick = self.quick_peak(c)
            if quick is not None and quick[0] > self.limit * quick[2]:
                self.pruned = True
                return quick[0], quick[1]
            if quick is not None and self.traced and quick[0] * quick[2] <= self.limit:
                # Traced, quick_peak is the analytic model of a family it claims, within 1% of
                # the trace both ways: 5% inside the limit fits whatever the trace would add.
                # Only candidates near the limit are decided by a trace (seconds each).
                self.modelled_inside += 1
                return quick[0], quick[1]
        if self.traced:
            r = self.step_of(c)
            return float(r["peak_bytes"]), str(r["peak_phase"])
        if c.technique.compile_memory_budget is not None:
            entry = interpolated_budget(c, self.arch, self.device_type,
                                        gpu=self.gpu if self.device_type == "cuda" else None)
            assert entry is not None and entry["peak_bytes"] is not None  # checkpointing none (_sets)
            return float(entry.get("device_total", entry["peak_bytes"])), "interpolated"
        e = self.step_of(c)
        if e.device_memory:
            return float(e.device_memory["device_total"]), e.peak_phase
        return e.peak_bytes, e.peak_phase


# A set that fits no micro-batch: (its smallest peak, its techniques, micro-batch, accumulation).
_Smallest = tuple[float, dict[str, str], int, int]


def _fit_target_batch(search: _Search, sets: list[dict[str, Any]], target: int, top: int, baseline: float,
                      ) -> tuple[list[Candidate], list[Candidate], int, Optional[_Smallest], list[dict[str, Any]]]:
    """Each set at the largest micro-batch that fits the target batch (``target`` sequences a step):
    the sets that fit, those that fit no micro-batch (at micro-batch 1), how many sets were
    visited, the smallest option found, and the sets in the order the search visits them."""
    fits: list[Candidate] = []
    unfit: list[Candidate] = []  # each set that fits no micro-batch, at micro-batch 1
    visited = 0
    smallest: Optional[_Smallest] = None
    micros = _divisors(target)
    at, peak, limit = search.at, search.peak, search.limit
    # Branch and bound: a set's cost at the full micro-batch is a lower bound of its cost.
    bounds = sorted(((step_cost(at(t, target, 1), search.device_type, search.arch)[0], i) for i, t in enumerate(sets)))
    for bound, i in bounds:
        if len(fits) >= top and bound > sorted(c.step_time_s for c in fits)[top - 1]:
            break
        visited += 1
        t = sets[i]
        # The largest micro-batch that fits (peak grows with the micro-batch): bisect.
        lo, hi, best = 0, len(micros) - 1, None
        at_one: Optional[float] = None  # the peak at micro-batch 1, where it was found

        @functools.cache  # by index in micros; each modelled once: the climb revisits the bisection's
        def micro_peak(j: int, t: dict[str, Any] = t) -> tuple[float, str]:
            return peak(at(t, micros[j], target // micros[j]))

        while lo <= hi:
            mid = (lo + hi) // 2
            p, ph = micro_peak(mid)
            if p <= limit:
                best, hi = (micros[mid], p, ph), mid - 1
            else:
                lo = mid + 1
                if micros[mid] == 1:
                    at_one = p
                    if smallest is None or p < smallest[0]:
                        smallest = (p, t, 1, target)
        if best is None:
            if smallest is None or micros[-1] != 1:
                p, _ = peak(at(t, micros[-1], target // micros[-1]))
                if smallest is None or p < smallest[0]:
                    smallest = (p, t, micros[-1], target // micros[-1])
            unfit.append(Candidate(dict(t), 1, target, at_one if at_one is not None else p, "", 0.0, fits=False))
            continue
        # The allocator model's peak can fall as the micro-batch grows (memtrain.analysis.dips):
        # the next few larger divisors are looked at too. micros runs from the largest down.
        position = climb_past_dips(lambda k: micro_peak(len(micros) - k)[0] <= limit,
                                   len(micros) - micros.index(best[0]), len(micros))
        micro = micros[len(micros) - position]
        p, ph = micro_peak(len(micros) - position)
        c = at(t, micro, target // micro)
        cost = search.cost_of(c)
        fits.append(Candidate(dict(t), micro, target // micro, p, ph, cost, cost / baseline))
    return fits, unfit, visited, smallest, [sets[i] for _, i in bounds]


def _fit_max_batch(search: _Search, sets: list[dict[str, Any]], max_batch_limit: int,
                   max_traces: int = MAX_BATCH_TRACES,
                   ) -> tuple[list[Candidate], list[Candidate], int, Optional[_Smallest]]:
    """Each set at the largest batch that fits (micro-batch = batch, no accumulation, at most
    ``max_batch_limit``): the sets that fit, those that fit not even batch 1, how many sets were
    visited, and the smallest option found.

    Traced (a transformers model), at most ``max_traces`` candidates are traced: first each set's
    batch is the largest the quick figure (the analytic model of its layers) says fits whatever the
    trace adds, tracing only where there is no such figure; then the fastest sets, in their order,
    are raised by bisecting with traces up to the batch the quick figure puts far over the limit,
    until the traces are spent. A set left at its first batch fits (within 5% of the largest)."""
    fits: list[Candidate] = []
    unfit: list[Candidate] = []  # each set that fits no micro-batch, at micro-batch 1
    visited = 0
    smallest: Optional[_Smallest] = None
    at, peak, limit = search.at, search.peak, search.limit
    capped = search.traced
    raise_to: list[Callable[[], tuple[int, float, str]]] = []  # per fitting set: its traced bisection
    for t in sets:
        @functools.cache  # each batch modelled once: the climb revisits the bisection's
        def peak_at(b: int, t: dict[str, Any] = t) -> tuple[float, str]:
            return peak(at(t, b, 1))

        def batch_fits(b: int) -> bool:
            return peak_at(b)[0] <= limit

        def untraced_fits(b: int, t: dict[str, Any] = t) -> bool:
            """The quick figure's answer; a trace only where there is none and traces are left."""
            c = at(t, b, 1)
            if search.quick_peak(c) is None:  # a family the analytic model does not claim: only traces tell
                return search.traces < max_traces and batch_fits(b)
            return search.surely_fits(c) is True  # near the limit: left to _traced_raise

        p, ph = peak_at(1)
        visited += 1
        if p > limit:
            if smallest is None or p < smallest[0]:
                smallest = (p, t, 1, 1)
            unfit.append(Candidate(dict(t), 1, 1, p, ph, 0.0, fits=False))
            continue

        if capped:
            # A tensor trace's peak (live bytes) grows with the batch: no dips to climb past.
            b = largest_fitting(untraced_fits, max_batch_limit)
        else:
            # Grow by doubling, then bisect; then look past a spike of the modelled peak (the
            # allocator model's total can fall as the batch grows: memtrain.analysis.dips).
            b = climb_past_dips(batch_fits, largest_fitting(batch_fits, max_batch_limit), max_batch_limit)
        p, ph = peak_at(b)
        fits.append(_at_max_batch(search, t, b, p, ph))
        if capped:
            raise_to.append(functools.partial(_traced_raise, search, t, b, max_batch_limit, max_traces, peak_at))
    if capped:
        _raise_fastest(search, fits, raise_to, max_traces)
    return fits, unfit, visited, smallest


def _at_max_batch(search: _Search, t: dict[str, Any], b: int, p: float, ph: str) -> Candidate:
    """Set ``t`` at batch ``b`` (peak ``p`` in phase ``ph``), costed per token."""
    cost = search.cost_of(search.at(t, b, 1))
    return Candidate(dict(t), b, 1, p, ph, cost / (b * search.cfg.train.seq_len), 1.0)


def _traced_raise(search: _Search, t: dict[str, Any], found: int, cap: int, max_traces: int,
                  peak_at: Callable[[int], tuple[float, str]]) -> tuple[int, float, str]:
    """Set ``t``'s batch ``found`` (it fits) raised with traces while traces are left, below the
    first batch the quick figure puts far over the limit; with its peak. As maxbatch's traced
    search: the quick figure's own answer and the batch above it are traced first (two traces
    where the figure is right, within 1% of the trace on the families it claims), then bisected."""
    def traced_fits(b: int) -> bool:
        if search.traces >= max_traces:
            search.raise_cut = True  # the cap, not the memory, stopped this raise
            return False
        return peak_at(b)[0] <= search.limit

    def not_far_over(b: int) -> bool:
        return search.surely_fits(search.at(t, b, 1)) is not False

    def modelled_fits(b: int) -> bool:
        quick = search.quick_peak(search.at(t, b, 1))
        return quick is not None and quick[0] <= search.limit

    top = largest_fitting(not_far_over, cap)  # milliseconds: the quick figure only; top + 1 is far over (or the cap's)
    guess = min(max(largest_fitting(modelled_fits, cap), found), top)
    if guess > found and not traced_fits(guess):
        b = bisect_fitting(traced_fits, found, guess)
    elif guess >= top or not traced_fits(guess + 1):
        b = guess
    else:
        b = bisect_fitting(traced_fits, guess + 1, top + 1)
    return (b, *peak_at(b))


def _raise_fastest(search: _Search, fits: list[Candidate], raise_to: list[Callable[[], tuple[int, float, str]]],
                   max_traces: int) -> None:
    """The fitting sets, fastest first, raised by :func:`_traced_raise` until the traces are spent;
    those left count in ``search.trace_capped``."""
    order = sorted(range(len(fits)), key=lambda i: (fits[i].step_time_s, -fits[i].batch_size))
    for i in order:
        if search.traces >= max_traces:
            search.trace_capped += 1
            continue
        search.raise_cut = False
        b, p, ph = raise_to[i]()
        fits[i] = _at_max_batch(search, fits[i].techniques, b, p, ph)
        search.trace_capped += search.raise_cut


def _ranked(fits: list[Candidate], max_batch: bool) -> list[Candidate]:
    """The sets that fit, fastest first (``fits``, sorted in place). At the target batch: by
    modelled step time; with ``max_batch``: by modelled time per token, the larger batch first on a
    tie, each timed relative to the fastest."""
    if not max_batch:
        # Equal modelled times (the CPU cost model times eager and SDPA attention alike) go to
        # the smaller peak: the candidates' order alone recommended math attention at 25% more.
        fits.sort(key=lambda c: (c.step_time_s, c.peak_bytes))
        return fits
    fits.sort(key=lambda c: (c.step_time_s, -c.batch_size, c.peak_bytes))
    if fits:
        best_rate = fits[0].step_time_s
        for cand in fits:
            cand.relative_time = cand.step_time_s / best_rate
    return fits


def _refuse_nothing_fits(search: _Search, order: list[dict[str, Any]], smallest: Optional[_Smallest], accum: int,
                         budget_bytes: int, margin: float) -> None:
    """The ConfigError when no set fits: the smallest option's need (a replayed or traced peak,
    never a quick figure), what to change, and the same option with LoRA adapters."""
    if search.pruned:  # the smallest option must be a replayed or traced peak, not a quick figure
        smallest = _smallest_option([(t, search.at(t, 1, accum)) for t in order], search.quick_peak,
                                    lambda c: search.peak(c, exact=True)[0], accum)
    assert smallest is not None
    p, t, micro, accum = smallest
    what = Candidate(dict(t), micro, accum, p, "", 0.0).label()
    adapters = "" if search.cfg.technique.lora_rank else _adapters_hint(
        search.at(t, micro, accum), lambda c: search.peak(c, exact=True)[0], search.limit, margin)
    raise ConfigError(
        f"nothing fits in {size_text(budget_bytes)} (with a {margin:.0%} margin): the smallest option needs "
        f"{size_text(p * (1 + margin))} ({size_text(p)} predicted; {what}); raise --budget or lower "
        f"--batch-size/--seq-len{adapters}")


def _notes(search: _Search, space: dict[str, list[Any]], arch_notes: list[str]) -> list[str]:
    """What the shown figures are: the cost model's, how the model was read (``arch_notes``), and how
    each peak was found (the allocator model, a trace or the analytic model of its layers, an
    interpolated compile budget)."""
    device_type, gpu = search.device_type, search.gpu
    notes = [f"cost model: {device_type} profile; a model to order candidates, not a measurement", *arch_notes]
    if gpu is not None and device_type == "cuda" and not search.traced:
        unnamed = " of an unnamed card (--gpu NAME for yours)" if gpu == "default" else ""
        notes.append("peaks are device totals: the caching-allocator model's reserved memory plus the CUDA context"
                     f"{unnamed} (memtrain.analysis.allocator)")
    if search.traced:
        if search.modelled_inside:
            notes.append(f"peaks of the candidates within {TRACE_PRUNE_SLACK - 1:.0%} of the limit traced under fake "
                         "tensors (transformers model; deep ones from 2 + 3 layer probes); the "
                         f"{search.modelled_inside} further inside from the analytic model of its layers (within 1% of "
                         "the trace on this family)")
        else:
            notes.append("peaks traced under fake tensors (transformers model; deep ones from 2 + 3 layer probes)")
    if search.trace_capped:
        notes.append(f"trace cap reached (--max-traces, {search.traces} traced): {search.trace_capped} set(s) keep a "
                     f"batch that fits (the analytic model of their layers' with {TRACE_PRUNE_SLACK - 1:.0%} kept, "
                     "or the largest traced) but may be below their largest")
    if "compile_memory_budget" in space:
        notes.append("compile budget candidates: peak and recompute interpolated between checkpointing none and "
                     "full (docs/estimation.md), not traced; `memtrain estimate --compile --compile-memory-budget F "
                     "--trace` runs torch's partitioner")
    return notes


def _adapters_hint(smallest: RunConfig, exact_peak: Callable[[RunConfig], float], limit: float,
                   margin: float) -> str:
    """When no full fine-tune fits: the smallest option again with LoRA adapters trained instead
    of every weight, its peak predicted as every candidate's, as a clause of the refusal. A
    different run (only the adapters learn), so it is named, never chosen."""
    rank = min(ADVICE_LORA_RANK, smallest.model.d_model)
    p = exact_peak(smallest.replace(lora_rank=rank))
    needs = f"{size_text(p * (1 + margin))} ({size_text(p)} predicted)"
    if p <= limit:
        return f"; or train LoRA adapters instead of every weight: with --lora-rank {rank} it needs {needs}"
    qlora = ", and --qlora keeps the base weights in 4 bits" if smallest.model.model is not None else ""
    return f"; with LoRA (--lora-rank {rank}) it still needs {needs}{qlora}"


def _config_key(cfg: RunConfig) -> str:
    """Every setting of ``cfg``, as one string: equal exactly when two configs are the same run."""
    return repr(cfg.to_dict())


def _without_idle_offload(fits: list[Candidate]) -> list[Candidate]:
    """Drop each --offload-activations candidate whose twin without it fits the same batch: the
    offload buys nothing there and only costs copies."""
    def twin(c: Candidate) -> tuple:
        return tuple(sorted((k, v) for k, v in c.techniques.items() if k != "offload_activations"))

    plain = {(twin(c), c.batch_size) for c in fits if not c.techniques.get("offload_activations")}
    return [c for c in fits if not (c.techniques.get("offload_activations") and (twin(c), c.batch_size) in plain)]


def _transformers_arch(cfg: RunConfig, device_type: str) -> tuple[Arch, bool, str]:
    """(arch, traced, note) for a transformers --model: its candidates are traced under fake
    tensors (the cost model takes ``cost_arch``'s shape). CUDA fake tensors need a CUDA build of
    torch; on a CPU-only build a family the analytic model covers is estimated analytically with
    CUDA kernel facts, as ``memtrain estimate`` does, and any other is refused with the flag that
    plans it on CPU kernels instead."""
    assert cfg.model.model is not None, "arch=None plans a transformers --model"
    if device_type != "cuda":
        return cost_arch(cfg.model.model), True, ""
    if not cpu_only_torch():  # a CPU-only build has no fake CUDA tensors: torch need not load to say so
        from memtrain.analysis.trace import cuda_trace_supported  # imports torch: transformers models only

        if cuda_trace_supported():
            return cost_arch(cfg.model.model), True, ""
    reason = why_not_modelled(cfg, device_type)
    if reason is not None:
        raise ConfigError(f"--device-type cuda: {reason}, and tracing it with CUDA kernels needs a CUDA build of "
                          "torch (this one is CPU-only); use --device-type cpu to plan with CPU kernels' memory rules")
    return hf_arch(cfg.model.model), False, ("peaks from the analytic model of transformers layers with CUDA kernel "
                                            "facts (a CUDA trace needs a CUDA build of torch)")


def candidate_config(cfg: RunConfig, c: Candidate) -> RunConfig:
    """The run of candidate ``c``. An fp8 candidate runs compiled: torchao's FP8 casts are fast only
    fused by torch.compile, and the cost model charges FP8's rate (memtrain.techniques.fp8)."""
    compiled = {"compile": True} if precision_facts(c.techniques["precision"]).fp8 else {}
    return cfg.replace(**c.techniques, **compiled, batch_size=c.batch_size, grad_accum=c.grad_accum)


def command_config(cfg: RunConfig, c: Candidate, device_type: str) -> RunConfig:
    """The run the printed ``memtrain train`` command rebuilds: candidate ``c`` on the device type
    the plan modelled. A --device of another type (``--device cpu --device-type cuda``) would run
    a plan whose kernels and peaks were not the ones modelled, so the command names the modelled type."""
    run = candidate_config(cfg, c)
    return run if planned_device(run.train.device, device_type) == run.train.device else \
        run.replace(device=device_type)


def planned_device(device: str, device_type: str) -> str:
    """``device`` when it is 'auto' or of ``device_type`` ('cuda:1' for cuda), else ``device_type``."""
    return device if device == "auto" or device.split(":")[0] == device_type else device_type


def verify_config(cfg: RunConfig, c: Candidate, steps: int = 2) -> RunConfig:
    """The short run that checks candidate ``c``: ``steps`` steps (at least 2, so that one is a
    steady-state step) with no warm-up, evaluation or progress, on the embedded default data
    unless ``cfg`` says otherwise. The command trains it (memtrain.training.train.train)."""
    return candidate_config(cfg, c).replace(steps=max(2, steps), warmup_steps=0, eval_every=0,
                                            warmup_timing_steps=0, progress=False, val_blocks=1)


def verification(c: Candidate, run_cfg: RunConfig, result: dict[str, Any]) -> dict[str, Any]:
    """The tracked peak of the steady-state step of ``verify_config``'s run (its ``result``)
    against the prediction of candidate ``c``."""
    measured = result["memory"]["peak_bytes"]
    return {"predicted_bytes": int(round(c.peak_bytes)), "measured_bytes": measured,
            "error": (c.peak_bytes / measured - 1) if measured else None,
            "by_category": result["memory"].get("by_category"), "steps": run_cfg.train.steps,
            "step_time_s": result["step_time_s"]["median"]}
