"""Instruction and chat records as documents: ``--data-format chat | prompt-completion | auto``.

TRL's two dataset formats a fine-tuner brings, read as TRL's ``SFTTrainer`` reads them:

* conversational: ``{"messages": [{"role": ..., "content": ...}, ...]}`` (or ShareGPT's
  ``{"conversations": [{"from": "human", "value": ...}, ...]}``), rendered by the model's own
  chat template (``tokenizer.apply_chat_template(messages, tokenize=False)``, no generation
  prompt);
* prompt-completion: ``{"prompt": ..., "completion": ...}``: two strings are joined
  (prompt + completion), two message lists are rendered as one conversation by the template.

A rendered conversation is a :class:`RecordText` marked ``templated``: the template writes the
conversation's own markers (a bos where the model has one), so the cache adds no bos before it (a
second one would follow); a plain prompt + completion is an ordinary document. The template is
rendered by transformers in jinja's sandbox: it cannot run Python.

With ``--loss-on completion`` a record also carries the character spans of its answers (TRL's
``assistant_only_loss`` / ``completion_only_loss``): each assistant turn from the end of its
header (the template's generation prompt) to the end of its render (its end-of-turn marker
included), found by rendering the conversation turn by turn and comparing the prefixes, which
works for templates without transformers' ``{% generation %}`` tags; the completion of a
prompt-completion record. The cache turns the spans into a per-token target mask.
"""

from __future__ import annotations

import difflib
from typing import Any, Callable, Optional, Protocol

from memtrain.errors import ChatTemplateLimit, ConfigError, first_line

# Raised when a record's rendering changes (its text or its answer spans), so cached ids of the
# old rendering are not reused (part of the token cache's key for every format but text).
RENDER_VERSION = 3  # 3: text parts joined by a space
CHAT_FIELDS = ("messages", "conversations")
PROMPT_FIELDS = ("prompt", "completion")
# ShareGPT's speaker names -> chat roles (TRL's maybe_convert_to_chatml uses the same map).
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool"}

# The roles chat templates know (OpenAI's and transformers' chat formats).
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer", "function", "ipython")
# Other formats' names for them, which a template would render as some unknown role.
ROLE_SYNONYMS = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant"}

Render = Callable[[dict[str, Any], int, str], Optional[str]]


class ChatTokenizer(Protocol):
    """What rendering needs of a model's tokenizer (memtrain.models.tokenizer.HFTokenizer)."""

    name: str

    @property
    def chat_template(self) -> Optional[str]: ...

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
                    tools: Optional[list[Any]] = None) -> str: ...


class RecordText(str):
    """A record's document: ``templated`` when a chat template rendered it (framed by the
    template: no bos added before it), and the character spans of its answers (``answers``,
    None when the run trains on every token)."""

    templated: bool
    answers: Optional[tuple[tuple[int, int], ...]]

    def __new__(cls, text: str, templated: bool, answers: Optional[list[tuple[int, int]]] = None) -> RecordText:
        self = super().__new__(cls, text)
        self.templated = templated
        self.answers = None if answers is None else tuple(answers)
        return self


def record_kind(record: dict[str, Any]) -> str:
    """``chat``, ``prompt-completion`` or ``text``: which format ``record``'s fields are (--data-format auto)."""
    if any(f in record for f in CHAT_FIELDS):
        return "chat"
    if all(f in record for f in PROMPT_FIELDS):
        return "prompt-completion"
    return "text"


def filled_kind(record: dict[str, Any]) -> Optional[str]:
    """``chat`` or ``prompt-completion`` by the fields that hold a value, else None. A JSON file
    read through ``datasets`` gives every record every column of the file, None where a record
    lacks it: a prompt-completion record of a file that also holds chat records has a
    ``messages`` of None, which :func:`record_kind` takes for a chat record."""
    if any(record.get(f) is not None for f in CHAT_FIELDS):
        return "chat"
    if all(record.get(f) is not None for f in PROMPT_FIELDS):
        return "prompt-completion"
    return None


def mixed_formats(first: tuple[str, int, str], other: tuple[str, int, str]) -> ConfigError:
    """The refusal of a ``--data`` that holds records of two formats under --data-format auto,
    naming both and where each starts (it said only that a record's 'messages' was no list of
    messages). One file or a folder of files: one --data is one dataset, and a dataset holds one
    format, as TRL's (its SFTTrainer reads the format off the first record, and ``datasets``
    refuses JSON files whose columns differ)."""
    (kind_a, at_a, file_a), (kind_b, at_b, file_b) = first, other
    if file_a == file_b:
        where = f"(the first: record {at_a}) and {kind_b} records (the first: record {at_b}) in {file_a!r}"
    else:
        where = f"(the first: record {at_a} of {file_a!r}) and {kind_b} records (the first: record {at_b} of {file_b!r})"
    return ConfigError(f"--data-format auto found {kind_a} records {where}; one --data holds one format: write every "
                       "record in one of them, or train on each format in a run of its own")


def no_template_reason(tokenizer: Optional[ChatTokenizer]) -> Optional[str]:
    """Why ``tokenizer`` cannot render a conversation (None: it can)."""
    if tokenizer is None:
        return "memtrain's GPT reads GPT-2's BPE, which has no chat template of its own"
    if not tokenizer.chat_template:
        return "the --model's tokenizer has no chat template (tokenizer_config.json's chat_template or chat_template.jinja)"
    return None


def template_refusal(fmt: str, tokenizer: Optional[ChatTokenizer]) -> Optional[ConfigError]:
    """The one-line refusal of rendering records as ``fmt`` with ``tokenizer``, or None."""
    why = no_template_reason(tokenizer)
    if why is None:
        return None
    return ConfigError(f"--data-format {fmt} renders conversations with the model's chat template, and {why}; give "
                       "--chat-template FILE (a .jinja template), or --model a folder whose tokenizer has one, or write "
                       "each record's text to one field and use --data-format text --text-field NAME")


def make_renderer(fmt: str, tokenizer: Optional[ChatTokenizer], answers: bool = False) -> Render:
    """``render(record, index, label)``: the document of one record read as ``fmt``; None for a
    record that is plain text under ``auto`` (the caller reads its text field). ``answers``
    (``--loss-on completion``): each document carries its answers' character spans."""

    # Under auto: the first record's format, its number and its file. Across the whole --data, not
    # per file: a folder of a chat file and a prompt-completion file mixes them as one file would.
    first: list[tuple[str, int, str]] = []

    def render(record: dict[str, Any], index: int, label: str) -> Optional[str]:
        kind = fmt
        if fmt == "auto":
            filled = filled_kind(record)
            kind = filled or record_kind(record)  # no format filled: record_kind's reading says what is wrong
            if filled is not None:
                if not first:
                    first.append((filled, index, label))
                if first[0][0] != filled:
                    raise mixed_formats(first[0], (filled, index, label))
        if kind == "text":
            return None
        where = f"record {index} of {label!r}"
        if kind == "chat":
            messages, tools = chat_messages(record, where), record_tools(record, where)
            text = _render(tokenizer, messages, where, tools=tools)
            return RecordText(text, True, _chat_answers(tokenizer, messages, text, where, tools) if answers else None)
        return _prompt_completion(record, tokenizer, where, answers)

    return render


def record_tools(record: dict[str, Any], where: str) -> Optional[list[Any]]:
    """The record's ``tools`` (function definitions), given to the template as TRL gives them
    (``apply_chat_template(messages, tools=...)``: a tool-aware template writes them into the
    prompt); None without any."""
    tools = record.get("tools")
    if tools is None or isinstance(tools, list):
        return tools
    raise ConfigError(f"{where}'s 'tools' is {type(tools).__name__}; give a list of tool (function) definitions or none")


def chat_messages(record: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """The record's conversation as ``{"role", "content"}`` messages (ShareGPT's from/value mapped)."""
    field = next((f for f in CHAT_FIELDS if f in record), None)
    if field is None:
        raise ConfigError(f"{where} has no {' or '.join(repr(f) for f in CHAT_FIELDS)} field (fields: "
                          f"{', '.join(map(str, record))}); give chat records or choose another --data-format")
    return messages_of(record[field], f"{where}'s {field!r}")


def messages_of(value: Any, where: str) -> list[dict[str, Any]]:
    """``value`` as a non-empty list of ``{"role", "content"}`` messages; ShareGPT's ``{"from", "value"}``
    turns are mapped to roles. Anything else is a ConfigError naming ``where``."""
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where} is not a non-empty list of messages; write it as "
                          '[{"role": "user", "content": "..."}, ...]')
    return [_message(m, f"{where} message {i}") for i, m in enumerate(value, 1)]


def _message(m: Any, where: str) -> dict[str, Any]:
    if isinstance(m, dict) and "from" in m and "role" not in m:  # ShareGPT
        role = SHAREGPT_ROLES.get(str(m["from"]))
        if role is None:
            raise ConfigError(f"{where} is from {m['from']!r}, a speaker ShareGPT's format does not name; use one of "
                              f"{', '.join(SHAREGPT_ROLES)}")
        m = {"role": role, "content": m.get("value")}
    if isinstance(m, dict) and isinstance(m.get("content"), list):
        m = {**m, "content": _text_of_parts(m["content"], where)}
    if isinstance(m, dict) and m.get("tool_calls") and m.get("content") is None:
        # An assistant turn that only calls tools: given to the template as it is, as TRL does.
        return {**m, "role": _role(m.get("role"), where)}
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
        raise ConfigError(f"{where} is not a message with text 'role' and 'content'; write it as "
                          '{"role": "user", "content": "..."}')
    return {**m, "role": _role(m["role"], where), "content": m["content"]}


# What separates the text parts of one message's content: transformers' own flattening of parts for a
# text-only model (`transformers serve`, ``BaseHandler.get_processor_inputs_from_messages`` for
# ``Modality.LLM``: ``" ".join``). A text-only template (Qwen2.5's, Llama 3's) writes ``message['content']``
# as one string, so parts must become one first.
PART_SEPARATOR = " "


def _text_of_parts(parts: list[Any], where: str) -> str:
    """The text of a content given as parts (the multimodal form ``[{"type": "text", "text": ...}]``,
    which TRL accepts): the text parts joined by :data:`PART_SEPARATOR`, as transformers flattens
    them for a text-only model. Any other part (an image) is refused: memtrain trains on text."""
    texts = []
    for i, part in enumerate(parts, 1):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ConfigError(f"{where}'s content part {i} is {kind!r}, not a text part; memtrain trains on text: give "
                              'the content as a string or as [{"type": "text", "text": "..."}] parts')
        texts.append(part["text"])
    return PART_SEPARATOR.join(texts)


def _role(role: Any, where: str) -> str:
    """``role``, unless it is a misspelling of a chat role ('assitant', 'User'): a template renders any
    role it is given, so a misspelled assistant turn would silently become a prompt (no target under
    --loss-on completion). A role unlike every known one (a template's own) is kept."""
    if not isinstance(role, str):
        raise ConfigError(f"{where} is not a message with text 'role' and 'content'; write it as "
                          '{"role": "user", "content": "..."}')
    if role in CHAT_ROLES:
        return role
    near = [ROLE_SYNONYMS[role.lower()]] if role.lower() in ROLE_SYNONYMS else \
        difflib.get_close_matches(role.lower(), CHAT_ROLES, n=1, cutoff=0.75)
    if near:
        raise ConfigError(f"{where} has role {role!r}; did you mean {near[0]!r}? (roles: {', '.join(CHAT_ROLES)})")
    return role


def _prompt_completion(record: dict[str, Any], tokenizer: Optional[ChatTokenizer], where: str,
                       answers: bool) -> RecordText:
    """TRL's rule: two strings are joined; two message lists are one conversation, rendered. The
    answer is the completion: after the prompt (rendered with its generation prompt), to the end."""
    missing = [f for f in PROMPT_FIELDS if f not in record]
    if missing:
        raise ConfigError(f"{where} has no {' or '.join(repr(f) for f in missing)} field (fields: "
                          f"{', '.join(map(str, record))}); give prompt-completion records or choose another --data-format")
    prompt, completion = record["prompt"], record["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        text = prompt + completion
        return RecordText(text, False, [(len(prompt), len(text))] if answers else None)
    if isinstance(prompt, list) and isinstance(completion, list):
        asked, tools = messages_of(prompt, f"{where}'s 'prompt'"), record_tools(record, where)
        text = _render(tokenizer, asked + messages_of(completion, f"{where}'s 'completion'"), where, "prompt-completion",
                       tools=tools)
        if not answers:
            return RecordText(text, True)
        before = _render(tokenizer, asked, where, "prompt-completion", add_generation_prompt=True, tools=tools)
        _check_prefix(text, before, where)
        return RecordText(text, True, [(len(before), len(text))])
    raise ConfigError(f"{where}'s prompt and completion are {type(prompt).__name__} and {type(completion).__name__}; "
                      "give both as text or both as lists of messages")


def _render(tokenizer: Optional[ChatTokenizer], messages: list[dict[str, Any]], where: str,
            fmt: str = "chat", add_generation_prompt: bool = False, tools: Optional[list[Any]] = None) -> str:
    """``messages`` through the tokenizer's chat template; a template's own refusal (roles that
    do not alternate, a role it does not know) is a ConfigError naming the record, and so is a
    render that passes the template's bounds (time, size: each render on its own), which the
    template, not the record, is to blame for."""
    refusal = template_refusal(fmt, tokenizer)
    if refusal is not None:
        raise refusal
    assert tokenizer is not None
    try:
        return tokenizer.render_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools)
    except ChatTemplateLimit as exc:
        held = _text_chars(messages)
        if exc.max_chars is not None and held > exc.max_chars:
            # The record's own text passes the bound: the template did nothing wrong, and its advice
            # ("fix the chat_template") sent the user to the wrong file.
            raise ConfigError(f"{where} holds {held:,} characters of messages, more than one rendered record may "
                              f"({exc.max_chars:,}); split the conversation into shorter records, or give long text "
                              "as --data-format text") from None
        given = getattr(tokenizer, "template_file", None)  # --chat-template's, not the model folder's
        fix = (f"fix {given!r}" if given else "fix the chat_template in its tokenizer_config.json (or chat_template.jinja)")
        raise ConfigError(f"the {'--chat-template' if given else '--model'}'s chat template {exc} for {where}; {fix}, "
                          "or give --data-format text") from None
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:  # jinja2's TemplateError too
        part = " (its turns up to an answer, for --loss-on completion)" if add_generation_prompt else ""
        raise ConfigError(f"the chat template refused {where}{part}: {first_line(exc)}; fix the record or remove it"
                          + ("; or give --loss-on all" if part else "")) from None


def _text_chars(value: Any) -> int:
    """The characters of every string in ``value`` (messages, their parts, tool calls), walked
    without recursion: what a record brings to its render before the template adds anything."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


def _chat_answers(tokenizer: Optional[ChatTokenizer], messages: list[dict[str, Any]], text: str,
                  where: str, tools: Optional[list[Any]] = None) -> list[tuple[int, int]]:
    """The character spans of ``text`` (the whole conversation rendered) that the assistant's
    turns add: for turn k, from the render of turns 0..k-1 with the generation prompt (the
    assistant's header) to the render of turns 0..k. An assistant turn that opens the
    conversation counts from the start."""
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:k], where, add_generation_prompt=True, tools=tools) if k else ""
        # The last turn's render is the whole conversation's, already rendered.
        after = text if k == len(messages) - 1 else _render(tokenizer, messages[:k + 1], where, tools=tools)
        _check_prefix(after, before, where)
        _check_prefix(text, after, where)
        spans.append((len(before), len(after)))
    return spans


def _check_prefix(text: str, prefix: str, where: str) -> None:
    """Refuse a template that renders the first turns of ``where`` otherwise once more follow
    (one that drops earlier turns' reasoning, or dates each render): its answers cannot be
    told from its prompt by comparing renders."""
    if not text.startswith(prefix):
        raise ConfigError(f"the chat template renders the first turns of {where} differently once later turns follow, "
                          "so its answers cannot be told from its prompt; give --loss-on all, or a template that "
                          "renders a conversation's first turns alike")
