"""Several 2-rank ``memtrain train`` runs from one process, for tests/test_distributed.py.

    python tests/dist_launch.py PLAN.json

PLAN.json: ``{"nproc": 2, "logs": DIR, "runs": [[NAME, [ARG, ...]], ...]}``. Each run goes through
torch's own elastic launcher (``torch.distributed.launcher.api.elastic_launch``: the agent and
standalone c10d rendezvous torchrun uses, a fresh rendezvous per run) with the ranks *forked*
from this process after torch, torch._dynamo and memtrain are imported. A rank runs
``memtrain.cli.main(ARGS)``, the function ``python -m memtrain`` runs, with its stdout and stderr
in ``DIR/NAME-rank{R}.log``.

Why: a torchrun launch starts three interpreters (agent + 2 ranks), each importing torch and
torch._dynamo (built with the first AdamW): ~17 s of CPU on a 2-core test machine against
~1 s of training for the tests' tiny model. Forked ranks pay those imports once per file.
Runs go one after another, in PLAN order (a resume follows the run that saved). The test file
still launches one run through real torchrun, as users do.

Exit 0 when every rank of every run returned 0; else 1 after the first failed run, naming it.
"""

from __future__ import annotations

import json
import os
import sys
import uuid

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

import memtrain.cli
import memtrain.training.train  # noqa: F401 - imported before the fork, so no rank imports it again


def _rank(argv: list[str], log_prefix: str) -> int:
    """One rank: its output to its own log file (fd level, so torch's C++ warnings go there too)."""
    fd = os.open(f"{log_prefix}-rank{os.environ['RANK']}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    return memtrain.cli.main(argv)


def main(plan_path: str) -> int:
    plan = json.loads(open(plan_path).read())
    # torch._dynamo is imported by AdamW's first construction: here, once, not in every rank.
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    for name, argv in plan["runs"]:
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=plan["nproc"], run_id=str(uuid.uuid4()),
                              rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
                              start_method="fork", monitor_interval=0.1)
        try:
            codes = elastic_launch(config, _rank)(argv, os.path.join(plan["logs"], name))
        except ChildFailedError as exc:
            print(f"run {name} failed: {exc}", file=sys.stderr)
            return 1
        if any(code != 0 for code in codes.values()):
            print(f"run {name}: rank exit codes {codes}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
