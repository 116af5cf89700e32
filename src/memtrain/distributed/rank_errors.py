"""Errors of a multi-rank run: every rank fails together, and the reason is said once.

Under torchrun each rank is its own process. A bad input that only one rank sees (its own
``rank-R.pt`` of a sharded checkpoint, a data file missing on one node) used to fail that
rank alone while the others walked into their next collective and waited there until the
launcher killed them: rank 0, the rank that prints, never learned why.

- :func:`agreement`: a block that every rank runs before a collective could strand it. At
  its end the ranks exchange their outcome (one ``all_gather_object``); if any rank failed,
  every rank raises: the failing rank its own exception, the others a ConfigError (bad
  input, exit 2) or RuntimeError (exit 1) naming the rank and its reason. So every rank
  exits with the same code and rank 0 can print the line. The block must hold no
  collective itself (a failing rank would skip it and strand the others inside it).
  Outside a process group the block runs as is.
- :func:`record_error_line`: the one ``error:`` line also goes into torchelastic's per-rank
  error file (``TORCHELASTIC_ERROR_FILE``, set by torchrun for every worker), so torchrun's
  failure summary shows the reason instead of a link, and ``memtrain train
  --nproc-per-node N`` (:mod:`memtrain.distributed.launch`) prints it once as the last line.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from memtrain.errors import ConfigError, first_line, one_line, typed_first_line

# Set by memtrain.distributed.launch for the ranks it starts: the launcher prints the error line (once,
# after torch's launcher has gone quiet) and holds the --out lock for the ranks.
LAUNCHED_ENV = "MEMTRAIN_LAUNCHED"
ERROR_DIR_ENV = "MEMTRAIN_ERROR_DIR"  # where the launcher's ranks leave their error line


def launched_by_memtrain() -> bool:
    """Whether this process is a rank started by ``memtrain train --nproc-per-node``."""
    return os.environ.get(LAUNCHED_ENV) == "1" and "WORLD_SIZE" in os.environ


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in a torchrun launch (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``)."""

    rank: int
    world_size: int
    local_rank: int


def _env_int(name: str, default: Optional[str] = None) -> int:
    raw = os.environ.get(name, default)
    if raw is None:
        raise ConfigError(f"{name} is not set but WORLD_SIZE is; launch with torchrun (it sets both) "
                          "or unset WORLD_SIZE")
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw[:40]!r} is not an integer; launch with torchrun "
                          f"(it sets {name}) or unset it") from None


TIMEOUT_ENV = "MEMTRAIN_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
# torch keeps a process group's timeout in int64 nanoseconds (about 292 years): beyond that the
# rendezvous failed or not from run to run ("The client socket has timed out after
# -5833720454947758ms" at 999,999,999 days). A billion seconds (31 years)
# is far from it and from any wait a run means.
MAX_TIMEOUT_S = 1e9


def rendezvous_timeout_s() -> float:
    """``MEMTRAIN_DIST_TIMEOUT`` in seconds (DEFAULT_TIMEOUT_S when unset or empty), checked: a
    finite number in (0, MAX_TIMEOUT_S]. NaN and infinity failed in ``timedelta`` with Python's
    own words (exit 1), after the input was checked."""
    raw = os.environ.get(TIMEOUT_ENV)
    try:
        seconds = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= MAX_TIMEOUT_S:  # False for NaN too
        raise ConfigError(f"environment variable {TIMEOUT_ENV}={(raw or '')[:40]!r} must be a number of seconds "
                          f"above 0 and at most {MAX_TIMEOUT_S:.0e}, e.g. 300; set one, or unset it for "
                          f"{DEFAULT_TIMEOUT_S:.0f}")
    return seconds


def launch_world_size() -> Optional[int]:
    """``WORLD_SIZE``, checked (an integer >= 1); None when it is not set."""
    if "WORLD_SIZE" not in os.environ:
        return None
    world = _env_int("WORLD_SIZE")
    if world < 1:
        raise ConfigError(f"environment variable WORLD_SIZE={world} must be at least 1; launch with torchrun "
                          "or unset it")
    return world


def launch_env() -> Optional[LaunchEnv]:
    """The launch variables, checked; None outside a launcher (no ``WORLD_SIZE``).

    torch reads them as they are: ``RANK=5 WORLD_SIZE=2`` or ``RANK=-1`` waits at the
    rendezvous for ranks that never come (until the timeout, minutes), ``RANK=abc`` fails with
    a traceback. Checked before anything joins a group, as bad input (exit 2)."""
    world = launch_world_size()
    if world is None:
        return None
    rank = _env_int("RANK")
    if not 0 <= rank < world:
        raise ConfigError(f"environment variable RANK={rank} must be in [0, WORLD_SIZE={world}); launch with "
                          "torchrun or fix RANK")
    local = _env_int("LOCAL_RANK", "0")
    local_world = _env_int("LOCAL_WORLD_SIZE", str(world))
    if not 0 <= local < max(1, local_world):
        raise ConfigError(f"environment variable LOCAL_RANK={local} must be in [0, {local_world}); launch with "
                          "torchrun or fix LOCAL_RANK")
    return LaunchEnv(rank, world, local)


def env_rank() -> int:
    """This process's rank for deciding who prints: its launch rank when the launch variables
    are sound, else 0 (a process whose variables are wrong says so on its own stderr)."""
    try:
        env = launch_env()
    except ConfigError:
        return 0
    return env.rank if env is not None else 0


def _group_size() -> int:
    # torch loads only under a launch: the CLI imports this module before any command
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size()


def _outcome(exc: Optional[BaseException]) -> Optional[tuple[str, str]]:
    """What a rank tells the others: None (fine) or (kind, one-line reason)."""
    if exc is None:
        return None
    text = first_line(exc)
    if isinstance(exc, ConfigError):
        return "config", text
    return "failure", f"{type(exc).__name__}: {text}"


def raise_if_any_rank_failed(local: Optional[BaseException]) -> None:
    """Exchange outcomes with every rank; raise if any failed (see the module docstring)."""
    if _group_size() > 1:
        # torch loads only under a launch: the CLI imports this module before any command
        import torch.distributed as dist

        outcomes: list[Optional[tuple[str, str]]] = [None] * dist.get_world_size()
        # A rank that fails exits right after this exchange, and the launcher then sends
        # SIGTERM to the others, maybe before they have read the outcome (a loaded machine):
        # hold the signal back until this rank knows how it ends.
        with _sigterm_held() as held:
            dist.all_gather_object(outcomes, _outcome(local))
            if local is None:
                for rank, outcome in enumerate(outcomes):
                    if outcome is None:
                        continue
                    kind, text = outcome
                    local = ConfigError(f"rank {rank}: {text}") if kind == "config" else RuntimeError(f"rank {rank} failed: {text}")
                    break
            if local is not None:
                held.append(-1)  # the failure is agreed: SIGTERM from here on exits with its code
                _exit_with_code_on_sigterm(local, now=signal.SIGTERM in held)
    if local is not None:
        raise local


@contextlib.contextmanager
def _sigterm_held() -> Iterator[list[int]]:
    """Inside the block SIGTERM is recorded, not acted on; at its end a recorded SIGTERM is
    delivered again under the previous handler, unless the block took over (appended -1)."""
    held: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield held
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: held.append(signum))
    try:
        yield held
    finally:
        if -1 not in held:
            signal.signal(signal.SIGTERM, previous)
            if signal.SIGTERM in held:
                os.kill(os.getpid(), signal.SIGTERM)


def error_line(exc: BaseException) -> str:
    """The one ``error:`` line the CLI prints for ``exc`` (bad input, or another failure)."""
    if isinstance(exc, ConfigError):
        return f"error: {exc}"
    return f"error: {typed_first_line(exc)} (set MEMTRAIN_DEBUG=1 for the traceback)"


_said = False


def begin_command() -> None:
    """Forget a line said by an earlier command run in this process (tests call main() often)."""
    global _said
    _said = False


def say_error(line: str, code: int, every_rank: bool = True) -> None:
    """The one ``error:`` line on stderr, at most once per process; under torchrun also into
    the rank's error file. Bad input is said by rank 0 only (every rank agrees on it), and
    under ``--nproc-per-node`` by the launcher alone (memtrain.distributed.launch), once, at the end."""
    global _said
    if _said:
        return
    _said = True
    # One line whatever the message echoes (a path or --model spec with a newline in it).
    line = one_line(line.rstrip("\n"))
    record_error_line(line, code)
    debug = bool(os.environ.get("MEMTRAIN_DEBUG"))
    # The launcher says the line it finds in its folder; without that folder (MEMTRAIN_LAUNCHED
    # left in an environment memtrain's launcher did not make) no one would: exit 2, no line.
    relayed = bool(os.environ.get(ERROR_DIR_ENV)) and "RANK" in os.environ
    if launched_by_memtrain() and relayed and not debug:
        return
    if every_rank or env_rank() == 0 or debug:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


def _exit_with_code_on_sigterm(exc: BaseException, now: bool = False) -> None:
    """Once the ranks agree that the run failed, the launcher's SIGTERM (it stops the other
    ranks as soon as one has exited) must not turn this rank's exit 2 into "killed by
    SIGTERM": say the line and exit with the agreed code at once (``now``: it came already)."""
    code = 2 if isinstance(exc, ConfigError) else 1
    line = error_line(exc)

    def handler(signum: int, frame: Any) -> None:
        say_error(line, code, every_rank=code != 2)
        os._exit(code)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)
    if now:
        handler(signal.SIGTERM, None)


@contextlib.contextmanager
def agreement() -> Iterator[None]:
    """Run the block on every rank; afterwards all ranks go on, or all raise."""
    failure: Optional[Exception] = None
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - handed to every rank, then re-raised here
        failure = exc
    raise_if_any_rank_failed(failure)


def record_error_line(line: str, code: int = 1) -> None:
    """Write ``line`` into torchelastic's error file of this worker, when there is one, and
    into memtrain's launcher folder (``MEMTRAIN_ERROR_DIR``) with the exit code.

    The torchelastic file holds what torch's own ``@record`` writes, with our line where the
    traceback would be (torchrun prints that field as the failure's "traceback"). The
    launcher reads its own folder: torch's agent reports only the ranks that had failed when
    it looked, and stops the rest, so it may never see rank 0's line."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    stamp = str(int(time.time()))
    if path:
        data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": stamp}}}
        with contextlib.suppress(OSError):
            with open(path, "w") as fh:
                json.dump(data, fh)
    folder = os.environ.get(ERROR_DIR_ENV)
    if folder and "RANK" in os.environ:
        with contextlib.suppress(OSError):
            with open(os.path.join(folder, f"rank-{env_rank()}.json"), "w") as fh:
                json.dump({"line": line, "code": code}, fh)


def read_error_lines(folder: str) -> dict[int, tuple[str, int]]:
    """``{rank: (line, exit code)}`` written by :func:`record_error_line` into ``folder``."""
    found: dict[int, tuple[str, int]] = {}
    for name in os.listdir(folder):
        if not (name.startswith("rank-") and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(folder, name)) as fh:
                data = json.load(fh)
            found[int(name[len("rank-"):-len(".json")])] = (str(data["line"]), int(data["code"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a rank killed mid-write: the others still speak
    return found


def error_line_of(message: object) -> Optional[str]:
    """Our ``error:`` line from a failure message torchelastic read back (None if not ours)."""
    if isinstance(message, dict):
        message = message.get("message")
    if isinstance(message, str) and message.startswith("error:"):
        return message.splitlines()[0]
    return None
