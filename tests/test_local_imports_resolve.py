"""Every name a function-local import refers to exists where the import looks for it.

A function-local import runs only when its function does: one inside a CUDA branch (a fused
kernel, a device-memory reading, a GPU benchmark script's heredoc) never runs on a CPU, so a name
that moved in a restructure would first fail on a lent GPU, in its scarce minutes. Here each such
import is read with ``ast`` (nothing of the importing file runs) and resolved in a fresh process:
a moved or renamed name fails CI instead.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"

# A bash heredoc fed to Python (``python3 - ARGS <<'PY' ... PY``): code that runs only where the
# script does (loss_kernel_ab.sh: CUDA only).
_HEREDOC = re.compile(r"python3?\s+-\s[^\n]*<<-?\s*'?(\w+)'?\n(.*?)\n\1\n", re.S)

# The resolver, run in a fresh process so that the imports it makes (transformers, torchao,
# every memtrain module) leave this test process as it was. It reads [where, module, name]
# triples on stdin and prints one line per import that does not resolve.
_RESOLVE = """
import importlib, json, sys
for where, module, name in json.load(sys.stdin):
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # any failure to import is what this check reports
        print(f"{where}: {module}: {type(exc).__name__}: {exc}")
        continue
    if name is None or name == "*" or hasattr(mod, name):
        continue
    try:  # `from package import submodule`
        importlib.import_module(f"{module}.{name}")
    except ImportError:
        print(f"{where}: {module} has no {name}")
"""


# A dotted name a message or docstring of src/ tells the reader to use (``memtrain.a.b.name``),
# resolved in a fresh process: prints each one that names nothing.
_RESOLVE_DOTTED = """
import importlib, json, sys
for where, dotted in json.load(sys.stdin):
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr, None)
        break
    if obj is None:
        print(f"{where}: {dotted} names nothing")
"""
# memtrain.x.y in a string, not part of a longer name or a file name (".memtrain.lock")
_DOTTED = re.compile(r"(?<![\w.])memtrain(?:\.[A-Za-z_]\w*)+")


def _module_of(path: Path, node: ast.ImportFrom) -> str:
    """The absolute module a ``from`` import names (relative ones resolved against ``path``)."""
    if node.level == 0:
        return node.module or ""
    package = list(path.relative_to(SRC).with_suffix("").parts[:-1])
    package = package[:len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def _imports(tree: ast.AST, path: Path, where: str, local_only: bool) -> list[tuple[str, str, Optional[str]]]:
    """(where, module, name) of each import in ``tree``; with ``local_only``, those inside a function."""
    scopes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    nodes = {id(n): n for s in (scopes if local_only else [tree]) for n in ast.walk(s)
             if isinstance(n, (ast.Import, ast.ImportFrom))}
    found: list[tuple[str, str, Optional[str]]] = []
    for node in sorted(nodes.values(), key=lambda n: n.lineno):
        at = f"{where}:{node.lineno}"
        if isinstance(node, ast.Import):
            found += [(at, alias.name, None) for alias in node.names]
        else:
            module = _module_of(path, node)
            found += [(at, module, alias.name) for alias in node.names]
    return found


def local_imports(paths: list[Path]) -> list[tuple[str, str, Optional[str]]]:
    """Function-local imports of the Python files, and every import of a Python heredoc in the
    shell scripts, of ``paths``."""
    found: list[tuple[str, str, Optional[str]]] = []
    for path in paths:
        text = path.read_text()
        where = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
        if path.suffix == ".py":
            found += _imports(ast.parse(text), path, where, local_only=True)
            continue
        for match in _HEREDOC.finditer(text):
            line = text[:match.start(2)].count("\n") + 1
            found += [(f"{where}:{line + int(at.rsplit(':', 1)[1]) - 1}", module, name)
                      for at, module, name in _imports(ast.parse(match.group(2)), path, where, local_only=False)]
    return found


def _installed(module: str) -> bool:
    """Whether the top-level package of ``module`` is installed here (an optional one such as
    Liger, bitsandbytes or Cut Cross-Entropy may not be: its imports cannot be checked)."""
    top = module.split(".")[0]
    return top == "memtrain" or importlib.util.find_spec(top) is not None


def _run_resolver(code: str, items: list) -> list[str]:
    """Run ``code`` in a fresh process over ``items`` (JSON on stdin); the lines it prints."""
    path = os.pathsep.join([str(SRC), str(ROOT / "tests"), str(ROOT / "benchmarks")])
    proc = subprocess.run([sys.executable, "-c", code], input=json.dumps(items), capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": path, "MPLBACKEND": "Agg"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.splitlines()


def dotted_names(paths: list[Path]) -> list[tuple[str, str]]:
    """(where, name) of each ``memtrain.a.b`` in a string constant of the Python files ``paths``."""
    found = []
    for path in paths:
        where = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found += [(f"{where}:{node.lineno}", name) for name in _DOTTED.findall(node.value)]
    return found


def unresolved(imports: list[tuple[str, str, Optional[str]]]) -> list[str]:
    """The imports that fail (of packages installed here), one line each."""
    return _run_resolver(_RESOLVE, [list(t) for t in imports if _installed(t[1])])


def _code_files() -> list[Path]:
    """src/memtrain's modules, the benchmark scripts (Python and shell) and the GPU-marked tests."""
    gpu_tests = [p for p in sorted((ROOT / "tests").glob("test_*.py")) if "mark.gpu" in p.read_text()]
    return [*sorted((SRC / "memtrain").rglob("*.py")), *sorted((ROOT / "benchmarks").glob("*.py")),
            *sorted((ROOT / "benchmarks").glob("*.sh")), *gpu_tests]


def test_every_function_local_import_resolves():
    imports = local_imports(_code_files())
    # the scan sees what it claims to: the CUDA-only Liger import and the GPU script's heredoc
    assert any(m == "liger_kernel.transformers" for _, m, _ in imports)
    assert any(w.startswith("benchmarks/loss_kernel_ab.sh:") and m == "json" for w, m, _ in imports)
    assert len(imports) > 300, len(imports)
    failed = unresolved(imports)
    assert failed == [], "\n".join(failed)


def test_the_check_reports_a_moved_name_a_gone_module_and_a_heredoc(tmp_path):
    pkg = SRC / "memtrain" / "models"  # a file the relative imports below resolve against
    script = tmp_path / "gpu.sh"
    script.write_text("set -u\npython3 - \"$1\" <<'PY'\nimport json\nfrom memtrain.config import no_such_name\nPY\n")
    code = tmp_path / "kernel.py"
    code.write_text("import torch\n\n"
                    "def on_cuda():\n"
                    "    if torch.cuda.is_available():\n"
                    "        from memtrain.files.results import append_jsonl  # still there\n"
                    "        from memtrain.lock import LOCK_NAME  # moved to memtrain.files.results\n"
                    "        import memtrain.no_such_module\n"
                    "        from not_installed_package_xyz import kernel  # an optional package: skipped\n")
    found = local_imports([code, script])
    assert [(m, n) for _, m, n in found] == [
        ("memtrain.files.results", "append_jsonl"), ("memtrain.lock", "LOCK_NAME"), ("memtrain.no_such_module", None),
        ("not_installed_package_xyz", "kernel"), ("json", None), ("memtrain.config", "no_such_name")]
    assert found[-1][0] == f"{script}:4"
    failed = unresolved(found)
    assert len(failed) == 3, failed
    assert failed[0].startswith(f"{code}:6: memtrain.lock: ModuleNotFoundError")
    assert failed[1].startswith(f"{code}:7: memtrain.no_such_module: ModuleNotFoundError")
    assert failed[2] == f"{script}:4: memtrain.config has no no_such_name"
    # a relative import inside the package resolves against its file
    rel = ast.parse("def f():\n    from ..files import results\n    from .gpt import GPT\n")
    assert [(m, n) for _, m, n in _imports(rel, pkg / "hf.py", "x", local_only=True)] == [
        ("memtrain.files", "results"), ("memtrain.models.gpt", "GPT")]


def test_every_memtrain_name_a_message_or_docstring_gives_exists():
    """A message that tells the reader to call ``memtrain.x.y`` names something that is there (an
    error that sent users to a name the restructure moved is no help)."""
    names = dotted_names(sorted((SRC / "memtrain").rglob("*.py")))
    assert len(names) > 50, len(names)
    failed = _run_resolver(_RESOLVE_DOTTED, [list(n) for n in names])
    assert failed == [], "\n".join(failed)


def test_the_dotted_name_check_sees_a_moved_name_and_skips_a_file_name(tmp_path):
    code = tmp_path / "msg.py"
    code.write_text('X = "use memtrain.analysis.estimate.method.estimate_step, not memtrain.analysis.estimate.nothing"\n'
                    'LOCK = ".memtrain.lock"\n')
    names = dotted_names([code])
    assert [n for _, n in names] == ["memtrain.analysis.estimate.method.estimate_step",
                                     "memtrain.analysis.estimate.nothing"]
    assert _run_resolver(_RESOLVE_DOTTED, [list(n) for n in names]) == [
        f"{code}:1: memtrain.analysis.estimate.nothing names nothing"]
