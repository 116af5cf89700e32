"""Checkpoints of distributed runs: a directory written by all ranks together.

``--save CKPT`` under ``--distributed`` writes::

    CKPT/
      .metadata, __R_0.distcp   torch.distributed.checkpoint (DCP): the model weights and, for
                                ddp/zero2/fsdp, the optimizer state; each rank writes its own
                                shards (replicated tensors are written once)
      rank-R.pt                 per rank: RNG states, LR schedule, loss scaler; under zero1
                                also the rank's ZeRO-1 optimizer shard
      meta.json                 step, loss history, data position, ranks, strategy, config

and ``--resume CKPT`` restores all of it, so a resumed run continues exactly as the
uninterrupted one would (the promise of :mod:`memtrain.checkpoints.exact`). The same functions and
signatures as that module (a path and the run's :class:`memtrain.training.step.TrainState`), so the
train loop only chooses which pair to call.

Written atomically: all ranks write into a sibling temporary directory, and rank 0 renames
it into place once every rank has finished, so a run killed mid-save keeps the previous
checkpoint. Ranks must share the file system (one machine, or a shared mount).

Resuming needs the same number of ranks (each rank's data position and RNG state are its
own) and, for zero1, the same strategy (its optimizer shards are per-rank row chunks);
ddp, zero2 and fsdp read one another's checkpoints, since DCP stores tensors by name.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from memtrain.checkpoints.exact import (
    DamagedCheckpoint,
    check_hyper_parameters,
    check_loader_state,
    check_optimizer_shapes,
    check_optimizer_state,
    check_process_state,
    check_progress,
    check_scheduler_fits,
    check_val_history,
    damaged,
    load_plain,
    restore_rng_and_scaler,
    rng_and_scaler_state,
)
from memtrain.config.run import ConfigError
from memtrain.distributed.rank_errors import agreement
from memtrain.errors import first_line

if TYPE_CHECKING:  # the harness imports the techniques (torch models); a checkpoint only reads it
    from memtrain.training.step import TrainState
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from memtrain.checkpoints.safe_dcp import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    UnsafeCheckpointError,
    UnsafeStorageError,
    read_metadata,
)
from memtrain.distributed.zero1 import ShardedZeRO1
from memtrain.files import results
from memtrain.files.guard import regular_file_problem
from memtrain.files.results import loads_bounded

FORMAT = "memtrain-dcp-1"
META = "meta.json"


def _zero1_local(optimizer: Any) -> Any:
    """The rank-local optimizer of ZeRO-1 (:class:`ShardedZeRO1`), else None."""

    return optimizer.optim if isinstance(optimizer, ShardedZeRO1) else None


def _storage_key(t: Any) -> tuple[int, int]:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.untyped_storage().data_ptr(), local.storage_offset()


def _split_aliases(model_sd: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The state dict without tied duplicates, and ``{alias: key it shares storage with}``.

    A tied LM head appears twice in a module's state dict (``wte.weight`` and
    ``lm_head.weight``, one tensor): saved as is, DCP would write the model's largest matrix
    twice. It is saved once and the alias restored after loading."""
    first: dict[tuple[int, int], str] = {}
    unique: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    for key, value in model_sd.items():
        if not isinstance(value, torch.Tensor):
            unique[key] = value
            continue
        k = _storage_key(value)
        if k in first and model_sd[first[k]].shape == value.shape:
            aliases[key] = first[k]
        else:
            first.setdefault(k, key)
            unique[key] = value
    return unique, aliases


def _app_state(model: nn.Module, optimizer: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """What DCP saves/loads: canonical parameter names (no ``module.`` prefix) whatever the
    wrapper, DTensor shards under FSDP2, tied weights once; and the aliases left out. ZeRO-1's
    optimizer is not DCP-aware; its shard travels in the rank file instead."""

    if _zero1_local(optimizer) is not None:
        model_sd, aliases = _split_aliases(get_model_state_dict(model))
        return {"model": model_sd}, aliases
    model_sd, optim_sd = get_state_dict(model, optimizer)
    model_sd, aliases = _split_aliases(model_sd)
    return {"model": model_sd, "optimizer": optim_sd}, aliases


def _meta_complete(meta: dict[str, Any]) -> bool:
    """Whether meta.json has every key and type load_checkpoint relies on."""
    return (isinstance(meta.get("step"), int) and isinstance(meta.get("losses"), list)
            and isinstance(meta.get("world_size"), int) and isinstance(meta.get("loader"), dict)
            and isinstance(meta.get("strategy"), str))


def _rank_file(root: Path, rank: int) -> Path:
    return root / f"rank-{rank}.pt"


def rank_files_beyond(root: Path, world: int) -> list[str]:
    """The ``rank-R.pt`` files in ``root`` of ranks ``R >= world``. A save writes one per rank into a
    fresh folder, so any such file means meta.json's ``world_size`` is not the count that wrote it:
    a meta.json saying 1 rank for a 2-rank checkpoint was resumed by 1 rank, on another global batch
    and rank 1's state dropped, without a word."""
    found = []
    for f in root.glob("rank-*.pt"):
        index = f.name[len("rank-"):-len(".pt")]
        if index.isdigit() and int(index) >= world:
            found.append(f.name)
    return sorted(found, key=lambda name: int(name[len("rank-"):-len(".pt")]))


def check_rank_count(p: Path, world: int) -> None:
    """meta.json's ``world_size`` agrees with the rank files the checkpoint holds."""
    beyond = rank_files_beyond(p, world)
    if beyond:
        raise damaged(p / META, DamagedCheckpoint(f"it says {world} ranks wrote it, but it holds {', '.join(beyond)}"))


def save_checkpoint(path: str | Path, run: TrainState) -> None:
    """Write everything needed to continue after ``run.step`` (a collective: every rank calls it)."""

    model, optimizer, scheduler, cfg = run.model, run.optimizer, run.scheduler, run.cfg

    final = Path(path)
    if final.exists() and not final.is_dir():
        raise ConfigError(f"--save {str(final)!r} is a file; distributed runs save a directory, give a new path")
    tmp = final.with_name(f".{final.name}.tmp")
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    dcp.save(_app_state(model, optimizer)[0], checkpoint_id=str(tmp))
    local = _zero1_local(optimizer)
    torch.save(
        {
            **rng_and_scaler_state(run.precision),
            "scheduler": scheduler.state_dict(),
            "optimizer": local.state_dict() if local is not None else None,
            # ZeRO-1's outer param_groups carry the scheduled LR of the next step; the local
            # optimizer's still hold the last step's (they are synced at the start of a step).
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
            if local is not None else None,
        },
        _rank_file(tmp, rank),
    )
    if rank == 0:
        meta = {
            "format": FORMAT,
            "step": run.step,
            "losses": list(run.losses),
            "val_history": [dict(e) for e in run.val_history],  # --eval-every's evaluations so far
            "loader": run.loader.state_dict(),
            "world_size": dist.get_world_size(),
            "strategy": cfg.technique.distributed,
            "config": cfg.to_dict(),
            "data_fingerprint": run.data_fingerprint,  # --resume refuses other data at the same path
            "model_config": run.model_config,  # --resume compares the --model by its config.json
            "cwd": os.getcwd(),  # what its relative paths are relative to (memtrain.training.run_paths)
        }
        (tmp / META).write_text(json.dumps(meta, indent=1))
    dist.barrier()  # every rank has written its part
    if rank == 0:
        _swap_into_place(tmp, final)
    dist.barrier()  # nobody reads or rewrites the checkpoint before it is in place


RENAME_EXCHANGE = 2  # linux/fs.h: renameat2 swaps the two names in one step
AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names of ``a`` and ``b`` atomically (Linux ``renameat2(RENAME_EXCHANGE)``);
    False where the system or file system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0


def _swap_into_place(tmp: Path, final: Path) -> None:
    """Put the finished checkpoint ``tmp`` at ``final``, then delete the one it replaces.

    Moving the old folder aside and the new one in took two renames: a SIGKILL (or a SIGTERM,
    which ends a rank at once under torch's launcher) between them left no checkpoint at
    ``final``, only hidden copies, and ``--resume`` said it was not a checkpoint. Where the system
    can swap two names in one step there is no such moment."""
    if final.exists() and _exchange(tmp, final):
        shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the replaced checkpoint
        return
    old = final.with_name(f".{final.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(path: str | Path, run: TrainState) -> dict[str, Any]:
    """Restore all of ``run`` in place (every rank calls it; ``run.step`` and ``run.losses``
    too); return ``{"step", "losses"}``."""
    p = Path(path)
    model = run.model
    optimizer: Any = run.optimizer  # ZeRO-1's ShardedZeRO1 adds sync_param_groups
    # Every check, and this rank's own file, before the collective load: a refusal on any
    # one rank (its rank-R.pt missing or corrupt) refuses the resume on all of them.
    with agreement():
        meta, own = _checked_parts(p, optimizer)
    state, aliases = _app_state(model, optimizer)
    try:
        # Our reader and planner: nothing in the directory is unpickled beyond plain data.
        dcp.load(state, storage_reader=SafeFileSystemReader(str(p)), planner=SafeLoadPlanner())
    except CheckpointException as exc:  # a BaseException in torch: turn it into a user error
        first = first_line(exc)
        raise ConfigError(f"checkpoint {str(p)!r} does not fit this model ({first}); use the same model flags as the saved run") from None
    for alias, key in aliases.items():  # a tied weight: the same loaded tensor under both names
        state["model"][alias] = state["model"][key]
    local = _zero1_local(optimizer)
    if local is None:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    else:
        set_model_state_dict(model, state["model"])

    if local is not None:
        local.load_state_dict(own["optimizer"])
        for group, saved in zip(optimizer.param_groups, own["param_groups"]):
            group.update(saved)
        optimizer.sync_param_groups()
    run.scheduler.load_state_dict(own["scheduler"])
    run.loader.load_state_dict(meta["loader"])
    restore_rng_and_scaler(own, run.precision)
    run.step, run.losses = int(meta["step"]), list(meta["losses"])
    run.val_history = [dict(e) for e in meta.get("val_history", [])]
    return {"step": int(meta["step"]), "losses": meta["losses"]}


def _checked_parts(p: Path, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """meta.json and this rank's ``rank-R.pt`` of checkpoint ``p``, after every check that
    needs no collective (format, pickled metadata, ranks, strategy)."""
    if not (p / META).is_file():
        hint = "it is a single-process checkpoint; resume it without --distributed" if p.is_file() else "check --resume"
        raise ConfigError(f"{str(p)!r} is not a distributed checkpoint directory ({hint})")
    _check_part_file(p, META, max_bytes=results.MAX_WHOLE_JSON_BYTES)  # read whole below
    try:
        meta = loads_bounded((p / META).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        meta = None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not _meta_complete(meta):
        raise ConfigError(f"checkpoint {str(p)!r} has an unknown format; it was not written by this memtrain version")
    try:  # every rank checks the pickled DCP metadata before the collective load starts
        read_metadata(p)
    except UnsafeStorageError as exc:
        raise ConfigError(f"checkpoint {str(p)!r} is refused: {exc}; resume only from checkpoints memtrain wrote") from None
    except (OSError, UnsafeCheckpointError) as exc:
        raise ConfigError(f"checkpoint {str(p)!r} is refused: its .metadata is not a plain DCP metadata file ({exc}); "
                          "resume only from checkpoints memtrain wrote") from None
    world, rank = dist.get_world_size(), dist.get_rank()
    if meta["world_size"] != world:
        raise ConfigError(
            f"checkpoint {str(p)!r} was written by {meta['world_size']} ranks, this run has {world}; "
            f"resume with torchrun --nproc_per_node {meta['world_size']}"
        )
    check_rank_count(p, world)
    local = _zero1_local(optimizer)
    if (meta["strategy"] == "zero1") != (local is not None):
        raise ConfigError(f"checkpoint {str(p)!r} was written with --distributed {meta['strategy']}; resume with the same strategy")
    _check_part_file(p, _rank_file(p, rank).name)
    try:
        own = load_plain(_rank_file(p, rank))
    except Exception as exc:  # missing, truncated, or holding more than plain data
        raise ConfigError(f"cannot read {str(_rank_file(p, rank))!r} ({type(exc).__name__}); "
                          "it is not a memtrain checkpoint part") from None
    if not isinstance(own, dict) or not isinstance(own.get("scheduler"), dict):
        raise ConfigError(f"{str(_rank_file(p, rank))!r} is not a memtrain checkpoint part (no scheduler state)")
    try:
        check_progress(meta["step"], meta["losses"])
        check_val_history(meta.get("val_history", []), meta["step"])
        check_loader_state(meta["loader"])
    except DamagedCheckpoint as exc:
        raise damaged(p / META, exc) from None
    try:
        _check_rank_state(own, optimizer)
    except DamagedCheckpoint as exc:
        raise damaged(_rank_file(p, rank), exc) from None
    return meta, own


def _check_part_file(p: Path, name: str, max_bytes: Optional[int] = None) -> None:
    """``p / name`` is a regular file inside the checkpoint (never a FIFO, which would block
    the rank in ``open``, nor a link out of the folder), of at most ``max_bytes`` when given."""
    why = regular_file_problem(p / name, p, max_bytes=max_bytes)
    if why is not None:
        raise ConfigError(f"checkpoint {str(p)!r} is refused: its {name} is {why}; resume only from checkpoints memtrain wrote")


def _check_rank_state(own: dict[str, Any], optimizer: Any) -> None:
    """A rank file's fields have the types load_checkpoint relies on (DamagedCheckpoint if not)."""
    check_process_state(own)
    local = _zero1_local(optimizer)
    if local is None:
        check_scheduler_fits(own["scheduler"], optimizer)
        return
    check_optimizer_state(own.get("optimizer"), local)
    check_optimizer_shapes(own["optimizer"], local)
    check_scheduler_fits(own["scheduler"], optimizer)
    groups = own.get("param_groups")  # the outer optimizer's groups without their parameters
    if not (isinstance(groups, list) and len(groups) == len(optimizer.param_groups)):
        raise DamagedCheckpoint("its ZeRO-1 param_groups do not match this run's parameter groups")
    check_hyper_parameters(groups, optimizer)
