"""Config: defaults, layering of files and flags, and one-line errors for bad input."""

import pytest

from memtrain.config.file import load_config_file
from memtrain.config.run import ConfigError, build_config, parse_size


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
        # A transformers model's limits come from its config.json: --max-seq-len / --d-model change nothing.
        ({"model": "tiny-llama", "seq_len": 1024, "max_seq_len": 4096},
         "exceeds the max_position_embeddings 512 of --model 'tiny-llama'; lower --seq-len"),
        ({"model": "tiny-llama", "lora_rank": 4096}, "exceeds the hidden size 128 of --model 'tiny-llama'; lower --lora-rank"),
        ({"batch_size": -1}, "--batch-size must be positive"),
        ({"precision": "fp4"}, "unknown --precision"),
        ({"checkpointing": "every:x"}, "every:K"),
        ({"window": 300, "seq_len": 256}, "larger than --seq-len"),
        ({"steps": "ten"}, "expects int"),
        ({"prefetch_factor": 2}, "--num-workers"),
        ({"optim_block": 3}, "--optim-block must be 0"),
        ({"optim_block": -256}, "--optim-block must be 0"),
        ({"save_every": 5, "out": "runs/x"}, "no --save is given; add --save \\(e.g. --save runs/x/ckpt.pt\\)"),
        # A YAML "\\0" or JSON "\\u0000" (or a checkpoint's saved --out): os calls raised ValueError mid-run.
        ({"out": "runs/a\x00b"}, "--out holds a NUL character"),
        ({"data": "a\x00.txt"}, "--data holds a NUL character"),
    ],
)
def test_bad_values_are_one_line_errors(layer, message):
    with pytest.raises(ConfigError, match=message) as info:
        build_config(layer)
    assert "\n" not in str(info.value)


def test_bad_config_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config_file(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="is a directory; give a YAML, TOML or JSON file"):
        load_config_file(tmp_path)  # it exists: "not found" sent the user looking for it
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
    # Peta units are read (they were "cannot read memory size"), and a size past 1 EiB says so.
    assert parse_size("1PiB") == 2**50 and parse_size("2PB") == 2 * 10**15
    with pytest.raises(ConfigError, match="beyond what memtrain handles"):
        parse_size("99999999PiB")
    # The unit of that limit is read, and a size at or past it says so, not "cannot read"; zero or
    # less is said to be what it is.
    assert parse_size("0.5EiB") == 2**59
    for size in ("1EiB", "2EiB", "1e400", "2E"):
        with pytest.raises(ConfigError, match="beyond what memtrain handles"):
            parse_size(size)
    for size in ("0", "-3GiB", "0MiB"):
        with pytest.raises(ConfigError, match="is not positive"):
            parse_size(size)


# --------------------------------------------------------------------------- --model resolution
# What ModelConfig.__post_init__ may not do while a dataclass is built: read a file or a folder,
# import a module (models.spec, transformers), or reach the network.
_NO_IO_SCRIPT = r"""
import sys
from memtrain.config.run import ModelConfig, RunConfig

events = []
watched = ("open", "import", "os.listdir", "os.scandir", "socket.connect", "socket.getaddrinfo", "subprocess.Popen")
sys.addaudithook(lambda event, args: events.append((event, str(args)[:200])) if event in watched else None)
default = ModelConfig()
first = ModelConfig(model="llama-3-8b")
assert not events, events[:5]
for spec in ("llama-3-8b", "gpt2", "tiny-llama", "hf:Org/Name", "/no/such/folder", "no-such-model"):
    m = ModelConfig(model=spec)
    assert m.model == spec and (m.d_model, m.n_layers, m.vocab_size) == (default.d_model, default.n_layers,
                                                                          default.vocab_size), m
RunConfig(model=first)
assert not events, events[:5]
assert "memtrain.models.spec" not in sys.modules and "transformers" not in sys.modules
print("ok")
"""


def test_model_config_reads_no_file_and_imports_no_spec():
    """Building a ModelConfig only checks the values given: ``model`` is recorded, never
    resolved (no config.json opened, no models.spec or transformers imported, no network);
    an audit hook in a fresh interpreter sees every open and import."""
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _NO_IO_SCRIPT], capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def _bundled_json(name: str) -> dict:
    import json

    from memtrain.models.source import CONFIG_DIR

    return json.loads((CONFIG_DIR / f"{name}.json").read_text(encoding="utf-8"))


def test_from_spec_resolves_a_gpt_preset():
    from memtrain.config.presets import PRESETS
    from memtrain.config.run import ModelConfig

    m = ModelConfig.from_spec("gpt2", d_model=64, vocab_multiple=64)
    assert m.model == "gpt2"
    assert {k: getattr(m, k) for k in PRESETS["gpt2"][0]} == PRESETS["gpt2"][0]  # the preset wins over d_model=64
    assert m.vocab_multiple == 64  # a field the preset leaves alone keeps the given value
    assert build_config({"model": "gpt2"}).model == ModelConfig.from_spec("gpt2")


def test_from_spec_resolves_a_bundled_config():
    pytest.importorskip("transformers")
    from memtrain.config.run import ModelConfig

    c = _bundled_json("llama-3-8b")
    m = ModelConfig.from_spec("llama-3-8b")
    assert (m.model, m.vocab_size, m.d_model, m.n_heads, m.n_layers, m.d_ff, m.max_seq_len) == (
        "llama-3-8b", c["vocab_size"], c["hidden_size"], c["num_attention_heads"], c["num_hidden_layers"],
        c["intermediate_size"], c["max_position_embeddings"])
    assert m.untie_embeddings == (not c.get("tie_word_embeddings", True))
    assert m != ModelConfig(model="llama-3-8b")  # the dataclass alone keeps memtrain's default shape
    assert build_config({"model": "llama-3-8b", "seq_len": 2048}).model == m


def test_from_spec_resolves_a_local_folder(llama_dir):
    from memtrain.config.run import ModelConfig

    m = ModelConfig.from_spec(str(llama_dir), n_layers=7)
    assert (m.vocab_size, m.d_model, m.n_heads, m.n_layers, m.d_ff, m.max_seq_len) == (50257, 16, 2, 1, 32, 64)
    assert build_config({"model": str(llama_dir), "seq_len": 32}).model == ModelConfig.from_spec(str(llama_dir))
    with pytest.raises(ConfigError, match="is not a preset, a bundled config"):
        ModelConfig.from_spec(str(llama_dir / "missing"))


def test_replace_resolves_the_model_again():
    """RunConfig.replace goes through build_config: the model's shape stays the model's."""
    cfg = build_config({"model": "gpt2"}).replace(d_model=64, batch_size=2)
    assert (cfg.model.d_model, cfg.train.batch_size) == (768, 2)


def test_an_empty_section_is_no_settings_and_a_section_holding_a_value_is_named(tmp_path):
    """`train:` with its settings commented out is YAML's null: it was refused as "unknown option
    --train", the name of a section the file may use. It is an empty section now; a section
    holding a list or text is one line naming the section and showing one of its settings."""
    from memtrain.config.run import flatten

    empty = tmp_path / "empty.yaml"
    empty.write_text("model:\ntrain:\n  # steps: 3\ntechnique:\nsteps: 2\n")
    assert load_config_file(empty) == {"steps": 2}
    cfg = build_config(flatten(load_config_file(empty)))
    assert cfg.train.steps == 2
    for text, words in (("train: [1, 2]\n", "has train: holding a list"),
                        ("technique: fast\n", "has technique: holding text"),
                        ("train: 3\n", "has train: holding a number")):
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(ConfigError, match="a section holds settings") as err:
            load_config_file(bad)
        assert words in str(err.value) and "e.g." in str(err.value)


def test_seq_lens_help_says_a_shorter_model_trains_at_its_own_length(capsys):
    """Without --seq-len a model with fewer positions than the default trains at its own length
    (build_config); the flag's help said only the default and the bound."""
    from memtrain.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--seq-len INT Tokens per training sequence (<= --max-seq-len; when not given, a model with fewer " \
           "positions than this default trains at its own length). (default: 256)" in help_text
    cfg = build_config({"max_seq_len": 128})
    assert cfg.train.seq_len == 128 and build_config({"max_seq_len": 128, "seq_len": 64}).train.seq_len == 64


def test_a_flag_beats_the_config_file_which_beats_the_base_and_the_defaults(tmp_path):
    """The command line's layers, as train resolves them: defaults <- a base (a bench preset) <-
    --config FILE <- flags; a setting no layer names keeps its default."""
    from memtrain.cli import build_parser, config_from_args

    p = tmp_path / "run.yaml"
    p.write_text("train:\n  batch_size: 3\n  lr: 0.002\n  steps: 40\ntechnique:\n  precision: bf16\n")
    args, _ = build_parser().parse_known_args(["train", "--config", str(p), "--batch-size", "5"])
    cfg = config_from_args(args, base={"lr": 0.001, "seq_len": 64, "steps": 10})
    assert cfg.train.batch_size == 5  # the flag over the file
    assert cfg.train.lr == 0.002 and cfg.train.steps == 40 and cfg.technique.precision == "bf16"  # file over base
    assert cfg.train.seq_len == 64  # the base over the default
    assert cfg.train.warmup_steps == 4  # not given anywhere: 10% of the file's 40 steps
    assert cfg.train.weight_decay == 0.1 and cfg.technique.attention == "math"  # defaults


def test_a_run_that_sets_steps_alone_warms_up_over_a_tenth_of_them():
    """ceil(10%) of --steps, at least 1, at most the default 200; no --steps: the default 200."""
    assert [build_config({"steps": s}).train.warmup_steps for s in (3, 45, 2000, 5000)] == [1, 5, 200, 200]
    assert build_config({}).train.warmup_steps == 200
