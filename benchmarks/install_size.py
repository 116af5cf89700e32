"""Disk size of memtrain's install and of each extra, measured on the installed packages.

For the core and each extra: the distributions its requirements in this checkout's
pyproject.toml pull in (followed through their own requirements, environment markers
evaluated), and the bytes of their installed files (each file listed in the distribution's
RECORD, measured with os.path.getsize). Run it in an environment where they are installed
(e.g. after ``pip install -e '.[dev]'``); a requirement that is not installed is listed as
missing, not guessed.

    python benchmarks/install_size.py            # a table
    python benchmarks/install_size.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

EXTRAS = ("core", "lowbit", "lora", "hub", "tensorboard", "wandb", "hf", "test", "dev")


def _name(text: str) -> str:
    return re.sub(r"[-_.]+", "-", text).lower()


def dist_bytes(dist: metadata.Distribution) -> int:
    total = 0
    for f in dist.files or []:
        path = f.locate()
        if os.path.isfile(path):
            total += os.path.getsize(path)
    return total


def closure(roots: list[tuple[str, set[str]]], skip: set[str]) -> tuple[set[str], set[str]]:
    """(installed distribution names, missing names) reached from ``roots`` (name, extras)."""
    seen: set[str] = set()
    missing: set[str] = set()
    todo = list(roots)
    while todo:
        name, extras = todo.pop()
        key = _name(name)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            missing.add(key)
            continue
        new = key not in seen
        seen.add(key)
        for text in dist.requires or []:
            req = Requirement(text)
            envs = [{"extra": e} for e in (extras or {""})]
            if req.marker is not None and not any(req.marker.evaluate(env) for env in envs):
                continue
            if _name(req.name) in skip or (not new and not req.extras):
                continue
            todo.append((req.name, set(req.extras)))
    return seen - skip, missing


def extra_requirements(project: dict, extra: str) -> list[str]:
    """The requirement texts one extra of pyproject.toml's ``project`` table adds, memtrain's own
    extras (``memtrain[lowbit]``) expanded, each extra once."""
    texts: list[str] = []
    todo, done = [extra], set()
    while todo:
        e = todo.pop()
        if e in done:
            continue
        done.add(e)
        for text in project["optional-dependencies"][e]:
            req = Requirement(text)
            if _name(req.name) == "memtrain":
                todo += sorted(req.extras)
            else:
                texts.append(text)
    return texts


def requirements(extra: str) -> list[tuple[str, set[str]]]:
    """The (name, extras) roots of the core (``extra == "core"``: its dependencies) or of the
    core plus one extra, from pyproject.toml, memtrain's own extras expanded."""
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    texts = list(project["dependencies"])
    if extra != "core":
        texts += extra_requirements(project, extra)
    return [(Requirement(t).name, set(Requirement(t).extras)) for t in texts]


def sizes() -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    core, _ = closure(requirements("core"), set())
    for extra in EXTRAS:
        dists, missing = closure(requirements(extra), set())
        added = dists if extra == "core" else dists - core
        by_dist = {d: dist_bytes(metadata.distribution(d)) for d in sorted(added)}
        out[extra] = {"bytes": sum(by_dist.values()), "distributions": by_dist, "missing": sorted(missing)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    res = sizes()
    if args.json:
        print(json.dumps(res, indent=2))
        return
    for extra, r in res.items():
        top = sorted(r["distributions"].items(), key=lambda kv: -kv[1])[:6]  # type: ignore[union-attr]
        what = "core install" if extra == "core" else f"[{extra}] adds to the core"
        print(f"{what}: {r['bytes'] / 1e6:,.0f} MB ({', '.join(f'{d} {b / 1e6:,.0f}' for d, b in top)})"
              + (f"; not installed: {', '.join(r['missing'])}" if r["missing"] else ""))


if __name__ == "__main__":
    main()
