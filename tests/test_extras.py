"""Optional extras fail with the install line; known third-party import noise stays quiet."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import TINY_MODEL
from memtrain.cli import main
from memtrain.config.run import ConfigError

FLAGS = [x for k, v in TINY_MODEL.items() for x in ("--" + k.replace("_", "-"), str(v))]


@pytest.mark.parametrize("module,extra", [("peft", "lora"), ("datasets", "hub"), ("pyarrow", "hub"),
                                          ("transformers", "hf")])
def test_require_names_the_extra(monkeypatch, module, extra):
    from memtrain.runtime.extras import import_extra

    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    with pytest.raises(ConfigError, match=rf"pip install 'memtrain\[{extra}\]'"):
        import_extra(module)


def test_lora_without_peft_is_one_error_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "peft", None)
    code = main(["train", "--lora-rank", "4", "--steps", "1", "--seq-len", "16", "--no-progress",
                 "--out", str(tmp_path / "r"), *FLAGS])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: LoRA (--lora-rank) needs the peft package")
    assert "pip install 'memtrain[lora]'" in err and err.count("\n") == 1
    assert not (tmp_path / "r" / "result.json").exists()


def test_jsonl_without_datasets_names_the_extra(tmp_path, monkeypatch, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello"}\n')
    monkeypatch.setitem(sys.modules, "datasets", None)
    code = main(["train", "--data", str(data), "--no-cache", "--steps", "1", "--seq-len", "16", "--no-progress",
                 "--out", str(tmp_path / "r"), *FLAGS])
    err = capsys.readouterr().err
    assert code == 2 and "pip install 'memtrain[hub]'" in err


@pytest.mark.slow  # importing torchao takes seconds
def test_torchao_import_noise_is_quiet():
    pytest.importorskip("torchao")
    env = {**os.environ, "MEMTRAIN_VERBOSE": "0"}
    code = "from memtrain.runtime.extras import quiet_third_party; quiet_third_party(); import torchao.optim"
    quiet = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert quiet.returncode == 0
    for noise in ("Failed to load", "Detected no triton", "deprecated"):
        assert noise not in quiet.stderr


def test_verbose_keeps_third_party_loggers(monkeypatch):
    import logging

    from memtrain.runtime.extras import quiet_third_party

    monkeypatch.setenv("MEMTRAIN_VERBOSE", "1")
    logger = logging.getLogger("torchao")
    monkeypatch.setattr(logger, "level", logging.NOTSET)
    quiet_third_party()
    assert logger.level == logging.NOTSET
    monkeypatch.setenv("MEMTRAIN_VERBOSE", "0")
    quiet_third_party()
    assert logger.level == logging.ERROR


def test_compile_time_syntax_warnings_of_libraries_are_quiet_and_memtrains_own_warnings_stay(monkeypatch):
    """A SyntaxWarning raised while a library's source compiles names the file, not the module
    (torchao's "invalid escape sequence" reached the bench's output); it is hidden, while a warning
    of memtrain's own and a SyntaxWarning of another file still show."""
    import warnings

    from memtrain.runtime.extras import quiet_third_party
    from memtrain.runtime.notices import SlowPrecisionWarning

    monkeypatch.setenv("MEMTRAIN_VERBOSE", "0")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_third_party()
        warnings.warn_explicit("invalid escape sequence '\\.'", SyntaxWarning,
                               "/tmp/site/torchao/quantization/quant_api.py", 1542)
        warnings.warn_explicit("invalid escape sequence '\\d'", SyntaxWarning, "/home/me/my_script.py", 3)
        warnings.warn("--precision bf16: slow here", SlowPrecisionWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["invalid escape sequence '\\d'", "--precision bf16: slow here"]


def test_transformers_loading_bars_are_off_while_memtrain_loads_a_model(tmp_path, capsys, monkeypatch):
    """transformers' "Loading weights" bar is not printed when memtrain builds a model from a
    directory with weights, and the library's own setting is restored afterwards."""
    transformers = pytest.importorskip("transformers")
    from transformers.utils import logging as hf_logging

    from memtrain.config.run import build_config
    from memtrain.models.hf import build_hf_model

    monkeypatch.setenv("MEMTRAIN_VERBOSE", "0")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    capsys.readouterr()
    hf_logging.enable_progress_bar()
    build_hf_model(build_config({"model": str(tmp_path / "m"), "seq_len": 16}), with_weights=True)
    assert "Loading weights" not in capsys.readouterr().err
    assert hf_logging.is_progress_bar_enabled()
