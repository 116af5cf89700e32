"""Chat and prompt-completion records (TRL's dataset formats), --data-format: each conversation's ids
are the tokenizer's own apply_chat_template ids, closed by eos as every document is; plain prompt +
completion strings are one ordinary document; a changed template never reuses cached ids; our GPT or
a tokenizer without a template is one error line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import _small_corpus_texts
from memtrain.cli import main

pytest.importorskip("transformers")
pytest.importorskip("datasets")

# Qwen2's ChatML (the default system turn, <|im_start|> / <|im_end|>), and a Llama-2-like template that
# writes the bos itself and closes each answer with eos, for a tokenizer that also adds bos to a text.
CHATML = ("{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
          "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
          "{{ message['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
          "{% endif %}")
LLAMA2 = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}[INST] {{ message['content'] }}"
          " [/INST]{% elif message['role'] == 'assistant' %} {{ message['content'] }}{{ eos_token }}{% else %}"
          "<<SYS>>{{ message['content'] }}<</SYS>>{% endif %}{% endfor %}")

CONVERSATIONS = [
    [{"role": "user", "content": f"How do I sort list {i}?"},
     {"role": "assistant", "content": f"Use sorted(x{i}) or x{i}.sort()."},
     {"role": "user", "content": "And in reverse?"},
     {"role": "assistant", "content": "Pass reverse=True."}] if i % 3 else
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": f"What is {i} + 1?"},
     {"role": "assistant", "content": f"{i + 1}."}]
    for i in range(60)
]


def _chat_folder(root: Path, template: str | None, family: str = "qwen2") -> Path:
    """A config-only tiny Qwen2 (ChatML specials, eos <|im_end|>, no bos) or Llama (<s> added before a
    text, eos </s>) with its own byte-level BPE and ``template`` as its chat template."""
    # tokenizers and transformers are optional extras: imported only by the tests that need them
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] if family == "qwen2" else ["<pad>", "<s>", "</s>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = _small_corpus_texts() + [m["content"] for c in CONVERSATIONS for m in c]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    kw = {"chat_template": template} if template else {}
    if family == "qwen2":
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", **kw)
        config = Qwen2Config(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                             eos_token_id=fast.eos_token_id)
    else:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", **kw)
        config = LlamaConfig(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                             bos_token_id=1, eos_token_id=2, pad_token_id=0)
    root.mkdir(parents=True)
    fast.save_pretrained(root)
    config.save_pretrained(root)
    return root


def _records(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _tokens(tmp_path: Path, data: Path, model: Path | None, **kw):
    from memtrain.config.run import build_config
    from memtrain.data import prepare_tokens
    from memtrain.models.families import data_tokenizer

    settings = {"data": str(data), "cache_dir": str(tmp_path / "cache"), "val_fraction": 0.2, **kw}
    if model is not None:
        settings.update(model=str(model), seq_len=32)
    cfg = build_config(settings)
    tokenizer = data_tokenizer(cfg)
    return prepare_tokens(cfg.data, progress=False, tokenizer=tokenizer), tokenizer


def _expected(tok, split_of: list[bool], eos: int, val: bool) -> list[int]:
    """apply_chat_template's ids of each record of one split, in order, each closed by eos unless it
    already ends with it."""
    out: list[int] = []
    for messages, in_val in zip(CONVERSATIONS, split_of):
        if in_val != val:
            continue
        ids = list(tok.apply_chat_template(messages, tokenize=True, return_dict=False))
        out += ids if ids[-1] == eos else ids + [eos]
    return out


def _split_of(n: int, val_fraction: float = 0.2, seed: int = 1234) -> list[bool]:
    from memtrain.data.cache import assign_validation

    return assign_validation(np.random.default_rng(seed), n, val_fraction).tolist()


@pytest.mark.parametrize("family, template", [("qwen2", CHATML), ("llama", LLAMA2)])
def test_chat_records_are_the_tokenizers_own_chat_template_ids_closed_by_eos(tmp_path, family, template):
    """Every record's ids are tokenizer.apply_chat_template(messages, tokenize=True), then eos (none
    added after a template that closed the record with it); the template's bos is the only one (the
    Llama tokenizer's own bos before a text is not added again). ShareGPT's from/value turns give the
    same ids as the same conversation in messages."""
    model = _chat_folder(tmp_path / family, template, family)
    data = _records(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])
    splits, tokenizer = _tokens(tmp_path, data, model, data_format="chat")
    tok, eos = tokenizer.tok, tokenizer.eot_id
    split_of = _split_of(len(CONVERSATIONS))
    assert splits.n_train_docs == split_of.count(False) and splits.n_val_docs == split_of.count(True)
    assert np.asarray(splits.train).tolist() == _expected(tok, split_of, eos, val=False)
    assert np.asarray(splits.val).tolist() == _expected(tok, split_of, eos, val=True)
    if family == "llama":  # the template's bos, once per record
        assert int((np.asarray(splits.train) == tok.bos_token_id).sum()) == splits.n_train_docs

    speakers = {"user": "human", "assistant": "gpt", "system": "system"}
    sharegpt = _records(tmp_path / "sharegpt.jsonl", [
        {"conversations": [{"from": speakers[m["role"]], "value": m["content"]} for m in c]} for c in CONVERSATIONS])
    same, _ = _tokens(tmp_path, sharegpt, model, data_format="auto")
    assert np.array_equal(same.train, splits.train) and np.array_equal(same.val, splits.val)


def test_prompt_completion_records_join_strings_and_render_message_lists(tmp_path):
    """TRL's rule: a prompt and a completion that are strings are one document, prompt + completion
    (framed as any text: the --data-format text ids of the joined field); message lists are one
    conversation through the template."""
    model = _chat_folder(tmp_path / "qwen2", CHATML)
    pairs = [(f"Question {i}: how do I sort a list?", f" Use sorted(x{i}).") for i in range(40)]
    plain = _records(tmp_path / "pc.jsonl", [{"prompt": p, "completion": c} for p, c in pairs])
    joined = _records(tmp_path / "text.jsonl", [{"text": p + c} for p, c in pairs])
    got, _ = _tokens(tmp_path, plain, model, data_format="prompt-completion")
    want, _ = _tokens(tmp_path, joined, model)
    assert np.array_equal(got.train, want.train) and np.array_equal(got.val, want.val)

    convs = _records(tmp_path / "pc-chat.jsonl", [{"prompt": c[:-1], "completion": c[-1:]} for c in CONVERSATIONS])
    as_pc, _ = _tokens(tmp_path, convs, model, data_format="auto")
    as_chat, _ = _tokens(tmp_path, _records(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS]),
                         model, data_format="chat")
    assert np.array_equal(as_pc.train, as_chat.train)


def test_a_changed_chat_template_does_not_reuse_cached_ids(tmp_path):
    """The template is part of the cache key: the same records under another template (a changed
    chat_template.jinja, which the tokenizer's file hash does not cover) are rendered again."""
    model = _chat_folder(tmp_path / "qwen2", CHATML)
    data = _records(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])
    first, tokenizer = _tokens(tmp_path, data, model, data_format="chat")
    assert (model / "chat_template.jinja").is_file()  # where transformers saves a template
    (model / "chat_template.jinja").write_text(CHATML.replace("You are a helpful assistant.", "Be terse."))
    second, tokenizer2 = _tokens(tmp_path, data, model, data_format="chat")
    assert tokenizer2.name == tokenizer.name  # the tokenizer's identity alone would have reused the entry
    assert not second.from_cache and first.cache_path != second.cache_path
    system = tokenizer2.tok("Be terse.", add_special_tokens=False)["input_ids"]
    assert len(second.train) < len(first.train) and len(system) > 0


def test_chat_data_without_a_chat_template_is_one_error_line(tmp_path, capsys):
    """Our GPT (GPT-2's BPE) and a --model whose tokenizer has no template cannot render a
    conversation: one error line naming what to do, nothing written."""
    data = _records(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])
    plain = _chat_folder(tmp_path / "plain", None)
    for model in ([], ["--model", str(plain)]):
        out = tmp_path / f"run{len(model)}"
        assert main(["train", "--data", str(data), "--data-format", "chat", *model, "--steps", "1", "--seq-len", "16",
                     "--batch-size", "1", "--no-progress", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: --data-format chat renders conversations"), err
        assert ("GPT-2's BPE" in err) if not model else ("no chat template" in err)
        assert "--data-format text --text-field" in err and "--chat-template FILE" in err and not out.exists()


@pytest.mark.parametrize("flags, says", [
    (["--data-format", "chat", "--text-field", "messages"], "drop --text-field"),
    (["--data-format", "chat", "--strip-html"], "drop --strip-html"),
    (["--data-format", "prompt-completion", "--data", "default"], "is plain text"),
    (["--data-format", "chats"], "unknown --data-format 'chats'"),
])
def test_record_formats_refuse_what_they_cannot_read(tmp_path, capsys, flags, says):
    data = _records(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])
    assert main(["train", "--data", str(data), *flags, "--steps", "1", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err


def test_a_file_mixing_chat_and_prompt_completion_records_names_both_under_auto(tmp_path, capsys):
    """A file of chat and prompt-completion records under --data-format auto was refused saying only
    that record 4's 'messages' was no list of messages (the file's columns give each record every
    field, None where it has none). The line names both formats and the first record of each, in
    either order; a file of one format still reads."""
    model = _chat_folder(tmp_path / "qwen2", CHATML)
    chats = [{"messages": c} for c in CONVERSATIONS[:3]]
    pairs = [{"prompt": c[:-1], "completion": c[-1:]} for c in CONVERSATIONS[3:6]]
    for name, records, first, then in (("cp", chats + pairs, ("chat", 1), ("prompt-completion", 4)),
                                       ("pc", pairs[:2] + chats, ("prompt-completion", 1), ("chat", 3))):
        data = _records(tmp_path / f"{name}.jsonl", records)
        assert main(["train", "--model", str(model), "--data", str(data), "--data-format", "auto", "--seq-len", "32",
                     "--steps", "1", "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert (f"--data-format auto found {first[0]} records (the first: record {first[1]}) and {then[0]} records "
                f"(the first: record {then[1]}) in '{data}'") in err, err
    splits, _ = _tokens(tmp_path, _records(tmp_path / "one.jsonl", chats), model, data_format="auto")
    assert splits.n_train_docs + splits.n_val_docs == len(chats)


def test_a_folder_of_a_chat_file_and_a_prompt_completion_file_is_refused_as_one_file_is(tmp_path):
    """A folder of a chat file and a prompt-completion file passed --data-format auto unnoticed where
    one file mixing them was refused: one --data is one dataset of one format (TRL's SFTTrainer reads
    the format off the first record; datasets refuses JSON files whose columns differ). The line
    names the first record of each format and its file; a folder of files of one format still reads."""
    from memtrain.config.run import ConfigError

    model = _chat_folder(tmp_path / "qwen2", CHATML)
    chats = [{"messages": c} for c in CONVERSATIONS[:3]]
    pairs = [{"prompt": c[:-1], "completion": c[-1:]} for c in CONVERSATIONS[3:6]]
    apart = tmp_path / "apart"
    apart.mkdir()
    a, b = _records(apart / "a.jsonl", chats), _records(apart / "b.jsonl", pairs)
    with pytest.raises(ConfigError) as refused:
        _tokens(tmp_path, apart, model, data_format="auto")
    assert str(refused.value).startswith(f"--data-format auto found chat records (the first: record 1 of '{a}') and "
                                         f"prompt-completion records (the first: record 1 of '{b}'); one --data holds "
                                         "one format"), refused.value
    same = tmp_path / "same"
    same.mkdir()
    _records(same / "a.jsonl", chats[:2])
    _records(same / "b.jsonl", chats[2:])
    splits, _ = _tokens(tmp_path, same, model, data_format="auto")
    assert splits.n_train_docs + splits.n_val_docs == len(chats)


def test_a_record_the_template_or_the_format_cannot_read_is_named(tmp_path):
    from memtrain.config.run import ConfigError

    model = _chat_folder(tmp_path / "qwen2", CHATML)
    bad = _records(tmp_path / "bad.jsonl", [{"messages": CONVERSATIONS[0]}, {"messages": [{"role": "user"}]}])
    with pytest.raises(ConfigError, match=r"record 2 of .*'messages' message 1 is not a message with text 'role'"):
        _tokens(tmp_path, bad, model, data_format="chat")
    mixed = _records(tmp_path / "mixed.jsonl", [{"prompt": "a", "completion": [{"role": "user", "content": "b"}]}])
    with pytest.raises(ConfigError, match="prompt and completion are str and list"):
        _tokens(tmp_path, mixed, model, data_format="prompt-completion")
    strict = _chat_folder(tmp_path / "strict", "{{ raise_exception('Conversation roles must alternate') }}")
    good = _records(tmp_path / "good.jsonl", [{"messages": c} for c in CONVERSATIONS])
    with pytest.raises(ConfigError, match="the chat template refused record 1 of .*roles must alternate"):
        _tokens(tmp_path, good, strict, data_format="chat")


def test_a_checkpoint_saved_before_data_format_existed_resumes_as_text():
    """A saved config without data_format ran on text: it resumes as --data-format text, and is
    another run's under any other format."""
    from memtrain.config.run import build_config
    from memtrain.training.resume_check import config_differences

    now = build_config({}).to_dict()
    saved = {**now, "data": {k: v for k, v in now["data"].items() if k != "data_format"}}
    assert config_differences(saved, now) == []
    chat = {**now, "data": {**now["data"], "data_format": "chat"}}
    assert config_differences(saved, chat) == ["data_format: 'text' -> 'chat'"]


# ChatML with transformers' {% generation %} tags around each answer (its content and end of turn):
# apply_chat_template(return_assistant_tokens_mask=True) then marks the answers itself, the oracle of
# the turn-by-turn renders memtrain compares for a template without the tags.
CHATML_TAGGED = CHATML.replace("<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n",
                               "<|im_start|>{{ message['role'] }}\n{% if message['role'] == 'assistant' %}"
                               "{% generation %}{{ message['content'] }}<|im_end|>\n{% endgeneration %}{% else %}"
                               "{{ message['content'] }}<|im_end|>\n{% endif %}")


def _masks_per_record(splits, tok, eos, records, split_of, val: bool):
    """Each record's (ids, mask) cut from one split's stream, by the lengths of its framed ids."""
    ids, mask = np.asarray(splits.val if val else splits.train), np.asarray(splits.val_mask if val else splits.train_mask)
    out, at = [], 0
    for messages, in_val in zip(records, split_of):
        if in_val != val:
            continue
        own = list(tok.apply_chat_template(messages, tokenize=True, return_dict=False))
        n = len(own) + (own[-1] != eos)
        assert ids[at:at + len(own)].tolist() == own
        out.append((own, mask[at:at + n].tolist()))
        at += n
    assert at == len(ids)
    return out


def test_answers_only_marks_each_assistant_turn_as_transformers_generation_tags_do(tmp_path):
    """--loss-on completion: the target mask beside the ids is 1 on exactly the tokens transformers'
    assistant mask marks for the same template with {% generation %} tags (each answer and its
    <|im_end|>), found without the tags by rendering the turns one by one; the eos that closes a record
    ending with an answer is a target. The ids are --loss-on all's."""
    model = _chat_folder(tmp_path / "qwen2", CHATML)
    data = _records(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])
    splits, tokenizer = _tokens(tmp_path, data, model, data_format="chat", loss_on="completion")
    plain, _ = _tokens(tmp_path, data, model, data_format="chat")
    assert np.array_equal(splits.train, plain.train) and plain.train_mask is None
    tok, eos = tokenizer.tok, tokenizer.eot_id
    split_of = _split_of(len(CONVERSATIONS))
    for val in (False, True):
        for (own, mask), messages in zip(_masks_per_record(splits, tok, eos, CONVERSATIONS, split_of, val),
                                         [c for c, v in zip(CONVERSATIONS, split_of) if v == val]):
            oracle = tok.apply_chat_template(messages, chat_template=CHATML_TAGGED, tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=True)
            assert oracle["input_ids"] == own
            assert mask[:len(own)] == oracle["assistant_masks"]
            assert mask[len(own):] == [1]  # the closing eos: the record ends with an answer
    assert 0 < int(np.asarray(splits.train_mask).sum()) < len(splits.train)


def test_a_prompt_completion_records_targets_are_its_completion_and_eos(tmp_path):
    """TRL's completion_only_loss: strings: the completion's tokens and the eos added after it;
    message lists: after the prompt's render with its generation prompt. The bos a Llama tokenizer
    adds before the text is a prompt token."""
    model = _chat_folder(tmp_path / "llama", LLAMA2, "llama")
    pairs = [(f"Question {i}: how do I sort a list?", f" Use sorted(x{i}).") for i in range(40)]
    data = _records(tmp_path / "pc.jsonl", [{"prompt": p, "completion": c} for p, c in pairs])
    splits, tokenizer = _tokens(tmp_path, data, model, data_format="prompt-completion", loss_on="completion")
    tok, eos = tokenizer.tok, tokenizer.eot_id
    ids, mask = np.asarray(splits.train).tolist(), np.asarray(splits.train_mask).tolist()
    at = 0
    for (p, c), in_val in zip(pairs, _split_of(len(pairs))):
        if in_val:
            continue
        own = tok(p + c, add_special_tokens=False)["input_ids"]
        n_prompt = len(tok(p, add_special_tokens=False)["input_ids"])
        assert ids[at:at + len(own) + 2] == [tok.bos_token_id, *own, eos]
        assert own[:n_prompt] == tok(p, add_special_tokens=False)["input_ids"]  # no merge across the boundary here
        assert mask[at:at + len(own) + 2] == [0] * (1 + n_prompt) + [1] * (len(own) - n_prompt) + [1]
        at += len(own) + 2
    assert at == len(ids)

    chat = _chat_folder(tmp_path / "qwen2", CHATML)
    convs = _records(tmp_path / "pc-chat.jsonl", [{"prompt": c[:-1], "completion": c[-1:]} for c in CONVERSATIONS])
    got, tokenizer = _tokens(tmp_path, convs, chat, data_format="auto", loss_on="completion")
    tok, eos = tokenizer.tok, tokenizer.eot_id
    split_of = _split_of(len(CONVERSATIONS))
    for (own, mask), messages in zip(_masks_per_record(got, tok, eos, CONVERSATIONS, split_of, False),
                                     [c for c, v in zip(CONVERSATIONS, split_of) if not v]):
        prompt = tok.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=True, return_dict=False)
        assert mask == [0] * len(prompt) + [1] * (len(own) - len(prompt)) + [1]


def _hf_style_loss(model, block: np.ndarray, mask: np.ndarray) -> float:
    """transformers' own loss of the blocks: labels are the tokens, -100 where the mask says a token is no
    target (the prompt's), input_ids the whole block; the model shifts them and averages F.cross_entropy."""
    import torch

    block = block.astype(np.int64)
    labels = np.where(mask == 1, block, -100)
    with torch.no_grad():
        return float(model.lm(input_ids=torch.from_numpy(block), labels=torch.from_numpy(labels)).loss)


@pytest.mark.parametrize("loss", ["standard", "chunked"])
def test_the_loss_on_answers_is_transformers_loss_with_prompt_labels_ignored(tmp_path, loss):
    """A training batch and a validation batch of --loss-on completion: memtrain's loss (standard and
    chunked kernels) equals transformers' loss of the same blocks with labels -100 on the prompt's
    tokens; a batch holding no answer gives 0 and zero gradients (every kernel's 0/0 would be NaN)."""
    import torch

    from memtrain.config.run import build_config
    from memtrain.data import make_train_loader, make_val_batches, prepare_tokens
    from memtrain.models.families import data_tokenizer
    from memtrain.techniques import make_precision
    from memtrain.training.step import build_state

    model_dir = _chat_folder(tmp_path / "qwen2", CHATML)
    data = _records(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])
    cfg = build_config({"model": str(model_dir), "data": str(data), "cache_dir": str(tmp_path / "cache"), "seq_len": 32,
                        "data_format": "chat", "loss_on": "completion", "val_fraction": 0.2, "loss": loss,
                        "loss_chunk": 16, "dropout": 0.0})
    splits = prepare_tokens(cfg.data, progress=False, tokenizer=data_tokenizer(cfg))
    torch.manual_seed(0)
    state = build_state(cfg, torch.device("cpu"), make_precision("fp32", torch.device("cpu")))
    model = state.model
    loader = make_train_loader(splits.train, 32, 4, seed=1, mask=splits.train_mask)
    x, y = loader.next_batch()
    order = loader._sampler().epoch_order(0)[:4]
    blocks = np.stack([np.asarray(splits.train[i * 33:(i + 1) * 33]) for i in order])
    masks = np.stack([np.asarray(splits.train_mask[i * 33:(i + 1) * 33]) for i in order])
    assert np.array_equal(x.numpy(), blocks[:, :-1]) and (y == -100).any() and (y != -100).any()
    with torch.no_grad():
        ours = float(model(x, y))
    assert ours == pytest.approx(_hf_style_loss(model, blocks, masks), rel=1e-5)

    (vx, vy), = make_val_batches(splits.val, 32, 2, 2, mask=splits.val_mask)
    vblocks, vmasks = np.asarray(splits.val[:66]).reshape(2, 33), np.asarray(splits.val_mask[:66]).reshape(2, 33)
    with torch.no_grad():
        assert float(model(vx, vy)) == pytest.approx(_hf_style_loss(model, vblocks, vmasks), rel=1e-5)

    prompt_only = torch.full_like(y, -100)
    lost = model(x, prompt_only)
    lost.backward()
    assert float(lost) == 0.0
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() and not g.any() for g in grads)


def test_plain_text_keeps_the_ids_it_had_before_data_formats(small_corpus, tmp_path):
    """The text path is untouched: the small corpus's GPT-2 ids hash as they did before --data-format
    and --loss-on existed (pinned on the commit before them), with no target mask."""
    import hashlib

    splits, _ = _tokens(tmp_path, small_corpus, None, val_fraction=0.05)
    assert splits.train_mask is None and splits.val_mask is None
    assert (len(splits.train), len(splits.val)) == (18002, 1438)
    assert hashlib.sha256(np.asarray(splits.train).tobytes()).hexdigest() == \
        "855868dbaf890a37a5263aeae6ede3eb19e1ffe51112b2560cb0b56facc99dec"
    assert hashlib.sha256(np.asarray(splits.val).tobytes()).hexdigest() == \
        "d270f40d4555bceec6bd518da6af135410c0b7161756f8d469ccea7bff3ea1b9"


def test_our_gpt_trains_on_the_completions_of_plain_prompt_completion_records(tmp_path, capsys):
    """Plain-string prompt-completion needs no template: our GPT (GPT-2's BPE, offsets from its ids)
    trains on the completions; result.json counts the answer tokens the losses average and the
    summary line says val loss is over them. Data without an answer, or validation blocks without
    one, are one error line before the first step."""
    from memtrain.data.tokenizer import get_tokenizer

    pairs = [(f"Question {i}: how do I sort a list?", f" Use sorted(x{i}).") for i in range(60)]
    data = _records(tmp_path / "pc.jsonl", [{"prompt": p, "completion": c} for p, c in pairs])
    splits, _ = _tokens(tmp_path, data, None, data_format="prompt-completion", loss_on="completion")
    gpt2 = get_tokenizer()
    p, c = pairs[0]
    n_prompt, n_all = len(gpt2.encode_ordinary(p)), len(gpt2.encode_ordinary(p + c))
    first = 0 if not _split_of(len(pairs))[0] else None
    assert first == 0  # the first record is a training one
    assert np.asarray(splits.train_mask[:n_all + 1]).tolist() == [0] * n_prompt + [1] * (n_all - n_prompt) + [1]

    out = tmp_path / "run"
    run = ["--steps", "2", "--seq-len", "16", "--batch-size", "2", "--val-blocks", "4", "--val-fraction", "0.2",
           "--no-progress", "--cache-dir", str(tmp_path / "cache")]
    gpt = ["--d-model", "32", "--n-heads", "4", "--n-layers", "2", "--d-ff", "64", "--max-seq-len", "64"]
    assert main(["train", "--data", str(data), "--loss-on", "completion", "--data-format", "prompt-completion", *gpt, *run,
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads((out / "result.json").read_text())
    d = result["data"]
    assert 0 < d["val_target_tokens_evaluated"] < d["val_tokens_evaluated"] and d["train_target_tokens"] < d["train_tokens"]
    assert f"on the {d['val_target_tokens_evaluated']:,} answer tokens of" in printed
    assert all(np.isfinite(result["loss_history"]))

    model = _chat_folder(tmp_path / "qwen2", CHATML)  # conversations without an assistant turn: no answer
    asked = _records(tmp_path / "asked.jsonl", [{"messages": c[:1]} for c in CONVERSATIONS])
    assert main(["train", "--model", str(model), "--data", str(asked), "--loss-on", "completion", "--data-format", "chat",
                 *run, "--out", str(tmp_path / "r2")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no answer token" in err and not (tmp_path / "r2").exists()
    assert main(["train", "--data", str(data), "--loss-on", "completion", "--data-format", "text",
                 "--out", str(tmp_path / "r3")]) == 2
    err = capsys.readouterr().err  # refused by train (estimate, plan and maxbatch take it without data)
    assert err.count("\n") == 1 and "--data-format text has none" in err and not (tmp_path / "r3").exists()


def test_a_template_that_renders_first_turns_otherwise_later_is_refused_for_answers_only(tmp_path):
    """A template whose render of the first turns changes once more follow (here: it opens with the
    number of turns) leaves no prefix to tell answers from prompts: --loss-on completion names the
    record and --loss-on all; --loss-on all renders it as it is."""
    from memtrain.config.run import ConfigError

    model = _chat_folder(tmp_path / "qwen2", "{{ messages | length }}" + CHATML)
    data = _records(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])
    with pytest.raises(ConfigError, match=r"renders the first turns of record 1 of .* differently .*--loss-on all"):
        _tokens(tmp_path, data, model, data_format="chat", loss_on="completion")
    splits, _ = _tokens(tmp_path, data, model, data_format="chat")
    assert splits.train_mask is None and len(splits.train)


def test_a_chat_template_reaching_for_python_is_stopped_by_the_sandbox(tmp_path):
    """A template is code in a file memtrain reads: transformers renders it in jinja's immutable
    sandbox, so one that reaches for Python's classes is refused (one line naming the record), never run."""
    from memtrain.config.run import ConfigError

    model = _chat_folder(tmp_path / "qwen2", "{{ ''.__class__.__mro__[1].__subclasses__() }}" + CHATML)
    data = _records(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])
    with pytest.raises(ConfigError, match=r"the chat template refused record 1 of .*unsafe"):
        _tokens(tmp_path, data, model, data_format="chat")


@pytest.mark.parametrize("damage", ["byte", "short", "missing"])
def test_a_damaged_target_mask_in_the_cache_is_rebuilt(tmp_path, damage):
    """A cached entry's mask that is not one 0/1 byte per id (a byte 2, a truncated or missing file)
    is not used: the entry is tokenized again, with the same mask."""
    model = _chat_folder(tmp_path / "qwen2", CHATML)
    data = _records(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])
    first, _ = _tokens(tmp_path, data, model, data_format="chat", loss_on="completion")
    want = np.asarray(first.train_mask).copy()
    mask = Path(first.cache_path) / "train.mask"
    del first
    if damage == "byte":
        with open(mask, "r+b") as f:
            f.write(b"\x02")
    elif damage == "short":
        mask.write_bytes(mask.read_bytes()[:-1])
    else:
        mask.unlink()
    again, _ = _tokens(tmp_path, data, model, data_format="chat", loss_on="completion")
    assert not again.from_cache and np.array_equal(np.asarray(again.train_mask), want)


def test_validation_blocks_without_an_answer_are_one_error_line(tmp_path, capsys):
    """--loss-on completion with a validation block of prompt tokens only (here: one block of 8, inside
    the first record's system turn) has no validation loss to average: one line before the first step."""
    model = _chat_folder(tmp_path / "qwen2", CHATML)
    data = _records(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])
    out = tmp_path / "run"
    assert main(["train", "--model", str(model), "--data", str(data), "--data-format", "chat", "--loss-on", "completion",
                 "--seq-len", "8", "--batch-size", "1", "--val-blocks", "1", "--val-fraction", "0.2", "--steps", "1",
                 "--no-progress", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "validation batch(es) (--val-blocks 1) hold no answer token" in err, err
    assert not out.exists()


LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def _two_fine_records(fmt: str) -> list[dict]:
    """Two well-formed records of ``fmt`` (chat or prompt-completion), for a bad third one to follow."""
    if fmt == "chat":
        return [{"messages": c} for c in CONVERSATIONS[:2]]
    return [{"prompt": c[:-1], "completion": c[-1:]} for c in CONVERSATIONS[:2]]


def _train_one_step(model: Path, data: Path, fmt: str, tmp_path: Path, out: Path) -> int:
    """train's exit code for one tiny step on ``data`` read as ``fmt``."""
    return main(["train", "--model", str(model), "--data", str(data), "--data-format", fmt, "--steps", "1",
                 "--seq-len", "16", "--batch-size", "1", "--no-progress", "--cache-dir", str(tmp_path / "cache"),
                 "--out", str(out)])


@pytest.mark.parametrize("fmt, record, words", [
    ("chat", {"messages": [{"role": "user", "content": "loop"}, {"role": "assistant", "content": "ok"}]},
     "did not render within 1 s"),
    ("prompt-completion", {"prompt": [{"role": "user", "content": "grow"}],
                           "completion": [{"role": "assistant", "content": "ok"}]},
     "made a text of 5,000,"),
])
def test_a_chat_template_that_loops_or_grows_on_one_record_is_one_line_naming_it(tmp_path, capsys, monkeypatch, fmt,
                                                                                  record, words):
    """The template comes with the model folder and renders every record: one that loops (10**10
    iterations) hung training-data preparation, one that printed millions of characters had them
    tokenized. Each render is bounded as generate --chat's is: one line naming the record, exit 2,
    nothing written."""
    import memtrain.models.tokenizer as tokenizer

    monkeypatch.setattr(tokenizer, "CHAT_TEMPLATE_SECONDS", 1.0)
    template = ("{% if messages[0]['content'] == 'loop' %}" + LOOPS + "{% endif %}"
                "{% if messages[0]['content'] == 'grow' %}{{ 'x' * 5000000 }}{% endif %}" + CHATML)
    model = _chat_folder(tmp_path / "qwen2", template)
    fine = _two_fine_records(fmt)
    data = _records(tmp_path / "records.jsonl", [*fine, record])
    out = tmp_path / "run"
    assert _train_one_step(model, data, fmt, tmp_path, out) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: the --model's chat template ") and words in err, err
    assert "for record 3 of " in err and "fix the chat_template" in err and not out.exists()


@pytest.mark.parametrize("fmt", ["chat", "prompt-completion"])
def test_a_record_too_long_to_render_is_blamed_on_the_record_not_the_template(tmp_path, capsys, fmt):
    """A record whose own messages hold more characters than a render may (4 Mi) passed the bound
    through no fault of the template, yet its line said "fix the chat_template": it names the
    record's size and says to split it."""
    from memtrain.models.tokenizer import MAX_CHAT_CHARS

    model = _chat_folder(tmp_path / "qwen2", CHATML)
    long = [{"role": "user", "content": "word " * (MAX_CHAT_CHARS // 5 + 10)}, {"role": "assistant", "content": "ok"}]
    fine = _two_fine_records(fmt)
    record = {"messages": long} if fmt == "chat" else {"prompt": long[:1], "completion": long[1:]}
    data = _records(tmp_path / "records.jsonl", [*fine, record])
    out = tmp_path / "run"
    assert _train_one_step(model, data, fmt, tmp_path, out) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: record 3 of "), err
    assert f"characters of messages, more than one rendered record may ({MAX_CHAT_CHARS:,})" in err, err
    assert "split the conversation" in err and "fix the chat_template" not in err and not out.exists()
