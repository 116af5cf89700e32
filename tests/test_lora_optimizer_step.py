"""benchmarks/lora_optimizer_step.py: the bf16-pure optimizer step timed several ways. Its json
is rewritten after every variant, so a variant that fails later (a long compile cut off, an
out-of-memory) loses none of the earlier ones; bad arguments are one line and exit 2."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("lora_optimizer_step", ROOT / "benchmarks" / "lora_optimizer_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_variant_is_written_as_it_finishes(tmp_path, monkeypatch):
    script = _script()
    calls = []
    original = script._time

    def fail_on_the_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("cut off")
        return original(*args, **kwargs)

    monkeypatch.setattr(script, "_time", fail_on_the_second)
    with pytest.raises(RuntimeError, match="cut off"):
        script.main(["--tensors", "2", "--d", "8", "--rank", "2", "--steps", "1", "--variants", "torch-fp32,torch-fp32",
                     "--out", str(tmp_path)])
    written = json.loads((tmp_path / "lora_optimizer_step.json").read_text())
    assert list(written["results"]) == ["torch-fp32"] and written["results"]["torch-fp32"]["median_ms"] >= 0


@pytest.mark.parametrize("argv,message", [
    (["--tensors", "0"], "must be a positive integer"),
    (["--variants", "fastest"], "unknown fastest"),
    (["--out", "FILE"], "is a file, not a folder"),
    (["--out", "USED"], "already holds lora_optimizer_step.json from an earlier run"),
])
def test_bad_arguments_are_one_line_and_exit_2(argv, message, tmp_path, capsys):
    (tmp_path / "FILE").write_text("kept")
    (tmp_path / "USED").mkdir()
    (tmp_path / "USED" / "lora_optimizer_step.json").write_text("{}")
    argv = [str(tmp_path / a) if a in ("FILE", "USED") else a for a in argv]
    with pytest.raises(SystemExit) as exc:
        _script().main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert (tmp_path / "FILE").read_text() == "kept"
    assert (tmp_path / "USED" / "lora_optimizer_step.json").read_text() == "{}"
