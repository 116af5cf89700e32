"""Which ``--distributed`` combinations cannot work, said before any process group exists."""

from __future__ import annotations

import importlib.util

import torch

from memtrain.config.run import ConfigError, RunConfig

DEEPSPEED_STRATEGIES = ("deepspeed-zero2", "deepspeed-zero3")

LAUNCH_HINT = ("add --nproc-per-node N (memtrain starts N ranks), or launch it with "
               "`torchrun --nproc_per_node N -m memtrain train --distributed {s} ...`")


def check_distributed_run(cfg: RunConfig, device: torch.device) -> None:
    """Combinations that cannot work, reported before any process group exists."""
    tech, s = cfg.technique, cfg.technique.distributed
    if s in DEEPSPEED_STRATEGIES:
        if tech.precision == "fp8":
            raise ConfigError(f"--distributed {s} runs its own mixed precision, without torchao's FP8 Linears; "
                              "use --distributed fsdp or ddp with --precision fp8, or --precision bf16")
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
    check_distributed_run(cfg, device)

