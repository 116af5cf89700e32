"""benchmarks/import_graph.py and benchmarks/estimate_identity.py: the restructure's two gauges
must see what they claim to see, and the package itself keeps an import graph without circles."""

from __future__ import annotations

import ast
import importlib.util
import io
import json
import re
import subprocess
import sys
import tokenize
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
SRC = Path(__file__).resolve().parents[1] / "src" / "memtrain"


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=60)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_import_graph_finds_a_hidden_circle_and_an_upward_arrow(tmp_path):
    pkg = tmp_path / "memtrain"
    _write(pkg, {
        "__init__.py": "",
        "config/__init__.py": "",
        "config/run.py": "",
        # train -> flops at module level, flops -> train inside a function: a circle all the same.
        "training/__init__.py": "",
        "training/train.py": "from memtrain.analysis.flops import count\n",
        "analysis/__init__.py": "",
        "analysis/flops.py": "def count():\n    from memtrain.training.train import step\n",
        "techniques/__init__.py": "",
        "techniques/optim.py": "from memtrain.metrics.memory import storage_bytes\n",
        "metrics/__init__.py": "",
        "metrics/memory.py": "from memtrain.config.run import X\n",
    })
    out = _run("import_graph.py", "--src", str(pkg)).stdout
    assert "circles (module level): 0" in out
    assert "circles (all imports, function-local included): 1\n  analysis.flops <-> training.train" in out
    assert "techniques.optim:1 -> metrics.memory  [techniques -> metrics, module level]" in out
    assert "analysis.flops:2 -> training.train  [counting -> step, local]" in out


def test_memtrain_has_no_import_circle():
    out = _run("import_graph.py", "--src", str(SRC)).stdout
    assert "circles (all imports, function-local included): 0" in out, out


def test_every_memtrain_module_is_layered_and_nothing_imports_upward():
    out = _run("import_graph.py", "--src", str(SRC)).stdout
    assert "modules in no layer: 0" in out, out
    assert "upward arrows: 0 " in out, out


def test_estimate_identity_diff_names_changed_added_and_failed(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _write(a, {"same.json": '{"x": 1}\n', "moved.json": '{"x": 1, "y": {"z": 2}}\n', "grew.json": '{"x": 1}\n',
               "broken.json": "exit 2\nerror: bad flag\n"})
    _write(b, {"same.json": '{"x": 1}\n', "moved.json": '{"x": 1, "y": {"z": 3}}\n',
               "grew.json": json.dumps({"x": 1, "new": 0}) + "\n", "broken.json": "exit 2\nerror: bad flag\n"})
    proc = _run("estimate_identity.py", "diff", str(a), str(b))
    lines = dict(line.split(None, 1) for line in proc.stdout.splitlines() if not line[0].isdigit())
    assert lines["same"] == "identical"
    assert lines["moved"] == "different: changed: y.z"
    assert lines["grew"] == "different: added: new"
    assert lines["broken"].startswith("failed in a, b")  # failing alike is no proof of identity
    assert "1/4 identical" in proc.stdout and proc.returncode == 1


def test_the_package_root_holds_only_its_face():
    """Every module lives in the package of its concept; the root keeps the entry points only."""
    loose = sorted(p.name for p in SRC.glob("*.py"))
    assert loose == ["__init__.py", "__main__.py", "cli.py", "errors.py"], loose


# Optional packages: importing one inside the function that needs it is the rule, so it needs no
# comment. Every other function-local import says why it is not at module level.
OPTIONAL_PACKAGES = {"accelerate", "bitsandbytes", "datasets", "deepspeed", "flash_attn", "huggingface_hub",
                     "cut_cross_entropy", "liger_kernel", "peft", "pyarrow", "safetensors", "torchao", "transformers", "wandb"}


def _private_imports(path: Path) -> list[str]:
    """``from memtrain.x import _name`` in ``path`` (a leading underscore: the name is x's own)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "memtrain":
            found += [f"{path.relative_to(SRC.parent)}:{node.lineno}: {node.module}.{a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def _uncommented_local_imports(path: Path) -> list[str]:
    """Function-local imports of ``path`` that are neither of an optional package nor commented:
    a comment on a line of the run of consecutive imports holding it, or on the line above the run."""
    text = path.read_text()
    lines = text.splitlines()
    comments = {t.start[0] for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type == tokenize.COMMENT}
    tree = ast.parse(text)
    imports: dict[int, int] = {}  # first line -> last line, of every import statement
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imports[node.lineno] = node.end_lineno or node.lineno
    found = []
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    local = {id(n): n for f in functions for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    for node in local.values():
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        if {n.split(".")[0] for n in names} <= OPTIONAL_PACKAGES:
            continue
        first, last = node.lineno, node.end_lineno or node.lineno
        while True:  # widen to the run of imports around it (blank lines end a run)
            before = next((s for s, e in imports.items() if e == first - 1), None)
            if before is None:
                break
            first = before
        while last + 1 in imports:
            last = imports[last + 1]
        if not any(line in comments for line in range(first - 1, last + 1)):
            found.append(f"{path.relative_to(SRC.parent)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return found


def test_no_module_imports_another_modules_private_names():
    """A name used by another module is public in its home; a leading underscore means "this
    module's own", which an import from elsewhere would make a lie."""
    found = [hit for path in sorted(SRC.rglob("*.py")) for hit in _private_imports(path)]
    assert found == [], "\n".join(found)


def test_every_function_local_import_says_why():
    """An import inside a function is there for a reason (an optional package, torch kept out of
    the CLI's start-up, a circle avoided); the comment beside it names the reason."""
    found = [hit for path in sorted(SRC.rglob("*.py")) for hit in _uncommented_local_imports(path)]
    assert found == [], "\n".join(found)


def test_the_checks_see_a_private_import_and_an_uncommented_local_import(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path / "memtrain")
    _write(tmp_path / "memtrain", {"a.py": (
        "from memtrain.b import _hidden, shown\n"
        "def f():\n    import json\n    from memtrain.c import d\n"
        "def g():\n    # torch kept out of start-up\n    import torch\n    import torch.nn\n"
        "def h():\n    import transformers\n"
    )})
    path = tmp_path / "memtrain" / "a.py"
    assert _private_imports(path) == ["memtrain/a.py:1: memtrain.b._hidden"]
    assert _uncommented_local_imports(path) == ["memtrain/a.py:3: import json", "memtrain/a.py:4: from memtrain.c import d"]


def test_the_architecture_doc_lists_every_package_and_only_real_ones():
    """docs/architecture.md's package table is drawn from the tree: each package has a row, each
    row names a package (or module) that exists, and the layers it states are import_graph's."""
    doc = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    table = doc[doc.index("## Packages"):doc.index("## The step harness")]
    named = set(re.findall(r"^\| `([a-z_/]+(?:\.py)?)`", table, flags=re.M))
    packages = {p.parent.relative_to(SRC).as_posix() + "/" for p in SRC.glob("*/__init__.py")}
    missing = sorted(packages - named)
    assert not missing, f"packages without a row in docs/architecture.md: {missing}"
    for name in named:
        assert (SRC / name).exists(), f"docs/architecture.md names {name}, which does not exist"
    rules = doc[doc.index("## Import rules"):doc.index("## Interface contract")]
    spec = importlib.util.spec_from_file_location("import_graph", SRC.parents[1] / "benchmarks" / "import_graph.py")
    assert spec and spec.loader
    graph = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(graph)
    for _, prefixes in graph.LAYERS:
        for prefix in prefixes:
            if prefix not in ("__main__", "cli", "commands"):
                assert f"`{prefix}`" in rules or prefix in rules, f"layer prefix {prefix} not in the doc's import rules"
