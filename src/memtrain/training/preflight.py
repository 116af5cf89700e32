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
- :func:`memtrain.training.resume_check.check_resume`: a checkpoint given to ``--resume`` belongs
  to *this* run (called by :func:`check_before_launch` and the train loop).
"""

from __future__ import annotations

import fnmatch
import glob
import os
import stat
import tempfile
from pathlib import Path, PurePath
from typing import Any, Iterable, Optional

from memtrain.config.run import ConfigError, RunConfig
from memtrain.errors import shortened
from memtrain.files import results
from memtrain.files.json_file import TOO_BIG, JsonFileProblem, read_json_file
from memtrain.files.lock import check_lock_file, refuse_folder_in_use
from memtrain.files.results import (
    LOCK_NAME,
    METRICS_NAME,
    OUT_FILES,
    RESULT_NAME,
    TRAIN_FILES,
    longest_temp_name,
    refuse_odd_destination,
)
from memtrain.training.resume_check import (
    check_resume,
    check_sharded_resume,
    continue_longer,
    data_of,
    differences_from_this_run,
    resume_state,
    resumed_model_as,
    saved_run,
    saved_state,
    shown_differences,
)
from memtrain.training.run_paths import anchored, launch_dir
from memtrain.training.sinks import LOGGER_FOLDERS, parse_report_to
from memtrain.training.size_check import check_cpu_rank_count, check_model_size


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


def check_folder_room(folder: str | Path, names: Iterable[str], flag: str) -> None:
    """``folder``, one memtrain creates, has a name the file system takes, and each of ``names``
    written in it fits (:func:`check_name_room`): a bench row's folder (``OUT/rows/NAME``) is made,
    and its files written, only when that row runs, after the rows before it."""
    where = Path(folder)
    name_max = _path_limit(_nearest_existing(where.absolute()), "PC_NAME_MAX", 255)
    size = len(os.fsencode(where.name))
    if size > name_max:
        raise ConfigError(f"{flag}: the folder name {shortened(where.name)!r} has {size} bytes, over the {name_max} "
                          "a name may have here; shorten it")
    check_name_room(where, names, flag)


def check_writable_file(path: str | Path, flag: str) -> None:
    """``path`` is (or can become) a file memtrain can replace atomically."""
    p = Path(path).expanduser()
    if str(path).strip() == "":
        raise ConfigError(f"{flag} is empty; give a file path, e.g. {flag} runs/ckpt.pt")
    if p.is_dir():
        raise ConfigError(f"{flag} {str(p)!r} is a directory; give a file path inside it, e.g. {str(p / 'ckpt.pt')!r}")
    check_writable_dir(p.parent if str(p.parent) else Path("."), f"{flag} (its folder)")
    check_name_room(p.parent, [p.name], flag)


def check_destinations(cfg: RunConfig, fresh_out: bool = False, resumed: Optional[dict[str, Any]] = None) -> None:
    """Every place this run will write, checked before anything runs. ``fresh_out`` (the
    ``train`` command, which writes result.json and metrics.jsonl): a folder holding an earlier
    run's results is refused unless this run resumes. ``resumed``: the ``--resume``
    checkpoint's small entries, where the caller read them already
    (:func:`memtrain.training.resume_check.resume_state`)."""
    t = cfg.train
    check_writable_dir(t.out, "--out")
    if t.save is not None:
        if cfg.technique.distributed != "none":
            check_writable_dir(t.save, "--save")  # a sharded checkpoint is a directory
        else:
            check_writable_file(t.save, "--save")
        check_save_target(cfg, resumed)
    out = Path(t.out)  # "~" already expanded (TrainConfig)
    check_name_room(out, TRAIN_FILES, "--out")
    check_out_outside_data(out, cfg.data.data, TRAIN_FILES)
    check_out_names(out, "--out")
    check_logger_folders(out, t.report_to)
    if fresh_out and not t.resume:
        check_fresh_out(out)
    elif fresh_out:
        check_resumed_out(out, cfg, resumed)


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
    :func:`glob_reads_through_links`: through links below its wildcard parts); a glob's, a folder's
    or a file's entry that links to one of ``names`` is seen by :func:`linked_to_written`."""
    if data == "default" or data.startswith("hf:"):
        return
    from memtrain.data.sources import SUPPORTED_SUFFIXES, listed_entries  # memtrain.data loads torch: not for --help

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
    # A file the reader lists now that links to one memtrain writes (`corpus/x.txt ->
    # ../run/metrics.jsonl`, dangling until the run writes it): the folder reader's rglob follows it.
    hit = hit or linked_to_written(listed_entries(data), target, read)
    if hit is not None:
        raise ConfigError(f"{flag} {str(out)!r} is where --data {data!r} reads: the {hit} memtrain writes there would be "
                          "read as text to train on by the next run (or a resumed one); choose an --out outside the data")


def glob_reads_through_links(data: str, target: Path, names: list[str]) -> Optional[str]:
    """The first of ``names`` in the folder ``target`` (resolved) that the --data glob ``data``
    reads through a link below one of its wildcard parts (``corpus/sub`` a link elsewhere,
    ``--data 'corpus/**/*.jsonl'``, ``--out`` under the link's target). realpath resolves only the parts before the first wildcard, and glob's
    wildcards (``**`` included) follow links to folders, as the reader's ``glob.glob`` does."""
    # As given (relative stays relative, ".." kept): glob walks it so, and a working folder whose
    # name holds "[" would be read as a wildcard.
    pattern = Path(data).expanduser()
    return next((hit for folder in _folders_walked(pattern) if (hit := _read_through(pattern, folder, target, names))),
                None)


def linked_to_written(listed: Iterable[Path], target: Path, names: list[str]) -> Optional[str]:
    """The first of ``names`` in the folder ``target`` (resolved) that an entry of ``listed`` (what
    the reader lists, :func:`memtrain.data.sources.listed_entries`) is, or links to."""
    wanted = {target / name: name for name in names}
    return next((hit for entry in listed if (hit := wanted.get(Path(os.path.realpath(entry))))), None)


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


def check_resumed_out(out: Path, cfg: RunConfig, resumed: Optional[dict[str, Any]] = None) -> None:
    """A resumed run replaces ``result.json`` and appends to ``metrics.jsonl``: allowed in its own
    folder (or a new one), refused where the result.json was written by a different run (other
    settings that decide the numbers, as :func:`check_resume` compares them), whose result and
    loss curve it would overwrite and extend. A folder with only ``metrics.jsonl`` (a run killed
    before its result) cannot be told apart and is continued. ``resumed``: as
    :func:`check_destinations` takes it."""
    path = out / RESULT_NAME
    if not os.path.lexists(path):
        return
    limit = results.MAX_WHOLE_JSON_BYTES
    try:  # a huge (or sparse) file is refused from its size, never read whole into memory
        recorded = read_json_file(path, limit)
    except JsonFileProblem as exc:
        if exc.kind == TOO_BIG:
            raise ConfigError(f"--out {str(out)!r} holds a result.json of {path.stat().st_size:,} bytes, more than "
                              f"memtrain reads back ({limit:,}); a resumed run would replace it: choose a new --out") from None
        recorded = None
    config = recorded.get("config") if isinstance(recorded, dict) else None
    if not isinstance(config, dict):
        raise ConfigError(f"--out {str(out)!r} holds a result.json that records no run config; a resumed run would "
                          "replace it: choose a new --out")
    data_as = model_as = None
    if cfg.train.resume:  # written by the resumed run from the folder it was launched from
        state = saved_state(cfg.train.resume) if resumed is None else resumed
        where = launch_dir(state, cfg.train.resume)
        config = anchored(config, where)
        # The data was compared with the checkpoint's (check_resume, by content where it moved):
        # the result.json's run is the checkpoint's where it records the checkpoint's data.
        data_as = data_of(anchored(state["config"], where))
        model_as = resumed_model_as(cfg, anchored(state["config"], where), state)  # the model too, by its config.json
    diffs = differences_from_this_run(config, cfg, data_as=data_as, model_as=model_as)
    if diffs:
        raise ConfigError(f"--out {str(out)!r} holds the result.json of a different run ({shown_differences(diffs, 4)}); resuming there "
                          "would replace it: choose a new --out, or the resumed run's own")


def check_save_target(cfg: RunConfig, resumed: Optional[dict[str, Any]] = None) -> None:
    """``--save`` replaces only what memtrain wrote: a checkpoint (or an empty file, for a
    single-file checkpoint; an empty folder, for a sharded one) or a new name; never a link,
    a device, a FIFO, the data file or a file memtrain writes in ``--out``. ``resumed``: as
    :func:`check_destinations` takes it (a ``--save`` that is the resumed checkpoint is not
    read again)."""
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
    if resumed is not None and _resumes_from(save, cfg):
        return  # the checkpoint this run resumes: check_resume compared it with this run already
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
        raise ConfigError(f"--save {str(save)!r} holds the checkpoint of a different run ({shown_differences(diffs, 4)}); "
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
    resumed = resume_state(cfg)  # the checkpoint's small entries, read once for every check below
    continue_longer(cfg, resumed)  # a longer --steps on --resume keeps the saved warm-up, before the configs are compared
    check_resume(cfg, resumed)  # before --out and --save are compared (train's order)
    refuse_folder_in_use(Path(cfg.train.out))  # a running run's folder: said as in use, as train says it
    check_destinations(cfg, fresh_out=True, resumed=resumed)
    check_vocab(cfg)
    device = resolve_device(cfg.train.device)
    check_model_size(cfg.model, device, cfg.technique.precision)
    check_combination(cfg, device)
    if device.type == "cuda":
        check_gpu_count(nproc)
    else:
        check_cpu_rank_count(nproc)
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
