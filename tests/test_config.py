"""Config: defaults, layering of files and flags, and one-line errors for bad input."""

import pytest

from memtrain.config.run import ConfigError, build_config, load_config_file, parse_size


def test_defaults_follow_spec():
    c = build_config()
    assert (c.train.steps, c.train.seq_len, c.train.lr, c.train.warmup_steps, c.train.grad_clip) == (
        200, 256, 3e-4, 200, 1.0)
    assert c.technique.optim == "adamw"


def test_layers_later_wins_and_nested_or_flat(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  d_model: 64\n  n_heads: 4\ntrain:\n  batch_size: 3\n")
    c = build_config(load_config_file(p), {"batch_size": "5"})
    assert c.model.d_model == 64 and c.train.batch_size == 5
    t = tmp_path / "c.toml"
    t.write_text('precision = "bf16"\n[train]\nsteps = 7\n')
    c = build_config(load_config_file(t))
    assert c.technique.precision == "bf16" and c.train.steps == 7


@pytest.mark.parametrize(
    "layer, message",
    [
        ({"d_modle": 64}, "did you mean --d-model"),
        ({"n_heads": 7}, "must divide --d-model"),
        ({"seq_len": 1024}, "exceeds --max-seq-len"),
        ({"batch_size": -1}, "--batch-size must be positive"),
        ({"precision": "fp8"}, "unknown --precision"),
        ({"checkpointing": "every:x"}, "every:K"),
        ({"window": 300, "seq_len": 256}, "larger than --seq-len"),
        ({"steps": "ten"}, "expects int"),
        ({"prefetch_factor": 2}, "--num-workers"),
        ({"optim_block": 3}, "--optim-block must be 0"),
        ({"optim_block": -256}, "--optim-block must be 0"),
    ],
)
def test_bad_values_are_one_line_errors(layer, message):
    with pytest.raises(ConfigError, match=message) as info:
        build_config(layer)
    assert "\n" not in str(info.value)


def test_bad_config_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config_file(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [\n")
    with pytest.raises(ConfigError, match="cannot parse"):
        load_config_file(bad)


def test_parse_size():
    assert parse_size("8GiB") == 8 * 2**30
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("512MiB") == 512 * 2**20
    with pytest.raises(ConfigError, match="8GiB"):
        parse_size("lots")
