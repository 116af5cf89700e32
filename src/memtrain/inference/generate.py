"""Sampling through transformers' ``generate``, so the sampling rules are the library's, not ours.

What ``memtrain generate MODEL`` samples from:

* a checkpoint of memtrain's GPT: mapped onto ``GPT2LMHeadModel`` (:mod:`memtrain.inference.export`),
  with GPT-2's tokenizer;
* a checkpoint of a transformers model (``train --model SPEC``): that model with its LoRA
  adapters merged (:mod:`memtrain.inference.export`), with the tokenizer it was trained with;
* a directory (written by ``memtrain export``, or any transformers model folder): its
  ``config.json`` is checked first (custom code is refused, never offered), then transformers
  reads it with ``trust_remote_code=False`` and safetensors weights only; its own tokenizer
  files, or GPT-2's BPE when it has none.

Every sampling setting comes from the command line (a fresh ``GenerationConfig``): a folder's
``generation_config.json`` is not consulted, so the same seed gives the same text from a
checkpoint and from its export (on the same device, in the same dtype).

``--device`` and ``--dtype`` place the model: a folder's weights are read in that dtype straight
onto the device (never a float32 copy on the host first); a checkpoint's model holds the
checkpoint's own tensors, mapped from the file (no copy on the host), and each parameter is
moved to the device and cast in one step (buffers keep their dtype, as a folder's do). Before
any weight reaches the device, the command holds ``memtrain estimate --mode inference``'s figure
for the run against the device's memory (``before_sampling``: memtrain.commands.generate), so a
batch that cannot fit is one error line instead of an out-of-memory failure midway; for a folder
the check comes before its weights are read at all.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from memtrain.config.run import ConfigError, ModelConfig, RunConfig, build_config
from memtrain.data.tokenizer import EOT_ID, N_VOCAB, get_tokenizer
from memtrain.errors import ChatTemplateLimit, first_line
from memtrain.inference.export import load_trained, require_transformers, to_hf_model
from memtrain.models.config_json import read_config_json, refuse_custom_tokenizer
from memtrain.models.families import data_tokenizer
from memtrain.models.gpt import GPT
from memtrain.models.hf import ATTN_IMPLEMENTATION, load_pretrained_lm
from memtrain.models.placement import place_weights
from memtrain.models.source import TOKENIZER_FILES, refuse_pickled_weights, safetensors_files
from memtrain.models.spec import attention_of_model_type, config_positions
from memtrain.models.tokenizer import GPT2_TRANSFORMERS_NAME, bounded_chat_template, leading_special_ids, load_tokenizer
from memtrain.runtime.notices import NoticeWarning
from memtrain.techniques.facts import DTYPE_MATMUL_TYPE, GENERATE_DTYPES
from memtrain.training.size_check import check_model_size


@dataclass(frozen=True)
class Codec:
    """Text <-> token ids for one model."""

    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    start_id: Optional[int]  # the document boundary an empty prompt starts after (None: none known)
    n_vocab: int
    # A user message framed by the tokenizer's chat template, up to the assistant's turn (None:
    # the tokenizer has no template), and the id that ends a turn there (the reply is cut at it).
    chat: Optional[Callable[[str], list[int]]] = None
    end_id: Optional[int] = None
    eos_id: Optional[int] = None  # a reply also ends at eos, where that comes before the turn's end


def gpt2_codec() -> Codec:
    """memtrain's GPT-2 BPE (tiktoken, built offline)."""
    tok = get_tokenizer()
    return Codec(tok.encode_ordinary, tok.decode, EOT_ID, N_VOCAB)


def transformers_codec(tok: Any, template_kwargs: Optional[dict[str, Any]] = None) -> Codec:
    """A transformers tokenizer; a prompt is framed as training framed a document: after the
    tokenizer's bos when it adds one (Llama), which an empty prompt then starts from.
    ``template_kwargs``: the run's --chat-template-kwargs, given to every chat render."""
    prefix = leading_special_ids(tok)
    kwargs = template_kwargs or {}
    return Codec(lambda text: prefix + list(tok(text, add_special_tokens=False)["input_ids"]),
                 lambda ids: tok.decode(ids, clean_up_tokenization_spaces=False), _start_id(tok, prefix), len(tok),
                 _chat_encoder(tok, kwargs), turn_end_id(tok, kwargs), tok.eos_token_id)


def with_run_chat(codec: Codec, tok: Any, template_kwargs: dict[str, Any]) -> Codec:
    """``codec`` (memtrain's GPT-2 BPE) that frames --chat prompts with ``tok``, transformers' GPT-2
    tokenizer holding the run's --chat-template: plain prompts keep tiktoken's ids and start."""
    return dataclasses.replace(codec, chat=_chat_encoder(tok, template_kwargs), end_id=turn_end_id(tok, template_kwargs),
                               eos_id=tok.eos_token_id)


def _chat_encoder(tok: Any, template_kwargs: dict[str, Any]) -> Optional[Callable[[str], list[int]]]:
    """One user message through the tokenizer's chat template with the assistant's turn opened,
    as transformers' chat pipeline frames it (the template supplies any bos); None without one.
    transformers renders the template in jinja's sandbox: it cannot run Python, but it can loop
    for ever or build text of any length, so the render is bounded (:func:`chat_ids`)."""
    if not getattr(tok, "chat_template", None):
        return None
    return lambda text: chat_ids(tok, text, template_kwargs)


def chat_ids(tok: Any, text: str, template_kwargs: Optional[dict[str, Any]] = None) -> list[int]:
    """``text`` as a user message framed by ``tok``'s chat template (given ``template_kwargs``), as
    token ids. The template comes with the model folder (or the run's --chat-template): it is rendered
    first as text, within the bounds of :func:`memtrain.models.tokenizer.bounded_chat_template`
    (time, and size before the tokenizer sees it); a template that fails (its own
    ``raise_exception``, the sandbox's refusal) or passes a bound is one line naming it."""
    messages = [{"role": "user", "content": text}]
    advice = "fix its chat_template, or give the prompt as text without --chat"

    def render(tokenize: bool) -> Any:
        try:
            return bounded_chat_template(tok, messages, tokenize=tokenize, add_generation_prompt=True,
                                         return_dict=False, **(template_kwargs or {}))
        except ChatTemplateLimit as exc:
            raise ConfigError(f"the tokenizer's chat template {exc} from a prompt of {len(text):,} characters; "
                              f"{advice}") from None
        except Exception as exc:  # the template is the folder's: whatever it raises is its fault, not ours
            raise ConfigError(f"the tokenizer's chat template fails ({type(exc).__name__}: {first_line(exc)}); "
                              f"{advice}") from None

    render(tokenize=False)  # the text first: its size is bounded before any tokenizing
    # Rendered again with the ids: transformers' own tokenizing of its render, so the ids are its.
    return list(render(tokenize=True))


def turn_end_id(tok: Any, template_kwargs: Optional[dict[str, Any]] = None) -> Optional[int]:
    """The id the chat template closes an assistant's turn with: the first special token it writes
    after an answer (ChatML's <|im_end|>, Llama 3's <|eot_id|>). Not always eos: a base model's
    tokenizer (Qwen2.5's <|endoftext|>) ends documents with another token than its template ends
    turns with, and a reply cut at eos ran on through the turn's end. eos when the template writes
    no special token there (or cannot render a two-turn conversation within its bounds)."""
    from jinja2 import TemplateError  # comes with transformers, which loaded ``tok``: imported where used

    marker = "\u2603 reply end"
    try:
        text = str(bounded_chat_template(tok, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": marker}],
                                         **(template_kwargs or {})))
    # The template's own refusal, or its bounds passed (a ValueError): use eos; --chat, which
    # needs the template, then says what is wrong with it.
    except (TemplateError, ValueError, TypeError, KeyError, IndexError):
        return tok.eos_token_id
    after = text[text.rfind(marker) + len(marker):] if marker in text else ""
    special = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}
    ids = tok(after, add_special_tokens=False)["input_ids"] if after else []
    return next((int(i) for i in ids if i in special), tok.eos_token_id)


def chat_reply(ids: list[int], end_id: Optional[int], eos_id: Optional[int] = None) -> list[int]:
    """A sampled reply up to its end-of-turn id, or eos if that comes first (sampling runs the
    full --max-new-tokens)."""
    stops = [ids.index(i) for i in (end_id, eos_id) if i is not None and i in ids]
    return ids[:min(stops)] if stops else ids


def _start_id(tok: Any, prefix: list[int]) -> Optional[int]:
    """The id an empty prompt starts from: the last of ``prefix`` (the bos a Llama tokenizer puts
    before every document), else the eos that ends the document before, else the bos; None when
    the tokenizer has neither."""
    if prefix:
        return prefix[-1]
    return tok.eos_token_id if tok.eos_token_id is not None else tok.bos_token_id


# --------------------------------------------------------------------------- what to sample from
def from_checkpoint(path: Path, chat: bool = True) -> tuple[Any, Codec, RunConfig]:
    """A checkpoint's model as a transformers model, its tokenizer (framing ``chat`` prompts with
    the run's template), and the run config it was trained with."""
    model, cfg = load_trained(path)
    # With the run's --chat-template (and kwargs), read only for --chat: a plain prompt samples
    # without it, even where the file is gone since.
    tok = data_tokenizer(cfg if chat else dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, chat_template=None)))
    if isinstance(model, GPT):
        codec = gpt2_codec() if tok is None else with_run_chat(gpt2_codec(), tok.tok, tok.template_kwargs)
        return to_hf_model(model, cfg), codec, cfg
    if tok is None:
        return model.lm, gpt2_codec(), cfg
    if tok.name == GPT2_TRANSFORMERS_NAME:  # a folder without tokenizer files, given --chat-template
        return model.lm, with_run_chat(gpt2_codec(), tok.tok, tok.template_kwargs), cfg
    return model.lm, transformers_codec(tok.tok, tok.template_kwargs), cfg


@dataclass(frozen=True)
class Folder:
    """A transformers model folder checked and read up to its weights: its transformers config,
    its tokenizer and a run config naming it (no code of the folder runs, no weight is read)."""

    path: Path
    config: Any
    codec: Codec
    cfg: RunConfig

    def load(self, dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None) -> Any:
        """The model in eval mode, its weights read in ``dtype`` (None: float32) straight onto
        ``device`` (None: the host)."""
        # The attention transformers builds this family with (eager for Gemma-2, which refuses SDPA).
        attn = ATTN_IMPLEMENTATION[attention_of_model_type(getattr(self.config, "model_type", None))]
        lm = load_pretrained_lm(str(self.path), self.config, attn, repr(str(self.path)), dtype=dtype, device=device)
        return lm.eval()


def read_folder(path: Path) -> Folder:
    """A transformers model folder to sample from, checked and read without its weights."""
    shown = repr(str(path))
    if (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
        # `memtrain export --adapter-only` writes a LoRA adapter, which samples only on its base.
        raise ConfigError(f"{shown} holds a LoRA adapter (export --adapter-only), not a model; sample from the "
                          "checkpoint itself, or from `memtrain export CKPT DIR` without --adapter-only (merged)")
    read_config_json(path / "config.json")  # custom code (auto_map, an unknown model_type) is refused here
    refuse_custom_tokenizer(path)
    check_model_size(ModelConfig.from_spec(str(path)))  # the shape config.json declares, before transformers builds it
    _check_weight_files(path)
    config = _read_config(path)
    vocab = getattr(config, "vocab_size", None)
    if any((path / f).is_file() for f in TOKENIZER_FILES):
        codec = transformers_codec(load_tokenizer(str(path), shown))
    elif isinstance(vocab, int) and vocab >= N_VOCAB:
        codec = gpt2_codec()
    else:
        raise ConfigError(f"{shown} has no tokenizer files ({', '.join(TOKENIZER_FILES)}) and its vocabulary is not "
                          "GPT-2's; add the tokenizer the model was trained with")
    if isinstance(vocab, int) and codec.n_vocab > vocab:
        raise ConfigError(f"the tokenizer of {shown} has {codec.n_vocab} tokens but the model embeds only vocab_size "
                          f"{vocab}; use the model's own tokenizer")
    # The run config names the folder; its sequence (a placeholder: any prompt within the
    # model's positions) is the prompt's when the memory of a sampling run is estimated.
    return Folder(path, config, codec, build_config({"model": str(path), "seq_len": 1}))


def _check_weight_files(path: Path) -> None:
    """A folder to sample from needs safetensors weights; pickled ones are never read."""
    refuse_pickled_weights(path, repr(str(path)))
    if not safetensors_files(path):
        raise ConfigError(f"{str(path)!r} has no *.safetensors weights; give a directory written by `memtrain export`")


def _read_config(path: Path) -> Any:
    """transformers' config of a folder whose config.json memtrain has checked."""
    transformers = require_transformers()
    try:
        return transformers.AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001 - a field transformers rejects: the file's fault
        first = first_line(exc)
        raise ConfigError(f"cannot read the config.json of {str(path)!r}: {first}") from None


def load_for_sampling(model_path: Path, dtype: Optional[torch.dtype] = None) -> tuple[Any, Codec, RunConfig]:
    """The transformers model ``memtrain generate`` samples from (in ``dtype``; None: as stored,
    float32 or the dtype a checkpoint's run trained in), its tokenizer and its run config."""
    if model_path.is_dir():  # its weights read in the dtype (None: float32)
        folder = read_folder(model_path)
        return folder.load(dtype), folder.codec, folder.cfg
    hf, codec, cfg = from_checkpoint(model_path)
    return place_weights(hf, dtype), codec, cfg


# The dtypes --dtype names (those estimate --mode inference's --weights-dtype models for
# generate), by the registry's dtype -> matmul type table.
DTYPES: dict[str, torch.dtype] = {kind: getattr(torch, name) for name, kind in DTYPE_MATMUL_TYPE.items()
                                  if kind in GENERATE_DTYPES}


# --------------------------------------------------------------------------- sampling
def generation_config(max_new_tokens: int, temperature: float, top_k: int, pad: int) -> Any:
    """The ``GenerationConfig`` memtrain generate samples with (and estimate --mode inference
    models): temperature and top-k sampling, greedy at temperature 0; no eos, so every sample is
    ``max_new_tokens`` long and no padding is ever written (``pad``: a token id it would use)."""
    transformers = require_transformers()
    sampling = dict(do_sample=True, temperature=temperature, top_k=top_k or None) if temperature > 0 else dict(do_sample=False)
    return transformers.GenerationConfig(max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=None, **sampling)


def sample_ids(hf: Any, x: torch.Tensor, settings: Any, **extra: Any) -> torch.Tensor:
    """transformers' ``generate`` of ``x`` (prompts and continuations) with ``settings`` (from
    :func:`generation_config`; ``extra``: more of generate's arguments), every sample
    ``max_new_tokens`` long.

    transformers fills an eos that the settings leave unset from the model's own generation config
    (its ``config.json``'s or ``generation_config.json``'s eos), so a sample that drew it stopped there
    and was padded, shorter than the estimate's run and with pad tokens in its text: the model's
    generation config is replaced by a default one first (the eos and every other setting)."""
    # Not only the eos: transformers fills every setting ``settings`` leaves at its default from
    # the model's own generation config, so a folder's generation_config.json (Qwen's
    # repetition_penalty and top_p, a num_beams) changed what was sampled, and num_beams 0 ended in
    # ZeroDivisionError. A default config in its place leaves the command line's settings alone.
    hf.generation_config = require_transformers().GenerationConfig()
    if not cache_counts_positions(hf.config):
        # In the settings, not as generate's keyword: transformers deprecates passing both.
        settings = copy.deepcopy(settings)
        settings.use_cache = False
        warnings.warn(NoticeWarning(f"a {hf.config.model_type} model without attention layers samples without a cache "
                                    "(transformers' cache of only recurrent layers cannot say how many positions it "
                                    "holds): each new token reruns the whole sequence, the same text, slower"),
                      stacklevel=2)
    with torch.no_grad():
        return hf.generate(x, attention_mask=torch.ones_like(x), generation_config=settings, **extra)


def cache_counts_positions(config: Any) -> bool:
    """Whether the cache transformers' ``generate`` builds for a model of ``config`` has a layer
    that counts the positions it holds (an attention layer's). A model whose layers are all
    recurrent (a RecurrentGemma, Qwen3-Next, LFM2 or Jamba of only recurrent blocks: a tiny one
    whose block pattern's attention falls beyond its depth) gets a cache of recurrent layers only,
    and transformers 5's mask builder asks that cache its length before the first token: a
    ValueError ("get_seq_length can only be called on Attention layers")."""
    from transformers.cache_utils import CacheLayerMixin, DynamicCache

    layers = DynamicCache(config=config).layers
    return not layers or any(isinstance(layer, CacheLayerMixin) for layer in layers)


# What generate calls once the prompt is tokenized and before any weight reaches the device:
# (the model's run config, the dtype its weights will have, the prompt's token count, the device).
BeforeSampling = Callable[[RunConfig, torch.dtype, int, torch.device], None]


def generate(model_path: Path, prompt: str, max_new_tokens: int, temperature: float, top_k: int,
             num_samples: int, seed: int, device: str = "auto", dtype: Optional[str] = None,
             before_sampling: Optional[BeforeSampling] = None, chat: bool = False) -> list[str]:
    """``num_samples`` continuations of ``prompt`` (the new text only), sampled on ``device``
    (auto, cpu, cuda, cuda:N) with the weights in ``dtype`` (fp32, bf16, fp16; None: as stored).
    ``chat``: ``prompt`` is a user message, framed by the tokenizer's chat template; each
    continuation is the reply, up to the template's end of turn."""
    from memtrain.runtime.env import resolve_device  # torch-free --help: the device is resolved here

    require_transformers()
    place = resolve_device(device)
    asked = None if dtype is None else DTYPES[dtype]
    # A folder is read up to its weights now and its weights once the run is known to fit; a
    # checkpoint's model is made on the host from the file's mapped tensors (no copy), then moved.
    folder = read_folder(model_path) if model_path.is_dir() else None
    loaded: Any = None
    if folder is not None:
        codec, cfg, config, weights_dtype = folder.codec, folder.cfg, folder.config, asked or torch.float32
    else:
        loaded, codec, cfg = from_checkpoint(model_path, chat)
        config, weights_dtype = loaded.config, asked or next(loaded.parameters()).dtype
    if chat:
        if codec.chat is None:
            raise ConfigError(f"--chat: {str(model_path)!r} has no chat template (tokenizer_config.json's chat_template "
                              "or chat_template.jinja beside the tokenizer); give the prompt as text without --chat")
        ids = codec.chat(prompt)
    elif prompt:
        ids = codec.encode(prompt)
    elif codec.start_id is not None:
        ids = [codec.start_id]
    else:
        raise ConfigError("this model's tokenizer has no eos or bos token to start a document from; give --prompt")
    limit = config_positions(config)
    if limit is not None and len(ids) + max_new_tokens > limit:
        raise ConfigError(f"prompt ({len(ids)} tokens) + --max-new-tokens {max_new_tokens} exceeds the model's "
                          f"{limit} positions; shorten one")
    if before_sampling is not None:
        before_sampling(cfg, weights_dtype, len(ids), place)
    # A checkpoint's parameters are moved and cast together, tensor by tensor (no whole copy in
    # the asked dtype on the host first); its buffers (rope's float32 inv_freq) are only moved.
    hf: Any = folder.load(asked, place) if folder is not None else place_weights(loaded, weights_dtype, place)
    pad = codec.start_id if codec.start_id is not None else ids[0]
    settings = generation_config(max_new_tokens, temperature, top_k, pad)
    torch.manual_seed(seed)
    x = torch.tensor([ids] * num_samples, device=place)
    y = sample_ids(hf, x, settings)
    rows = [row[len(ids):].tolist() for row in y]
    return [codec.decode(chat_reply(row, codec.end_id, codec.eos_id) if chat else row) for row in rows]
