"""The training run: data, the step loop, evaluation, checkpoints and the result.

``train(cfg)`` runs one configured run and returns its result dict (the ``result.json``
contract of docs/architecture.md). The run is built and stepped by the step harness
(:mod:`memtrain.training.step`: one :class:`~memtrain.training.step.TrainState`, micro-steps -> clip -> optimizer
step); this module adds what only a real run has: data, timing, the metered steps, logging,
evaluation and checkpoints. It prints nothing itself except an optional progress bar; the CLI
decides what to show.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

import numpy as np
import torch
import torch.nn as nn
from tqdm.auto import tqdm

from memtrain.analysis.flops import counted_flops_per_step, rule_flops_per_token
from memtrain.checkpoints.exact import load_checkpoint, save_checkpoint
from memtrain.config.run import ConfigError, RunConfig, effective_cache_dir
from memtrain.data import (
    check_split_documents,
    check_val_tokens,
    data_fingerprint,
    make_train_loader,
    make_val_batches,
    prepare_splits,
    validation_source_name,
)
from memtrain.data.device_feed import DeviceFeed
from memtrain.data.loader import IGNORE_INDEX, RecordRows
from memtrain.devices.advice import mfu_for_run, reference_rate_now, run_device_facts
from memtrain.distributed.rank_errors import agreement, launched_by_memtrain
from memtrain.distributed.session import DistContext, distributed_session
from memtrain.files.lock import FolderLock, file_lock, refuse_folder_in_use, register_writer
from memtrain.files.results import remove_stale_temps
from memtrain.metrics import MemoryMeter, StepTimer, device_peak_memory, reset_device_peak, synchronize
from memtrain.metrics.state import ShardedStateBytes
from memtrain.models.families import data_tokenizer
from memtrain.models.identity import model_config_identity
from memtrain.runtime.env import environment, resolve_device, seed_everything
from memtrain.runtime.notices import ProgressLines, QLoRASkipWarning, shows_lines, shows_progress
from memtrain.techniques import Precision, make_precision
from memtrain.techniques.optim import check_optimizer_installed
from memtrain.training.nudge import nudge_weights
from memtrain.training.preflight import check_destinations, check_vocab
from memtrain.training.readings import StepReadings
from memtrain.training.resume_check import (
    check_resume,
    continue_longer,
    resume_state,
    resuming_line,
    run_of_state,
    unchecked_data_warning,
)
from memtrain.training.sinks import MetricsLogger, live_memory
from memtrain.training.size_check import check_model_size
from memtrain.training.step import (
    Batch,
    TrainState,
    build_base_model,
    build_state,
    queue_run_step,
    run_step,
    train_step,
)

__all__ = ["LossDiverged", "evaluate", "train"]

# Steps whose memory is tracked (the meter slows a step down, so only these are metered and
# they are also left out of the timing). Step 0 creates the optimizer state; step 1 is the
# steady state whose peak is reported.
METERED_STEPS = (0, 1)


class LossDiverged(RuntimeError):
    """The loss became NaN or infinite: further steps would only train on garbage."""


@torch.no_grad()
@torch.compiler.set_stance("force_eager")
def evaluate(model: nn.Module, batches: list[Batch], precision: Precision, device: torch.device,
             on_batch: Optional[Callable[[int], None]] = None) -> float:
    """Mean token loss over the fixed validation batches; ``on_batch`` is told how many batches
    are done after each (the final validation's plain lines).

    Run uncompiled under ``--compile`` (torch's ``force_eager`` stance): in eval mode and without
    gradients the compiled model is another graph, and compiling it (again for a smaller last
    batch) costs far more than it saves in the few evaluations of a run (the figures:
    docs/performance.md, "One compile per run"). HF Trainer evaluates its uncompiled model too."""
    was_training = model.training
    model.eval()
    losses, weights = [], []
    for done, (x, y) in enumerate(batches, 1):
        # Weighted by its targets: every token of text, the answer tokens under --loss-on
        # completion (a batch without one has no loss to add).
        weight = target_count(y)
        if weight != 0:
            with precision.autocast():
                loss = model(x.to(device), y.to(device))
            losses.append(float(loss))
            weights.append(weight)
        if on_batch is not None:
            on_batch(done)
    model.train(was_training)
    return sum(loss * w for loss, w in zip(losses, weights)) / sum(weights)


def _final_validation(model: nn.Module, batches: list[Batch], precision: Precision, device: torch.device,
                      plain: bool) -> float:
    """:func:`evaluate` after the last step, with plain lines of its own (``plain``: no bar,
    stderr a log): the train phase's lines close before it, and a long validation (a large
    --val-blocks, a big model) wrote nothing while it ran."""
    with ProgressLines("validating", plain, total=len(batches), unit="batches") as said:
        val_loss = evaluate(model, batches, precision, device, on_batch=said.update)
        said.close()
    return val_loss


def target_count(y: torch.Tensor) -> int:
    """How many of ``y``'s targets the loss averages: all of them, less those ignored (-100)."""
    return y.numel() - int((y == IGNORE_INDEX).sum())


@dataclass
class _Progress:
    """A tqdm bar that is silent when disabled; with ``plain`` (no bar: stderr is no terminal),
    a plain line now and then instead (:class:`memtrain.runtime.notices.ProgressLines`)."""

    total: int
    initial: int
    enabled: bool
    plain: bool = False
    bar: Any = field(default=None)
    lines: Any = field(default=None)

    def __post_init__(self) -> None:
        if self.enabled:
            self.bar = tqdm(total=self.total, initial=self.initial, desc="train", unit="step", dynamic_ncols=True)
        self.lines = ProgressLines("train", self.plain and not self.enabled, total=self.total, unit="step")
        self.lines.done = self.initial

    def update(self, loss: float, tokens_per_s: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
            self.bar.update(1)
        self.lines.update(self.lines.done + 1, f"loss {loss:.3f}, {tokens_per_s:,.0f} tokens/s")

    def stop(self) -> None:
        """The run failed or was interrupted: its plain lines stop without a closing "done" line."""
        self.lines.stop()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.lines.close()


def _flops_per_rank_step(cfg: RunConfig, n_params: int, rule_dropped_params: Optional[int] = None) -> tuple[float, str]:
    """Model FLOPs of one optimizer step on one rank, the MFU numerator: the counted
    forward + backward (as ``memtrain flops`` reports them, so both agree), or the 6ND +
    attention rule when the model cannot be traced for counting, less the parameters that do no
    matmul work for a token (``rule_dropped_params``, counted on the built model: its learned
    position table, none in a rotary model, and a mixture-of-experts model's experts a token does
    not meet; None: the position table by the config)."""
    try:
        # The count builds the model once more: --qlora's note on the weights it leaves unquantized
        # was said when the run built it, and a second time after the run reads as another model.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", QLoRASkipWarning)
            return float(counted_flops_per_step(cfg)["model_flops"]), "counted"
    except Exception:  # noqa: BLE001 - a counting gap must not fail a finished run
        t = cfg.train
        tokens = t.batch_size * t.grad_accum * t.seq_len
        return rule_flops_per_token(cfg.model, t.seq_len, n_params, rule_dropped_params) * tokens, "rule"


# Called after every optimizer step with (steps done, steps in this run, timed-step median so
# far or None while still in the timing warm-up); the bench uses it for its ETA.
StepCallback = Callable[[int, int, Optional[float]], None]


def _optimizer_kernel(optimizer: Any) -> Optional[str]:
    """Which AdamW kernel ran (``--optim adamw`` picks one per device): fused | foreach | for-loop."""
    d = getattr(optimizer, "defaults", {}) or {}
    if "fused" not in d and "foreach" not in d:
        return None
    return "fused" if d.get("fused") else "foreach" if d.get("foreach") else "for-loop"


def train(cfg: RunConfig, progress: Optional[bool] = None, track_memory: bool = True,
          on_result: Optional[Callable[[dict[str, Any]], None]] = None,
          log_metrics: bool = False, on_step: Optional[StepCallback] = None,
          lock_out: bool = False) -> dict[str, Any]:
    """Run one training run as configured; return the result dict.

    Under ``--distributed`` every rank (torchrun process) runs this and gets the result;
    only rank 0 shows progress (see :mod:`memtrain.distributed`). ``on_result``
    receives the result before the final checkpoint is written (the CLI writes result.json
    there), so a failing final save cannot lose the run's numbers. ``log_metrics`` (the
    ``train`` command) writes ``OUT/metrics.jsonl`` and the ``--report-to`` sinks as steps
    complete; library callers (bench rows, plan's check) leave it off. ``lock_out`` (the
    ``train`` command) holds ``OUT``'s folder lock for the run, so a second train or bench
    on the folder is refused (exit 2) instead of mixing their files: rank 0 takes it (under
    memtrain's launcher the launcher has it already), and every other rank adds itself to
    the lock file as a writer (:func:`memtrain.files.lock.register_writer`), so the folder stays
    refused until the last rank is gone, whoever ends first.
    """
    with distributed_session(cfg, resolve_device(cfg.train.device)) as dist_ctx, contextlib.ExitStack() as held:
        # Before any step and before the first collective: every rank checks, and a refusal
        # on any one rank (its own file, its own disk) refuses the run on all of them.
        launched = launched_by_memtrain()  # the launcher holds OUT's lock for its ranks
        with agreement():
            # A longer --steps on --resume keeps the saved warm-up, before the configs are compared.
            cfg.data.check_answer_source()  # --loss-on completion needs records, before anything is read or written
            resumed = resume_state(cfg)  # the checkpoint's small entries, read once for the run
            stretched = continue_longer(cfg, resumed) is not None
            # A checkpoint of another run is refused before tokenizing, and before its own --out
            # and --save are compared (a changed flag is then said as a resume's difference).
            resumed_at = check_resume(cfg, resumed)
            # Never a run that cannot write its result, nor one that would overwrite another's. A
            # folder a running run holds is said as in use (a launcher's ranks write under its lock).
            if lock_out and dist_ctx.is_main and not launched:
                refuse_folder_in_use(Path(cfg.train.out))
            check_destinations(cfg, fresh_out=log_metrics, resumed=resumed)
            check_vocab(cfg)
            check_model_size(cfg.model, dist_ctx.device, cfg.technique.precision)  # a shape that cannot be built, refused before building
            check_optimizer_installed(cfg.technique)  # an absent optional package, before anything is built
            if lock_out and dist_ctx.is_main and not launched:
                held.enter_context(FolderLock(Path(cfg.train.out), "memtrain train", cleanup_if_unused=True))
                if cfg.train.save:
                    held.enter_context(file_lock(Path(cfg.train.save), "memtrain train", "--save"))
                remove_stale_writes(cfg)
        if log_metrics and dist_ctx.is_main and resumed_at is not None:  # the train command: its log says where it picked up
            print(resuming_line(cfg, resumed_at), flush=True)
        # After the agreement: the holder (rank 0 or the launcher) has the lock file by now.
        if lock_out and dist_ctx.enabled and (launched or not dist_ctx.is_main):
            register_writer(Path(cfg.train.out), f"memtrain train rank {dist_ctx.rank}")
        # An older checkpoint records no data fingerprint: the run says once that nothing was compared.
        unchecked = resumed is not None and run_of_state(resumed, cfg.train.resume or "")[2] is None
        return _train(cfg, dist_ctx, progress, track_memory, on_result, log_metrics, on_step, stretched, unchecked)


def follow_new_schedule(scheduler: Any) -> None:
    """After resuming a run with a longer ``--steps`` (:func:`continue_longer`): the optimizer's
    restored LR is the saved schedule's for the next step; take that step's LR again from this
    run's schedule (LambdaLR keeps its step count and calls this run's lr_lambda; torch's
    ``step`` also sets the 0-d tensor LR that torchao's optimizers keep)."""
    scheduler.last_epoch -= 1
    scheduler.step()


def remove_stale_writes(cfg: RunConfig) -> None:
    """Temporary files of an earlier writer of ``--out`` or of ``--save`` that was killed
    mid-write (a SIGKILL skips its cleanup): memtrain's own names, whose process is gone."""
    remove_stale_temps(Path(cfg.train.out))
    if cfg.train.save and cfg.technique.distributed == "none":
        save = Path(cfg.train.save)
        remove_stale_temps(save.parent, save.name)


def step_lr(scheduler: Any) -> float:
    """The learning rate the next optimizer step runs at (read before ``scheduler.step()``), as a
    plain number. torchao's optimizers (bf16-pure's stochastic-rounding AdamW, the low-bit
    AdamWs) keep it as a 0-d CPU tensor, which json cannot write (a run once stopped at its
    first metrics line) and which the scheduler overwrites in place at the next step, so its
    value is taken now."""
    lr = scheduler.get_last_lr()[0]
    return float(lr.item() if isinstance(lr, torch.Tensor) else lr)


def _host_scalars(lr: float, device: torch.device) -> dict[str, Any]:
    """A metrics line's values known on the host as a step is queued: the learning rate the step
    ran at (:func:`step_lr`, taken before the scheduler moved on; HF Trainer's line shows the
    next step's) and live memory."""
    return {"lr": lr, **live_memory(device)}


def _step_scalars(loss: float, logged: dict[str, Any], grad_norm: Optional[float],
                  tokens_per_s: float) -> dict[str, Any]:
    """What one metrics.jsonl line holds besides the step number: the loss and gradient norm
    read from the device, and ``logged``, the learning rate and live memory taken on the host
    as the step was queued (:func:`_host_scalars`)."""
    return {"loss": loss, "lr": logged["lr"], "grad_norm": grad_norm, "tokens_per_s": tokens_per_s, **logged}


def _train(cfg: RunConfig, dist_ctx: DistContext, progress: Optional[bool], track_memory: bool,
           on_result: Optional[Callable[[dict[str, Any]], None]] = None,
           log_metrics: bool = False, on_step: Optional[StepCallback] = None,
           stretched: bool = False, unchecked_data: bool = False) -> dict[str, Any]:
    t = cfg.train
    requested = t.progress if progress is None else progress
    show = shows_progress(requested) and dist_ctx.is_main
    # The train command, unasked and writing stderr to a log: plain lines, so the log shows life.
    plain = log_metrics and dist_ctx.is_main and not show and shows_lines(requested)
    device = dist_ctx.device
    seed_everything(t.seed)
    # Distributed runs save a sharded checkpoint directory (torch.distributed.checkpoint).
    save_ckpt, load_ckpt = save_checkpoint, load_checkpoint
    if dist_ctx.enabled:
        # Imported only here: torch.distributed.checkpoint pulls in DTensor and most of a
        # bench row's import time (measured with python -X importtime), for runs that never use it.
        from memtrain.checkpoints.distributed import (  # torch.distributed.checkpoint loads only when used
            load_checkpoint as dcp_load,
            save_checkpoint as dcp_save,
        )

        save_ckpt, load_ckpt = dcp_save, dcp_load

    # Techniques first: an impossible combination (a backend the device lacks, an optimizer
    # that cannot pair with the precision) fails in seconds, before a long tokenization.
    with agreement():  # no collective yet: a rank that cannot build the model fails them all
        precision = make_precision(cfg.technique.precision, device)
        # Probe the device (rates cached in the run's cache folder) and warn up front when this
        # precision is slow here.
        caps, device_caps = (run_device_facts(cfg.technique.precision, device, effective_cache_dir(cfg.data))
                             if dist_ctx.is_main else (None, None))
        clock = _SetupClock(device)
        base = build_base_model(cfg, device, precision)  # on the device, in the weight dtype
        if t.nudge_seed:  # a bench noise twin: the same run, its weights one rounding apart
            nudge_weights(base, t.nudge_seed)
        clock.lap("model")
    state = build_state(cfg, device, precision, dist_ctx=dist_ctx, base=base, schedule=True)
    clock.lap("state")
    if dist_ctx.enabled:  # what this rank holds of the state, the result's ranks[].sharded_state
        dist_ctx.state = ShardedStateBytes(state.model, state.optimizer, dist_ctx.local_optimizer or state.optimizer)

    # Then data; nothing is written before both succeeded. The fingerprint checkpoints save (and
    # --resume compares) is of the content as reading starts: tokenizing refuses files that change
    # under it, so it is the content the tokens came from (taken after, it named a file replaced
    # while the run tokenized its predecessor).
    state.data_fingerprint = data_fingerprint(cfg.data)
    state.model_config = model_config_identity(cfg.model.model)  # saved in checkpoints, checked by --resume
    with dist_ctx.main_first():  # rank 0 fills the token cache, the other ranks then read it
        splits = prepare_splits(cfg.data, progress=show, tokenizer=data_tokenizer(cfg), lines=plain)
    check_split_documents(splits, cfg.data)
    check_val_tokens(splits, cfg.data, t.seq_len)
    # The next step's batches are fetched while this one runs, on a GPU (memtrain.data.device_feed).
    state.loader = DeviceFeed(make_train_loader(
        splits.train, t.seq_len, t.batch_size, seed=t.seed,
        # Pinning speeds a copy to a GPU only; without one, torch cannot pin (it raises).
        num_workers=cfg.data.num_workers, pin_memory=cfg.data.pin_memory and device.type == "cuda",
        prefetch_factor=cfg.data.prefetch_factor, rank=dist_ctx.rank, world_size=dist_ctx.world_size,
        mask=splits.train_mask, offsets=_pad_offsets(cfg, splits.train_offsets),
    ), device)
    val_batches = make_val_batches(splits.val, t.seq_len, cfg.data.val_blocks, t.batch_size, mask=splits.val_mask,
                                   offsets=_pad_offsets(cfg, splits.val_offsets))
    if dist_ctx.is_main and (said := truncation_line(state.loader.loader.dataset,
                                                     _val_rows(cfg, splits), _rows_in(val_batches))) is not None:
        print(said, file=sys.stderr)
    check_answers(splits, val_batches, cfg)
    clock.lap("data")
    if t.resume:
        load_ckpt(t.resume, state)  # sets state.step and state.losses
        if stretched:
            follow_new_schedule(state.scheduler)
        if dist_ctx.is_main and unchecked_data:  # an older checkpoint: nothing was compared
            print(unchecked_data_warning(cfg), file=sys.stderr)
        clock.lap("resume")
    start_step = state.step

    tokens_per_step = t.batch_size * t.grad_accum * t.seq_len * dist_ctx.world_size  # global batch
    # Metered steps run slower (the meter sees every op): keep them inside the timing warm-up.
    warmup = max(t.warmup_timing_steps, len(METERED_STEPS) if track_memory else 0)
    overlap = overlaps_steps(state, t.sync_steps, dist_ctx.world_size)
    timer = StepTimer(device, warmup=min(warmup, max(0, (t.stop_after or t.steps) - start_step - 1)), overlap=overlap)
    meter = MemoryMeter(state.model, state.optimizer, by_module=t.memory_by_module,
                        module_depth=t.module_depth) if track_memory else None
    dist_ctx.attach_meter(meter)
    reset_device_peak(device)
    end_step = t.stop_after or t.steps
    logger = MetricsLogger(t.out, t.report_to, t.log_every, enabled=log_metrics and dist_ctx.is_main,
                           resumed_from=start_step if t.resume else None, config=cfg.to_dict())
    loop = _Loop(state, timer, meter, logger, save_ckpt, val_batches, tokens_per_step, on_step,
                 dist_ctx.mean, overlap)
    wall_start = time.perf_counter()
    bar = _Progress(total=end_step, initial=start_step, enabled=show, plain=plain)
    try:
        loop.run(start_step, end_step, bar)
    except BaseException:
        bar.stop()  # no "done" line, and no heartbeat line after the run's error line
        logger.close(discard_if_empty=True)  # a failed first step leaves the folder as it found it
        raise
    finally:
        bar.close()
        state.loader.close()  # drops a group fetched ahead; stops the loader's workers, if any
    total_time = time.perf_counter() - wall_start
    try:
        # CPU MFU's reference rate, measured now: under the same load as the steps just timed
        # (none timed where the run resumed at its last step: no MFU to refer to it).
        rate_now = reference_rate_now(caps) if end_step > start_step else None

        val_loss = _final_validation(state.model, val_batches, precision, device, plain)
        record_stop_evaluation(state, end_step, val_loss)
        logger.log(end_step, {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50))}, force=True)
        logger.close()

        memory = _run_memory(meter, device, ran_steps=end_step > start_step)
        result = _result(state, timer, memory, splits, val_loss, state.val_history, start_step, end_step,
                         tokens_per_step, total_time, caps, device_caps, rate_now)
        result["setup_time_s"] = {**clock.laps, "first_step": timer.first_step_s}
        # What val_loss averages: the first --val-blocks blocks of the held-out split, not all of it.
        result["data"]["val_tokens_evaluated"] = sum(int(y.numel()) for _, y in val_batches)
        # What val_loss was read on: --val-data, a --val-split, or the held-out share of --data.
        result["data"]["val_source"] = validation_source_name(cfg.data)
        if splits.train_mask is not None:  # --loss-on completion: what the losses average
            result["data"].update(answer_counts(splits, val_batches))
        result.update(padding_fields(state.loader.loader.dataset, splits.val, splits.val_offsets, val_batches,
                                     result["tokens_per_s"]))
        # distributed: "ranks" (memory per rank), "distributed"
        result.update(dist_ctx.result_fields(memory, ran_steps=end_step > start_step))
    except BaseException:
        if not dist_ctx.enabled:  # a sharded save is collective: one rank's failure would hang it
            _save_trained_steps(state, save_ckpt, end_step)
        raise
    _write_outputs(result, state, on_result, save_ckpt, end_step, logger.failure)
    return result


def record_stop_evaluation(state: TrainState, end_step: int, val_loss: float) -> None:
    """A run stopped by --stop-after at an --eval-every step: its final validation is that step's
    evaluation (the same weights, the same batches), kept in ``state.val_history`` for result.json and
    the checkpoint. The loop skips the evaluation of its last step, which the final validation
    replaces; the run that resumes starts after it, so the uninterrupted run's entry was missing."""
    t = state.cfg.train
    stopped_early = end_step < t.steps
    at_evaluation = bool(t.eval_every) and end_step % t.eval_every == 0
    if stopped_early and at_evaluation and not any(e["step"] == end_step for e in state.val_history):
        state.val_history.append(evaluation_entry(end_step, val_loss))


def evaluation_entry(step: int, val_loss: float) -> dict[str, float]:
    """One ``val_history`` entry: the step, its validation loss and perplexity (exp capped at 50
    nats, as every PPL memtrain prints)."""
    return {"step": step, "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50))}


def _pad_offsets(cfg: RunConfig, offsets: Optional[np.ndarray]) -> Optional[np.ndarray]:
    """A split's record offsets where --packing pad makes a row of each record, else None (the
    stream is cut into blocks). prepare_tokens tokenized again where an entry had none."""
    if cfg.data.packing != "pad":
        return None
    if offsets is None:  # an invariant of prepare_tokens, said as a fault rather than a crash in the loader
        raise RuntimeError("--packing pad: the token cache entry holds no record offsets; run again with --no-cache")
    return offsets


def _val_rows(cfg: RunConfig, splits: Any) -> Optional[RecordRows]:
    """The validation split's record rows under --packing pad (None under concat): what its
    truncation counts are read from (make_val_batches builds the same rows for the batches)."""
    offsets = _pad_offsets(cfg, splits.val_offsets)
    return None if offsets is None else RecordRows(splits.val, cfg.train.seq_len, offsets)


def _rows_in(batches: list[Batch]) -> int:
    """The rows of ``batches``: the validation rows val_loss is read on."""
    return sum(len(x) for x, _ in batches)


def truncation_line(rows: Any, val_rows: Optional[RecordRows] = None, evaluated: int = 0) -> Optional[str]:
    """--packing pad: one line saying, of each split, how many records were longer than a row (cut,
    as TRL cuts them silently at max_length) and how many held nothing to predict (skipped); of
    the validation split also how many of the ``evaluated`` rows val_loss reads were cut."""
    if not isinstance(rows, RecordRows):
        return None
    parts = _split_truncation(rows, "training")
    if val_rows is not None:
        parts += _split_truncation(val_rows, "validation", evaluated, said_row=bool(rows.n_truncated))
    if not parts:
        return None
    truncated = rows.n_truncated or (val_rows is not None and val_rows.n_truncated)
    return "note: --packing pad: " + "; ".join(parts) + (" (raise --seq-len to keep more)" if truncated else "")


def _split_truncation(rows: RecordRows, split: str, evaluated: Optional[int] = None,
                      said_row: bool = False) -> list[str]:
    """The parts of :func:`truncation_line` said of one split (none where nothing was cut or
    skipped); the row's length is said once, in the first part that speaks of it."""
    parts = []
    if rows.n_truncated:
        row = "a row" if said_row else f"a row (--seq-len + 1 = {rows.block_len:,} tokens)"
        part = f"{rows.n_truncated:,} of {rows.n_blocks + rows.n_skipped:,} {split} records are longer than {row} " \
               "and were truncated"
        if evaluated is not None:
            part += f" ({rows.truncated_rows(evaluated):,} of the {evaluated:,} rows val_loss is read on)"
        parts.append(part)
    if rows.n_skipped:
        whose = "" if split == "training" else f" {split} record{'' if rows.n_skipped == 1 else 's'}"
        were = "was" if rows.n_skipped == 1 else "were"
        parts.append(f"{rows.n_skipped:,}{whose} held a single token (nothing to predict) and {were} skipped")
    return parts


def padding_fields(rows: Any, val_tokens: np.ndarray, val_offsets: Optional[np.ndarray], val_batches: list[Batch],
                   tokens_per_s: Optional[float]) -> dict[str, Any]:
    """result.json's padding figures: ``pad_fraction`` (the share of the training rows' input
    positions that are padding: 0 when records are packed), ``real_tokens_per_s`` (tokens_per_s,
    which counts every computed position, less the padded ones) and, under --packing pad, the
    records truncated and skipped (of the training split, and ``val_``: of the validation split,
    with ``val_truncated_evaluated`` of the rows val_loss is read on), the targets val_loss
    averages and the evaluated validation rows' pad share (from the rows' lengths: --loss-on
    completion's prompts are no padding)."""
    pad = rows.pad_fraction() if isinstance(rows, RecordRows) else 0.0
    fields: dict[str, Any] = {"pad_fraction": pad,
                              "real_tokens_per_s": None if tokens_per_s is None else tokens_per_s * (1.0 - pad)}
    if isinstance(rows, RecordRows) and val_offsets is not None:
        evaluated = _rows_in(val_batches)
        val_rows = RecordRows(val_tokens, rows.seq_len, val_offsets)
        fields["padding"] = {"train_rows": rows.n_blocks, "truncated_records": rows.n_truncated,
                             "skipped_records": rows.n_skipped,
                             "val_targets_evaluated": sum(int(y.ne(IGNORE_INDEX).sum()) for _, y in val_batches),
                             "val_pad_fraction": val_rows.pad_fraction(evaluated),
                             "val_truncated_records": val_rows.n_truncated, "val_skipped_records": val_rows.n_skipped,
                             "val_truncated_evaluated": val_rows.truncated_rows(evaluated)}
    return fields


def check_answers(splits: Any, val_batches: list[Batch], cfg: RunConfig) -> None:
    """--loss-on completion: refused before the first step when the training split holds no answer
    token (every step's loss would be 0) or the evaluated validation blocks hold none (no
    validation loss to average)."""
    if splits.train_mask is None:
        return
    targets = int(np.asarray(splits.train_mask).sum())
    if not targets:
        raise ConfigError(f"--loss-on completion: the training split of --data {cfg.data.data} holds no answer token "
                          "(no assistant turn, no completion); check the records or give --loss-on all")
    if targets == len(splits.train_mask):
        # Every token a target: no record had a prompt (--data-format auto read them all as text),
        # so --loss-on completion would train as --loss-on all while saying it averages answers.
        raise ConfigError(f"--loss-on completion: every token of the training split of --data {cfg.data.data} is a "
                          f"target (--data-format {cfg.data.data_format} found no chat or prompt-completion record, "
                          "only text); give such records or drop --loss-on")
    if not sum(target_count(y) for _, y in val_batches):
        raise ConfigError(f"--loss-on completion: the {len(val_batches)} validation batch(es) (--val-blocks "
                          f"{cfg.data.val_blocks}) hold no answer token to average (read on "
                          f"{validation_source_name(cfg.data)}); raise --val-blocks"
                          + (" or give --val-data records with answers" if cfg.data.validation_config()
                             else " or --val-fraction"))


def answer_counts(splits: Any, val_batches: list[Batch]) -> dict[str, int]:
    """result.json's ``data`` counts of target (answer) tokens under --loss-on completion: each
    split's, and those of the evaluated validation blocks, which val_loss averages."""
    return {
        "train_target_tokens": int(np.asarray(splits.train_mask).sum()),
        "val_target_tokens": int(np.asarray(splits.val_mask).sum()),
        "val_target_tokens_evaluated": sum(target_count(y) for _, y in val_batches),
    }


def _run_memory(meter: Optional[MemoryMeter], device: torch.device, ran_steps: bool) -> dict[str, Any]:
    """result.json's ``memory``: the meter's figures of the metered steps and the device's peaks.
    A run resumed at its last step (it only evaluates: ``resume_check.check_resume``) measured no step:
    it keeps the same keys, each null, rather than the figures of an evaluation or a meter that
    saw nothing (a peak of 0 bytes)."""
    memory: dict[str, Any] = {"peak_bytes": None, "by_category": None}
    if meter is not None:
        memory.update(meter.stats().to_dict())
    memory.update(device_peak_memory(device))
    if not ran_steps:
        memory = dict.fromkeys(memory)
    return memory


def _save_trained_steps(state: TrainState, save_ckpt: Callable[[Any, TrainState], None], end_step: int) -> None:
    """Every step ran, then what follows them failed (the final evaluation ran out of memory, a
    signal came): the trained weights were lost with the run, whatever --save said. They are
    saved to --save as the run's end (export, generate, or a longer --steps take them), and a
    note says so before the failure's line; a failing save leaves the failure as it was."""
    if not state.cfg.train.save:
        return
    state.step = end_step
    try:
        save_ckpt(state.cfg.train.save, state)
    except Exception:  # noqa: BLE001 - the run's own failure is the one to report
        return
    sys.stderr.write(f"note: the run failed after its last step; its {end_step} trained steps are saved in "
                     f"{state.cfg.train.save!r}\n")


def _write_outputs(result: dict[str, Any], state: TrainState, on_result: Optional[Callable[[dict[str, Any]], None]],
                   save_ckpt: Callable[[Any, TrainState], None], end_step: int,
                   earlier: Optional[BaseException]) -> None:
    """The result (``on_result``: result.json) first, then the final checkpoint, each written
    whatever became of the other: a full ``--out`` disk still leaves the checkpoint on
    ``--save``'s file system, and the reverse. Then the first failure is raised (``earlier``:
    metrics.jsonl's), naming every file that could not be written."""
    failures = [earlier] if earlier is not None else []
    if on_result is not None:
        try:
            on_result(result)
        # raised below, after the checkpoint; a Ctrl-C or SIGTERM too: it lost every step since
        # the last periodic checkpoint (all of them without --save-every) with the result
        except BaseException as exc:  # noqa: BLE001
            failures.append(exc)
    if state.cfg.train.save:  # after the result is out: a full disk here loses no numbers
        state.step = end_step
        try:
            save_ckpt(state.cfg.train.save, state)
        except Exception as exc:  # noqa: BLE001 - raised below
            failures.append(exc)
    if failures:
        raise _first_failure(failures)


def _first_failure(failures: list[BaseException]) -> BaseException:
    """The first failure; an interrupt wins (the run ends as interrupted, exit 130); when every
    one is an OSError of the same kind (a full disk), one OSError naming all their files (the
    CLI's line says ``disk full writing A and B``)."""
    interrupts = [f for f in failures if not isinstance(f, Exception)]
    if interrupts:
        return interrupts[0]
    first = failures[0]
    errors = [f for f in failures if isinstance(f, OSError)]
    if len(failures) > 1 and len(errors) == len(failures) and len({e.errno for e in errors}) == 1:
        names = [str(e.filename) for e in errors if e.filename]
        return OSError(errors[0].errno, errors[0].strerror, " and ".join(dict.fromkeys(names)))
    return first


class _SetupClock:
    """Wall time of each phase before the first step (result.json's ``setup_time_s``): building
    the model on the device, wrapping it with the techniques and the optimizer, preparing the
    data, loading a checkpoint. The device is synchronized at each lap so that queued
    initialisation kernels are billed to the phase that queued them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        synchronize(self.device)
        now = time.perf_counter()
        self.laps[name] = now - self._last
        self._last = now


@dataclass
class _Queued:
    """A step whose work is queued: what the loop reports of it once its values are read."""

    done: int  # optimizer steps completed once it has run
    loss: Union[torch.Tensor, float]  # its mean loss: a 0-d device tensor until read, or a float
    grad_norm: Optional[torch.Tensor]  # on a step that logs: its gradient norm, else None
    started: float  # host clock when it began (tokens/s on the progress bar)
    logged: Optional[dict[str, Any]]  # its metrics line's host-side values (lr, live memory), or None


@dataclass
class _ReadGroup:
    """Consecutive queued steps whose values are read together, once (:class:`StepReadings`)."""

    steps: list[_Queued]
    readings: StepReadings


# The most steps an overlapped run queues without reading their losses when nothing else asks
# for a read (no metrics line, evaluation or checkpoint in between): a diverged loss stops the
# run within this many steps, and the host runs at most this far ahead of the device.
READ_EVERY_MAX = 100


@dataclass
class _Loop:
    """The step loop of one run: data wait, metered steps, NaN stop, logging, evaluation and
    periodic checkpoints around :func:`memtrain.training.step.run_step`.

    With ``overlap`` (a single-process GPU run, see :func:`overlaps_steps`) each step's loss
    stays on the device until a step must be read: one that writes a metrics line, the metered
    steps, one that something after it needs the model as it left (an evaluation, a checkpoint,
    the last step), or the ``READ_EVERY_MAX``-th since the last read. The steps since the last
    read are then read together, in one host read (HF Trainer likewise reads its loss at logging
    steps only), and the read waits until the next step is queued, so the device always has a
    step to run while the host reads, logs and fetches; a step whose model is needed is read
    before the next is queued. A diverged loss stops the run at that read, naming its step, and
    always before a checkpoint could keep it. Without overlap every step is read as it ends.
    """

    state: TrainState
    timer: StepTimer
    meter: Optional[MemoryMeter]
    logger: MetricsLogger
    save_ckpt: Callable[[Any, TrainState], None]
    val_batches: list[Batch]
    tokens_per_step: int
    on_step: Optional[StepCallback]
    mean: Callable[[float], float]  # the mean over ranks (DistContext.mean)
    overlap: bool = False
    _open: list[_Queued] = field(default_factory=list)  # queued steps not yet in a read group
    _groups: deque[_ReadGroup] = field(default_factory=deque)  # read groups whose values are unread
    _last_read: float = 0.0  # host clock when the last step's values were read
    _save_failed: bool = False  # a periodic checkpoint could not be written (said once)

    def run(self, start_step: int, end_step: int, bar: _Progress) -> None:
        state, t = self.state, self.state.cfg.train
        for step in range(start_step, end_step):
            with self.timer.data_wait():
                micro = state.loader.next_group(t.grad_accum)
            started = time.perf_counter()
            metered = self.meter is not None and step - start_step in METERED_STEPS
            logs = self._logs(step + 1, end_step)
            lr = step_lr(state.scheduler) if logs else 0.0  # this step's, before the scheduler moves on
            with self.timer.step():
                loss = self._one_step(micro, step - start_step, metered)
                state.scheduler.step()
            logged = _host_scalars(lr, state.device) if logs else None
            grad_norm = state.precision.last_grad_norm if logs else None
            self._open.append(_Queued(step + 1, loss, grad_norm, started, logged))
            acts = self._acts(step + 1, end_step)
            if not self.overlap or metered or logs or acts or len(self._open) >= READ_EVERY_MAX:
                self._close_group()
            lag = self.overlap and not metered and not acts
            # Under lag the group closed by this step stays unread until the next step is queued.
            keep = 1 if lag and self._groups and self._groups[-1].steps[-1].done == step + 1 else 0
            self._read_groups(keep=keep, start_step=start_step, end_step=end_step, bar=bar)
            # After the step's reading (where the step is read now: its metrics line is written
            # before the callback sees the step); from the host's clocks: no read of the device.
            # The median is kept as steps are timed (StepTimer.median_so_far), not sorted anew.
            if self.on_step is not None:
                self.on_step(step + 1 - start_step, end_step - start_step, self.timer.median_so_far())

    def _close_group(self) -> None:
        """The open steps become one read group: their losses (and the last one's gradient norm,
        when it logs) stacked into one tensor and, under overlap, copied to the host now, right
        behind the last step's work (:class:`StepReadings`)."""
        steps, self._open = self._open, []
        self._groups.append(_ReadGroup(steps, StepReadings([q.loss for q in steps], steps[-1].grad_norm,
                                                           defer=self.overlap)))

    def _logs(self, done: int, end_step: int) -> bool:
        """Whether step ``done`` writes a metrics line."""
        return bool(self.logger.sinks) and (done % self.logger.every == 0 or done == end_step)

    def _acts(self, done: int, end_step: int) -> bool:
        """Whether something reads the model as step ``done`` leaves it (so the next step
        must wait): an evaluation, a checkpoint, or the end of the loop."""
        t = self.state.cfg.train
        return (done == end_step or bool(t.eval_every and done % t.eval_every == 0)
                or bool(t.save and t.save_every and done % t.save_every == 0))

    def _one_step(self, micro: list[Batch], index: int, metered: bool) -> Union[torch.Tensor, float]:
        """One step, metered when it is one of METERED_STEPS; its mean loss, read now (a float)
        or, under overlap, left on the device (a 0-d tensor). While the device runs an unmetered
        step the host fetches the next step's batches (the feed's ``prefetch``: a no-op on a
        CPU); a metered step fetches none, so the meter sees the step's tensors only."""
        state, meter = self.state, self.meter if metered else None
        group = state.cfg.train.grad_accum
        if self.overlap and meter is None:
            total = queue_run_step(state, micro)
            state.loader.prefetch(group)
            return total
        with meter if meter is not None else contextlib.nullcontext():
            if meter is not None and index == METERED_STEPS[-1]:
                meter.reset_peak()
            return run_step(state, micro, meter,
                            before_wait=None if meter is not None else lambda: state.loader.prefetch(group))

    def _read_groups(self, keep: int, start_step: int, end_step: int, bar: _Progress) -> None:
        """Read the closed groups' values, oldest first, until ``keep`` groups remain; report each
        step (NaN stop, loss history, progress bar, metrics line, evaluation, checkpoint)."""
        state = self.state
        while len(self._groups) > keep:
            g = self._groups.popleft()
            losses = g.readings.losses()  # one read for the group's steps
            now = time.perf_counter()
            # The group's throughput: its steps' tokens over the host time since the last read
            # (with one step a group, each step's own rate, as before groups).
            tokens_per_s = self.tokens_per_step * len(g.steps) / max(now - max(g.steps[0].started, self._last_read), 1e-9)
            self._last_read = now
            for q, read in zip(g.steps, losses):
                loss = self.mean(read)  # the global batch's loss, the same on every rank
                if not math.isfinite(loss):  # the same value on every rank: all stop together
                    raise LossDiverged(f"the training loss became {loss} at step {q.done}; lower --lr "
                                       f"(now {state.cfg.train.lr:g}) or keep --grad-clip on; checkpoints written "
                                       f"before are intact")
                state.losses.append(loss)
                state.step = q.done
                bar.update(loss, tokens_per_s)
                self._after_step(q, g.readings, start_step, end_step, loss, tokens_per_s)

    def _after_step(self, q: _Queued, readings: StepReadings, start_step: int, end_step: int, loss: float,
                    tokens_per_s: float) -> None:
        state, t, logger, done = self.state, self.state.cfg.train, self.logger, q.done
        if q.logged is not None:  # the last step of its group: the group's gradient norm is its own
            logger.log(done, _step_scalars(loss, q.logged, readings.grad_norm(), tokens_per_s), force=True)
        if t.eval_every and done % t.eval_every == 0 and done < end_step:
            v = evaluate(state.model, self.val_batches, state.precision, state.device)
            state.val_history.append(evaluation_entry(done, v))
            logger.log(done, state.val_history[-1], force=True)
            self.timer.skip_gap()  # the evaluation was work, not the device idling
        # Not at the last step: the final checkpoint follows result.json there, so a run stopped
        # between the two (Ctrl-C in the last validation) still has a step to resume that writes it.
        if t.save and t.save_every and done % t.save_every == 0 and done < end_step:
            self._save_periodic(t.save, done)
            self.timer.skip_gap()

    def _save_periodic(self, path: str, done: int) -> None:
        """A --save-every checkpoint. One that cannot be written (a full disk, EIO) is said once
        and training goes on: stopping there lost every step since the last checkpoint and the
        run's result, while the final save (after result.json) tries again and says its own
        failure; the file keeps the last checkpoint written. A sharded save is collective: its
        failure stops every rank, as before."""
        try:
            self.save_ckpt(path, self.state)
        except OSError as exc:
            if self.state.cfg.technique.distributed != "none":
                raise
            if not self._save_failed:
                self._save_failed = True
                sys.stderr.write(f"warning: the checkpoint of step {done} could not be written to {path!r} "
                                 f"({exc.strerror or type(exc).__name__}); training goes on, the final save tries "
                                 "again, and the file keeps the last checkpoint written\n")


def overlaps_steps(state: TrainState, sync_steps: bool, world_size: int) -> bool:
    """Whether the loop may queue a step before reading the last one's loss: on CUDA, one
    process (a data-parallel mean reads every rank's loss at once), the plain step function
    (DeepSpeed's reads its own), no activation offload (its host buffers live for one step),
    and not ``--sync-steps``."""
    return (not sync_steps and world_size == 1 and state.device.type == "cuda"
            and state.step_fn is train_step and state.offload is None)


def _result(state: TrainState, timer: StepTimer, memory: dict[str, Any], splits: Any, val_loss: float,
            val_history: list[dict[str, float]], start_step: int, end_step: int, tokens_per_step: int,
            total_time: float, caps: Any, device_caps: Any, rate_now: Optional[float] = None) -> dict[str, Any]:
    """The result dict of a finished run (the result.json contract of docs/architecture.md)."""
    cfg, t, losses, device = state.cfg, state.cfg.train, state.losses, state.device
    stats = timer.summary().to_dict()
    tail = losses[-min(10, len(losses)):] if losses else [float("nan")]
    # The Trainer's train_loss: the mean over every step this invocation ran (a resumed run's
    # own steps), beside memtrain's train_loss, the mean of the last 10 (the end of the curve).
    ran = losses[len(losses) - (end_step - start_step):] if end_step > start_step and losses else [float("nan")]
    flops_per_rank_step, flops_source = _flops_per_rank_step(cfg, state.n_params, state.rule_dropped_params)
    median = stats["median"]
    run_mfu, mfu_reference = mfu_for_run(flops_per_rank_step, median, device, cfg.technique.precision, caps, rate_now,
                                         effective_cache_dir(cfg.data))
    return {
        "config": cfg.recorded(),
        "train_loss": sum(tail) / len(tail),
        "train_loss_steps": len(tail) if losses else 0,
        "train_loss_mean": sum(ran) / len(ran),
        "val_loss": val_loss,
        "val_ppl": math.exp(min(val_loss, 50)),
        "steps": end_step,
        "steps_run": end_step - start_step,
        "stopped_early": end_step < t.steps,
        "tokens": tokens_per_step * end_step,
        "step_time_s": {k: stats[k] for k in ("median", "p10", "p90", "mean")},
        "data_wait_share": stats.get("data_wait_share"),
        "device_idle_share": stats.get("device_idle_share"),
        "total_time_s": total_time,
        "tokens_per_s": tokens_per_step / median if median else None,
        "mfu": run_mfu,
        "mfu_reference": mfu_reference,
        "optimizer_kernel": _optimizer_kernel(state.optimizer),  # CUDA: datasheet peak; CPU: the GEMM rate measured here
        "device_caps": device_caps,
        "flops_per_step": flops_per_rank_step,
        "flops_source": flops_source,
        "memory": memory,
        "parameters": state.n_params,
        "trainable_parameters": state.trainable_parameters,
        # LoRA's A and B matrices, outside ``parameters`` (the model as built), as estimate
        # counts them: parameters + adapter_parameters is peft's "all params".
        "adapter_parameters": state.trainable_parameters if cfg.technique.lora_rank else 0,
        "loss_history": losses,
        "val_history": val_history,
        "skipped_steps": state.precision.skipped_steps,
        "data": {
            "train_tokens": int(len(splits.train)),
            "val_tokens": int(len(splits.val)),
            "train_documents": splits.n_train_docs,
            "val_documents": splits.n_val_docs,
            "from_cache": splits.from_cache,
            "tokenize_tokens_per_s": splits.tokens_per_s,
            "tokenizer": splits.tokenizer,  # gpt2, or the identity of a --model folder's own tokenizer
        },
        "env": environment(device),
        # --offload-activations: what the last step moved over the host link (absent when off).
        **({"offload": state.offload.counts.to_dict()} if state.offload is not None else {}),
    }
