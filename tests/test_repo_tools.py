"""benchmarks/import_graph.py and benchmarks/estimate_identity.py: the restructure's two gauges
must see what they claim to see, and the package itself keeps an import graph without circles."""

from __future__ import annotations

import json
import subprocess
import sys
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
