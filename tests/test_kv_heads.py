"""A transformers config whose num_key_value_heads does not divide num_attention_heads (StableLM
takes 32 where it is unset) is refused in one line: transformers builds the model, then fails at
the first forward (a size mismatch, or a division by zero for 0), exit 1."""

from __future__ import annotations

import json

import pytest

from memtrain.cli import main

TINY = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1, "intermediate_size": 64,
        "vocab_size": 50304}


def _model(tmp_path, **fields):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**TINY, **fields}))
    return str(d)


@pytest.mark.parametrize(("fields", "said"), [
    ({"model_type": "stablelm"}, "num_key_value_heads 32 (stablelm's default where config.json leaves it unset)"),
    ({"model_type": "stablelm", "num_key_value_heads": 3}, "num_key_value_heads 3 does not divide"),
    ({"model_type": "qwen2", "num_key_value_heads": 8}, "num_key_value_heads 8 does not divide"),
    ({"model_type": "mistral", "num_key_value_heads": 0}, "num_key_value_heads 0 does not divide"),
])
def test_a_kv_head_count_that_does_not_divide_the_heads_is_one_line(tmp_path, capsys, fields, said):
    model = _model(tmp_path, **fields)
    assert main(["estimate", "--model", model, "--trace", "--seq-len", "8", "--batch-size", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and said in err and "a divisor of 4" in err, err


def test_a_dividing_kv_head_count_is_let_through(tmp_path, capsys):
    """StableLM with its kv heads set to a divisor traces (grouped-query attention)."""
    model = _model(tmp_path, model_type="stablelm", num_key_value_heads=2)
    assert main(["estimate", "--model", model, "--trace", "--seq-len", "8", "--batch-size", "1"]) == 0, \
        capsys.readouterr().err
