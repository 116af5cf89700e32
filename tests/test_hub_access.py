"""An offline Hugging Face Hub is known before transformers asks it (memtrain.models.hub_access):
``hf:ORG/NAME`` then reads the local cache only and fails in seconds, not after five retries."""

from __future__ import annotations

import socket

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
    from memtrain.models.spec import load_config

    no_offline_env.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    load_config.cache_clear()
    with pytest.raises(ConfigError, match=r"cannot read the model config of --model 'hf:memtrain-test/absent'.*"
                                          r"the Hub was not asked: 127\.0\.0\.1 is unreachable"):
        build_config({"model": "hf:memtrain-test/absent"})


def test_a_cached_hub_config_gets_the_checks_of_a_local_one(no_offline_env, tmp_path):
    """A Hub repository's config.json was read by transformers from the cache, not by memtrain's
    checks of local files: its NaN rms_norm_eps went through and trained into a divergence, and
    an auto_map naming custom model code was accepted (a model_type transformers ships)."""
    pytest.importorskip("transformers")
    import json

    import huggingface_hub.constants

    from memtrain.config.run import ConfigError, build_config
    from memtrain.models.spec import load_config

    for name, fields in (("nan", {"rms_norm_eps": float("nan")}), ("novocab", {"vocab_size": 0}),
                         ("custom", {"auto_map": {"AutoModelForCausalLM": "modeling.Custom"}})):
        snapshot = tmp_path / f"models--memtrain-test--{name}" / "snapshots" / ("0" * 40)
        snapshot.mkdir(parents=True)
        (tmp_path / f"models--memtrain-test--{name}" / "refs").mkdir()
        (tmp_path / f"models--memtrain-test--{name}" / "refs" / "main").write_text("0" * 40)
        config = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                  "num_hidden_layers": 1, "vocab_size": 128, **fields}
        (snapshot / "config.json").write_text(json.dumps(config))
    no_offline_env.setenv("HF_HUB_OFFLINE", "1")
    no_offline_env.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    load_config.cache_clear()
    try:
        with pytest.raises(ConfigError, match=r"--model 'hf:memtrain-test/nan': .*config.json' has rms_norm_eps NaN, "
                                              "not a finite number"):
            build_config({"model": "hf:memtrain-test/nan"})
        with pytest.raises(ConfigError, match=r"--model 'hf:memtrain-test/novocab': .*config.json' has vocab_size 0"):
            build_config({"model": "hf:memtrain-test/novocab"})
        # Custom code in a cached repository is refused as in a folder: never offered
        # (transformers' own refusal told the user to pass trust_remote_code=True).
        with pytest.raises(ConfigError, match=r"names custom model code \(auto_map\); memtrain never runs code"):
            build_config({"model": "hf:memtrain-test/custom"})
    finally:
        load_config.cache_clear()
