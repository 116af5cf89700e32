"""One bench row, run in its own process: ``python -m memtrain.bench.worker SPEC OUT``.

A fresh process per row means a fresh allocator and compile cache, so one technique's memory
state cannot leak into the next row's numbers, and a row that crashes takes only itself down.

SPEC is a JSON file {"config": {...}, "maxbatch": {...} | null, "progress": bool | null}; a
"maxbatch" holding "known" (another row's answer, same config but the seed) is reused, not
searched. The worker writes OUT (JSON) with ``status`` ok | oom | invalid | error and, when
ok, the train result plus ``max_batch`` and ``estimate``. The exit code is 0 whenever OUT was written.

Under torchrun (a distributed row) every rank runs the row and only rank 0 writes OUT; a
failed rank other than 0 writes ``OUT.rankR`` instead, and a failed rank exits 1 so that
torchrun stops the others at once rather than leaving them blocked in a collective.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

from memtrain.analysis.estimate.method import estimate_step, model_arch
from memtrain.config.run import ConfigError, build_config
from memtrain.errors import is_out_of_memory, typed_first_line
from memtrain.files.results import write_json_atomic
from memtrain.runtime.extras import quiet_third_party
from memtrain.runtime.notices import SlowPrecisionWarning


def heartbeat_writer(path: Optional[str]) -> Optional[Callable[[int, int, Any], None]]:
    """train()'s ``on_step`` for a row: the heartbeat file the runner reads for the row's and the
    bench's ETA (:mod:`memtrain.bench.eta`), written once, at the first timed step.

    The ETA is said once per row, from the first heartbeat that carries a step time; one written
    at every step (an fsynced write and a rename: milliseconds, docs/performance.md "Host work per
    step") cost each step that much host time, more than a small model's whole step on a GPU. A
    lost write costs nothing but the ETA line."""
    if not path:
        return None
    written = False

    def on_step(done: int, total: int, step_s: Any) -> None:
        nonlocal written
        if written or step_s is None:  # said already, or still in the timing warm-up: no ETA to give
            return
        written = True
        try:
            write_json_atomic(Path(path), {"done": done, "total": total, "step_s": step_s})
        except OSError:
            pass

    return on_step


def run_row(spec: dict[str, Any]) -> dict[str, Any]:
    """Train, then search the max batch, then estimate; each part's failure is recorded."""
    from memtrain.training.train import train  # torch loads only when this runs

    cfg = build_config(spec["config"])
    heartbeat = spec.get("heartbeat")

    result: dict[str, Any] = train(cfg, progress=spec.get("progress"), on_step=heartbeat_writer(heartbeat))
    result["status"] = "ok"
    mb = spec.get("maxbatch")
    if mb and mb.get("known"):
        # A row of this bench with the same config but the seed already searched: the trace
        # holds no values, so the answer is the same (runner.trace_key).
        result["max_batch"] = dict(mb["known"])
    elif mb:
        from memtrain.analysis.maxbatch import find_max_batch  # torch loads only when this runs

        try:
            found = find_max_batch(cfg, budget_bytes=mb.get("budget_bytes"), max_batch=mb.get("max_batch"),
                                   multiple_of=mb.get("multiple_of", 1), progress=spec.get("progress"))
            result["max_batch"] = found.to_dict()
        except (ConfigError, RuntimeError) as exc:
            result["max_batch"] = {"batch_size": None, "error": str(exc).splitlines()[0]}
    result["estimate"] = row_estimate(cfg)
    return result


def row_estimate(cfg: Any) -> dict[str, Any]:
    """The prediction of a row's run, shown beside its measurement in the report: the estimate
    `memtrain estimate` makes of the same config (analytic, or traced for a transformers model
    the analytic model does not cover), or ``{"error": ...}``."""
    from memtrain.runtime.env import resolve_device  # torch loads only when this runs

    # A row run on N ranks (`bench --nproc N`) is measured per rank: its estimate is one rank's
    # share, as `estimate --world-size N` gives it (the whole unsharded step was set beside it).
    world = int(os.environ.get("WORLD_SIZE", "1"))
    shard = "none" if world > 1 and cfg.technique.distributed in ("none", "ddp") else None
    try:
        device_type = resolve_device(cfg.train.device).type
        return estimate_step(cfg, device_type, model_arch(cfg), world_size=world, shard=shard).json
    except Exception as exc:  # noqa: BLE001 - an estimator gap must not lose the measured row
        return {"error": typed_first_line(exc)}


def main(argv: list[str]) -> int:
    quiet_third_party()
    spec_path, out_path = Path(argv[0]), Path(argv[1])
    spec = json.loads(spec_path.read_text())

    # The runner already said, once and up front, which rows run a precision that is slow here.
    warnings.filterwarnings("ignore", category=SlowPrecisionWarning)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    try:
        result = run_row(spec)
    except ConfigError as exc:
        result = {"status": "invalid", "error": str(exc)}
    except BaseException as exc:  # noqa: BLE001 - record every failure, including OOM
        if isinstance(exc, KeyboardInterrupt):
            raise
        status = "oom" if is_out_of_memory(exc) else "error"  # CPU's "can't allocate memory" too
        result = {"status": status, "error": typed_first_line(exc),
                  "traceback": traceback.format_exc(limit=8)}
    if rank == 0:
        write_json_atomic(out_path, result)
    elif result["status"] != "ok":
        write_json_atomic(out_path.with_name(f"{out_path.name}.rank{rank}"), result)
    return 1 if world > 1 and result["status"] != "ok" else 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:  # stopped by its bench: the bench reports it, no traceback here
        sys.exit(130)
