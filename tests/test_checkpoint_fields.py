"""The checks a checkpoint's fields pass before a resume changes anything
(memtrain.checkpoints.exact): each accepts what a run saves and refuses the field one step off."""

from __future__ import annotations

import pytest
import torch

from memtrain.checkpoints.exact import (
    DamagedCheckpoint,
    check_optimizer_shapes,
    check_process_state,
    check_progress,
    check_val_history,
)


def test_progress_needs_exactly_one_loss_per_step():
    check_progress(2, [3.0, 2.5])
    check_progress(0, [])
    for losses in ([3.0], [3.0, 2.5, 2.0]):  # fewer and more losses than steps
        with pytest.raises(DamagedCheckpoint, match=f"{len(losses)} losses for 2 steps"):
            check_progress(2, losses)


def test_evaluations_lie_within_the_steps_the_run_took():
    entry = {"step": 4, "val_loss": 2.0, "val_ppl": 7.4}
    check_val_history([entry], 4)
    for bad in ({**entry, "step": 5}, {**entry, "step": 0}):  # after the last step; before the first
        with pytest.raises(DamagedCheckpoint, match="val_history"):
            check_val_history([bad], 4)


def _process_state(rng: torch.Tensor) -> dict:
    sched = {"last_epoch": 2, "_step_count": 3, "base_lrs": [1e-3], "_last_lr": [1e-3], "lr_lambdas": [None]}
    return {"rng_cpu": rng, "rng_cuda": [], "scaler": None, "skipped_steps": 0, "scheduler": sched}


def test_a_random_generator_state_is_a_1d_uint8_tensor():
    rng = torch.get_rng_state()
    check_process_state(_process_state(rng))
    for bad in (rng.to(torch.int64), rng.reshape(1, -1)):  # torch.set_rng_state takes a ByteTensor only
        with pytest.raises(DamagedCheckpoint, match="rng_cpu"):
            check_process_state(_process_state(bad))


def test_optimizer_state_shapes_may_keep_a_factored_1_but_no_other_size():
    """Adafactor keeps row and column factors (a 1 where the parameter has its size): they fit.
    A moment with a dimension of another size does not."""
    param = torch.nn.Parameter(torch.zeros(4, 6))
    opt = torch.optim.SGD([param], lr=0.1)

    def saved(**state: torch.Tensor) -> dict:
        return {"state": {0: state}, "param_groups": [{"params": [0]}]}

    check_optimizer_shapes(saved(exp_avg=torch.zeros(4, 6), row=torch.zeros(4, 1), col=torch.zeros(1, 6)), opt)
    for bad in (torch.zeros(4, 5), torch.zeros(4), torch.zeros(2, 6)):
        with pytest.raises(DamagedCheckpoint, match="shape"):
            check_optimizer_shapes(saved(exp_avg=bad), opt)
