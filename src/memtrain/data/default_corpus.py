"""The default corpus (``--data default``): English technical prose from the running Python's
own documentation, every ``pydoc`` topic and one document per standard-library module (its
docstrings). Needs no download; sources are parsed with :mod:`ast`, never imported.
"""

from __future__ import annotations

import ast
import functools
import sysconfig
from collections.abc import Iterator
from pathlib import Path

# Bump when the rendering of the default corpus changes, so cached tokens are rebuilt.
DEFAULT_CORPUS_VERSION = 1

# Directories of the standard library that hold tests, the IDLE application or installed
# third-party packages rather than documented library code.
_SKIP_STDLIB_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"})


@functools.lru_cache(maxsize=1)
def default_documents() -> tuple[str, ...]:
    """The default corpus, built once per process (parsing the stdlib takes a few seconds)."""
    return tuple(collect_default_documents())


def collect_default_documents() -> Iterator[str]:
    """Python's own documentation: every ``pydoc`` topic, then one document per stdlib module.

    A module's docstrings (module, classes, functions, in source order, each under its
    qualified name) form one document rather than one document per docstring: most
    docstrings are a line or two, so separate documents would make end-of-text tokens a
    large share of the corpus and cut training blocks into unrelated fragments, while a
    module reads as one coherent page, like a chapter of the library reference.
    Sources are parsed with :mod:`ast` and never imported (importing runs code).
    """
    try:
        # pydoc_data is left out of some Python builds (the try says what then)
        from pydoc_data.topics import topics
    except ImportError:  # some distributions split pydoc_data into a separate package
        topics = {}  # type: ignore[misc]  # fallback for the optional import above
    for key in sorted(topics):
        yield topics[key]
    for path in _stdlib_sources():
        doc = _module_document(path)
        if doc:
            yield doc


def _stdlib_sources() -> list[Path]:
    """The standard library's .py files, sorted, without tests, IDLE and site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        p for p in root.rglob("*.py") if not _SKIP_STDLIB_DIRS.intersection(p.relative_to(root).parts[:-1])
    )


def _module_document(path: Path) -> str | None:
    """All docstrings of one module as a single text, or None if it has none or cannot parse."""
    root = Path(sysconfig.get_paths()["stdlib"])
    module = ".".join(path.relative_to(root).with_suffix("").parts)
    module = module.removesuffix(".__init__")
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))  # bytes: honours coding cookies
    except (SyntaxError, ValueError):
        return None  # e.g. deliberately broken files; skipping them is still deterministic
    parts = [f"{name}\n\n{doc}" for name, doc in _docstrings(tree, module)]
    return "\n\n\n".join(parts) or None


def _docstrings(node: ast.AST, qualname: str) -> Iterator[tuple[str, str]]:
    """(qualified name, docstring) of ``node`` and every def/class inside it, in source order.

    Recurses through all statements, so definitions under ``if``/``try`` are found too.
    """
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        doc = ast.get_docstring(node)
        if doc:
            yield qualname, doc
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _docstrings(child, f"{qualname}.{child.name}")
        elif isinstance(child, (ast.stmt, ast.excepthandler, ast.match_case)):
            yield from _docstrings(child, qualname)
