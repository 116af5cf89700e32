"""Whether a checkpoint given to ``--resume`` belongs to *this* run, checked before data is
tokenized: the saved config agrees on everything that decides the numbers (model, data, batch,
sequence, accumulation, schedule, seed, optimizer, precision; :data:`MAY_DIFFER` may change),
and the saved step lies inside the run. A mismatch is a ConfigError naming every differing key.
A larger ``--steps`` is the same run trained longer (:func:`continue_longer`). Also the settings
a resume takes from its checkpoint (:func:`resumed_settings`) and a sharded checkpoint's ranks
(:func:`check_sharded_resume`).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Iterable, Optional

from memtrain.config.run import ConfigError, RunConfig, build_config, field_index, flatten
from memtrain.files import results
from memtrain.files.guard import special_file_kind
from memtrain.files.json_file import NOT_A_FILE, TOO_BIG, JsonFileProblem, read_json_file
from memtrain.files.results import RESULT_NAME
from memtrain.models.identity import identity_differences, model_config_identity
from memtrain.models.spec import every_decoder_linear
from memtrain.training.run_paths import anchored, launch_dir, same_file, same_place
from memtrain.training.schedule import lr_lambda

# Settings newer than some checkpoints, with the value every run had before they existed: a
# checkpoint that lacks one resumes as a run with that value.
ADDED_LATER: dict[str, Any] = {"data_format": "text", "loss_on": "all", "packing": "concat"}
# Keys that may differ between the saved run and the resumed one: where output goes, how it
# is shown, how fast it runs, and implementation choices that compute the same numbers.
MAY_DIFFER: frozenset[str] = frozenset({
    "out", "save", "save_every", "resume", "stop_after", "progress", "device", "eval_every",
    "warmup_timing_steps", "sync_steps", "cache_dir", "no_cache", "num_workers", "pin_memory", "prefetch_factor",
    "attention", "checkpointing", "compile", "compile_mode", "compile_scope", "loss", "loss_chunk",
    "distributed", "cpu_offload", "offload_activations",
    "compile_memory_budget",  # what the compiled graph recomputes, not what it computes
    "memory_by_module", "module_depth", "module_top",  # what the result reports, not what the run computes
    "log_every", "report_to",  # how often and where metrics are logged, not what they are
})


def saved_run(path: str | Path, state: Optional[dict[str, Any]] = None) -> tuple[dict[str, Any], int, Optional[str]]:
    """The saved config, step and data fingerprint (None in checkpoints that predate it) of a
    checkpoint (single file or sharded directory). The config's relative paths are made
    absolute against the folder the run was launched from, where that is not this process's
    (:mod:`memtrain.training.run_paths`).

    Reads no tensor data: a sharded checkpoint's meta.json, or a single file memory-mapped
    with ``weights_only=True`` (only the small entries are touched). ``state``: its
    :func:`saved_state`, where the caller read it already (:func:`resume_state`)."""
    return run_of_state(saved_state(path) if state is None else state, path)


def run_of_state(state: dict[str, Any], path: str | Path) -> tuple[dict[str, Any], int, Optional[str]]:
    """:func:`saved_run` of a checkpoint's :func:`saved_state` already read from ``path``."""
    fingerprint = state.get("data_fingerprint")
    config = anchored(state["config"], launch_dir(state, path))
    return config, state["step"], fingerprint if isinstance(fingerprint, str) else None


# The entries of a single-file checkpoint that :func:`saved_state` keeps: the run's config and step,
# what --resume compares, and the folder its paths are relative to. The tensors (weights, optimizer
# state) stay in the file, for load_checkpoint to read once the run is checked.
SMALL_ENTRIES: tuple[str, ...] = ("format", "step", "config", "data_fingerprint", "model_config", "cwd")


def saved_state(path: str | Path) -> dict[str, Any]:
    """A checkpoint's small entries (config, step, fingerprint, launch folder), checked to hold a
    run config and a step. A run reads them once (:func:`resume_state`) and passes them on."""
    p = Path(path).expanduser()
    if p.is_dir():
        meta_path = p / "meta.json"
        if not meta_path.is_file():
            raise ConfigError(f"--resume {str(p)!r} is a directory without meta.json; it is not a memtrain checkpoint")
        try:
            state = read_json_file(meta_path, results.MAX_WHOLE_JSON_BYTES, root=p)
        except JsonFileProblem as exc:
            if exc.kind in (NOT_A_FILE, TOO_BIG):  # a link out of the checkpoint, a file too large to read whole
                raise ConfigError(f"checkpoint {str(p)!r} is refused: its meta.json is {exc}; resume only from "
                                  "checkpoints memtrain wrote") from None
            raise ConfigError(f"cannot read {str(meta_path)!r}; it is not a memtrain checkpoint") from None
    elif p.is_file():
        # memtrain.checkpoints imports torch: loaded only for --resume
        from memtrain.checkpoints.exact import load_plain, unreadable_checkpoint

        try:
            loaded = load_plain(p, mmap=True)
        except ConfigError:  # it says what to install
            raise
        except Exception as exc:  # truncated, foreign, or holding more than plain data
            raise unreadable_checkpoint(p, exc) from None
        # Only the small entries are kept: a run holds them from its checks to its end, and the
        # memory-mapped tensors would keep the file mapped all that time.
        state = {k: loaded[k] for k in SMALL_ENTRIES if k in loaded} if isinstance(loaded, dict) else loaded
    else:
        kind = special_file_kind(p)  # a FIFO (never opened: it would block), a device: named, not "not found"
        found = "not found" if kind is None else f"is {kind}, not a file"
        raise ConfigError(f"checkpoint {str(p)!r} {found}; check --resume")
    if not isinstance(state, dict) or not isinstance(state.get("config"), dict) or not isinstance(state.get("step"), int):
        raise ConfigError(f"checkpoint {str(p)!r} holds no run config or step; it was not written by this memtrain version")
    # A negative step, else check_resume, comparing it with this run's end, asks for another --stop-after.
    from memtrain.checkpoints.exact import DamagedCheckpoint, check_step, damaged  # torch: only for --resume

    try:
        check_step(state["step"])
    except DamagedCheckpoint as exc:
        raise damaged(p, exc) from None
    return state


def resume_state(cfg: RunConfig) -> Optional[dict[str, Any]]:
    """The :func:`saved_state` of this run's ``--resume`` (None without one), read once per run:
    the one the command line read to take the saved settings (``cfg.resumed_state``, kept for its
    path), else read now. Every check of the run (:func:`continue_longer`, :func:`check_resume`,
    the destinations' checks) and the run itself take it from here, so the checkpoint is opened
    for its small entries once, not once per check."""
    if not cfg.train.resume:
        return None
    kept = getattr(cfg, "resumed_state", None)
    if isinstance(kept, tuple) and len(kept) == 2 and kept[0] == cfg.train.resume:
        return kept[1]
    return saved_state(cfg.train.resume)


# The saved settings a resumed run does not take from its checkpoint: which checkpoint it resumes
# and where it stops, and what belongs to the machine it runs on now (the device, the loader's
# workers, the token cache), which the saved config recorded for another machine.
NOT_RESUMED: frozenset[str] = frozenset({
    "resume", "stop_after", "device", "progress", "num_workers", "pin_memory", "prefetch_factor", "cache_dir",
    "no_cache",
})
# The data-parallel strategy, taken only by a resumed run that is launched as ranks again
# (--nproc-per-node, torchrun): one process resuming a ranks' run gets the launch's own refusal.
LAUNCH_SETTINGS: frozenset[str] = frozenset({"distributed", "cpu_offload"})


def resumed_settings(path: str | Path, launched: bool = False, out_given: bool = False,
                     state: Optional[dict[str, Any]] = None) -> tuple[dict[str, Any], Optional[str]]:
    """The settings ``train --resume CKPT`` starts from: the checkpoint's saved run config
    (model, data, schedule, techniques, its ``--out`` and ``--save``; with ``launched``, a run
    started as ranks, its data-parallel strategy too), so that ``--resume CKPT`` alone continues
    the run; the config file and the flags override them, and a change that decides the numbers
    is still refused as another run's (:func:`check_resume`). Leaves out :data:`NOT_RESUMED`
    and names this memtrain does not know. A saved value memtrain refuses is one ConfigError
    naming the checkpoint. Also returns the ``--save`` the checkpoint was written as where it is
    no longer that file (:func:`saved_elsewhere`: its ``--save`` and ``--save-every`` are left
    out then), else None.

    One rule says where a resumed run writes, moved checkpoint or not: into the ``--out`` the
    flags or the config file name (``out_given``); else into the folder the checkpoint lies in,
    when that is the folder its run wrote to (:func:`lends_out`); else nowhere: one ConfigError
    saying to add ``--out``. A file anyone could have placed at a path names no folder for this
    run to write into, and a default folder (runs/train, where a moved checkpoint's run once
    wrote) is one the user did not name. ``state``: the checkpoint's :func:`saved_state`, where
    the caller read it already."""
    saved, _, _ = saved_run(path, state)
    if not launched and Path(path).expanduser().is_dir():
        check_sharded_resume(path, 1)  # a ranks' checkpoint: says how many ranks resume it
    index = field_index()
    left_out = NOT_RESUMED if launched else NOT_RESUMED | LAUNCH_SETTINGS
    try:
        settings = {k: v for k, v in flatten(saved).items() if k in index and k not in left_out}
        # The values as a config file's are checked, before anything runs. The model spec is left
        # to the run's own build: a model that cannot be resolved now (a folder since moved, the
        # Hub offline) is said in its own words there, not blamed on the checkpoint.
        build_config({k: v for k, v in settings.items() if k != "model"})
    except ValueError as exc:  # a ConfigError, or flatten's key that is no setting name
        raise ConfigError(f"checkpoint {str(path)!r} holds settings memtrain refuses ({exc}); resume only from "
                          "checkpoints memtrain wrote") from None
    saved_as = settings.get("save")
    moved = saved_elsewhere(path, saved_as)
    if moved:  # its --save (and how often to save there) is that run's, whose newer checkpoint it holds
        settings = {k: v for k, v in settings.items() if k not in RUN_SAVES}
    if not lends_out(path, settings.get("out")):
        if not out_given:
            raise ConfigError(f"checkpoint {str(path)!r} is not in the folder its run wrote to "
                              f"({str(settings.get('out'))!r}), so it does not say where this run writes; "
                              "add --out DIR (the run's own folder to continue there)")
        settings.pop("out", None)
    return settings, saved_as if moved else None


# Where a run saves: taken by a resumed run only from a checkpoint still where its run saved it.
# --save-every is how often it saves to that --save: taken without it, a copied checkpoint's run
# was refused for a --save-every its user never gave ("add --save or drop --save-every").
RUN_SAVES: frozenset[str] = frozenset({"save", "save_every"})


def lends_out(checkpoint: str | Path, out: Any) -> bool:
    """Whether a resumed ``checkpoint`` may name the ``--out`` its config records: it lies in
    that folder itself (links resolved; ``--out runs/x --save runs/x/ckpt.pt``), where only
    someone who may write there could have put it. A checkpoint elsewhere that named any folder
    would make ``--resume CKPT`` alone write result.json and metrics.jsonl wherever a file placed
    at a known path said; any folder above the checkpoint (``/``, the home folder) would be as
    bad, so the checkpoint's own folder is the only one lent."""
    if not isinstance(out, str) or not out:
        return False
    here = Path(os.path.expanduser(str(checkpoint))).resolve()
    return here.parent == Path(os.path.expanduser(out)).resolve()


def saved_elsewhere(path: str | Path, saved_as: Any) -> bool:
    """Whether the checkpoint at ``path`` is no longer the file (or folder) its run saved as
    ``saved_as``: moved, copied (an earlier checkpoint kept aside) or brought from another
    machine. Such a checkpoint's ``--out`` and ``--save`` are that run's: taken, a resumed run
    would replace the newer checkpoint saved there, or write wherever its config says."""
    return isinstance(saved_as, str) and bool(saved_as) and not same_file(path, saved_as)


def moved_checkpoint_note(cfg: RunConfig, saved_as: Optional[str], given: Iterable[str]) -> Optional[str]:
    """The note a resumed run prints after it when its checkpoint was saved elsewhere, as
    ``saved_as`` (:func:`resumed_settings`), and the flags or the config file (``given``) did not
    name the ``--save`` it left out; None otherwise."""
    if saved_as is None or "save" in given:
        return None
    t = cfg.train
    writes = f"it wrote to {t.out!r}" + (f" and saved {t.save!r}" if t.save else " and saved no checkpoint (--save to keep one)")
    return (f"note: {str(t.resume)!r} was saved by its run as {saved_as!r} (moved or copied since): this run does not "
            f"take that run's --save; {writes}")


def config_differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """``["key: saved -> now", ...]`` for every key that decides the run's numbers."""
    diffs = []
    for section, values in now.items():
        old_section = saved.get(section) if isinstance(saved.get(section), dict) else {}
        for key, value in values.items():
            if key in MAY_DIFFER:
                continue
            # A setting added after the checkpoint was saved ran as its default then.
            old = old_section.get(key, ADDED_LATER.get(key, "<missing>"))  # type: ignore[union-attr]  # old_section is a dict: non-dicts were replaced by {}
            if not same_place(key, old, value) and not _same_lora_targets(key, old, value):
                diffs.append(f"{key}: {old!r} -> {value!r}")
    return diffs


def _same_lora_targets(key: str, old: Any, new: Any) -> bool:
    """Whether ``old`` and ``new`` are two names of every decoder Linear as LoRA targets: a
    transformers run saved before its config recorded peft's ``all-linear`` recorded our GPT's
    default list for the same adapters, and still resumes."""
    return key == "lora_targets" and isinstance(old, str) and every_decoder_linear(old) and every_decoder_linear(new)


def differences_from_this_run(saved: dict[str, Any], cfg: RunConfig, data_as: Optional[str] = None,
                              model_as: Optional[str] = None) -> list[str]:
    """:func:`config_differences` of a saved config (a checkpoint's, a result.json's) from this
    run: none where it is this run's, or, when this run trains a resumed run longer
    (:func:`continue_longer`), that run's (the same settings with its shorter ``--steps``).
    ``data_as``: the ``--data`` to compare as this run's, where the run's own data path is not
    the one to compare (resuming, the data was compared with the checkpoint's by its content:
    a copied or moved data file still resumes; :func:`check_resume`). ``model_as``: the same for
    ``--model``, compared by its config.json (:func:`_check_resume_model`)."""
    now = cfg.to_dict()
    if data_as is not None:
        now = {**now, "data": {**now["data"], "data": data_as}}
    if model_as is not None:  # the same model at another path (compared by its config.json)
        now = {**now, "model": {**now["model"], "model": model_as}}
    diffs = config_differences(saved, now)
    shorter = getattr(cfg.train, "continues_steps", None)
    if diffs and shorter is not None:  # the larger --steps is no difference: only the others are
        return config_differences(saved, {**now, "train": {**now["train"], "steps": shorter}})
    return diffs


def _count_or_none(value: Any) -> Optional[int]:
    """``value`` when it is a whole number >= 0 (a saved config's step count), else None: a
    damaged or crafted checkpoint's field neither extends a run nor sets its warm-up."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def continue_longer(cfg: RunConfig, state: Optional[dict[str, Any]] = None) -> Optional[str]:
    """Train longer: ``--resume`` with a ``--steps`` larger than the saved run's continues that
    run, its LR schedule stretched over the new ``--steps`` from the step it resumes at (as the
    Trainer does when it resumes with a larger ``max_steps``): under the cosine schedule the LR
    rises back to where the longer schedule has it. The warm-up stays the one that ran: a
    warm-up no setting names would otherwise grow with ``--steps`` (10% of it) and refuse the
    checkpoint as another run's; one set on the command line is compared as any setting is.

    Returns the line that says so (None when this run does not resume a shorter run), and
    sets ``cfg.train.warmup_steps`` to the saved warm-up where it was defaulted. Called before
    the other checks compare the saved config with this one (:func:`check_resume`). ``state``:
    the checkpoint's :func:`saved_state` (read here where not given)."""
    t = cfg.train
    if not t.resume:
        return None
    saved, step, _ = saved_run(t.resume, state)
    saved_train: dict[str, Any] = saved["train"] if isinstance(saved.get("train"), dict) else {}
    before, warmup = _count_or_none(saved_train.get("steps")), _count_or_none(saved_train.get("warmup_steps"))
    if before is None or t.steps <= before:
        return None
    t.continues_steps = before  # type: ignore[attr-defined]  # not a field: read by differences_from_this_run
    if getattr(t, "warmup_defaulted", False) and warmup is not None:
        t.warmup_steps = warmup
        t.warmup_defaulted = False  # type: ignore[attr-defined]  # the CLI's note on a defaulted warm-up no longer applies
    # The saved run's schedule, rebuilt only to read its LR: this run's --stop-after (which may lie
    # past the saved run's end, the point of a longer --steps) is no part of it, and TrainConfig
    # refuses a --stop-after beyond its --steps.
    saved_schedule = dataclasses.replace(t, steps=before, stop_after=None)
    was = t.lr * lr_lambda(dataclasses.replace(cfg, train=saved_schedule))(step)
    now = t.lr * lr_lambda(cfg)(step)
    head = f"note: --steps {t.steps} trains the {before}-step run of {str(t.resume)!r} longer"
    if was == now:
        return f"{head}, from step {step} at LR {now:.3g}"
    return f"{head}: the {t.schedule} schedule now spans {t.steps} steps, so the LR at step {step} moves from {was:.3g} to {now:.3g}"


def resuming_line(cfg: RunConfig, step: int) -> str:
    """The line a resumed run starts with: the step it continues from, the step it ends at, and
    the checkpoint, so that a log says where the run picked up (the summary's "steps N" gives
    only where it ended)."""
    t = cfg.train
    end = f"{t.steps}" if t.stop_after is None else f"{t.steps} (stopping after step {t.stop_after})"
    return f"resuming at step {step} of {end} from {str(t.resume)!r}"  # repr: a newline in the path stays one line


def shown_differences(diffs: list[str], most: int) -> str:
    """The first ``most`` of :func:`config_differences`' lines, and how many more there are."""
    return "; ".join(diffs[:most]) + (f"; and {len(diffs) - most} more" if len(diffs) > most else "")


def check_resume(cfg: RunConfig, state: Optional[dict[str, Any]] = None) -> Optional[int]:
    """Refuse ``--resume`` of a checkpoint from a different run (see the module docstring).
    Returns the step the checkpoint resumes at (None without ``--resume``). ``state``: the
    checkpoint's :func:`saved_state` (read here where not given)."""
    if not cfg.train.resume:
        return None
    if state is None:
        state = saved_state(cfg.train.resume)  # read once: the run's config and the model's config.json
    saved, step, fingerprint = run_of_state(state, cfg.train.resume)
    model_as = resumed_model_as(cfg, saved, state)
    diffs = differences_from_this_run(saved, cfg, model_as=model_as)
    moved = any(d.startswith("data: ") for d in diffs) and _holds_the_saved_data(cfg, fingerprint)
    if moved:  # the same data at another path: its content is the checkpoint's
        diffs = differences_from_this_run(saved, cfg, data_as=data_of(saved), model_as=model_as)
    if diffs:
        what = "model" if any(d.split(":")[0] in saved.get("model", {}) for d in diffs) else "run"
        raise ConfigError(f"checkpoint {cfg.train.resume!r} does not fit this {what}: it was saved by a different run "
                          f"({shown_differences(diffs, 8)}); drop the flags that differ (--resume alone takes the saved run's settings) "
                          "or start a new run without --resume")
    end = cfg.train.stop_after or cfg.train.steps
    # A checkpoint at the run's last step resumes to its final evaluation and result.json (the
    # run was stopped between the two), unless that result is written already.
    written = finished_result(cfg, saved, step) if step == end else None
    if not 0 <= step <= end or written is not None:
        more = ("raise --stop-after (or drop it) to continue" if step < cfg.train.steps
                else "give a larger --steps to train it longer")
        held = f" and {str(written)!r} holds its result" if written is not None else ""
        raise ConfigError(f"--resume {cfg.train.resume!r} is at step {step}, this run ends at step {end}{held}; {more}")
    if not moved:  # a moved file's content was compared above already
        check_resume_data(cfg, fingerprint)
    return step


def saved_model_config(state: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The transformers --model's config.json fields a checkpoint's :func:`saved_state` holds (None
    in checkpoints of memtrain's GPT, of a Hub model, or older than the field)."""
    value = state.get("model_config")
    return value if isinstance(value, dict) else None


def resumed_model_as(cfg: RunConfig, saved: dict[str, Any], state: dict[str, Any]) -> Optional[str]:
    """Compare this run's transformers ``--model`` with the one the checkpoint trained, by the
    content of its config.json (:mod:`memtrain.models.identity`), not its path: another model at
    the checkpoint's path is refused naming the fields that differ (its path alone matched, so it
    resumed, or was refused only where a mirrored size differed); the same model moved or copied
    elsewhere resumes. Returns the saved ``--model`` to compare as this run's where the two
    configs agree (None: compare the paths, as for a checkpoint older than the saved config).
    ``saved``: the checkpoint's run config; ``state``: its :func:`saved_state`."""
    saved_config = saved_model_config(state)
    if saved_config is None:
        return None
    now = model_config_identity(cfg.model.model)
    if now is None:
        return None  # memtrain's GPT, or a Hub name: the run config's fields compare them
    differ = identity_differences(saved_config, now)
    if differ:
        raise ConfigError(f"--model {cfg.model.model!r} is not the model checkpoint {cfg.train.resume!r} was trained "
                          f"from: its config.json differs ({shown_differences(differ, 4)}); give that model's folder, "
                          "or start a new run without --resume")
    section = saved.get("model")
    spec = section.get("model") if isinstance(section, dict) else None
    return spec if isinstance(spec, str) else None


def finished_result(cfg: RunConfig, saved: dict[str, Any], step: int) -> Optional[Path]:
    """The result.json of a run that ended at ``step`` in this run's ``--out`` or in the saved
    run's own (a finished run's checkpoint resumed into a new folder), or None: a run stopped
    between its last step and its result (Ctrl-C in the final evaluation) has none."""
    saved_train = saved.get("train")
    saved_out = saved_train.get("out") if isinstance(saved_train, dict) else None
    for out in dict.fromkeys([cfg.train.out, *([saved_out] if isinstance(saved_out, str) else [])]):
        if result_written_at(out, step):
            return Path(out) / RESULT_NAME
    return None


def result_written_at(out: str | Path, step: int) -> bool:
    """Whether ``OUT/result.json`` records a run that ended at ``step``: the run a checkpoint at
    that step belongs to is finished, and resuming it would only replace its result (its step
    times and memory, measured while it trained) with an evaluation's. A file that is not a
    readable result of that step is left to :func:`memtrain.training.preflight.check_resumed_out`."""
    recorded = results.read_result(out)  # None: absent, or nothing this check may open (a FIFO, a huge file)
    return recorded is not None and recorded.get("steps") == step


def data_of(config: dict[str, Any]) -> Optional[str]:
    """A saved config's ``--data`` (None where a damaged config has none)."""
    section = config.get("data")
    value = section.get("data") if isinstance(section, dict) else None
    return value if isinstance(value, str) else None


def _holds_the_saved_data(cfg: RunConfig, saved: Optional[str]) -> bool:
    """Whether ``--data`` holds the content of the checkpoint's data fingerprint ``saved``
    (False where the checkpoint has none, or the data cannot be read)."""
    from memtrain.data.sources import data_fingerprint  # reads the data's files only when resuming

    if saved is None:
        return False
    try:
        return data_fingerprint(cfg.data) == saved
    except ConfigError:
        return False


def check_resume_data(cfg: RunConfig, saved: Optional[str]) -> None:
    """The data at ``--data`` holds what the checkpoint was trained on: the same path with other
    content would resume the data position (and the train/validation split) on other tokens.
    A checkpoint without a fingerprint (written before checkpoints carried one) cannot be
    compared: the run warns once it has resumed (:func:`unchecked_data_warning`)."""
    from memtrain.data.sources import data_fingerprint  # reads the data's files only when resuming

    if saved is not None and data_fingerprint(cfg.data) != saved:
        changed = "its content, or the --chat-template file that renders it," if cfg.data.chat_template else "its content"
        if cfg.data.validation_config() is not None:  # the fingerprint covers both sources: name both
            # memtrain.data imports torch: loaded only here, as above
            from memtrain.data.validation import validation_source_name

            raise ConfigError(f"--data {cfg.data.data!r} and {validation_source_name(cfg.data)} do not hold the data "
                              f"checkpoint {cfg.train.resume!r} was trained and validated on ({changed} changed since); "
                              "resume with that data, or start a new run without --resume")
        raise ConfigError(f"--data {cfg.data.data!r} does not hold the data checkpoint {cfg.train.resume!r} was "
                          f"trained on ({changed} changed since); resume with that data, or start a new run "
                          "without --resume")


def unchecked_data_warning(cfg: RunConfig) -> str:
    """What a run resumed from a checkpoint without a data fingerprint says (once, on stderr)."""
    return (f"warning: checkpoint {cfg.train.resume!r} records no data fingerprint (an older memtrain wrote it); "
            f"cannot check that --data {cfg.data.data!r} holds the data it was trained on")


def check_sharded_resume(path: str | Path, nproc: int) -> None:
    """A sharded checkpoint was written by ``nproc`` ranks and holds every rank's file."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ConfigError(f"{str(p)!r} is not a distributed checkpoint directory; a single-process checkpoint "
                          "resumes without --distributed and without --nproc-per-node")
    meta = saved_state(p)  # its meta.json, read bounded and checked as saved_run (check_resume) reads it
    world = meta.get("world_size") if isinstance(meta, dict) else None
    if not (isinstance(world, int) and not isinstance(world, bool) and world > 0):
        from memtrain.checkpoints.exact import DamagedCheckpoint, damaged  # torch: only for --resume

        # else the line below asked for --nproc-per-node None (or -5, or "two")
        raise damaged(p, DamagedCheckpoint(f"its meta.json's world_size is {world!r}, not a count of ranks"))
    from memtrain.checkpoints.distributed import check_rank_count  # torch: only for --resume

    check_rank_count(p, world)  # before the count is compared: a lying count names the wrong fix
    if world != nproc:
        raise ConfigError(f"checkpoint {str(p)!r} was written by {world} ranks; resume with --nproc-per-node {world}")
    missing = [f"rank-{r}.pt" for r in range(nproc) if not (p / f"rank-{r}.pt").is_file()]
    if missing:
        raise ConfigError(f"checkpoint {str(p)!r} lacks {', '.join(missing)}; it is incomplete, resume from another one")
