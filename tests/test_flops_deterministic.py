"""`memtrain flops` gives the same classes whatever the hash seed: a backward op run while sibling
modules' backward passes are open together is classed the same way every time, and rightly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import memtrain
from memtrain.analysis.flops.recorder import backward_class

LLAMA_MLP = "GPT.model.layers.0.mlp"


class _Shape:
    def __init__(self, *shape: int) -> None:
        self.shape = shape

    def dim(self) -> int:
        return len(self.shape)


def test_silu_backward_beside_up_proj_is_the_activation_in_either_order():
    # torch's ModuleTracker holds both act_fn and up_proj (same depth) when SiLU's backward runs:
    # the old "deepest parent" took whichever the set yielded first (mlp_fc or other).
    opened = ["GPT", f"{LLAMA_MLP}", f"{LLAMA_MLP}.act_fn", f"{LLAMA_MLP}.up_proj"]
    grads = [_Shape(8, 256, 384), _Shape(8, 256, 384)]
    answers = {backward_class(order, "silu_backward", grads, 32000) for order in (opened, opened[::-1])}
    assert answers == {"other"}  # the forward's silu runs in act_fn: "other" there too


def test_siblings_of_one_kind_keep_their_class():
    opened = [f"{LLAMA_MLP}.gate_proj", f"{LLAMA_MLP}.up_proj"]
    for order in (opened, opened[::-1]):
        assert backward_class(order, "mm", [_Shape(2048, 384), _Shape(384, 128)], 32000) == "mlp_fc"
        assert backward_class(order, "add", [_Shape(8, 256, 128)] * 2, 32000) == "mlp_fc"


def _without_measured(value: Any) -> Any:
    """The JSON without each op's share of the step time (it may rest on a measured rate)."""
    if isinstance(value, dict):
        return {k: _without_measured(v) for k, v in value.items() if k != "est_time_share"}
    if isinstance(value, list):
        return [_without_measured(v) for v in value]
    return value


def _flops_json(seed: str) -> dict[str, Any]:
    src = str(Path(memtrain.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": src}
    proc = subprocess.run([sys.executable, "-m", "memtrain", "flops", "--json", "--model", "tiny-llama"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_flops_json_is_the_same_in_fresh_processes():
    a, b = _flops_json("1"), _flops_json("2")
    assert a["total_flops"] == b["total_flops"]
    assert _without_measured(a) == _without_measured(b)
    fc = next(o for o in a["ops"] if o["name"] == "mlp_fc")
    # gate/up's matmuls plus the add that joins their input gradients: no SiLU FLOPs in mlp_fc.
    assert fc["elementwise_flops"] == 4 * 8 * 256 * 128  # layers x batch x seq x d_model
