"""A transformers model folder's own tokenizer and length: documents framed as its tokenizer frames
a text (its bos, no warning past its model_max_length), and seq-len defaulting to a model shorter
than memtrain's default (train, estimate and a bench scale alike)."""

from __future__ import annotations

import json
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
    # The prompt's ids are the text's own after that one bos (never a second, as a template adds).
    plain = list(tokenizer.tok("x", add_special_tokens=False)["input_ids"])
    assert codec.encode("x") == ([BOS] if bos_template else []) + plain
    assert codec.start_id == (BOS if bos_template else EOS)  # where an empty prompt starts


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


@pytest.mark.parametrize("template, words", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{{ messages[0]['content'] }}",
     "did not render within 1 s"),
    ("{{ 'x' * 5000000 }}{{ messages[0]['content'] }}", "made a text of 5,000,002 characters (at most 4,194,304) from a prompt of 2"),
    ("{{ raise_exception('no system turn') }}", "fails (TemplateError: no system turn)"),
    ("{{ ''.__class__.__mro__ }}", "fails (SecurityError: access to attribute '__class__'"),
])
def test_a_chat_template_that_loops_grows_or_fails_is_one_line(tmp_path, capsys, monkeypatch, template, words):
    """A model folder's chat template is the folder's code, run in jinja's sandbox: one that loops
    (10**10 iterations) or printed a 2 GB text was still running when stopped after 60 s, a text of
    millions of characters went to the tokenizer whole, and one that raised (its own raise_exception, the sandbox's
    refusal) was exit 1 with the library's words. Each is one line, exit 2, before any weight is read."""
    import memtrain.models.tokenizer as tokenizer

    monkeypatch.setattr(tokenizer, "CHAT_TEMPLATE_SECONDS", 1.0)
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = _llama_folder(tmp_path / "chat", False, chat_template=template)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(folder))).save_pretrained(folder)
    capsys.readouterr()  # the test's own saving bars
    assert main(["generate", str(folder), "--chat", "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: the tokenizer's chat template ") and words in err, err
    assert "without --chat" in err


class _RendersText:
    """apply_chat_template's part of a tokenizer: a text of ``n`` characters."""

    def __init__(self, n: int) -> None:
        self.n = n

    def apply_chat_template(self, messages, tokenize=False, **kwargs):
        return "x" * self.n


def test_a_chat_render_of_the_size_bound_passes_and_one_character_more_is_refused():
    from memtrain.errors import ChatTemplateLimit
    from memtrain.models.tokenizer import MAX_CHAT_CHARS, bounded_chat_template

    assert len(bounded_chat_template(_RendersText(MAX_CHAT_CHARS), [])) == MAX_CHAT_CHARS
    with pytest.raises(ChatTemplateLimit, match=rf"made a text of {MAX_CHAT_CHARS + 1:,} characters \(at most {MAX_CHAT_CHARS:,}\)"):
        bounded_chat_template(_RendersText(MAX_CHAT_CHARS + 1), [])


def test_generate_chat_prints_the_reply_up_to_its_end_of_turn(tmp_path, capsys, monkeypatch):
    """The sampled ids run past the end of the turn (sampling runs --max-new-tokens): --chat
    prints what comes before the eos only."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    import memtrain.inference.generate as gen

    folder = _llama_folder(tmp_path / "chat", False, chat_template=CHAT_TEMPLATE)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(folder))).save_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(str(folder))
    said, after = tok("sort it", add_special_tokens=False)["input_ids"], tok("then more", add_special_tokens=False)["input_ids"]
    monkeypatch.setattr(gen, "sample_ids", lambda hf, x, settings: torch.cat(
        [x, torch.tensor([said + [EOS] + after] * x.shape[0])], dim=1))
    assert main(["generate", str(folder), "--chat", "--prompt", "How?", "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out == tok.decode(said, clean_up_tokenization_spaces=False) + "\n"
