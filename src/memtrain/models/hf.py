"""A transformers causal LM behind the same seams as memtrain's GPT.

:class:`HFCausalLM` wraps any ``AutoModelForCausalLM`` so the step harness (train, trace,
maxbatch, plan --verify) does not care which model it holds:

* ``forward(idx, targets)`` returns the mean next-token loss, as ``GPT.forward`` does. The
  loss is computed by ``self.loss_fn`` on the **final hidden states** and the LM-head weight
  (the decoder is run without its head), so ``--loss chunked`` never materializes the full
  (tokens x vocab) logits, exactly as for our GPT (memtrain.techniques.loss).
* ``blocks`` is the decoder-layer list, so activation checkpointing (every policy) and
  per-block compile apply to HF layers unchanged (memtrain.techniques.checkpointing/compile).

:func:`memtrain.techniques.hf_mapping.prepare_hf_model` maps the techniques onto the model, each through the library that
owns it: the attention backend is transformers' ``attn_implementation`` (chosen when the
model is built), LoRA is peft, QLoRA's NF4 base weights are torchao (CPU) or bitsandbytes
(CUDA), checkpointing/loss/compile are memtrain's own technique functions.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from memtrain.attention.hf import restricted_sdpa_implementation
from memtrain.config.run import ConfigError, RunConfig
from memtrain.errors import first_line
from memtrain.models.auto_config import load_config
from memtrain.models.depth import apply_layer_count
from memtrain.models.gpt import LossFn, answer_targets, standard_lm_loss
from memtrain.models.hub_access import from_pretrained_kwargs, offline_reason
from memtrain.models.source import ModelSource, refuse_pickled_weights, resolve
from memtrain.models.spec import window_refusal

# --attention -> transformers' attn_implementation
ATTN_IMPLEMENTATION = {
    "math": "eager",
    "sdpa": "sdpa",
    # memtrain's flash / mem-efficient are SDPA restricted to one kernel (as for our GPT);
    # flash-attn is the flash-attn package, transformers' flash_attention_2.
    "flash": "sdpa",
    "mem-efficient": "sdpa",
    "flash-attn": "flash_attention_2",
    "flex": "flex_attention",
}


class HFCausalLM(nn.Module):
    """A transformers causal LM with memtrain's ``forward(idx, targets) -> loss`` interface."""

    lm: Any  # a transformers PreTrainedModel (its attributes are dynamic to a type checker)

    def __init__(self, lm: Any, source: ModelSource) -> None:
        super().__init__()
        self.lm = lm
        self.source_spec = source.spec
        self.loss_fn: LossFn = standard_lm_loss
        # --loss-on completion: a micro-batch may hold no target at all (gpt.answer_targets).
        self.answers_only = False
        self.vocab_size = int(lm.config.vocab_size)
        # Gemma 2 squashes the logits with cap * tanh(logits / cap) before the softmax: the
        # standard loss applies it (see forward); the fused losses, which never hold the
        # logits, cannot (memtrain.techniques.hf_mapping refuses them).
        softcap = getattr(lm.config, "final_logit_softcapping", None)
        self.logit_softcap: Optional[float] = float(softcap) if softcap else None
        # Some families scale their logits after the head (Cohere's logit_scale, Granite's
        # 1 / logits_scaling, ...: LOGIT_SCALE_MULTIPLIES / _DIVIDES): every loss applies the
        # factor, as the model's own head does, so the run trains the logits generate samples.
        self.logit_multiplier = logit_multiplier(lm.config)

    # -- the seams the techniques use ---------------------------------------------------------
    @property
    def backbone(self) -> Any:
        """The decoder without the LM head (``model.model`` for Llama, ``transformer`` for GPT-2)."""
        return self.lm.base_model

    @property
    def head(self) -> Any:
        return self.lm.get_output_embeddings()

    @property
    def blocks(self) -> nn.ModuleList:
        """The decoder layers: the shallowest ModuleList of the backbone with num_hidden_layers
        entries (``model.layers`` for Llama, ``transformer.h`` for GPT-2, ``model.decoder.layers``
        for OPT)."""
        n = self.lm.config.num_hidden_layers
        level = [self.backbone]
        while level:  # breadth first: the layer list, not a list nested inside one layer
            for module in level:
                if isinstance(module, nn.ModuleList) and len(module) == n:
                    return module
            level = [child for module in level for child in module.children()]
        raise ConfigError(f"cannot find the decoder layers of --model {self.source_spec!r}")

    # -- forward ------------------------------------------------------------------------------
    def hidden_states(self, idx: torch.Tensor) -> torch.Tensor:
        # --attention flash / mem-efficient hold SDPA to one kernel inside each attention call
        # (memtrain.attention.hf), so a checkpointed layer's recomputation uses it too.
        return self.backbone(input_ids=idx, use_cache=False)[0]

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = self.hidden_states(idx)
        head = self.head
        if targets is None:
            return self._capped(head(h))
        h2, y = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
        if self.answers_only:
            y, weight = answer_targets(y)
            return self._loss(h2, y) * weight
        return self._loss(h2, y)

    def _loss(self, h2: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The mean loss of hidden states ``h2`` (tokens x d) against targets ``y``."""
        head = self.head
        if self.logit_softcap is not None:
            return F.cross_entropy(self._capped(head(h2).float()), y, ignore_index=-100)
        if getattr(head, "bias", None) is not None:
            # getattr: under --memory-by-module the loss runs wrapped (memtrain.metrics.by_module).
            if getattr(self.loss_fn, "__wrapped__", self.loss_fn) is not standard_lm_loss:
                # prepare_hf_model refuses this first (techniques.hf_mapping._check_head_bias); here
                # for a loss set without it, in the same words (the loss's name is not known here).
                raise ConfigError(f"--loss chunked or naive needs an LM head without a bias; --model {self.source_spec!r} "
                                  "has one: use --loss standard")
            return F.cross_entropy(self._capped(head(h2)).float(), y, ignore_index=-100)
        if self.logit_multiplier is not None:
            # (m h) W^T = m (h W^T): scaled on the hidden states, the fused losses (which never
            # hold the logits) compute the model's own logits too.
            h2 = h2 * self.logit_multiplier
        return self.loss_fn(h2, head.weight, y)

    def _capped(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits as the model's own head returns them: scaled and soft-capped where the
        config says so."""
        if self.logit_multiplier is not None:
            logits = logits * self.logit_multiplier
        cap = self.logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Distinct parameters (a tied head counted once); NF4 weights count their elements."""
        seen: dict[int, nn.Parameter] = {}
        for p in self.parameters():
            if not trainable_only or p.requires_grad:
                seen[id(p)] = p
        return sum(p.numel() for p in seen.values())


# Families whose causal-LM head scales the logits around the LM head's matmul (their modeling
# files: Cohere's ``logits * logit_scale``, Falcon-H1's ``* lm_head_multiplier``, HyperCLOVA X's
# ``* logits_scaling``; Granite's and MiniCPM3's ``/ logits_scaling``), and the config field that
# gives the factor.
LOGIT_SCALE_MULTIPLIES = {"cohere": "logit_scale", "cohere2": "logit_scale", "cohere2_moe": "logit_scale",
                          "cohere_compass": "logit_scale", "hyperclovax": "logits_scaling",
                          "falcon_h1": "lm_head_multiplier"}
LOGIT_SCALE_DIVIDES = {t: "logits_scaling" for t in ("granite", "granitemoe", "granitemoeshared", "granitemoehybrid",
                                                     "granite_swa", "granitemoe_swa", "minicpm3")}


def logit_multiplier(config: Any) -> Optional[float]:
    """The factor a model's own head multiplies its logits by (None: 1, no scaling)."""
    model_type = getattr(config, "model_type", None)
    if model_type in LOGIT_SCALE_MULTIPLIES:
        value = getattr(config, LOGIT_SCALE_MULTIPLIES[model_type], None)
        factor = 1.0 if value is None else float(value)
    elif model_type in LOGIT_SCALE_DIVIDES:
        factor = 1.0 / float(getattr(config, LOGIT_SCALE_DIVIDES[model_type]))
    else:
        return None
    return None if factor == 1.0 else factor


def build_hf_model(cfg: RunConfig, with_weights: bool = True, initialize: bool = True) -> HFCausalLM:
    """Build ``cfg.model.model`` on the current default device and dtype.

    ``from_config`` (random initial weights) unless the source holds ``*.safetensors`` weights
    and ``with_weights`` (training): then ``from_pretrained`` (fine-tuning). A folder whose
    weights are only pickled files is refused then, rather than built at random. The trace
    builds with ``with_weights=False`` under fake tensors: nothing is read or allocated.
    ``initialize=False`` (with ``with_weights=False``: a caller that loads every weight itself,
    as export does from a checkpoint) leaves the weights as allocated, uninitialized: drawing
    them, to be overwritten, is nearly all of a host build's time (Qwen2.5-0.5B on 2 CPU cores:
    7-10 s against 0.01 s, CHANGELOG; an 8B model's takes minutes).
    """
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    spec = cfg.model.model
    assert spec is not None
    source = resolve(spec)
    if with_weights and source.directory is not None:
        refuse_pickled_weights(source.directory, f"--model {spec!r}")  # not random weights in their place
    config = load_config(spec).__class__.from_dict(load_config(spec).to_dict())  # a private copy
    apply_layer_count(config)  # a shallow copy of the model while memtrain.analysis.depth_trace probes it
    tech = cfg.technique
    attn = ATTN_IMPLEMENTATION.get(tech.attention)
    if attn is None:
        raise ConfigError(f"--attention {tech.attention} has no transformers equivalent; "
                          f"choose one of {', '.join(ATTN_IMPLEMENTATION)}")
    attn = restricted_sdpa_implementation(tech.attention) or attn
    if tech.window is not None:
        refusal = window_refusal(config)
        if refusal is not None:
            raise ConfigError(refusal)
        config.sliding_window = tech.window
        if hasattr(config, "use_sliding_window"):
            config.use_sliding_window = True
            config.max_window_layers = 0  # every layer windowed (Qwen2 counts full layers first)
        if hasattr(config, "layer_types"):
            config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    config.use_cache = False
    dtype = torch.get_default_dtype()
    if with_weights and source.has_weights():
        lm = load_pretrained_lm(source.load_id, config, attn, f"--model {spec!r}", repo=source.repo)
        return HFCausalLM(lm, source)
    try:
        # no_init_weights: torch's init functions and the model's init_weights do nothing; buffers
        # computed in __init__ (rope's inv_freq) still are.
        with contextlib.nullcontext() if initialize else no_init_weights():
            lm = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype,
                                                  trust_remote_code=False)
    except (ImportError, ValueError) as exc:
        raise _attention_refusal(f"--model {spec!r} with --attention {tech.attention} ({attn})", attn, exc) from None
    if not initialize:
        lm.tie_weights()  # transformers ties the head to the embedding in the init it skipped
    return HFCausalLM(lm, source)


def _attention_refusal(what: str, attn: str, exc: BaseException) -> ConfigError:
    """transformers' refusal of attention implementation ``attn`` for the model and attention
    ``what`` names (Gemma-2 has no SDPA path), cut to its first sentence (the rest is an issue link and a
    from_pretrained example in transformers' names), with memtrain's name for the implementation
    every family has."""
    first = first_line(exc).split(". ")[0].rstrip(".")
    hint = "; use --attention math (transformers' eager attention)" if attn != "eager" else ""
    return ConfigError(f"{what}: {first}{hint}")


def _refuses_attention(exc: ValueError) -> bool:
    """Whether transformers' ValueError refuses the attention implementation asked (its words:
    "... does not support an attention implementation through ...")."""
    return "attention implementation" in first_line(exc)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' progress bars ("Loading weights", "Writing model shards") and its load
    report off the terminal while a model is read or written (unless MEMTRAIN_VERBOSE=1):
    memtrain checks what the report says itself, and a failure's stderr stays one error: line."""

    from transformers.utils import logging as tlog

    if os.environ.get("MEMTRAIN_VERBOSE") == "1":
        yield
        return
    bars, level = tlog.is_progress_bar_enabled(), tlog.get_verbosity()
    tlog.disable_progress_bar()
    tlog.set_verbosity(tlog.CRITICAL)
    try:
        yield
    finally:
        tlog.set_verbosity(level)
        if bars:
            tlog.enable_progress_bar()


def load_pretrained_lm(load_id: str, config: Any, attn: str, what: str, repo: Optional[str] = None,
                       dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None) -> Any:
    """``AutoModelForCausalLM.from_pretrained`` of a folder (or Hub repository) whose config
    memtrain has checked, in ``dtype`` (None: the default dtype), its weights read straight onto
    ``device`` (None: the device context the caller built under, else the host); ``what`` names
    it in errors.

    Never runs code (``trust_remote_code=False``) nor reads pickles (``use_safetensors``).
    Every failure to read the weights is a ConfigError: a truncated or foreign
    ``*.safetensors`` file (safetensors raises its own error type), a tensor of the wrong
    shape, and a weight the files lack, which transformers would otherwise initialize at
    random and use as if trained."""
    from transformers import AutoModelForCausalLM

    try:
        with quiet_transformers():
            loaded: Any = AutoModelForCausalLM.from_pretrained(
                load_id, config=config, attn_implementation=attn, dtype=dtype or torch.get_default_dtype(),
                use_safetensors=True, trust_remote_code=False, output_loading_info=True,
                # transformers then returns the mis-shaped tensors (refused below, naming one)
                # instead of raising after a report of every one; such a model is never used.
                ignore_mismatched_sizes=True, **from_pretrained_kwargs(repo),
                # transformers places every weight on this device as it reads it ({"": device});
                # None lets it take a `with torch.device(...)` context (train's build).
                **({} if device is None else {"device_map": {"": device}}))
        lm, info = loaded  # output_loading_info: (model, what was missing, unexpected, mis-shaped)
    except ImportError as exc:  # an attention implementation whose package is absent
        raise ConfigError(f"{what} with attn_implementation {attn}: {first_line(exc)}") from None
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the files hold, reading them is the input's failure
        if isinstance(exc, ValueError) and _refuses_attention(exc):  # the flag's fault, not the files'
            raise _attention_refusal(f"{what} with attn_implementation {attn}", attn, exc) from None
        reason = f"{type(exc).__name__}: {first_line(exc)}"
        if "ignore_mismatched_sizes" in reason:  # transformers points at the report memtrain keeps quiet
            reason = "a tensor's shape differs from the one its config.json gives"
        # A Hub repository without safetensors weights (or none cached, offline): transformers'
        # advice ("do not set use_safetensors=True", "a file named pytorch_model.bin") would read
        # pickles, which can run code.
        offline = offline_reason() if repo is not None else None
        if repo is not None and offline is not None and not _cached_safetensors(repo):
            raise ConfigError(f"{what} has no *.safetensors weights in the local Hugging Face cache (the Hub was "
                              f"not asked: {offline}); connect once to download them, or point --model at a local "
                              "directory") from None
        if repo is not None and ("model.safetensors" in reason or "pytorch_model.bin" in reason):
            raise ConfigError(f"{what} has no *.safetensors weights; memtrain reads safetensors only (a pickle can "
                              "run code): use a repository that ships them, or convert its weights") from None
        if "not valid UTF-8" in reason:  # safetensors reads UTF-8 paths only: the path's fault, not the files'
            raise ConfigError(f"cannot read the weights of {what}: its path is not UTF-8, which safetensors cannot "
                              "read; rename the folder, or give it through a link with a UTF-8 name") from None
        raise ConfigError(f"cannot read the weights of {what} ({reason}); "
                          "its *.safetensors files must be complete and belong to its config.json") from None
    mismatched = sorted(info.get("mismatched_keys") or (), key=lambda m: str(m[0]))
    if mismatched:
        key, saved, built = mismatched[0]
        more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
        raise ConfigError(f"the weights of {what} do not fit its config.json: {key} is {list(saved)} in the "
                          f"*.safetensors but {list(built)} in the model{more}; use the config.json the weights "
                          "were saved with")
    missing = sorted(map(str, info.get("missing_keys") or ()))
    if missing:
        raise ConfigError(f"the weights of {what} do not fit its config.json: {len(missing)} tensor(s) missing, "
                          f"e.g. {missing[0]}; give the complete *.safetensors files")
    return lm


def _cached_safetensors(repo: str) -> bool:
    """Whether the Hugging Face cache holds ``repo``'s safetensors weights (one file or an index)."""
    from huggingface_hub import try_to_load_from_cache

    return any(isinstance(try_to_load_from_cache(repo, name), str)
               for name in ("model.safetensors", "model.safetensors.index.json"))


@contextlib.contextmanager
def same_paths_as_eager() -> Iterator[None]:
    """While tracing under fake tensors, let transformers take the paths a real step takes.

    transformers treats a fake tensor as "tracing" (``is_tracing``) and then materializes the
    (batch, 1, T, T) causal mask instead of relying on SDPA's ``is_causal``, which also moves
    SDPA off its flash kernel: the trace would describe a different, larger step. memtrain
    passes no padding mask, so no decision of that check needs tensor values; report fake
    tensors as ordinary ones for the duration of the trace.
    """
    try:
        import transformers.utils.import_utils as iu
    except ImportError:
        yield
        return
    original = iu.is_fake_tensor
    iu.is_fake_tensor = lambda tensor: False  # type: ignore[assignment]
    try:
        yield
    finally:
        iu.is_fake_tensor = original  # type: ignore[assignment]
