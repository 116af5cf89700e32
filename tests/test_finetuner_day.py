"""A fine-tuner's checks against transformers and peft on their own data: parameter counts as
peft states them, documents framed as the model's tokenizer frames them, instruction data
named for what it is."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import TINY_MODEL, _small_corpus_texts, cli_flags
from memtrain.cli import main

TINY_FLAGS = [*cli_flags(TINY_MODEL), "--batch-size", "1", "--seq-len", "16", "--val-blocks", "1", "--warmup-steps", "1",
              "--no-progress"]

BOS, EOS = 1, 2


def _llama_folder(root: Path, bos_template: bool, **tokenizer_kw) -> Path:
    """A config-only tiny Llama with its own byte-level BPE (<pad>, <s>, </s> as ids 0-2); with
    ``bos_template`` the tokenizer adds <s> before a text, as Llama's tokenizers do."""
    # tokenizers and transformers are optional extras: imported only by the tests that need them
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_small_corpus_texts(), trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos_template:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    root.mkdir(parents=True)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            **tokenizer_kw).save_pretrained(root)
    LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=64, bos_token_id=BOS, eos_token_id=EOS,
                pad_token_id=0).save_pretrained(root)
    return root


@pytest.mark.parametrize("bos_template", [True, False])
def test_each_document_starts_as_the_models_tokenizer_starts_a_text(small_corpus, tmp_path, bos_template):
    """A tokenizer that puts bos before a text (Llama's) gets it before every document, as
    transformers' tokenizer call gives it; one that adds nothing (GPT-2's, Qwen2's) gets none. The
    prompt of generate is framed the same way."""
    from memtrain.config.run import build_config
    from memtrain.data import prepare_tokens
    from memtrain.inference.generate import transformers_codec
    from memtrain.models.families import data_tokenizer

    folder = _llama_folder(tmp_path / "llama", bos_template)
    cfg = build_config({"model": str(folder), "data": str(small_corpus), "cache_dir": str(tmp_path / "cache"),
                        "seq_len": 32})
    tokenizer = data_tokenizer(cfg)
    splits = prepare_tokens(cfg.data, progress=False, tokenizer=tokenizer)
    ids = np.asarray(splits.train)
    assert (ids == EOS).sum() == splits.n_train_docs
    starts = np.concatenate([[0], np.flatnonzero(ids == EOS)[:-1] + 1])  # where each document begins
    assert (ids[starts] == BOS).all() if bos_template else (ids == BOS).sum() == 0
    codec = transformers_codec(tokenizer.tok)
    assert codec.encode("x")[:1] == ([BOS] if bos_template else tokenizer.tok("x")["input_ids"][:1])
    assert codec.start_id == (BOS if bos_template else EOS)  # where an empty prompt starts


def _peft_counts(spec: str, r: int, targets: list[str]) -> tuple[int, int]:
    """peft's (trainable, all) parameters of ``spec`` with LoRA r on ``targets``."""
    # transformers and peft are optional extras: imported only by the tests that need them
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from memtrain.models.spec import load_config

    model = AutoModelForCausalLM.from_config(load_config(spec))
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=16, target_modules=targets))
    return peft_model.get_nb_trainable_parameters()


def test_train_states_the_parameters_as_peft_counts_them(small_corpus, tmp_path, capsys, one_thread):
    """result.json's parameters + adapter_parameters is peft's "all params", and train prints it
    with the trainable share as print_trainable_parameters does."""
    out = tmp_path / "run"
    assert main(["train", "--model", "tiny-llama", "--data", str(small_corpus), "--lora-rank", "2",
                 "--lora-targets", "q_proj,v_proj", "--steps", "1", "--batch-size", "1", "--seq-len", "16",
                 "--val-blocks", "1", "--no-progress", "--out", str(out)]) == 0
    result = json.loads((out / "result.json").read_text())
    trainable, total = _peft_counts("tiny-llama", 2, ["q_proj", "v_proj"])
    assert result["trainable_parameters"] == trainable
    assert result["parameters"] + result["adapter_parameters"] == total
    assert f"= {total:,}; trainable {trainable:,} ({100 * trainable / total:.4f}%)" in capsys.readouterr().out
    capsys.readouterr()
    assert main(["flops", "--model", "tiny-llama", "--lora-rank", "2", "--lora-targets", "q_proj,v_proj",
                 "--seq-len", "16", "--batch-size", "1", "--json"]) == 0
    flops = json.loads(capsys.readouterr().out)
    assert (flops["parameters"], flops["adapter_parameters"]) == (result["parameters"], result["adapter_parameters"])


@pytest.mark.parametrize("record, field", [
    ({"prompt": "How do I sort a list?", "response": "Use sorted()."}, None),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}, "messages"),
])
def test_instruction_and_chat_records_are_refused_saying_what_memtrain_trains_on(tmp_path, capsys, record, field):
    """Naming a prompt field would train on prompts alone and a messages list is no text: the one
    error line says memtrain trains on one packed text field, how to make one, and writes nothing."""
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(record) + "\n" for _ in range(20)))
    out = tmp_path / "run"
    argv = ["train", "--data", str(data), "--steps", "1", "--seq-len", "16", "--batch-size", "1", "--out", str(out)]
    assert main([*argv, *(["--text-field", field] if field else [])]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert "apply_chat_template" in err and "no prompt masking" in err
    assert not out.exists()


def test_a_text_field_named_like_none_of_those_gets_no_instruction_hint(tmp_path, capsys):
    data = tmp_path / "posts.jsonl"
    data.write_text("".join(json.dumps({"body": "a post"}) + "\n" for _ in range(20)))
    assert main(["train", "--data", str(data), "--steps", "1", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "field 'text' not found" in err and "apply_chat_template" not in err


def test_a_text_field_that_is_one_part_of_an_instruction_record_is_warned_once(tmp_path, capsys):
    """--text-field instruction trains on the instructions alone: the run goes on, saying so in one line."""
    from memtrain.config.run import build_config
    from memtrain.data import prepare_tokens
    from memtrain.runtime.notices import PartOfARecordWarning

    data = tmp_path / "alpaca.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"Sort list {i}", "output": "sorted(x)"}) + "\n"
                            for i in range(20)))
    cfg = build_config({"data": str(data), "text_field": "instruction", "cache_dir": str(tmp_path / "cache")})
    with pytest.warns(PartOfARecordWarning, match="trains on that field alone; the records also hold output") as seen:
        prepare_tokens(cfg.data, progress=False)
    assert len(seen) == 1


def test_documents_longer_than_the_tokenizers_max_length_are_packed_without_its_warning(small_corpus, tmp_path, capfd):
    """transformers warns that a text longer than model_max_length "will result in indexing errors"
    when run whole; memtrain cuts the stream into --seq-len blocks, so no such line is printed and
    the documents are kept whole."""
    folder = _llama_folder(tmp_path / "llama", False, model_max_length=8)
    out = tmp_path / "run"
    assert main(["train", "--model", str(folder), "--data", str(small_corpus), "--seq-len", "32", "--batch-size", "2",
                 "--steps", "1", "--val-blocks", "1", "--no-progress", "--out", str(out),
                 "--cache-dir", str(tmp_path / "cache")]) == 0
    assert "indexing errors" not in capfd.readouterr().err
    data = json.loads((out / "result.json").read_text())["data"]
    assert data["train_tokens"] > 8 * data["train_documents"]  # documents past model_max_length, kept whole


def test_a_save_to_disk_folder_reads_as_the_same_records_in_a_file(small_corpus, tmp_path, capsys):
    """datasets' save_to_disk (a Dataset, or a DatasetDict's split) is read with load_from_disk
    through hf:DIR, giving the tokens of the same records in a .jsonl; the folder given without
    hf: is one line saying to add it, and a split the DatasetDict lacks names the ones it has."""
    datasets = pytest.importorskip("datasets")
    from memtrain.config.run import ConfigError, build_config
    from memtrain.data import prepare_tokens

    records = [json.loads(line) for line in small_corpus.read_text().splitlines()]
    one, both = tmp_path / "one", tmp_path / "both"
    datasets.Dataset.from_list(records).save_to_disk(str(one))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(records)}).save_to_disk(str(both))

    def tokens(data: str, **kw) -> np.ndarray:
        cfg = build_config({"data": data, "cache_dir": str(tmp_path / "cache"), **kw})
        return np.asarray(prepare_tokens(cfg.data, progress=False).train)

    expected = tokens(str(small_corpus))
    assert np.array_equal(tokens(f"hf:{one}"), expected)
    assert np.array_equal(tokens(f"hf:{both}"), expected)
    with pytest.raises(ConfigError, match=r"has no split 'validation' \(splits: train\); set --hf-split"):
        tokens(f"hf:{both}", hf_split="validation")
    capsys.readouterr()  # save_to_disk's progress bars
    assert main(["train", "--data", str(one), "--steps", "1", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --data {str(one)!r} is a folder written by datasets' save_to_disk; give --data hf:{one}\n"


def test_a_save_to_disk_folder_with_garbled_or_outward_json_is_one_line(small_corpus, tmp_path, capsys):
    """A save_to_disk folder whose dataset_info.json is a list, whose state.json lists files as
    numbers, or whose state.json names a file outside it (`../good/data.arrow`, which datasets read):
    datasets' AttributeError or TypeError (exit 1), or a read outside the folder. Each is one
    line (exit 2) before datasets reads the folder; the folder as saved still reads."""
    datasets = pytest.importorskip("datasets")

    records = [json.loads(line) for line in small_corpus.read_text().splitlines()]
    good = tmp_path / "good"
    datasets.Dataset.from_list(records).save_to_disk(str(good))
    state = json.loads((good / "state.json").read_text())
    outward = f"../good/{state['_data_files'][0]['filename']}"
    capsys.readouterr()  # save_to_disk's progress bars
    for name, edit in (("info-list", {"dataset_info.json": "[1]"}),
                       ("files-numbers", {"state.json": json.dumps({**state, "_data_files": [5]})}),
                       # a file that exists outside the folder: datasets read it
                       ("outward", {"state.json": json.dumps({**state, "_data_files": [{"filename": outward}]})})):
        folder = tmp_path / name
        shutil.copytree(good, folder)
        for file, text in edit.items():
            (folder / file).write_text(text)
        out = tmp_path / f"run-{name}"
        argv = ["train", "--data", f"hf:{folder}", "--steps", "1", "--out", str(out), *TINY_FLAGS]
        assert main(argv) == 2, name
        err = capsys.readouterr().err
        assert err.startswith(f"error: cannot load {str(folder)!r} (a save_to_disk folder): ") and err.count("\n") == 1, err
        assert not out.exists()
    assert main(["train", "--data", f"hf:{good}", "--steps", "1", "--out", str(tmp_path / "ok"), *TINY_FLAGS]) == 0


def test_a_model_shorter_than_the_default_seq_len_trains_at_its_own_length(tmp_path, capsys):
    """With no --seq-len, a model of 64 positions gets seq-len 64 (as run_clm caps its block size),
    said in the defaults line, where every verb refused the default 256 as if it had been asked
    for; a --seq-len given past the model's positions is still refused."""
    from memtrain.config.run import ConfigError, build_config

    folder = _llama_folder(tmp_path / "llama", False)
    assert build_config({"model": str(folder)}).train.seq_len == 64
    assert build_config({"max_seq_len": 128}).train.seq_len == 128  # memtrain's GPT made shorter
    assert build_config({"model": str(folder), "seq_len": 32}).train.seq_len == 32
    with pytest.raises(ConfigError, match="--seq-len 256 exceeds the max_position_embeddings 64"):
        build_config({"model": str(folder), "seq_len": 256})
    assert main(["estimate", "--model", str(folder), "--batch-size", "1"]) == 0
    assert "seq-len 64 (the model's max_position_embeddings, under memtrain's 256; --seq-len)" in capsys.readouterr().out
    # memtrain's GPT made shorter names the flag that made it so (it said max_position_embeddings)
    assert main(["estimate", "--max-seq-len", "128", "--d-model", "64", "--n-heads", "4", "--n-layers", "2"]) == 0
    assert "seq-len 128 (--max-seq-len 128, under memtrain's 256; --seq-len)" in capsys.readouterr().out


def test_a_bench_scales_seq_len_fits_a_shorter_model_as_trains_default_does(tmp_path):
    """The scale's 256 tokens are a default too: a 64-position model's rows run at 64 (they were
    each refused); a --seq-len given, or a model long enough, keeps its length."""
    from memtrain.bench.scales import fitted_scale_layer

    folder = str(_llama_folder(tmp_path / "llama", False))
    assert fitted_scale_layer("quick", [{"model": folder}])["seq_len"] == 64
    assert fitted_scale_layer("quick", [{"model": folder}, {"seq_len": 32}])["seq_len"] == 256  # the flag's wins later
    assert fitted_scale_layer("quick", [{"model": "tiny-llama"}])["seq_len"] == 256
    assert fitted_scale_layer("quick", [{}])["seq_len"] == 256
    assert fitted_scale_layer("quick", [{"max_seq_len": "128"}])["seq_len"] == 128  # our GPT made shorter


def test_a_run_without_save_says_so_and_its_folder_is_named_as_one_that_saved_nothing(tiny_run, tmp_path, capsys):
    """train writes weights only with --save (the Trainer saves by default): the run says so in
    one note, and export or generate of its --out folder says the run saved no checkpoint and
    how to keep one, where it sent the user after "the checkpoint its run saved with --save"."""
    from conftest import cli_flags

    run = Path(tiny_run["out"])
    assert main(["train", *cli_flags(tiny_run)]) == 0
    said = capsys.readouterr()
    assert "note: no --save: the trained weights were not written; give --save FILE" in said.err
    expected = f"{str(run)!r} is the --out folder of a run that saved no checkpoint: train keeps the weights only with --save"
    for argv in (["export", str(run), str(tmp_path / "exported")], ["generate", str(run), "--prompt", "hi"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and expected in err, err
        assert "the checkpoint its run saved" not in err
    assert not (tmp_path / "exported").exists()
    # A run that saved elsewhere is named with its --save, and export's line does not send the
    # user to `memtrain export`.
    assert main(["train", *cli_flags({**tiny_run, "out": str(tmp_path / "run2"), "steps": 2}),
                 "--save", str(tmp_path / "keep.pt")]) == 0
    assert "note: no --save" not in capsys.readouterr().err
    assert main(["export", str(tmp_path / "run2"), str(tmp_path / "exported")]) == 2
    err = capsys.readouterr().err
    assert f"the checkpoint its run saved with --save ({str(tmp_path / 'keep.pt')!r})" in err and "memtrain export" not in err


def test_the_summary_says_what_its_losses_average_and_result_json_has_the_trainers_train_loss(tiny_run, capsys):
    """train_loss is the mean of the last 10 steps and val_loss covers --val-blocks blocks, where
    the Trainer's train_loss is the mean over every step run and its eval covers the whole split:
    the summary line says both spans, and result.json adds the Trainer's figure and the tokens
    val_loss was read on."""
    from conftest import cli_flags

    run = Path(tiny_run["out"])
    assert main(["train", *cli_flags({**tiny_run, "steps": 12})]) == 0
    out = capsys.readouterr().out
    result = json.loads((run / "result.json").read_text())
    history = result["loss_history"]
    assert len(history) == 12 and result["train_loss_steps"] == 10
    assert result["train_loss"] == pytest.approx(sum(history[-10:]) / 10)
    assert result["train_loss_mean"] == pytest.approx(sum(history) / 12)  # the Trainer's train_loss
    data = result["data"]
    assert data["val_tokens_evaluated"] == tiny_run["val_blocks"] * tiny_run["seq_len"] < data["val_tokens"]
    assert (f"train loss {result['train_loss']:.4f} (mean of the last 10 steps)" in out
            and f"(on {data['val_tokens_evaluated']:,} of {data['val_tokens']:,} held-out tokens; --val-blocks)" in out), out


def test_trains_defaults_line_names_the_optimizer_defaults_the_trainer_sets_otherwise(small_corpus, tmp_path, capsys,
                                                                                        one_thread):
    """A fine-tune of a transformers model at memtrain's lr 3e-4, weight decay 0.1 and beta2 0.95
    (the Trainer's: 5e-5, 0, 0.999) said nothing of them: train's defaults line names each one not
    given; estimate's, whose memory they do not shape, does not."""
    argv = ["--model", "tiny-llama", "--seq-len", "16", "--batch-size", "1"]
    assert main(["train", *argv, "--data", str(small_corpus), "--steps", "2", "--val-blocks", "1", "--no-progress",
                 "--learning_rate", "1e-4", "--out", str(tmp_path / "run")]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("defaults used: "))
    assert "weight-decay 0.1 (the Trainer's default is 0; --weight-decay)" in line
    assert "beta2 0.95 (the Trainer's default is 0.999; --beta2)" in line
    assert "lr " not in line  # given, by its Trainer name
    assert main(["estimate", *argv]) == 0
    assert "Trainer" not in capsys.readouterr().out


CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


def test_generate_chat_frames_the_prompt_with_the_chat_template_and_prints_the_reply(tmp_path, capsys):
    """A chat model was prompted with raw text only (its template typed by hand); --chat frames
    --prompt as a user message with the tokenizer's template, as transformers' chat pipeline
    does, and prints the reply up to the end of its turn: transformers' greedy continuation of
    the same ids, cut at eos. A tokenizer without a template is one error line."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = _llama_folder(tmp_path / "chat", False, chat_template=CHAT_TEMPLATE)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(folder))).save_pretrained(folder)  # random weights
    assert main(["generate", str(folder), "--chat", "--prompt", "How do I sort a list?", "--temperature", "0",
                 "--max-new-tokens", "12"]) == 0
    printed = capsys.readouterr().out
    tok = AutoTokenizer.from_pretrained(str(folder))
    ids = tok.apply_chat_template([{"role": "user", "content": "How do I sort a list?"}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    opened = tok("<s>assistant\n", add_special_tokens=False)["input_ids"]
    assert ids[-len(opened):] == opened and opened[0] == BOS  # the assistant's turn opened
    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        new = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=12, eos_token_id=None,
                             pad_token_id=0)[0, len(ids):].tolist()
    reply = new[:new.index(EOS)] if EOS in new else new
    from memtrain.inference.generate import chat_reply
    assert chat_reply([5, EOS, 7], EOS) == [5] and chat_reply([5, 7], EOS) == [5, 7]  # cut at the end of the turn
    assert printed == tok.decode(reply, clean_up_tokenization_spaces=False) + "\n"
    plain = _llama_folder(tmp_path / "plain", False)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(plain))).save_pretrained(plain)
    capsys.readouterr()  # the test's own loading bars
    assert main(["generate", str(plain), "--chat", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --chat: ") and "has no chat template" in err


def test_the_trainers_default_linear_schedule_is_taken_and_decays_as_transformers_does(tiny_run):
    """--lr_scheduler_type linear, the Trainer's default, was refused ("memtrain's --schedule is
    cosine or constant"), so a Trainer recipe could not be matched: it is --schedule linear
    --min-lr-ratio 0, each step after warm-up at transformers' get_linear_schedule_with_warmup rate."""
    from conftest import cli_flags

    steps, warmup, lr = 8, 2, 1e-3
    run = Path(tiny_run["out"])
    assert main(["train", *cli_flags({**tiny_run, "steps": steps, "warmup_steps": warmup}), "--lr", str(lr),
                 "--lr_scheduler_type", "linear"]) == 0
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    ran = {line["step"]: line["lr"] for line in lines if "lr" in line}
    assert json.loads((run / "result.json").read_text())["config"]["train"]["schedule"] == "linear"
    import torch
    from transformers import get_linear_schedule_with_warmup

    theirs = get_linear_schedule_with_warmup(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr), warmup, steps)
    for step in range(warmup + 1, steps + 1):  # the rate step N ran at: transformers' scheduler at N - 1
        assert ran[step] == pytest.approx(lr * theirs.lr_lambdas[0](step - 1)), step
    assert ran[steps] < ran[warmup + 1] / 2  # it decays: the check has teeth


@pytest.mark.parametrize("command", ["train", "estimate", "maxbatch"])
def test_help_says_a_transformers_model_defaults_to_sdpa(command, capsys):
    """--help said `--attention ... (default: math)` only, while every verb runs a --model with
    sdpa: a newcomer reading it expected eager attention and its memory."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "a transformers --model defaults to sdpa" in text


def test_help_of_save_says_that_without_it_no_weights_are_kept(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "what export, generate and --resume read. None: the trained weights are not kept." in text
