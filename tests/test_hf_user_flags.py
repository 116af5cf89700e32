"""A user of transformers' Trainer, peft and accelerate gets the right picture from their first flags:
printed commands rebuild what was planned, a --model gets transformers' attention default and a
line saying which defaults shaped the answer, one name means one model, LoRA on a random base is
said once, the Trainer's option names map (or are refused in one line), and a misspelt option is
never taken for a prefix of another."""

from __future__ import annotations

import json
import shlex

import pytest

from conftest import TINY_MODEL, cli_flags
from memtrain.cli import build_parser, config_from_args, main
from memtrain.config.run import ConfigError, build_config
from memtrain.config.train_flags import train_flags


def _parse(argv: list[str]):
    args, extra = build_parser().parse_known_args(argv)
    assert not extra, extra
    return args


def _cfg(argv: list[str]):
    return config_from_args(_parse(argv))


def _train_cfg_of(flags: str):
    """The config `memtrain train FLAGS` resolves to, through train's own parser."""
    return _cfg(["train", *shlex.split(flags)])


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


# ------------------------------------------------------------------------ 1. printed commands
def _planned(argv: list[str], capsys):
    """plan's JSON for ``argv`` and the config it planned from (parsed as plan parses it)."""
    from memtrain.commands.estimate import resolve_model

    assert main(["plan", *argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cfg, _ = resolve_model(_parse(["plan", *argv]))
    return out, cfg


def _check_plan_commands_rebuild_the_plan(argv: list[str], capsys) -> None:
    from memtrain.analysis.plan import Candidate, candidate_config

    out, cfg = _planned(argv, capsys)
    assert out["candidates"]
    for c in out["candidates"]:
        planned = candidate_config(cfg, Candidate(c["techniques"], c["batch_size"], c["grad_accum"], 0, "", 0))
        assert _train_cfg_of(c["config_flags"]).to_dict() == planned.to_dict(), c["config_flags"]
    # The text output's suggestion is the recommended candidate's command.
    assert main(["plan", *argv]) == 0
    best = [line for line in capsys.readouterr().out.splitlines() if line.startswith("best: memtrain train ")]
    assert best == ["best: memtrain train " + out["candidates"][out["recommended"]]["config_flags"]]


def test_plan_command_rebuilds_a_gpt_preset_with_lora_and_its_seq_len(capsys):
    """--model gpt2-medium at seq 2048 with LoRA: the printed command trains that model, not the
    default 16M GPT at seq 256."""
    _check_plan_commands_rebuild_the_plan(
        ["--model", "gpt2-medium", "--seq-len", "2048", "--max-seq-len", "2048", "--lora-rank", "16",
         "--lora-targets", "qkv,fc", "--lora-alpha", "32", "--budget", "24GiB", "--device-type", "cuda",
         "--batch-size", "4", "--grad-accum", "2", "--top", "3"], capsys)


def test_plan_command_rebuilds_a_transformers_model(capsys, one_thread):
    """A transformers --model (traced): the command names the model, its LoRA targets and the
    sequence length; no shape flag competes with the model's own config."""
    argv = ["--model", "tiny-llama", "--seq-len", "32", "--batch-size", "2", "--lora-rank", "4",
            "--lora-targets", "q_proj,v_proj", "--budget", "1GiB", "--device-type", "cpu",
            "--precisions", "fp32", "--attentions", "sdpa", "--checkpointings", "none", "--losses", "standard",
            "--top", "1"]
    _check_plan_commands_rebuild_the_plan(argv, capsys)
    out, _ = _planned(argv, capsys)
    flags = shlex.split(out["candidates"][0]["config_flags"])
    assert flags[:2] == ["--model", "tiny-llama"] and "--d-model" not in flags


@pytest.mark.parametrize("flags, words", [
    (["--lora-targets", "q_proj,v_proj"], "--lora-targets q_proj,v_proj applies only with --lora-rank"),
    (["--lora-alpha", "32"], "--lora-alpha 32.0 applies only with --lora-rank"),
    (["--lora-dropout", "0.05"], "--lora-dropout 0.05 applies only with --lora-rank"),
    (["--compile-mode", "max-autotune"], "--compile-mode max-autotune applies only with --compile"),
    (["--compile-scope", "block"], "--compile-scope block applies only with --compile"),
    (["--adafactor-relative-step"], "--adafactor-relative-step applies only with --optim adafactor"),
    (["--loss-chunk", "64"], "--loss-chunk 64 applies only with --loss chunked"),
    (["--schedule", "constant", "--min-lr-ratio", "0.5"], "--min-lr-ratio 0.5 applies only with --schedule cosine"),
])
def test_a_setting_of_a_technique_that_is_off_is_refused(tiny_run, tmp_path, flags, words, capsys):
    """--lora-targets without --lora-rank trained every weight and said nothing; each such setting
    is one line naming the flag that turns its technique on."""
    run = {**tiny_run, "out": str(tmp_path / "o")}
    assert main(["train", *cli_flags(run), *flags]) == 2
    assert words in _error_line(capsys)
    assert not (tmp_path / "o").exists()
    # With its technique on, or at its default value (a config file spelling out every key), it is taken.
    assert _cfg(["train", "--lora-rank", "4", "--lora-alpha", "32"]).technique.lora_alpha == 32.0
    assert _cfg(["train", "--lora-alpha", "16"]).technique.lora_rank == 0


def test_printed_commands_leave_out_settings_of_techniques_that_are_off():
    cfg = build_config({"loss": "standard", "loss_chunk": 64, "compile_mode": "max-autotune"})
    flags = train_flags(cfg)
    assert "--loss-chunk" not in flags and "--compile-mode" not in flags
    _cfg(["train", *flags])  # train takes the command


def test_plan_leaves_selective_out_for_a_transformers_model():
    """Megatron's selective policy is refused for a transformers model; plan does not offer it."""
    from memtrain.analysis.plan import default_space

    assert "selective" in default_space(build_config(), "cpu")["checkpointing"]
    assert "selective" not in default_space(build_config({"model": "tiny-llama"}), "cpu")["checkpointing"]


@pytest.mark.parametrize("argv", [
    ["--model", "tiny-llama", "--seq-len", "64", "--lora-rank", "8", "--qlora", "--lora-dropout", "0.05",
     "--data", "hf:org/name", "--text-field", "body", "--strip-html", "--no-cache", "--no-progress",
     "--window", "16", "--lr", "1e-4", "--steps", "30", "--save", "ck.pt", "--device", "cpu"],
    ["--d-model", "96", "--n-heads", "3", "--untie-embeddings", "--no-bias", "--max-seq-len", "1024",
     "--seq-len", "1024", "--precision", "bf16-pure", "--optim", "adamw-8bit", "--vocab-multiple", "64",
     "--checkpointing", "every:2", "--min-lr-ratio", "0.0", "--warmup_ratio", "0.1"],
])
def test_train_flags_round_trip_through_trains_parser(argv):
    cfg = _cfg(["train", *argv])
    assert _cfg(["train", *train_flags(cfg)]).to_dict() == cfg.to_dict()


@pytest.mark.parametrize("verb", ["train", "estimate"])
@pytest.mark.parametrize("flag, words", [
    (["--no-bias"], "--no-bias: --model tiny-gpt2 is a transformers model, which builds the biases"),
    (["--vocab-multiple", "64"], "--vocab-multiple 64: --model tiny-gpt2 is a transformers model, which embeds"),
])
def test_gpt_only_model_flags_are_refused_for_a_transformers_model(verb, flag, words, capsys, tmp_path):
    """--no-bias and --vocab-multiple shape memtrain's GPT only: with a transformers --model, train
    ignored them (while result.json recorded them) and estimate counted them. Refused in one
    line by every verb; their defaults (a config file spelling out every key) pass."""
    assert main([verb, "--model", "tiny-gpt2", *flag, "--out", str(tmp_path / "o")] if verb == "train"
                else [verb, "--model", "tiny-gpt2", *flag]) == 2
    assert words in _error_line(capsys)
    assert not (tmp_path / "o").exists()
    assert _cfg(["train", "--model", "tiny-gpt2", "--bias", "--vocab-multiple", "1"]).model.bias
    assert _cfg(["train", *flag]).model != _cfg(["train"]).model  # memtrain's GPT takes them


def test_a_bench_presets_padding_is_not_applied_to_a_transformers_model():
    """The adamw-8bit row pads memtrain's GPT's vocabulary to 64; a transformers model embeds its
    own vocab_size rows, so its row's config (and estimate) keeps vocab_multiple 1."""
    from memtrain.analysis.estimate.method import estimate_step
    from memtrain.bench.technique_sets import technique_overrides

    row = technique_overrides("adamw-8bit", "quick")
    assert row["vocab_multiple"] == 64
    cfg = build_config({"model": "tiny-gpt2", "batch_size": 2, "seq_len": 32}, row)
    assert cfg.model.vocab_multiple == 1 and cfg.model.padded_vocab_size == cfg.model.vocab_size
    plain = build_config({"model": "tiny-gpt2", "batch_size": 2, "seq_len": 32, "bias": False, "vocab_multiple": 64})
    assert estimate_step(plain, "cpu", None).json["parameters"] == estimate_step(
        build_config({"model": "tiny-gpt2", "batch_size": 2, "seq_len": 32}), "cpu", None).json["parameters"]


# ------------------------------------------------------------------------ 2. defaults of a --model
def test_a_transformers_model_gets_sdpa_unless_attention_is_given():
    from memtrain.commands.estimate import resolve_model

    assert resolve_model(_parse(["estimate", "--model", "tiny-llama"]))[0].technique.attention == "sdpa"
    assert resolve_model(_parse(["plan", "--model", "tiny-llama", "--budget", "1GiB"]))[0].technique.attention == "sdpa"
    assert _cfg(["train", "--model_name_or_path", "tiny-llama"]).technique.attention == "sdpa"
    assert _cfg(["maxbatch", "--model", "tiny-llama"]).technique.attention == "sdpa"
    math = resolve_model(_parse(["estimate", "--model", "tiny-llama", "--attention", "math"]))[0]
    assert math.technique.attention == "math"
    assert _cfg(["train"]).technique.attention == "math"  # memtrain's GPT keeps its default
    assert resolve_model(_parse(["estimate", "--model", "gpt2"]))[0].technique.attention == "math"


def test_a_family_without_sdpa_gets_eager_as_transformers_builds_it(tmp_path, capsys):
    """transformers builds Gemma-2 with eager attention (it has no SDPA path and refuses one): its
    default is math, not an sdpa that stops the run; a named --attention still wins."""
    import transformers

    d = tmp_path / "gemma2"
    d.mkdir()
    (d / "config.json").write_text(transformers.Gemma2Config(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_hidden_layers=2, max_position_embeddings=256, vocab_size=50257).to_json_string())
    assert _cfg(["train", "--model", str(d)]).technique.attention == "math"
    assert _cfg(["train", "--model", str(d), "--attention", "sdpa"]).technique.attention == "sdpa"
    assert main(["estimate", "--model", str(d), "--seq-len", "16", "--batch-size", "1"]) == 0
    assert "attention=math (the model's default, as in transformers" in capsys.readouterr().out


def test_the_families_without_sdpa_are_transformers_own():
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from memtrain.models.spec import NO_SDPA_MODEL_TYPES

    for model_type in sorted(NO_SDPA_MODEL_TYPES | {"llama", "qwen2", "mistral", "gemma", "phi3", "gpt2", "opt"}):
        model_class = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
        assert bool(model_class._supports_sdpa) == (model_type not in NO_SDPA_MODEL_TYPES), model_type


def test_estimate_of_llama_says_which_defaults_shaped_it(capsys):
    flags = ["estimate", "--model", "llama-3-8b", "--bf16", "--lora_r", "16", "--device-type", "cuda"]
    assert main(flags) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("defaults used: ")]
    assert len(lines) == 1
    for part in ("attention=sdpa", "seq-len 256", "base weights fp32 under bf16 autocast", "--precision bf16-pure",
                 "all-linear", "lora-alpha 16 (scale alpha / r = 1; peft's LoraConfig default is 8; --lora-alpha)"):
        assert part in lines[0], part
    # The default is transformers' SDPA: smaller than the materialized scores of --attention math.
    assert main([*flags, "--json"]) == 0
    default = json.loads(capsys.readouterr().out)["peak_bytes"]
    assert main([*flags, "--attention", "math", "--json"]) == 0
    assert default < json.loads(capsys.readouterr().out)["peak_bytes"]
    # Named settings are not defaults.
    assert main([*flags, "--attention", "sdpa", "--seq-len", "128"]) == 0
    out = capsys.readouterr().out
    assert "attention=" not in out and "seq-len 256" not in out and "all-linear" in out
    assert main([*flags, "--lora-alpha", "32"]) == 0  # peft's alpha, given, is no default
    assert "lora-alpha" not in capsys.readouterr().out


def test_plan_prints_the_defaults_of_its_choice(capsys):
    assert main(["plan", "--budget", "1GiB", "--d-model", "64", "--n-heads", "4", "--n-layers", "2", "--d-ff", "128",
                 "--device-type", "cpu", "--top", "1"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("defaults used: ")]
    assert lines == ["defaults used: seq-len 256 (--seq-len)"]  # plan chose the attention itself


def test_maxbatch_prints_the_defaults_of_its_answer(capsys, one_thread):
    """maxbatch picks the same defaults as estimate, plan and train (the attention kernel, the
    batch search's --seq-len) and said none of them; the length search sets --seq-len itself."""
    tiny = ["--budget", "64MiB", "--d-model", "32", "--n-heads", "2", "--n-layers", "1", "--vocab-size", "128"]
    assert main(["maxbatch", *tiny, "--max-batch", "8"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("defaults used: ")]
    assert lines == ["defaults used: attention=math (memtrain's GPT; --attention sdpa for the fused kernel); "
                     "seq-len 256 (--seq-len)"]
    assert main(["maxbatch", *tiny, "--search", "seq-len", "--max-len", "128"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("defaults used: ")]
    assert lines == ["defaults used: attention=math (memtrain's GPT; --attention sdpa for the fused kernel)"]
    # Named settings are not defaults, and JSON stays JSON.
    assert main(["maxbatch", *tiny, "--max-batch", "8", "--attention", "sdpa", "--seq-len", "64"]) == 0
    assert "defaults used" not in capsys.readouterr().out
    assert main(["maxbatch", *tiny, "--max-batch", "8", "--json"]) == 0
    json.loads(capsys.readouterr().out)


# ------------------------------------------------------------------------ 3. one name per model
@pytest.mark.parametrize("spec,twin", [("llama3-8b", "llama-3-8b"), ("Llama-3-8B", "llama-3-8b"),
                                       ("qwen2.5_7b", "qwen2.5-7b"), ("gpt-2", "gpt2")])
def test_a_near_spelling_of_a_model_name_is_refused_naming_it(spec, twin, capsys):
    for verb in ("estimate", "train"):
        assert main([verb, "--model", spec, "--out", "unused"] if verb == "train" else [verb, "--model", spec]) == 2
        assert f"did you mean --model {twin}?" in _error_line(capsys)


def test_llama_3_8b_is_the_transformers_config(capsys):
    assert main(["estimate", "--model", "llama-3-8b", "--device-type", "cuda", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["parameters"] == 8_030_261_248
    from memtrain.config.presets import PRESETS
    from memtrain.models.source import _name_key, bundled_names

    keys = [_name_key(n) for n in [*PRESETS, *bundled_names()]]
    assert len(keys) == len(set(keys))  # no two names for one model


# ------------------------------------------------------------------------ 4. LoRA on a random base
def test_random_base_warning_names_the_cases(tmp_path):
    from memtrain.runtime.notices import random_base_warning

    assert "random weights" in random_base_warning(build_config({"lora_rank": 4}))
    assert random_base_warning(build_config({"lora_rank": 4, "resume": "ck.pt"})) is None
    assert random_base_warning(build_config({})) is None
    assert "no *.safetensors weights" in random_base_warning(build_config({"model": "tiny-llama", "lora_rank": 4}))
    with_weights = tmp_path / "m"
    with_weights.mkdir()
    (with_weights / "config.json").write_text((__import__("memtrain.models.source", fromlist=["CONFIG_DIR"])
                                               .CONFIG_DIR / "tiny-llama.json").read_text())
    (with_weights / "model.safetensors").write_bytes(b"")
    assert random_base_warning(build_config({"model": str(with_weights), "lora_rank": 4})) is None


def test_train_warns_once_and_the_library_does_not(small_corpus, tmp_path, capsys, one_thread):
    run = {**TINY_MODEL, "data": str(small_corpus), "batch_size": 2, "seq_len": 16, "steps": 3, "warmup_steps": 1,
           "val_blocks": 1, "progress": False, "lora_rank": 4}
    assert main(["train", *cli_flags(run), "--out", str(tmp_path / "cli")]) == 0
    captured = capsys.readouterr()
    assert captured.err.count("on a random base") == 1 and "warning: --lora-rank 4" in captured.err
    assert "defaults used: attention=math" in captured.out
    from memtrain.training.train import train

    train(build_config({**run, "out": str(tmp_path / "lib")}))  # what a bench row runs
    assert "random base" not in capsys.readouterr().err


# ------------------------------------------------------------------------ 5. Trainer names, no prefixes
def test_more_trainer_names_map_onto_our_fields():
    cfg = _cfg(["train", "--save_steps", "5", "--logging_steps", "2", "--eval_steps", "4",
                "--resume_from_checkpoint", "ck.pt", "--model_name_or_path", "tiny-llama", "--seq-len", "32",
                "--save", "ck2.pt"])
    t = cfg.train
    assert (t.save_every, t.log_every, t.eval_every, t.resume, cfg.model.model) == (5, 2, 4, "ck.pt", "tiny-llama")


def test_warmup_ratio_is_a_share_of_the_steps():
    assert _cfg(["train", "--warmup_ratio", "0.1", "--max_steps", "55"]).train.warmup_steps == 6  # ceil, as the Trainer
    assert _cfg(["train", "--warmup-ratio", "0.5"]).train.warmup_steps == 100  # of the default 200 steps
    assert _cfg(["train", "--warmup_ratio", "0.1", "--warmup_steps", "3", "--steps", "50"]).train.warmup_steps == 3
    assert build_config({"warmup_ratio": 0.25, "steps": 8}).train.warmup_steps == 2
    assert build_config({"warmup_ratio": 0.25}, {"steps": 40}).train.warmup_steps == 10
    assert build_config({"warmup_steps": 7}, {"warmup_ratio": 0.5, "steps": 8}).train.warmup_steps == 4
    with pytest.raises(ConfigError, match=r"--warmup_ratio must be a number in \[0, 1\]"):
        build_config({"warmup_ratio": 1.5})


def test_lr_scheduler_type_maps_onto_the_schedule(capsys):
    cosine = _cfg(["train", "--lr_scheduler_type", "cosine"]).train
    assert (cosine.schedule, cosine.min_lr_ratio) == ("cosine", 0.0)  # the Trainer's cosine decays to 0
    constant = _cfg(["train", "--lr_scheduler_type", "constant", "--steps", "50"]).train
    assert (constant.schedule, constant.warmup_steps) == ("constant", 0)
    warm = _cfg(["train", "--lr_scheduler_type", "constant_with_warmup", "--warmup_steps", "5"]).train
    assert (warm.schedule, warm.warmup_steps) == ("constant", 5)
    linear = _cfg(["train", "--lr_scheduler_type", "linear"]).train
    assert (linear.schedule, linear.min_lr_ratio) == ("linear", 0.0)  # the Trainer's default, to 0
    assert main(["train", "--lr_scheduler_type", "polynomial"]) == 2
    assert "--lr_scheduler_type 'polynomial' is not available" in _error_line(capsys)


def test_num_train_epochs_is_refused_naming_steps(capsys):
    assert main(["train", "--num_train_epochs", "3"]) == 2
    err = _error_line(capsys)
    assert "--num_train_epochs 3 has no memtrain equivalent" in err and "--steps N" in err
    with pytest.raises(ConfigError, match="--steps"):
        build_config({"num_train_epochs": 1})


def test_a_misspelt_option_is_not_a_prefix(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--learning_rat", "0.001"])
    assert exc.value.code == 2
    assert "did you mean --learning_rate?" in _error_line(capsys)
    with pytest.raises(SystemExit) as exc:
        main(["estimate", "--seq", "64"])  # once a prefix of --seq-len
    assert exc.value.code == 2
    assert "did you mean --seq-len?" in _error_line(capsys)
    with pytest.raises(SystemExit):
        main(["estimate", "--lora"])  # memtrain's own flag before the Trainer's --lora_r
    assert "did you mean --lora-rank?" in _error_line(capsys)
    with pytest.raises(SystemExit):
        main(["estimate", "--layers", "2"])  # the listed flag, not its unlisted --n_layers spelling
    assert "did you mean --n-layers?" in _error_line(capsys)


@pytest.mark.parametrize("verb", ["bench", "plan", "estimate", "maxbatch", "flops"])
@pytest.mark.parametrize("flag", [["--report-to", "tensorboard"], ["--log-every", "5"], ["--logging_steps", "5"]])
def test_verbs_that_log_no_metrics_refuse_the_logging_flags(verb, flag):
    """bench --report-to tensorboard logged nothing anywhere (a row's metrics are its results line),
    and estimate, plan, maxbatch and flops took the flags too: refused, not dropped."""
    _, extra = build_parser().parse_known_args([verb, *flag])  # the CLI refuses what is left over
    assert extra[:1] == flag[:1]


def test_no_parser_takes_abbreviations():
    import argparse

    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert parser.allow_abbrev is False
    for name, sub in subs.choices.items():
        assert sub.allow_abbrev is False, name
        if any(a.required for a in sub._actions):
            continue  # a verb with a required argument refuses the bare option for that reason too
        args, extra = sub.parse_known_args(["--verbos"], namespace=argparse.Namespace())
        assert extra == ["--verbos"] and not getattr(args, "verbose", False), name


@pytest.mark.parametrize("flag, shown", [
    ("--dropout 0.3", "--dropout 0.3"), ("--d-model 256", "--d-model 256"), ("--n-layers 7", "--n-layers 7"),
])
def test_a_model_flag_the_model_overrides_is_refused_not_ignored(flag, shown, capsys):
    """A transformers --model sets its shape and attention dropout from its config.json: a flag
    that would be dropped (tiny-gpt2: dropout 0, width 128, 4 layers) is refused in one line."""
    assert main(["estimate", "--model", "tiny-gpt2", "--seq-len", "32", *flag.split()]) == 2
    err = _error_line(capsys)
    assert shown in err and "tiny-gpt2" in err


def test_a_model_flag_equal_to_the_models_own_value_passes():
    """A config file written for the model (its own values) is no conflict."""
    own = _cfg(["estimate", "--model", "tiny-gpt2", "--seq-len", "32"]).model
    cfg = _cfg(["estimate", "--model", "tiny-gpt2", "--seq-len", "32", "--d-model", str(own.d_model),
                "--dropout", str(own.dropout)])
    assert cfg.model.d_model == own.d_model


def test_the_fewer_lora_targets_hint_names_modules_the_model_has(tmp_path, capsys):
    """The hint said --lora-targets q_proj,v_proj for every model; GPT-2 has none (its q/k/v are
    one Conv1D, c_attn), so following it failed. It names the family's own modules now."""
    transformers = pytest.importorskip("transformers")
    transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=1000, n_positions=64,
                            bos_token_id=0, eos_token_id=0).save_pretrained(tmp_path)
    flags = ["estimate", "--model", str(tmp_path), "--lora-rank", "4", "--seq-len", "32", "--device", "cpu"]
    assert main(flags) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("defaults used: "))
    assert "--lora-targets c_attn for fewer" in line and "q_proj" not in line, line
    assert main([*flags, "--lora-targets", "c_attn"]) == 0  # the hint, followed, runs
    assert main(["estimate", "--model", "tiny-llama", "--lora-rank", "4", "--device", "cpu"]) == 0
    assert "--lora-targets q_proj,v_proj for fewer" in capsys.readouterr().out


def test_the_fewer_lora_targets_are_pefts_defaults_for_the_family():
    pytest.importorskip("peft")
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT

    from memtrain.models.spec import FEWER_LORA_TARGETS

    for model_type, targets in FEWER_LORA_TARGETS.items():
        if PEFT.get(model_type) is not None:  # peft does not list phi3
            assert targets.split(",") == list(PEFT[model_type]), model_type


# ------------------------------------------------------------------------ 6. what a run records
def test_a_transformers_run_records_the_lora_targets_it_trained(small_corpus, tmp_path, one_thread):
    """Our GPT's default target list means peft's all-linear on a transformers model: result.json and
    the checkpoint record all-linear, the modules that got adapters, not our GPT's names."""
    out = tmp_path / "run"
    assert main(["train", "--model", "tiny-llama", "--data", str(small_corpus), "--lora-rank", "2", "--steps", "1",
                 "--batch-size", "1", "--seq-len", "16", "--val-blocks", "1", "--no-progress", "--out", str(out),
                 "--save", str(out / "ckpt.pt")]) == 0
    assert json.loads((out / "result.json").read_text())["config"]["technique"]["lora_targets"] == "all-linear"
    from memtrain.training.resume_check import saved_run

    assert saved_run(str(out / "ckpt.pt"))[0]["technique"]["lora_targets"] == "all-linear"
    # Our GPT's own default, a named list and a run without LoRA are recorded as they were.
    assert build_config({"lora_rank": 2}).technique.lora_targets == "qkv,proj,fc,fc_out"
    assert build_config({"model": "tiny-llama", "lora_rank": 2, "lora_targets": "q_proj"}).technique.lora_targets \
        == "q_proj"
    assert build_config({"model": "tiny-llama"}).technique.lora_targets == "qkv,proj,fc,fc_out"


def test_a_run_saved_with_the_gpt_default_targets_resumes_as_all_linear():
    from memtrain.training.resume_check import config_differences

    now = build_config({"model": "tiny-llama", "lora_rank": 2}).to_dict()
    saved = {**now, "technique": {**now["technique"], "lora_targets": "qkv,proj,fc,fc_out"}}
    assert config_differences(saved, now) == []
    named = {**now, "technique": {**now["technique"], "lora_targets": "q_proj"}}
    assert config_differences(named, now) == ["lora_targets: 'q_proj' -> 'all-linear'"]


def test_the_trainers_adam_options_map_or_are_refused_in_one_line(capsys):
    """--adam_beta1/--adam_beta2 set the betas; --adam_epsilon at the Trainer's default is memtrain's
    eps, and another eps, which memtrain cannot set, is refused instead of trained with 1e-8."""
    t = _cfg(["train", "--adam_beta1", "0.8", "--adam_beta2", "0.999", "--adam_epsilon", "1e-8"]).train
    assert (t.beta1, t.beta2) == (0.8, 0.999)
    assert build_config({"adam_beta2": 0.99, "adam_epsilon": 1e-8}).train.beta2 == 0.99
    assert main(["train", "--adam_epsilon", "1e-6"]) == 2
    assert "--adam_epsilon 1e-6: memtrain's AdamW uses eps 1e-8" in _error_line(capsys)
    assert main(["train", "--adam_beta2", "0.9", "--beta2", "0.95"]) == 2  # two values for one setting
    assert "beta2" in _error_line(capsys)


@pytest.mark.parametrize("optim, precision", [("adamw", "fp32"), ("adamw-8bit", "fp32"), ("adamw", "bf16-pure")])
def test_every_adamw_memtrain_builds_uses_the_eps_adam_epsilon_accepts(optim, precision):
    """--adam_epsilon is accepted at ADAM_EPSILON only because every AdamW memtrain builds (torch's,
    torchao's 8-bit, bf16-pure's stochastic rounding) uses it; a builder passing another eps would
    make the accepted flag a lie."""
    import torch

    from memtrain.techniques.facts import ADAM_EPSILON
    from memtrain.techniques.optim import build_optimizer

    if optim != "adamw" or precision == "bf16-pure":
        pytest.importorskip("torchao")  # low-bit and bf16-pure optimizers come from torchao
    cfg = build_config({"optim": optim, "precision": precision})
    model = torch.nn.Linear(64, 64).to(torch.bfloat16 if precision == "bf16-pure" else torch.float32)
    opt = build_optimizer(model, cfg.technique, cfg.train)
    assert {g["eps"] for g in opt.param_groups} == {ADAM_EPSILON}
