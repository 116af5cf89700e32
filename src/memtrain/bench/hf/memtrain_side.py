"""memtrain's side: ``memtrain.training.train.train(cfg)``, the code path of ``memtrain train``.

The one hook into memtrain's loop is its step timer (:class:`HandoffStepTimer`), which hands
the lockstep turn over after each step. This is the seam where memtrain's step harness plugs
in: the side needs nothing but "train this config, call me after every step".
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

from memtrain.bench.hf.lockstep import BATON, STEP_WINDOWS
from memtrain.config.run import RunConfig, effective_cache_dir


def warm_device_facts(cfg: RunConfig) -> None:
    """Probe the device before either side seeds and builds its model.

    ``memtrain.training.train`` probes the device (cached per machine) between seeding and building the
    model; an uncached probe draws random matrices from the global generator and would give
    memtrain other initial weights than the Trainer side. Probing first, in both workers,
    makes the in-run probe a cache read on both sides."""
    # on this side's turn: the package imports no torch before the lockstep baton
    from memtrain.devices.advice import run_device_facts

    # on this side's turn: the package imports no torch before the lockstep baton
    from memtrain.runtime.env import resolve_device

    run_device_facts(cfg.technique.precision, resolve_device(cfg.train.device), effective_cache_dir(cfg.data))


def run_ours(cfg: RunConfig) -> dict[str, Any]:
    """Train ``cfg`` with memtrain, handing the lockstep turn over after every step."""
    # on this side's turn: the package imports no torch before the lockstep baton
    import memtrain.training.train

    # on this side's turn: the package imports no torch before the lockstep baton
    from memtrain.metrics import StepTimer

    class HandoffStepTimer(StepTimer):
        """memtrain's StepTimer that hands the lockstep turn over after every step."""

        @contextlib.contextmanager
        def step(self) -> Iterator[None]:
            start = time.time()
            with super().step():
                yield
            STEP_WINDOWS.append((start, time.time()))
            BATON.handoff()
            self.skip_gap()  # the other side's step runs until the turn comes back: not idling

    # train() builds its timer from this module-level name.
    memtrain.training.train.StepTimer = HandoffStepTimer  # type: ignore[misc]
    # Each step finished before the turn is handed over (the other side's step must not share
    # the device with it), and timed as the Trainer side's are: by the host clock around a
    # synchronized step.
    cfg.train.sync_steps = True
    return memtrain.training.train.train(cfg, progress=False)
