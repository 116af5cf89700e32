"""A plain ``generate`` samples ``--max-new-tokens`` tokens every time, as ``estimate --mode
inference`` sizes the run, and prints an eos it draws as its text: its help and the README say so,
where a user of transformers' ``generate`` expects the sample to stop at the eos."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memtrain.cli import main

pytest.importorskip("transformers")

from test_chat_data import CHATML, _chat_folder  # noqa: E402  (the tests' tiny Qwen2 with ChatML)

README = Path(__file__).resolve().parents[1] / "README.md"


def _always_eos_folder(root: Path) -> Path:
    """The tiny Qwen2 with weights whose every next token, greedily, is its eos: the final norm's
    weight is zero, so every logit is 0 and the argmax is id 0, made the eos (``<|endoftext|>``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = _chat_folder(root, CHATML)
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    tok_config["eos_token"] = "<|endoftext|>"
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = 0
    (folder / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    with torch.no_grad():
        model.model.norm.weight.zero_()
    model.save_pretrained(folder)
    return folder


def test_a_plain_sample_runs_past_the_eos_as_its_help_says(tmp_path, capsys):
    folder = _always_eos_folder(tmp_path / "model")
    assert main(["generate", str(folder), "--prompt", "How do I", "--max-new-tokens", "5", "--temperature", "0",
                 "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.count("<|endoftext|>") == 5, out  # every token sampled, each one the eos, printed
    with pytest.raises(SystemExit):  # argparse's --help exits 0 after printing
        main(["generate", "--help"])
    said = " ".join(capsys.readouterr().out.split())
    assert "does not stop at the eos" in said
    assert "does not stop at the eos" in " ".join(README.read_text(encoding="utf-8").split())
