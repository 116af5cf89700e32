"""docs/models.md's worked example of chat fine-tuning runs as written: its chat file, its
``train --data-format chat --loss-on completion`` and its ``generate --chat``, on a tiny local Qwen2
folder in place of the user's ``./my-chat-model``; the summary line the text quotes has the shape
train prints."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from memtrain.cli import main

pytest.importorskip("transformers")
pytest.importorskip("datasets")

from test_chat_data import CHATML, _chat_folder  # noqa: E402  (the tests' tiny Qwen2 with ChatML)

DOC = Path(__file__).resolve().parents[1] / "docs" / "models.md"
SECTION = "## Fine-tuning on chat data: a worked example"
USER_MODEL = "./my-chat-model"


def _section() -> str:
    text = DOC.read_text(encoding="utf-8")
    assert SECTION in text, f"docs/models.md lost its section {SECTION!r}"
    return text.split(SECTION, 1)[1].split("\n## ", 1)[0]


def _script() -> str:
    return re.search(r"```bash\n(.*?)```", _section(), re.S).group(1)  # type: ignore[union-attr]


def _heredoc(script: str) -> tuple[str, str]:
    """(file name, text) of the script's ``cat > NAME <<'EOF'`` ... ``EOF``."""
    m = re.search(r"cat > (\S+) <<'EOF'\n(.*?\n)EOF\n", script, re.S)
    assert m, "the example writes its chat file with a quoted heredoc"
    return m.group(1), m.group(2)


def _commands(script: str) -> list[list[str]]:
    """Each ``memtrain ...`` line of the script (backslash continuations joined) as argv, verb first."""
    joined = script.replace("\\\n", " ")
    return [shlex.split(line)[1:] for line in joined.splitlines() if line.startswith("memtrain ")]


def test_the_worked_example_parses_into_a_chat_file_a_train_and_a_generate():
    name, text = _heredoc(_script())
    records = [json.loads(line) for line in text.splitlines()]
    assert name == "chat.jsonl" and len(records) >= 2 and all("messages" in r for r in records)
    verbs = [argv[0] for argv in _commands(_script())]
    assert verbs == ["train", "generate"]
    train, generate = _commands(_script())
    assert USER_MODEL in train and "--data-format" in train and "--loss-on" in train and "--out" in train
    assert "--chat" in generate


def test_the_worked_example_runs_as_written_on_a_tiny_chat_model(tmp_path, monkeypatch, capsys):
    folder = _chat_folder(tmp_path / "model", CHATML)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 512  # the helper's 64 positions hold no --seq-len 128
    (folder / "config.json").write_text(json.dumps(config))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    script = _script()
    name, text = _heredoc(script)
    Path(name).write_text(text)  # a quoted heredoc: the shell writes the lines as they stand
    for argv in _commands(script):
        argv = [str(folder) if a == USER_MODEL else a for a in argv]
        capsys.readouterr()
        assert main(argv) == 0, argv
        out, err = capsys.readouterr()
        if argv[0] == "train":
            summary = next(line for line in out.splitlines() if line.startswith("steps "))
            quoted = re.search(r"`(val loss [^`]+)`", _section()).group(1)  # type: ignore[union-attr]
            shape = re.sub(r"\d+(\.\d+)?", "N", re.sub(r"\s*\n\s*", " ", quoted))  # the text wraps it
            assert shape in re.sub(r"\d+(\.\d+)?", "N", summary), (quoted, summary)
            result = json.loads((work / "runs" / "chat" / "result.json").read_text())
            assert result["config"]["data"]["data_format"] == "chat"
            assert result["config"]["data"]["loss_on"] == "completion"
            assert 0 < result["data"]["val_target_tokens_evaluated"] < result["data"]["val_tokens_evaluated"]
            assert result["data"]["val_documents"] == 2 and "two held-out conversations" in _section()
        else:
            assert out.strip(), err  # a reply was printed
