"""Command line: parse -> config -> call one library function -> print.

Exit codes (docs/architecture.md): 0 success; 2 bad input, with one line on stderr starting
``error:`` that says what to change; 1 any other failure; 130 interrupted.

Run/model/technique flags are generated from the config dataclasses, so every config field
is a flag with its docstring as help, and a config file (YAML/TOML) may set the same keys.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import sys
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from memtrain.config import SECTIONS, ConfigError, RunConfig, build_config, load_config_file
from memtrain.results import write_json_atomic  # noqa: F401 - re-exported: older code imports it from here


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one ``error:`` line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"error: {message}; see '{self.prog} --help'\n")
        raise SystemExit(2)


def _type_name(f: Any) -> str:
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return t[len("Optional["):-1] if t.startswith("Optional[") else t


def add_config_flags(parser: argparse.ArgumentParser, sections: Sequence[str] = tuple(SECTIONS),
                     exclude: Sequence[str] = ()) -> None:
    """One flag per config field of ``sections`` (except the field names in ``exclude``);
    unset flags stay absent (SUPPRESS) so that a config file's values are only overridden by
    flags actually given."""
    parser.add_argument("--config", help="YAML or TOML file with settings (sections model/data/technique/train or flat keys).")
    for section in sections:
        group = parser.add_argument_group(f"{section} options")
        for f in fields(SECTIONS[section]):
            if f.name in exclude:
                continue
            flag = "--" + f.name.replace("_", "-")
            default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc,operator]  # MISSING ruled out just before
            help_text = f"{f.metadata.get('help', '')} (default: {default})"
            kind = _type_name(f)
            if kind == "bool":
                group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                                   default=argparse.SUPPRESS, help=help_text)
            else:
                group.add_argument(flag, dest=f.name, default=argparse.SUPPRESS, metavar=kind.upper(),
                                   help=help_text)


def config_from_args(args: argparse.Namespace, base: Optional[dict[str, Any]] = None) -> RunConfig:
    """Defaults <- ``base`` (e.g. a bench preset) <- config file <- flags."""
    known = {f.name for cls in SECTIONS.values() for f in fields(cls)}
    flags = {k: v for k, v in vars(args).items() if k in known}
    file_layer = load_config_file(args.config) if getattr(args, "config", None) else {}
    return build_config(base or {}, file_layer, flags)


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


# --------------------------------------------------------------------------- train
def cmd_train(args: argparse.Namespace) -> int:
    from memtrain.train import train

    cfg = config_from_args(args)
    out = Path(cfg.train.out)
    main_rank = int(os.environ.get("RANK", "0")) == 0  # under torchrun only rank 0 writes and prints

    def write_result(result: dict) -> None:  # before the final checkpoint (see train())
        if main_rank:
            write_json_atomic(out / "result.json", result)

    # SIGTERM (kill, a job scheduler) stops like Ctrl-C: finally blocks run, scratch is removed,
    # exit 130. Not under torchrun, whose launcher owns its workers' signals.
    from memtrain.signals import sigterm_as_interrupt

    guard = sigterm_as_interrupt() if "WORLD_SIZE" not in os.environ else contextlib.nullcontext()
    with guard:
        result = train(cfg, on_result=write_result)
    if not main_rank:
        return 0  # result["ranks"] has every rank's numbers
    mem = result["memory"]
    print(
        f"steps {result['steps']}  train loss {result['train_loss']:.4f}  "
        f"val loss {result['val_loss']:.4f}  val ppl {result['val_ppl']:.2f}"
    )
    print(
        f"step time {result['step_time_s']['median'] * 1000:.1f} ms (median)  "
        f"{result['tokens_per_s']:,.0f} tokens/s  total {result['total_time_s']:.1f} s  "
        f"tracked peak {fmt_bytes(mem.get('peak_bytes'))}"
    )
    print(f"wrote {out / 'result.json'}")
    return 0


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}


def register(name: str, help: str, add_args: Callable[[argparse.ArgumentParser], None],
             run: Callable[[argparse.Namespace], int]) -> None:
    """Add a subcommand (other modules register theirs in :func:`_load_commands`)."""
    COMMANDS[name] = (help, add_args, run)


def _load_commands() -> None:
    register("train", "Train one model with any combination of techniques; writes OUT/result.json.",
             lambda p: add_config_flags(p), cmd_train)
    # Each module of memtrain/commands/ registers its own subcommand on import, so a new
    # command is a new file there and this module stays unchanged.
    import importlib
    import pkgutil

    import memtrain.commands as commands

    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        importlib.import_module(f"memtrain.commands.{info.name}")


def build_parser() -> argparse.ArgumentParser:
    _load_commands()
    parser = _Parser(prog="memtrain", description="Train Transformer LMs under memory limits and measure what each technique buys.")
    from memtrain import __version__

    parser.add_argument("--version", action="version", version=f"memtrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, (help_text, add_args, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_args(p)
        p.set_defaults(_run=run)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except ConfigError as exc:
        # Under torchrun every rank validates the same input and exits 2; only rank 0 says
        # why, so the user reads the line once rather than once per rank.
        if int(os.environ.get("RANK", "0")) == 0 or os.environ.get("MEMTRAIN_DEBUG"):
            sys.stderr.write(f"error: {exc}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted; results written so far are kept\n")
        return 130
    except OSError as exc:
        if exc.errno != errno.ENOSPC or os.environ.get("MEMTRAIN_DEBUG"):
            return _failure(exc)
        where = f" writing {exc.filename}" if exc.filename else ""
        sys.stderr.write(f"error: disk full{where}; free space and run again (files written before are intact)\n")
        return 1
    except Exception as exc:  # noqa: BLE001 - the contract: exit 1 with the reason
        return _failure(exc)


def _failure(exc: BaseException) -> int:
    """Exit 1 with the reason on one line (the traceback with MEMTRAIN_DEBUG=1)."""
    if os.environ.get("MEMTRAIN_DEBUG"):
        raise exc
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    sys.stderr.write(f"error: {type(exc).__name__}: {first} (set MEMTRAIN_DEBUG=1 for the traceback)\n")
    return 1


if __name__ == "__main__":
    sys.exit(main())
