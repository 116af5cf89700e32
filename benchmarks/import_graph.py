"""memtrain's import graph: circles, upward arrows and the largest modules.

    python benchmarks/import_graph.py [--src src/memtrain] [--top 12]

Reads every module under the package with `ast` (nothing is imported or executed) and draws an
arrow A -> B for each `import`/`from ... import` of a memtrain module B in A, at module level or
inside a function (a function-local import still couples the two modules; it only hides the
circle from Python's import machinery, so it is counted and marked `local`).

- circles: strongly connected components of the graph (Tarjan), at module level and in all.
- upward arrows: an arrow from a lower layer to a higher one in LAYERS below, the direction the
  data flows in (config -> data -> model -> techniques -> metrics -> FLOP counting -> step ->
  analysis -> report -> bench -> cli). memtrain.analysis holds two layers: its FLOP counting
  (below the step, which reports MFU) and the rest (above it). Within one layer no arrow is upward.
- largest modules: line counts, and every module over 500 lines.

Exit status 0 always: this script reports, the tests judge.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "memtrain"

# Layers, lowest first; a module's layer is that of its longest matching prefix. A module may
# import its own layer and those below, never one above. The top-level names of the analysis
# modules before they moved into memtrain.analysis (estimate, flops, trace, ...) stay listed so
# that the graph of an older checkout (--src) is layered the same way, for before/after views.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # What a run is and the facts every layer reads, torch-free where they can be: the typed
    # configuration and its flags (config), what a name refers to and its config (models.spec,
    # .source, .config_json, .auto_config, .light_config, hub access), the techniques' typed facts, files read and written, the process around a run, the
    # device's facts. Read while a config is validated, so below everything else.
    ("foundation", ("config", "errors", "files", "runtime", "devices", "analysis.limits",
                    "distributed.rank_errors", "models.spec", "models.source", "models.config_json",
                    "models.auto_config", "models.light_config", "models.hub_access", "techniques.facts")),
    ("data+model", ("data", "models", "attention")),
    ("techniques", ("techniques", "attention.apply", "distributed")),
    # GPU kinds and their FLOP rates are device facts measured against, so beside the meters.
    ("metrics", ("metrics", "devices.gpus")),
    # FLOP counting of one step (memtrain.analysis.flops: rules, classes, recorder, count): a
    # fact of model + techniques, the MFU numerator the train loop reports, so below the step.
    # Its roofline and report (flops.roofline) and its profiling (flops.profile, which trains)
    # are analysis.
    # The parameter count of a shape (analysis.estimate.params, pure arithmetic) belongs here
    # too: the builders' size check (preflight) asks it before a model is built.
    ("counting", ("analysis.flops", "analysis.estimate.params")),
    ("step", ("training", "checkpoints", "inference", "devices.advice", "distributed.launch")),
    ("analysis", ("analysis", "analysis.flops.roofline", "analysis.flops.profile")),
    ("report", ("report",)),
    ("bench", ("bench",)),
    ("cli", ("cli", "commands", "__main__")),
]


def layer_of(module: str) -> int:
    rel = module.removeprefix(PACKAGE + ".")
    best, rank = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (rel == p or rel.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    return rank  # -1: the package root (memtrain/__init__), outside the layering


def modules(src: Path) -> dict[str, Path]:
    out = {}
    for path in sorted(src.rglob("*.py")):
        parts = list(path.relative_to(src.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> list[tuple[str, bool, int]]:
    """(target module, function-local?, line) for each import of a memtrain module in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_pkg = path.name == "__init__.py"
    found: list[tuple[str, bool, int]] = []

    def resolve(base: str, names: list[str]) -> list[str]:
        # `from memtrain.x import y` is an import of memtrain.x.y when that is a module, else of memtrain.x.
        out = []
        for n in names:
            full = f"{base}.{n}"
            out.append(full if full in known else base)
        return out

    def visit(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for a in child.names:
                    if a.name.split(".")[0] == PACKAGE:
                        found.append((a.name, local, child.lineno))
            elif isinstance(child, ast.ImportFrom):
                if child.level:  # relative: resolve against this module's package
                    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                    pkg = pkg[: len(pkg) - child.level + 1]
                    base = ".".join(pkg + ([child.module] if child.module else []))
                else:
                    base = child.module or ""
                if base.split(".")[0] == PACKAGE:
                    for target in resolve(base, [a.name for a in child.names]):
                        found.append((target, local, child.lineno))
            visit(child, inner)

    visit(tree, False)
    # An import of a name that is not a module resolves to its module; drop self-arrows.
    return [(t if t in known else _owner(t, known), loc, ln) for t, loc, ln in found
            if (t if t in known else _owner(t, known)) != name]


def _owner(target: str, known: set[str]) -> str:
    while target and target not in known:
        target = target.rpartition(".")[0]
    return target


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--src", type=Path, default=ROOT / "src" / PACKAGE)
    p.add_argument("--top", type=int, default=12, help="how many of the largest modules to list")
    args = p.parse_args()

    mods = modules(args.src)
    known = set(mods)
    arrows: dict[tuple[str, str], bool] = {}  # (a, b) -> every import of b in a is function-local
    lines: dict[tuple[str, str], int] = {}
    for name, path in mods.items():
        for target, local, lineno in imports(name, path, known):
            key = (name, target)
            arrows[key] = arrows.get(key, True) and local
            lines.setdefault(key, lineno)

    short = {m: m.removeprefix(PACKAGE + ".") for m in mods}
    all_edges: dict[str, set[str]] = {}
    top_edges: dict[str, set[str]] = {}
    for (a, b), local in arrows.items():
        all_edges.setdefault(a, set()).add(b)
        if not local:
            top_edges.setdefault(a, set()).add(b)

    print(f"{len(mods)} modules, {len(arrows)} arrows ({sum(arrows.values())} only function-local)")
    for label, edges in (("module level", top_edges), ("all imports, function-local included", all_edges)):
        cs = circles(edges)
        print(f"\ncircles ({label}): {len(cs)}")
        for c in cs:
            print("  " + " <-> ".join(short[m] for m in c))

    up = sorted((a, b) for (a, b) in arrows if layer_of(a) >= 0 and layer_of(b) > layer_of(a))
    print(f"\nupward arrows: {len(up)}  (layers: " + " < ".join(n for n, _ in LAYERS) + ")")
    for a, b in up:
        kind = "local" if arrows[(a, b)] else "module level"
        print(f"  {short[a]}:{lines[(a, b)]} -> {short[b]}  [{LAYERS[layer_of(a)][0]} -> "
              f"{LAYERS[layer_of(b)][0]}, {kind}]")

    # A module in no layer escapes the upward-arrow check: name every one (the package root aside).
    unlayered = sorted(short[m] for m in mods if layer_of(m) < 0 and m != PACKAGE)
    print(f"\nmodules in no layer: {len(unlayered)}" + (f"  ({', '.join(unlayered)})" if unlayered else ""))

    sizes = sorted(((len(path.read_text(encoding="utf-8").splitlines()), short[m]) for m, path in mods.items()),
                   reverse=True)
    print(f"\nlargest modules (lines; {sum(n > 500 for n, _ in sizes)} over 500):")
    for n, m in sizes[: args.top]:
        print(f"  {n:>6}  {m}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
