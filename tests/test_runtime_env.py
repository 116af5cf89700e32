"""What a result records about the software that produced it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import memtrain
from memtrain.runtime.env import git_commit

SRC = Path(memtrain.__file__).resolve().parents[1]  # the folder that holds the memtrain package


def _git(cwd: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(cwd), *args], check=True, capture_output=True,
                   env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
                        "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"})


def _commit_seen_from(src: Path, env_commit: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "MEMTRAIN_COMMIT"}
    if env_commit is not None:
        env["MEMTRAIN_COMMIT"] = env_commit
    env["PYTHONPATH"] = str(src)
    out = subprocess.run([sys.executable, "-c", "from memtrain.runtime.env import git_commit; print(git_commit())"],
                         capture_output=True, text=True, env=env, check=True, cwd=src)
    return out.stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
@pytest.mark.parametrize("with_pyproject", [False, True])
def test_a_copy_inside_another_repository_reports_no_commit_of_that_repository(tmp_path, with_pyproject):
    """A source tree copied into some other git repository (vendored, say) must not report that
    repository's commit as memtrain's: the commit is unknown, or what MEMTRAIN_COMMIT says."""
    other = tmp_path / "other"
    vendored = other / "vendor" / "memtrain"
    shutil.copytree(SRC / "memtrain", vendored / "src" / "memtrain",
                    ignore=shutil.ignore_patterns("__pycache__"))
    if with_pyproject:
        (vendored / "pyproject.toml").write_text("[project]\nname = 'memtrain'\n")
    _git(other, "init", "-q")
    _git(other, "add", "-A")
    _git(other, "commit", "-q", "-m", "unrelated")
    assert _commit_seen_from(vendored / "src") == "None"
    assert _commit_seen_from(vendored / "src", env_commit="abc123") == "abc123"


def test_the_checkout_reports_its_own_commit():
    root = SRC.parent
    if not (root / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout of memtrain")
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert (git_commit() or "").split("-")[0] == head
