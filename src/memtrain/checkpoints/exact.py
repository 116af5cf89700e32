"""Checkpoints that resume a run exactly: model, optimizer, scheduler, RNG, data position.

Written atomically (a temporary file in the same directory, then ``os.replace``), so a run
killed mid-save leaves the previous checkpoint intact. Loaded with ``weights_only=True``:
a checkpoint holds only tensors, numbers, strings, lists and dicts, never pickled code.
"""

from __future__ import annotations

import importlib
import math
import os
import pickle
import re
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from memtrain.config.run import ConfigError
from memtrain.files.guard import special_file_kind
from memtrain.files.results import write_atomic

# A checkpoint reads and writes a memtrain.training.step.TrainState; it is typed Any here because the
# step harness (through preflight's model-size check) sits above this module, and an import of
# it, even for annotations only, would close a circle.
TrainState = Any

FORMAT_VERSION = 1
REQUIRED_KEYS = ("step", "losses", "model", "optimizer", "scheduler", "loader", "rng_cpu", "rng_cuda",
                 "scaler", "skipped_steps", "config")


def _unwrap(model: nn.Module) -> nn.Module:
    """The module whose state_dict has the plain parameter names (compile/DDP wrap it)."""
    while True:
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if inner is None or not isinstance(inner, nn.Module):
            return model
        model = inner


def rng_and_scaler_state(precision: Any) -> dict[str, Any]:
    """The per-process state besides model and optimizer: RNG streams and the loss scaler."""
    return {
        "rng_cpu": torch.get_rng_state(),
        "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "scaler": precision.scaler.state_dict() if precision.scaler is not None else None,
        "skipped_steps": precision.skipped_steps,
    }


def restore_rng_and_scaler(state: dict[str, Any], precision: Any) -> None:
    """Inverse of :func:`rng_and_scaler_state`."""
    torch.set_rng_state(state["rng_cpu"])
    if state["rng_cuda"] and torch.cuda.is_available():
        # One state per GPU visible where it was saved: a machine (or CUDA_VISIBLE_DEVICES) with
        # fewer restores those it has (set_rng_state_all failed with "invalid device ordinal").
        for index, rng in enumerate(state["rng_cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(rng, index)
    if state["scaler"] is not None and precision.scaler is not None:
        precision.scaler.load_state_dict(state["scaler"])
    precision.skipped_steps = state["skipped_steps"]


# --------------------------------------------------------------------------- what a checkpoint holds
# Checked when a checkpoint is read, before it changes anything: torch.load(weights_only=True)
# admits any tensors, numbers, strings, lists and dicts, and a wrong-typed field (losses as a
# string, a learning rate as text, a moment of the wrong shape) would otherwise pass every load
# and fail at the first step or only when the result is written, after the whole run.
class DamagedCheckpoint(ConfigError):
    """A checkpoint field of the wrong type or shape (the message names the field)."""


def _number(value: Any) -> bool:
    """A finite int or float (a bool is no number here), or a 0-d floating/integer tensor."""
    if isinstance(value, torch.Tensor):
        return value.ndim == 0 and not value.is_complex() and bool(torch.isfinite(value.detach().float()))
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _count(value: Any) -> bool:
    """A non-negative int (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _kind(value: Any) -> str:
    return f"a {type(value).__name__}"


def check_step(step: Any) -> None:
    """``step``: a whole number of completed optimizer steps."""
    if not _count(step):
        raise DamagedCheckpoint(f"its step is {step!r}, not a whole number of steps")


def check_progress(step: Any, losses: Any) -> None:
    """``step`` completed optimizer steps and one finite loss per step."""
    check_step(step)
    if not isinstance(losses, list) or not all(_number(x) and not isinstance(x, torch.Tensor) for x in losses):
        raise DamagedCheckpoint(f"its losses are {_kind(losses)} holding other than finite numbers")
    if len(losses) != step:
        raise DamagedCheckpoint(f"it holds {len(losses)} losses for {step} steps")


def check_val_history(history: Any, step: int) -> None:
    """The evaluations of the saved run: ``{"step", "val_loss", "val_ppl"}`` each, at steps up
    to ``step`` (a checkpoint written before they were saved has none)."""
    def entry_ok(e: Any) -> bool:  # a value may be NaN (an evaluation that diverged): the run went on
        return (isinstance(e, dict) and set(e) == {"step", "val_loss", "val_ppl"} and _count(e["step"])
                and 0 < e["step"] <= step and all(isinstance(e[k], (int, float)) and not isinstance(e[k], bool)
                                                  for k in ("val_loss", "val_ppl")))

    if not isinstance(history, list) or not all(entry_ok(e) for e in history):
        raise DamagedCheckpoint(f"its val_history is {_kind(history)}, not evaluations at the steps it ran")


def check_loader_state(loader: Any) -> None:
    """The data position: ``{"epoch", "batch_index"}`` as whole numbers."""
    if not isinstance(loader, dict) or not (_count(loader.get("epoch")) and _count(loader.get("batch_index"))):
        raise DamagedCheckpoint(f"its data position is {loader!r}, not {{'epoch': N, 'batch_index': N}}")


def _check_rng(rng: Any, name: str) -> None:
    if not (isinstance(rng, torch.Tensor) and rng.dtype == torch.uint8 and rng.ndim == 1):
        raise DamagedCheckpoint(f"its {name} is {_kind(rng)}, not a random generator state (a 1-d uint8 tensor)")


def check_process_state(state: dict[str, Any]) -> None:
    """What :func:`rng_and_scaler_state` wrote, and the LR schedule's state."""
    _check_rng(state.get("rng_cpu"), "rng_cpu")
    rng_cuda = state.get("rng_cuda")
    if not isinstance(rng_cuda, list):
        raise DamagedCheckpoint(f"its rng_cuda is {_kind(rng_cuda)}, not a list")
    for rng in rng_cuda:
        _check_rng(rng, "rng_cuda")
    scaler = state.get("scaler")
    if scaler is not None and not (isinstance(scaler, dict) and all(_number(v) for v in scaler.values())):
        raise DamagedCheckpoint(f"its loss scaler state is {_kind(scaler)}, not numbers by name")
    if not _count(state.get("skipped_steps")):
        raise DamagedCheckpoint(f"its skipped_steps is {state.get('skipped_steps')!r}, not a whole number")
    check_scheduler_state(state.get("scheduler"))


def check_scheduler_state(sched: Any) -> None:
    """The LR schedule (LambdaLR's state_dict): step counters and per-group learning rates."""
    if not isinstance(sched, dict):
        raise DamagedCheckpoint(f"its LR schedule is {_kind(sched)}, not a scheduler state")
    for key in ("last_epoch", "_step_count"):
        if key in sched and not (isinstance(sched[key], int) and not isinstance(sched[key], bool)):
            raise DamagedCheckpoint(f"its LR schedule's {key} is {sched[key]!r}, not a whole number")
    for key in ("base_lrs", "_last_lr"):
        if key in sched and not (isinstance(sched[key], list) and all(_number(v) for v in sched[key])):
            raise DamagedCheckpoint(f"its LR schedule's {key} is {_kind(sched[key])}, not a list of numbers")
    lambdas = sched.get("lr_lambdas", [])
    if not (isinstance(lambdas, list) and all(f is None or isinstance(f, dict) for f in lambdas)):
        raise DamagedCheckpoint("its LR schedule's lr_lambdas are not a schedule state")


def check_model_state(model_sd: Any) -> None:
    """Tensors by parameter name (their shapes are checked by ``load_state_dict``)."""
    if not isinstance(model_sd, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                 for k, v in model_sd.items()):
        raise DamagedCheckpoint("its model is not tensors by parameter name")


# The floating dtypes a run keeps its weights in (FP8 training too keeps FP32 master weights).
WEIGHT_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16, torch.float64})


def check_weights(model_sd: Any) -> None:
    """:func:`check_model_state`, each tensor dense with data (not sparse, not on the meta device),
    and each floating one in a dtype of :data:`WEIGHT_DTYPES`: export and generate hand the
    checkpoint's tensors to the model as they are, and such a tensor failed midway (torch's
    ``isfinite`` has no float8 kernel, a meta tensor has no values, a sparse one no reshape)."""
    check_model_state(model_sd)
    for name, value in model_sd.items():
        if value.layout != torch.strided or value.is_meta:
            where = "on the meta device (no values)" if value.is_meta else f"of layout {value.layout}"
            raise DamagedCheckpoint(f"its weight {name} is a tensor {where}, not a dense one")
        if value.is_floating_point() and value.dtype not in WEIGHT_DTYPES:
            raise DamagedCheckpoint(f"its weight {name} is {value.dtype}, a dtype no run keeps its weights in")


def _same_kind(saved: Any, now: Any) -> bool:
    """Whether a saved optimizer hyper-parameter may replace the current one: numbers for
    numbers, equally long sequences of numbers, a flag (bool or None) for a flag."""
    if now is None or isinstance(now, bool):
        return saved is None or isinstance(saved, bool)
    if _number(now):
        return _number(saved)
    if isinstance(now, (tuple, list)):
        return isinstance(saved, (tuple, list)) and len(saved) == len(now) and all(map(_same_kind, saved, now))
    return type(saved) is type(now)


def check_optimizer_state(optim_sd: Any, optimizer: Any) -> None:
    """An optimizer state_dict that ``optimizer`` can load and step with: per-parameter state of
    tensors and numbers, and param_groups whose hyper-parameters have the current ones' kinds
    (torch's load_state_dict checks the group and parameter counts, not these)."""
    if not isinstance(optim_sd, dict) or not isinstance(optim_sd.get("state"), dict) \
            or not isinstance(optim_sd.get("param_groups"), list):
        raise DamagedCheckpoint("its optimizer is not an optimizer state (state and param_groups)")
    for index, entry in optim_sd["state"].items():
        if not isinstance(entry, dict) or not all(isinstance(v, torch.Tensor) or _number(v) for v in entry.values()):
            raise DamagedCheckpoint(f"its optimizer state of parameter {index!r} is not tensors and numbers")
    for i, saved in enumerate(optim_sd["param_groups"]):
        if not isinstance(saved, dict) or not isinstance(saved.get("params"), list) \
                or not all(_count(pid) for pid in saved["params"]):
            raise DamagedCheckpoint(f"its optimizer parameter group {i} is not a dict with a list of parameter ids")
    check_hyper_parameters(optim_sd["param_groups"], optimizer)


def check_hyper_parameters(saved_groups: list[Any], optimizer: Any) -> None:
    """Saved parameter groups whose hyper-parameters (lr, betas, weight decay ...) have the kinds
    of ``optimizer``'s current ones, group by group; their parameter ids are not looked at."""
    for i, saved in enumerate(saved_groups):
        if not isinstance(saved, dict):
            raise DamagedCheckpoint(f"its optimizer parameter group {i} is {_kind(saved)}, not a dict")
    for saved, now in zip(saved_groups, getattr(optimizer, "param_groups", [])):
        for key, value in now.items():
            if key != "params" and key in saved and not _same_kind(saved[key], value):
                raise DamagedCheckpoint(f"its optimizer's {key} is {saved[key]!r}, where this run has {value!r}")


def check_optimizer_shapes(optim_sd: dict[str, Any], optimizer: Any) -> None:
    """Every per-parameter state tensor of ``optim_sd`` fits the parameter of ``optimizer`` it
    will be loaded into (same dimensions, each equal or 1: Adam's moments have the parameter's
    shape, Adafactor's factors keep a 1), so a moment of another shape cannot fail the first
    step. Parameters are matched as ``Optimizer.load_state_dict`` matches them (saved ids and
    current parameters, group by group, in order); a count that differs is left to it. The
    state of bitsandbytes also holds quantization tables of other shapes: only its types count."""
    if type(optimizer).__module__.startswith("bitsandbytes"):
        return
    saved_ids = [pid for g in optim_sd["param_groups"] for pid in g["params"]]  # check_optimizer_state ran
    params = [param for g in getattr(optimizer, "param_groups", []) for param in g.get("params", [])]
    if len(saved_ids) != len(params):
        return
    by_id = dict(zip(saved_ids, params))
    for pid, entry in optim_sd["state"].items():
        param = by_id.get(pid)
        if param is None:
            continue
        for key, value in entry.items():
            if not isinstance(value, torch.Tensor) or value.ndim == 0:
                continue
            shape, want = tuple(value.shape), tuple(param.shape)
            if len(shape) != len(want) or any(s not in (1, w) for s, w in zip(shape, want)):
                raise DamagedCheckpoint(f"its optimizer state {key} of parameter {pid} has shape {list(shape)}, "
                                        f"the parameter {list(want)}")


def check_scheduler_fits(sched: dict[str, Any], optimizer: Any) -> None:
    """One base learning rate per parameter group of this run's optimizer."""
    groups = len(getattr(optimizer, "param_groups", []))
    if "base_lrs" in sched and len(sched["base_lrs"]) != groups:
        raise DamagedCheckpoint(f"its LR schedule has {len(sched['base_lrs'])} learning rates for {groups} parameter groups")


def damaged(path: Path | str, exc: DamagedCheckpoint) -> ConfigError:
    """The one-line error for checkpoint ``path`` whose field ``exc`` names is damaged."""
    return ConfigError(f"checkpoint {str(path)!r} is damaged: {exc}; resume from a checkpoint memtrain wrote")


# Modules whose tensor subclasses memtrain's own checkpoints hold: QLoRA's NF4 base weights on
# CPU (torchao's NF4Tensor; the second name is torchao's older path). torch's restricted unpickler
# accepts such a class once its module has registered it (torch.serialization.add_safe_globals,
# run when the module is imported), which a fresh `memtrain export`/`generate`/`--resume` process
# has not done. Only these modules are imported, whatever else a file names.
SAFE_SUBCLASS_MODULES = frozenset({"torchao.quantization.quantize_.workflows.nf4.nf4_tensor",
                                   "torchao.dtypes.nf4tensor"})
_UNSUPPORTED_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)\.\w+ was not an allowed global")


def load_plain(f: Any, **kwargs: Any) -> Any:
    """``torch.load(f, weights_only=True)`` without torch's warnings on the terminal.

    A file that is not a zip checkpoint (a raw pickle, torch's legacy format) makes torch's
    restricted unpickler warn about its pickle protocol before it refuses the file; the caller
    says why the file is refused in its one ``error:`` line, so the warning is noise. A class
    of :data:`SAFE_SUBCLASS_MODULES` that the unpickler does not know yet has its module
    imported (which registers it), and the load is tried again."""
    imported: set[str] = set()
    while True:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return torch.load(f, map_location="cpu", weights_only=True, **kwargs)
        except pickle.UnpicklingError as exc:
            found = _UNSUPPORTED_GLOBAL.search(str(exc))
            module = found.group(1) if found else None
            if module not in SAFE_SUBCLASS_MODULES or module in imported:
                raise
            try:
                importlib.import_module(module)
            except ImportError:
                raise ConfigError("this checkpoint holds QLoRA's NF4 base weights (torchao) and torchao is not "
                                  "installed: pip install torchao") from None
            imported.add(module)
            if hasattr(f, "seek"):
                f.seek(0)


def read_state(p: Path, missing_hint: str, mmap: bool = False) -> Any:
    """A single-file checkpoint's contents, loaded with ``weights_only=True`` (tensors, numbers,
    strings, lists and dicts only: nothing in the file can execute). A missing or unreadable file
    is a one-line ConfigError; ``missing_hint`` says where the file should come from.

    ``mmap``: the tensors are mapped from the file, not read into memory (torch's private
    mapping: a write to one copies its page, never reaches the file). A reader that needs only
    the weights (export, generate) then never reads the optimizer's state, and a model given
    these tensors holds no second copy of them."""
    if not p.is_file():
        kind = special_file_kind(p)
        found = "not found" if kind is None else f"is {kind}, not a file"
        raise ConfigError(f"checkpoint {str(p)!r} {found}; {missing_hint}")
    try:
        return load_plain(p, mmap=True) if mmap else load_plain(p)
    except ConfigError:  # it says what to install
        raise
    except OSError as exc:  # unreadable: the file may be a fine checkpoint
        raise ConfigError(f"cannot read checkpoint {str(p)!r} ({exc.strerror or type(exc).__name__}); check its "
                          "permissions") from None
    except Exception as exc:  # a truncated or foreign file
        raise unreadable_checkpoint(p, exc) from None


# How every zip file, and so every torch checkpoint, starts.
ZIP_MAGIC = b"PK\x03\x04"


def unreadable_checkpoint(p: Path, exc: BaseException) -> ConfigError:
    """The one line for a checkpoint file torch cannot load: a zip archive without its end (a
    copy cut short, a disk that filled while it was written) is said to be incomplete, with what
    to do; it was called "not a memtrain checkpoint", which sent the user after the wrong file."""
    try:
        with open(p, "rb") as f:
            truncated = f.read(len(ZIP_MAGIC)) == ZIP_MAGIC and not zipfile.is_zipfile(f)
    except OSError:
        truncated = False
    if truncated:
        return ConfigError(f"checkpoint {str(p)!r} is incomplete (its zip archive has no end: a copy cut short, or a "
                           "disk that filled while it was written); copy it again, or give an earlier checkpoint")
    return ConfigError(f"cannot read checkpoint {str(p)!r} ({type(exc).__name__}); it is not a memtrain checkpoint")


def save_checkpoint(path: str | Path, run: TrainState) -> None:
    """Write everything needed to continue after ``run.step`` completed optimizer steps."""
    state = {
        "format": FORMAT_VERSION,
        "step": run.step,
        "losses": list(run.losses),
        "val_history": [dict(e) for e in run.val_history],  # --eval-every's evaluations so far
        "model": _unwrap(run.model).state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "scheduler": run.scheduler.state_dict(),
        "loader": run.loader.state_dict(),
        **rng_and_scaler_state(run.precision),
        "config": run.cfg.to_dict(),
        "data_fingerprint": run.data_fingerprint,  # --resume refuses other data at the same path
        "model_config": run.model_config,  # --resume compares the --model by its config.json
        "cwd": os.getcwd(),  # what its relative paths are relative to (memtrain.training.run_paths)
    }
    # A temporary file beside ``path``, then a rename: a failure or a kill mid-save leaves the
    # previous checkpoint at ``path`` untouched (memtrain.files.results.write_atomic). A link
    # there was planted after the run checked its --save (memtrain.training.preflight): it is
    # replaced, never written through, rather than losing the checkpoint.
    write_atomic(Path(path), lambda tmp: save_through_python(state, tmp), replace_link=True)


def save_through_python(state: Any, tmp: str) -> None:
    """``torch.save`` into a file Python opened: a write that fails (a full disk, a quota, the
    file size limit of ``ulimit -f``) raises an OSError with its errno, which torch's RuntimeError
    then carries as its context (:func:`memtrain.files.results.named_write_error` takes it).
    Given a name, torch writes through its own C++ stream and says only "unexpected pos 576 vs
    534", which left the run's last line a RuntimeError naming no file and no cause."""
    with open(tmp, "wb") as f:
        torch.save(state, f)


def load_checkpoint(path: str | Path, run: TrainState) -> dict[str, Any]:
    """Restore all of ``run`` in place (``run.step`` and ``run.losses`` too); return
    ``{"step", "losses"}`` of the saved run."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{str(p)!r} is a sharded checkpoint directory; resume it under torchrun with the "
                          "--distributed strategy and rank count that wrote it")
    state = read_state(p, "check --resume")
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
        raise ConfigError(f"checkpoint {str(p)!r} has an unknown format; it was not written by this memtrain version")
    missing = [k for k in REQUIRED_KEYS if k not in state]
    if missing:
        raise ConfigError(f"checkpoint {str(p)!r} lacks {', '.join(missing)}; it is incomplete or was not written by memtrain")
    try:  # every field's type before anything is restored
        check_progress(state["step"], state["losses"])
        check_val_history(state.get("val_history", []), state["step"])
        check_loader_state(state["loader"])
        check_process_state(state)
        check_model_state(state["model"])
        check_optimizer_state(state["optimizer"], run.optimizer)
        check_optimizer_shapes(state["optimizer"], run.optimizer)
        check_scheduler_fits(state["scheduler"], run.optimizer)
    except DamagedCheckpoint as exc:
        raise damaged(p, exc) from None
    try:
        _unwrap(run.model).load_state_dict(state["model"])
    except RuntimeError as exc:
        first = str(exc).splitlines()[0]
        raise ConfigError(f"checkpoint {str(p)!r} does not fit this model ({first}); use the same model flags as the saved run") from None
    try:
        run.optimizer.load_state_dict(state["optimizer"])
        run.scheduler.load_state_dict(state["scheduler"])
        run.loader.load_state_dict(state["loader"])
        restore_rng_and_scaler(state, run.precision)
    except ConfigError:
        raise
    except (KeyError, ValueError, TypeError, RuntimeError, IndexError) as exc:
        raise ConfigError(f"checkpoint {str(p)!r} does not fit this run ({type(exc).__name__}: {exc}); "
                          "resume with the saved run's optimizer and settings") from None
    run.step, run.losses = int(state["step"]), list(state["losses"])
    run.val_history = [dict(e) for e in state.get("val_history", [])]
    return {"step": int(state["step"]), "losses": state["losses"]}
