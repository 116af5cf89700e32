"""The Trainer's option names, one vocabulary across verbs, and per-verb --help."""

from __future__ import annotations

import pytest

from memtrain.cli import build_parser, config_from_args, main
from memtrain.config.run import ConfigError, build_config


def _cfg(argv: list[str]):
    args, extra = build_parser().parse_known_args(argv)
    assert not extra
    return config_from_args(args)


def test_trainer_names_map_onto_our_fields():
    cfg = _cfg(["train", "--bf16", "--gradient_checkpointing", "--optim", "adamw_torch_fused",
                "--learning_rate", "1e-3", "--max_steps", "7", "--per_device_train_batch_size", "2",
                "--warmup_steps", "3", "--weight_decay", "0.2", "--max_grad_norm", "0.5",
                "--output_dir", "/tmp/x", "--torch_compile", "--dataloader_num_workers", "1",
                "--dataloader_pin_memory", "--lora_r", "4", "--gradient_accumulation_steps", "3"])
    t, tech, d = cfg.train, cfg.technique, cfg.data
    assert (tech.precision, tech.checkpointing, tech.optim, tech.compile, tech.lora_rank) == ("bf16", "full", "adamw-fused", True, 4)
    assert (t.lr, t.steps, t.batch_size, t.warmup_steps, t.weight_decay, t.grad_clip, t.out, t.grad_accum) == \
        (1e-3, 7, 2, 3, 0.2, 0.5, "/tmp/x", 3)
    assert (d.num_workers, d.pin_memory) == (1, True)


def test_dash_spelling_and_explicit_false():
    cfg = _cfg(["train", "--learning-rate", "2e-3", "--fp16", "--bf16", "false", "--torch-compile", "False"])
    assert cfg.train.lr == 2e-3 and cfg.technique.precision == "fp16" and cfg.technique.compile is False


@pytest.mark.parametrize("trainer,ours", [("adamw_torch", "adamw"), ("adafactor", "adafactor"),
                                         ("adamw_bnb_8bit", "adamw-bnb-8bit"), ("adamw_torch_8bit", "adamw-8bit"),
                                         ("adamw_torch_4bit", "adamw-4bit")])
def test_trainer_optim_values(trainer, ours):
    assert _cfg(["train", "--optim", trainer]).technique.optim == ours


@pytest.mark.parametrize("ours", ["adamw", "adamw-fused", "adamw-8bit", "adamw-4bit", "adamw-bnb-8bit", "adafactor"])
def test_our_optim_values_are_unchanged(ours):
    assert _cfg(["train", "--optim", ours]).technique.optim == ours


def test_aliases_in_config_files_and_help(capsys):
    cfg = build_config({"learning_rate": 5e-4, "bf16": True, "optim": "adamw_torch", "lora_r": 2})
    assert (cfg.train.lr, cfg.technique.precision, cfg.technique.optim, cfg.technique.lora_rank) == (5e-4, "bf16", "adamw", 2)
    with pytest.raises(ConfigError, match="--bf16 takes true or false"):
        build_config({"bf16": "maybe"})
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for name in ("--bf16", "--gradient_checkpointing", "--learning_rate", "--per_device_train_batch_size", "--lora_r"):
        assert name in out


def test_unknown_option_names_the_closest(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--learnin_rate", "3"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unrecognized arguments: --learnin_rate 3") and "did you mean --learning_rate?" in err
    assert err.count("\n") == 1


def test_a_misspelt_trainer_name_in_a_config_file_names_the_closest(tmp_path, capsys):
    """A config file's misspelt Trainer name gets the suggestion the command line gives it
    (only memtrain's own names were offered: `see --help`)."""
    (tmp_path / "c.toml").write_text("[train]\nlearning_rat = 0.1\n")
    assert main(["train", "--config", str(tmp_path / "c.toml"), "--out", str(tmp_path / "o")]) == 2
    assert "unknown option --learning-rat; did you mean --learning-rate?" in capsys.readouterr().err


def test_per_verb_help_lists_only_used_options(capsys):
    for verb in ("estimate", "maxbatch", "flops", "plan"):
        with pytest.raises(SystemExit):
            main([verb, "--help"])
        out = capsys.readouterr().out
        assert "--batch-size" in out and "--precision" in out, verb
        for loop_only in ("--warmup-steps", "--save-every", "--resume", "--eval-every", "--lr ", "--no-no-cache"):
            assert loop_only not in out, (verb, loop_only)
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "--no-cache" in out and "--no-no-cache" not in out


def test_no_cache_switch():
    assert _cfg(["train", "--no-cache"]).data.no_cache is True
    assert _cfg(["train"]).data.no_cache is False


def test_estimate_derives_max_seq_len(capsys):
    assert main(["estimate", "--params", "7e9", "--seq-len", "2048", "--device", "cpu", "--json"]) == 0
    assert capsys.readouterr().out.lstrip().startswith("{")
    # An explicit --max-seq-len still wins, and still refuses a longer --seq-len.
    assert main(["estimate", "--params", "1e8", "--seq-len", "2048", "--max-seq-len", "1024", "--device", "cpu"]) == 2
    assert "exceeds --max-seq-len 1024" in capsys.readouterr().err


def test_memory_budget_and_max_batch_are_one_vocabulary(capsys):
    base = ["--d-model", "64", "--n-heads", "4", "--n-layers", "2", "--d-ff", "128", "--seq-len", "32",
            "--device", "cpu", "--top", "1", "--json"]
    assert main(["plan", "--memory-budget", "128MiB", *base]) == 0
    a = capsys.readouterr().out
    assert main(["plan", "--budget", "128MiB", *base]) == 0
    assert a == capsys.readouterr().out
    import json

    assert main(["plan", "--memory-budget", "128MiB", "--max-batch", "4", *base]) == 0
    capped = json.loads(capsys.readouterr().out)["candidates"][0]
    assert capped["batch_size"] * capped["grad_accum"] <= 4


def test_warmup_capped_only_when_no_layer_sets_it():
    from memtrain.bench.scales import scale_overrides

    assert build_config({"steps": 30}).train.warmup_steps == 3
    assert build_config({"steps": 30}, {"warmup_steps": 200}).train.warmup_steps == 200
    assert build_config({"steps": 5000}).train.warmup_steps == 200
    assert build_config({"steps": 30}).train.warmup_defaulted is True
    assert build_config({"warmup_steps": 7}).train.warmup_defaulted is False
    # No layer sets --steps: the seed's spec (200 steps, 200 warm-up steps) stands.
    assert build_config().train.warmup_steps == 200
    assert build_config().train.warmup_defaulted is False
    # The seed scale names its warm-up, so it keeps the seed's 200.
    assert build_config(scale_overrides("seed")).train.warmup_steps == 200


def test_train_says_so_once(tmp_path, capsys):
    from conftest import TINY_MODEL

    flags = [x for k, v in TINY_MODEL.items() for x in ("--" + k.replace("_", "-"), str(v))]
    code = main(["train", "--steps", "2", "--batch-size", "1", "--seq-len", "16", "--val-blocks", "1",
                 "--no-progress", "--out", str(tmp_path / "r"), *flags])
    err = capsys.readouterr().err
    assert code == 0 and err.count("note: warm-up was 1 step (10% of --steps 2") == 1


@pytest.mark.parametrize("flags", [["--fp16", "--bf16"], ["--precision", "fp16", "--bf16"],
                                   ["--bf16", "--precision", "fp16"], ["--bf16", "--precision", "bf16-pure"],
                                   ["--gradient_checkpointing", "--checkpointing", "selective"]])
def test_a_switch_beside_a_name_of_its_field_with_another_value_is_refused(flags, tmp_path, capsys):
    """The last one silently won (--fp16 --bf16 ran BF16); the Trainer refuses fp16 with bf16."""
    for verb in (["estimate"], ["train", "--out", str(tmp_path / "o")]):
        assert main([*verb, *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and "ask for different" in err, err
        assert all(f in err for f in flags if f.startswith("--")), err
    assert not (tmp_path / "o").exists()


def test_switches_that_agree_are_still_taken():
    for flags, precision in ((["--bf16", "--precision", "bf16"], "bf16"), (["--fp16", "--bf16", "false"], "fp16"),
                             (["--bf16", "--bf16"], "bf16")):
        assert _cfg(["train", *flags]).technique.precision == precision
    assert _cfg(["train", "--compile", "--torch_compile"]).technique.compile is True


@pytest.mark.parametrize("text", ["fp16: true\nbf16: true\n", "technique:\n  precision: fp16\nbf16: true\n",
                                  "torch_compile: true\ncompile: false\n"])
def test_a_config_file_with_disagreeing_switches_is_refused(text, tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    assert main(["estimate", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "ask for different" in err, err
    agree = tmp_path / "agree.yaml"
    agree.write_text("precision: bf16\nbf16: true\nfp16: false\n")
    assert main(["estimate", "--config", str(agree), "--json"]) == 0


@pytest.mark.parametrize("argv, words", [
    (["--lr", "1e-3", "--learning_rate", "2e-3"], "--lr 1e-3 and --learning_rate ask for different --lr (1e-3, 2e-3)"),
    (["--learning_rate", "2e-3", "--lr", "1e-3"], "--learning_rate and --lr 1e-3 ask for different --lr"),
    (["--batch-size", "2", "--per_device_train_batch_size", "4"], "ask for different --batch-size (2, 4)"),
])
def test_an_alias_and_its_target_asking_for_different_values_are_refused(argv, words, capsys):
    """Whichever of --lr and --learning_rate came last silently won; now the line names both.
    The same value twice is one setting."""
    assert main(["train", *argv]) == 2
    assert words in capsys.readouterr().err
    assert _cfg(["train", "--lr", "1e-3", "--learning_rate", "1e-3"]).train.lr == 1e-3
    with pytest.raises(ConfigError, match="ask for different --lr"):
        build_config({"lr": 1e-3, "learning_rate": "2e-3"})
    assert build_config({"lr": 1e-3, "learning_rate": "1e-3"}).train.lr == 1e-3  # YAML reads 1e-3 as text


@pytest.mark.parametrize("text, words", [
    ("model:\n  d_model: 32\ntrain:\n  d_model: 64\n", "has d_model under train: but it is a model setting"),
    ("model:\n  d_model: 32\nd_model: 64\n", "sets d_model twice (model: and the top level)"),
    ("train:\n  lr: 0.001\n  learning_rate: 0.002\n", "ask for different --lr"),
])
def test_a_config_file_setting_a_key_twice_or_in_the_wrong_section_is_refused(text, words, tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    assert main(["estimate", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1


@pytest.mark.parametrize("verb, extra", [
    (["estimate"], "seq_len: 100000000\n"),  # would derive --max-seq-len from it
    (["train", "--out", "{out}"], "resume: {missing}\n"),  # would read the checkpoint before the file
])
def test_a_config_file_whose_aliases_cannot_be_read_is_that_one_error(verb, extra, tmp_path, capsys):
    """A config file whose aliases cannot be read is refused as the one-line error it is: its
    unread keys steered the command first (a --seq-len over the limit, a --resume that is not
    there), which then failed on them and hid the file's own error."""
    path = tmp_path / "run.yaml"
    out = tmp_path / "o"
    path.write_text("fp16: true\nbf16: true\n" + extra.format(missing=tmp_path / "missing"))
    assert main([*(a.format(out=out) for a in verb), "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == "error: --fp16 and --bf16 ask for different --precision (fp16, bf16); keep one of them\n", err
    assert not out.exists()


def test_given_settings_reads_each_layer_as_the_bench_does():
    """The CLI's settings and the bench's are one reading: an unreadable layer is left out (its
    raw keys, in the Trainer's names, are never merged) and later layers win."""
    from memtrain.config.layers import given_settings, normalized_layers

    bad = {"learning_rate": 1e-3, "lr": 2e-3, "seq_len": 64}
    assert normalized_layers(bad) == []
    assert given_settings({"lr": 1e-3, "steps": 5}, bad, {"per_device_train_batch_size": 2}) == \
        {"lr": 1e-3, "steps": 5, "batch_size": 2}
