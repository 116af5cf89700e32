"""Is `memtrain estimate --json` byte-identical between two versions of the code?

A restructure must not move a single predicted byte. This script runs `memtrain estimate --json`
on the 19-config accuracy grid of tests/test_estimate.py (GRID) and on every model preset
(`--model NAME`), writes one file per config, and compares two such folders.

    python benchmarks/estimate_identity.py dump OUT_DIR          # the memtrain on PYTHONPATH
    python benchmarks/estimate_identity.py diff DIR_A DIR_B      # two folders
    python benchmarks/estimate_identity.py commits REV_A REV_B   # two git revisions

`commits` checks each revision out with `git worktree add --detach` into a temporary folder and
runs `dump` there as a subprocess with PYTHONPATH=<worktree>/src, so both sides run their own
code. The list of configs always comes from the *current* tree (its tests/test_estimate.py and
memtrain.config.presets), passed to each side as argv lists: an old revision without a preset reports
it as an error instead of silently skipping it.

Exit status: 0 when every config is identical, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _flags(overrides: dict[str, Any]) -> list[str]:
    """Config overrides as the CLI flags `add_config_flags` defines (one flag per field)."""
    argv: list[str] = []
    for key, value in overrides.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + key.replace("_", "-"))
        else:
            argv += [flag, str(value)]
    return argv


def cases() -> dict[str, list[str]]:
    """name -> argv of `memtrain estimate`, from the current tree's grid and presets."""
    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT / "src"))
    from memtrain.config.presets import PRESETS
    from test_estimate import GRID  # the accuracy grid lives in its test, not copied here

    out = {f"grid-{name}": ["estimate", "--json", *_flags(overrides)] for name, overrides in GRID}
    out.update({f"preset-{name}": ["estimate", "--json", "--model", name] for name in PRESETS})
    return out


def dump(out_dir: Path, argvs: dict[str, list[str]]) -> None:
    """Run every case in this process (one torch import, not 27) and write NAME.json."""
    from memtrain.cli import main

    out_dir.mkdir(parents=True, exist_ok=True)
    for name, argv in argvs.items():
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                rc = main(argv)
            except SystemExit as exc:  # argparse rejects a flag this revision does not know
                rc = exc.code if isinstance(exc.code, int) else 2
        text = stdout.getvalue() if rc == 0 else f"exit {rc}\n{stderr.getvalue()}"
        (out_dir / f"{name}.json").write_text(text, encoding="utf-8")


def diff(a: Path, b: Path) -> int:
    """Print identical/different per config; the number of configs that are not identical."""
    names = sorted({p.name for p in a.glob("*.json")} | {p.name for p in b.glob("*.json")})
    bad = 0
    for name in names:
        fa, fb = a / name, b / name
        if not fa.exists() or not fb.exists():
            state = f"missing in {a if not fa.exists() else b}"
        elif fa.read_text(encoding="utf-8").startswith("exit ") or fb.read_text(encoding="utf-8").startswith("exit "):
            # A config that fails (on either side) proves nothing, even when both fail alike.
            failed = [str(p.parent.name) for p in (fa, fb) if p.read_text(encoding="utf-8").startswith("exit ")]
            state = "failed in " + ", ".join(failed) + ": " + " ".join(
                next(p for p in (fa, fb) if p.read_text(encoding="utf-8").startswith("exit ")).read_text(
                    encoding="utf-8").split())[:160]
        elif fa.read_bytes() == fb.read_bytes():
            state = "identical"
        else:
            state = "different: " + _what_differs(fa.read_text(encoding="utf-8"), fb.read_text(encoding="utf-8"))
        bad += state != "identical"
        print(f"{name[:-5]:<45} {state}")
    print(f"{len(names) - bad}/{len(names)} identical")
    return bad


def _what_differs(a: str, b: str) -> str:
    """The JSON keys whose values differ (dotted paths, first 6), or 'output' when not JSON."""
    try:
        ja, jb = json.loads(a), json.loads(b)
    except json.JSONDecodeError:
        return "output (not JSON on one side: " + (a if not a.startswith("{") else b).splitlines()[0] + ")"
    changed: list[str] = []
    added: list[str] = []  # keys only B has: new result keys extend the contract, they change no value
    removed: list[str] = []

    def walk(x: Any, y: Any, path: str) -> None:
        if isinstance(x, dict) and isinstance(y, dict):
            for k in sorted(set(x) | set(y), key=str):
                sub = f"{path}.{k}" if path else str(k)
                if k not in x:
                    added.append(sub)
                elif k not in y:
                    removed.append(sub)
                else:
                    walk(x[k], y[k], sub)
        elif isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
            for i, (u, v) in enumerate(zip(x, y)):
                walk(u, v, f"{path}[{i}]")
        elif x != y:
            changed.append(path or "<root>")

    walk(ja, jb, "")
    parts = [f"{label}: " + ", ".join(keys[:6]) + (f" (+{len(keys) - 6} more)" if len(keys) > 6 else "")
             for label, keys in (("changed", changed), ("removed", removed), ("added", added)) if keys]
    return "; ".join(parts) or "same values, different bytes (key order or formatting)"


def commits(rev_a: str, rev_b: str, keep: Path | None) -> int:
    argvs = cases()
    with tempfile.TemporaryDirectory(prefix="estimate-identity-") as tmp:
        base = keep or Path(tmp)
        spec = Path(tmp) / "cases.json"
        spec.write_text(json.dumps(argvs), encoding="utf-8")
        outs = []
        for i, rev in enumerate((rev_a, rev_b)):
            tree = Path(tmp) / f"tree{i}"
            out = base / f"{i}-{rev.replace('/', '_')}"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), rev], check=True)
            try:
                env = dict(os.environ, PYTHONPATH=str(tree / "src"))
                subprocess.run([sys.executable, __file__, "dump", str(out), "--cases", str(spec)], env=env,
                               check=True, cwd=tree)
            finally:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=True)
            outs.append(out)
        print(f"A = {rev_a} ({_sha(rev_a)}), B = {rev_b} ({_sha(rev_b)})")
        return diff(*outs)


def _sha(rev: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev], capture_output=True, text=True,
                          check=True).stdout.strip()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump", allow_abbrev=False, help="write OUT/NAME.json for every config, with the memtrain on PYTHONPATH")
    d.add_argument("out", type=Path)
    d.add_argument("--cases", type=Path, help="JSON {name: argv} (default: this tree's grid and presets)")
    f = sub.add_parser("diff", allow_abbrev=False, help="compare two dump folders")
    f.add_argument("a", type=Path)
    f.add_argument("b", type=Path)
    c = sub.add_parser("commits", allow_abbrev=False, help="dump two git revisions (via git worktree) and compare them")
    c.add_argument("rev_a")
    c.add_argument("rev_b")
    c.add_argument("--keep", type=Path, help="keep both dump folders under this folder")
    args = p.parse_args()
    if args.cmd == "dump":
        argvs = json.loads(args.cases.read_text(encoding="utf-8")) if args.cases else cases()
        dump(args.out, argvs)
        return 0
    if args.cmd == "diff":
        return 1 if diff(args.a, args.b) else 0
    return 1 if commits(args.rev_a, args.rev_b, args.keep) else 0


if __name__ == "__main__":
    sys.exit(main())
