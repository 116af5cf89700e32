"""A fine-tuner's checks against transformers and peft on their own data: parameter counts as
peft states them, documents framed as the model's tokenizer frames them, instruction data
named for what it is."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import _small_corpus_texts
from memtrain.cli import main

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
    # The prompt's ids are the text's own after that one bos (never a second, as a template adds).
    plain = list(tokenizer.tok("x", add_special_tokens=False)["input_ids"])
    assert codec.encode("x") == ([BOS] if bos_template else []) + plain
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
