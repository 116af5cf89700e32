"""Run a list of techniques, each in its own subprocess, appending results as they finish.

Resumable: a row already in ``results.jsonl`` with status ok, the same resolved config and the
same bench settings (:func:`bench_settings`: what every row shares, the max-batch search among
them) is skipped (``force`` reruns it). After every row the report's tables (Markdown, CSV, JSON) are
rebuilt, so an interrupted bench still leaves a complete report of what finished; the plots are
drawn by the caller (``memtrain bench`` draws them at the end and when interrupted;
``memtrain report DIR`` redraws everything).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Optional

from memtrain.bench.eta import BenchEta
from memtrain.bench.process import clean_stale_row_dirs, row_tmpdir, start_row, stop_row
from memtrain.bench.scales import SCALE_BUDGET, SCALE_MAX_BATCH, fitted_scale_overrides, row_base_layers
from memtrain.bench.technique_sets import describe, noise_twin, technique_overrides
from memtrain.config.layers import normalized_layers, refuse_long_warmup, warmup_named
from memtrain.config.run import (
    ConfigError,
    RunConfig,
    TechniqueConfig,
    build_config,
    flatten,
    parse_size,
    val_data_message,
)
from memtrain.files.bench_record import new_record, record_bench
from memtrain.files.bench_store import append_result, read_results, row_settings, rows_under, select_rows
from memtrain.files.lock import FolderLock
from memtrain.files.results import remove_stale_temps
from memtrain.report import write_report

TECHNIQUE_KEYS = frozenset(f.name for f in fields(TechniqueConfig))


@dataclass
class BenchOptions:
    """What to compare and how."""

    techniques: list[str]
    scale: str = "quick"
    out: Path = Path("runs/bench")
    overrides: dict[str, Any] = field(default_factory=dict)  # shared by every row (data, model, ...)
    file_layer: dict[str, Any] = field(default_factory=dict)  # from --config
    force: bool = False
    maxbatch: bool = True
    memory_budget: Optional[str] = None
    max_batch: Optional[int] = None
    multiple_of: int = 1
    progress: Optional[bool] = None  # None: a row draws its bars when stderr is a terminal
    timeout_s: Optional[float] = None
    nproc: int = 1  # processes per row (torchrun); > 1 runs rows data-parallel, ddp unless a row sets distributed=
    # The rows are the default list (the user named none): rows whose precision has no native
    # kernel on this device run in the nearest native one (bench/device_rows.py).
    substitute_slow: bool = False
    eta: bool = True  # print per-row and bench ETA lines on stderr
    command: str = ""  # the command line, for the bench record (memtrain.files.bench_record)


def config_hash(config: dict[str, Any]) -> str:
    """Identity of a row's resolved config, ignoring where its output goes."""
    c = json.loads(json.dumps(config))
    c.get("train", {}).pop("out", None)
    c.get("train", {}).pop("progress", None)
    return hashlib.sha256(json.dumps(c, sort_keys=True).encode()).hexdigest()[:16]


def bench_settings(opts: BenchOptions, rows: Optional[list[tuple[str, RunConfig]]] = None) -> dict[str, Any]:
    """What every row of the bench shares and that shapes its figures beside its own config: the
    config the rows start from (scale, ``--config``, flags) before their names' settings, the
    device type ``auto`` resolves to, the max-batch search asked for (None: ``--no-maxbatch``;
    the Max Batch column), and the processes per row. ``rows``: ``resolve_rows(opts)`` where the
    caller has them (before any device adaptation).

    The device is named too (``device_name``: the GPU model, the CPU model): rows benched on an
    H100 and then an H200, or on an AVX2-only CPU and then one with AMX, in one folder are not
    the same bench, and a report never puts their step times side by side. So is the data's
    content (``data_fingerprint``, as --resume compares it): a data file edited in place between
    two benches makes the second one's rows run again, where its path alone called them done."""
    from memtrain.data import data_fingerprint  # torch and numpy: only once a bench runs
    from memtrain.runtime.env import resolve_device  # torch-free --help/estimate/plan

    if rows is None:
        rows = resolve_rows(opts)  # the errors a bad list gets, before anything else
    try:
        base: Any = build_config(fitted_scale_overrides(opts.scale, opts.file_layer, opts.overrides), opts.file_layer,
                                 opts.overrides).to_dict()
        base["train"].pop("out", None)
        base["train"].pop("progress", None)
    except ConfigError:
        # Valid only beside a row's own settings (a --config key that needs a technique): the
        # layers as given name it.
        base = [fitted_scale_overrides(opts.scale, opts.file_layer, opts.overrides), opts.file_layer, opts.overrides]
    device = resolve_device(rows[0][1].train.device)
    return {"scale": opts.scale, "config": base, "device": device.type, "device_name": hardware_name(device),
            "data_fingerprint": data_fingerprint(rows[0][1].data),
            "max_batch_search": _maxbatch_spec(opts, rows[0][1]), "nproc": opts.nproc}


def check_rows_data(rows: list[tuple[str, RunConfig]]) -> None:
    """Each local data source of ``rows`` holds a document (a ConfigError, the one line ``train``
    says, if not), checked before the folder, its lock or a row exists: an empty or unreadable
    data file made every row fail alone ("invalid") and the bench exit 1 after writing a report
    of failed rows. Reading stops at the first document; a Hub dataset is left to its rows."""
    from memtrain.data.cache import check_first_document  # reads the data: only once a bench runs
    from memtrain.models.tokenizer import data_tokenizer  # transformers' tokenizer: only for structured records

    checked: set[str] = set()
    for _, cfg in rows:
        data = cfg.data
        data.check_answer_source()  # --loss-on completion over text: train's one line, before any row
        key = repr(data) + repr(cfg.model.model)
        if key in checked or data.data.startswith("hf:"):
            continue
        checked.add(key)
        # Chat and prompt-completion records are documents only once the model's template renders
        # them: read without it, every record lacked the text field and the bench was refused.
        tokenizer = data_tokenizer(cfg) if data.data_format != "text" else None
        check_first_document(data, tokenizer)
        _check_val_first_document(data, tokenizer)


def _check_val_first_document(data: Any, tokenizer: Any) -> None:
    """A local validation source of its own (--val-data) holds a document, as :func:`check_rows_data`
    checks --data: every row validates on it; the line names --val-data."""
    from memtrain.data.cache import check_first_document  # reads the data: only once a bench runs

    val = data.validation_config()
    if val is None or val.data.startswith("hf:"):
        return
    try:
        check_first_document(val, tokenizer)
    except ConfigError as exc:
        raise ConfigError(val_data_message(str(exc))) from None


def hardware_name(device: Any) -> str:
    """The model of ``device`` (``runtime.env.device_model``: result.json's ``env.device_model``).
    On CUDA a child process reads it (:mod:`memtrain.bench.cuda_caps`): torch initialises CUDA to
    name a GPU, and the runner must not, while the rows measure their memory."""
    if getattr(device, "type", None) == "cuda":
        from memtrain.bench.cuda_caps import cuda_caps_in_child  # torch-free --help/estimate/plan

        caps = cuda_caps_in_child(device)
        return caps.name if caps is not None else "CUDA GPU (its model could not be read)"
    from memtrain.runtime.env import device_model  # torch-free --help/estimate/plan: bench has resolved a device

    return device_model(device)


def settings_hash(settings: dict[str, Any]) -> str:
    """Identity of :func:`bench_settings`: equal for every row of one bench, and for two benches
    whose rows ran alike."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def resolve_rows(opts: BenchOptions) -> list[tuple[str, RunConfig]]:
    """Every row's validated config, before anything runs (a bad row fails the whole command
    up front rather than after an hour of the others)."""
    if not opts.techniques:
        raise ConfigError("no techniques given; pass --techniques baseline,bf16,... or omit it for the default list")
    rows = []
    seen = set()
    for name in opts.techniques:
        if name in seen:
            raise ConfigError(f"technique {name!r} is listed twice; list each once")
        seen.add(name)
        row_layer = technique_overrides(name, opts.scale)
        both = sorted(set(row_layer) & (set(flatten(opts.file_layer)) | set(opts.overrides)))
        if both and "=" in name:
            # An explicit row (key=value+...) and a flag or --config key that set the same key:
            # neither may silently win over the other.
            raise ConfigError(f"technique {name!r} sets {', '.join(both)} and --{both[0].replace('_', '-')} is "
                              f"given too (as a flag or in --config); drop one (the row's value applies to that row only)")
        # A preset's techniques are what its label says ("BF16 Mixed Precision"): a --config key that
        # changed one would run another technique under that label. (Flags set no technique key.)
        relabelled = sorted(set(row_layer) & set(flatten(opts.file_layer)) & TECHNIQUE_KEYS)
        if relabelled and "=" not in name:
            raise ConfigError(f"technique {name!r} sets {', '.join(relabelled)} and --config sets it too; drop "
                              f"{relabelled[0]} from the config file, or name the row key=value+key=value")
        try:
            given = (row_layer, opts.file_layer, opts.overrides)
            flat_given = normalized_layers(*given)  # read once: for the scale, the attention and the warm-up
            scale_layer, default_attention = row_base_layers(opts.scale, flat_given)
            cfg = build_config(scale_layer, *given, default_attention)
            if warmup_named(flat_given):
                refuse_long_warmup(cfg.train)
        except ConfigError as exc:
            raise ConfigError(f"technique {name!r}: {exc}") from None
        twin = noise_twin(name)  # the same row again: run-to-run noise
        if twin is not None and twin.kind == "seed":
            cfg = cfg.replace(seed=cfg.train.seed + 1)
        elif twin is not None:
            cfg = cfg.replace(nudge_seed=twin.nudge_seed)
        if opts.nproc > 1 and cfg.technique.distributed == "none":
            cfg = cfg.replace(distributed="ddp")
        rows.append((name, cfg))
    return rows


def _maxbatch_spec(opts: BenchOptions, cfg: RunConfig) -> Optional[dict[str, Any]]:
    if not opts.maxbatch:
        return None
    from memtrain.runtime.env import resolve_device  # torch-free --help/estimate/plan

    device = resolve_device(cfg.train.device)
    budget = opts.memory_budget or (SCALE_BUDGET.get(opts.scale) if device.type == "cpu" else None)
    if device.type == "cpu" and budget is None:
        budget = "1GiB"
    return {
        "budget_bytes": parse_size(budget) if budget else None,
        "max_batch": opts.max_batch or SCALE_MAX_BATCH.get(opts.scale, 1024),
        "multiple_of": opts.multiple_of,
    }


def trace_key(cfg: RunConfig) -> str:
    """What a row's traced max-batch search depends on: its config less the seeds (fake tensors
    hold no values), so a noise twin reuses its row's answer instead of tracing again."""
    return config_hash(cfg.replace(seed=0, nudge_seed=0).to_dict())


def row_folder(out: Path, name: str) -> Path:
    """The folder row ``name`` of the bench in ``out`` runs in (its train's --out)."""
    return out / "rows" / name.replace("/", "_").replace("=", "-").replace("+", "_")


def check_row_folders(out: Path, names: list[str]) -> None:
    """``out/rows`` and each row's folder in it are real folders (or absent), checked before the
    bench folder or a row exists: a link there made each row create its folder, and run, at the
    link's target, outside the bench folder."""
    for path in [out / "rows", *(row_folder(out, name) for name in names)]:
        if path.is_symlink() or (os.path.lexists(path) and not path.is_dir()):
            kind = "a symbolic link" if path.is_symlink() else "not a folder"
            raise ConfigError(f"--out {str(out)!r}: {str(path.relative_to(out))!r} is {kind}; memtrain does not "
                              "write through links: remove it or choose another --out")


def run_row_subprocess(name: str, cfg: RunConfig, opts: BenchOptions, eta: Optional[Any] = None,
                       known_max_batch: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Run one row in a fresh Python process; return its result dict (with status).
    ``known_max_batch``: this bench's search result for a row with the same :func:`trace_key`."""
    row_dir = row_folder(opts.out, name)
    row_dir.mkdir(parents=True, exist_ok=True)
    cfg = cfg.replace(out=str(row_dir))
    distributed = cfg.technique.distributed != "none"
    # The max-batch search runs one process; it is not defined for a distributed row.
    spec: dict[str, Any] = {"config": cfg.to_dict(), "maxbatch": None if distributed else _maxbatch_spec(opts, cfg), "progress": opts.progress}
    if spec["maxbatch"] and known_max_batch:
        spec["maxbatch"]["known"] = known_max_batch
    with row_tmpdir() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        heartbeat = Path(tmp) / "heartbeat.json"
        spec["heartbeat"] = str(heartbeat)
        spec_path.write_text(json.dumps(spec))
        cmd = [sys.executable, "-m", "memtrain.bench.worker", str(spec_path), str(out_path)]
        if distributed:  # one worker per rank; only rank 0 writes OUT
            cmd[1:3] = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={opts.nproc}", "-m", "memtrain.bench.worker"]
        start = time.perf_counter()
        # Its own process group (a timeout or Ctrl-C stops torchrun and all of its workers
        # together, and a terminal's Ctrl-C reaches only the bench) that dies with the bench.
        proc = start_row(cmd, stdout=subprocess.DEVNULL)
        try:
            code = _wait(proc, opts.timeout_s, start, lambda: _say_eta(eta, name, heartbeat, start))
        except subprocess.TimeoutExpired:
            stop_row(proc, grace_s=0, sig=signal.SIGKILL)
            return {"status": "timeout", "error": f"row exceeded {opts.timeout_s:.0f} s", "config": cfg.recorded()}
        except BaseException:  # Ctrl-C, SIGTERM (raised as KeyboardInterrupt), anything: no orphan
            stop_row(proc)
            raise
        wall = time.perf_counter() - start
        if out_path.is_file():
            result = json.loads(out_path.read_text())
        else:
            # Killed (e.g. the kernel's OOM killer sends SIGKILL) before it could write.
            how = f"signal {-code}" if code < 0 else f"exit code {code}"
            result = {"status": "killed" if code < 0 else "error", "error": f"row process ended with {how} before writing a result"}
        for rank_file in sorted(Path(tmp).glob(out_path.name + ".rank*")):
            if result.get("status") != "ok":  # a failed rank other than 0 names the root cause
                result = json.loads(rank_file.read_text())
                break
    result.setdefault("config", cfg.recorded())
    result["row_wall_s"] = wall
    return result


def _say_eta(eta: Optional[Any], name: str, heartbeat: Path, start: float) -> None:
    if eta is not None:
        line = eta.line(name, heartbeat, time.perf_counter() - start)
        if line:
            print(line, file=sys.stderr, flush=True)


def _wait(proc: subprocess.Popen, timeout_s: Optional[float], start: float, tick: Callable[[], None]) -> int:
    """``proc.wait(timeout_s)``, calling ``tick`` about twice a second meanwhile."""
    while True:
        left = None if timeout_s is None else timeout_s - (time.perf_counter() - start)
        if left is not None and left <= 0:
            raise subprocess.TimeoutExpired(proc.args, float(timeout_s or 0))
        try:
            return proc.wait(timeout=0.5 if left is None else min(0.5, left))
        except subprocess.TimeoutExpired:
            tick()


def run_bench(opts: BenchOptions, on_row: Optional[Callable[[str, dict[str, Any]], None]] = None,
              rows: Optional[list[tuple[str, RunConfig]]] = None,
              settings: Optional[dict[str, Any]] = None) -> list[dict[str, Any]]:
    """Run every technique of ``opts`` not already done; return all rows of this bench.
    ``rows`` and ``settings``: :func:`resolve_rows` and :func:`bench_settings` of ``opts`` where
    the caller has them (``memtrain bench`` needs the settings before the first row)."""
    from memtrain.bench.device_rows import (  # torch-free --help/estimate/plan
        adapt_compiled_optims,
        adapt_fp8_rows,
        adapt_rows,
        adapt_window_kernels,
        runner_caps,
    )
    from memtrain.runtime.env import resolve_device  # torch-free --help/estimate/plan

    if rows is None:
        rows = resolve_rows(opts)
    if settings is None:
        settings = bench_settings(opts, rows)
    device = resolve_device(rows[0][1].train.device) if rows else None
    caps = runner_caps(device, rows[0][1]) if device is not None else None
    rows, substituted, notes = adapt_rows(rows, caps, opts.substitute_slow)
    device_type = device.type if device is not None else ""
    rows, optim_subs, optim_notes = adapt_compiled_optims(rows, device_type, opts.substitute_slow)
    rows, attention_subs, attention_notes = adapt_window_kernels(rows, device_type, opts.substitute_slow)
    rows, fp8_notes = adapt_fp8_rows(rows, caps, opts.substitute_slow)
    # One bench per folder: a second one would run every row twice under contention and
    # interleave its appends with ours. Held until the last row is appended.
    with FolderLock(opts.out, "memtrain bench"):
        # Once, up front, not once per row; after the lock, whose refusal stays the one error: line.
        for note in notes + optim_notes + attention_notes + fp8_notes:
            print(f"warning: {note}", file=sys.stderr, flush=True)
        remove_stale_temps(opts.out)  # a report write of an earlier bench that was SIGKILL'd
        write_bench_record(opts, [name for name, _ in rows], settings)
        return _run_rows(opts, rows, substituted, on_row, optim_subs, attention_subs, settings)


def write_bench_record(opts: BenchOptions, names: list[str], settings: dict[str, Any]) -> None:
    """Record what this bench was asked to run before its first row: interrupted before it
    appends a row (its first rows found done), it leaves no row naming its list, and the record
    lets `memtrain report` name its missing rows all the same."""
    problem = record_bench(opts.out, new_record(names, settings_hash(settings), opts.command))
    if problem is not None:
        print(f"warning: {problem}", file=sys.stderr, flush=True)


def _run_rows(opts: BenchOptions, rows: list[tuple[str, RunConfig]], substituted: dict[str, Any],
              on_row: Optional[Callable[[str, dict[str, Any]], None]],
              optim_subs: Optional[dict[str, Any]] = None,
              attention_subs: Optional[dict[str, Any]] = None,
              settings: Optional[dict[str, Any]] = None) -> list[dict[str, Any]]:
    clean_stale_row_dirs()  # scratch of an earlier bench that was SIGKILL'd
    settings = settings if settings is not None else bench_settings(opts)
    sid = settings_hash(settings)
    # A row is done when it ran with the same config under the same bench settings; a row that
    # records no settings_hash (row_settings: "unrecorded") never matches, so it runs again.
    finished = [] if opts.force else [r for r in read_results(opts.out) if r.get("status") == "ok"]
    done = {(r.get("technique"), r.get("config_hash"), row_settings(r)): r for r in finished}
    earlier = {r.get("technique"): r for r in finished}
    keys = [(name, config_hash(cfg.to_dict()), sid) for name, cfg in rows]
    eta = BenchEta(sum(k not in done for k in keys)) if opts.eta else None
    names = [n for n, _ in rows]
    searched: dict[str, dict[str, Any]] = {}  # trace_key -> a finished row's max-batch answer
    for (name, cfg), key in zip(rows, keys):
        if key in done:
            if on_row:
                on_row(name, {**done[key], "skipped": True})
            continue
        if name in earlier:  # said before the row's minutes, not after
            print(rerun_message(name, earlier[name], key, settings), file=sys.stderr, flush=True)
        tkey = trace_key(cfg)
        result = run_row_subprocess(name, cfg, opts, eta, known_max_batch=searched.get(tkey))
        found = result.get("max_batch")
        if isinstance(found, dict) and found.get("batch_size") and "reused_from" not in found:
            searched.setdefault(tkey, {**found, "reused_from": name})
        if eta is not None:
            eta.row_finished(result)
        # named_settings: what the row's name sets, so that the report tells them from settings
        # every row shares (a --config key, memtrain.report.tables.shared_technique_lines).
        result.update({"technique": name, "description": describe(name, settings["device"]), "scale": opts.scale,
                       "config_hash": key[1], "named_settings": sorted(technique_overrides(name, opts.scale)),
                       "settings_hash": sid, "max_batch_search": settings["max_batch_search"], "nproc": opts.nproc,
                       "device_name": settings["device_name"], "data_fingerprint": settings["data_fingerprint"],
                       # The bench's whole list: `memtrain report` names the rows an interrupted bench never finished.
                       "bench_techniques": names})
        if name in substituted:
            result["substituted"] = substituted[name]
        if optim_subs and name in optim_subs:
            result["substituted_optim"] = optim_subs[name]
        if attention_subs and name in attention_subs:
            result["substituted_attention"] = attention_subs[name]
        append_result(opts.out, result)
        if on_row:
            on_row(name, result)
        # The tables after every row, so an interrupted bench keeps them; the plots (most of a
        # report's cost) are drawn once by the caller, at the end or on interruption.
        write_report(opts.out, techniques=names, plots=False, settings=sid, replace_links=True)
    return select_rows(rows_under(read_results(opts.out), sid), names)


def rerun_message(name: str, row: dict[str, Any], key: tuple[str, str, str], settings: dict[str, Any]) -> str:
    """Why ``name`` runs again although it finished before (``row``, its latest finished row;
    ``key``: technique, config hash and settings hash of the row about to run; ``settings``:
    :func:`bench_settings`): what changed, in a few words."""
    if "settings_hash" not in row:
        return f"[{name}] its earlier row does not record its bench settings; running it again"
    what = []
    if row.get("config_hash") != key[1]:
        what.append("config")
    if row.get("max_batch_search") != settings["max_batch_search"]:
        what.append("max-batch search")
    if row.get("nproc") != settings["nproc"]:
        what.append("--nproc")
    if "device_name" in row and row["device_name"] != settings["device_name"]:
        what.append(f"device: {row['device_name']} then, {settings['device_name']} now")
    if "data_fingerprint" in row and row["data_fingerprint"] != settings["data_fingerprint"]:
        what.append("the data's content")
    return f"[{name}] settings changed since its earlier row ({', '.join(what) or 'device or shared settings'}); running it again"
