"""One side of one row in this (fresh) process: training, then the max-batch search."""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import torch

from memtrain.bench.hf.lockstep import BATON, STEP_WINDOWS
from memtrain.bench.hf.memtrain_side import run_ours, warm_device_facts
from memtrain.bench.hf.probe import hf_step_peak
from memtrain.bench.hf.rows import probe_at
from memtrain.bench.hf.trainer_side import run_theirs
from memtrain.config.run import ConfigError, RunConfig, build_config
from memtrain.errors import is_out_of_memory, typed_first_line
from memtrain.files.results import write_json_atomic


def run_side(side: str, cfg: RunConfig, maxbatch: Optional[dict[str, Any]], exact_schedule: bool = False) -> dict[str, Any]:
    """One side's run (training, then the max-batch search); the worker process calls this."""
    # on this side's turn: the package imports no torch before the lockstep baton
    from memtrain.analysis.maxbatch import find_max_batch

    # on this side's turn: the package imports no torch before the lockstep baton
    from memtrain.runtime.env import resolve_device

    warm_device_facts(cfg)
    if side == "ours":
        result = run_ours(cfg)
    else:
        result = run_theirs(cfg, exact_schedule=exact_schedule)
    result["step_windows"] = list(STEP_WINDOWS)
    if maxbatch:
        device = resolve_device(cfg.train.device)
        method = maxbatch.get("method") or ("measure" if device.type == "cuda" else "trace")
        probe = None if side == "ours" else (lambda c, b: hf_step_peak(c, b, fake=method == "trace"))
        try:
            found = find_max_batch(cfg, budget_bytes=maxbatch.get("budget_bytes"), max_batch=maxbatch.get("max_batch"),
                                   progress=False, method=method, probe=probe).to_dict()
            if probe_at(found, cfg.train.batch_size) is None and method == "trace":
                # The search did not visit the run's batch: probe it for the traced-vs-measured check.
                peak = traced_peak(side, cfg)
                found["probes"].append({"batch_size": cfg.train.batch_size, "peak_bytes": peak, "fits": None})
            result["max_batch"] = found
        except (ConfigError, RuntimeError) as exc:
            result["max_batch"] = {"batch_size": None, "error": str(exc).splitlines()[0]}
    return result


def traced_peak(side: str, cfg: RunConfig) -> Optional[int]:
    """The traced steady-state peak at the run's own batch (CPU)."""
    if side == "ours":
        # on this side's turn: the package imports no torch before the lockstep baton
        from memtrain.analysis.maxbatch import traced_step_peak

        return traced_step_peak(cfg, cfg.train.batch_size)
    return hf_step_peak(cfg, cfg.train.batch_size, fake=True)


# ============================================================================ worker
def worker_main(side: str, spec_path: str, out_path: str) -> int:
    """``python -m memtrain.bench.hf --worker SIDE SPEC OUT``: run one side in this fresh process."""
    spec = json.loads(Path(spec_path).read_text())
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    warnings.filterwarnings("ignore")
    start = time.perf_counter()
    try:
        cfg = build_config(spec["config"])
        result = run_side(side, cfg, spec.get("maxbatch"), bool(spec.get("exact_schedule")))
        result["status"] = "ok"
    except ConfigError as exc:
        msg = str(exc)
        result = {"status": "not available yet" if "not wired" in msg else "invalid", "error": msg}
    except Exception as exc:  # noqa: BLE001 - every failure is recorded in the row, not lost
        import traceback

        oom = is_out_of_memory(exc)  # CUDA's OutOfMemoryError and the CPU allocator's refusal alike
        msg = typed_first_line(exc)
        result = {"status": "oom" if oom else ("not available yet" if "not wired" in msg else "error"),
                  "error": msg, "traceback": traceback.format_exc(limit=10)}
    result["worker_wall_s"] = time.perf_counter() - start
    write_json_atomic(Path(out_path), result)
    BATON.finish()
    return 0

