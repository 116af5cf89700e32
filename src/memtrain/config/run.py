"""Typed configuration for every memtrain command.

One dataclass per stage (model, data, techniques, training), each validated once in
``__post_init__`` with a :class:`ConfigError` whose message says what to change. Validation
reads no file and no network: ``--model SPEC`` is resolved by the named constructor
:meth:`ModelConfig.from_spec` (which :func:`build_config` calls).
Every field carries its documentation in ``metadata["help"]``; the command line is
generated from these fields (see :mod:`memtrain.cli`), so a field added here becomes a
``--flag`` automatically (underscores turn into dashes).

Field names are unique across the sections so that a flat ``--key value`` or a flat
config file key maps to exactly one field.
A config file's text becomes such keys in :mod:`memtrain.config.file`.
"""

from __future__ import annotations

import dataclasses
import difflib
import glob
import json
import math
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any, Optional

from memtrain.analysis.limits import (
    MAX_BATCH,
    MAX_BYTES,
    MAX_INT,
    MAX_RANKS,
    MAX_WIDTH,
    check_analytic_size,
    check_at_most,
)
from memtrain.config.aliases import BY_NAME as ALIASES_BY_NAME, WARMUP_RATIO, normalize as normalize_aliases

# ConfigError lives in a leaf module so that the modules config itself consults (model presets,
# model-spec resolution) can raise it without importing config back.
from memtrain.errors import ConfigError, require
from memtrain.files.guard import unknown_home
from memtrain.techniques.facts import (
    FOREIGN_LOSS_KERNELS,
    OPTIMIZER_STATE_RULES,
    PRECISION_FACTS,
    loss_kernel_precision_error,
    parse_checkpointing,
)

# The memtrain cache folder (token cache, device probe rates) when neither MEMTRAIN_CACHE nor
# --cache-dir names one.
DEFAULT_CACHE_DIR = "~/.cache/memtrain"
# The held-out split's defaults: a --val-data run refuses any other value (DataConfig._check_validation_source).
DEFAULT_VAL_FRACTION = 0.05
DEFAULT_SPLIT_SEED = 1234


def _f(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with its documentation attached (shown by ``--help``)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


def _check_homes(*paths: tuple[str, Optional[str]]) -> None:
    """Each (flag, path) given: refused when it names the home folder of an unknown user."""
    for flag, path in paths:
        why = unknown_home(path, flag) if isinstance(path, str) else None
        require(why is None, str(why))


# --------------------------------------------------------------------------- model
@dataclass
class ModelConfig:
    """Shape of the decoder-only Transformer (GPT-2 style, pre-LayerNorm).

    ``ModelConfig(...)`` takes every field as given; for a ``--model SPEC`` build it with
    :meth:`from_spec`, which sets the shape fields to the model's."""

    vocab_size: int = _f(50257, "Vocabulary size (GPT-2 BPE has 50257 tokens).")
    vocab_multiple: int = _f(
        1,
        "Pad the embedding table to a multiple of this (64 gives 50304, which speeds up "
        "matmuls and lets low-bit optimizers quantize the embedding). 1 = no padding.",
    )
    d_model: int = _f(256, "Hidden size of the residual stream.")
    n_heads: int = _f(8, "Attention heads per layer; must divide d_model.")
    n_layers: int = _f(4, "Number of Transformer blocks.")
    d_ff: int = _f(1024, "Hidden size of the GELU MLP in each block.")
    max_seq_len: int = _f(512, "Longest sequence the learned position embedding covers.")
    dropout: float = _f(0.1, "Dropout probability on embeddings, attention output and MLP output.")
    untie_embeddings: bool = _f(
        False, "Give the LM head its own weight instead of sharing the token embedding."
    )
    bias: bool = _f(True, "Use biases in Linear layers and LayerNorms (GPT-2 does).")
    model: Optional[str] = _f(
        None,
        "Bring your own model: a transformers config.json, a directory holding one (optionally with "
        "*.safetensors weights and tokenizer files), a bundled config (llama-3-8b, qwen2.5-7b, mistral-7b, "
        "llama-3-70b, qwen2.5-0.5b; tiny-llama and tiny-gpt2 train in seconds on a CPU) or hf:ORG/NAME; "
        "a GPT preset name (gpt2...) sets our GPT's shape. "
        "The shape fields above then mirror the model's config. None: memtrain's GPT.",
    )

    @classmethod
    def from_spec(cls, spec: Optional[str] = None, **given: Any) -> "ModelConfig":
        """The ModelConfig of ``--model SPEC``: where a model name, folder or Hub repository is
        resolved (the constructor every command and library entry point reaches, through
        :func:`build_config`).

        The shape fields mirror the model ``spec`` names, winning over the same fields in
        ``given``: a GPT preset's fields, or those of the transformers config.json of a bundled
        name, a folder or ``hf:ORG/NAME`` (read from disk or the Hub), so every reader of
        ``cfg.model`` (random batches, FLOP rules, --seq-len/--lora-rank checks) sees the real
        shape. The other fields come from ``given``. No spec: ``ModelConfig(**given)``.
        ConfigError when ``spec`` names no model, or its config cannot be read or built.
        """
        if spec is not None:
            from memtrain.models.spec import model_fields  # torch-free --help/estimate/plan

            given = {**given, **model_fields(spec)}
        return cls(model=spec, **given)

    def __post_init__(self) -> None:
        # Checks the values as given, and nothing else: no file or network is read while a
        # ModelConfig is built (``model`` is only recorded here; from_spec resolves it).
        for name in ("vocab_size", "vocab_multiple", "d_model", "n_heads", "n_layers", "d_ff", "max_seq_len"):
            require(getattr(self, name) > 0, f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        # Before any arithmetic on the shape (the hint below loops over n_heads): every verb
        # refuses an absurd shape here, before building or counting it.
        check_analytic_size(self)
        require(
            self.d_model % self.n_heads == 0,
            f"--n-heads ({self.n_heads}) must divide --d-model ({self.d_model}); try --n-heads "
            f"{max(h for h in range(1, self.n_heads + 1) if self.d_model % h == 0)}",
        )
        require(0.0 <= self.dropout < 1.0, f"--dropout must be in [0, 1), got {self.dropout}")

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding table: vocab_size rounded up to vocab_multiple."""
        m = self.vocab_multiple
        return ((self.vocab_size + m - 1) // m) * m

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


# --------------------------------------------------------------------------- data
# --data-format: what a structured record holds (memtrain.data.records renders the record kinds).
DATA_FORMATS = ("text", "chat", "prompt-completion", "auto")
LOSS_ON = ("all", "completion")  # --loss-on: every token a target, or a record's answers only
PACKINGS = ("concat", "pad")  # --packing: records joined into one stream, or one record per padded row


# apply_chat_template's own arguments and the variables transformers sets itself: a
# --chat-template-kwargs key among them would collide with memtrain's call ("got multiple values").
TEMPLATE_RESERVED = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs", "sanitize_control_tokens",
})


def template_kwargs_text(value: Any) -> Optional[str]:
    """--chat-template-kwargs as canonical JSON text (sorted keys: one spelling, one cache key), or
    None when not given; a config file's mapping is taken as the object it is. Anything but an object
    of plain values (text, numbers, booleans, null) under names the template can read is a
    ConfigError saying what to write."""
    if value is None:
        return None
    hint = "; write a JSON object of plain values, e.g. '{\"enable_thinking\": false}'"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--chat-template-kwargs is not JSON ({exc.msg} at character {exc.pos}){hint}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"--chat-template-kwargs is a JSON {type(value).__name__}, not an object{hint}")
    for key, item in value.items():
        require(isinstance(key, str) and key.isidentifier(),
                f"--chat-template-kwargs key {key!r} is not a name a template can read{hint}")
        require(key not in TEMPLATE_RESERVED,
                f"--chat-template-kwargs key {key!r} is an argument memtrain gives apply_chat_template itself; drop it")
        require(item is None or isinstance(item, (str, int, float, bool)),
                f"--chat-template-kwargs value of {key!r} is a {type(item).__name__}{hint}")
    return json.dumps(value, sort_keys=True)


def template_kwargs(text: Optional[str]) -> dict[str, Any]:
    """The variables a validated --chat-template-kwargs gives the template ({} without any)."""
    return json.loads(text) if text else {}


@dataclass
class DataConfig:
    """Where the text comes from and how it becomes token blocks."""

    data: str = _f(
        "default",
        "Text source: 'default' (embedded Python documentation), 'hf:OWNER/NAME' "
        "(Hugging Face dataset, streamed; hf:DIR and hf:json|parquet|csv:GLOB read local files the same way, "
        "through datasets: a .txt in hf:DIR is one document per line, blank lines dropped, where memtrain's own "
        ".txt reader cuts documents at a blank line after each 8,192 characters, so the two split a text into "
        "train and validation differently), a local file, folder or glob (.txt .jsonl .json .parquet .csv), "
        "or a Stack Exchange Posts.xml dump.",
    )
    text_field: Optional[str] = _f(
        None,
        "Field holding the text in structured sources (default: 'Body' for Posts.xml and "
        "mikex86/stackoverflow-posts, else 'text').",
    )
    data_format: str = _f(
        "text",
        "What a structured record holds: 'text' (one text field, --text-field), 'chat' (a 'messages' list of "
        "{role, content}, or ShareGPT's 'conversations' of {from, value}, rendered with the model's chat template), "
        "'prompt-completion' (TRL's 'prompt' and 'completion': strings joined, message lists rendered with the "
        "chat template) or 'auto' (each record read as the format its fields are; one --data holds one format).",
    )
    loss_on: str = _f(
        "all",
        "Which tokens are targets: 'all' (every token) or 'completion' (a record's answers only: the assistant's "
        "turns of a conversation, the completion of a prompt-completion record; TRL's assistant_only_loss and "
        "completion_only_loss; the others' targets are -100, and validation loss averages answer tokens only). "
        "'completion' needs --data-format chat, prompt-completion or auto.",
    )
    packing: str = _f(
        "concat",
        "How records become rows of --seq-len tokens: 'concat' (each record followed by <|endoftext|>/eos, joined into "
        "one stream cut into blocks: attention crosses records, nothing is padded; run_clm's and TRL's packing=True) or "
        "'pad' (one record per row, truncated at --seq-len + 1 tokens, right-padded; padded positions are no targets "
        "(-100) and the losses average real targets only; TRL SFTTrainer's default, packing=False). result.json's "
        "pad_fraction is the share of padded positions.",
    )
    chat_template: Optional[str] = _f(
        None,
        "A chat template file (.jinja text, at most 1 MiB) that renders the records of --data-format chat, "
        "prompt-completion or auto in place of the --model tokenizer's own (TRL's chat_template_path), e.g. for a "
        "base model without one; with memtrain's GPT (GPT-2's BPE has none) it makes chat data trainable. Rendered "
        "as a model's own template is (jinja's sandbox, 10 s and 4 Mi characters a render); its hash keys the token "
        "cache; export writes it into the exported tokenizer and generate --chat on the run's checkpoint uses it.",
    )
    chat_template_kwargs: Optional[str] = _f(
        None,
        "A JSON object of plain values (text, numbers, true, false, null) given to the chat template as variables "
        "(TRL's chat_template_kwargs), e.g. '{\"enable_thinking\": false}' for Qwen3's template; part of the token "
        "cache's key; generate --chat on the run's checkpoint renders with them too.",
    )
    strip_html: bool = _f(False, "Remove HTML tags and unescape entities (Stack Overflow bodies are HTML).")
    max_documents: Optional[int] = _f(
        None, "Read at most this many documents (needed to bound a streamed hub dataset)."
    )
    hf_split: str = _f("train", "Split of a Hugging Face dataset.")
    val_fraction: float = _f(DEFAULT_VAL_FRACTION, "Share of documents held out for validation (split by document, seeded).")
    val_blocks: int = _f(32, "Validation blocks evaluated (a fixed subset of the held-out set).")
    split_seed: int = _f(DEFAULT_SPLIT_SEED, "Seed of the train/validation document split (independent of --seed).")
    val_data: Optional[str] = _f(
        None,
        "A separate validation source, any source --data takes (e.g. val.jsonl beside --data train.jsonl: "
        "TRL's eval_dataset), read with the same --text-field, --data-format, --loss-on, chat template, "
        "--strip-html and --max-documents. All of --data then trains (no --val-fraction is held out) and validation reads the "
        "first --val-blocks blocks of it. None: validate on --val-fraction of --data.",
    )
    val_split: Optional[str] = _f(
        None,
        "The split of an hf: validation source to validate on (e.g. 'validation' or 'test'): of --val-data, "
        "or of --data itself when --val-data is not given (all of --data's --hf-split then trains). "
        "None: --hf-split's.",
    )
    cache_dir: str = _f(
        DEFAULT_CACHE_DIR,
        "Directory of the token cache (memmaps keyed by source, tokenizer and options) and of the "
        "device probe's measured GEMM rates. Overridden by the MEMTRAIN_CACHE environment variable.",
    )
    no_cache: bool = _f(False, "Tokenize again even if a cache entry exists (the entry is rewritten).")
    num_workers: int = _f(0, "DataLoader worker processes (dataloader_num_workers).")
    pin_memory: bool = _f(False, "Pin host batches so host-to-device copies are asynchronous (dataloader_pin_memory).")
    prefetch_factor: Optional[int] = _f(None, "Batches prefetched per worker (needs --num-workers > 0).")

    def __post_init__(self) -> None:
        # An empty path is the current folder: every data file below it, a cache among them.
        require(self.data.strip() != "", "--data is empty; give a file, a folder, a glob, 'default' or hf:NAME")
        require(self.cache_dir.strip() != "", "--cache-dir is empty; give a folder or drop --cache-dir")
        _check_homes(("--data", self.data), ("--cache-dir", self.cache_dir))
        # Settings of a kind of source that --data is not: dropped otherwise (the run trained on
        # the default corpus when --data was forgotten next to --text-field).
        plain = self.data == "default" or (not glob.has_magic(self.data) and self.data.lower().endswith(".txt"))
        require(self.text_field is None or not plain,
                f"--text-field {self.text_field} names a field of a structured --data (.jsonl, .json, .parquet, .csv, "
                f"Posts.xml, hf:...); --data {self.data} is plain text: give that --data or drop --text-field")
        require(self.data_format in DATA_FORMATS,
                f"unknown --data-format {self.data_format!r}; choose one of {', '.join(DATA_FORMATS)}")
        if self.data_format != "text":
            self._check_record_format(plain)
        self.chat_template_kwargs = template_kwargs_text(self.chat_template_kwargs)
        for flag, value in (("--chat-template", self.chat_template), ("--chat-template-kwargs", self.chat_template_kwargs)):
            require(value is None or self.data_format != "text",
                    f"{flag} renders the records of --data-format chat, prompt-completion or auto; --data-format text "
                    f"renders none: give one of those formats or drop {flag}")
        require(self.chat_template is None or self.chat_template.strip() != "",
                "--chat-template is empty; give a .jinja file or drop --chat-template")
        require(self.loss_on in LOSS_ON, f"unknown --loss-on {self.loss_on!r}; choose one of {', '.join(LOSS_ON)}")
        require(self.packing in PACKINGS, f"unknown --packing {self.packing!r}; choose one of {', '.join(PACKINGS)}")
        require(self.hf_split == "train" or self.data.startswith("hf:"),
                f"--hf-split {self.hf_split} picks a split of an hf: --data; --data {self.data} has none: give "
                "--data hf:NAME or drop --hf-split")
        require(0.0 < self.val_fraction < 1.0, f"--val-fraction must be in (0, 1), got {self.val_fraction}")
        require(self.val_blocks > 0, f"--val-blocks must be positive, got {self.val_blocks}")
        self._check_validation_source()
        require(self.num_workers >= 0, f"--num-workers must be >= 0, got {self.num_workers}")
        check_at_most("--num-workers", self.num_workers, MAX_RANKS)
        require(self.prefetch_factor is None or self.prefetch_factor >= 1,
                f"--prefetch-factor must be at least 1 (batches each worker loads ahead), got {self.prefetch_factor}")
        require(
            self.prefetch_factor is None or self.num_workers > 0,
            "--prefetch-factor needs --num-workers > 0; set --num-workers 2 or drop --prefetch-factor",
        )
        require(
            self.max_documents is None or self.max_documents > 0,
            f"--max-documents must be positive, got {self.max_documents}",
        )

    @property
    def ignores_targets(self) -> bool:
        """Whether some targets are -100 (ignored): a prompt's under --loss-on completion, a pad's
        under --packing pad; the losses then average the others only."""
        return self.loss_on == "completion" or self.packing == "pad"

    def validation_config(self) -> Optional["DataConfig"]:
        """The DataConfig of the separate validation source (--val-data, or --val-split of an hf:
        --data): its source and split, every text option of --data's; None when validation is held
        out of --data (--val-fraction)."""
        source = self.val_data if self.val_data is not None else (self.data if self.val_split is not None else None)
        if source is None:
            return None
        return dataclasses.replace(self, data=source, hf_split=self.val_split or self.hf_split,
                                   val_data=None, val_split=None)

    def _check_validation_source(self) -> None:
        """--val-data and --val-split: refused where they cannot be read as given, and beside the
        settings of the held-out split they replace (--val-fraction, --split-seed): refused rather
        than ignored, as a flag of a technique that is off is, since a run that took a fraction
        out of nothing would record a split it never made. A value equal to the default asks
        nothing (a config file may spell every key)."""
        if self.val_data is None and self.val_split is None:
            return
        require(self.val_data is None or self.val_data.strip() != "",
                "--val-data is empty; give a file, a folder, a glob, 'default' or hf:NAME, or drop --val-data")
        _check_homes(("--val-data", self.val_data))
        require(self.val_split is None or self.val_split.strip() != "",
                "--val-split is empty; give a split name (validation, test) or drop --val-split")
        source = self.val_data if self.val_data is not None else self.data
        require(self.val_split is None or source.startswith("hf:"),
                f"--val-split {self.val_split} picks a split of an hf: validation source; "
                f"{'--val-data' if self.val_data is not None else '--data'} {source} has none: give --val-data hf:NAME "
                "or drop --val-split")
        flag = f"--val-data {self.val_data}" if self.val_data is not None else f"--val-split {self.val_split}"
        for name, default in (("val_fraction", DEFAULT_VAL_FRACTION), ("split_seed", DEFAULT_SPLIT_SEED)):
            value = getattr(self, name)
            require(value == default,
                    f"--{name.replace('_', '-')} {value} splits --data into train and validation; {flag} validates "
                    f"on its own source and trains on all of --data: drop --{name.replace('_', '-')} (or {flag})")
        try:
            self.validation_config()  # the text options checked against the validation source's kind
        except ConfigError as exc:
            raise ConfigError(val_data_message(str(exc))) from None

    def check_answer_source(self) -> None:
        """--loss-on completion reads its targets from records: refused over --data-format text.
        Checked where data is read (train), not in ``__post_init__``: estimate, plan and maxbatch
        take --loss-on to size such a step and read no data."""
        require(self.loss_on == "all" or self.data_format != "text",
                f"--loss-on {self.loss_on} trains on the answers of chat or prompt-completion records; --data-format "
                "text has none: give --data-format chat, prompt-completion or auto, or drop --loss-on")

    def _check_record_format(self, plain: bool) -> None:
        """A --data-format other than text reads whole records: refused where --data holds no
        records (plain text, a Posts.xml dump) and beside the text-only options."""
        flag = f"--data-format {self.data_format}"
        xml = not glob.has_magic(self.data) and self.data.lower().endswith(".xml")
        require(not plain and not xml,
                f"{flag} reads records (.jsonl, .json, .parquet, hf:...); --data {self.data} is plain text: give "
                "records or drop --data-format")
        require(self.text_field is None,
                f"{flag} reads the records' own fields (messages, conversations, prompt, completion); drop "
                "--text-field, which names the text of --data-format text")
        require(not self.strip_html,
                f"{flag} renders records with a chat template, whose markup --strip-html would remove; drop "
                "--strip-html")


def val_data_message(line: str) -> str:
    """A line said of --data, said of the validation source it was about: its checks and readers
    name the flag of the source they were given, which there is --val-data (``--data-format``
    and the other ``--data-*`` flags are kept)."""
    return re.sub(r"--data(?![-\w])", "--val-data", line)


# --------------------------------------------------------------------------- techniques
# The choices of --precision and --optim are the keys of the technique registry.
PRECISIONS = tuple(PRECISION_FACTS)
ATTENTIONS = ("math", "sdpa", "flash", "mem-efficient", "flex", "flash-attn")
LOSSES = ("standard", "chunked", "naive")
LOSS_KERNELS = ("memtrain", *FOREIGN_LOSS_KERNELS)  # memtrain, liger, cce
OPTIMS = tuple(OPTIMIZER_STATE_RULES)
DISTRIBUTED = ("none", "ddp", "zero1", "zero2", "fsdp", "deepspeed-zero2", "deepspeed-zero3")


@dataclass
class TechniqueConfig:
    """Memory and speed techniques. All combine; they are applied in one documented order
    (lora -> attention backend -> activation checkpointing -> compile -> distributed wrap)."""

    precision: str = _f("fp32", "Numeric precision: " + "|".join(PRECISIONS) + ".")
    attention: str = _f("math", "Attention implementation: " + "|".join(ATTENTIONS) + ". The default is memtrain's "
                        "GPT's; a transformers --model defaults to sdpa (eager math for a family without SDPA), as "
                        "transformers builds it.")
    window: Optional[int] = _f(None, "Sliding-window attention: each token attends to the previous W tokens.")
    checkpointing: str = _f(
        "none", "Activation checkpointing: none|full|every:K|sqrt|selective|selective-matmul "
        "(gradient_checkpointing). selective: Megatron's (Korthikanti et al. 2022): keep everything "
        "but the attention core (scores, softmax, dropout), recompute that; selective-matmul: keep "
        "matmul/attention-kernel outputs, recompute the rest of each block."
    )
    loss: str = _f("standard", "LM-head loss: standard (full logits), chunked (logits never all alive) or naive "
                               "(standard, with the logits kept by the caller until the next step replaces them, "
                               "as the common `logits = model(x); loss = F.cross_entropy(...)` loop does).")
    loss_chunk: int = _f(
        0,
        "Tokens per chunk for --loss chunked; 0 (default) picks by device: 256 on a CPU (256 x 50257 "
        "fp32 logits = 51 MB alive at a time); on CUDA, where each chunk costs one compiled call and one "
        "pass over the weight gradient, 1024, halved (down to 256) while its logits would hold more than "
        "2^28 values (1024 for every vocabulary up to 262,144 tokens; docs/techniques.md). "
        "Ignored by --loss-kernel liger and cce, which pick their own blocks.",
    )
    loss_kernel: str = _f(
        "memtrain",
        "Kernel of --loss chunked: memtrain (its own chunked loss, on every device), liger "
        "(Liger-Kernel's fused linear cross-entropy) or cce (Apple's Cut Cross-Entropy: the logits never "
        "leave on-chip memory; bf16/fp16 compute). liger and cce run on CUDA with their package installed "
        "(liger-kernel, cut-cross-entropy). memtrain's is the default: on an H100 its Qwen2.5-0.5B step "
        "took 86 ms where Liger's took 141 ms (docs/performance.md).",
    )
    optim: str = _f("adamw", "Optimizer: " + "|".join(OPTIMS) + ".")
    optim_block: int = _f(
        0,
        "Quantization block of --optim adamw-8bit / adamw-4bit (elements per FP32 scale); 0 = "
        "torchao's default (256 for 8-bit, 128 for 4-bit; transformers' Trainer uses 256 for both). "
        "Larger blocks: fewer scales and a faster step, coarser quantization. Ignored by other optimizers.",
    )
    adafactor_relative_step: bool = _f(
        False,
        "--optim adafactor: scale every update by the parameter's RMS (the paper's relative step, "
        "torch.optim.Adafactor's default), so --lr is a fraction of each weight's size. Off: --lr is "
        "the step size, as in the Trainer's optim='adafactor' (transformers' Adafactor, "
        "scale_parameter=False, relative_step=False) and as for AdamW.",
    )
    lora_rank: int = _f(0, "LoRA rank; 0 disables LoRA (base weights trained).")
    lora_alpha: float = _f(16.0, "LoRA scaling numerator (scale = alpha / rank).")
    lora_dropout: float = _f(0.0, "Dropout on the LoRA input.")
    lora_targets: str = _f("qkv,proj,fc,fc_out", "Comma-separated Linear module names that get adapters, or "
                           "all-linear (peft's name: every decoder Linear, which the default also means for a "
                           "transformers --model).")
    qlora: bool = _f(False, "QLoRA: store the frozen base weights in 4-bit NF4 (needs --lora-rank; transformers "
                     "--model only): torchao NF4 on CPU, bitsandbytes on CUDA.")
    compile: bool = _f(False, "Compile the model with torch.compile (torch_compile).")
    compile_mode: str = _f("default", "torch.compile mode: default|reduce-overhead|max-autotune.")
    compile_scope: str = _f("model", "Compile the whole model or each block: model|block.")
    distributed: str = _f("none", "Data-parallel strategy under torchrun: " + "|".join(DISTRIBUTED) + ".")
    cpu_offload: bool = _f(False, "Offload sharded parameters/optimizer to CPU (FSDP2 CPUOffloadPolicy).")
    offload_activations: bool = _f(
        False,
        "Activation offloading (torchtune's enable_activation_offloading): tensors the forward saves for "
        "backward are copied to host memory (pinned, on a side stream on CUDA) and brought back ahead of "
        "use in the backward. With --checkpointing only the checkpointed blocks' inputs are saved, so only "
        "those move. Costs host-link time (PCIe) each step; parameters and tensors under 1 KiB stay.",
    )
    compile_memory_budget: Optional[float] = _f(
        None,
        "With --compile: torch.compile's activation memory budget F in (0, 1] (torch._functorch.config."
        "activation_memory_budget): the min-cut partitioner saves at most F of what it saves by default "
        "(the graph's inputs aside) and recomputes the cheapest rest in backward. None: torch's default (1.0).",
    )

    def __post_init__(self) -> None:
        require(self.precision in PRECISIONS, f"unknown --precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}")
        require(self.attention in ATTENTIONS, f"unknown --attention {self.attention!r}; choose one of {', '.join(ATTENTIONS)}")
        require(self.loss in LOSSES, f"unknown --loss {self.loss!r}; choose one of {', '.join(LOSSES)}")
        require(self.optim in OPTIMS, f"unknown --optim {self.optim!r}; choose one of {', '.join(OPTIMS)}")
        require(self.distributed in DISTRIBUTED, f"unknown --distributed {self.distributed!r}; choose one of {', '.join(DISTRIBUTED)}")
        require(self.window is None or self.window > 0, f"--window must be positive, got {self.window}")
        require(self.loss_chunk >= 0, f"--loss-chunk must be positive (or 0: by device), got {self.loss_chunk}")
        require(self.loss_kernel in LOSS_KERNELS,
                f"unknown --loss-kernel {self.loss_kernel!r}; choose one of {', '.join(LOSS_KERNELS)}")
        require(self.loss_kernel == "memtrain" or self.loss == "chunked",
                f"--loss-kernel {self.loss_kernel} picks the kernel of --loss chunked; add --loss chunked "
                "or drop --loss-kernel")
        precision_error = loss_kernel_precision_error(self.loss_kernel, self.precision)
        require(precision_error is None, precision_error or "")
        require(self.optim_block >= 0 and self.optim_block % 2 == 0,
                f"--optim-block must be 0 (torchao's default) or a positive even number, e.g. 256; got {self.optim_block}")
        require(self.lora_rank >= 0, f"--lora-rank must be >= 0, got {self.lora_rank}")
        require(math.isfinite(self.lora_alpha) and self.lora_alpha > 0, f"--lora-alpha must be positive, got {self.lora_alpha}")
        require(0.0 <= self.lora_dropout < 1.0, f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")
        require(self.compile_mode in ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
                f"unknown --compile-mode {self.compile_mode!r}; choose default, reduce-overhead or max-autotune")
        require(self.compile_scope in ("model", "block"), f"unknown --compile-scope {self.compile_scope!r}; choose model or block")
        parse_checkpointing(self.checkpointing)
        # torchao's float8 training casts trainable high-precision Linear weights per matmul: a LoRA
        # base is frozen (peft wraps it) and QLoRA's is NF4, neither a weight it converts.
        require(not (self.precision == "fp8" and (self.lora_rank or self.qlora)),
                "--precision fp8 trains every weight (torchao float8 training); with --lora-rank/--qlora use "
                "--precision bf16")
        require(not (self.offload_activations and self.distributed.startswith("deepspeed")),
                f"--offload-activations wraps memtrain's own train step, but --distributed {self.distributed} runs "
                "DeepSpeed's engine step: use --distributed zero2 or fsdp, or drop --offload-activations")
        self._check_compile_memory_budget()

    def _check_compile_memory_budget(self) -> None:
        budget = self.compile_memory_budget
        if budget is None:
            return
        require(math.isfinite(budget) and 0.0 < budget <= 1.0,
                f"--compile-memory-budget must be in (0, 1] (1 = torch's default partition), got {budget}")
        require(self.compile, "--compile-memory-budget sets torch.compile's partitioner: add --compile")


# --------------------------------------------------------------------------- training
MAX_LR = 10.0  # far above any working learning rate; 1e30 or inf is a typo, not a setting
DEFAULT_MODULE_TOP = 10  # entries of the --memory-by-module table printed before "other"


@dataclass
class TrainConfig:
    """Optimisation loop, evaluation, checkpoints and output."""

    batch_size: int = _f(8, "Micro-batch size (sequences per forward/backward).")
    seq_len: int = _f(256, "Tokens per training sequence (<= --max-seq-len; when not given, a model with fewer "
                           "positions than this default trains at its own length).")
    steps: int = _f(200, "Optimizer steps (one epoch is 200 steps by default).")
    grad_accum: int = _f(1, "Micro-batches per optimizer step (gradient_accumulation_steps).")
    lr: float = _f(3e-4, "Peak learning rate.")
    warmup_steps: int = _f(
        200,
        "Linear warm-up steps W up to --lr: step s (from 0) runs at (s + 1) / W of it, so the first step "
        "already learns. When --steps is set and no setting names the warm-up, it is capped at "
        "10%% of --steps (a 30-step run would never reach --lr); with neither set, the default 200-step run "
        "warms up over all 200 (the seed's one-epoch warm-up).",
    )
    schedule: str = _f("cosine", "Learning-rate shape after warm-up: cosine|linear|constant (linear: straight down "
                       "to --min-lr-ratio, the Trainer's default shape with --min-lr-ratio 0).")
    min_lr_ratio: float = _f(0.1, "Floor of the cosine or linear decay as a fraction of --lr.")
    weight_decay: float = _f(0.1, "Decoupled weight decay on matrices (not on biases, norms).")
    beta1: float = _f(0.9, "Adam beta1.")
    beta2: float = _f(0.95, "Adam beta2.")
    grad_clip: float = _f(1.0, "Clip the global gradient norm to this (0 disables).")
    seed: int = _f(1337, "Seed for weights, dropout and batch order.")
    device: str = _f("auto", "Device: auto|cpu|cuda|cuda:N.")
    eval_every: int = _f(0, "Also evaluate every N steps (0: only at the end).")
    warmup_timing_steps: int = _f(3, "First steps left out of step-time statistics.")
    sync_steps: bool = _f(
        False,
        "Wait for the device after every step: the loss is read at once and each step is timed by the "
        "host clock. Off, a single-process GPU run keeps the losses on the device and reads those of the "
        "steps since the last read together, once per metrics line (--log-every), evaluation, checkpoint "
        "or 100 steps, after queuing the next step (the device never idles while the host logs or "
        "fetches), and times steps with CUDA events. No effect on a CPU.",
    )
    out: str = _f("runs/train", "Output directory (result.json is written there).")
    save: Optional[str] = _f(None, "Write a checkpoint to this file at the end (atomically): what export, generate "
                             "and --resume read. None: the trained weights are not kept.")
    save_every: int = _f(0, "Also checkpoint every N steps to --save (0: only at the end).")
    resume: Optional[str] = _f(None, "Resume model, optimizer, scheduler, RNG and data position from this checkpoint; "
                                     "a larger --steps than the saved run's trains it longer (its LR schedule stretched "
                                     "over the new --steps).")
    stop_after: Optional[int] = _f(
        None,
        "Stop after this many optimizer steps, as if interrupted, with --save writing a checkpoint "
        "there; the schedule still spans --steps, so --resume continues the same run.",
    )
    progress: Optional[bool] = _f(
        None, "Show a progress bar on stderr: --progress always, --no-progress never; unset, only when stderr "
        "is a terminal (a captured stderr keeps an error: as its one line). Unset, train writes a plain line "
        "to a stderr that is a file or pipe once a phase (tokenizing, training) has run 5 s, then at most "
        "every 30 s.")
    report_to: str = _f(
        "none",
        "Where live metrics go besides OUT/metrics.jsonl (always written by train): "
        "none|tensorboard|wandb, comma-separated (extras memtrain[tensorboard], memtrain[wandb]).",
    )
    log_every: int = _f(1, "Write a metrics.jsonl line (and TensorBoard/wandb point) every N steps.")
    memory_by_module: bool = _f(
        False,
        "Also report which modules hold the tracked peak, by category (train: measured, memory.by_module "
        "in result.json; estimate: traced under fake tensors). Off, no module hook is installed.",
    )
    module_depth: Optional[int] = _f(
        None,
        "Module path depth of --memory-by-module (1: blocks, 2: blocks.0). Default: each Transformer "
        "block one entry (blocks.0 for memtrain's GPT, model.layers.0 for a transformers model).",
    )
    module_top: int = _f(DEFAULT_MODULE_TOP, "Entries --memory-by-module prints, largest first; the rest are summed as other.")
    nudge_seed: int = _f(
        0,
        "Move every initial weight by about one rounding of its dtype, drawn with this seed (0: no nudge). "
        "A bench noise twin (row X-nudgeN) is row X with --nudge-seed N: how far a rounding-size "
        "difference carries the run is what its PPL difference shows.",
    )

    def __post_init__(self) -> None:
        _check_homes(("--out", self.out), ("--save", self.save), ("--resume", self.resume))
        for name in ("batch_size", "seq_len", "steps", "grad_accum"):
            require(getattr(self, name) > 0, f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        for name in ("batch_size", "grad_accum"):  # a batch of 10**30 overflows torch or hangs a search
            check_at_most(f"--{name.replace('_', '-')}", getattr(self, name), MAX_BATCH)
        require(math.isfinite(self.lr) and 0 < self.lr <= MAX_LR,
                f"--lr must be positive and at most {MAX_LR:g} (larger diverges at once), got {self.lr}")
        require(math.isfinite(self.weight_decay) and self.weight_decay >= 0,
                f"--weight-decay must be >= 0 and finite, got {self.weight_decay}")
        for name in ("beta1", "beta2"):
            require(0.0 <= getattr(self, name) < 1.0, f"--{name} must be in [0, 1), got {getattr(self, name)}")
        require(0 <= self.seed < 2**32, f"--seed must be in [0, 2**32), got {self.seed}")
        require(0 <= self.nudge_seed < 2**32, f"--nudge-seed must be in [0, 2**32) (0: no nudge), got {self.nudge_seed}")
        for name in ("eval_every", "save_every", "warmup_timing_steps"):
            require(getattr(self, name) >= 0, f"--{name.replace('_', '-')} must be >= 0 (0 turns it off), got {getattr(self, name)}")
        require(self.out.strip() != "", "--out is empty; give a directory, e.g. --out runs/train")
        require(self.save is None or self.save.strip() != "", "--save is empty; give a file path or drop --save")
        require(self.resume is None or self.resume.strip() != "", "--resume is empty; give a checkpoint path or drop --resume")
        # One path for every check and every write: "~" is the home folder (as for --data and
        # --cache-dir); the checks expanded it while the writes made a folder named "~" here.
        self.out = os.path.expanduser(self.out)
        self.save = None if self.save is None else os.path.expanduser(self.save)
        self.resume = None if self.resume is None else os.path.expanduser(self.resume)
        # Without --save the periodic checkpoints would go nowhere, silently (the Trainer's
        # save_steps writes into output_dir: a user of the alias expects files).
        require(not self.save_every or self.save is not None,
                f"--save-every {self.save_every} checkpoints to --save PATH, and no --save is given; add --save "
                f"(e.g. --save {self.out.rstrip('/') or 'runs/train'}/ckpt.pt) or drop --save-every")
        require(self.warmup_steps >= 0, f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        require(self.schedule in ("cosine", "linear", "constant"),
                f"unknown --schedule {self.schedule!r}; choose cosine, linear or constant")
        require(math.isfinite(self.grad_clip) and self.grad_clip >= 0, f"--grad-clip must be >= 0 and finite, got {self.grad_clip}")
        require(0.0 <= self.min_lr_ratio <= 1.0, f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        require(self.log_every > 0, f"--log-every must be positive, got {self.log_every}")
        bad = [s for s in self.report_to.split(",") if s.strip() not in ("none", "tensorboard", "wandb")]
        require(not bad, f"unknown --report-to {bad[0] if bad else ''!r}; choose none, tensorboard or wandb (comma-separated)")
        require(self.stop_after is None or 0 < self.stop_after <= self.steps,
                f"--stop-after must be between 1 and --steps ({self.steps}), got {self.stop_after}")
        check_device_name(self.device)
        self._check_module_table()

    def _check_module_table(self) -> None:
        """--module-depth and --module-top shape --memory-by-module's table: valid, and only with it."""
        require(self.module_depth is None or self.module_depth >= 1,
                f"--module-depth must be >= 1 (1: top-level modules such as blocks, 2: blocks.0), got {self.module_depth}")
        require(self.module_top >= 1, f"--module-top must be >= 1, got {self.module_top}")
        if not self.memory_by_module:
            named = "--module-depth" if self.module_depth is not None else "--module-top" if self.module_top != DEFAULT_MODULE_TOP else None
            require(named is None, f"{named} shapes the table of --memory-by-module: add --memory-by-module (or drop {named})")


# The device names memtrain runs on (torch.device's spelling of them): anything else (mps, xpu,
# a typo) is refused from the argument itself, torch-free, before a verb imports its machinery.
_DEVICE_NAME = re.compile(r"(auto|cpu(:\d+)?|cuda(:\d+)?)")


def check_device_name(name: str) -> None:
    """ConfigError unless ``name`` is auto, cpu or cuda[:N]. Whether a CUDA device is here is
    torch's to say (``runtime.env.resolve_device``); this check needs no import, so every verb says
    it as its config is built: `maxbatch --device mps` refused after the search's modules loaded
    (seconds), and estimate, plan and flops answered as if for a CPU."""
    require(_DEVICE_NAME.fullmatch(name) is not None,
            f"--device {name!r} is not supported; use auto, cpu, cuda or cuda:N")


CACHE_ENV = "MEMTRAIN_CACHE"


def effective_cache_dir(data: DataConfig) -> str:
    """The token cache folder a run uses, as written (``~`` unexpanded): ``$MEMTRAIN_CACHE`` when
    set, else ``--cache-dir``."""
    check_cache_env()
    return os.environ.get(CACHE_ENV) or data.cache_dir


def check_cache_env() -> None:
    """``$MEMTRAIN_CACHE`` names no home folder of an unknown user (refused before anything runs)."""
    _check_homes((f"environment variable {CACHE_ENV}", os.environ.get(CACHE_ENV) or None))


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "technique": TechniqueConfig,
    "train": TrainConfig,
}


@dataclass
class RunConfig:
    """Everything one training run needs, resolved and validated."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    technique: TechniqueConfig = field(default_factory=TechniqueConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        # A transformers model (--model) takes its limits from its config.json, not from
        # memtrain's model flags: the message names what the user can change.
        hf = self.model.model
        # Past memtrain's size limit neither a larger --max-seq-len nor a config.json with more
        # max_position_embeddings (both bounded by the same limit) helps: name the limit, as
        # estimate does, not the flag.
        check_at_most("--seq-len", self.train.seq_len, MAX_WIDTH)
        require(
            self.train.seq_len <= self.model.max_seq_len,
            f"--seq-len {self.train.seq_len} exceeds the max_position_embeddings {self.model.max_seq_len} of "
            f"--model {hf!r}; lower --seq-len (or use a config.json with a larger max_position_embeddings)" if hf else
            f"--seq-len {self.train.seq_len} exceeds --max-seq-len {self.model.max_seq_len}; "
            f"lower --seq-len or raise --max-seq-len",
        )
        if self.technique.window is not None:
            require(
                self.technique.window <= self.train.seq_len,
                f"--window {self.technique.window} is larger than --seq-len {self.train.seq_len}; "
                f"use a window <= seq-len (or drop --window for full causal attention)",
            )
        if self.technique.lora_rank:
            require(self.technique.lora_rank <= self.model.d_model,
                    f"--lora-rank {self.technique.lora_rank} exceeds the hidden size {self.model.d_model} of "
                    f"--model {hf!r}; lower --lora-rank" if hf else
                    f"--lora-rank {self.technique.lora_rank} exceeds --d-model {self.model.d_model}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def recorded(self) -> dict[str, Any]:
        """This config as a result records it: every setting as resolved, and the token cache
        folder the run used (``$MEMTRAIN_CACHE`` overrides ``--cache-dir``, so the setting alone
        could name a folder the run never read)."""
        config = self.to_dict()
        config["data"]["cache_dir"] = effective_cache_dir(self.data)
        return config

    def replace(self, **overrides: Any) -> "RunConfig":
        """A copy with flat overrides applied (``batch_size=4, precision='bf16'``). The settings
        a command line named (``given_settings``, see memtrain.cli.config_from_args) carry over,
        with the overridden ones added."""
        copy = build_config(self.to_dict(), overrides)
        given = getattr(self, "given_settings", None)
        if given is not None:
            copy.given_settings = frozenset(given) | set(overrides)  # type: ignore[attr-defined]
        return copy


def field_index() -> dict[str, str]:
    """Map every field name to its section name (names are unique across sections)."""
    index: dict[str, str] = {}
    for section, cls in SECTIONS.items():
        for f in fields(cls):
            assert f.name not in index, f"duplicate config field {f.name}"
            index[f.name] = section
    return index


# Optional sources whose empty value is a mistake, not a way to say "unset": "" stays "" for them, so
# that DataConfig's check refuses it in one line ("--val-data is empty; ... or drop --val-data").
# Read as None, `--val-data ""` (a shell variable that was never set) silently validated on a
# share of --data instead. "none" or "null" still says unset, as for every optional field.
# --save "" and --resume "" likewise: read as None, a run asked to checkpoint saved nothing, and a run
# asked to resume started from scratch, both without a word (TrainConfig refuses them in one line).
EMPTY_IS_REFUSED = frozenset({"val_data", "val_split", "chat_template", "save", "resume"})


def _says_unset(name: str, value: Any) -> bool:
    """Whether ``value`` of optional field ``name`` means None: "none", "null", and "" except for
    the fields of EMPTY_IS_REFUSED."""
    if not isinstance(value, str) or value.lower() not in ("none", "null", ""):
        return False
    return not (value == "" and name in EMPTY_IS_REFUSED)


def _coerce(cls: type, name: str, value: Any) -> Any:
    """Coerce a value from a file or string into the field's declared type; a config file's mapping
    for --chat-template-kwargs is the JSON object the flag takes."""
    if name == "chat_template_kwargs" and isinstance(value, dict):
        return template_kwargs_text(value)
    return _coerce_scalar(cls, name, value)


def _coerce_scalar(cls: type, name: str, value: Any) -> Any:
    """Coerce a scalar from a file or string into the field's declared type."""
    f = {f.name: f for f in fields(cls)}[name]
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    optional = t.startswith("Optional[")
    base = t[len("Optional["):-1] if optional else t
    if value is None:
        if optional:
            return None
        raise ConfigError(f"--{name.replace('_', '-')} expects {base}, got null; give a value or leave the key out")
    if isinstance(value, bool) and base in ("int", "float"):
        raise ConfigError(f"--{name.replace('_', '-')} expects {base}, got {value!r}")
    if isinstance(value, (dict, list)):
        raise ConfigError(f"--{name.replace('_', '-')} expects {base}, got a {type(value).__name__}")
    if optional and _says_unset(name, value):
        return None
    try:
        if base == "bool":
            if isinstance(value, str):
                if value.lower() in ("1", "true", "yes", "on"):
                    return True
                if value.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError(value)
            return bool(value)
        if base == "int":
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if base == "float":
            number = float(value)
            if math.isnan(number):  # NaN passes every comparison of the checks below as False
                raise ValueError(value)
            return number
        text = str(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"--{name.replace('_', '-')} expects {base}, got {_shown(value)}") from None
    return _without_nul(name, text)


def _without_nul(name: str, text: str) -> str:
    """``text``, a text setting without a NUL character: no path or name holds one, and os calls
    given one raised ValueError midway through a run."""
    if "\x00" in text:
        raise ConfigError(f"--{name.replace('_', '-')} holds a NUL character (\\x00); remove it")
    return text


def _shown(value: Any, width: int = 40) -> str:
    """``repr(value)``, cut to ``width`` characters (a 300-digit typo stays a one-line message)."""
    text = repr(value)
    return text if len(text) <= width else text[:width] + f"... ({len(text)} characters)"


def _check_integers_fit(parts: dict[str, Any]) -> None:
    """Every integer setting fits torch's int64. Sizes have tighter bounds of their own (checked
    first, in each section); this catches the rest (--steps, --warmup-steps, --save-every ...)."""
    for section in parts.values():
        for f in fields(section):
            value = getattr(section, f.name)
            if isinstance(value, int) and not isinstance(value, bool):
                check_at_most(f"--{f.name.replace('_', '-')}", abs(value), MAX_INT)


def flatten(nested: dict[str, Any]) -> dict[str, Any]:
    """Accept both ``{"model": {"d_model": 64}}`` and ``{"d_model": 64}``; return flat keys.
    A key that is no string (a checkpoint's saved config read, not trusted) is a ValueError."""
    flat: dict[str, Any] = {}
    for key, value in (nested or {}).items():
        key = _setting_name(key)
        if key in SECTIONS and isinstance(value, dict):
            for k, v in value.items():
                flat[_setting_name(k)] = v
        else:
            flat[key] = value
    return flat


def _setting_name(key: Any) -> str:
    if not isinstance(key, str):
        raise ValueError(f"the key {_shown(key)} is not a setting name")
    return key.replace("-", "_")


def unknown_option_line(key: str) -> str:
    """The refusal of a setting name no section has, with the closest name as a hint. The
    Trainer's names are settings too (a file's `learning_rat` means `learning_rate`), as the
    command line's own suggestion offers them."""
    close = difflib.get_close_matches(key, [*field_index(), *ALIASES_BY_NAME], n=1)
    hint = f"; did you mean --{close[0].replace('_', '-')}?" if close else "; see --help for the options"
    return f"unknown option --{key.replace('_', '-')}{hint}"


def build_config(*layers: dict[str, Any]) -> RunConfig:
    """Merge layers of settings (later wins) into a validated RunConfig.

    Each layer is nested by section or flat. Unknown keys are rejected with a hint. A ``model``
    setting (``--model SPEC``) is resolved through :meth:`ModelConfig.from_spec`, so its shape
    fields mirror the model.
    """
    index = field_index()
    per_section: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    warmup_ratio: Optional[float] = None  # the Trainer's --warmup_ratio, resolved once --steps is known
    for layer in layers:
        try:  # the Trainer's option names and values (memtrain.config.aliases) become ours
            flat = normalize_aliases(flatten(layer))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if "warmup_steps" in flat:  # steps given beside (or after) a ratio win, as in the Trainer
            warmup_ratio = None
        elif WARMUP_RATIO in flat:
            warmup_ratio = flat[WARMUP_RATIO]
        flat.pop(WARMUP_RATIO, None)
        for key, value in flat.items():
            if key not in index:
                raise ConfigError(unknown_option_line(key))
            section = index[key]
            per_section[section][key] = _coerce(SECTIONS[section], key, value)
    if warmup_ratio is not None:
        steps = per_section["train"].get("steps", TrainConfig.steps)
        if isinstance(steps, int) and steps > 0:  # TrainConfig reports a bad --steps
            per_section["train"]["warmup_steps"] = math.ceil(warmup_ratio * steps)
    # The seed's spec (a 200-step epoch with 200 warm-up steps) stands when no layer sets --steps;
    # a run whose length was chosen but whose warm-up was not gets a warm-up that fits inside it.
    default_warmup = "warmup_steps" not in per_section["train"] and "steps" in per_section["train"]
    if default_warmup:
        steps = per_section["train"]["steps"]
        if isinstance(steps, int) and steps > 0:
            per_section["train"]["warmup_steps"] = capped_warmup(steps)
    # --model is resolved here, by its named constructor (ModelConfig itself reads nothing), and
    # first, as before: an unknown model is reported ahead of the other sections' values.
    model = per_section["model"]
    parts: dict[str, Any] = {"model": ModelConfig.from_spec(model.pop("model", None), **model)}
    max_len = parts["model"].max_seq_len
    if "seq_len" not in per_section["train"] and isinstance(max_len, int) and 0 < max_len < TrainConfig.seq_len:
        # A default, not a request: a model shorter than it trains at its own length, as transformers'
        # run_clm caps its block size at the model's; a --seq-len given is still checked against it.
        per_section["train"]["seq_len"] = max_len
    parts.update({s: SECTIONS[s](**kv) for s, kv in per_section.items() if s != "model"})
    _check_integers_fit(parts)
    cfg = RunConfig(**parts)
    _record_trained_lora_targets(cfg)
    # Remembered (not a field, so not in result.json's config) for the CLI's one-line note.
    cfg.train.warmup_defaulted = default_warmup  # type: ignore[attr-defined]  # read with getattr(..., False)
    return cfg


def _record_trained_lora_targets(cfg: RunConfig) -> None:
    """Set in ``cfg`` the LoRA targets a transformers ``--model`` trains: our GPT's default list
    (``qkv,proj,fc,fc_out``) means peft's ``all-linear`` there, and result.json, checkpoints and
    bench rows record the config, so they name what was adapted rather than our GPT's modules."""
    from memtrain.models.spec import ALL_LINEAR, GPT_LORA_TARGETS, is_gpt_preset  # torch-free; spec reads config

    tech = cfg.technique
    if tech.lora_rank and tech.lora_targets == GPT_LORA_TARGETS and not is_gpt_preset(cfg.model.model):
        tech.lora_targets = ALL_LINEAR


WARMUP_FRACTION = 0.1


def capped_warmup(steps: int) -> int:
    """Warm-up when none is set: the default 200, capped at 10% of ``steps`` (at least 1)."""
    return min(TrainConfig.warmup_steps, max(1, math.ceil(WARMUP_FRACTION * steps)))


def parse_size(text: str | int | float) -> int:
    """Parse a memory size such as ``8GiB``, ``1.5GB``, ``512MiB`` or a byte count (at least one
    byte, at most ``limits.MAX_BYTES``)."""
    s = str(text).strip().replace(" ", "")
    units = {
        "": 1, "b": 1,
        "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15, "eb": 10**18,
        "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50, "eib": 2**60,
        "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "p": 2**50, "e": 2**60,
    }
    num = s.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    unit = s[len(num):].lower()
    try:
        value = float(num)
    except ValueError:
        value = math.nan
    if unit not in units or math.isnan(value):
        raise ConfigError(f"cannot read memory size {text!r}; write it like 8GiB, 1.5GB or 512MiB")
    if value <= 0:
        raise ConfigError(f"memory size {text!r} is not positive; write it like 8GiB, 1.5GB or 512MiB")
    size = value * units[unit]  # a float: 1e300GB (or inf) is inf here, refused below
    if not size < MAX_BYTES:
        raise ConfigError(f"memory size {text!r} is beyond what memtrain handles (less than 1 EiB, 1024 PiB); "
                          "write it like 8GiB, 1.5GB or 512MiB")
    if size < 1:
        raise ConfigError(f"memory size {text!r} is less than one byte; write it like 8GiB, 1.5GB or 512MiB")
    return int(size)
