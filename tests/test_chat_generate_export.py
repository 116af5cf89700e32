"""A run trained on chat records, sampled with ``generate --chat`` and exported: the prompt is framed
by the template the records were rendered with, the reply ends at the template's end of turn, and
the export keeps the template for transformers' ``apply_chat_template``."""

from __future__ import annotations

import pytest

from memtrain.cli import main

pytest.importorskip("transformers")

from test_chat_data import CHATML, CONVERSATIONS, _chat_folder, _records  # noqa: E402  (the tests' tiny Qwen2)


def _base_model_folder(tmp_path):
    """The tiny Qwen2 as a base model's tokenizer is (Qwen2.5's): eos <|endoftext|>, ChatML's turns
    closed by <|im_end|>."""
    from transformers import AutoConfig, AutoTokenizer

    folder = _chat_folder(tmp_path / "chat", CHATML)
    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.eos_token = "<|endoftext|>"
    tok.save_pretrained(str(folder))
    config = AutoConfig.from_pretrained(str(folder))
    config.eos_token_id = tok.eos_token_id
    config.save_pretrained(str(folder))
    return folder, tok


def test_a_reply_ends_at_the_templates_end_of_turn_not_at_a_base_models_eos(tmp_path):
    from memtrain.inference.generate import chat_reply, transformers_codec

    _, tok = _base_model_folder(tmp_path)
    im_end, eos = tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id
    assert im_end != eos
    codec = transformers_codec(tok)
    assert codec.end_id == im_end  # it was the eos, so a reply ran on through <|im_end|>
    assert chat_reply([5, im_end, 7, eos], codec.end_id, codec.eos_id) == [5]
    assert chat_reply([5, eos, 7, im_end], codec.end_id, codec.eos_id) == [5]


def test_generate_chat_on_a_chat_run_and_its_export_frames_and_cuts_as_the_template(tmp_path, capsys):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, tok = _base_model_folder(tmp_path)
    data = _records(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])
    ckpt, export = tmp_path / "run.pt", tmp_path / "export"
    assert main(["train", "--model", str(folder), "--data", str(data), "--data-format", "chat", "--loss-on", "completion",
                 "--steps", "2", "--seq-len", "32", "--batch-size", "2", "--cache-dir", str(tmp_path / "cache"),
                 "--out", str(tmp_path / "out"), "--save", str(ckpt)]) == 0
    assert main(["export", str(ckpt), str(export)]) == 0
    messages = [{"role": "user", "content": "How do I sort a list?"}]
    exported = AutoTokenizer.from_pretrained(str(export))
    assert exported.chat_template == CHATML  # transformers' apply_chat_template works on the export
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert exported.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False) == ids
    capsys.readouterr()
    printed = []
    for source in (ckpt, export):
        assert main(["generate", str(source), "--chat", "--prompt", messages[0]["content"], "--temperature", "0",
                     "--max-new-tokens", "10"]) == 0
        printed.append(capsys.readouterr().out)
    model = AutoModelForCausalLM.from_pretrained(str(export)).eval()
    with torch.no_grad():
        new = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=10, eos_token_id=None,
                             pad_token_id=0)[0, len(ids):].tolist()
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    reply = new[:new.index(im_end)] if im_end in new else new
    assert printed[0] == printed[1] == tok.decode(reply, clean_up_tokenization_spaces=False) + "\n"


def test_chat_without_a_prompt_frames_an_empty_user_message_as_the_help_says(tmp_path, capsys):
    """--prompt's help gave only its text default ("start of a document"); under --chat the
    default is framed as an empty user message, which the help now says."""
    from memtrain.inference.generate import transformers_codec

    _, tok = _base_model_folder(tmp_path)
    empty = tok.apply_chat_template([{"role": "user", "content": ""}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False)
    assert transformers_codec(tok).chat("") == list(empty)
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "with --chat, an empty user message" in text


def test_the_end_of_turn_is_the_first_special_token_after_the_answer_not_the_text_before_it(tmp_path):
    """Llama 2's template closes an answer with a space, then eos: the reply ends at the eos, not at
    the space's token (which would cut every reply at its first space)."""
    from transformers import AutoTokenizer

    from memtrain.inference.generate import transformers_codec

    spaced = ("{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
              "{% else %} {{ m['content'] }} {{ eos_token }}{% endif %}{% endfor %}")
    tok = AutoTokenizer.from_pretrained(str(_chat_folder(tmp_path / "llama", spaced, family="llama")))
    assert tok(" </s>", add_special_tokens=False)["input_ids"][0] != tok.eos_token_id  # the space is a token
    assert transformers_codec(tok).end_id == tok.eos_token_id
