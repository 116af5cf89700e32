"""The torch-free reader of a transformers config.json gives the analytic estimate and plan what
transformers' AutoConfig gives them: every field they read, transformers' defaults included, for
the families the estimator models; anything else is read by AutoConfig."""

from __future__ import annotations

import json

import pytest

from memtrain.models import light_config, spec as model_spec
from memtrain.models.light_config import ANALYTIC_CONFIG_DEFAULTS, analytic_config
from memtrain.models.source import CONFIG_DIR, bundled_names

pytest.importorskip("transformers")

# What transformers derives from other fields (and what the estimator reads besides the defaults).
DERIVED = ("model_type", "is_encoder_decoder", "head_dim", "num_key_value_heads", "sliding_window", "layer_types")


def _autoconfig(path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path), trust_remote_code=False)


def _assert_same_as_autoconfig(path, spec: str) -> None:
    light = light_config._read_light_config(spec)
    assert light is not None, spec
    full = _autoconfig(path)
    fields = set(ANALYTIC_CONFIG_DEFAULTS[full.model_type]) | set(DERIVED)
    for name in sorted(fields):
        if hasattr(full, name) or hasattr(light, name):
            assert getattr(light, name) == getattr(full, name), (spec, name)
    assert model_spec._mirrored_fields(light) == model_spec._mirrored_fields(full)


@pytest.mark.parametrize("name", [n for n in bundled_names()
                                  if json.loads((CONFIG_DIR / f"{n}.json").read_text())["model_type"]
                                  in ANALYTIC_CONFIG_DEFAULTS])
def test_every_bundled_config_reads_as_autoconfig_reads_it(name):
    _assert_same_as_autoconfig(CONFIG_DIR / f"{name}.json", name)


def _write(tmp_path, data: dict) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    light_config._read_light_config.cache_clear()
    return str(path)


@pytest.mark.parametrize("model_type", sorted(ANALYTIC_CONFIG_DEFAULTS))
def test_a_config_that_leaves_every_field_out_gets_transformers_defaults(tmp_path, model_type):
    spec = _write(tmp_path, {"model_type": model_type})
    _assert_same_as_autoconfig(spec, spec)


@pytest.mark.parametrize("model_type, fields", [
    ("llama", {"hidden_size": 96, "num_attention_heads": 6}),  # head_dim and k/v heads from these
    ("llama", {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": None,
               "tie_word_embeddings": True, "attention_dropout": 0.1}),
    ("qwen2", {"num_hidden_layers": 6, "use_sliding_window": True, "max_window_layers": 4}),  # layer_types derived
    ("qwen2", {"num_hidden_layers": 3, "sliding_window": 64}),  # sliding_window dropped: use_sliding_window off
    # Mistral's default 8 k/v heads must divide the heads (tests/test_kv_heads.py): 2 of 4 here.
    ("mistral", {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": None,
                 "head_dim": None}),
    ("gpt2", {"n_embd": 96, "n_head": 6, "n_layer": 3, "n_inner": None}),  # d_ff 4 x n_embd
    ("gpt2", {"n_embd": 64, "n_head": 4, "n_inner": 200, "n_positions": 96, "activation_function": "gelu",
              "attn_pdrop": 0, "resid_pdrop": 0.0, "embd_pdrop": 0.2, "tie_word_embeddings": False,
              "reorder_and_upcast_attn": True, "add_cross_attention": True}),
])
def test_a_config_with_some_fields_left_out_gets_transformers_defaults(tmp_path, model_type, fields):
    spec = _write(tmp_path, {"model_type": model_type, **fields})
    _assert_same_as_autoconfig(spec, spec)


@pytest.mark.parametrize("data", [
    {"model_type": "gpt_neox"},  # not a family the analytic estimator models
    {"model_type": "llama", "auto_map": {"AutoConfig": "x.Config"}},  # refused by load_config's own words
    {"model_type": "llama", "hidden_size": 100, "num_attention_heads": 3},  # transformers refuses the shape
    {"model_type": "llama", "hidden_size": "4096"},  # a size transformers' strict config must judge
    {"model_type": "llama", "num_hidden_layers": True},
    {"model_type": "llama", "tie_word_embeddings": "yes"},
    {"model_type": ["llama"]},
    {"model_type": "mistral", "num_key_value_heads": None},  # not nullable there: transformers refuses it
    # Fields the estimate does not read but AutoConfig refuses (train, --trace and generate did, the
    # analytic estimate answered): an epsilon of 0, a rope that is no dict, an unknown dtype, layer
    # kinds that are unknown or not one per layer.
    {"model_type": "llama", "rms_norm_eps": 0},
    {"model_type": "qwen2", "rope_scaling": "yes"},
    {"model_type": "llama", "torch_dtype": "float128"},
    {"model_type": "llama", "num_hidden_layers": 2, "layer_types": ["x", "y"]},
    {"model_type": "qwen2", "num_hidden_layers": 2, "layer_types": ["full_attention"]},
    {"model_type": "gpt2", "layer_norm_epsilon": -1.0},
])
def test_what_the_reader_does_not_know_goes_to_autoconfig(tmp_path, monkeypatch, data):
    spec = _write(tmp_path, data)
    assert light_config._read_light_config(spec) is None
    monkeypatch.setattr(light_config, "load_config", lambda s: ("autoconfig", s))
    assert analytic_config(spec) == ("autoconfig", spec)


@pytest.mark.parametrize("data", [
    {"model_type": "llama", "rms_norm_eps": 0},
    {"model_type": "llama", "rope_scaling": "yes"},
    {"model_type": "llama", "num_hidden_layers": 2, "layer_types": ["x", "y"]},
])
def test_a_config_transformers_refuses_is_refused_by_the_analytic_estimate_too(tmp_path, capsys, data):
    from memtrain.cli import main

    spec = _write(tmp_path, {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
                             "vocab_size": 300, **data})
    assert main(["estimate", "--model", spec, "--seq-len", "16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot read the model config") and err.count("\n") == 1, err


def test_a_hub_model_goes_to_autoconfig(monkeypatch):
    monkeypatch.setattr(light_config, "load_config", lambda s: ("autoconfig", s))
    assert analytic_config("hf:Qwen/Qwen2.5-0.5B") == ("autoconfig", "hf:Qwen/Qwen2.5-0.5B")


def test_the_mirrored_ffn_width_is_the_models_own_for_opt(tmp_path):
    """OPT names its FFN width ffn_dim: result.json, flops and the bench report recorded 4 x
    hidden (a width the model does not have) in its place."""
    transformers = pytest.importorskip("transformers")
    from memtrain.models.spec import model_fields

    transformers.OPTConfig(hidden_size=32, ffn_dim=48, num_attention_heads=4, num_hidden_layers=2,
                           word_embed_proj_dim=32, vocab_size=384).save_pretrained(tmp_path)
    assert model_fields(str(tmp_path))["d_ff"] == 48


@pytest.mark.parametrize("family", ["mamba", "rwkv"])
def test_a_causal_lm_without_attention_heads_is_refused_naming_why(tmp_path, capsys, family):
    """A state-space or recurrent causal LM (Mamba, RWKV) has no attention heads: its config was
    refused as a typo, "its config.json holds a size that is not a whole number (int() argument
    must be ... not 'NoneType'); fix the config". The refusal says what the model is, for every verb."""
    import transformers

    from memtrain.cli import main

    config = {"mamba": transformers.MambaConfig, "rwkv": transformers.RwkvConfig}[family]
    config(hidden_size=32, num_hidden_layers=2, vocab_size=384).save_pretrained(tmp_path)
    for verb in (["estimate"], ["train", "--out", str(tmp_path / "run"), "--steps", "1"]):
        assert main([*verb, "--model", str(tmp_path)]) == 2
        err = capsys.readouterr().err.strip()
        assert err == (f"error: --model {str(tmp_path)!r}: a {family} model has no attention heads (num_attention_heads "
                       "or n_head in its config.json); memtrain trains Transformer decoders, not state-space or "
                       "recurrent models"), err
    assert not (tmp_path / "run").exists()
