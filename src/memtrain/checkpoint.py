"""Checkpoints that resume a run exactly: model, optimizer, scheduler, RNG, data position.

Written atomically (a temporary file in the same directory, then ``os.replace``), so a run
killed mid-save leaves the previous checkpoint intact. Loaded with ``weights_only=True``:
a checkpoint holds only tensors, numbers, strings, lists and dicts, never pickled code.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from memtrain.config import ConfigError

if TYPE_CHECKING:  # the harness imports the techniques (torch models); a checkpoint only reads it
    from memtrain.step import TrainState

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
        torch.cuda.set_rng_state_all(state["rng_cuda"])
    if state["scaler"] is not None and precision.scaler is not None:
        precision.scaler.load_state_dict(state["scaler"])
    precision.skipped_steps = state["skipped_steps"]


def disk_full_or(exc: BaseException, path: Path) -> BaseException:
    """``exc``, or an OSError(ENOSPC) naming ``path`` when the write failed on a full disk.

    torch.save reports a failed write as a RuntimeError ("file write failed") without the
    errno; a nearly full file system is then the cause worth naming."""
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return OSError(errno.ENOSPC, "No space left on device", str(path))
    if isinstance(exc, RuntimeError) and "write failed" in str(exc):
        try:
            free = shutil.disk_usage(Path(path).parent).free
        except OSError:
            free = 0
        if free < 256 * 2**20:
            return OSError(errno.ENOSPC, "No space left on device", str(path))
    return exc


def read_state(p: Path, missing_hint: str) -> Any:
    """A single-file checkpoint's contents, loaded with ``weights_only=True`` (tensors, numbers,
    strings, lists and dicts only: nothing in the file can execute). A missing or unreadable file
    is a one-line ConfigError; ``missing_hint`` says where the file should come from."""
    if not p.is_file():
        raise ConfigError(f"checkpoint {str(p)!r} not found; {missing_hint}")
    try:
        return torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file
        raise ConfigError(f"cannot read checkpoint {str(p)!r} ({type(exc).__name__}); it is not a memtrain checkpoint") from None


def save_checkpoint(path: str | Path, run: TrainState) -> None:
    """Write everything needed to continue after ``run.step`` completed optimizer steps."""
    state = {
        "format": FORMAT_VERSION,
        "step": run.step,
        "losses": list(run.losses),
        "model": _unwrap(run.model).state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "scheduler": run.scheduler.state_dict(),
        "loader": run.loader.state_dict(),
        **rng_and_scaler_state(run.precision),
        "config": run.cfg.to_dict(),
        "data_fingerprint": run.data_fingerprint,  # --resume refuses other data at the same path
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)  # the previous checkpoint at ``path`` is untouched
        raise disk_full_or(exc, path) from None


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
    return {"step": int(state["step"]), "losses": state["losses"]}
