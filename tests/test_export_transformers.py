"""Export and generate for transformers models trained by memtrain, and for hostile inputs.

A transformers --model checkpoint exports as its own architecture (LoRA merged, or a peft
adapter with --adapter-only; QLoRA's NF4 base dequantized) with logits equal to memtrain's
model; generate samples from the checkpoint and from the export alike. No corrupt or hostile
folder or file given to generate/export gets past one `error:` line and exit 2, and none runs
the code it ships.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import test_hf_models as hf_models  # noqa: E402
import test_hub_access as hub_tests  # noqa: E402
from memtrain.cli import main  # noqa: E402
from memtrain.config.run import build_config  # noqa: E402
from tiny_families import FAMILIES, tiny_config  # noqa: E402

VOCAB, make_model_dir = hf_models.VOCAB, hf_models.make_model_dir
tokenizer_files, corpus = hf_models.tokenizer_files, hf_models.corpus  # the tiny models' fixtures
hub_cache, no_offline_env = hub_tests.hub_cache, hub_tests.no_offline_env  # an offline Hub with a local cache

pytestmark = pytest.mark.usefixtures("one_thread")

TRAIN = ["--steps", "3", "--batch-size", "2", "--seq-len", "32", "--val-blocks", "1", "--warmup-steps", "0",
         "--lr", "1e-2", "--attention", "sdpa", "--no-progress"]


def _one_error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error:") and "Traceback" not in err
    return lines[0]


def _train(model_dir: Path, corpus_path: Path, tmp_path: Path, *extra: str) -> Path:
    ckpt = tmp_path / "run" / "ck.pt"
    assert main(["train", "--model", str(model_dir), "--data", str(corpus_path), *TRAIN,
                 "--out", str(tmp_path / "run"), "--save", str(ckpt), *extra]) == 0
    return ckpt


def _tokens(vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0))


def _memtrain_logits(ckpt: Path, idx: torch.Tensor) -> torch.Tensor:
    """The logits of the model as trained: adapters unmerged, through memtrain's own wrapper."""
    from memtrain.inference.export import load_trained

    ours, _ = load_trained(ckpt, merge=False)
    with torch.no_grad():
        return ours(idx)


@pytest.fixture(scope="module")
def pretrained_llama(tmp_path_factory, tokenizer_files) -> Path:
    """A tiny Llama folder with weights and tokenizer, as a user would bring it."""
    return make_model_dir(tmp_path_factory.mktemp("pretrained"), "llama", tokenizer_files, weights=True)


@pytest.fixture(scope="module")
def scratch_llama(tmp_path_factory, tokenizer_files) -> Path:
    """A tiny Llama config with a tokenizer and no weights (trained from random weights)."""
    return make_model_dir(tmp_path_factory.mktemp("scratch"), "llama", tokenizer_files)


# --------------------------------------------------------------------------- export: equal logits
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_transformers_checkpoint_exports_with_equal_logits_and_generates(scratch_llama, corpus, tmp_path, capsys, lora):
    ckpt = _train(scratch_llama, corpus, tmp_path, *(["--lora-rank", "4"] if lora else []))
    if lora:
        state = torch.load(ckpt, weights_only=True)["model"]
        assert any("lora_B" in k and v.abs().sum() > 0 for k, v in state.items())  # the adapters did learn
    out = tmp_path / "hf"
    capsys.readouterr()
    assert main(["export", str(ckpt), str(out)]) == 0
    said = capsys.readouterr()
    assert "LlamaForCausalLM" in said.out and ("LoRA merged" in said.out) == lora and said.err == ""
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(hf).__name__ == "LlamaForCausalLM" and not any("lora" in n for n, _ in hf.named_parameters())
    idx = _tokens()
    with torch.no_grad():
        theirs = hf(idx).logits
    ours = _memtrain_logits(ckpt, idx)
    assert ours.shape == theirs.shape == (2, 24, VOCAB)
    assert (ours - theirs).abs().max().item() < 1e-5
    # The model's own tokenizer went along: the same ids as the folder it was trained with.
    text = "memory gradient tensor"
    assert (transformers.AutoTokenizer.from_pretrained(str(out))(text)["input_ids"]
            == transformers.AutoTokenizer.from_pretrained(str(scratch_llama))(text)["input_ids"])
    args = ["--prompt", "memory", "--max-new-tokens", "6", "--seed", "5"]
    assert main(["generate", str(ckpt), *args]) == 0
    from_ckpt = capsys.readouterr().out
    assert main(["generate", str(out), *args]) == 0
    assert capsys.readouterr().out == from_ckpt and from_ckpt.startswith("memory") and len(from_ckpt) > len("memory\n")


def test_gemma2_trains_exports_and_generates_with_the_defaults(tmp_path, tokenizer_files, corpus, capsys):
    """Gemma-2, which transformers builds with eager attention only, goes through the day without an
    --attention flag: trained, exported with equal logits, and sampled from its export as from its
    checkpoint."""
    d = hf_models._gemma2_dir(tmp_path)
    for f in tokenizer_files.iterdir():
        shutil.copy(f, d / f.name)
    ckpt = tmp_path / "run" / "ck.pt"
    flags = [a for a in TRAIN if a not in ("--attention", "sdpa")]
    assert main(["train", "--model", str(d), "--data", str(corpus), *flags, "--lora-rank", "2",
                 "--out", str(tmp_path / "run"), "--save", str(ckpt)]) == 0
    out = tmp_path / "hf"
    assert main(["export", str(ckpt), str(out)]) == 0
    idx = _tokens()
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()(idx).logits
    assert (_memtrain_logits(ckpt, idx) - theirs).abs().max().item() < 1e-5
    args = ["--prompt", "memory", "--max-new-tokens", "4", "--seed", "5"]
    capsys.readouterr()
    assert main(["generate", str(ckpt), *args]) == 0
    from_ckpt = capsys.readouterr().out
    assert main(["generate", str(out), *args]) == 0
    assert capsys.readouterr().out == from_ckpt and from_ckpt.startswith("memory")


def test_a_mixture_of_experts_lora_run_exports_merged_with_equal_logits(tmp_path, tokenizer_files, corpus):
    """LoRA on a mixture-of-experts model (transformers' Mixtral: each layer's experts are stacked
    tensors, which peft adapts with one ParamWrapper nested in another) trained, then its export
    failed after the run: exit 1, "'MixtralExperts' object has no attribute 'weight'". Every
    adapter is merged now, the experts' included: the export's logits are memtrain's."""
    d = tmp_path / "mixtral"
    config = transformers.MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=128, vocab_size=VOCAB,
                                        num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(d)
    for f in tokenizer_files.iterdir():
        shutil.copy(f, d / f.name)
    ckpt = _train(d, corpus, tmp_path, "--lora-rank", "2")
    state = torch.load(ckpt, weights_only=True)["model"]
    assert any(".experts." in k and "lora_B" in k and v.abs().sum() > 0 for k, v in state.items())  # experts learned
    out = tmp_path / "hf"
    assert main(["export", str(ckpt), str(out)]) == 0
    idx = _tokens()
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()(idx).logits
        base = transformers.AutoModelForCausalLM.from_pretrained(str(d)).eval()(idx).logits
    ours = _memtrain_logits(ckpt, idx)
    assert (ours - theirs).abs().max().item() < 1e-5
    assert (ours - base).abs().max().item() > 1e-3  # the merged adapters changed the model

def test_an_export_keeps_the_folders_generation_settings_with_the_kv_cache_on(pretrained_llama, scratch_llama,
                                                                            corpus, tmp_path):
    """The export's generation_config.json is the --model folder's own (eos tokens, sampling
    defaults), or the one its config gives; never the training build's use_cache=False, which
    would make transformers' generate recompute every step without a KV cache."""
    d = tmp_path / "brought"
    shutil.copytree(pretrained_llama, d)
    transformers.GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9, eos_token_id=[2, 7],
                                  bos_token_id=1).save_pretrained(d)
    for model_dir, name in ((d, "brought"), (scratch_llama, "scratch")):
        ckpt = _train(model_dir, corpus, tmp_path / name, "--lora-rank", "2")
        assert main(["export", str(ckpt), str(tmp_path / name / "hf")]) == 0
        generation = transformers.GenerationConfig.from_pretrained(str(tmp_path / name / "hf"))
        assert generation.use_cache is True
        if model_dir == d:
            assert (generation.temperature, generation.top_p, generation.eos_token_id) == (0.6, 0.9, [2, 7])


def test_an_export_of_a_cached_hub_model_carries_the_repositorys_generation_settings(hub_cache, tokenizer_files,
                                                                                    corpus, tmp_path_factory):
    """``export`` of a run on ``hf:ORG/NAME`` wrote generation settings derived from config.json,
    never the repository's own ``generation_config.json`` (its eos tokens, sampling defaults),
    which a folder's export carries: read from the (offline) Hugging Face cache now. A cached
    repository without one still exports the settings its config gives."""
    folder = make_model_dir(tmp_path_factory.mktemp("brought"), "llama", tokenizer_files, weights=True)
    files: dict[str, Any] = {f.name: f.read_bytes() for f in folder.iterdir()}
    generation = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "eos_token_id": [2, 7], "bos_token_id": 1}
    hub_tests._cached_repo(hub_cache, "withgen", {**files, "generation_config.json": generation})
    hub_tests._cached_repo(hub_cache, "nogen", files)
    runs = tmp_path_factory.mktemp("hubruns")
    for name in ("withgen", "nogen"):
        ckpt = runs / name / "ck.pt"
        assert main(["train", "--model", f"hf:memtrain-test/{name}", "--data", str(corpus), "--steps", "1",
                     "--batch-size", "2", "--seq-len", "16", "--val-blocks", "1", "--warmup-steps", "0",
                     "--lora-rank", "2", "--no-progress", "--out", str(runs / name), "--save", str(ckpt)]) == 0
        assert main(["export", str(ckpt), str(runs / name / "hf")]) == 0
        written = transformers.GenerationConfig.from_pretrained(str(runs / name / "hf"))
        assert written.use_cache is True
        if name == "withgen":
            assert (written.temperature, written.top_p, written.eos_token_id, written.do_sample) == (0.6, 0.9, [2, 7],
                                                                                                    True)
        else:
            assert written.temperature in (None, 1.0) and not written.do_sample


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_build_for_a_checkpoints_weights_draws_nothing_and_keeps_ties_and_buffers(tmp_path, family):
    """Export and generate build a checkpoint's model uninitialized (every weight is loaded after):
    no random number is drawn, the head is tied as in an initialized build, every buffer
    (rope's inv_freq, GPT-2's causal mask) is the initialized build's, and once the weights are
    loaded the logits are equal."""
    from memtrain.models.hf import build_hf_model

    folder = tmp_path / family
    tiny_config(family, 2).save_pretrained(folder)
    cfg = build_config({"model": str(folder), "seq_len": 16})
    built = build_hf_model(cfg, with_weights=False)
    rng = torch.get_rng_state()
    bare = build_hf_model(cfg, with_weights=False, initialize=False)
    assert torch.equal(torch.get_rng_state(), rng)  # nothing drawn
    assert [n for n, _ in bare.named_parameters()] == [n for n, _ in built.named_parameters()]  # the same ties
    buffers = dict(built.named_buffers())
    assert {n: b for n, b in bare.named_buffers()}.keys() == buffers.keys()
    for name, buffer in bare.named_buffers():
        assert torch.equal(buffer, buffers[name]), name
    bare.load_state_dict(built.state_dict())
    idx = torch.randint(0, 384, (1, 12))
    with torch.no_grad():
        assert torch.equal(bare.eval()(idx), built.eval()(idx))


def test_model_without_tokenizer_exports_gpt2_tokenizer(tmp_path_factory, corpus, tmp_path, capsys):
    d = make_model_dir(tmp_path_factory.mktemp("notok"), "llama", None, vocab_size=50304)
    ckpt = _train(d, corpus, tmp_path, "--steps", "1")
    out = tmp_path / "hf"
    assert main(["export", str(ckpt), str(out)]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok("Hello world")["input_ids"] == [15496, 995]  # GPT-2's BPE, as the data was read
    idx = _tokens(50304)
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()(idx).logits
    assert (_memtrain_logits(ckpt, idx) - theirs).abs().max().item() < 1e-5
    capsys.readouterr()
    assert main(["generate", str(out), "--prompt", "Hello", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("Hello")


def test_adapter_only_loads_with_peft_onto_the_base(pretrained_llama, corpus, tmp_path, capsys):
    peft = pytest.importorskip("peft")
    ckpt = _train(pretrained_llama, corpus, tmp_path, "--lora-rank", "4")
    out = tmp_path / "adapter"
    assert main(["export", str(ckpt), str(out), "--adapter-only"]) == 0
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in out.iterdir()}
    assert not (out / "model.safetensors").exists()  # the adapter only, not the base
    base = transformers.AutoModelForCausalLM.from_pretrained(str(pretrained_llama)).eval()
    idx = _tokens()
    with torch.no_grad():
        before = base(idx).logits
        adapted = peft.PeftModel.from_pretrained(base, str(out)).eval()(idx).logits
    ours = _memtrain_logits(ckpt, idx)
    assert (ours - adapted).abs().max().item() < 1e-5
    assert (ours - before).abs().max().item() > 1e-3  # the adapter changes the model: the check has teeth
    capsys.readouterr()
    # An adapter is no model to sample from: generate says what to give it instead.
    assert main(["generate", str(out), "--prompt", "Hello", "--seed", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "LoRA adapter" in err and "without --adapter-only" in err


def test_adapter_config_is_written_as_peft_writes_one_and_the_same_every_time(pretrained_llama, corpus, tmp_path):
    """peft's save_pretrained writes inference_mode true; export wrote the live training config's
    false, and its target_modules in set order, so two exports of one checkpoint differed. The
    fields now read as peft's own save of the same LoraConfig, the module list sorted."""
    peft = pytest.importorskip("peft")
    ckpt = _train(pretrained_llama, corpus, tmp_path, "--lora-rank", "4")
    ours = []
    for name in ("a", "b"):
        assert main(["export", str(ckpt), str(tmp_path / name), "--adapter-only"]) == 0
        ours.append(json.loads((tmp_path / name / "adapter_config.json").read_text()))
    base = transformers.AutoModelForCausalLM.from_pretrained(str(pretrained_llama))
    theirs_dir = tmp_path / "peft"
    peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=16, target_modules="all-linear",
                                              task_type="CAUSAL_LM")).save_pretrained(str(theirs_dir))
    theirs = json.loads((theirs_dir / "adapter_config.json").read_text())
    assert ours[0]["inference_mode"] is theirs["inference_mode"] is True
    assert set(ours[0]["target_modules"]) == set(theirs["target_modules"])
    assert ours[0]["target_modules"] == sorted(ours[0]["target_modules"])
    assert ours[0] == ours[1]
    # What PeftModel.from_pretrained(base, DIR) reads: the rank, the scale, the task and the base.
    for key in ("r", "lora_alpha", "task_type", "peft_type", "base_model_name_or_path"):
        assert ours[0][key] == theirs[key], key


def test_adapter_only_is_refused_where_it_cannot_be_used(pretrained_llama, scratch_llama, corpus, tmp_path, capsys):
    peft_free = _train(pretrained_llama, corpus, tmp_path / "a", "--steps", "1")
    scratch = _train(scratch_llama, corpus, tmp_path / "b", "--steps", "1", "--lora-rank", "4")
    changed_dir = tmp_path / "changed"
    shutil.copytree(pretrained_llama, changed_dir)
    changed = _train(changed_dir, corpus, tmp_path / "c", "--steps", "1", "--lora-rank", "4")
    base = transformers.AutoModelForCausalLM.from_pretrained(str(changed_dir))
    with torch.no_grad():
        base.model.layers[0].mlp.up_proj.weight.add_(1.0)
    base.save_pretrained(str(changed_dir))  # the base folder no longer holds the weights trained on
    capsys.readouterr()
    for ckpt, words in [(peft_free, "is not one"), (scratch, "random initial weights"), (changed, "differs")]:
        assert main(["export", str(ckpt), str(tmp_path / "out"), "--adapter-only"]) == 2, words
        assert words in _one_error_line(capsys.readouterr().err)
        assert not (tmp_path / "out").exists()


def test_qlora_checkpoint_exports_dequantized_and_merged(tmp_path_factory, tokenizer_files, corpus, tmp_path, capsys):
    """NF4 base weights (torchao, CPU) are dequantized and the adapters merged: the export's
    logits are those of the quantized model memtrain trained."""
    pytest.importorskip("torchao")
    from memtrain.inference.export import read_checkpoint
    from memtrain.models import build_model
    from memtrain.models.qlora import quantize_base_weights
    from memtrain.techniques.hf_mapping import apply_hf_lora

    d = make_model_dir(tmp_path_factory.mktemp("q"), "llama", tokenizer_files, hidden_size=128,
                       intermediate_size=256, num_key_value_heads=4)
    ckpt = _train(d, corpus, tmp_path, "--lora-rank", "4", "--qlora")
    out = tmp_path / "hf"
    assert main(["export", str(ckpt), str(out)]) == 0
    state, cfg = read_checkpoint(ckpt)
    trained = build_model(cfg, with_weights=False)
    apply_hf_lora(trained, cfg.technique)
    assert quantize_base_weights(trained, torch.device("cpu")) == 0
    trained.load_state_dict(state["model"])  # as --resume does: NF4 base weights, FP32 adapters
    idx = _tokens()
    with torch.no_grad():
        ours = trained.eval()(idx)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()(idx).logits
    assert (ours - theirs).abs().max().item() < 1e-5


def _adapter_on_full_base_and_merged_logits(peft, base_dir: Path, adapter: Path, merged: Path):
    """Logits of the exported adapter on the base folder loaded in full precision, and of the merged export."""
    idx = _tokens()
    with torch.no_grad():
        base = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir)).eval()
        on_full_base = peft.PeftModel.from_pretrained(base, str(adapter)).eval()(idx).logits
        trained = transformers.AutoModelForCausalLM.from_pretrained(str(merged)).eval()(idx).logits
    return on_full_base, trained


def test_a_qlora_adapter_says_it_was_trained_on_the_nf4_base(tmp_path_factory, tokenizer_files, corpus, tmp_path,
                                                            capsys):
    """A QLoRA run's adapters on the full-precision base are not the trained model (the NF4
    rounding is not there): --adapter-only says so and names the two ways to the trained logits."""
    pytest.importorskip("torchao")
    peft = pytest.importorskip("peft")
    d = make_model_dir(tmp_path_factory.mktemp("qa"), "llama", tokenizer_files, weights=True, hidden_size=128,
                       intermediate_size=256, num_key_value_heads=4)
    ckpt = _train(d, corpus, tmp_path, "--lora-rank", "4", "--qlora")
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    capsys.readouterr()
    assert main(["export", str(ckpt), str(adapter), "--adapter-only"]) == 0
    note = capsys.readouterr().out.splitlines()[-1]
    assert note.startswith("note: these adapters were trained on the base in NF4 (--qlora)") and "load_in_4bit" in note
    assert main(["export", str(ckpt), str(merged)]) == 0
    on_full_base, trained = _adapter_on_full_base_and_merged_logits(peft, d, adapter, merged)
    assert (on_full_base - trained).abs().max().item() > 1e-3  # what the note warns of
    assert main(["export", str(_train(d, corpus, tmp_path / "plain", "--lora-rank", "4")), str(tmp_path / "a2"),
                 "--adapter-only"]) == 0
    assert "NF4" not in capsys.readouterr().out  # a LoRA run's adapter needs no such note


def test_a_qlora_run_that_quantized_nothing_gets_no_nf4_note(tmp_path_factory, tokenizer_files, corpus, tmp_path,
                                                             capsys):
    """A --qlora run on weights too small for NF4's blocks keeps them all in full precision (train
    warns so); its adapters were trained on the base as from_pretrained loads it, yet --adapter-only
    said they were trained on an NF4 base and sent the user to load it in 4 bits."""
    pytest.importorskip("torchao")
    peft = pytest.importorskip("peft")
    d = make_model_dir(tmp_path_factory.mktemp("q0"), "llama", tokenizer_files, weights=True)
    ckpt = _train(d, corpus, tmp_path, "--lora-rank", "4", "--qlora")
    from memtrain.inference.export import quantized_weight_count, read_checkpoint

    assert quantized_weight_count(read_checkpoint(ckpt)[0]["model"]) == 0  # every weight too small for NF4
    capsys.readouterr()
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    assert main(["export", str(ckpt), str(adapter), "--adapter-only"]) == 0
    assert "NF4" not in capsys.readouterr().out
    assert main(["export", str(ckpt), str(merged)]) == 0
    on_full_base, trained = _adapter_on_full_base_and_merged_logits(peft, d, adapter, merged)
    assert (on_full_base - trained).abs().max().item() < 1e-5  # the full-precision base is the trained one


def test_export_refuses_a_busy_destination_and_leaves_nothing_behind(scratch_llama, corpus, tmp_path, capsys):
    ckpt = _train(scratch_llama, corpus, tmp_path, "--steps", "1")
    (tmp_path / "file").write_text("x")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "link").symlink_to(empty, target_is_directory=True)  # the final rename would replace the link
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    capsys.readouterr()
    for dest, words in [(tmp_path / "file", "is a file"), (busy, "not empty"), (tmp_path / "link", "symbolic link"),
                        (tmp_path / "dangling", "symbolic link")]:
        assert main(["export", str(ckpt), str(dest)]) == 2
        assert words in _one_error_line(capsys.readouterr().err)
    assert (busy / "keep.txt").read_text() == "mine" and (tmp_path / "file").read_text() == "x"
    assert (tmp_path / "link").is_symlink() and list(empty.iterdir()) == []
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("meanwhile", ["folder", "file"])
def test_a_destination_made_during_the_export_is_refused_and_kept(tmp_path, meanwhile):
    """Two exports to one new folder: the second's rename met the first's export and said
    `error: OSError: [Errno 39] Directory not empty` (exit 1); it is bad input, and nothing is replaced."""
    from memtrain.config.run import ConfigError
    from memtrain.inference.export import _new_directory

    out = tmp_path / "out"
    with pytest.raises(ConfigError, match="was created while exporting"):
        with _new_directory(out) as tmp:
            (tmp / "config.json").write_text("{}")
            if meanwhile == "folder":
                out.mkdir()
                (out / "config.json").write_text("theirs")
            else:
                out.write_text("theirs")
    assert (out / "config.json" if meanwhile == "folder" else out).read_text() == "theirs"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_fresh_process_reads_an_nf4_checkpoint_and_still_refuses_other_classes(tmp_path):
    """torch's restricted unpickler knows torchao's NF4Tensor only once torchao registered it:
    a fresh `memtrain export`/`generate`/`--resume` process refused every CPU QLoRA checkpoint
    ("not a memtrain checkpoint"). The loader imports that one module and retries; a class from
    any other module stays refused, and its module is not imported."""
    pytest.importorskip("torchao")
    from torchao.quantization import to_nf4

    nf4 = tmp_path / "nf4.pt"
    torch.save({"w": to_nf4(torch.randn(256, 256), 64, 256)}, nf4)
    other = tmp_path / "other.pt"
    torch.save({"w": pickle.PicklingError("x")}, other)  # a class the unpickler does not allow
    code = ("import sys; from memtrain.checkpoints.exact import load_plain\n"
            "assert 'torchao' not in sys.modules\n"
            "print(type(load_plain(sys.argv[1])['w']).__name__)\n"
            "try:\n    load_plain(sys.argv[2])\nexcept Exception as e:\n    print(type(e).__name__)\n")
    out = subprocess.run([sys.executable, "-c", code, str(nf4), str(other)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["NF4Tensor", "UnpicklingError"]
    # Where torchao is not installed, the one line says what to install.
    absent = ("import sys; sys.modules['torchao'] = None\n"  # an import of torchao then fails, as if absent
              "from memtrain.checkpoints.exact import read_state\n"
              "try:\n    read_state(__import__('pathlib').Path(sys.argv[1]), 'x')\nexcept Exception as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", absent, str(nf4)], capture_output=True, text=True, timeout=300)
    assert "torchao is not installed: pip install torchao" in out.stdout, out.stdout + out.stderr[-2000:]


# --------------------------------------------------------------------------- remote code is never run
EVIL_CODE = "import pathlib\npathlib.Path({marker!r}).write_text('ran')\nfrom transformers import PretrainedConfig\n" \
            "class EvilConfig(PretrainedConfig):\n    model_type = 'evilgpt'\n"


def _evil_folder(root: Path, marker: Path) -> Path:
    d = root / "evil"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "model_type": "evilgpt", "architectures": ["EvilModel"],
        "auto_map": {"AutoConfig": "configuration_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilModel"}}))
    for name in ("configuration_evil.py", "modeling_evil.py"):
        (d / name).write_text(EVIL_CODE.format(marker=str(marker)))
    return d


def _cli(args: list[str], tmp_path: Path, stdin: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEMTRAIN_CACHE": str(tmp_path / "cache")}
    return subprocess.run([sys.executable, "-m", "memtrain", *args], input=stdin, capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)


def test_generate_never_prompts_for_nor_runs_a_folders_code(tmp_path):
    """transformers asks "run the custom code? [y/N]" when trust_remote_code is left unset:
    a "y" on stdin must change nothing."""
    marker = tmp_path / "ran"
    evil = _evil_folder(tmp_path, marker)
    proc = _cli(["generate", str(evil), "--max-new-tokens", "2"], tmp_path, stdin="y\ny\ny\n")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "auto_map" in _one_error_line(proc.stderr)
    assert "[y/N]" not in proc.stdout + proc.stderr
    assert not marker.exists()


def test_no_verb_reads_a_folders_code(tmp_path, corpus, capsys):
    """The siblings: train and estimate with --model, and export of a checkpoint whose run named the folder."""
    marker = tmp_path / "ran"
    evil = _evil_folder(tmp_path, marker)
    for argv in (["train", "--model", str(evil), "--data", str(corpus), "--out", str(tmp_path / "o")],
                 ["estimate", "--model", str(evil)]):
        assert main(argv) == 2
        assert "auto_map" in _one_error_line(capsys.readouterr().err)
    crafted = tmp_path / "crafted.pt"
    torch.save({"model": {}, "config": {"model": {"model": str(evil)}}}, crafted)
    for argv in (["export", str(crafted), str(tmp_path / "out")], ["generate", str(crafted)]):
        assert main(argv) == 2
        assert "auto_map" in _one_error_line(capsys.readouterr().err)
    assert not marker.exists() and not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- corrupt folders: exit 2, one line
def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value))


def _edit_config(d: Path, **changes: object) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    _write_json(d / "config.json", cfg)


def _edit_weights(d: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(d / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})


def _edit_header(d: Path, edit) -> None:
    """Rewrite model.safetensors' JSON header through ``edit(header, first_tensor_name)``, the
    tensor bytes kept: a header that lies about what the bytes hold."""
    raw = (d / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    edit(header, next(k for k in header if k != "__metadata__"))
    text = json.dumps(header).encode()
    (d / "model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])


def _overlap(header: dict, first: str) -> None:
    second = next(k for k in header if k not in ("__metadata__", first))
    header[second]["data_offsets"] = header[first]["data_offsets"]


def _replace_with_dir(path: Path) -> None:
    path.unlink()
    path.mkdir()


CORRUPT_FOLDERS = {
    "empty-folder": lambda d: [p.unlink() for p in d.iterdir()],
    "no-config": lambda d: (d / "config.json").unlink(),
    "config-not-json": lambda d: (d / "config.json").write_text("{not json"),
    "config-binary": lambda d: (d / "config.json").write_bytes(b"\xff\xfe\x00garbage"),
    "config-is-a-list": lambda d: _write_json(d / "config.json", [1, 2, 3]),
    "config-is-a-folder": lambda d: _replace_with_dir(d / "config.json"),
    "config-no-model-type": lambda d: _write_json(d / "config.json", {"hidden_size": 64}),
    "model-type-not-text": lambda d: _edit_config(d, model_type=7),
    "model-type-unknown": lambda d: _edit_config(d, model_type="nosuchmodel"),
    "auto-map": lambda d: _edit_config(d, auto_map={"AutoModelForCausalLM": "modeling.Evil"}),
    "size-is-text": lambda d: _edit_config(d, hidden_size="big"),
    "layers-is-a-list": lambda d: _edit_config(d, num_hidden_layers=[2]),
    "vocab-negative": lambda d: _edit_config(d, vocab_size=-5),
    "positions-is-text": lambda d: _edit_config(d, max_position_embeddings="many"),
    "weights-truncated": lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:300]),
    "weights-garbage": lambda d: (d / "model.safetensors").write_bytes(os.urandom(4096)),
    "weights-empty": lambda d: (d / "model.safetensors").write_bytes(b""),
    "weights-a-folder": lambda d: _replace_with_dir(d / "model.safetensors"),
    # safetensors' header checked before any byte is mapped: a 2 GiB header length, shapes whose
    # size overflows, offsets past the end or shared by two tensors, a dtype that does not exist
    "header-length-2gib": lambda d: (d / "model.safetensors").write_bytes((2 << 30).to_bytes(8, "little") + b"{}"),
    "header-huge-shape": lambda d: _edit_header(d, lambda h, k: h[k].update(shape=[2**31, 2**31, 2**31])),
    "header-offset-past-end": lambda d: _edit_header(d, lambda h, k: h[k].update(data_offsets=[0, 2**62])),
    "header-offsets-overlap": lambda d: _edit_header(d, _overlap),
    "header-unknown-dtype": lambda d: _edit_header(d, lambda h, k: h[k].update(dtype="F99")),
    "weights-shape-mismatch": lambda d: _edit_weights(d, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)})),
    "weights-missing-tensor": lambda d: _edit_weights(d, lambda t: t.pop("model.layers.0.mlp.up_proj.weight")),
    "weights-absent": lambda d: (d / "model.safetensors").unlink(),
    "pickle-only": lambda d: ((d / "model.safetensors").unlink(), torch.save({}, d / "pytorch_model.bin")),
    "shard-index-without-shards": lambda d: ((d / "model.safetensors").unlink(), _write_json(
        d / "model.safetensors.index.json", {"metadata": {}, "weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}})),
    "tokenizer-garbage": lambda d: (d / "tokenizer.json").write_text("{garbage"),
    "tokenizer-wrong-shape": lambda d: _write_json(d / "tokenizer.json", {"model": 5}),
    "tokenizer-config-garbage": lambda d: (d / "tokenizer_config.json").write_text("[[["),
    "tokenizer-config-auto-map": lambda d: _write_json(d / "tokenizer_config.json", {"auto_map": {"AutoTokenizer": ["t.T", None]}}),
    "tokenizer-larger-than-vocab": lambda d: _edit_config(d, vocab_size=8),
}


@pytest.fixture(scope="module")
def good_folder(pretrained_llama) -> Path:
    return pretrained_llama


def test_a_model_folder_whose_path_is_not_utf8_is_named_as_such_and_a_link_to_it_works(good_folder, tmp_path, capsys):
    """safetensors reads UTF-8 paths only: a sound folder named with a byte that is not UTF-8 was
    refused as weights that "must be complete and belong to its config.json". The line names the
    path; a link with a UTF-8 name to the same folder samples."""
    d = Path(os.fsdecode(bytes(tmp_path) + b"/model\xff"))
    shutil.copytree(good_folder, d)
    capsys.readouterr()
    assert main(["generate", str(d), "--prompt", "memory", "--max-new-tokens", "2"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "its path is not UTF-8" in line and "give it through a link with a UTF-8 name" in line
    (tmp_path / "link").symlink_to(d, target_is_directory=True)
    assert main(["generate", str(tmp_path / "link"), "--prompt", "memory", "--max-new-tokens", "2"]) == 0


@pytest.mark.parametrize("name", list(CORRUPT_FOLDERS))
def test_generate_refuses_each_corrupt_folder_with_one_line(good_folder, tmp_path, capsys, name):
    d = tmp_path / "model"
    shutil.copytree(good_folder, d)
    CORRUPT_FOLDERS[name](d)
    capsys.readouterr()
    assert main(["generate", str(d), "--max-new-tokens", "2"]) == 2
    _one_error_line(capsys.readouterr().err)


def test_the_good_folder_generates(good_folder, capsys):
    """The folder the corrupt ones are made from is fine: each refusal is its corruption's."""
    assert main(["generate", str(good_folder), "--prompt", "memory", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("memory")


def test_every_sample_runs_its_new_tokens_past_the_models_eos(good_folder, tmp_path):
    """generate samples ``--max-new-tokens`` tokens whatever the model's eos (what estimate --mode
    inference models): transformers fills the eos that memtrain's settings leave unset from the
    folder's config, and stopped a sample that drew it, padding the rest. Here every logit is zero
    and the eos is token 0, which greedy sampling picks at every step."""
    from memtrain.inference.generate import generate, load_for_sampling

    d = tmp_path / "model"
    shutil.copytree(good_folder, d)
    _edit_weights(d, lambda t: t.update({k: torch.zeros_like(v) for k, v in t.items() if k == "lm_head.weight"}))
    _edit_config(d, eos_token_id=0)
    if (d / "generation_config.json").exists():
        generation = json.loads((d / "generation_config.json").read_text())
        _write_json(d / "generation_config.json", {**generation, "eos_token_id": 0})
    _, codec, _ = load_for_sampling(d, torch.float32)
    texts = generate(d, "memory", 6, 0.0, 0, 2, 7, "cpu")
    assert texts == [codec.decode([0] * 6)] * 2  # was one eos, then five pad tokens


def test_a_folders_generation_settings_never_change_what_is_sampled(good_folder, tmp_path):
    """generate samples with the command line's settings only (module docstring): transformers
    filled every setting they leave at its default from the folder's generation_config.json, so a
    repetition_penalty or top_p there (Qwen's has both) changed the text, and a num_beams of 0 ended
    in ZeroDivisionError (exit 1)."""
    from memtrain.inference.generate import generate

    d = tmp_path / "model"
    shutil.copytree(good_folder, d)
    plain = [generate(d, "memory memory", 6, temperature, 50, 2, 7, "cpu") for temperature in (0.0, 0.8)]
    _write_json(d / "generation_config.json", {"repetition_penalty": 50.0, "no_repeat_ngram_size": 1,
                                               "top_p": 0.01, "num_beams": 3})
    assert [generate(d, "memory memory", 6, temperature, 50, 2, 7, "cpu") for temperature in (0.0, 0.8)] == plain
    _write_json(d / "generation_config.json", {"num_beams": 0})
    assert generate(d, "memory memory", 6, 0.0, 50, 2, 7, "cpu") == plain[0]


def _checkpoint_of(tmp_path: Path, model: dict, config: dict) -> Path:
    p = tmp_path / "crafted.pt"
    torch.save({"model": model, "config": config}, p)
    return p


TINY_LLAMA = {"model": {"model": "tiny-llama"}, "train": {"seq_len": 64}}
NORM = "lm.model.norm.weight"  # the tensor each crafted checkpoint changes


def _weights_with(tmp_path: Path, change) -> Path:
    """A checkpoint of tiny-llama whose weights all fit, ``change`` made to them (a crafted
    file: each tensor it puts there loaded into the model and failed later, exit 1)."""
    from memtrain.models.hf import build_hf_model

    weights = dict(build_hf_model(build_config(TINY_LLAMA), with_weights=False).state_dict())
    change(weights)
    return _checkpoint_of(tmp_path, weights, TINY_LLAMA)


CORRUPT_CHECKPOINTS = {
    "missing": lambda t: t / "none.pt",
    "a-folder": lambda t: t,
    "garbage": lambda t: (t / "g.pt").write_bytes(os.urandom(512)) and t / "g.pt",
    "empty": lambda t: (t / "e.pt").write_bytes(b"") or t / "e.pt",
    "raw-pickle": lambda t: (t / "p.pt").write_bytes(pickle.dumps({"model": {}, "config": {}})) and t / "p.pt",
    "legacy-pickle": lambda t: torch.save({"model": {}, "config": {}}, t / "l.pt", _use_new_zipfile_serialization=False) or t / "l.pt",
    "not-a-dict": lambda t: torch.save([1, 2], t / "n.pt") or t / "n.pt",
    "config-wrong-types": lambda t: _checkpoint_of(t, {}, {"model": {"d_model": "wide"}}),
    "config-not-a-dict": lambda t: _checkpoint_of(t, {}, "gpt"),
    "weights-do-not-fit": lambda t: _checkpoint_of(t, {"wte.weight": torch.zeros(2, 2)}, {}),
    "model-folder-gone": lambda t: _checkpoint_of(t, {}, {"model": {"model": str(t / "gone")}}),
    "weight-float8": lambda t: _weights_with(t, lambda w: w.update({NORM: w[NORM].to(torch.float8_e4m3fn)})),
    "weight-on-meta": lambda t: _weights_with(t, lambda w: w.update({NORM: w[NORM].to("meta")})),
    "weight-sparse": lambda t: _weights_with(t, lambda w: w.update({NORM: w[NORM].to_sparse()})),
    "weight-name-not-a-string": lambda t: _weights_with(t, lambda w: w.update({3: torch.zeros(1)})),
}


@pytest.mark.parametrize("verb", ["export", "generate"])
@pytest.mark.parametrize("name", list(CORRUPT_CHECKPOINTS))
def test_each_corrupt_checkpoint_is_one_line(tmp_path, capsys, name, verb):
    src = tmp_path / "in"
    src.mkdir()
    ckpt = CORRUPT_CHECKPOINTS[name](src)
    argv = ["export", str(ckpt), str(tmp_path / "out")] if verb == "export" else ["generate", str(ckpt)]
    assert main(argv) == 2
    _one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["raw-pickle", "legacy-pickle"])
def test_a_pickle_is_refused_without_torchs_warning(tmp_path, kind):
    """torch's restricted unpickler warns (two lines) about a raw pickle's protocol before it
    refuses the file: only memtrain's error: line may reach stderr."""
    p = tmp_path / "model.pt"
    if kind == "raw-pickle":
        p.write_bytes(pickle.dumps({"model": {}, "config": {}}, protocol=4))
    else:
        torch.save({"model": {}}, p, _use_new_zipfile_serialization=False)
    for args in (["generate", str(p)], ["export", str(p), str(tmp_path / "out")]):
        proc = _cli(args, tmp_path)
        assert proc.returncode == 2, proc.stderr[-2000:]
        _one_error_line(proc.stderr)


# --------------------------------------------------------------------------- one line, whatever the user typed
def test_an_error_echoing_a_newline_stays_one_line(tmp_path, capsys):
    for argv in (["estimate", "--model", "hf:a/b\nc"], ["generate", str(tmp_path / "no\nsuch")],
                 ["export", str(tmp_path / "x\r\n.pt"), str(tmp_path / "o")], ["estimate", "--model", "x\x1b[2Jy"]):
        assert main(argv) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert "\x1b" not in line and "\r" not in line


def test_every_transformers_load_passes_trust_remote_code_false():
    """Every from_pretrained / from_config call in the package says trust_remote_code=False, so
    transformers never asks on stdin whether to run a folder's code."""
    import ast

    import memtrain

    calls = []
    for path in Path(memtrain.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in ("from_pretrained", "from_config"):
                flags = {k.arg: k.value for k in node.keywords}
                safe = isinstance(flags.get("trust_remote_code"), ast.Constant) and flags["trust_remote_code"].value is False
                calls.append((f"{path.name}:{node.lineno}", safe))
    assert len(calls) >= 5  # the config, tokenizer, model (two ways) and generate's config reads
    assert [where for where, safe in calls if not safe] == []


def test_error_lines_escape_control_characters():
    from memtrain.errors import one_line

    assert one_line("a\nb\r\x1b[0m\u2028é") == "a\\nb\\r\\x1b[0m\\u2028é"


# --------------------------------------------------------------------------- generate: device, dtype, fit
def test_generate_reads_a_folder_in_the_asked_dtype_and_samples_as_transformers_does(good_folder, monkeypatch):
    """--dtype bf16: the weights are read in bf16 straight onto the device (not cast or moved after
    a float32 load on the host), and the text is the one transformers' own generate samples from
    the folder loaded in bf16 with the same seed."""
    from memtrain.inference import generate as module
    from memtrain.inference.generate import generate, generation_config, load_for_sampling

    seen: dict = {}
    reads: list = []
    read = module.load_pretrained_lm

    def spy(cfg, dtype, prompt_tokens, device):
        seen.update(dtype=dtype, prompt=prompt_tokens, device=device.type, reads_before=len(reads))

    def reading(*args, **kwargs):
        lm = read(*args, **kwargs)
        reads.append((kwargs["dtype"], kwargs["device"], next(lm.parameters()).dtype, next(lm.parameters()).device))
        return lm

    monkeypatch.setattr(module, "load_pretrained_lm", reading)
    texts = generate(good_folder, "memory", 5, 0.8, 50, 2, 7, "cpu", "bf16", before_sampling=spy)
    assert seen["dtype"] == torch.bfloat16 and seen["device"] == "cpu" and len(texts) == 2
    cpu = torch.device("cpu")
    assert seen["reads_before"] == 0 and reads == [(torch.bfloat16, cpu, torch.bfloat16, cpu)]  # checked, then read once
    hf, codec, _ = load_for_sampling(good_folder, torch.bfloat16)
    ids = codec.encode("memory")
    assert seen["prompt"] == len(ids)
    torch.manual_seed(7)
    x = torch.tensor([ids] * 2)
    hf.generation_config.eos_token_id = None  # memtrain samples past the model's eos (sample_ids)
    with torch.no_grad():
        y = hf.generate(x, attention_mask=torch.ones_like(x), generation_config=generation_config(5, 0.8, 50, codec.start_id))
    assert texts == [codec.decode(row[len(ids):].tolist()) for row in y]


def test_a_sampling_run_that_cannot_fit_is_one_line_before_it_starts(good_folder, capsys, monkeypatch):
    """The estimate of the run is held against the device's memory (here a CPU said to hold
    64 MiB): too many samples is one line naming what to lower; fewer sample."""
    from memtrain.commands import generate as command

    monkeypatch.setattr(command, "free_memory", lambda device, host_available: 64 << 20)
    argv = ["generate", str(good_folder), "--prompt", "memory", "--max-new-tokens", "100"]
    assert main([*argv, "--num-samples", "20000"]) == 2
    captured = capsys.readouterr()
    line = _one_error_line(captured.err)
    assert "20000 samples of a" in line and "more than the 0.06 GiB available on this machine" in line
    assert "lower --num-samples or --max-new-tokens, or --dtype bf16" in line and captured.out == ""
    assert main([*argv, "--num-samples", "2"]) == 0


def _fake_memory(monkeypatch, tmp_path: Path, meminfo: str, cgroup: dict[str, str] | None = None) -> None:
    """Point the host memory readings at crafted kernel files: /proc/meminfo's text, and a
    cgroup v2 folder holding ``cgroup``'s files (none: no cgroup)."""
    from memtrain.training import size_check

    (tmp_path / "meminfo").write_text(meminfo)
    folder = tmp_path / "cgroup"
    folder.mkdir()
    for name, text in (cgroup or {}).items():
        (folder / name).write_text(text)
    monkeypatch.setattr(size_check, "MEMINFO", tmp_path / "meminfo")
    monkeypatch.setattr(size_check, "CGROUP_V2", folder)
    monkeypatch.setattr(size_check, "CGROUP_V1", tmp_path / "no-cgroup-v1")


def test_generate_holds_the_run_against_available_memory_not_the_total(good_folder, tmp_path, capsys, monkeypatch):
    """A host of 1 TiB with 64 MiB available (other processes hold the rest) refuses a run that
    needs more than 64 MiB, naming the available figure; the total let it start and fail in the
    allocator."""
    _fake_memory(monkeypatch, tmp_path, "MemTotal:       1073741824 kB\nMemFree:  1000 kB\n"
                                        "MemAvailable:      65536 kB\n")
    argv = ["generate", str(good_folder), "--prompt", "memory", "--max-new-tokens", "100", "--device", "cpu"]
    assert main([*argv, "--num-samples", "20000"]) == 2
    captured = capsys.readouterr()
    line = _one_error_line(captured.err)
    assert "more than the 0.06 GiB available on this machine" in line and captured.out == ""
    assert "lower --num-samples or --max-new-tokens" in line
    assert main([*argv, "--num-samples", "2"]) == 0


def test_available_memory_takes_the_tighter_of_the_host_and_its_cgroup(tmp_path, monkeypatch):
    """MemAvailable, a cgroup's limit less its usage (its inactive page cache counted free),
    the smaller of the two; the total where no reading is known."""
    from memtrain.training import size_check

    meminfo = "MemTotal: 4194304 kB\nMemAvailable: 2097152 kB\n"  # 4 GiB, 2 GiB available
    _fake_memory(monkeypatch, tmp_path, meminfo, {"memory.max": f"{2**30}\n", "memory.current": f"{900 << 20}\n",
                                                  "memory.stat": f"anon 1\ninactive_file {100 << 20}\n"})
    assert size_check.host_available_bytes() == 2**30 - (900 << 20) + (100 << 20)
    (tmp_path / "cgroup" / "memory.max").write_text("max\n")  # no limit: the host's figure
    assert size_check.host_available_bytes() == 2 * 2**30
    (tmp_path / "meminfo").write_text("garbage\n")
    monkeypatch.setattr(size_check, "host_memory_bytes", lambda: 123)
    assert size_check.host_available_bytes() == 123


def test_running_out_of_memory_past_the_check_is_one_line(good_folder, capsys, monkeypatch):
    """The fit check is a lower bound: an allocation that still fails while sampling (the CPU
    allocator's words) is exit 2 with one line naming the allocation and what to lower."""
    from memtrain.inference import generate as module

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 6587285504 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(module, "load_pretrained_lm", out_of_memory)
    assert main(["generate", str(good_folder), "--prompt", "memory", "--num-samples", "12"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "out of memory sampling 12 x" in line and "tried to allocate 6.13 GiB" in line
    assert "lower --num-samples or --max-new-tokens, or --dtype bf16" in line


def test_the_fit_check_holds_the_estimate_it_names(good_folder):
    """check_fits refuses exactly above estimate --mode inference's peak, and checks nothing
    where the memory is unknown."""
    from memtrain.analysis.estimate.inference import estimate_generate_run
    from memtrain.commands.generate import check_fits
    from memtrain.config.run import ConfigError
    from memtrain.inference.generate import read_folder

    cfg = read_folder(good_folder).cfg
    need = estimate_generate_run(cfg.replace(seq_len=5, batch_size=3), "fp32", None, 40)["peak_bytes"]
    cpu, fp32 = torch.device("cpu"), torch.float32
    check_fits(cfg, fp32, 5, 40, 3, cpu, int(need))
    check_fits(cfg, fp32, 5, 40, 3, cpu, None)
    with pytest.raises(ConfigError, match="3 samples of a 5-token prompt"):
        check_fits(cfg, fp32, 5, 40, 3, cpu, int(need) - 1)
    check_fits(cfg, torch.float64, 5, 40, 3, cpu, 1)  # weights in a dtype the estimate does not model


def test_a_family_the_inference_estimate_does_not_model_samples_with_a_note(tmp_path, tokenizer_files, capsys):
    """generate holds a run against estimate --mode inference before sampling; for a family that
    estimate does not model (Qwen3 here) it sampled unchecked without a word, whatever the
    device's memory. It says so in one note line on stderr, and samples."""
    from memtrain.commands.generate import check_fits
    from memtrain.inference.generate import read_folder

    d = tmp_path / "qwen3"
    transformers.Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=8, vocab_size=VOCAB,
                             max_position_embeddings=64).save_pretrained(d)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(d)).save_pretrained(d)
    for f in tokenizer_files.iterdir():
        shutil.copy(f, d / f.name)
    capsys.readouterr()  # transformers' progress bar of the save
    check_fits(read_folder(d).cfg, torch.float32, 5, 40, 3, torch.device("cpu"), 1)  # 1 byte: unchecked
    assert capsys.readouterr().err == ("note: sampling without the memory check (memtrain estimate --mode inference: "
                                       "no analytic model of qwen3 layers (only llama, qwen2, mistral, phi3, gemma, "
                                       "gpt2))\n")
    assert main(["generate", str(d), "--prompt", "memory", "--max-new-tokens", "2", "--seed", "1"]) == 0
    said = capsys.readouterr()
    assert said.out.startswith("memory") and said.err.startswith("note: sampling without the memory check")

def test_a_folder_that_cannot_fit_reads_no_weight(good_folder, monkeypatch):
    """The fit check of a folder comes before any weight is read: a refused run never loads the
    model (on a GPU, never a byte of it on the device)."""
    from memtrain.config.run import ConfigError
    from memtrain.inference import generate as module

    def refuse(cfg, dtype, prompt_tokens, device):
        raise ConfigError("does not fit")

    def must_not_read(*args, **kwargs):
        raise AssertionError("weights read before the fit check")

    monkeypatch.setattr(module, "load_pretrained_lm", must_not_read)
    with pytest.raises(ConfigError, match="does not fit"):
        module.generate(good_folder, "memory", 5, 0.8, 50, 2, 7, "cpu", "bf16", before_sampling=refuse)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
def test_generate_on_cuda_without_one_is_one_line(good_folder, capsys):
    assert main(["generate", str(good_folder), "--device", "cuda"]) == 2
    assert "no CUDA GPU is visible" in _one_error_line(capsys.readouterr().err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_generate_samples_on_cuda_in_bf16(good_folder, capsys, monkeypatch):
    """A folder's weights are read in bf16 straight onto the GPU (transformers' device_map)."""
    from memtrain.inference import generate as module

    seen: dict = {}
    read = module.load_pretrained_lm

    def spy(cfg, dtype, prompt_tokens, device):
        seen.update(device=device.type)

    def reading(*args, **kwargs):
        lm = read(*args, **kwargs)
        seen.update(weights=(next(lm.parameters()).device.type, next(lm.parameters()).dtype))
        return lm

    monkeypatch.setattr(module, "load_pretrained_lm", reading)
    texts = module.generate(good_folder, "memory", 4, 0.8, 50, 3, 7, "cuda", "bf16", before_sampling=spy)
    assert seen["device"] == "cuda" and seen["weights"] == ("cuda", torch.bfloat16) and len(texts) == 3
    assert main(["generate", str(good_folder), "--prompt", "memory", "--device", "cuda", "--dtype", "bf16",
                 "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("memory")


def test_export_from_another_folder_reads_the_model_folder_the_run_trained(scratch_llama, corpus, tmp_path,
                                                                           monkeypatch, capsys):
    """A run trained with a relative --model: export and generate from another folder said
    "--model './m' is not a preset" (the path was read from the new folder), or read a folder
    of the same name there; they read the run's own, as --resume does."""
    launch, elsewhere = tmp_path / "launch", tmp_path / "elsewhere"
    launch.mkdir(), elsewhere.mkdir()
    shutil.copytree(scratch_llama, launch / "m")
    monkeypatch.chdir(launch)
    assert main(["train", "--model", "./m", "--data", str(corpus), *TRAIN, "--out", "run", "--save", "run/ck.pt"]) == 0
    monkeypatch.chdir(elsewhere)
    (elsewhere / "m").mkdir()  # a folder of the same name here, not the model
    capsys.readouterr()
    assert main(["export", str(launch / "run" / "ck.pt"), "hf"]) == 0, capsys.readouterr().err
    assert (elsewhere / "hf" / "tokenizer.json").is_file()
    assert main(["generate", str(launch / "run" / "ck.pt"), "--prompt", "memory", "--max-new-tokens", "3"]) == 0


@pytest.mark.parametrize("damage", ["shape", "integer", "nan"])
def test_a_damaged_checkpoint_is_named_by_the_tensor_that_does_not_fit(scratch_llama, corpus, tmp_path, capsys, damage):
    """A tensor of another shape was refused with torch's headline only ("Error(s) in loading
    state_dict for HFCausalLM:"), naming none; an integer tensor in a run that was no QLoRA was
    blamed on bitsandbytes' packed weights; NaN weights exported with exit 0 and sampling failed
    in torch's multinomial."""
    ckpt = _train(scratch_llama, corpus, tmp_path, "--steps", "1")
    state = torch.load(ckpt, weights_only=True)
    name = "lm.model.norm.weight"
    state["model"][name] = {"shape": torch.ones(3), "integer": state["model"][name].to(torch.int64),
                            "nan": state["model"][name].clone().fill_(float("nan"))}[damage]
    torch.save(state, ckpt)
    capsys.readouterr()
    assert main(["export", str(ckpt), str(tmp_path / "hf")]) == 2
    said = _one_error_line(capsys.readouterr().err)
    assert name in said and "bitsandbytes" not in said, said
    assert {"shape": "size mismatch", "integer": "torch.int64", "nan": "NaN or inf"}[damage] in said
    assert not (tmp_path / "hf").exists()



def test_a_bf16_pure_adapter_says_it_was_trained_on_the_bf16_base(pretrained_llama, corpus, tmp_path, capsys):
    """A bf16-pure run's adapters learnt on the base rounded to bf16; on the float32 base that
    from_pretrained loads by default the logits move by that rounding, as for QLoRA's NF4, and
    --adapter-only says so (it said nothing). The note's remedy, the base loaded in bf16 then
    cast to float32, gives exactly the trained weights."""
    peft = pytest.importorskip("peft")
    from memtrain.inference.export import load_trained

    ckpt = _train(pretrained_llama, corpus, tmp_path, "--lora-rank", "4", "--precision", "bf16-pure")
    adapter = tmp_path / "adapter"
    capsys.readouterr()
    assert main(["export", str(ckpt), str(adapter), "--adapter-only"]) == 0
    note = capsys.readouterr().out.splitlines()[-1]
    assert note.startswith("note: these adapters were trained on the base rounded to bf16 (--precision bf16-pure)")
    assert "torch_dtype=torch.bfloat16" in note
    trained, _ = load_trained(ckpt, merge=False)
    idx = _tokens()
    with torch.no_grad():
        exact = trained.float()(idx)  # the trained (bf16) weights, in float32 arithmetic
        fp32 = transformers.AutoModelForCausalLM.from_pretrained(str(pretrained_llama)).eval()
        on_fp32_base = peft.PeftModel.from_pretrained(fp32, str(adapter)).eval()(idx).logits
        rounded = transformers.AutoModelForCausalLM.from_pretrained(
            str(pretrained_llama), torch_dtype=torch.bfloat16).float().eval()
        on_rounded_base = peft.PeftModel.from_pretrained(rounded, str(adapter)).eval()(idx).logits
    assert (on_fp32_base - exact).abs().max().item() > 1e-4  # what the note warns of
    assert (on_rounded_base - exact).abs().max().item() < 1e-5  # what it advises


def test_a_checkpoint_whose_model_folder_is_gone_names_the_path_to_restore(scratch_llama, corpus, tmp_path, capsys):
    """A run folder copied from another machine: the checkpoint's --model is an absolute path
    that does not exist here. export and generate said it "is not a preset, a bundled config, ...",
    listing model names, and to "run where its --model is readable"; they now name the path to
    put the model folder at, and a link there to a copy exports."""
    model = tmp_path / "machine1" / "model"
    shutil.copytree(scratch_llama, model)
    ckpt = _train(model, corpus, tmp_path, "--steps", "1")
    shutil.rmtree(tmp_path / "machine1")
    capsys.readouterr()
    for argv in (["export", str(ckpt), str(tmp_path / "hf")], ["generate", str(ckpt), "--max-new-tokens", "2"]):
        assert main(argv) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert f"its run's --model '{model}' does not exist here" in line and "is not a preset" not in line, line
    assert not (tmp_path / "hf").exists()
    (tmp_path / "machine1").mkdir()
    model.symlink_to(scratch_llama, target_is_directory=True)
    assert main(["export", str(ckpt), str(tmp_path / "hf")]) == 0
