"""``memtrain train --nproc-per-node N``: torchrun's launcher run from inside memtrain.

Plain ``torchrun ... -m memtrain train`` works, but when a rank fails torchrun's agent adds
its own report after the rank's ``error:`` line (log lines, a ``ChildFailedError`` traceback,
a failure summary) and exits 1 whatever the rank said. This module runs the same launcher
(``torch.distributed.run``, standalone rendezvous on this machine) programmatically, so that:

- the input is checked once here, before any process starts (the caller's preflight);
- torch's launcher logs are off (``--verbose`` keeps them);
- a failure is reported as one ``error:`` line, printed once, as the last line, with the
  ranks' own exit code: 2 when any rank refused its input, 130 when interrupted, else 1.
  The line is the one the rank wrote into torchelastic's per-rank error file
  (:func:`memtrain.distributed.rank_errors.record_error_line`).

The ranks know they were started here (``MEMTRAIN_LAUNCHED=1``): they leave printing the
error to the launcher and the ``--out`` lock to it (it holds the lock for the whole run).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
from typing import Any, Optional, Sequence

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from memtrain.distributed.rank_errors import ERROR_DIR_ENV, LAUNCHED_ENV, error_line_of, read_error_lines
from memtrain.runtime.signals import LAUNCHER_PID_ENV


def _quiet_launcher_logs() -> None:
    """torch's elastic agent logs every worker start and stop at WARNING/ERROR on its own
    loggers (each with an explicit level, so a parent logger's level does not reach them).
    In this process nothing else logs, so logging is switched off as a whole."""
    if not os.environ.get("MEMTRAIN_VERBOSE"):
        logging.disable(logging.CRITICAL)


def launch(nproc: int, argv: Sequence[str]) -> int:
    """Run ``python -m memtrain ARGV`` on ``nproc`` local ranks; return the exit code."""

    _quiet_launcher_logs()
    os.environ[LAUNCHED_ENV] = "1"  # inherited by the ranks
    # The ranks die with this process even when it is SIGKILLed (memtrain.runtime.signals.bind_rank_to_launcher).
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default, without its banner
    args = parse_args(["--standalone", f"--nproc_per_node={nproc}", "-m", "memtrain", *argv])
    with tempfile.TemporaryDirectory(prefix="memtrain-launch-") as errors:
        os.environ[ERROR_DIR_ENV] = errors
        try:
            run(args)
        except ChildFailedError as exc:
            return report_failures(exc.failures, read_error_lines(errors))
        except (SignalException, KeyboardInterrupt):
            sys.stderr.write("error: interrupted; the ranks were stopped, results written so far are kept\n")
            return 130
        finally:
            os.environ.pop(ERROR_DIR_ENV, None)
    return 0


def report_failures(failures: dict[int, Any], said: Optional[dict[int, tuple[str, int]]] = None) -> int:
    """One line for the failed ranks and the exit code.

    ``said``: every rank's own line and exit code (:func:`memtrain.distributed.rank_errors.read_error_lines`),
    also of ranks torch's agent stopped before it saw them fail; ``failures``: torchelastic's
    ``ProcessFailure`` by global rank, for ranks that said nothing. A refusal of input (2)
    wins over what it caused in the others; among refusals, the lowest rank's line (rank 0
    names the rank that refused: ``error: rank 1: ...``). torch's agent stops the surviving ranks
    with SIGTERM once one failed, so among ranks that said nothing the cause is one that ended
    otherwise (SIGKILL, a crash, an exit code); when all ended by SIGTERM, one was sent it from
    outside: the run was interrupted (130), as SIGTERM to the launcher is."""
    for wanted in (2, 130):
        chosen = sorted(r for r, (_, code) in (said or {}).items() if code == wanted)
        if chosen:
            sys.stderr.write((said or {})[chosen[0]][0] + "\n")
            return wanted
    ranks = sorted(failures)
    lines = {r: error_line_of(failures[r].message) for r in ranks}
    codes = {r: failures[r].exitcode for r in ranks}
    for wanted in (2, 130):
        chosen = [r for r in ranks if codes[r] == wanted]
        if chosen:
            found = [line for line in (lines[r] for r in chosen) if line]
            sys.stderr.write((found[0] if found else f"error: rank {chosen[0]} exited with code {wanted}") + "\n")
            return wanted
    said_ranks = [r for r in ranks if lines[r]]
    if said_ranks:  # the first rank that said why (by the time it wrote its error file)
        first = min(said_ranks, key=lambda r: failures[r].timestamp)
        sys.stderr.write(f"{lines[first]}\n")
        return 1
    causes = [r for r in ranks if failures[r].exitcode != -signal.SIGTERM]
    if not causes:  # every rank ended by SIGTERM and none said why: one was sent it from outside
        sys.stderr.write("error: interrupted: a rank was sent SIGTERM; the ranks were stopped, "
                         "results written so far are kept\n")
        return 130
    f = failures[causes[0]]
    how = f"signal {f.signal_name()}" if f.exitcode < 0 else f"exit code {f.exitcode}"
    sys.stderr.write(f"error: rank {causes[0]} ended with {how} without a message; "
                     "set MEMTRAIN_DEBUG=1 for its traceback\n")
    return 1
