"""The tokenizer of a transformers model, for the data pipeline.

A model brought with ``--model DIR`` reads its data through its own tokenizer
(``AutoTokenizer`` from the directory, never remote code); memtrain's GPT-2 BPE stays for the
built-in GPT. The token cache is keyed by the tokenizer's identity (a hash of its files), so
two tokenizers never share cached tokens.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

from memtrain.config.run import ConfigError, RunConfig, template_kwargs
from memtrain.errors import ChatTemplateLimit, first_line
from memtrain.files.guard import regular_file_problem
from memtrain.models.auto_config import load_config
from memtrain.models.hf import quiet_transformers
from memtrain.models.hub_access import from_pretrained_kwargs
from memtrain.models.source import TOKENIZER_FILES, TOKENIZER_ID_FILES, resolve
from memtrain.models.spec import is_gpt_preset
from memtrain.runtime.signals import TimeLimitExceeded, time_limit

# A chat template renders one conversation in milliseconds; these bound one that does not (the
# template comes with the model folder: jinja's sandbox stops it running Python, not looping).
CHAT_TEMPLATE_SECONDS = 10.0
MAX_CHAT_CHARS = 4 << 20  # far past any model's context: a render longer is the template's doing
# A --chat-template file is read whole: the Hub's largest templates are tens of KB.
MAX_CHAT_TEMPLATE_BYTES = 1 << 20
# The cache identity of GPT-2's BPE read through transformers (memtrain's GPT given --chat-template).
GPT2_TRANSFORMERS_NAME = "gpt2-transformers"


def bounded_chat_template(tok: Any, messages: list[dict[str, Any]], tokenize: bool = False, **kwargs: Any) -> Any:
    """``tok.apply_chat_template(messages, ...)`` within :data:`CHAT_TEMPLATE_SECONDS`, its text
    at most :data:`MAX_CHAT_CHARS` characters; else :class:`ChatTemplateLimit`. A nested loop of
    jinja's largest ranges (10**10 iterations) was still running after 60 s, and a template
    printing ``'x' * 2000000000`` had its text tokenized. ``tokenize=True`` returns the ids (their
    text is not measured: render the text first). The template's own errors pass through."""
    try:
        with time_limit(CHAT_TEMPLATE_SECONDS):
            out = tok.apply_chat_template(messages, tokenize=tokenize, **kwargs)
    except TimeLimitExceeded:
        raise ChatTemplateLimit(f"did not render within {CHAT_TEMPLATE_SECONDS:g} s") from None
    if not tokenize and len(out) > MAX_CHAT_CHARS:
        raise ChatTemplateLimit(f"made a text of {len(out):,} characters (at most {MAX_CHAT_CHARS:,})", MAX_CHAT_CHARS)
    return out


class HFTokenizer:
    """The interface ``memtrain.data.prepare_tokens`` uses: ``name``, ``n_vocab``, ``eot_id``,
    ``prefix_ids``, ``encode_batch``."""

    def __init__(self, tok: Any, identity: str, template_kwargs: Optional[dict[str, Any]] = None) -> None:
        self.tok = tok
        self.name = identity
        # --chat-template-kwargs: variables every render of the chat template gets (TRL's chat_template_kwargs).
        self.template_kwargs = dict(template_kwargs or {})
        # --chat-template's path when that file, not the model folder, gave the template (errors name it).
        self.template_file: Optional[str] = None
        self.n_vocab = len(tok)  # base vocabulary plus added tokens: the largest id + 1
        eot = tok.eos_token_id
        if eot is None:
            raise ConfigError(f"tokenizer {identity!r} has no eos token to separate documents; set eos_token in its tokenizer_config.json")
        self.eot_id = int(eot)
        # What the tokenizer puts before a text when called as transformers calls it (a Llama
        # tokenizer's bos): the cache starts every document with it, as the model was trained.
        self.prefix_ids = leading_special_ids(tok)

    def encode_batch(self, texts: list[str], num_threads: Optional[int] = None) -> list[list[int]]:
        # The text alone: a long document is encoded in pieces, and its bos (prefix_ids) and
        # closing eos are added once, by the cache. Special-token text written in a document (a
        # chat template's markers) maps to its id, as transformers' tokenizer call maps it.
        # verbose=False: transformers' "longer than the specified maximum sequence length ... will
        # result in indexing errors" is about one document run whole, while memtrain packs documents
        # into --seq-len blocks (checked against max_position_embeddings): a long document is no error.
        return self.tok(texts, add_special_tokens=False, verbose=False)["input_ids"]

    def encode_offsets(self, texts: list[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """Each text's ids (those of :meth:`encode_batch`) and each id's character span in it."""
        try:
            out = self.tok(texts, add_special_tokens=False, verbose=False, return_offsets_mapping=True)
        except NotImplementedError:  # transformers' Python tokenizers keep no offsets; the Rust ones do
            raise ConfigError(f"--loss-on completion needs each token's place in the text, which tokenizer {self.name!r} "
                              f"({type(self.tok).__name__}) does not give; use a fast tokenizer (tokenizer.json) or "
                              "--loss-on all") from None
        return [(list(ids), [tuple(o) for o in offsets])  # type: ignore[misc]  # offsets are (start, end) pairs
                for ids, offsets in zip(out["input_ids"], out["offset_mapping"])]

    @property
    def chat_template(self) -> Optional[str]:
        """The chat template the tokenizer renders conversations with (None without one); a
        tokenizer holding several named templates gives them as one JSON text, so that the token
        cache's key changes when any of them does."""
        template = getattr(self.tok, "chat_template", None)
        if not template:
            return None
        return template if isinstance(template, str) else json.dumps(template, sort_keys=True)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
                    tools: Optional[list[Any]] = None) -> str:
        """``messages`` rendered by the chat template as text, without a generation prompt (a
        conversation to train on, as TRL's SFTTrainer renders one) unless asked (the prompt
        before an answer); a template's own refusal (jinja's TemplateError: roles that do not
        alternate) is a ValueError, and one that loops or grows past its bounds a
        :class:`ChatTemplateLimit` (a ValueError too), each render bounded on its own."""
        # jinja2 comes with transformers, which this tokenizer was loaded with: imported only here
        from jinja2 import TemplateError

        try:
            return str(bounded_chat_template(self.tok, messages, tools=tools,
                                             add_generation_prompt=add_generation_prompt, **self.template_kwargs))
        except TemplateError as exc:
            raise ValueError(first_line(exc)) from None


def leading_special_ids(tok: Any) -> list[int]:
    """The ids ``tok`` adds before a text with ``add_special_tokens=True`` (Llama's bos; none
    for GPT-2 or Qwen2), found by encoding a probe text both ways."""
    plain = list(tok("a", add_special_tokens=False)["input_ids"])
    framed = list(tok("a", add_special_tokens=True)["input_ids"])
    for start in range(len(framed) - len(plain) + 1):
        if framed[start:start + len(plain)] == plain:
            return framed[:start]
    return []  # the text's own ids changed under the template: add nothing rather than guess


def _identity(load_id: str, directory: Any) -> str:
    """``hf-`` and a hash of the load id and of the tokenizer files the folder holds (their exact
    names, :data:`TOKENIZER_ID_FILES`; ``resolve`` has checked each is a regular file)."""
    h = hashlib.sha256(load_id.encode())
    if directory is not None:
        for name in TOKENIZER_ID_FILES:
            if (directory / name).is_file():
                h.update(name.encode())
                h.update((directory / name).read_bytes())
    return "hf-" + h.hexdigest()[:16]


def data_tokenizer(cfg: RunConfig) -> Optional[HFTokenizer]:
    """The tokenizer for ``cfg``'s data: None (memtrain's GPT-2 BPE) for our GPT, or for a
    transformers model without tokenizer files trained from scratch whose vocabulary holds
    GPT-2's; else the model's own tokenizer. A vocabulary the model cannot embed is an error.
    With ``--chat-template FILE`` the tokenizer renders with that template (and its kwargs): GPT-2's
    BPE is then transformers' (the same ids as memtrain's for text), which can render one."""
    spec = cfg.model.model
    template, kwargs = run_chat_template(cfg), template_kwargs(cfg.data.chat_template_kwargs)
    if is_gpt_preset(spec):
        return None if template is None else _given_template(gpt2_chat_tokenizer(template, kwargs), cfg)
    assert spec is not None
    src = resolve(spec)
    vocab = int(load_config(spec).vocab_size)
    if not src.has_tokenizer():
        if src.has_weights():
            raise ConfigError(f"--model {spec!r} has weights but no tokenizer files ({', '.join(TOKENIZER_FILES)}); "
                              "add the tokenizer the weights were trained with")
        # Imported here: memtrain.data loads tiktoken and the data pipeline, which a model's build
        # (every traced estimate) never needs.
        from memtrain.data.tokenizer import N_VOCAB

        if vocab < N_VOCAB:
            raise ConfigError(f"--model {spec!r} has no tokenizer files and its vocab_size {vocab} is smaller than "
                              f"GPT-2's {N_VOCAB}; add a tokenizer (tokenizer.json) to the directory")
        return None if template is None else _given_template(gpt2_chat_tokenizer(template, kwargs), cfg)
    tok = load_tokenizer(src.load_id, f"--model {spec!r}", repo=src.repo)
    if template is not None:
        tok.chat_template = template  # as TRL's chat_template_path sets it; save_pretrained writes it
    wrapped = _given_template(HFTokenizer(tok, _identity(src.load_id, src.directory), kwargs), cfg)
    if wrapped.n_vocab > vocab:
        raise ConfigError(f"the tokenizer of --model {spec!r} has {wrapped.n_vocab} tokens but the model embeds only "
                          f"vocab_size {vocab}; use the model's own tokenizer or raise vocab_size in config.json")
    return wrapped


def _given_template(tok: HFTokenizer, cfg: RunConfig) -> HFTokenizer:
    """``tok`` marked as rendering the run's ``--chat-template`` file, where one was given."""
    tok.template_file = cfg.data.chat_template
    return tok


def run_chat_template(cfg: RunConfig) -> Optional[str]:
    """The text of the run's ``--chat-template`` file (None without one), read as a small UTF-8
    file and checked to be a jinja template (compiled in transformers' sandboxed environment,
    never rendered here); a file that is none is a ConfigError saying what to change."""
    if cfg.data.chat_template is None:
        return None
    path = Path(cfg.data.chat_template).expanduser()
    shown = f"--chat-template {cfg.data.chat_template!r}"
    if not path.exists():
        raise ConfigError(f"{shown} not found; give the path of a .jinja chat template file (a run's checkpoint "
                          "reads the file where the run did: put it back there)")
    # A link to a template elsewhere is followed (the file is the user's own, not a folder's part);
    # a FIFO or device is never opened, and the size is checked before the read.
    why = regular_file_problem(path, path.resolve().parent, max_bytes=MAX_CHAT_TEMPLATE_BYTES)
    if why is not None:
        raise ConfigError(f"{shown} is {why}; give a .jinja chat template file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{shown} is not UTF-8 text; give a .jinja chat template file") from None
    if not text.strip():
        raise ConfigError(f"{shown} is empty; give a .jinja chat template file")
    _check_template_syntax(text, shown)
    return text


def _check_template_syntax(text: str, shown: str) -> None:
    """Compile ``text`` as transformers compiles a chat template (its immutable sandbox, its
    ``{% generation %}`` tag): a syntax error is named before any record is read, not blamed on the
    first record. Compiling runs nothing of the template."""
    # transformers and jinja2 (one of its requirements) load only where a template is given
    from jinja2 import TemplateError

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # a transformers without it (its private name): the first render names the error
        return
    try:
        _compile_jinja_template(text)
    except TemplateError as exc:
        raise ConfigError(f"{shown} is not a jinja template ({first_line(exc)}); fix the file") from None


def gpt2_chat_tokenizer(template: str, kwargs: dict[str, Any]) -> HFTokenizer:
    """memtrain's GPT-2 BPE as transformers' GPT-2 tokenizer (from the package's own vocabulary
    files: no download) rendering ``template``: its ids of a text are tiktoken's, and it can render
    a conversation, which tiktoken cannot."""
    with tempfile.TemporaryDirectory(prefix="memtrain-gpt2-") as tmp, quiet_transformers():
        tok = gpt2_tokenizer_in(Path(tmp))
    tok.chat_template = template
    return HFTokenizer(tok, GPT2_TRANSFORMERS_NAME, kwargs)


def gpt2_tokenizer_in(folder: Path) -> Any:
    """transformers' GPT-2 tokenizer of memtrain's own BPE files, written into ``folder`` first
    (OpenAI's encoder.json and vocab.bpe as vocab.json and merges.txt, the names transformers reads:
    no download); export keeps them there, a chat template's tokenizer reads them from a scratch folder."""
    # The Rust tokenizer (offsets for --loss-on completion) in transformers 4 and 5; 5's stubs do not
    # list the name. Imported here, as the GPT-2 files below: a model's build (every traced estimate)
    # needs neither transformers' tokenizers nor memtrain.data (tiktoken, the data pipeline).
    from transformers import GPT2TokenizerFast  # type: ignore[attr-defined]

    from memtrain.data.tokenizer import vocab_dir  # tiktoken's package: loaded only where GPT-2's files are wanted

    shutil.copyfile(vocab_dir() / "encoder.json", folder / "vocab.json")
    shutil.copyfile(vocab_dir() / "vocab.bpe", folder / "merges.txt")
    return GPT2TokenizerFast.from_pretrained(str(folder), trust_remote_code=False)


def load_tokenizer(load_id: str, what: str, repo: Optional[str] = None) -> Any:
    """``AutoTokenizer.from_pretrained`` of a folder (or Hub repository), never running code;
    any failure to read its files is a ConfigError naming ``what``."""
    from transformers import AutoTokenizer

    try:
        with quiet_transformers():
            return AutoTokenizer.from_pretrained(load_id, trust_remote_code=False, **from_pretrained_kwargs(repo))
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises a bare Exception for a garbled file
        text = str(exc).strip()
        if "contains custom code" in text:  # a Hub repository's auto_map: refused, never offered (its text goes on
            # to ask for trust_remote_code=True); a folder's was refused before this read (refuse_custom_tokenizer)
            raise ConfigError(f"the tokenizer of {what} names custom code (auto_map); memtrain never runs code shipped "
                              "with a model: use a tokenizer class transformers ships") from None
        if isinstance(exc, UnicodeEncodeError):  # the tokenizers library takes UTF-8 paths only: the path's fault
            raise ConfigError(f"cannot load the tokenizer of {what}: its path is not UTF-8, which the tokenizers "
                              "library cannot read; rename the folder, or give it through a link with a UTF-8 name"
                              ) from None
        raise ConfigError(f"cannot load the tokenizer of {what}: {_load_failure(exc)}; fix or replace its tokenizer "
                          f"files ({', '.join(TOKENIZER_FILES)})") from None


def _load_failure(exc: BaseException) -> str:
    """What went wrong reading a tokenizer, in words: a KeyError (a field transformers expects,
    missing from a file) said only the field's name."""
    if isinstance(exc, KeyError) and exc.args:
        return f"a file lacks the field {exc.args[0]!r}"
    return first_line(exc)
