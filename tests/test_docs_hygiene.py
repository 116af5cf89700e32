"""The code's comments say why, not which commit measured what; the README opens with what memtrain
is and the two commands that work on a fresh machine.

Where a figure came from (command, commit, hardware) lives in docs/performance.md and the other
docs, beside the figure; a comment that names a commit goes stale the day the code moves on."""

from __future__ import annotations

import argparse
import ast
import importlib
import io
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

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


# What a user reads: the README, benchmarks/README.md and docs/. A command, a module name or a test
# named there is checked against the code, so a flag renamed or a module split leaves no dead text.
USER_DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"```[^\n]*\n(.*?)```", re.S)
FLAG = re.compile(r"(?<![\w-])(--[a-zA-Z][\w-]*)")


def _code_texts(text: str) -> list[str]:
    """Every fenced block's lines (a backslash continuation joined) and every inline code span."""
    lines = [line for block in FENCE.findall(text) for line in block.replace("\\\n", " ").splitlines()]
    return lines + re.findall(r"`([^`]+)`", FENCE.sub("", text))


def _verb_options() -> dict[str, set[str]]:
    from memtrain.cli import build_parser  # the other tests of this file read text only: no torch

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: set(parser._option_string_actions) for name, parser in sub.choices.items()}


def _flags_by_verb(code: str, verbs: set[str]) -> list[tuple[str, str]]:
    """(verb, flag) for each flag written after ``memtrain VERB`` (or a span opening with ``VERB --``)
    in ``code``, up to the next shell separator or comment."""
    found = []
    starts = [m for m in re.finditer(r"(?:^|(?<=memtrain ))(\w+)(?= )", code) if m.group(1) in verbs]
    for m in starts:
        if m.start() != 0 and not code[:m.start()].endswith("memtrain "):
            continue
        rest = re.split(r"\||;|&&|\s#|memtrain ", code[m.end():])[0]
        found += [(m.group(1), flag) for flag in FLAG.findall(rest)]
    return found


def test_the_flag_scan_reads_commands_in_blocks_and_spans():
    text = "run `memtrain plan --top 3 | head` or\n```bash\nmemtrain estimate --model x \\\n  --json  # --nope\n```\n" \
           "and `maxbatch --search seq-len`; `--top` alone names no verb"
    verbs = {"plan", "estimate", "maxbatch"}
    pairs = [pair for code in _code_texts(text) for pair in _flags_by_verb(code, verbs)]
    assert sorted(pairs) == [("estimate", "--json"), ("estimate", "--model"), ("maxbatch", "--search"), ("plan", "--top")]


def test_every_flag_the_docs_give_a_verb_is_one_that_verb_takes():
    options = _verb_options()
    wrong = [f"{doc.relative_to(ROOT)}: memtrain {verb} {flag}"
             for doc in USER_DOCS for code in _code_texts(doc.read_text(encoding="utf-8"))
             for verb, flag in _flags_by_verb(code, set(options)) if flag.split("=")[0] not in options[verb]]
    assert not wrong, "a documented command gives a flag its verb does not have: " + "; ".join(wrong)


def _resolves(dotted: str) -> bool:
    """Whether ``memtrain.a.b.name`` is a module or a module's attribute (a moved name is not)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as exc:
            if exc.name and not exc.name.startswith("memtrain"):
                pytest.skip(f"{dotted} needs {exc.name}, not installed")
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_memtrain_module_or_name_the_docs_give_exists():
    packages = {p.stem for p in SRC.iterdir() if p.is_dir() or p.suffix == ".py"} - {"__init__", "__main__"}
    missing = []
    for doc in USER_DOCS:
        for code in _code_texts(doc.read_text(encoding="utf-8")):
            for dotted in re.findall(r"(?<![\w./-])((?:memtrain\.)?[a-z_]+(?:\.[A-Za-z_]\w*)+)(?![\w/-])", code):
                head = dotted.split(".")[0]
                if head != "memtrain" and (head not in packages or head in {"data", "config"} and
                                           dotted.count(".") == 1):
                    continue  # a file name (`config.json`) or a result key (`data.tokenizer`), not a module
                full = dotted if head == "memtrain" else f"memtrain.{dotted}"
                if not re.search(r"\.(py|md|json|jsonl|lock|log|pt|csv|png|txt)$", dotted) and not _resolves(full):
                    missing.append(f"{doc.relative_to(ROOT)}: {dotted}")
    assert not missing, "the docs name modules or names the code no longer has (moved?): " + "; ".join(missing)


def _test_names() -> dict[str, set[str]]:
    return {path.name: {node.name for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                        if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
            for path in (ROOT / "tests").glob("test_*.py")}


def test_every_test_the_docs_cite_exists():
    tests = _test_names()
    every = set().union(*tests.values())
    missing = []
    for doc in USER_DOCS:
        text = doc.read_text(encoding="utf-8")
        for path in re.findall(r"\btests/([\w/]+\.py)\b", text):
            if not (ROOT / "tests" / path).exists():
                missing.append(f"{doc.relative_to(ROOT)}: tests/{path}")
        for file, name, star in re.findall(r"(test_\w+\.py)::(test_\w+)(\*?)", text):
            # `file::test_prefix_*` names every test of the file that starts so: one must exist
            if not any(found == name or star and found.startswith(name) for found in tests.get(file, set())):
                missing.append(f"{doc.relative_to(ROOT)}: {file}::{name}{star}")
        for name in re.findall(r"(?<![\w.])::(test_\w+)", text):
            if name not in every:
                missing.append(f"{doc.relative_to(ROOT)}: ::{name}")
    assert not missing, "the docs cite tests that do not exist: " + "; ".join(missing)


def _moved_targets() -> list[tuple[str, list[str]]]:
    """(new home, names said to live there) of each ``-> `home` (`a`, `b`)`` (or ``(`a`, `b`) ->
    `home```) in the Unreleased ``### Moved`` section: the list counts only where the parentheses
    open with nothing but backticked names (up to a colon or semicolon)."""
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8").split("## Unreleased", 1)[1].split("\n## ", 1)[0]
    moved = " ".join(text.split("### Moved", 1)[1].split("\n### ", 1)[0].split()) if "### Moved" in text else ""

    def names(inside: str) -> list[str]:
        head = re.split(r"[:;]", inside, maxsplit=1)[0].strip()
        return re.findall(r"`(\w+)`", head) if re.fullmatch(r"`\w+`(, `\w+`)*", head) else []

    found = [(home, names(inside)) for home, inside in
             re.findall(r"-> `((?:memtrain\.)?[a-z_][\w.]*)`(?: \(([^()]*)\))?", moved)]
    found += [(home, names(inside)) for inside, home in
              re.findall(r"\(([^()]*)\) -> `((?:memtrain\.)?[a-z_][\w.]*)`", moved)]
    return [(home if home.startswith("memtrain.") else f"memtrain.{home}", listed) for home, listed in found]


def test_the_moved_scan_reads_both_orders_and_only_plain_name_lists(monkeypatch):
    entry = ("## Unreleased\n\n### Moved\n\n- `memtrain.a`'s model -> `memtrain.b` (`f`, `G`), no aliases;\n"
             "  the sizes (`X`, `Y`: torch's constants) -> `memtrain.c`; `m.d` -> `memtrain.e` (the seam `z` stays)\n"
             "\n### Fixed\n\n- -> `memtrain.nope` (`q`)\n\n## 0.1.0\n")
    real = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: entry if self.name == "CHANGELOG.md" else real(self, *a, **k))
    assert sorted(_moved_targets()) == [("memtrain.b", ["f", "G"]), ("memtrain.c", []), ("memtrain.c", ["X", "Y"]),
                                        ("memtrain.e", [])]


def test_every_unreleased_move_names_a_home_that_holds_its_names():
    """A ``### Moved`` entry tells a user where to import from now: the home must resolve and hold
    each name listed for it (a later move or rename would leave the entry pointing nowhere)."""
    missing = [f"{home}.{name}" if name else home for home, listed in _moved_targets()
               for name in (listed or [""]) if not _resolves(f"{home}.{name}" if name else home)]
    assert not missing, "CHANGELOG ### Moved names homes or names the code does not have: " + "; ".join(missing)


def test_the_planners_cost_model_figures_in_the_docs_are_the_codes():
    """docs/estimation.md states the step-time model's device rates, micro-batch efficiency and
    optimizer traffic; they live in memtrain.analysis.step_time (moved there from plan), and a
    change to either must change both."""
    from memtrain.analysis.step_time import DEVICE_PROFILES, OPTIMIZER_TRAFFIC

    text = " ".join((ROOT / "docs" / "estimation.md").read_text(encoding="utf-8")
                    .split("## The planner's cost model", 1)[1].split())
    cuda, cpu = DEVICE_PROFILES["cuda"], DEVICE_PROFILES["cpu"]
    tf, gf = (lambda x: f"{x / 1e12:g}"), (lambda x: f"{x / 1e9:g}")
    rates = (f"CUDA fp32 {tf(cuda['flops']['fp32'])}, tf32 {tf(cuda['flops']['tf32'])}, bf16 and fp16 "
             f"{tf(cuda['flops']['bf16'])}, bf16-pure {tf(cuda['flops']['bf16-pure'])} TFLOP/s; CPU fp32 and tf32 "
             f"{gf(cpu['flops']['fp32'])}, bf16 {gf(cpu['flops']['bf16'])}, fp16 {gf(cpu['flops']['fp16'])} GFLOP/s")
    assert cuda["flops"]["bf16"] == cuda["flops"]["fp16"] and cpu["flops"]["fp32"] == cpu["flops"]["tf32"]
    assert rates in text, rates
    assert f"T0 = {cuda['half_tokens']} on CUDA, {cpu['half_tokens']} on CPU" in text
    o = OPTIMIZER_TRAFFIC
    assert o["adamw-8bit"] == o["adamw-4bit"]
    traffic = (f"plain AdamW {o['adamw']} B, foreach {o['adamw-foreach']}, fused {o['adamw-fused']}, 8-bit and 4-bit "
               f"{o['adamw-8bit']}, bitsandbytes 8-bit {o['adamw-bnb-8bit']}, Adafactor {o['adafactor']}, SGD {o['sgd']}")
    assert traffic in text, traffic



# How the docs write each family of memtrain.analysis.estimate.hf.MODELLED (its model_type keys).
FAMILY_NAMES = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral", "phi3": "Phi-3", "gemma": "Gemma",
                "gpt2": "GPT-2"}


def _names_in(text: str, start: str, end: str) -> list[str]:
    """The comma/``and``-separated names between ``start`` and the next ``end`` of ``text`` (whitespace
    joined, as a wrapped paragraph reads), backticks dropped."""
    flat = " ".join(text.split())
    assert start in flat, f"the docs lost the sentence that opens with {start!r}"
    inside = flat.split(start, 1)[1].split(end, 1)[0]
    return [name.strip(" `") for name in re.split(r",\s*|\s+and\s+", inside) if name.strip(" `")]


def test_the_families_the_docs_say_estimate_models_analytically_are_the_codes():
    """README and docs/estimation.md each list the transformers families estimate answers without a
    trace; a family added to (or dropped from) MODELLED must change both lists."""
    from memtrain.analysis.estimate.hf import MODELLED

    expected = sorted(FAMILY_NAMES[family] for family in MODELLED)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    estimation = (ROOT / "docs" / "estimation.md").read_text(encoding="utf-8")
    assert sorted(_names_in(readme, "`estimate` answers ", " analytically")) == expected
    assert sorted(_names_in(estimation, "the transformers families of `MODELLED` (", ")")) == expected


def test_the_bundled_configs_the_readme_and_help_name_are_the_shipped_files():
    """The README's and ``--model``'s help list of bundled transformers configs names each file of
    memtrain/models/configs, and nothing else: a config shipped but unlisted is one a newcomer never
    finds, one listed but not shipped an ``error:`` on the first try."""
    from memtrain.config.run import ModelConfig

    shipped = sorted(p.stem for p in (SRC / "models" / "configs").glob("*.json"))
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    clause = readme.split("a bundled full-size config (", 1)[1].split(" or `hf:ORG/NAME`", 1)[0]
    assert sorted(re.findall(r"`([^`]+)`", clause)) == shipped, clause
    help_text = ModelConfig.__dataclass_fields__["model"].metadata["help"]
    clause = help_text.split("a bundled config (", 1)[1].split(") or hf:", 1)[0]
    # "llama-3-8b, ..., qwen2.5-0.5b; tiny-llama and tiny-gpt2 train in seconds on a CPU" -> the names
    names = re.findall(r"(?<![\w.-])([a-z][a-z0-9.]*-[a-z0-9.-]*[a-z0-9])(?![\w.-])", clause)
    assert sorted(names) == shipped, clause
