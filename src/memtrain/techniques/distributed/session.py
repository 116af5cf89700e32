"""Data-parallel training across processes on torch.distributed (``--distributed``).

Launched with one process per device by torchrun::

    torchrun --nproc_per_node N -m memtrain train --distributed ddp|zero1|zero2|fsdp ...

Every rank builds the same model (same seed), reads its own slice of each global batch
(``make_train_loader(rank=, world_size=)``) and the strategies differ only in what each rank
keeps of the training state (P = parameter bytes, N = ranks, Adam: optimizer = 2P):

==========  ============================================  =========  ==========  ===========
strategy    implementation                                 weights    gradients   optimizer
==========  ============================================  =========  ==========  ===========
ddp         ``DistributedDataParallel`` (all-reduce)        P          P           2P
zero1       DDP + :class:`~memtrain.techniques.zero1.     P          P           2P / N
            ShardedZeRO1` (dim-0 chunks of every tensor)
zero2       FSDP2 ``fully_shard``, reshard_after_forward    P/N + P*   P/N         2P / N
            =False (gathered weights kept to backward)
fsdp        FSDP2 ``fully_shard``, reshard_after_forward    P/N + 1    P/N         2P / N
            =True (each block gathered only while used)    block*
==========  ============================================  =========  ==========  ===========

(*) transient: the gathered (unsharded) weights exist from a block's forward to its backward.
FSDP2's "zero2" therefore holds *more* weight bytes at the peak than DDP (the shard plus
the gathered copy); it still wins overall because gradients and optimizer state shrink.

FSDP2 shards every Transformer block and then the root (embeddings, final LayerNorm and
the LM head, whose weight is the token embedding's: the tie survives because both modules
sit in the root's parameter group, so one sharded parameter is registered under both names).
Under ``--precision bf16`` FSDP2 gathers BF16 weights and reduces FP32 gradients
(``MixedPrecisionPolicy``); ``--cpu-offload`` keeps shards, gradients and the optimizer step
on the CPU (``CPUOffloadPolicy``, CUDA only).

Order with the other techniques (see :mod:`memtrain.techniques`): LoRA, attention,
activation checkpointing, loss and compile are applied to the plain model first; the
distributed wrap comes last. Gradient accumulation skips the gradient exchange on all
micro-batches but the last (DDP ``no_sync``; FSDP2 ``set_requires_gradient_sync(False)``).

``--distributed deepspeed-zero2|deepspeed-zero3`` runs DeepSpeed's ZeRO engine instead
when ``deepspeed`` is installed (CUDA); its options are mapped by :func:`deepspeed_config`.

A run's lifetime: :func:`distributed_session` joins the process group (NCCL on CUDA, gloo
on CPU; with a timeout, so a collective whose peer died fails instead of blocking forever:
``MEMTRAIN_DIST_TIMEOUT`` seconds, default 300) and always leaves it, and hands the train
loop a :class:`DistContext` with the few hooks the loop needs.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import importlib.util
import inspect
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from memtrain.config import ConfigError, RunConfig, TechniqueConfig

__all__ = [
    "DistContext",
    "apply_distributed",
    "deepspeed_config",
    "distributed_session",
    "init_distributed",
]

DEEPSPEED_STRATEGIES = ("deepspeed-zero2", "deepspeed-zero3")
TIMEOUT_ENV = "MEMTRAIN_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
# Fault injection for the failure-propagation test: "R" or "R:K" makes rank R raise at its
# K-th forward call (default 2, i.e. after the first step's collectives have run).
FAIL_ENV = "MEMTRAIN_TEST_FAIL_RANK"

LAUNCH_HINT = "launch it with `torchrun --nproc_per_node N -m memtrain train --distributed {s} ...`"


def _timeout() -> datetime.timedelta:
    raw = os.environ.get(TIMEOUT_ENV)
    try:
        seconds = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise ConfigError(f"{TIMEOUT_ENV}={raw!r} must be a positive number of seconds, e.g. 300")
    return datetime.timedelta(seconds=seconds)


def _validate(cfg: RunConfig, device: torch.device) -> None:
    """Combinations that cannot work, reported before any process group exists."""
    tech, s = cfg.technique, cfg.technique.distributed
    if s in DEEPSPEED_STRATEGIES:
        if importlib.util.find_spec("deepspeed") is None:
            raise ConfigError(
                f"--distributed {s} needs DeepSpeed: `pip install deepspeed` (CUDA); or use "
                f"--distributed {'zero2' if s.endswith('2') else 'fsdp'} (FSDP2, built into torch)"
            )
        if cfg.train.save or cfg.train.resume:
            raise ConfigError(f"--save/--resume are not supported with --distributed {s}; use --distributed zero2 or fsdp")
        if tech.precision == "bf16-pure":
            raise ConfigError(f"--distributed {s} keeps its own FP32 master weights; use --precision bf16 instead of bf16-pure")
    if tech.cpu_offload:
        if s not in ("zero2", "fsdp") + DEEPSPEED_STRATEGIES:
            raise ConfigError(f"--cpu-offload needs sharded state: use --distributed zero2 or fsdp, not {s}")
        if device.type != "cuda":
            raise ConfigError("--cpu-offload moves sharded state from GPU memory to the CPU; on a CPU run it is there already, drop --cpu-offload")
    if s in ("zero2", "fsdp") and tech.precision == "fp16":
        raise ConfigError(f"--distributed {s} with --precision fp16 needs a sharded gradient scaler; use --precision bf16")


def check_combination(cfg: RunConfig, device: torch.device) -> None:
    """The strategy's impossible combinations as ConfigErrors (``memtrain train
    --nproc-per-node`` checks them before starting any rank)."""
    _validate(cfg, device)


# --------------------------------------------------------------------------- process group
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

        Each half ends in an exchange of outcomes (memtrain.rank_errors), not a bare
        barrier: a rank that fails in the block (a data file only it cannot read) fails
        every rank with its reason instead of leaving them waiting."""
        from memtrain.rank_errors import agreement, raise_if_any_rank_failed

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
            optimizer = _zero_redundancy(optimizer)
            self.local_optimizer = optimizer.optim  # type: ignore[attr-defined]  # ShardedZeRO1 keeps its rank-local optimizer as .optim
        elif self.strategy in DEEPSPEED_STRATEGIES:
            model, optimizer = self._deepspeed(model, optimizer)
        return model, optimizer

    def no_sync(self, model: nn.Module) -> Optional[Callable[[], contextlib.AbstractContextManager]]:
        """For gradient accumulation: a context that skips the gradient exchange (None: no
        such thing, e.g. one process)."""
        if isinstance(model, nn.parallel.DistributedDataParallel):
            return model.no_sync
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule):
            return lambda: _fsdp_no_sync(model)
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

    def result_fields(self, memory: dict[str, Any]) -> dict[str, Any]:
        """``ranks`` (every rank's memory dict, gathered) and ``distributed`` for the result."""
        if not self.enabled:
            return {}
        local = {"rank": self.rank, **memory, "sharded_state": self.state.to_dict() if self.state else None}
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


def init_distributed(cfg: RunConfig, device: torch.device) -> DistContext:
    """Validate the launch and join the process group (see :func:`distributed_session`)."""
    s = cfg.technique.distributed
    env_world = os.environ.get("WORLD_SIZE")
    if s == "none":
        if env_world is not None and int(env_world) > 1:
            raise ConfigError(
                f"launched with {env_world} processes but --distributed is none; add --distributed ddp "
                f"(or zero1, zero2, fsdp), or run without torchrun"
            )
        return DistContext(device=device)
    if env_world is None and not dist.is_initialized():
        raise ConfigError(f"--distributed {s} runs one process per device; {LAUNCH_HINT.format(s=s)}")
    _validate(cfg, device)
    if dist.is_initialized():  # the caller set up the group (e.g. its own launcher): use it as is
        rank, world, owns = dist.get_rank(), dist.get_world_size(), False
        local = int(os.environ.get("LOCAL_RANK", rank))
    else:
        rank, world, owns = int(os.environ["RANK"]), int(env_world), True  # type: ignore[arg-type]  # env_world is not None on this branch
        local = int(os.environ.get("LOCAL_RANK", "0"))
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


# --------------------------------------------------------------------------- wrapping
def apply_distributed(model: nn.Module, tech: TechniqueConfig, device: torch.device, precision: Any) -> nn.Module:
    """Wrap (DDP) or shard (FSDP2) the finished model as ``tech.distributed`` says; last
    technique of :func:`memtrain.techniques.prepare_model`. Needs the process group."""
    s = tech.distributed
    if s == "none":
        if tech.cpu_offload:
            raise ConfigError("--cpu-offload needs sharded training: add --distributed zero2 or fsdp (under torchrun)")
        return model
    if not dist.is_initialized():
        raise ConfigError(f"--distributed {s} needs a process group; {LAUNCH_HINT.format(s=s)}")
    _install_fault_injection(model)
    if s in ("ddp", "zero1"):
        # gradient_as_bucket_view: gradients live in DDP's communication buckets instead of
        # beside them, so DDP costs one gradient copy, not two.
        return nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True,
        )
    if s in ("zero2", "fsdp"):
        return _fully_shard(model, tech, device, precision, reshard_after_forward=(s == "fsdp"))
    return model  # DeepSpeed wraps model and optimizer together, in DistContext.wrap_optimizer


def _fully_shard(model: nn.Module, tech: TechniqueConfig, device: torch.device, precision: Any,
                 reshard_after_forward: bool) -> nn.Module:
    """FSDP2: one parameter group per Transformer block, then the root (embeddings, final
    LayerNorm, tied LM head). Sharded bottom-up, as ``fully_shard`` requires."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy()
    if getattr(precision, "autocast_dtype", None) == torch.bfloat16:
        # Gather BF16 weights (half the all-gather bytes and the gathered copy), but reduce
        # gradients in FP32 so the sum over ranks loses nothing.
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=True) if tech.cpu_offload else OffloadPolicy()
    kw = dict(mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp, offload_policy=offload)
    for block in model.blocks:  # type: ignore[union-attr]  # torch types nn.Module attributes as Tensor | Module
        fully_shard(block, **kw)  # type: ignore[call-overload]  # the policies dict matches fully_shard's keywords
    fully_shard(model, **kw)  # type: ignore[call-overload]  # the policies dict matches fully_shard's keywords
    return model


@contextlib.contextmanager
def _fsdp_no_sync(model: nn.Module) -> Iterator[None]:
    """FSDP2's equivalent of DDP's ``no_sync``: accumulate unreduced gradients locally."""
    model.set_requires_gradient_sync(False)  # type: ignore[operator]  # torch types nn.Module attributes as Tensor | Module
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]  # torch types nn.Module attributes as Tensor | Module


def _constructor_kwargs(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's defaults that its constructor accepts (to build it again per shard)."""
    params = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in params}


def _zero_redundancy(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """ZeRO-1: the same optimizer class and parameter groups, each rank keeping the state of
    its dim-0 chunk of every parameter and broadcasting its updated rows after each step
    (:class:`memtrain.techniques.zero1.ShardedZeRO1`; torch's ZeroRedundancyOptimizer gives
    whole tensors to ranks, which leaves a large tied embedding's state on one rank)."""
    from memtrain.techniques.zero1 import ShardedZeRO1

    groups = [dict(g) for g in optimizer.param_groups]
    return ShardedZeRO1(groups, optimizer_class=type(optimizer), **_constructor_kwargs(optimizer))


def _install_fault_injection(model: nn.Module) -> None:
    """If ``MEMTRAIN_TEST_FAIL_RANK`` names this rank, raise at its K-th forward (tests only)."""
    spec = os.environ.get(FAIL_ENV)
    if not spec:
        return
    rank_text, _, call_text = spec.partition(":")
    if int(rank_text) != dist.get_rank():
        return
    fail_at = int(call_text or 2)
    calls = [0]

    def hook(*_: Any) -> None:
        calls[0] += 1
        if calls[0] >= fail_at:
            raise RuntimeError(f"injected failure on rank {dist.get_rank()} at forward {calls[0]} ({FAIL_ENV}={spec})")

    model.register_forward_pre_hook(hook)


# --------------------------------------------------------------------------- DeepSpeed
def deepspeed_config(cfg: RunConfig, world_size: int) -> dict[str, Any]:
    """memtrain's options as a DeepSpeed config (ZeRO stage 2 or 3)."""
    t, tech = cfg.train, cfg.technique
    stage = 3 if tech.distributed == "deepspeed-zero3" else 2
    zero: dict[str, Any] = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True}
    if tech.cpu_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": t.batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": t.batch_size * t.grad_accum * world_size,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": tech.precision == "bf16"},
        "fp16": {"enabled": tech.precision == "fp16"},
        "steps_per_print": 2**31 - 1,  # memtrain reports progress itself
        "wall_clock_breakdown": False,
    }


def deepspeed_train_step(engine: Any, micro_batches: list, optimizer: Any, precision: Any, grad_clip: float,
                         device: torch.device, meter: Any = None, no_sync: Any = None) -> float:
    """``train_step`` for a DeepSpeed engine: it scales by the accumulation steps, reduces,
    clips and steps the optimizer itself (on the last micro-batch)."""
    total = 0.0
    for x, y in micro_batches:
        loss = engine(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
        engine.backward(loss)
        engine.step()
        total += float(loss.detach())
    return total / len(micro_batches)
