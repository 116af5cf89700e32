"""Checks made before the first training step, so a run never fails at its end.

- :func:`check_destinations`: ``--out`` and ``--save`` can be written (a directory, not a
  file; a probe file can be created and removed). Today's alternative is a run that trains
  for an hour and then cannot write its result. Nothing is created by the check. What is
  there already is never lost: ``--save`` replaces only a memtrain checkpoint of this run (or
  an empty file), never another run's checkpoint, the data file, a file memtrain writes in
  ``--out``, a link, a device, a FIFO or a folder; no name memtrain writes in ``--out`` may be
  a link; a fresh ``train`` refuses
  an ``--out`` that holds an earlier run's ``result.json`` or ``metrics.jsonl``, and a resumed
  one an ``--out`` whose ``result.json`` another run wrote.
- :func:`check_vocab`: the model's vocabulary holds every token id of the tokenizer.
- :func:`memtrain.training.size_check.check_model_size`: the model's shape can be built here
  (called by :func:`check_before_launch`, the step harness, export and generate).
- :func:`check_resume`: a checkpoint given to ``--resume`` belongs to *this* run: the saved
  config agrees on everything that decides the numbers (model, data, batch, sequence,
  accumulation, schedule, seed, optimizer, precision), and the saved step lies inside the run.
  A mismatch is a ConfigError naming every differing key, raised before data is tokenized. A
  larger ``--steps`` is the same run trained longer (:func:`continue_longer`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import glob
import os
import stat
import tempfile
from pathlib import Path, PurePath
from typing import Any, Iterable, Optional

from memtrain.config.run import ConfigError, RunConfig, build_config, field_index, flatten
from memtrain.errors import shortened
from memtrain.files.guard import regular_file_problem
from memtrain.files.json_text import loads_bounded
from memtrain.files.lock import check_lock_file
from memtrain.files.results import (
    LOCK_NAME,
    METRICS_NAME,
    OUT_FILES,
    RESULT_NAME,
    TRAIN_FILES,
    longest_temp_name,
    refuse_odd_destination,
)
from memtrain.models.spec import every_decoder_linear
from memtrain.training.run_paths import anchored, launch_dir, same_file, same_place
from memtrain.training.schedule import lr_lambda
from memtrain.training.sinks import LOGGER_FOLDERS, parse_report_to
from memtrain.training.size_check import check_model_size

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


# --------------------------------------------------------------------------- destinations
def _nearest_existing(path: Path) -> Path:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _probe_dir(folder: Path) -> Optional[str]:
    """None when a file can be created in ``folder``; else why not."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".memtrain-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


def check_writable_dir(path: str | Path, flag: str) -> None:
    """``path`` is (or can become) a directory memtrain can write into."""
    p = Path(path).expanduser()
    if str(path).strip() == "":
        raise ConfigError(f"{flag} is empty; give a directory, e.g. {flag} runs/train")
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{flag} {str(p)!r} is a file; give a directory (a new or an existing one)")
    base = _nearest_existing(p.absolute())
    if not base.is_dir():
        raise ConfigError(f"{flag} {str(p)!r} cannot be created: {str(base)!r} is a file")
    why = _probe_dir(base)
    if why is not None:
        raise ConfigError(f"{flag} {str(p)!r} is not writable ({why} in {str(base)!r}); choose another {flag}")


def _path_limit(folder: Path, name: str, default: int) -> int:
    """``os.pathconf``'s limit ``name`` for ``folder`` (PC_NAME_MAX, PC_PATH_MAX), else ``default``."""
    try:
        return int(os.pathconf(folder, name))
    except (OSError, ValueError, AttributeError):
        return default


def check_name_room(folder: str | Path, names: Iterable[str], flag: str) -> None:
    """Each file memtrain writes in ``folder`` (``names``, each through a temporary file beside
    it) fits the file system's limits on a name (255 bytes) and a path (4,096): a ``--save``
    name of 235 bytes trained the whole run and then lost its checkpoint, whose temporary name
    was too long."""
    where = Path(folder)  # as memtrain passes it to the system: relative stays relative
    existing = _nearest_existing(where.absolute())  # pathconf needs a path that exists
    name_max = _path_limit(existing, "PC_NAME_MAX", 255)
    path_max = _path_limit(existing, "PC_PATH_MAX", 4096)
    for name in names:
        temp = os.fsencode(longest_temp_name(name))
        if len(temp) > name_max:
            spare = name_max - (len(temp) - len(os.fsencode(name)))
            raise ConfigError(f"{flag}: the name {shortened(name)!r} has {len(os.fsencode(name))} bytes, and the temporary "
                              f"file memtrain writes it through has {len(temp)}, over the {name_max} a name may have "
                              f"here; shorten the name to at most {spare} bytes")
        full = len(os.fsencode(str(where))) + 1 + len(temp)
        if full >= path_max:
            raise ConfigError(f"{flag} {shortened(str(folder))!r}: the path of {name} there, with its temporary name, "
                              f"has {full:,} bytes, over the {path_max:,} a path may have here; give a shorter path")


def check_writable_file(path: str | Path, flag: str) -> None:
    """``path`` is (or can become) a file memtrain can replace atomically."""
    p = Path(path).expanduser()
    if str(path).strip() == "":
        raise ConfigError(f"{flag} is empty; give a file path, e.g. {flag} runs/ckpt.pt")
    if p.is_dir():
        raise ConfigError(f"{flag} {str(p)!r} is a directory; give a file path inside it, e.g. {str(p / 'ckpt.pt')!r}")
    check_writable_dir(p.parent if str(p.parent) else Path("."), f"{flag} (its folder)")
    check_name_room(p.parent, [p.name], flag)


def check_destinations(cfg: RunConfig, fresh_out: bool = False) -> None:
    """Every place this run will write, checked before anything runs. ``fresh_out`` (the
    ``train`` command, which writes result.json and metrics.jsonl): a folder holding an earlier
    run's results is refused unless this run resumes."""
    t = cfg.train
    check_writable_dir(t.out, "--out")
    if t.save is not None:
        if cfg.technique.distributed != "none":
            check_writable_dir(t.save, "--save")  # a sharded checkpoint is a directory
        else:
            check_writable_file(t.save, "--save")
        check_save_target(cfg)
    out = Path(t.out)  # "~" already expanded (TrainConfig)
    check_name_room(out, TRAIN_FILES, "--out")
    check_out_outside_data(out, cfg.data.data, TRAIN_FILES)
    check_out_names(out, "--out")
    check_logger_folders(out, t.report_to)
    if fresh_out and not t.resume:
        check_fresh_out(out)
    elif fresh_out:
        check_resumed_out(out, cfg)


def check_logger_folders(out: Path, report_to: str) -> None:
    """The folder a --report-to logger writes into (OUT/tensorboard, OUT/wandb) is a folder, not a
    link: the loggers would follow one and write their event files wherever it points."""
    for name in parse_report_to(report_to):
        path = out / LOGGER_FOLDERS[name]
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            what = "a symbolic link" if path.is_symlink() else "not a folder"
            raise ConfigError(f"--out {str(out)!r}: {LOGGER_FOLDERS[name]} (where --report-to {name} writes) is {what}; "
                              "memtrain does not write through links: remove it or choose another --out")


def check_out_names(out: Path, flag: str = "--out") -> None:
    """No name memtrain writes in ``out`` is a link, a folder, a device or a FIFO (every write
    there would be refused at its end: refuse it before the first step)."""
    for name in OUT_FILES:
        if name == LOCK_NAME:
            check_lock_file(out, flag)  # the lock's own words, whichever check meets it first
        else:
            refuse_odd_destination(out / name, f"{flag} {str(out)!r}: {name}")


def check_out_outside_data(out: str | Path, data: str, names: Iterable[str], flag: str = "--out") -> None:
    """No file memtrain writes in ``out`` (``names``) is one that ``--data`` reads: an --out in
    (or equal to) a --data folder, or one a --data glob matches (``corpus/*.jsonl`` and
    ``--out corpus``), made the next run, a resume or a bench's next row read result.json,
    metrics.jsonl or results.jsonl as text to train on (or refuse it, the data's fingerprint
    changed). A glob is matched as the data reads it (:func:`glob_lists`: ``**`` any number of levels;
    :func:`glob_reads_through_links`: through links below its wildcard parts)."""
    if data == "default" or data.startswith("hf:"):
        return
    from memtrain.data.sources import SUPPORTED_SUFFIXES  # memtrain.data loads torch: not for --help

    read = [name for name in names if Path(name).suffix.lower() in SUPPORTED_SUFFIXES]
    # Links and ".." resolved on both sides: `--data corpus_link --out corpus/run` (or a glob through
    # the link, or `../corpus`) named one folder two ways and was let through. realpath leaves a
    # glob's wildcard parts, which exist as no file, as they are.
    target = Path(os.path.realpath(Path(out).expanduser()))
    source = Path(data).expanduser()
    real_source = Path(os.path.realpath(source))
    if glob.has_magic(data):
        hit = next((n for n in read if glob_lists(real_source, target / n)), None) or glob_reads_through_links(
            data, target, read)
    else:
        inside = source.is_dir() and (target == real_source or real_source in target.parents)
        hit = read[0] if inside and read else None
    if hit is not None:
        raise ConfigError(f"{flag} {str(out)!r} is where --data {data!r} reads: the {hit} memtrain writes there would be "
                          "read as text to train on by the next run (or a resumed one); choose an --out outside the data")


def glob_reads_through_links(data: str, target: Path, names: list[str]) -> Optional[str]:
    """The first of ``names`` in the folder ``target`` (resolved) that the --data glob ``data``
    reads through a link below one of its wildcard parts (``corpus/sub`` a link elsewhere,
    ``--data 'corpus/**/*.jsonl'``, ``--out`` under the link's target), or that a file the glob
    lists now links to. realpath resolves only the parts before the first wildcard, and glob's
    wildcards (``**`` included) follow links to folders, as the reader's ``glob.glob`` does."""
    # As given (relative stays relative, ".." kept): glob walks it so, and a working folder whose
    # name holds "[" would be read as a wildcard.
    pattern = Path(data).expanduser()
    wanted = {target / name: name for name in names}
    for listed in glob.iglob(str(pattern), recursive=True):  # what the reader reads now
        hit = wanted.get(Path(os.path.realpath(listed)))
        if hit is not None:
            return hit
    return next((hit for folder in _folders_walked(pattern) if (hit := _read_through(pattern, folder, target, names))),
                None)


def _folders_walked(pattern: Path) -> Iterable[str]:
    """Every existing folder the glob ``pattern`` walks below its first wildcard part, as glob
    spells it (a trailing separator makes glob list folders only)."""
    parts = pattern.parts
    first = next(i for i, part in enumerate(parts) if glob.has_magic(part))
    for end in range(first + 1, len(parts)):
        yield from glob.iglob(os.path.join(*parts[:end], ""), recursive=True)


def _read_through(pattern: Path, folder: str, target: Path, names: list[str]) -> Optional[str]:
    """The first of ``names`` in ``target`` that ``pattern`` lists when ``target`` lies inside the
    real path of ``folder`` and is spelled through it: the out folder need not exist yet."""
    real = Path(os.path.realpath(folder))
    if real != target and real not in target.parents:
        return None
    spelled = Path(folder) / target.relative_to(real)
    return next((name for name in names if glob_lists(pattern, spelled / name)), None)


def glob_lists(pattern: PurePath, path: PurePath) -> bool:
    """Whether ``glob.glob(pattern, recursive=True)`` (how --data reads a glob) would list ``path``,
    without the files existing yet. pathlib's ``match`` (Python 3.11) takes ``**`` for one folder
    level, so ``corpus/**/*.jsonl`` let ``--out corpus/deep/run`` through, whose metrics.jsonl the
    next run read as data. Both must be absolute or both relative."""
    return _parts_listed(pattern.parts, path.parts)


def _parts_listed(pattern: tuple[str, ...], names: tuple[str, ...]) -> bool:
    if not pattern:
        return not names
    head, rest = pattern[0], pattern[1:]
    if head == "**":  # zero levels, or one more (never a hidden one, as glob walks) and again
        return _parts_listed(rest, names) or (
            bool(names) and not names[0].startswith(".") and _parts_listed(pattern, names[1:]))
    if not names:
        return False
    # glob's wildcards skip names starting with "." unless the pattern's part starts with one too.
    if glob.has_magic(head) and names[0].startswith(".") and not head.startswith("."):
        return False
    return fnmatch.fnmatchcase(names[0], head) and _parts_listed(rest, names[1:])


def check_fresh_out(out: Path) -> None:
    """A new run never writes over an earlier run's result.json or metrics.jsonl (its loss
    curve would be lost and the two files would describe different runs)."""
    held = [n for n in (RESULT_NAME, METRICS_NAME) if os.path.lexists(out / n)]
    if held:
        raise ConfigError(f"--out {str(out)!r} already holds {' and '.join(held)} of an earlier run; choose a new "
                          "--out, or continue that run with --resume CHECKPOINT")


def check_resumed_out(out: Path, cfg: RunConfig) -> None:
    """A resumed run replaces ``result.json`` and appends to ``metrics.jsonl``: allowed in its own
    folder (or a new one), refused where the result.json was written by a different run (other
    settings that decide the numbers, as :func:`check_resume` compares them), whose result and
    loss curve it would overwrite and extend. A folder with only ``metrics.jsonl`` (a run killed
    before its result) cannot be told apart and is continued."""
    path = out / RESULT_NAME
    if not os.path.lexists(path):
        return
    try:
        recorded = loads_bounded(path.read_bytes())
    except (OSError, ValueError):
        recorded = None
    config = recorded.get("config") if isinstance(recorded, dict) else None
    if not isinstance(config, dict):
        raise ConfigError(f"--out {str(out)!r} holds a result.json that records no run config; a resumed run would "
                          "replace it: choose a new --out")
    data_as = None
    if cfg.train.resume:  # written by the resumed run from the folder it was launched from
        state = _saved_state(cfg.train.resume)
        where = launch_dir(state, cfg.train.resume)
        config = anchored(config, where)
        # The data was compared with the checkpoint's (check_resume, by content where it moved):
        # the result.json's run is the checkpoint's where it records the checkpoint's data.
        data_as = _data_of(anchored(state["config"], where))
    diffs = differences_from_this_run(config, cfg, data_as=data_as)
    if diffs:
        raise ConfigError(f"--out {str(out)!r} holds the result.json of a different run ({_shown(diffs, 4)}); resuming there "
                          "would replace it: choose a new --out, or the resumed run's own")


def check_save_target(cfg: RunConfig) -> None:
    """``--save`` replaces only what memtrain wrote: a checkpoint (or an empty file, for a
    single-file checkpoint; an empty folder, for a sharded one) or a new name; never a link,
    a device, a FIFO, the data file or a file memtrain writes in ``--out``."""
    save = Path(cfg.train.save or "")  # "~" already expanded (TrainConfig)
    sharded = cfg.technique.distributed != "none"
    try:
        st: Optional[os.stat_result] = os.lstat(save)
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISLNK(st.st_mode):
        raise ConfigError(f"--save {str(save)!r} is a symbolic link; memtrain does not write through links: "
                          "give the real path or a new name")
    if st is not None and not sharded and not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"--save {str(save)!r} is not a regular file (a device, FIFO or socket); give a new file path")
    if Path(os.path.realpath(save.parent)) == Path(os.path.realpath(cfg.train.out)) \
            and save.name in OUT_FILES:
        raise ConfigError(f"--save {str(save)!r} is a file memtrain writes in --out; give another name, e.g. "
                          f"{str(save.with_name('ckpt.pt'))!r}")
    if st is not None and _is_data_file(save, cfg.data.data):
        raise ConfigError(f"--save {str(save)!r} is the training data (--data); give another path")
    if st is None:
        return
    saved: Optional[dict[str, Any]] = None
    if sharded:
        if stat.S_ISDIR(st.st_mode) and any(save.iterdir()) and not (save / "meta.json").is_file():
            raise ConfigError(f"--save {str(save)!r} is a folder holding files that are not a memtrain checkpoint; "
                              "give a new or empty folder")
        if (save / "meta.json").is_file():
            saved = _saved_config(save)
    elif st.st_size > 0:
        saved = _saved_config(save)
        if saved is None:
            raise ConfigError(f"--save {str(save)!r} exists and is not a memtrain checkpoint; memtrain replaces only "
                              "its own checkpoints: give a new name")
    if saved is not None and not _resumes_from(save, cfg):
        check_saved_by_this_run(save, saved, cfg)


def _resumes_from(save: Path, cfg: RunConfig) -> bool:
    """Whether ``--save`` is the checkpoint this run resumes: :func:`check_resume` compares it
    then, and says what differs in a resume's words (not "choose a new --save")."""
    resume = cfg.train.resume
    if not resume:
        return False
    try:
        return os.path.samefile(save, Path(resume).expanduser())
    except OSError:
        return False


def _saved_config(path: Path) -> Optional[dict[str, Any]]:
    """The run config of the memtrain checkpoint at ``path`` (read as :func:`saved_run` does,
    without running code); None where ``path`` is not one."""
    try:
        return saved_run(path)[0]
    except ConfigError:
        return None


def check_saved_by_this_run(save: Path, saved: dict[str, Any], cfg: RunConfig) -> None:
    """``--save`` replaces a checkpoint of this run (a re-run, or a resumed run saving where it
    resumed from) but not another run's, which would be lost at the first save: the same
    comparison as :func:`check_resume`."""
    diffs = differences_from_this_run(saved, cfg)
    if diffs:
        raise ConfigError(f"--save {str(save)!r} holds the checkpoint of a different run ({_shown(diffs, 4)}); "
                          "saving there would replace it: choose a new --save, or resume that run with --resume")


def _is_data_file(path: Path, data: str) -> bool:
    """Whether the existing ``path`` is one of the files ``--data`` names."""
    if data == "default" or data.startswith("hf:"):
        return False
    # memtrain.data imports torch: loaded only for a local data path
    from memtrain.data.sources import resolve_local_files

    try:
        files = resolve_local_files(data)
    except (ConfigError, OSError):
        return False  # the data check itself reports a bad --data
    try:
        return any(os.path.samefile(path, f) for f in files)
    except OSError:
        return False


def check_vocab(cfg: RunConfig) -> None:
    """The embedding table holds every id the tokenizer can emit (else an index error after
    a long tokenization)."""
    from memtrain.data.tokenizer import N_VOCAB, TOKENIZER_NAME  # torch loads only when this runs
    from memtrain.models import is_hf  # torch loads only when this runs

    if is_hf(cfg):
        return  # a transformers model brings its own tokenizer; memtrain.models checks that pair
    if cfg.model.vocab_size < N_VOCAB:
        raise ConfigError(f"--vocab-size {cfg.model.vocab_size} is smaller than the {TOKENIZER_NAME} tokenizer's "
                          f"{N_VOCAB} ids; use --vocab-size {N_VOCAB} (or more) to train on text")


# --------------------------------------------------------------------------- resume
def saved_run(path: str | Path) -> tuple[dict[str, Any], int, Optional[str]]:
    """The saved config, step and data fingerprint (None in checkpoints that predate it) of a
    checkpoint (single file or sharded directory). The config's relative paths are made
    absolute against the folder the run was launched from, where that is not this process's
    (:mod:`memtrain.training.run_paths`).

    Reads no tensor data: a sharded checkpoint's meta.json, or a single file memory-mapped
    with ``weights_only=True`` (only the small entries are touched)."""
    state = _saved_state(path)
    fingerprint = state.get("data_fingerprint")
    config = anchored(state["config"], launch_dir(state, path))
    return config, state["step"], fingerprint if isinstance(fingerprint, str) else None


def _saved_state(path: str | Path) -> dict[str, Any]:
    """A checkpoint's small entries (config, step, fingerprint, launch folder), checked to hold a
    run config and a step."""
    p = Path(path).expanduser()
    if p.is_dir():
        meta_path = p / "meta.json"
        if not meta_path.is_file():
            raise ConfigError(f"--resume {str(p)!r} is a directory without meta.json; it is not a memtrain checkpoint")
        why = regular_file_problem(meta_path, p)  # e.g. a link out of the checkpoint
        if why is not None:
            raise ConfigError(f"checkpoint {str(p)!r} is refused: its meta.json is {why}; resume only from "
                              "checkpoints memtrain wrote")
        try:
            state = loads_bounded(meta_path.read_text())
        except (OSError, UnicodeDecodeError, ValueError):
            raise ConfigError(f"cannot read {str(meta_path)!r}; it is not a memtrain checkpoint") from None
    elif p.is_file():
        # memtrain.checkpoints imports torch: loaded only for --resume
        from memtrain.checkpoints.exact import load_plain

        try:
            state = load_plain(p, mmap=True)
        except ConfigError:  # it says what to install
            raise
        except Exception as exc:  # truncated, foreign, or holding more than plain data
            raise ConfigError(f"cannot read checkpoint {str(p)!r} ({type(exc).__name__}); it is not a memtrain checkpoint") from None
    else:
        raise ConfigError(f"checkpoint {str(p)!r} not found; check --resume")
    if not isinstance(state, dict) or not isinstance(state.get("config"), dict) or not isinstance(state.get("step"), int):
        raise ConfigError(f"checkpoint {str(p)!r} holds no run config or step; it was not written by this memtrain version")
    # A negative step, else check_resume, comparing it with this run's end, asks for another --stop-after.
    from memtrain.checkpoints.exact import DamagedCheckpoint, check_step, damaged  # torch: only for --resume

    try:
        check_step(state["step"])
    except DamagedCheckpoint as exc:
        raise damaged(p, exc) from None
    return state


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


def resumed_settings(path: str | Path, launched: bool = False,
                     out_given: bool = False) -> tuple[dict[str, Any], Optional[str]]:
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
    wrote) is one the user did not name."""
    saved, _, _ = saved_run(path)
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
            old = old_section.get(key, "<missing>")  # type: ignore[union-attr]  # old_section is a dict: non-dicts were replaced by {}
            if not same_place(key, old, value) and not _same_lora_targets(key, old, value):
                diffs.append(f"{key}: {old!r} -> {value!r}")
    return diffs


def _same_lora_targets(key: str, old: Any, new: Any) -> bool:
    """Whether ``old`` and ``new`` are two names of every decoder Linear as LoRA targets: a
    transformers run saved before its config recorded peft's ``all-linear`` recorded our GPT's
    default list for the same adapters, and still resumes."""
    return key == "lora_targets" and isinstance(old, str) and every_decoder_linear(old) and every_decoder_linear(new)


def differences_from_this_run(saved: dict[str, Any], cfg: RunConfig, data_as: Optional[str] = None) -> list[str]:
    """:func:`config_differences` of a saved config (a checkpoint's, a result.json's) from this
    run: none where it is this run's, or, when this run trains a resumed run longer
    (:func:`continue_longer`), that run's (the same settings with its shorter ``--steps``).
    ``data_as``: the ``--data`` to compare as this run's, where the run's own data path is not
    the one to compare (resuming, the data was compared with the checkpoint's by its content:
    a copied or moved data file still resumes; :func:`check_resume`)."""
    now = cfg.to_dict()
    if data_as is not None:
        now = {**now, "data": {**now["data"], "data": data_as}}
    diffs = config_differences(saved, now)
    shorter = getattr(cfg.train, "continues_steps", None)
    if diffs and shorter is not None:  # the larger --steps is no difference: only the others are
        return config_differences(saved, {**now, "train": {**now["train"], "steps": shorter}})
    return diffs


def _count_or_none(value: Any) -> Optional[int]:
    """``value`` when it is a whole number >= 0 (a saved config's step count), else None: a
    damaged or crafted checkpoint's field neither extends a run nor sets its warm-up."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def continue_longer(cfg: RunConfig) -> Optional[str]:
    """Train longer: ``--resume`` with a ``--steps`` larger than the saved run's continues that
    run, its LR schedule stretched over the new ``--steps`` from the step it resumes at (as the
    Trainer does when it resumes with a larger ``max_steps``): under the cosine schedule the LR
    rises back to where the longer schedule has it. The warm-up stays the one that ran: a
    warm-up no setting names would otherwise grow with ``--steps`` (10% of it) and refuse the
    checkpoint as another run's; one set on the command line is compared as any setting is.

    Returns the line that says so (None when this run does not resume a shorter run), and
    sets ``cfg.train.warmup_steps`` to the saved warm-up where it was defaulted. Called before
    the other checks compare the saved config with this one (:func:`check_resume`)."""
    t = cfg.train
    if not t.resume:
        return None
    saved, step, _ = saved_run(t.resume)
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


def _shown(diffs: list[str], most: int) -> str:
    """The first ``most`` of :func:`config_differences`' lines, and how many more there are."""
    return "; ".join(diffs[:most]) + (f"; and {len(diffs) - most} more" if len(diffs) > most else "")


def check_resume(cfg: RunConfig) -> None:
    """Refuse ``--resume`` of a checkpoint from a different run (see the module docstring)."""
    if not cfg.train.resume:
        return
    saved, step, fingerprint = saved_run(cfg.train.resume)
    diffs = differences_from_this_run(saved, cfg)
    moved = any(d.startswith("data: ") for d in diffs) and _holds_the_saved_data(cfg, fingerprint)
    if moved:  # the same data at another path: its content is the checkpoint's
        diffs = differences_from_this_run(saved, cfg, data_as=_data_of(saved))
    if diffs:
        what = "model" if any(d.split(":")[0] in saved.get("model", {}) for d in diffs) else "run"
        raise ConfigError(f"checkpoint {cfg.train.resume!r} does not fit this {what}: it was saved by a different run "
                          f"({_shown(diffs, 8)}); drop the flags that differ (--resume alone takes the saved run's settings) "
                          "or start a new run without --resume")
    end = cfg.train.stop_after or cfg.train.steps
    if not 0 <= step < end:
        more = ("raise --stop-after (or drop it) to continue" if step < cfg.train.steps
                else "give a larger --steps to train it longer")
        raise ConfigError(f"--resume {cfg.train.resume!r} is at step {step}, this run ends at step {end}; {more}")
    if not moved:  # a moved file's content was compared above already
        check_resume_data(cfg, fingerprint)


def _data_of(config: dict[str, Any]) -> Optional[str]:
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
        raise ConfigError(f"--data {cfg.data.data!r} does not hold the data checkpoint {cfg.train.resume!r} was "
                          "trained on (its content changed since); resume with that data, or start a new run "
                          "without --resume")


def unchecked_data_warning(cfg: RunConfig) -> str:
    """What a run resumed from a checkpoint without a data fingerprint says (once, on stderr)."""
    return (f"warning: checkpoint {cfg.train.resume!r} records no data fingerprint (an older memtrain wrote it); "
            f"cannot check that --data {cfg.data.data!r} holds the data it was trained on")


# --------------------------------------------------------------------------- launch
def check_before_launch(cfg: RunConfig, nproc: int) -> None:
    """What ``memtrain train --nproc-per-node N`` checks before it starts any rank: the same
    checks each rank makes (destinations, vocabulary, resume), the strategy and its
    combinations, and a sharded checkpoint's rank count and per-rank files, so that bad
    input costs no process start and no rendezvous."""
    from memtrain.distributed.validation import check_combination  # torch loads only when this runs
    from memtrain.runtime.env import resolve_device  # torch loads only when this runs

    if cfg.technique.distributed == "none":
        raise ConfigError(f"--nproc-per-node {nproc} starts data-parallel ranks; add --distributed ddp "
                          "(or zero1, zero2, fsdp)")
    continue_longer(cfg)  # a longer --steps on --resume keeps the saved warm-up, before the configs are compared
    check_resume(cfg)  # before --out and --save are compared (train's order)
    check_destinations(cfg, fresh_out=True)
    check_vocab(cfg)
    device = resolve_device(cfg.train.device)
    check_model_size(cfg.model, device, cfg.technique.precision)
    check_combination(cfg, device)
    if device.type == "cuda":
        check_gpu_count(nproc)
    if cfg.train.resume:
        check_sharded_resume(cfg.train.resume, nproc)


def check_gpu_count(nproc: int) -> None:
    """Each CUDA rank takes its own GPU (its local rank): more ranks than visible GPUs is refused
    before any starts. Otherwise the ranks past them refuse at start-up while the others wait
    for them at the rendezvous."""
    import torch  # loads only for a CUDA launch: the CLI checks before any command

    from memtrain.runtime.env import visible_gpus_phrase  # as torch: only for a CUDA launch

    count = torch.cuda.device_count()
    if nproc > count:
        raise ConfigError(f"--nproc-per-node {nproc} starts one rank per GPU, but {visible_gpus_phrase(count)}; "
                          f"use --nproc-per-node {count} or fewer")


def check_sharded_resume(path: str | Path, nproc: int) -> None:
    """A sharded checkpoint was written by ``nproc`` ranks and holds every rank's file."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ConfigError(f"{str(p)!r} is not a distributed checkpoint directory; a single-process checkpoint "
                          "resumes without --distributed and without --nproc-per-node")
    meta = loads_bounded((p / "meta.json").read_text())  # saved_run (check_resume) has read it
    world = meta.get("world_size") if isinstance(meta, dict) else None
    if not (isinstance(world, int) and not isinstance(world, bool) and world > 0):
        from memtrain.checkpoints.exact import DamagedCheckpoint, damaged  # torch: only for --resume

        # else the line below asked for --nproc-per-node None (or -5, or "two")
        raise damaged(p, DamagedCheckpoint(f"its meta.json's world_size is {world!r}, not a count of ranks"))
    if world != nproc:
        raise ConfigError(f"checkpoint {str(p)!r} was written by {world} ranks; resume with --nproc-per-node {world}")
    missing = [f"rank-{r}.pt" for r in range(nproc) if not (p / f"rank-{r}.pt").is_file()]
    if missing:
        raise ConfigError(f"checkpoint {str(p)!r} lacks {', '.join(missing)}; it is incomplete, resume from another one")
