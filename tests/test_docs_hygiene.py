"""The code's comments say why, not which commit measured what; the README opens with what memtrain
is and the two commands that work on a fresh machine.

Where a figure came from (command, commit, hardware) lives in docs/performance.md and the other
docs, beside the figure; a comment that names a commit goes stale the day the code moves on."""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "memtrain"

# A git commit as people abbreviate it: 7 to 40 hex digits with at least one letter and one digit
# (so neither a plain number nor a word such as "defaced" counts). A hex literal (0x...) is not
# one: its digits follow the "x" without a word boundary.
COMMIT_LIKE = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
MAIN_COMMAND = 'pip install "torch==2.13.0" -e . && memtrain bench'
README_TOP_LINES = 15


def _comments_and_docstrings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every ``#`` comment and every docstring (module, class, function) in ``path``."""
    text = path.read_text(encoding="utf-8")
    found = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(text).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                found.append((node.body[0].lineno, doc))
    return found


def _commit_like_tokens(path: Path) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{line}: {token}"
            for line, text in _comments_and_docstrings(path) for token in COMMIT_LIKE.findall(text)]


def _ci_test_command() -> str:
    """The command .ci/run runs as "the README's test command": the first command after the last
    comment that names it (the script's header names it too)."""
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    marker = max(i for i, line in enumerate(lines) if line.startswith("#") and "README's test command" in line)
    return next(line.strip() for line in lines[marker + 1:] if line.strip() and not line.lstrip().startswith("#"))


def _repo_files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode == 0 and out.stdout:
        return out.stdout.splitlines()
    return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file()]


def test_the_commit_pattern_finds_abbreviated_and_full_hashes_only():
    text = "at commit eedd2af, at 0d50060795e3, 26bc2bb9e1d0c4f3a5b7d9e1f3a5c7e9b1d3f5a7; not 0x1f2e3d4c5b, " \
           "1234567, 50257 or defaced"
    assert COMMIT_LIKE.findall(text) == ["eedd2af", "0d50060795e3", "26bc2bb9e1d0c4f3a5b7d9e1f3a5c7e9b1d3f5a7"]


def test_the_scan_reads_comments_and_docstrings_but_not_code(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('"""Module, timed at 1a2b3c4."""\n'
                      'X = "5d6e7f8a"  # measured at 9b8c7d6\n'
                      'def f():\n    """Function, see abc1234."""\n')
    found = " ".join(token for _, text in _comments_and_docstrings(module) for token in COMMIT_LIKE.findall(text))
    assert set(found.split()) == {"1a2b3c4", "9b8c7d6", "abc1234"}  # the string constant is code, not a comment


def test_no_comment_or_docstring_in_src_names_a_commit():
    offenders = [hit for path in sorted(SRC.rglob("*.py")) for hit in _commit_like_tokens(path)]
    assert not offenders, ("say why in the comment; put the commit and hardware of a figure in docs/performance.md "
                           "(or the doc of its subject): " + "; ".join(offenders))


def test_every_markdown_file_a_src_comment_names_exists():
    files = _repo_files()
    missing = []
    for path in sorted(SRC.rglob("*.py")):
        for line, text in _comments_and_docstrings(path):
            for name in re.findall(r"(?<![\w/.-])((?:[\w.-]+/)*[\w.-]+\.md)\b", text):
                if not any(f == name or f.endswith("/" + name) for f in files):
                    missing.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert not missing, "a comment cites a document the repository does not have: " + "; ".join(missing)


def test_readme_opens_with_the_main_command_and_the_ci_test_command_and_no_commit():
    top = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()[:README_TOP_LINES]
    test_command = _ci_test_command()
    assert test_command == "python -m pytest"  # what the README promises CI runs; change both together
    assert MAIN_COMMAND in [line.strip() for line in top], top
    assert any(line.strip() == test_command or line.strip().endswith("&& " + test_command) for line in top), top
    assert "memtrain" in top[0] and any("memory" in line for line in top[1:6]), "say what memtrain is first"
    hashes = [token for line in top for token in COMMIT_LIKE.findall(line)]
    assert not hashes, f"the README's first screen names commits {hashes}: their place is docs/performance.md"


def test_readme_links_the_section_that_holds_its_timings():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    anchors = re.findall(r"\(docs/performance\.md#([\w-]+)\)", readme)
    headings = [line.lstrip("#").strip() for line in (ROOT / "docs" / "performance.md").read_text().splitlines()
                if line.startswith("#")]
    # GitHub's anchor of a heading: lower case, punctuation dropped, spaces as dashes.
    slugs = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}
    assert anchors and set(anchors) <= slugs, (anchors, sorted(slugs))
    section = (ROOT / "docs" / "performance.md").read_text().split("## Timings of the README's commands", 1)[1]
    assert MAIN_COMMAND.split(" && ")[1] in section and _ci_test_command() in section
    assert COMMIT_LIKE.search(section)  # every timing there names the commit it ran at


def test_the_checkpointing_row_of_the_models_doc_names_what_a_transformers_model_takes():
    """docs/models.md listed `selective` among the checkpointing kinds a transformers model runs,
    which train refuses for one (and left out `selective-matmul`, which it runs): the row's kinds
    are those memtrain.techniques.facts lets through, and the refused one is said to be refused."""
    from memtrain.techniques.facts import transformers_checkpointing_error

    row = next(line for line in (ROOT / "docs" / "models.md").read_text().splitlines()
               if line.startswith("| `--checkpointing "))
    kinds = re.match(r"\| `--checkpointing ([^`]+)`", row).group(1).split("/")  # type: ignore[union-attr]
    assert "selective-matmul" in kinds
    for kind in kinds:
        assert transformers_checkpointing_error(kind.replace("every:K", "every:2")) is None, kind
    assert transformers_checkpointing_error("selective") is not None and "`selective`" in row and "refused" in row


def test_no_merge_leftover_is_tracked():
    # A conflicted merge's backups (``*.orig``, ``*.rej``) are stale copies of the code beside it:
    # shipped in src/, they are read as the module by whoever greps for a function.
    leftovers = [f for f in _repo_files() if f.endswith((".orig", ".rej"))]
    assert not leftovers, leftovers
