"""A distributed run's lifetime: join the process group, hand the train loop a
:class:`DistContext`, always leave the group (also when a rank fails)."""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from memtrain.config.run import ConfigError, RunConfig
from memtrain.distributed.deepspeed_engine import deepspeed_config, deepspeed_train_step
from memtrain.distributed.rank_errors import (
    agreement,
    launch_env,
    launch_world_size,
    raise_if_any_rank_failed,
    rendezvous_timeout_s,
)
from memtrain.distributed.validation import DEEPSPEED_STRATEGIES, LAUNCH_HINT, check_distributed_run
from memtrain.distributed.wrapping import fsdp_no_sync, zero_redundancy


def _timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=rendezvous_timeout_s())


@dataclass
class DistContext:
    """The process group as the train loop sees it. ``strategy == "none"``: one process,
    and every hook is a no-op."""

    strategy: str = "none"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    rank: int = 0
    world_size: int = 1
    backend: Optional[str] = None
    owns_group: bool = False
    # memtrain.metrics.ShardedStateBytes, set by the train loop (measurement lives in metrics).
    state: Optional[Any] = None
    # zero1: the rank-local optimizer inside ShardedZeRO1 (holds the real state).
    local_optimizer: Optional[torch.optim.Optimizer] = None
    # deepspeed: a train_step replacement that drives the engine.
    train_step: Optional[Callable[..., float]] = None
    cfg: Optional[RunConfig] = None

    @property
    def enabled(self) -> bool:
        return self.strategy != "none"

    @property
    def is_main(self) -> bool:
        """Rank 0: the only rank that prints and writes results."""
        return self.rank == 0

    @contextlib.contextmanager
    def main_first(self) -> Iterator[None]:
        """Rank 0 runs the block first (e.g. fills the token cache), the others after it.

        Each half ends in an exchange of outcomes (memtrain.distributed.rank_errors), not a bare
        barrier: a rank that fails in the block (a data file only it cannot read) fails
        every rank with its reason instead of leaving them waiting."""

        if not self.enabled:
            yield
            return
        if not self.is_main:
            raise_if_any_rank_failed(None)  # rank 0's turn
        with agreement():
            yield
        if self.is_main:
            raise_if_any_rank_failed(None)  # the other ranks' turn

    def wrap_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        """The optimizer (and model) the loop should use: ZeRO-1 shards the optimizer here;
        DeepSpeed builds its engine here (it needs the optimizer)."""
        if self.strategy == "zero1":
            optimizer = zero_redundancy(optimizer)
            self.local_optimizer = optimizer.optim  # type: ignore[attr-defined]  # ShardedZeRO1 keeps its rank-local optimizer as .optim
        elif self.strategy in DEEPSPEED_STRATEGIES:
            model, optimizer = self._deepspeed(model, optimizer)
        return model, optimizer

    def no_sync(self, model: nn.Module) -> Optional[Callable[[], contextlib.AbstractContextManager]]:
        """For gradient accumulation: a context that skips the gradient exchange (None: no
        such thing, e.g. one process)."""
        if isinstance(model, nn.parallel.DistributedDataParallel):
            return model.no_sync

        if isinstance(model, FSDPModule):
            return lambda: fsdp_no_sync(model)
        return None

    def mean(self, value: float) -> float:
        """``value`` averaged over ranks (the loss of the global batch)."""
        if not self.enabled or self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t.item()) / self.world_size

    def attach_meter(self, meter: Any) -> None:
        """Let a MemoryMeter see ZeRO-1's rank-local optimizer state."""
        if meter is not None and self.local_optimizer is not None:
            meter.attach_optimizer(self.local_optimizer)

    def release(self) -> None:
        """Drop what this context holds of the run (model, optimizers, engine), so that the
        process group they reference can be freed when the session ends."""
        self.state = self.local_optimizer = self.train_step = None

    def result_fields(self, memory: dict[str, Any], ran_steps: bool = True) -> dict[str, Any]:
        """``ranks`` (every rank's memory dict, gathered) and ``distributed`` for the result.
        ``ran_steps`` False (a run resumed at its last step, which only evaluates): no
        ``sharded_state`` either, as no other memory figure; its counter saw only the optimizer
        step that restoring a sharded optimizer state runs with zero gradients (one bias short of
        the run's gradients), not a training step."""
        if not self.enabled:
            return {}
        sharded = self.state.to_dict() if self.state and ran_steps else None
        local = {"rank": self.rank, **memory, "sharded_state": sharded}
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, local)
        return {
            "ranks": gathered,
            "distributed": {"strategy": self.strategy, "world_size": self.world_size, "backend": self.backend},
        }

    def _deepspeed(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        import deepspeed

        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=deepspeed_config(self.cfg, self.world_size),  # type: ignore[arg-type]  # cfg is set for the deepspeed strategy
            dist_init_required=False,
        )
        self.train_step = deepspeed_train_step
        # DeepSpeed replaces the client optimizer's parameters by its flat FP32 partitions but
        # steps it with its own param_groups, so the LR schedule keeps driving that optimizer.
        return engine, optimizer


def _check_rendezvous_env() -> None:
    """``init_process_group``'s env:// rendezvous needs MASTER_ADDR and MASTER_PORT (torchrun
    sets both); without them torch fails with a traceback, with a bad port it waits."""
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        raise ConfigError(f"environment variable {' and '.join(missing)} not set: the ranks cannot meet; "
                          "launch with torchrun (it sets them) or memtrain train --nproc-per-node N")
    port = os.environ["MASTER_PORT"]
    if not (port.isdigit() and 0 < int(port) < 65536):
        raise ConfigError(f"environment variable MASTER_PORT={port[:40]!r} is not a port number (1-65535)")


def init_distributed(cfg: RunConfig, device: torch.device) -> DistContext:
    """Validate the launch and join the process group (see :func:`distributed_session`)."""

    s = cfg.technique.distributed
    if s == "none":
        world = launch_world_size()
        if world is not None and world > 1:
            raise ConfigError(
                f"launched with {world} processes but --distributed is none; add --distributed ddp "
                f"(or zero1, zero2, fsdp), or run without torchrun"
            )
        if device.type == "cuda" and device.index is not None:
            # Triton kernels called directly (Liger's, Cut Cross-Entropy's) launch on the current
            # device, not on their tensors' (inductor's code sets it, they do not): --device
            # cuda:N makes N current.
            torch.cuda.set_device(device)
        return DistContext(device=device)
    env = launch_env()  # bad launch variables are refused here, before any rendezvous waits on them
    if env is None and not dist.is_initialized():
        raise ConfigError(f"--distributed {s} runs one process per device; {LAUNCH_HINT.format(s=s)}")
    check_distributed_run(cfg, device)
    if dist.is_initialized():  # the caller set up the group (e.g. its own launcher): use it as is
        rank, world, owns = dist.get_rank(), dist.get_world_size(), False
        local = env.local_rank if env is not None and "LOCAL_RANK" in os.environ else rank
    else:
        assert env is not None  # ruled out above
        _check_rendezvous_env()
        rank, world, owns, local = env.rank, env.world_size, True, env.local_rank
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        if local >= torch.cuda.device_count():
            raise ConfigError(
                f"rank {rank} needs GPU {local} but {torch.cuda.device_count()} are visible; "
                f"use --nproc_per_node {torch.cuda.device_count()} or fewer"
            )
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    if owns:
        dist.init_process_group(backend, timeout=_timeout())
    backend = dist.get_backend()
    return DistContext(strategy=s, device=device, rank=rank, world_size=world, backend=backend,
                       owns_group=owns, cfg=cfg)


@contextlib.contextmanager
def distributed_session(cfg: RunConfig, device: torch.device) -> Iterator[DistContext]:
    """Join the process group for one run and always leave it, also when a rank fails."""
    ctx = init_distributed(cfg, device)
    finished = False
    try:
        yield ctx
        finished = True
    finally:
        if ctx.owns_group and dist.is_initialized():
            _leave_group(ctx, finished)


def _leave_group(ctx: DistContext, finished: bool) -> None:
    """Settle every collective before the interpreter exits.

    Gloo's worker threads release a finished collective's tensors a moment after the caller's
    wait returns. When that moment falls into interpreter shutdown, the release needs the GIL,
    the thread is torn down and the process aborts with "terminate called without an active
    exception" although the run finished (seen in about 1 of 6 two-rank CPU runs). So: drop
    the model and optimizers this context holds and collect their reference cycles while
    Python is fully alive, and on a clean finish meet the other ranks at a barrier (which
    carries no Python tensors) so that no rank leaves while another still communicates. After
    a failure the barrier is skipped: the failed rank would never reach it and the others
    would wait until the timeout (torchrun stops them instead).
    """
    ctx.release()
    gc.collect()
    if finished:
        dist.barrier()
    dist.destroy_process_group()
