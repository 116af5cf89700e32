"""--chat-template FILE and --chat-template-kwargs JSON (TRL's chat_template_path and chat_template_kwargs):
a template given beside the model renders its records as the model's own would (same sandbox, same bounds),
keys the token cache, reaches export and generate --chat; memtrain's GPT trains on chat data with one."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from memtrain.cli import main

pytest.importorskip("transformers")
pytest.importorskip("datasets")

from test_chat_data import CHATML, CONVERSATIONS, LOOPS, _chat_folder, _records, _split_of, _tokens  # noqa: E402

GPT = ["--d-model", "32", "--n-heads", "4", "--n-layers", "2", "--d-ff", "64", "--max-seq-len", "64"]
# Qwen3's switch, reduced: an assistant's turn opens with an empty think block when thinking is off.
NO_THINK = "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
THINKING = CHATML.replace("<|im_start|>{{ message['role'] }}\n",
                          "<|im_start|>{{ message['role'] }}\n{% if message['role'] == 'assistant' %}" + NO_THINK
                          + "{% endif %}").replace("<|im_start|>assistant\n{% endif %}",
                                                   "<|im_start|>assistant\n" + NO_THINK + "{% endif %}")


def _template(tmp_path: Path, text: str, name: str = "chat.jinja") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _run(tmp_path: Path, data: Path, *flags: str, out: str = "run") -> int:
    return main(["train", "--data", str(data), "--steps", "2", "--seq-len", "32", "--batch-size", "2",
                 "--val-fraction", "0.2", "--val-blocks", "2", "--no-progress", "--cache-dir", str(tmp_path / "cache"),
                 *flags, "--out", str(tmp_path / out)])


def test_a_given_template_renders_a_base_model_without_one_and_keys_the_cache(tmp_path):
    """A folder whose tokenizer has no template (a base model) was refused; with --chat-template its
    records are the ids of apply_chat_template(messages, chat_template=FILE's text), closed by eos. Another
    file's text is another cache entry (the tokenizer's identity is the same)."""
    plain = _chat_folder(tmp_path / "base", None)
    data = _records(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])
    template = _template(tmp_path, CHATML)
    splits, tokenizer = _tokens(tmp_path, data, plain, data_format="chat", chat_template=str(template))
    tok, eos = tokenizer.tok, tokenizer.eot_id
    want: list[int] = []
    for messages, val in zip(CONVERSATIONS, _split_of(len(CONVERSATIONS))):
        if not val:
            ids = list(tok.apply_chat_template(messages, chat_template=CHATML, tokenize=True, return_dict=False))
            want += ids if ids[-1] == eos else ids + [eos]
    assert np.asarray(splits.train).tolist() == want

    other = _template(tmp_path, CHATML.replace("You are a helpful assistant.", "Be terse."), "other.jinja")
    again, _ = _tokens(tmp_path, data, plain, data_format="chat", chat_template=str(other))
    assert not again.from_cache and again.cache_path != splits.cache_path and len(again.train) < len(splits.train)


def test_our_gpt_trains_on_chat_data_with_a_given_template_and_export_and_generate_keep_it(tmp_path, capsys):
    """memtrain's GPT (GPT-2's BPE, no template of its own) refused chat data; with --chat-template it
    trains on the answers, `export` writes the template into the exported tokenizer (apply_chat_template
    works there, as the file renders), and generate --chat on the checkpoint frames the prompt with it."""
    from transformers import AutoTokenizer

    from memtrain.inference.generate import from_checkpoint

    data = _records(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])
    template = _template(tmp_path, CHATML)
    ckpt = tmp_path / "run" / "ck.pt"
    assert _run(tmp_path, data, "--data-format", "chat", "--chat-template", str(template), "--loss-on", "completion",
                *GPT, "--save", str(ckpt)) == 0
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert 0 < result["data"]["train_target_tokens"] < result["data"]["train_tokens"]
    assert result["config"]["data"]["chat_template"] == str(template)

    assert main(["export", str(ckpt), str(tmp_path / "exp")]) == 0
    exported = AutoTokenizer.from_pretrained(str(tmp_path / "exp"))
    asked = [{"role": "user", "content": "How do I sort?"}]
    framed = exported.apply_chat_template(asked, tokenize=False, add_generation_prompt=True)
    assert framed == exported.apply_chat_template(asked, chat_template=CHATML, tokenize=False, add_generation_prompt=True)
    assert framed.startswith("<|im_start|>system\n")

    _, codec, _ = from_checkpoint(ckpt)
    assert codec.chat is not None
    assert codec.chat("How do I sort?") == exported(framed, add_special_tokens=False)["input_ids"]
    assert codec.encode("plain text") == exported("plain text", add_special_tokens=False)["input_ids"]
    capsys.readouterr()
    assert main(["generate", str(ckpt), "--chat", "--prompt", "How do I sort?", "--max-new-tokens", "2"]) == 0

    template.unlink()  # a plain prompt needs no template; --chat says where the run's file was
    assert main(["generate", str(ckpt), "--prompt", "How do I", "--max-new-tokens", "2"]) == 0
    capsys.readouterr()
    assert main(["generate", str(ckpt), "--chat", "--prompt", "How do I sort?", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--chat-template {str(template)!r} not found" in err and "put it back" in err


def test_chat_template_kwargs_reach_every_render_the_cache_key_and_generate(tmp_path):
    """{"enable_thinking": false} reaches the template (Qwen3's empty think block opens each answer's
    turn), is part of the cache key, and generate --chat on the run's checkpoint renders with it."""
    from memtrain.inference.generate import from_checkpoint

    model = _chat_folder(tmp_path / "qwen2", THINKING)
    convs = _records(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])
    plain, tokenizer = _tokens(tmp_path, convs, model, data_format="chat", loss_on="completion")
    off, _ = _tokens(tmp_path, convs, model, data_format="chat", loss_on="completion",
                     chat_template_kwargs='{"enable_thinking": false}')
    decode = tokenizer.tok.decode
    assert not off.from_cache and off.cache_path != plain.cache_path
    assert "<think></think>" in decode(np.asarray(off.train).tolist())
    assert "<think>" not in decode(np.asarray(plain.train).tolist())
    # the think block opens each answer, a prompt token: the answers' targets are the same count
    assert int(np.asarray(off.train_mask).sum()) == int(np.asarray(plain.train_mask).sum())

    ckpt = tmp_path / "run" / "ck.pt"
    assert _run(tmp_path, convs, "--model", str(model), "--data-format", "chat",
                "--chat-template-kwargs", '{"enable_thinking": false}', "--save", str(ckpt)) == 0
    _, codec, _ = from_checkpoint(ckpt)
    assert codec.decode(codec.chat("Hi")).endswith("<|im_start|>assistant\n<think></think>")


@pytest.mark.parametrize("value, says", [
    ("[1, 2]", "is a JSON list, not an object"),
    ("{enable_thinking: false}", "is not JSON"),
    ('{"enable_thinking": [false]}', "value of 'enable_thinking' is a list"),
    ('{"add_generation_prompt": true}', "is an argument memtrain gives apply_chat_template itself"),
    ('{"not a name": 1}', "is not a name a template can read"),
])
def test_chat_template_kwargs_that_are_no_object_of_plain_values_are_one_line(tmp_path, capsys, value, says):
    data = _records(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])
    assert _run(tmp_path, data, "--data-format", "chat", "--chat-template-kwargs", value) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --chat-template-kwargs ") and says in err, err
    assert not (tmp_path / "run").exists()


def test_the_reserved_names_are_apply_chat_templates_own_arguments():
    """The keys --chat-template-kwargs refuses cover every named argument of apply_chat_template (one
    passed twice is transformers' TypeError, not a line saying what to drop)."""
    import inspect

    from transformers import PreTrainedTokenizerBase

    from memtrain.config.run import TEMPLATE_RESERVED

    named = {n for n, p in inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters.items()
             if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and n != "self"}
    assert named <= TEMPLATE_RESERVED, named - TEMPLATE_RESERVED


def _bad_template(tmp_path: Path, kind: str) -> Path:
    if kind == "missing":
        return tmp_path / "nope.jinja"
    if kind == "folder":
        (tmp_path / "dir.jinja").mkdir()
        return tmp_path / "dir.jinja"
    if kind == "fifo":  # opened, it would block the run for ever
        os.mkfifo(tmp_path / "pipe.jinja")
        return tmp_path / "pipe.jinja"
    path = tmp_path / f"{kind}.jinja"
    if kind == "large":
        path.write_text("x" * ((1 << 20) + 1))
    elif kind == "binary":
        path.write_bytes(b"\xff\xfe{{ messages }}")
    elif kind == "syntax":
        path.write_text("{% for message in messages %}{{ message['content'] }}")  # no endfor
    else:
        path.write_text(" \n")
    return path


@pytest.mark.parametrize("kind, says", [
    ("missing", "not found"), ("folder", "not a regular file"), ("fifo", "is a FIFO"), ("large", "larger than 1,048,576 bytes"),
    ("binary", "is not UTF-8 text"), ("syntax", "is not a jinja template"), ("empty", "is empty"),
])
def test_a_template_file_that_cannot_be_one_is_one_line_before_anything_is_written(tmp_path, capsys, kind, says):
    data = _records(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])
    path = _bad_template(tmp_path, kind)
    assert _run(tmp_path, data, "--data-format", "chat", "--chat-template", str(path), *GPT) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: --chat-template {str(path)!r} ") and says in err, err
    assert not (tmp_path / "run").exists()


def test_the_template_flags_over_text_data_are_refused(tmp_path, capsys):
    """--data-format text renders no record: a template given there would be silently unused."""
    for flag, value in (("--chat-template", str(_template(tmp_path, CHATML))), ("--chat-template-kwargs", "{}")):
        assert _run(tmp_path, _records(tmp_path / "t.jsonl", [{"text": "a b c"}] * 8), flag, value) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"drop {flag}" in err and "--data-format text renders none" in err, err


def test_a_given_template_runs_in_the_sandbox_and_within_the_bounds(tmp_path, monkeypatch):
    """A file is code memtrain renders: one reaching for Python's classes is refused by jinja's sandbox,
    one that loops is stopped at the bound; each is one line naming the record and the file."""
    import memtrain.models.tokenizer as tokenizer
    from memtrain.config.run import ConfigError

    monkeypatch.setattr(tokenizer, "CHAT_TEMPLATE_SECONDS", 1.0)
    plain = _chat_folder(tmp_path / "base", None)
    data = _records(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS[:3]])
    escape = _template(tmp_path, "{{ ''.__class__.__mro__[1].__subclasses__() }}" + CHATML, "escape.jinja")
    with pytest.raises(ConfigError, match=r"the chat template refused record 1 of .*unsafe"):
        _tokens(tmp_path, data, plain, data_format="chat", chat_template=str(escape))
    loop = _template(tmp_path, LOOPS + CHATML, "loop.jinja")
    with pytest.raises(ConfigError, match=r"the --chat-template's chat template did not render within 1 s for record 1 "
                                          r"of .*; fix '.*loop\.jinja'"):
        _tokens(tmp_path, data, plain, data_format="chat", chat_template=str(loop))


def test_a_config_files_mapping_is_the_same_kwargs_as_the_flags_json(tmp_path):
    """In a YAML config the kwargs are a mapping (it was refused: "expects str, got a dict"); it is the
    object the flag's JSON gives, spelled one way (sorted keys), so both key the cache alike."""
    from memtrain.config.file import load_config_file
    from memtrain.config.run import build_config

    path = tmp_path / "run.yaml"
    path.write_text("data: chat.jsonl\ndata_format: chat\nchat_template_kwargs:\n  enable_thinking: false\n  tone: dry\n")
    from_file = build_config(load_config_file(str(path))).data.chat_template_kwargs
    from_flag = build_config({"data": "chat.jsonl", "data_format": "chat",
                              "chat_template_kwargs": '{"tone": "dry", "enable_thinking": false}'}).data.chat_template_kwargs
    assert from_file == from_flag == '{"enable_thinking": false, "tone": "dry"}'


def test_a_relative_template_is_read_where_the_run_was_launched(tmp_path, monkeypatch):
    """A run's relative --chat-template is relative to the folder it was launched from, as its --data
    is: `export` from another folder found no file there."""
    from transformers import AutoTokenizer

    project = tmp_path / "proj"
    project.mkdir()
    _records(project / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])
    _template(project, CHATML)
    monkeypatch.chdir(project)
    assert main(["train", "--data", "chat.jsonl", "--data-format", "chat", "--chat-template", "chat.jinja", *GPT,
                 "--steps", "1", "--seq-len", "32", "--batch-size", "2", "--val-fraction", "0.2", "--no-progress",
                 "--cache-dir", str(tmp_path / "cache"), "--out", "run", "--save", "run/ck.pt"]) == 0
    monkeypatch.chdir(tmp_path)
    assert main(["export", str(project / "run" / "ck.pt"), "exp"]) == 0
    assert AutoTokenizer.from_pretrained(str(tmp_path / "exp")).chat_template == CHATML


def test_a_template_edited_in_place_is_other_data_for_resume_and_bench(tmp_path, capsys):
    """The data fingerprint (what --resume and a bench's settings compare) held the records' files only:
    a --chat-template edited in place resumed the data position on other tokens and called a bench's rows
    done. It holds the file's content; without a template it is what it was."""
    from memtrain.config.run import build_config
    from memtrain.data.sources import data_fingerprint

    data = _records(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])
    template = _template(tmp_path, CHATML)
    plain = build_config({"data": str(data), "data_format": "chat"}).data
    given = build_config({"data": str(data), "data_format": "chat", "chat_template": str(template)}).data
    assert data_fingerprint(plain) == data_fingerprint(build_config({"data": str(data)}).data)
    ckpt = tmp_path / "run" / "ck.pt"
    assert _run(tmp_path, data, "--data-format", "chat", "--chat-template", str(template), *GPT, "--steps", "1",
                "--save", str(ckpt)) == 0
    before = data_fingerprint(given)
    template.write_text(CHATML.replace("You are a helpful assistant.", "Be terse."))
    assert data_fingerprint(given) != before
    capsys.readouterr()
    assert main(["train", "--resume", str(ckpt), "--steps", "3", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "or the --chat-template file that renders it, changed since" in err, err


def test_a_template_given_through_a_link_is_read(tmp_path):
    """The file is the user's own: a link to a template kept elsewhere is followed (its target checked)."""
    from memtrain.config.run import build_config
    from memtrain.models.tokenizer import run_chat_template

    (tmp_path / "shared").mkdir()
    target = _template(tmp_path / "shared", CHATML)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "chat.jinja").symlink_to(target)
    cfg = build_config({"data": "chat.jsonl", "data_format": "chat", "chat_template": str(tmp_path / "run" / "chat.jinja")})
    assert run_chat_template(cfg) == CHATML


def test_a_base_model_run_exports_the_given_template_and_generates_with_it(tmp_path):
    """A transformers folder without a template, trained with --chat-template: the exported tokenizer
    holds the file's template, and generate --chat on the checkpoint frames a prompt as the export does."""
    from transformers import AutoTokenizer

    from memtrain.inference.generate import from_checkpoint

    base = _chat_folder(tmp_path / "base", None)
    data = _records(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])
    template = _template(tmp_path, CHATML)
    ckpt = tmp_path / "run" / "ck.pt"
    assert _run(tmp_path, data, "--model", str(base), "--data-format", "chat", "--chat-template", str(template),
                "--steps", "1", "--save", str(ckpt)) == 0
    assert main(["export", str(ckpt), str(tmp_path / "exp")]) == 0
    exported = AutoTokenizer.from_pretrained(str(tmp_path / "exp"))
    assert exported.chat_template == CHATML and AutoTokenizer.from_pretrained(str(base)).chat_template is None
    asked = [{"role": "user", "content": "Hi"}]
    _, codec, _ = from_checkpoint(ckpt)
    assert codec.chat("Hi") == list(exported.apply_chat_template(asked, add_generation_prompt=True, tokenize=True,
                                                                 return_dict=False))
