"""Two fresh processes per row, taking turns step by step (the comparison's fairness on a
shared machine).

No torch import here: a worker process waits for its first turn (:class:`Baton`) before it
imports torch, whose import is heavy while the other side may be in a timed step.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from memtrain.bench.process import reap

# What each worker process runs (then `--worker SIDE SPEC OUT`): the package's __main__, which
# waits for its turn before importing torch.
WORKER_COMMAND = (sys.executable, "-m", "memtrain.bench.hf")

BATON_ENV = "COMPARE_HF_BATON"


class Baton:
    """Turn-taking between the two sides of a lockstep pair (``--lockstep``, the default).

    Both processes live at once but only the one holding the turn computes: a side holds it
    from start-up to the end of each training step, then hands it over and waits for it to come
    back. Consecutive steps of ours and theirs thus alternate, a few seconds apart, under the
    same machine load, and no timed step ever overlaps the other side's work (start-up, data,
    compile, evaluation or max-batch search included). The turn travels as one byte over two
    pipes set up by the parent: ``g`` (your turn) or ``d`` (the other side has finished: run
    freely). Outside a pair (env var unset) every call is a no-op.
    """

    def __init__(self, spec: Optional[str]) -> None:
        self.in_fd: Optional[int] = None
        self.out_fd: Optional[int] = None
        self.free = True
        if spec:
            self.in_fd, self.out_fd = (int(x) for x in spec.split(","))
            self.free = False

    def acquire(self) -> None:
        """Block until it is this side's turn (or the other side is gone)."""
        if self.free or self.in_fd is None:
            return
        if os.read(self.in_fd, 1) in (b"d", b""):
            self.free = True

    def _send(self, token: bytes) -> None:
        if self.out_fd is None:
            return
        try:
            os.write(self.out_fd, token)
        except OSError:  # the other side has exited
            self.free = True

    def handoff(self) -> None:
        """End of a step: give the turn to the other side and wait for it to come back."""
        if self.free:
            return
        self._send(b"g")
        self.acquire()

    def finish(self) -> None:
        """This side is done: let the other side run freely from now on."""
        self._send(b"d")
        self.out_fd = None
        self.free = True


BATON = Baton(os.environ.get(BATON_ENV))
# (start, end) wall-clock times of every training step of this process, so the report can show
# that the two sides' steps never overlapped.
STEP_WINDOWS: list[tuple[float, float]] = []


def run_subprocess(side: str, cfg: Any, maxbatch: Optional[dict[str, Any]], threads: Optional[int],
                   timeout: Optional[float], exact_schedule: bool = False) -> dict[str, Any]:
    """Run one side in a fresh Python process; return its result (with status)."""
    with tempfile.TemporaryDirectory(prefix="compare-hf-") as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({"config": cfg.to_dict(), "maxbatch": maxbatch, "threads": threads,
                                    "exact_schedule": exact_schedule}))
        cmd = [*WORKER_COMMAND, "--worker", side, str(spec), str(out)]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return {"status": "timeout", "error": f"run exceeded {timeout:.0f} s"}
        except BaseException:  # Ctrl-C or a kill of this process: the worker must not run on alone
            proc.kill()
            reap(proc)  # not proc.wait(): the interrupt may have left Popen's wait lock held
            raise
        wall = time.perf_counter() - start
        if out.is_file():
            result = json.loads(out.read_text())
        else:
            tail = " | ".join((err or "").strip().splitlines()[-3:])
            result = {"status": "error", "error": f"worker ended with code {proc.returncode} before writing: {tail}"}
    result["process_wall_s"] = wall
    return result


def run_pair(order: tuple[str, str], cfg: Any, maxbatch: Optional[dict[str, Any]], threads: Optional[int],
             timeout: Optional[float], exact_schedule: bool = False) -> dict[str, dict[str, Any]]:
    """Run both sides at once in lockstep (see :class:`Baton`), ``order[0]`` taking the first turn."""
    inbox = {side: os.pipe() for side in order}  # side -> (read end, write end)
    procs: dict[str, subprocess.Popen] = {}
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="compare-hf-") as tmp:
        paths = {}
        for side in order:
            other = order[1] if side == order[0] else order[0]
            spec, out, err = (Path(tmp) / f"{side}.{x}" for x in ("spec.json", "out.json", "stderr"))
            paths[side] = (out, err)
            spec.write_text(json.dumps({"config": cfg.to_dict(), "maxbatch": maxbatch, "threads": threads,
                                        "exact_schedule": exact_schedule}))
            fds = (inbox[side][0], inbox[other][1])
            env = {**os.environ, BATON_ENV: f"{fds[0]},{fds[1]}"}
            cmd = [*WORKER_COMMAND, "--worker", side, str(spec), str(out)]
            with open(err, "w") as fh:
                procs[side] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=fh, env=env, pass_fds=fds)
        for side in order:
            os.close(inbox[side][0])
        start = time.perf_counter()
        os.write(inbox[order[0]][1], b"g")
        try:
            walls = _wait_for_pair(procs, inbox, start, timeout)
        finally:
            for side in order:
                with contextlib.suppress(OSError):
                    os.close(inbox[side][1])
        for side in order:
            out, err = paths[side]
            if walls.get(side, -1.0) < 0:
                results[side] = {"status": "timeout", "error": f"pair exceeded {timeout:.0f} s"}
                continue
            if out.is_file():
                results[side] = json.loads(out.read_text())
            else:
                tail = " | ".join(err.read_text().strip().splitlines()[-3:])
                results[side] = {"status": "error", "error": f"worker ended with code {procs[side].returncode} "
                                                            f"before writing: {tail}"}
            results[side]["process_wall_s"] = walls[side]
    return results


def _wait_for_pair(procs: dict[str, subprocess.Popen], inbox: dict[str, tuple[int, int]], start: float,
                   timeout: Optional[float]) -> dict[str, float]:
    """Each side's wall time once both have ended (-1.0: killed at ``timeout``). A side that ends
    wakes the other (it must not wait for a turn that never comes); on Ctrl-C or a kill of this
    process both workers are killed before the interrupt goes on."""
    walls: dict[str, float] = {}
    try:
        while len(walls) < len(procs):
            for side, proc in procs.items():
                if side not in walls and proc.poll() is not None:
                    walls[side] = time.perf_counter() - start
                    for other in procs:  # a side that died mid-run must not leave the other waiting
                        if other != side:
                            with contextlib.suppress(OSError):
                                os.write(inbox[other][1], b"d")
            if timeout is not None and time.perf_counter() - start > timeout:
                for side, proc in procs.items():
                    if side not in walls:
                        proc.kill()
                        proc.wait()
                        walls[side] = -1.0
                break
            time.sleep(0.2)
    except BaseException:  # no worker runs on alone
        for proc in procs.values():
            if proc.returncode is None:  # not poll(): the interrupt may have left Popen's wait lock held
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                reap(proc)
        raise
    return walls


def window_overlap_s(a: list, b: list) -> float:
    """Seconds during which a step of one side ran while a step of the other side also ran."""
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)

