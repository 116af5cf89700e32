"""Export a memtrain checkpoint as a Hugging Face transformers model directory.

A checkpoint holds the run's config (``state["config"]``), which says which model was trained:

* **memtrain's own GPT** becomes a ``GPT2LMHeadModel``. Our GPT is GPT-2's architecture with
  other parameter names, so the weights map one to one; transformers writes the directory
  (``save_pretrained``: ``config.json`` + ``model.safetensors``) and its GPT-2 tokenizer class
  writes the tokenizer files from the vocabulary memtrain ships. Differences handled here:

  - GPT-2 stores its projections in ``Conv1D`` modules, weight shape (in, out): our
    ``nn.Linear`` weights (out, in) are transposed.
  - ``--vocab-multiple`` padding rows are dropped (the padded rows are never used).
  - The LM head is tied to the token embedding unless ``--untie-embeddings``.
  - Our MLP uses ``F.gelu(approximate="tanh")``: transformers' ``gelu_pytorch_tanh`` is the
    same function (``gelu`` would be the exact erf form and change the logits).
  - ``--no-bias`` models get zero biases (GPT-2 always has them; a zero bias adds nothing).

* **a transformers model** (``train --model SPEC``) is rebuilt from its spec (the same
  architecture, ``--window`` included), given the checkpoint's weights, and written by
  transformers' own ``save_pretrained`` in the dtype it was trained in, with the model's own
  tokenizer (GPT-2's when its folder had none, as for training). QLoRA's NF4 base weights
  (torchao, CPU) are dequantized first; bitsandbytes' packed 4-bit weights (CUDA) keep their
  scales outside the checkpoint, so such a run exports its adapter only.

LoRA adapters are merged into the base weights (``W + alpha/r * B A``) by default. With
``adapter_only`` a transformers model's adapters are written as a peft adapter instead
(``adapter_config.json`` + ``adapter_model.safetensors``), for
``PeftModel.from_pretrained(base, out)`` on the base the run started from.

Checkpoints are read with ``torch.load(weights_only=True)``: no pickled code runs; a model
folder is read by transformers with ``trust_remote_code=False`` and safetensors only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.nn as nn

from memtrain.checkpoints.exact import DamagedCheckpoint, check_weights, read_state
from memtrain.config.run import ConfigError, RunConfig, build_config
from memtrain.data.tokenizer import EOT_ID
from memtrain.files.results import umask
from memtrain.models import is_hf
from memtrain.models.config_json import json_object, run_folder_hint
from memtrain.models.families import data_tokenizer
from memtrain.models.gpt import GPT
from memtrain.models.hf import HFCausalLM, build_hf_model, quiet_transformers
from memtrain.models.hub_access import from_pretrained_kwargs
from memtrain.models.placement import place_weights
from memtrain.models.source import resolve
from memtrain.models.tokenizer import GPT2_TRANSFORMERS_NAME, gpt2_tokenizer_in, run_chat_template
from memtrain.runtime.extras import import_extra
from memtrain.techniques.hf_mapping import apply_hf_lora
from memtrain.techniques.lora import apply_lora, merge_adapters_in_place, merge_lora
from memtrain.training.run_paths import anchored, launch_dir
from memtrain.training.size_check import BUILD_BYTES_PER_PARAM, check_model_size

# The attention kernels any machine can load a transformers model with; the others (flash-attn,
# flex, mem-efficient: CUDA) are a training choice, not part of the weights.
PORTABLE_ATTENTION = ("math", "sdpa")


def require_transformers() -> Any:
    return import_extra("transformers")


# --------------------------------------------------------------------------- reading a checkpoint
def read_checkpoint(ckpt: str | Path) -> tuple[dict[str, Any], RunConfig]:
    """A single-file checkpoint's state and the config of the run that wrote it."""
    p = Path(ckpt)
    if p.is_dir():
        raise ConfigError(f"{str(p)!r} is a directory; give the single-file checkpoint written by --save"
                          + (run_folder_hint(p, export_hint=False)
                             or " (a sharded distributed checkpoint cannot be exported yet)"))
    # Mapped, not read: export and generate use the weights only (never the optimizer's state), and
    # the model they build takes the mapped tensors themselves (``_fit(assign=True)``).
    state = read_state(p, "give the file written by train --save", mmap=True)
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict) or not isinstance(state.get("config"), dict):
        raise ConfigError(f"checkpoint {str(p)!r} is not a memtrain checkpoint (no model or config)")
    try:
        check_weights(state["model"])
    except DamagedCheckpoint as exc:
        raise ConfigError(f"checkpoint {str(p)!r} is damaged: {exc}; export a checkpoint memtrain wrote") from None
    # The run's relative --model (and data) are relative to the folder it was launched from,
    # as for --resume (memtrain.training.run_paths): an export from another folder reads the
    # model folder the run trained, never a folder of the same name here.
    saved = anchored(state["config"], launch_dir(state, p))
    gone = _missing_model_folder(saved)
    if gone is not None:
        raise ConfigError(f"checkpoint {str(p)!r}: its run's --model {gone!r} does not exist here (a run folder "
                          "copied from another machine, or the model folder moved); put that model folder at "
                          f"{gone!r} (a symbolic link to it works) and run this again")
    try:
        cfg = build_config(saved)
    except ConfigError as exc:
        raise ConfigError(f"checkpoint {str(p)!r}: the config of the run that wrote it cannot be used here ({exc}); "
                          "run where its --model is readable (a relative path is read from the current folder)") from None
    # A checkpoint's config is read, not trusted: its shape could be absurd. A transformers model
    # takes the checkpoint's tensors in place (their dtype's bytes: an 8B BF16 model fits a host
    # that its FP32 build would not); our GPT is built in FP32.
    per_param = trained_dtype(state["model"]).itemsize if is_hf(cfg) else BUILD_BYTES_PER_PARAM
    check_model_size(cfg.model, host_bytes_per_param=per_param)
    return state, cfg


def _missing_model_folder(saved: Any) -> Optional[str]:
    """The run's ``--model`` of a checkpoint's saved config when it is an absolute path (a
    relative one was made absolute against the run's launch folder) that does not exist here;
    None otherwise. Said as what it is: "cannot be used here (... is not a preset, a bundled
    config, ...)" listed model names for a folder that merely lives elsewhere now."""
    model = saved.get("model") if isinstance(saved, dict) else None
    spec = model.get("model") if isinstance(model, dict) else None
    if isinstance(spec, str) and os.path.isabs(spec) and not os.path.lexists(spec):
        return spec
    return None


def load_trained(ckpt: str | Path, merge: bool = True) -> tuple[nn.Module, RunConfig]:
    """The trained model of a checkpoint, in eval mode: our GPT (FP32) or a transformers model
    (:class:`memtrain.models.hf.HFCausalLM`, in the dtype it was trained in), LoRA adapters
    merged unless ``merge`` is False."""
    state, cfg = read_checkpoint(ckpt)
    if is_hf(cfg):
        return _load_transformers(state["model"], cfg, Path(ckpt), merge), cfg
    return _load_gpt(state["model"], cfg, Path(ckpt)), cfg


def _fit(model: nn.Module, weights: dict[str, Any], ckpt: Path, cfg: RunConfig, assign: bool = False) -> None:
    """``model.load_state_dict(weights)``, a mismatch being the input's fault (exit 2).

    ``assign``: the model's parameters become the checkpoint's tensors themselves, in the dtypes
    training kept them in, instead of copies into what the build allocated."""
    try:
        model.load_state_dict(weights, assign=assign)
    except (RuntimeError, TypeError, ValueError) as exc:
        first = _mismatch_line(exc)
        spec = f"--model {cfg.model.model!r} as it reads now" if cfg.model.model else "the model its config describes"
        raise ConfigError(f"checkpoint {str(ckpt)!r} does not fit {spec} ({first}); export with the files the run "
                          "was trained on") from None


def _mismatch_line(exc: BaseException) -> str:
    """What a failed ``load_state_dict`` says about the first tensor that does not fit: torch's
    headline ("Error(s) in loading state_dict for HFCausalLM:") names none; the line after it
    does ("size mismatch for lm.model.norm.weight: ...", "Missing key(s) in state_dict: ...")."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    detail = lines[1] if len(lines) > 1 and lines[0].startswith("Error(s) in loading state_dict") else lines[0]
    return detail if len(detail) <= 240 else detail[:237] + "..."


def _refuse_non_finite(model: nn.Module, ckpt: Path) -> None:
    """Refuse a model whose weights hold NaN or inf (a run that diverged before its checkpoint):
    exported, they loaded everywhere, and sampling failed in torch's multinomial with a message
    that never named the checkpoint."""
    for name, p in model.named_parameters():
        if not p.is_floating_point():
            continue
        for part in p.detach().reshape(-1).split(1 << 24):  # a bool mask of 16M elements at a time
            if not bool(torch.isfinite(part).all()):
                raise ConfigError(f"checkpoint {str(ckpt)!r} holds NaN or inf in {name}: its run diverged before it "
                                  "was saved; export an earlier checkpoint, or train again with a lower --lr")


def _load_gpt(weights: dict[str, Any], cfg: RunConfig, ckpt: Path) -> GPT:
    """Our GPT with a checkpoint's weights (LoRA merged), in FP32 and eval mode."""

    model = GPT(cfg.model)
    if cfg.technique.lora_rank:
        apply_lora(model, cfg.technique)
        _fit(model, weights, ckpt, cfg)
        model = merge_lora(model)
    else:
        _fit(model, weights, ckpt, cfg)
    _refuse_non_finite(model, ckpt)
    return model.float().eval()


def trained_dtype(weights: dict[str, Any]) -> torch.dtype:
    """The dtype of a checkpoint's base weights (the first floating tensor that is no adapter)."""
    for name, value in weights.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point() and "lora_" not in name \
                and not hasattr(value, "get_original_weight"):
            return value.dtype
    return torch.float32


def _plain_weights(weights: dict[str, Any], model: nn.Module, ckpt: Path, cfg: RunConfig) -> dict[str, Any]:
    """``weights`` with QLoRA's NF4 base weights dequantized (torchao ``NF4Tensor``), so they
    load into the plain model; packed 4-bit weights without their scales are refused, and so is
    an integer tensor where the model has a floating one in a run that was no QLoRA."""
    expected = model.state_dict()
    out: dict[str, Any] = {}
    for name, value in weights.items():
        if hasattr(value, "get_original_weight"):  # torchao NF4: the weights training multiplied with
            value = value.get_original_weight()
        elif isinstance(value, torch.Tensor) and not value.is_floating_point() and name in expected \
                and expected[name].is_floating_point():
            if not cfg.technique.qlora:  # no quantized run wrote it: the file was changed
                raise ConfigError(f"checkpoint {str(ckpt)!r} holds {name} as {value.dtype} where the model has "
                                  f"{expected[name].dtype}; it does not fit the model its config describes: export "
                                  "the checkpoint the run wrote")
            raise ConfigError(f"checkpoint {str(ckpt)!r} holds packed 4-bit weights ({name}, bitsandbytes' QLoRA on "
                              "CUDA) whose scales it does not keep; export the adapter with --adapter-only and apply "
                              "it to the base model")
        out[name] = value
    return out


def _load_transformers(weights: dict[str, Any], cfg: RunConfig, ckpt: Path, merge: bool) -> HFCausalLM:
    """The transformers model of ``cfg`` (built from its spec, no weights read) holding the
    checkpoint's weights: LoRA adapters merged unless ``merge`` is False, QLoRA's NF4 base
    weights dequantized, in the dtype the base weights were trained in, eval mode."""

    tech = cfg.technique
    attention = tech.attention if tech.attention in PORTABLE_ATTENTION else "sdpa"
    build_cfg = cfg.replace(attention=attention, qlora=False, compile=False, checkpointing="none",
                            distributed="none")
    # Every weight comes from the checkpoint (a strict load below), so none is drawn at random
    # first, and the build's own storage is never written: the load hands the model the
    # checkpoint's (mapped) tensors and frees what the build allocated, untouched: an 8B BF16
    # checkpoint takes its own size in host memory, not twice that again for an FP32 copy.
    model = build_hf_model(build_cfg, with_weights=False, initialize=False)
    if tech.lora_rank:
        import_extra("peft")
        apply_hf_lora(model, build_cfg.technique)
    _fit(model, _plain_weights(weights, model, ckpt, cfg), ckpt, cfg, assign=True)
    model.lm.tie_weights()  # the load assigned the head and the embedding one at a time: one tensor again
    _refuse_non_finite(model, ckpt)
    if tech.lora_rank and merge:
        merge_adapters_in_place(model)
    model.lm.config.use_cache = True  # training turned the KV cache off; generation wants it
    model.lm.generation_config = _generation_config(cfg, model.lm.config)
    for p in model.parameters():
        p.requires_grad_(False)
    dtype = trained_dtype(weights)
    if merge or not tech.lora_rank:
        place_weights(model, dtype)  # rope's float32 inv_freq stays float32 (models.placement)
    return model.eval()


GENERATION_CONFIG = "generation_config.json"


def _generation_config(cfg: RunConfig, config: Any) -> Any:
    """The generation settings an export carries: the ``--model`` folder's own
    ``generation_config.json`` (its eos tokens, sampling defaults), else those transformers derives
    from the model's config; with the KV cache on. The model was built for training (no KV cache),
    and transformers would write that into the exported folder's generate defaults."""
    from transformers import GenerationConfig  # export's extra, not the core's

    path = _generation_config_file(str(cfg.model.model))
    if path is not None:  # read as JSON, checked: nothing of the folder runs
        generation = GenerationConfig.from_dict(json_object(path, f"the {GENERATION_CONFIG} of "
                                                                  f"--model {cfg.model.model!r}"))
    else:
        generation = GenerationConfig.from_model_config(config)
    generation.use_cache = True
    return generation


def _generation_config_file(spec: str) -> Path | None:
    """The ``generation_config.json`` of the model the run started from: in its folder, or for
    ``hf:ORG/NAME`` the Hub repository's (from the local Hugging Face cache, fetched into it first
    when the Hub is reachable), as ``from_pretrained`` reads it; None when it has none."""
    source = resolve(spec)
    if source.repo is None:
        folder = source.directory
        return folder / GENERATION_CONFIG if folder is not None and (folder / GENERATION_CONFIG).is_file() else None
    from huggingface_hub import hf_hub_download  # export's extra (transformers requires it), not the core's
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    try:
        return Path(hf_hub_download(source.repo, GENERATION_CONFIG, **from_pretrained_kwargs(source.repo)))
    except (EntryNotFoundError, LocalEntryNotFoundError):  # the repository has none, or the cache holds none
        return None


# --------------------------------------------------------------------------- our GPT -> GPT2LMHeadModel
# The one conversion of our GPT into transformers' GPT-2: export and generate use it, and so does
# the Hugging Face comparison (memtrain.bench.hf), which trains the converted model with Trainer.
def hf_config(cfg: RunConfig, padded_vocab: bool = False) -> Any:
    """The ``GPT2Config`` of our model's shape.

    The vocabulary is the real one (``--vocab-multiple`` padding rows dropped: the logits are
    ours) unless ``padded_vocab``, which keeps the padded embedding table, as transformers'
    ``resize_token_embeddings(pad_to_multiple_of=...)`` would: the Hugging Face comparison trains
    the same table on both sides (GPT-2's softmax then also spans the padded tokens, which our
    head leaves out).
    """
    transformers = require_transformers()
    m = cfg.model
    vocab = m.padded_vocab_size if padded_vocab else m.vocab_size
    eot = EOT_ID if EOT_ID < vocab else None  # GPT-2's <|endoftext|>, unless a small vocabulary cannot hold it

    return transformers.GPT2Config(
        vocab_size=vocab, n_positions=m.max_seq_len, n_embd=m.d_model, n_layer=m.n_layers,
        n_head=m.n_heads, n_inner=m.d_ff, activation_function="gelu_pytorch_tanh",
        resid_pdrop=m.dropout, embd_pdrop=m.dropout, attn_pdrop=m.dropout, layer_norm_epsilon=1e-5,
        tie_word_embeddings=not m.untie_embeddings, bos_token_id=eot, eos_token_id=eot,
        architectures=["GPT2LMHeadModel"],
    )


def hf_state_dict(model: GPT, padded_vocab: bool = False) -> dict[str, torch.Tensor]:
    """Our parameters under GPT2LMHeadModel's names and layouts (the vocabulary as in
    :func:`hf_config`)."""
    m = model.cfg
    V = m.padded_vocab_size if padded_vocab else m.vocab_size
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}

    def bias(name: str, size: int) -> torch.Tensor:
        return sd.get(name, torch.zeros(size))

    out: dict[str, torch.Tensor] = {
        "transformer.wte.weight": sd["wte.weight"][:V],
        "transformer.wpe.weight": sd["wpe.weight"],
        "transformer.ln_f.weight": sd["ln_f.weight"],
        "transformer.ln_f.bias": bias("ln_f.bias", m.d_model),
    }
    for i in range(m.n_layers):
        a, h = f"blocks.{i}.", f"transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            out[h + ln + ".weight"] = sd[a + ln + ".weight"]
            out[h + ln + ".bias"] = bias(a + ln + ".bias", m.d_model)
        for ours, theirs, width in (("attn.qkv", "attn.c_attn", 3 * m.d_model), ("attn.proj", "attn.c_proj", m.d_model),
                                    ("mlp.fc", "mlp.c_fc", m.d_ff), ("mlp.fc_out", "mlp.c_proj", m.d_model)):
            out[h + theirs + ".weight"] = sd[a + ours + ".weight"].t().contiguous()  # Linear (out,in) -> Conv1D (in,out)
            out[h + theirs + ".bias"] = bias(a + ours + ".bias", width)
    out["lm_head.weight"] = sd["lm_head.weight"][:V] if m.untie_embeddings else out["transformer.wte.weight"]
    return out


def load_gpt_weights(hf: nn.Module, model: GPT, padded_vocab: bool = False) -> None:
    """Copy ``model``'s weights into ``hf``, a ``GPT2LMHeadModel`` of :func:`hf_config`'s shape."""
    weights = hf_state_dict(model, padded_vocab)
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    # Only non-persistent buffers may be absent from our mapping (older transformers keep the
    # causal mask as a buffer); a missing parameter would be a mapping bug.
    params = {n for n, _ in hf.named_parameters()}
    bad = [k for k in missing if k in params and k != "lm_head.weight"] + list(unexpected)
    if bad:
        raise RuntimeError(f"weight mapping incomplete: {bad[:5]}")
    if model.cfg.untie_embeddings:
        hf.lm_head.weight.data.copy_(weights["lm_head.weight"])  # type: ignore[union-attr,operator]  # torch types nn.Module attributes as Tensor | Module


def to_hf_model(model: GPT, cfg: RunConfig, padded_vocab: bool = False) -> Any:
    """A ``GPT2LMHeadModel`` holding ``model``'s weights (eval mode)."""
    transformers = require_transformers()
    hf = transformers.GPT2LMHeadModel(hf_config(cfg, padded_vocab))
    load_gpt_weights(hf, model, padded_vocab)
    return hf.eval()


def save_tokenizer(out: Path, chat_template: Optional[str] = None) -> None:
    """GPT-2's tokenizer files (vocab.json, merges.txt, tokenizer.json, ...) into ``out``, with
    ``chat_template`` (the run's --chat-template) where given, so ``apply_chat_template`` works on
    the export.

    vocab.json and merges.txt are OpenAI's encoder.json and vocab.bpe under the names
    transformers reads; its GPT-2 tokenizer class then loads them and writes the rest
    (tokenizer.json, tokenizer_config.json), whatever its major version calls its arguments.
    """
    require_transformers()  # its one-line refusal where transformers is not installed
    tok = gpt2_tokenizer_in(out)
    if chat_template is not None:
        tok.chat_template = chat_template
    tok.save_pretrained(str(out))


# --------------------------------------------------------------------------- a transformers model
def save_model_tokenizer(cfg: RunConfig, out: Path) -> None:
    """The tokenizer a transformers model was trained with (memtrain.models.data_tokenizer):
    its own, or GPT-2's when its folder had none; holding the run's --chat-template where given."""
    tok = data_tokenizer(cfg)
    if tok is None or tok.name == GPT2_TRANSFORMERS_NAME:
        save_tokenizer(out, None if tok is None else tok.chat_template)
    else:
        tok.tok.save_pretrained(str(out))


def check_base_unchanged(model: HFCausalLM, weights: dict[str, Any], ckpt: Path) -> None:
    """An adapter is only as good as its base: the checkpoint's frozen base weights must equal
    the ``*.safetensors`` of the folder the run started from (compared tensor by tensor, in
    the checkpoint's dtype; NF4 base weights are lossy and skipped)."""
    from safetensors import safe_open

    source = resolve(model.source_spec)
    files = source.weight_files()
    if source.repo is not None:
        return  # a Hub repository: its files are not ours to compare here
    if not files:
        raise ConfigError(f"--adapter-only: --model {model.source_spec!r} has no *.safetensors weights, so the run "
                          "trained adapters on random initial weights kept only in this checkpoint; export without "
                          "--adapter-only")
    for f in files:
        try:
            with safe_open(str(f), "pt") as fh:
                for key in fh.keys():
                    ours = weights.get(_checkpoint_name(key), weights.get(_checkpoint_name(key, base_layer=True)))
                    if not isinstance(ours, torch.Tensor) or hasattr(ours, "get_original_weight"):
                        continue
                    theirs = fh.get_tensor(key)
                    if theirs.shape != ours.shape or not torch.equal(theirs.to(ours.dtype), ours):
                        raise ConfigError(f"--adapter-only: {key} in {str(f)!r} differs from the base weights in "
                                          f"checkpoint {str(ckpt)!r}; the adapter would not fit that folder: export "
                                          "without --adapter-only, or use the folder the run was trained from")
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - a truncated or foreign file in the user's folder
            raise ConfigError(f"--adapter-only: cannot read {str(f)!r} ({type(exc).__name__}); the base model folder "
                              "must hold complete *.safetensors files") from None


def _checkpoint_name(key: str, base_layer: bool = False) -> str:
    """The name a weight of the model folder has in a memtrain checkpoint (``lm.`` prefix; under
    LoRA a wrapped Linear's own weight is ``<module>.base_layer.weight``)."""
    if base_layer:
        module, _, leaf = key.rpartition(".")
        key = f"{module}.base_layer.{leaf}"
    return "lm." + key


def write_adapter(model: HFCausalLM, out: Path) -> int:
    """The LoRA adapters of ``model`` (not merged) as a peft adapter folder; return their size."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    lm = model.lm
    lcfg = lm.peft_config["default"]
    lcfg.base_model_name_or_path = resolve(model.source_spec).load_id
    lcfg.task_type = "CAUSAL_LM"
    lcfg.inference_mode = True  # as peft's save_pretrained writes it (the live config is training's)
    if isinstance(lcfg.target_modules, (set, list)):
        # peft holds all-linear's modules as a set: sorted, two exports of one checkpoint are equal.
        lcfg.target_modules = sorted(lcfg.target_modules)
    adapters = get_peft_model_state_dict(lm)
    # PeftModel keeps the wrapped model under base_model.model: the names its loader expects.
    save_file({f"base_model.model.{k}": v.detach().contiguous() for k, v in adapters.items()},
              str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    lcfg.save_pretrained(str(out))
    return sum(v.numel() for v in adapters.values())


# --------------------------------------------------------------------------- the export
def check_new_directory(out: Path) -> None:
    """``out`` may become the export: absent, or an empty directory; not a link (even to an
    empty directory: the export's final rename would replace the link, not fill its target)."""
    if out.name in ("", ".", ".."):
        # The export is written beside OUT and renamed onto it: the current folder (or its
        # parent, or /) cannot be replaced (the rename failed with EBUSY, exit 1, once written).
        raise ConfigError(f"{str(out)!r} names the current folder, its parent or the root, which an export cannot "
                          "replace; give a new directory by name, e.g. ./model")
    try:
        str(out.absolute()).encode("utf-8")
    except UnicodeEncodeError:
        # A byte that is not UTF-8 (a lone surrogate here): the tokenizers and safetensors
        # libraries take UTF-8 paths only; tokenizers failed with a TypeError, exit 1, once the
        # checkpoint was read and the weights written.
        raise ConfigError(f"{str(out)!r} is not a UTF-8 path, and transformers' tokenizer and safetensors files can "
                          "only be written to one; give a UTF-8 path") from None
    if out.is_symlink():
        raise ConfigError(f"{str(out)!r} is a symbolic link; memtrain does not write through links: remove it "
                          "or give a new directory")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{str(out)!r} is a file; give a new directory")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{str(out)!r} exists and is not empty; give a new directory")


# A write that found no room: a full disk, a used-up quota, the file size limit (ulimit -f).
ROOM_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def _os_error_code(text: str) -> Optional[int]:
    """The errno a Rust library's error text ends with ("... (os error 27)"), or None."""
    found = re.search(r"\(os error (\d+)\)", text)
    return int(found.group(1)) if found else None


@contextlib.contextmanager
def _new_directory(out: Path) -> Iterator[Path]:
    """A scratch folder beside ``out`` that becomes ``out`` when the block succeeds, so a
    failed or interrupted export leaves no half-written model where a loader would find it."""
    check_new_directory(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # A name of its own, not OUT's: ".OUT.<random>.tmp" made an OUT name of 242-255 bytes (valid)
    # too long once the checkpoint was read.
    tmp = Path(tempfile.mkdtemp(prefix=".memtrain-export-", suffix=".tmp", dir=out.parent))
    try:
        try:
            yield tmp
        except Exception as exc:
            # safetensors' SafetensorError (no OSError) gives a failed write's errno in its text
            # only ("No space left on device (os error 28)", "File too large (os error 27)"): the
            # CLI's "disk full writing OUT" line, as for any other file.
            code = None if isinstance(exc, OSError) else _os_error_code(str(exc))
            if code not in ROOM_ERRNOS:
                raise
            raise OSError(code, os.strerror(code), str(out)) from None
        # mkdtemp makes the folder owner-only (0700): the model folder gets a plain mkdir's mode,
        # and its files open's, as every other file memtrain writes (safetensors wrote 0600).
        os.chmod(tmp, 0o777 & ~umask())
        _plain_modes(tmp)
        try:
            os.replace(tmp, out)  # onto an empty directory too (POSIX rename)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise
            # Another export (or anything else) made ``out`` after the check: keep theirs.
            raise ConfigError(f"{str(out)!r} was created while exporting (another export to it?); nothing was "
                              "replaced: give a new directory") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _plain_modes(folder: Path) -> None:
    """Give the regular files under ``folder`` the mode ``open`` creates (0666 less the umask) and
    its subfolders a plain mkdir's. safetensors writes a weights file owner-only (0600), so an
    export's ``model.safetensors`` could not be read by the group or other users who read its
    config.json, tokenizer and a checkpoint saved under the same umask. Links are left as they are."""
    files, folders = 0o666 & ~umask(), 0o777 & ~umask()
    for root, dirs, names in os.walk(folder):
        for name in dirs:
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), folders)
        for name in names:
            path = os.path.join(root, name)
            if stat.S_ISREG(os.lstat(path).st_mode):
                os.chmod(path, files)


def export_hf(ckpt: str | Path, out: str | Path, adapter_only: bool = False) -> dict[str, Any]:
    """Write ``out`` as a transformers-loadable directory (or, ``adapter_only``, a peft
    adapter); return a summary: ``out``, ``kind``, ``parameters``, ``lora_merged``, ``qlora``,
    ``quantized_weights`` (how many base weights the run held in 4 bits), ``precision`` (the run's), ``files``."""
    out = Path(out)
    check_new_directory(out)  # before the checkpoint is read: a refusal costs nothing
    state, cfg = read_checkpoint(ckpt)
    lora = bool(cfg.technique.lora_rank)
    if adapter_only and not (lora and is_hf(cfg)):
        raise ConfigError("--adapter-only writes the LoRA adapters of a transformers --model trained with --lora-rank; "
                          "this checkpoint is not one: export without --adapter-only")
    if is_hf(cfg):
        model = _load_transformers(state["model"], cfg, Path(ckpt), merge=not adapter_only)
        if adapter_only:
            check_base_unchanged(model, state["model"], Path(ckpt))
        with _new_directory(out) as tmp, quiet_transformers():
            if adapter_only:
                n, kind = write_adapter(model, tmp), "peft LoRA adapter"
            else:
                model.lm.save_pretrained(str(tmp), safe_serialization=True)
                n, kind = model.num_parameters(), type(model.lm).__name__
            save_model_tokenizer(cfg, tmp)
    else:
        gpt = _load_gpt(state["model"], cfg, Path(ckpt))
        hf = to_hf_model(gpt, cfg)
        template = run_chat_template(cfg)  # read before the folder is made: a file gone since is one line
        with _new_directory(out) as tmp, quiet_transformers():
            hf.save_pretrained(str(tmp), safe_serialization=True)
            save_tokenizer(tmp, template)
        n, kind = gpt.num_parameters(), "GPT2LMHeadModel"
    return {"out": str(out), "kind": kind, "parameters": n, "lora_merged": lora and not adapter_only,
            "qlora": bool(cfg.technique.qlora), "quantized_weights": quantized_weight_count(state["model"]),
            "precision": cfg.technique.precision, "files": sorted(p.name for p in out.iterdir())}


def quantized_weight_count(weights: dict[str, Any]) -> int:
    """How many of a checkpoint's weights a --qlora run stored in 4 bits: torchao's NF4 tensors,
    or bitsandbytes' packed integer ones. A --qlora run on weights too small for NF4's blocks
    stores none (train warns that they stay unquantized), and then trained on the base as
    from_pretrained loads it."""
    return sum(1 for name, value in weights.items()
               if hasattr(value, "get_original_weight")
               or (name.endswith(".weight") and isinstance(value, torch.Tensor) and not value.is_floating_point()))
