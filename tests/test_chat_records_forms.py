"""Chat records in the forms users bring besides plain ``{"role", "content"}`` strings: content as a
list of text parts, tool calls and tool definitions, misspelled roles, and turns that hold no answer."""

from __future__ import annotations

import pytest

from memtrain.config.run import ConfigError
from memtrain.data.records import make_renderer

pytest.importorskip("transformers")

from test_chat_data import CHATML, _chat_folder  # noqa: E402  (the tests' tiny Qwen2 folder)

# ChatML that writes tool definitions into the system turn and an assistant's tool calls as JSON, as
# Qwen2.5's template does (reduced).
TOOLS_CHATML = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] %}"
    "{{ message['content'] }}{% endif %}{% if message['tool_calls'] %}{% for c in message['tool_calls'] %}"
    "<tool_call>{{ c['function']['name'] }}</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tokenizer(folder):
    from memtrain.config.run import build_config
    from memtrain.models.families import data_tokenizer

    return data_tokenizer(build_config({"model": str(folder), "data": "chat.jsonl", "data_format": "chat"}))


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    return _tokenizer(_chat_folder(tmp_path_factory.mktemp("m") / "qwen2", CHATML))


def _render(tokenizer, record, fmt="chat"):
    return make_renderer(fmt, tokenizer, answers=True)(record, 1, "chat.jsonl")


def test_content_as_text_parts_is_the_content_as_transformers_flattens_it(chatml):
    """Text parts become one string as transformers flattens them for a text-only model
    (`transformers serve`'s get_processor_inputs_from_messages, Modality.LLM): parts "Sort it?" and
    "Keep it." were glued into "Sort it?Keep it."."""
    from transformers.cli.serving.utils import BaseHandler, Modality

    parts = [{"role": "user", "content": [{"type": "text", "text": "Sort it?"}, {"type": "text", "text": "Keep it."}]},
             {"role": "assistant", "content": [{"type": "text", "text": "Use sorted(x)."}]}]
    flat = BaseHandler.get_processor_inputs_from_messages(parts, Modality.LLM)
    assert flat[0]["content"] == "Sort it? Keep it."  # the oracle's rule, which the renders below must follow
    want, got = _render(chatml, {"messages": flat}), _render(chatml, {"messages": parts})
    assert got == want and got.answers == want.answers and got.answers
    assert "Sort it? Keep it." in got
    image = [{"role": "user", "content": [{"type": "image", "url": "a.png"}, {"type": "text", "text": "What?"}]}]
    with pytest.raises(ConfigError, match=r"record 1 .* message 1's content part 1 is 'image', not a text part"):
        _render(chatml, {"messages": image})
    captioned = [{"role": "user", "content": [{"type": "image", "text": "a cat"}]}]  # its caption is no text part
    with pytest.raises(ConfigError, match="content part 1 is 'image', not a text part"):
        _render(chatml, {"messages": captioned})


@pytest.mark.parametrize("role, meant", [("assitant", "assistant"), ("Assistant", "assistant"), ("usr", "user"),
                                         ("gpt", "assistant"), ("human", "user"), ("systen", "system"),
                                         ("Human", "user"), ("ASSISTANT", "assistant")])
def test_a_misspelled_role_is_one_error_naming_the_role_meant(chatml, role, meant):
    """A template renders any role: 'assitant' was a prompt turn, so --loss-on completion silently
    trained on nothing of it."""
    record = {"messages": [{"role": "user", "content": "Hi"}, {"role": role, "content": "Hello."}]}
    with pytest.raises(ConfigError, match=f"has role '{role}'; did you mean '{meant}'"):
        _render(chatml, record)


@pytest.mark.parametrize("role", ["narrator", "observation", "tool_response", "available_tools"])
def test_a_role_of_the_templates_own_is_kept(chatml, role):
    """Roles some templates define (ChatGLM3's observation, Granite's tool_response and
    available_tools) are no misspelling of a known one."""
    record = {"messages": [{"role": role, "content": "Night."}, {"role": "assistant", "content": "Hello."}]}
    assert f"<|im_start|>{role}\nNight." in _render(chatml, record)


def test_a_message_with_a_role_keeps_it_beside_a_stray_from_field(chatml):
    """ShareGPT's from/value is read only where a message has no role: a message with both is read by its role."""
    record = {"messages": [{"role": "user", "content": "Hi", "from": "human"}, {"role": "assistant", "content": "Yo"}]}
    assert _render(chatml, record) == _render(chatml, {"messages": [{"role": "user", "content": "Hi"},
                                                                    {"role": "assistant", "content": "Yo"}]})


@pytest.mark.parametrize("record, field", [({"messages": []}, "'messages'"),
                                           ({"prompt": [], "completion": [{"role": "assistant", "content": "Yo"}]},
                                            "'prompt'")])
def test_an_empty_conversation_is_one_error_naming_the_field(chatml, record, field):
    fmt = "chat" if "messages" in record else "prompt-completion"
    with pytest.raises(ConfigError, match=f"record 1 of 'chat.jsonl'.s {field} is not a non-empty list of messages"):
        _render(chatml, record, fmt)


def test_a_record_with_a_prompt_and_no_completion_is_text_under_auto(chatml):
    """--data-format auto reads a record as prompt-completion only when it has both fields; one with a
    prompt alone is a text record (its --text-field read by the caller), not a refusal."""
    render = make_renderer("auto", chatml, answers=True)
    assert render({"prompt": "Sort it?", "text": "Sort it with sorted(x)."}, 1, "chat.jsonl") is None
    assert render({"prompt": "Sort it?", "completion": " With sorted(x)."}, 1, "chat.jsonl").answers == ((8, 24),)


def test_an_assistant_turn_that_opens_a_conversation_is_an_answer_from_its_start(chatml):
    text = _render(chatml, {"messages": [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Hi"}]})
    (start, end), = text.answers
    assert start == 0 and text[:end].endswith("<|im_start|>assistant\nHello.<|im_end|>\n")


def test_turns_without_an_answer_have_no_target_span(chatml):
    """An empty answer trains on its end-of-turn marker only (as a {% generation %} span of the same
    template marks it); a trailing user turn and a system-only record hold no target."""
    empty = _render(chatml, {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}]})
    (start, end), = empty.answers
    assert empty[start:end] == "<|im_end|>\n"
    trailing = _render(chatml, {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"},
                                             {"role": "user", "content": "Bye"}]})
    assert [trailing[a:b] for a, b in trailing.answers] == ["Yo<|im_end|>\n"]
    assert _render(chatml, {"messages": [{"role": "system", "content": "Be brief."}]}).answers == ()


def test_tool_calls_and_tool_definitions_reach_the_template_as_trl_gives_them(tmp_path):
    """An assistant turn with tool_calls and no content was refused ("not a message with text 'role'
    and 'content'"); a record's tools were not given to the template. Both now render as
    apply_chat_template(messages, tools=tools) renders them, the call inside the answer's span."""
    tokenizer = _tokenizer(_chat_folder(tmp_path / "tools", TOOLS_CHATML))
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object", "properties": {}}}}]
    messages = [{"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "content": "5 C"}, {"role": "assistant", "content": "It is 5 C."}]
    text = _render(tokenizer, {"messages": messages, "tools": tools})
    assert text == tokenizer.tok.apply_chat_template(messages, tools=tools, tokenize=False)
    assert text.startswith("<|im_start|>system\nTools: get_weather")
    assert [text[a:b] for a, b in text.answers] == ["<tool_call>get_weather</tool_call><|im_end|>\n",
                                                    "It is 5 C.<|im_end|>\n"]
    with pytest.raises(ConfigError, match="'tools' is str; give a list"):
        _render(tokenizer, {"messages": messages, "tools": "get_weather"})
    # A prompt-completion record's tools reach the template too, prompt and completion alike.
    paired = _render(tokenizer, {"prompt": messages[:1], "completion": messages[3:], "tools": tools}, "prompt-completion")
    assert paired == tokenizer.tok.apply_chat_template([messages[0], messages[3]], tools=tools, tokenize=False)
    assert [paired[a:b] for a, b in paired.answers] == ["It is 5 C.<|im_end|>\n"]


# Drops an earlier assistant turn's content, as a reasoning model's template drops earlier turns'
# thinking: a turn renders otherwise once a later turn follows it.
DROPS_EARLIER = CHATML.replace("{{ message['content'] }}", "{% if message['role'] == 'assistant' and not loop.last %}"
                               "(earlier){% else %}{{ message['content'] }}{% endif %}")


@pytest.mark.parametrize("template, record, fmt", [
    (DROPS_EARLIER, {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"},
                                  {"role": "user", "content": "Bye"}]}, "chat"),
    ("{{ messages | length }}" + CHATML, {"prompt": [{"role": "user", "content": "Hi"}],
                                         "completion": [{"role": "assistant", "content": "Yo"}]}, "prompt-completion"),
])
def test_a_template_whose_first_turns_render_otherwise_later_has_no_answers_to_tell(tmp_path, template, record, fmt):
    """Its answers cannot be told from its prompt by comparing renders: refused for --loss-on
    completion, naming --loss-on all, under which it renders as it is."""
    tokenizer = _tokenizer(_chat_folder(tmp_path / "m", template))
    with pytest.raises(ConfigError, match="renders the first turns of record 1 .* differently .*give --loss-on all"):
        _render(tokenizer, record, fmt)
    assert make_renderer(fmt, tokenizer)(record, 1, "chat.jsonl").answers is None


def test_a_template_refusing_the_turns_before_an_answer_names_loss_on_all(tmp_path):
    """The answers are found by rendering the turns before each one with the generation prompt; a
    template that refuses that render is named with --loss-on all, which needs no such render."""
    refuses = CHATML + "{% if add_generation_prompt %}{{ raise_exception('no generation prompt') }}{% endif %}"
    tokenizer = _tokenizer(_chat_folder(tmp_path / "m", refuses))
    record = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}
    with pytest.raises(ConfigError, match=r"refused record 1 .*\(its turns up to an answer, for --loss-on completion\): "
                                          r"no generation prompt; fix the record or remove it; or give --loss-on all"):
        _render(tokenizer, record)


def test_records_rendered_before_tools_reached_the_template_are_tokenized_again(chatml, monkeypatch, tmp_path):
    """The cache key of record formats holds the rendering's version (an entry whose records were
    rendered without their tools is not reused); text data keeps its key."""
    from memtrain.config.run import build_config
    from memtrain.data import cache

    data = tmp_path / "chat.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "Hi"}]}\n')
    chat = build_config({"model": "tiny-llama", "data": str(data), "data_format": "chat"}).data
    text = build_config({"data": str(data)}).data
    keys = cache.cache_key(chat, chatml), cache.cache_key(text)
    monkeypatch.setattr(cache, "RENDER_VERSION", 1)
    assert cache.cache_key(chat, chatml) != keys[0] and cache.cache_key(text) == keys[1]


def test_loss_on_completion_over_records_auto_reads_as_text_is_one_error_line(tmp_path, capsys):
    """--data-format auto over records that are all text: --loss-on completion trained on every token,
    while the summary said it averaged answer tokens."""
    from memtrain.cli import main

    model = _chat_folder(tmp_path / "qwen2", CHATML)
    data = tmp_path / "text.jsonl"
    data.write_text("".join(f'{{"text": "plain text record number {i} with a few words"}}\n' for i in range(200)))
    out = tmp_path / "run"
    argv = ["train", "--model", str(model), "--data", str(data), "--data-format", "auto", "--loss-on", "completion",
            "--steps", "1", "--seq-len", "16", "--batch-size", "2", "--cache-dir", str(tmp_path / "cache"), "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --loss-on completion: every token") and "found no chat or prompt-completion" in err[-1]
    assert not (out / "result.json").exists()
