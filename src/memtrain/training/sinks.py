"""Live training logs: ``OUT/metrics.jsonl`` always, TensorBoard and Weights & Biases on request.

``result.json`` is written at the end of a run; a killed run would leave no loss curve. The
train loop hands each step's numbers to a :class:`MetricsLogger`, which appends one JSON line
per logged step to ``metrics.jsonl`` (flushed, so a crash keeps every line written) and
forwards the same scalars to the libraries the user already looks at: torch's
``SummaryWriter`` (``--report-to tensorboard``, extra ``memtrain[tensorboard]``) and ``wandb``
(``--report-to wandb``, extra ``memtrain[wandb]``; ``WANDB_MODE=offline`` works without an
account). Under torchrun only rank 0 logs.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Optional, Protocol

from memtrain.config.run import ConfigError
from memtrain.errors import first_line
from memtrain.files.results import METRICS_NAME, drop_planted_link, open_append, open_new, write_all

# Bytes copied at a time from a curve no longer in the folder into the file that takes its name.
_COPY_PIECE = 1 << 20

REPORT_TO = ("none", "tensorboard", "wandb")
# The folder inside --out each logger writes its own files into (wandb makes OUT/wandb itself).
LOGGER_FOLDERS = {"tensorboard": "tensorboard", "wandb": "wandb"}


class Sink(Protocol):
    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per logged step, appended line by line (unbuffered: a crash keeps every
    line written).

    A fresh run creates the file (``O_EXCL``: an earlier run's curve is never overwritten; the
    CLI refuses such a folder before the first step). A resumed run appends to the curve it
    continues, after a newline when a kill left the last line torn. Never through a link.
    The name is checked before each line, as result.json's and results.jsonl's are: when it no
    longer names this run's file (removed, replaced, a link planted), the curve goes on in the file
    now at the name (a link is replaced, never followed), after the lines written so far when the
    file they are in is no longer anywhere; otherwise every later line went to a removed file.
    A failed write (a full disk) does not stop the run: the sink says so once, stops writing,
    and keeps the error in :attr:`failure` for the run to report after its other writes."""

    def __init__(self, path: Path, resumed_from: Optional[int] = None) -> None:
        self.path = Path(path)
        append = resumed_from is not None  # a resumed run continues the curve; a fresh one creates it
        self.fd: Optional[int] = open_append(self.path) if append else open_new(self.path)
        self.failure: Optional[BaseException] = None
        self.created_empty = not append  # until the first line: a file only this run made
        # A resumed run's first line says where it continued from: the lines of an interrupted
        # run past its last checkpoint stay (nothing written is removed), and the resumed run
        # logs those steps again after them.
        self.resumed_from = resumed_from

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if self.fd is None:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in scalars.items()}
        if self.resumed_from is not None:
            clean["resumed_from_step"] = self.resumed_from
        try:
            self._follow_the_name()
            write_all(self.fd, (json.dumps({"step": step, **clean}) + "\n").encode(), self.path)
            self.created_empty = False
            self.resumed_from = None
        except (OSError, ConfigError) as exc:  # ConfigError: a folder or FIFO now at the name
            self.failure = exc
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            sys.stderr.write(f"warning: cannot write {self.path} ({reason}); training goes on, "
                             f"its curve from step {step} on is not logged\n")
            self.close()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _follow_the_name(self) -> None:
        """Reopen the curve at :attr:`path` when the name no longer names the open file."""
        assert self.fd is not None
        mine = os.fstat(self.fd)
        try:
            there = os.lstat(self.path)
            if (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino):
                return
        except FileNotFoundError:
            pass
        drop_planted_link(self.path)  # warns: a link is replaced, its target untouched
        old, self.fd = self.fd, None
        try:
            self.fd = open_append(self.path)
            # st_nlink 0: the file is in no folder any more (removed, or renamed over); its lines
            # would go with it. A file moved elsewhere keeps them where it was moved.
            copied = self._copy_lines(old) if mine.st_nlink == 0 else 0
        finally:
            os.close(old)
        sys.stderr.write(f"warning: {str(self.path)!r} was replaced or removed while the run wrote it; the curve "
                         f"goes on in the file now there" + (f" ({copied} bytes written before copied into it)"
                                                             if copied else "") + "\n")
        self.created_empty = False  # the file at the name is not one this run made empty

    def _copy_lines(self, old: int) -> int:
        """Append every byte of the descriptor ``old`` to the curve (then a newline if its last
        line was torn, so the next line stays intact); the count copied."""
        assert self.fd is not None
        copied, last = 0, b"\n"
        while piece := os.pread(old, _COPY_PIECE, copied):
            write_all(self.fd, piece, self.path)
            copied, last = copied + len(piece), piece
        if not last.endswith(b"\n"):
            write_all(self.fd, b"\n", self.path)
        return copied

    def discard_if_empty(self) -> None:
        """Close, and remove the file when this run created it and wrote no line (a run that failed
        before its first step): an empty metrics.jsonl would make the folder refuse the next run."""
        if self.fd is not None and self.created_empty:
            mine = os.fstat(self.fd)
            try:
                there = os.lstat(self.path)
                if (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino) and there.st_size == 0:
                    os.unlink(self.path)
            except OSError:
                pass  # gone or replaced already: nothing of this run's to remove
        self.close()


class TensorBoardSink:
    """torch.utils.tensorboard's SummaryWriter; tags ``train/<name>``."""

    def __init__(self, log_dir: Path) -> None:
        try:
            # tensorboard is an optional package (the try says what then)
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("--report-to tensorboard needs the tensorboard package: "
                              "pip install 'memtrain[tensorboard]'") from None
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for k, v in scalars.items():
            if v is not None:
                self.writer.add_scalar(f"train/{k}", v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A wandb run in ``OUT`` (set WANDB_MODE=offline to log without an account)."""

    def __init__(self, out: Path, config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError("--report-to wandb needs the wandb package: pip install 'memtrain[wandb]'") from None
        try:
            self.run = wandb.init(project="memtrain", dir=str(out), config=config, reinit=True)
        except (wandb.errors.UsageError, wandb.errors.AuthenticationError, ValueError) as exc:
            # No login (no API key, no network to log in), or a WANDB_* variable wandb cannot read
            # (its settings' ValidationError is a ValueError): the user's setup, said in one line.
            reason = first_line(exc)
            raise ConfigError(f"--report-to wandb cannot start a run ({reason}); run `wandb login`, set "
                              "WANDB_API_KEY, or set WANDB_MODE=offline to log without an account") from None

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log({f"train/{k}": v for k, v in scalars.items() if v is not None}, step=step)

    def close(self) -> None:
        self.run.finish()


def parse_report_to(spec: str) -> list[str]:
    """``tensorboard,wandb`` -> the sink names; ``none`` -> []."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    for n in names:
        if n not in REPORT_TO:
            raise ConfigError(f"unknown --report-to {n!r}; choose from {', '.join(REPORT_TO)} (comma-separated)")
    return [n for n in names if n != "none"]


class MetricsLogger:
    """Fans one step's scalars out to every sink; a no-op when ``enabled`` is False (rank > 0).
    ``resumed_from`` (a resumed run: the step it continues from) appends to metrics.jsonl, whose
    next line then carries it as ``resumed_from_step``; None creates the file."""

    def __init__(self, out: str | Path, report_to: str = "none", every: int = 1, enabled: bool = True,
                 resumed_from: Optional[int] = None, config: Optional[dict[str, Any]] = None) -> None:
        self.every = max(1, every)
        self.sinks: list[Sink] = []
        self.jsonl: Optional[JsonlSink] = None
        names = parse_report_to(report_to)  # validated on every rank: a typo fails everywhere alike
        if not enabled:
            return
        out = Path(out)
        self.path = out / METRICS_NAME
        try:
            # The sinks that can refuse (no login, a missing package) start first, so that a
            # refusal leaves no metrics.jsonl behind.
            if "wandb" in names:
                self.sinks.append(WandbSink(out, config or {}))
            if "tensorboard" in names:
                self.sinks.append(TensorBoardSink(out / LOGGER_FOLDERS["tensorboard"]))
            self.jsonl = JsonlSink(self.path, resumed_from)
            self.sinks.insert(0, self.jsonl)
        except BaseException:
            self.close()
            raise

    def log(self, step: int, scalars: dict[str, Any], force: bool = False) -> None:
        """Log ``scalars`` for ``step`` (1-based, the number of completed optimizer steps)."""
        if self.sinks and (force or step % self.every == 0):
            for sink in self.sinks:
                sink.log(step, scalars)

    @property
    def failure(self) -> Optional[BaseException]:
        """The error that stopped ``metrics.jsonl`` (a full disk), or None."""
        return self.jsonl.failure if self.jsonl is not None else None

    def close(self, discard_if_empty: bool = False) -> None:
        """Close every sink; ``discard_if_empty`` (a failed run): remove a metrics.jsonl this run
        created and never wrote to."""
        if discard_if_empty and self.jsonl is not None:
            self.jsonl.discard_if_empty()
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def live_memory(device: Any) -> dict[str, Optional[int]]:
    """Memory figures cheap enough to read every step: the CUDA allocator's current and peak
    bytes, or on CPU the process's peak resident set (the tracked meter runs on two steps only)."""
    # torch loads only when a run logs: the CLI's checks import this module
    import torch

    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        return {"memory_allocated_bytes": int(torch.cuda.memory_allocated(dev)),
                "max_allocated_bytes": int(torch.cuda.max_memory_allocated(dev))}
    try:
        # resource is Unix only (the try says what then)
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        return {"rss_peak_bytes": int(rss if sys.platform == "darwin" else rss * 1024)}
    except (ImportError, OSError):
        return {"rss_peak_bytes": None}
