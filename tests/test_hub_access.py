"""An offline Hugging Face Hub is known before transformers asks it (memtrain.models.hub_access):
``hf:ORG/NAME`` then reads the local cache only and fails in seconds, not after five retries."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from memtrain.models import hub_access


@pytest.fixture
def no_offline_env(monkeypatch):
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", *hub_access._PROXY_VARS):
        monkeypatch.delenv(var, raising=False)
    hub_access._unreachable.cache_clear()
    yield monkeypatch
    hub_access._unreachable.cache_clear()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: a connection is refused


@pytest.mark.parametrize("var", ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"])
def test_offline_variable_read_at_call_time(no_offline_env, var):
    no_offline_env.setenv(var, "1")
    assert hub_access.offline_reason() == f"{var} is set"
    assert hub_access.from_pretrained_kwargs("org/name") == {"local_files_only": True}
    assert hub_access.from_pretrained_kwargs(None) == {}  # a local directory is never affected
    assert "org/name is not in the local Hugging Face cache" in hub_access.offline_hint("org/name")


def test_unreachable_endpoint_reads_the_cache_only(no_offline_env):
    no_offline_env.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    assert "127.0.0.1 is unreachable" in hub_access.offline_reason()
    assert hub_access.from_pretrained_kwargs("org/name") == {"local_files_only": True}


def test_reachable_endpoint_and_proxies_leave_the_library_alone(no_offline_env):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        no_offline_env.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert hub_access.offline_reason() is None
        assert hub_access.from_pretrained_kwargs("org/name") == {}
    # Behind a proxy a direct connection says nothing about the Hub: no probe, the library decides.
    no_offline_env.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    hub_access._unreachable.cache_clear()
    no_offline_env.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    assert hub_access.offline_reason() is None


def test_hub_model_on_an_unreachable_hub_is_one_config_error(no_offline_env):
    pytest.importorskip("transformers")
    from memtrain.config.run import ConfigError, build_config
    from memtrain.models.auto_config import load_config

    no_offline_env.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    load_config.cache_clear()
    with pytest.raises(ConfigError, match=r"cannot read the model config of --model 'hf:memtrain-test/absent'.*"
                                          r"the Hub was not asked: 127\.0\.0\.1 is unreachable"):
        build_config({"model": "hf:memtrain-test/absent"})


TINY_LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
              "num_hidden_layers": 1, "vocab_size": 128}


def _cached_repo(cache: Path, name: str, files: dict[str, Any]) -> Path:
    """Hub repository memtrain-test/NAME as the Hugging Face cache holds it: its files (JSON
    objects, or bytes) in one snapshot that refs/main names. Returns the snapshot folder."""
    import json

    root = cache / f"models--memtrain-test--{name}"
    snapshot = root / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text("0" * 40)
    for file, content in files.items():
        path = snapshot / file
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(json.dumps(content))
    return snapshot


@pytest.fixture
def hub_cache(no_offline_env, tmp_path):
    """An offline Hub whose cache is ``tmp_path``; configs read before are forgotten."""
    pytest.importorskip("transformers")
    import huggingface_hub.constants

    from memtrain.models.auto_config import load_config

    no_offline_env.setenv("HF_HUB_OFFLINE", "1")
    no_offline_env.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    load_config.cache_clear()
    yield tmp_path
    load_config.cache_clear()


def test_a_cached_hub_config_gets_the_checks_of_a_local_one(hub_cache):
    """A Hub repository's config.json was read by transformers from the cache, not by memtrain's
    checks of local files: its NaN rms_norm_eps went through and trained into a divergence, and
    an auto_map naming custom model code was accepted (a model_type transformers ships)."""
    from memtrain.config.run import ConfigError, build_config

    for name, fields in (("nan", {"rms_norm_eps": float("nan")}), ("novocab", {"vocab_size": 0}),
                         ("custom", {"auto_map": {"AutoModelForCausalLM": "modeling.Custom"}})):
        _cached_repo(hub_cache, name, {"config.json": {**TINY_LLAMA, **fields}})
    with pytest.raises(ConfigError, match=r"--model 'hf:memtrain-test/nan': .*config.json' has rms_norm_eps NaN, "
                                          "not a finite number"):
        build_config({"model": "hf:memtrain-test/nan"})
    with pytest.raises(ConfigError, match=r"--model 'hf:memtrain-test/novocab': .*config.json' has vocab_size 0"):
        build_config({"model": "hf:memtrain-test/novocab"})
    # Custom code in a cached repository is refused as in a folder: never offered
    # (transformers' own refusal told the user to pass trust_remote_code=True).
    with pytest.raises(ConfigError, match=r"names custom model code \(auto_map\); memtrain never runs code"):
        build_config({"model": "hf:memtrain-test/custom"})
    with pytest.raises(ConfigError) as absent:
        build_config({"model": "hf:memtrain-test/absent"})
    assert "local_files_only" not in str(absent.value) and "not in the local Hugging Face cache" in str(absent.value)


def test_a_cached_repository_without_weights_or_with_a_custom_tokenizer_is_one_line(hub_cache, tmp_path_factory,
                                                                                     capsys):
    """Without a network, a repository whose config is cached and weights are not was refused
    with transformers' advice not to ask for safetensors (pickles can run code); a custom
    tokenizer with the first line of transformers' plea for trust_remote_code."""
    import transformers

    from memtrain.cli import main

    _cached_repo(hub_cache, "noweights", {"config.json": TINY_LLAMA})
    weights = tmp_path_factory.mktemp("weights")
    transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**{k: v for k, v in TINY_LLAMA.items()
                                                                               if k != "model_type"})
                                                  ).save_pretrained(weights)
    _cached_repo(hub_cache, "customtok", {"config.json": TINY_LLAMA,
                                          "model.safetensors": (weights / "model.safetensors").read_bytes(),
                                          "tokenizer_config.json": {"auto_map": {"AutoTokenizer": ["tok.T", None]},
                                                                    "tokenizer_class": "CustomTokenizer"}})
    out = tmp_path_factory.mktemp("runs")
    for name, words in (("noweights", "has no *.safetensors weights in the local Hugging Face cache (the Hub was "
                                      "not asked: HF_HUB_OFFLINE is set)"),
                        ("customtok", "the tokenizer of --model 'hf:memtrain-test/customtok' names custom code "
                                      "(auto_map); memtrain never runs code")):
        capsys.readouterr()
        assert main(["train", "--model", f"hf:memtrain-test/{name}", "--steps", "1", "--seq-len", "16",
                     "--out", str(out / name), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert words in err and "use_safetensors" not in err and "trust_remote_code" not in err, err
