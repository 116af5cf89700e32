"""A rotary embedding that turns a whole head of odd width cannot run: its cos/sin tables are one
channel wider than q and k, and transformers' first forward fails ("The size of tensor a (19) must
match the size of tensor b (20)"). transformers refuses such a config itself only for a family whose
config has a head_dim field (Llama, Mistral, Gemma) and a head wider than 4; the analytic estimate
read Llama and Mistral without it, and Qwen2, Phi-3 and GPT-NeoX reached the model, so estimate, plan
and maxbatch answered for a model train could not run. Every verb now refuses it in one line with
exit 2; GPT-2 (a learned position table) and a partial rotary embedding narrower than the head run."""

from __future__ import annotations

import json
import re

import pytest

from memtrain.cli import main
from memtrain.models import light_config
from memtrain.models.auto_config import HEAD_DIM_FAMILIES, load_config

transformers = pytest.importorskip("transformers")

WORDS = "rotary position embeddings need an even head dimension"
# hidden 152 / 8 heads: head_dim 19 (the smallest tables still build in a second)
ODD = {"hidden_size": 152, "num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": 64,
       "num_hidden_layers": 1, "vocab_size": 384, "max_position_embeddings": 64}
FAMILIES = {
    "llama": {}, "mistral": {"sliding_window": None}, "qwen2": {}, "phi3": {"pad_token_id": 0},
    # heads of 128 and 256 channels unless config.json says otherwise
    "qwen3": {"head_dim": 19}, "gemma": {"hidden_act": "gelu_pytorch_tanh", "head_dim": 19},
    "gpt_neox": {"rotary_pct": 1.0},
}
VERBS = {
    "estimate": ["estimate"], "trace": ["estimate", "--trace"], "plan": ["plan", "--budget", "1GiB"],
    "maxbatch": ["maxbatch", "--memory-budget", "1GiB"], "flops": ["flops"], "train": ["train", "--steps", "1"],
}


def _write(tmp_path, model_type: str, **fields) -> str:
    """A config.json written as a user writes one (JSON, no transformers class to validate it)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": model_type, **fields}))
    light_config._read_light_config.cache_clear()
    load_config.cache_clear()
    return str(path)


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("verb", sorted(VERBS))
def test_every_verb_refuses_an_odd_head_every_rotary_family_turns_whole(tmp_path, capsys, family, verb):
    spec = _write(tmp_path / "model", family, **ODD, **FAMILIES[family])
    out = tmp_path / "run"
    argv = VERBS[verb] + ["--model", spec, "--seq-len", "16", "--batch-size", "2"]
    assert main(argv + (["--out", str(out)] if verb == "train" else [])) == 2
    err = _one_error_line(capsys)
    if "head_dim" in FAMILIES[family]:
        assert WORDS in err and "head_dim = 19 (config.json's head_dim)" in err, err
    else:
        assert WORDS in err and "head_dim = 19 from hidden_size 152 / 8 heads" in err, err
        assert "e.g. hidden_size 160 for 8 heads" in err, err
    assert not out.exists() or not any(out.iterdir())  # refused before anything is written


def test_a_head_transformers_lets_through_is_refused_too(tmp_path, capsys):
    """transformers spares heads of 4 or fewer channels (its test fixtures): an odd one of 3 builds
    the config and fails the forward, as 19 does."""
    spec = _write(tmp_path, "llama", **{**ODD, "hidden_size": 24})
    assert transformers.AutoConfig.from_pretrained(spec).head_dim == 3  # transformers reads it
    assert main(["estimate", "--model", spec, "--seq-len", "16"]) == 2
    assert "head_dim = 3 from hidden_size 24 / 8 heads" in _one_error_line(capsys)


@pytest.mark.parametrize("family", ["gemma", "llama", "qwen2"])
def test_a_head_dim_set_in_the_config_is_named_as_what_to_change(tmp_path, capsys, family):
    spec = _write(tmp_path, family, **{**ODD, **FAMILIES[family], "hidden_size": 160, "head_dim": 19})
    assert main(["maxbatch", "--model", spec, "--seq-len", "16", "--memory-budget", "1GiB"]) == 2
    err = _one_error_line(capsys)
    assert "head_dim = 19 (config.json's head_dim); set an even head_dim in its config.json (e.g. 20)" in err, err


@pytest.mark.parametrize("family, fields", [("llama", {}), ("phi3", {"pad_token_id": 0}),
                                            ("gemma", {"head_dim": 19})])
def test_the_change_the_refusal_names_gives_a_model_that_runs(tmp_path, capsys, family, fields):
    """Each change the line proposes (a hidden size, a head_dim) is taken as given and the step is
    traced: the model is built and run under fake tensors."""
    spec = _write(tmp_path / "odd", family, **ODD, **fields)
    assert main(["estimate", "--model", spec, "--seq-len", "16"]) == 2
    err = _one_error_line(capsys)
    changes = [{"hidden_size": int(h)} for h in re.findall(r"e\.g\. hidden_size (\d+)", err)]
    changes += [{"head_dim": int(h)} for h in re.findall(r"even head_dim[^;]*?\(e\.g\. (\d+)\)", err)]
    assert changes, err
    for i, change in enumerate(changes):
        fixed = _write(tmp_path / f"fixed{i}", family, **{**ODD, **fields, **change})
        assert main(["estimate", "--trace", "--model", fixed, "--seq-len", "16", "--json"]) == 0, (change, capsys.readouterr().err)
        assert json.loads(capsys.readouterr().out)["peak_bytes"] > 0


def test_gpt2_with_an_odd_head_keeps_working(tmp_path, capsys, small_text_corpus):
    """GPT-2 adds a learned position table: a head of 19 channels runs on every verb."""
    spec = _write(tmp_path / "model", "gpt2", n_embd=152, n_head=8, n_layer=1, n_positions=64, vocab_size=50257,
                  bos_token_id=50256, eos_token_id=50256)
    common = ["--model", spec, "--seq-len", "16", "--batch-size", "2"]
    for verb in ("estimate", "trace", "plan", "maxbatch", "flops"):
        assert main(VERBS[verb] + common) == 0, (verb, capsys.readouterr().err)
    out = tmp_path / "run"
    assert main(["train", *common, "--steps", "1", "--data", str(small_text_corpus), "--no-progress",
                 "--out", str(out)]) == 0, capsys.readouterr().err
    assert json.loads((out / "result.json").read_text())["steps"] == 1


@pytest.mark.parametrize("family, fields", [("phi3", {"pad_token_id": 0, "rope_parameters": {
    "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}), ("gpt_neox", {"rotary_pct": 0.5})])
def test_a_partial_rotary_embedding_narrower_than_an_odd_head_keeps_working(tmp_path, capsys, family, fields):
    """Phi-3's and GPT-NeoX's layers turn the first 10 channels of a 19-wide head (a 9-channel
    rotary width rounded up) and pass the rest: the model runs, and is estimated."""
    spec = _write(tmp_path, family, **ODD, **fields)
    assert main(["estimate", "--trace", "--model", spec, "--seq-len", "16", "--json"]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["peak_bytes"] > 0


def _head_width(family: str, **fields) -> int:
    """The width of one attention head in ``family``'s model (built on the meta device) of the
    config hidden 152, 8 heads and ``fields``: its query projection's outputs per head."""
    import torch

    config = transformers.AutoConfig.for_model(family, **{**ODD, "pad_token_id": 0, **fields})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    name, q = next((n, m) for n, m in model.named_modules() if n.endswith(("q_proj", "qkv_proj", "query_key_value")))
    fused = 1 if name.endswith("q_proj") else 3  # q, k and v in one Linear (8 k/v heads: as many as q)
    return q.out_features // (fused * 8)


@pytest.mark.parametrize("family", sorted(HEAD_DIM_FAMILIES))
def test_the_families_said_to_read_head_dim_take_it_from_the_config(family):
    """The line offers "set an even head_dim" only for a family whose attention takes config.json's
    head_dim; GPT-NeoX's heads are hidden_size / num_attention_heads wide whatever head_dim says."""
    assert _head_width(family, head_dim=20) == 20
    assert _head_width("gpt_neox", head_dim=20) == 19
