"""How a memtrain run maps onto Hugging Face ``transformers.Trainer`` (+ ``peft``): for memtrain's
GPT the Trainer trains ``GPT2LMHeadModel``; for ``--model SPEC`` the same transformers model.

``hf_plan(cfg, device_type)`` reads a resolved :class:`memtrain.config.run.RunConfig` (not a preset
name, so ``key=value`` rows work too) and returns an :class:`HFPlan`: the ``TrainingArguments``
overrides, the attention implementation, an optional LoRA config, and, for every part of the
run, whether Hugging Face has the same thing, only something close, or nothing.

Three outcomes per row (``HFPlan.status``):

``matched``  every technique has a Trainer equivalent doing the same computation;
``closest``  some memory technique has no Trainer equivalent but leaves the trained model and
             its math unchanged (chunked loss, selective checkpointing, per-block compile), so
             the Hugging Face side runs without it: the row then shows what that technique buys
             over what a Trainer user can get; also a LoRA row under ``bf16-pure``, where only the
             small adapters' dtype differs (the Trainer side: the model in BF16, peft's FP32 adapters);
``none``     a part changes what is computed (sliding-window attention, full fine-tuning in BF16
             weights without an FP32 copy, no biases) or cannot run in one process (distributed):
             there is nothing to compare against, the row is listed with the reason and not run.

Written against transformers 5.23, where ``gradient_checkpointing`` is the deprecated alias of
``activation_checkpointing`` (with ``every_n_layers``). ``use_liger_kernel=True`` is asked for only
where the installed Liger-Kernel's patched forward reads nothing the installed transformers' model
config lacks (:func:`liger_forward_gaps`) and passes the model no keyword it refuses
(:func:`memtrain.bench.hf.liger_calls.liger_call_gaps`).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from dataclasses import dataclass, field
from typing import Any, Optional

# liger_forward_gaps: the name this module exported before the check moved to liger_calls (kept in __all__).
from memtrain.bench.hf.liger_calls import liger_call_gaps, liger_config_gaps as liger_forward_gaps
from memtrain.config.aliases import trainer_optim
from memtrain.config.run import ConfigError, RunConfig
from memtrain.models import is_hf
from memtrain.techniques.facts import LOW_BIT_BLOCK, checkpoint_policy, precision_facts

__all__ = ["HFPlan", "hf_plan", "liger_forward_gaps", "lora_targets", "trainer_alignment", "TRAINER_LOW_BIT_BLOCK"]

# transformers passes block_size=256 to torchao's AdamW8bit and AdamW4bit, and cannot be told
# otherwise: optim_args="block_size=128" reaches torchao as the string "128" in transformers
# 5.23 (its step then fails on `numel % "128"`).
TRAINER_LOW_BIT_BLOCK = 256


def trainer_alignment(cfg: RunConfig) -> dict[str, Any]:
    """memtrain settings that a row takes so that both sides run the same optimizer, where the
    Trainer's setting is fixed and memtrain's is an option (applied unless the user sets them).

    Today: the low-bit optimizers' quantization block (memtrain's 4-bit default is torchao's 128;
    the Trainer's is 256). Comparing 128 against 256 would time the block size, not the loop.
    """
    if cfg.technique.optim in LOW_BIT_BLOCK:
        return {"optim_block": TRAINER_LOW_BIT_BLOCK}
    return {}


# memtrain's LoRA targets -> GPT-2's Conv1D module names (GPT-2 calls both projections back
# into the residual stream c_proj, so each is named with its parent).
_LORA_TARGETS = {"qkv": "c_attn", "proj": "attn.c_proj", "fc": "c_fc", "fc_out": "mlp.c_proj"}


@dataclass
class HFPlan:
    """What the Hugging Face side of one row runs.

    Attributes:
        status: ``matched``, ``closest`` or ``none`` (see the module docstring).
        training_args: ``TrainingArguments`` keyword overrides for the techniques.
        attn_implementation: ``eager``, ``sdpa``, ``flex_attention`` or ``flash_attention_2``.
        lora: keyword arguments of ``peft.LoraConfig`` (None: full fine-tuning).
        weight_dtype: the dtype the model is built in (``torch`` attribute name): ``float32``,
            or ``bfloat16`` for a LoRA row under ``--precision bf16-pure`` (the frozen base in BF16).
        quantization: ``transformers.BitsAndBytesConfig`` keyword arguments for a QLoRA row (the
            model is loaded through them), else None.
        matmul_precision: ``torch.set_float32_matmul_precision`` value to set before training
            (used for TF32 on CPU, where ``TrainingArguments.tf32`` refuses to run).
        mapping: one line per technique: memtrain setting -> Trainer setting.
        missing: for ``closest``/``none``: what Hugging Face lacks, and why.
    """

    status: str
    training_args: dict[str, Any] = field(default_factory=dict)
    attn_implementation: str = "eager"
    lora: Optional[dict[str, Any]] = None
    weight_dtype: str = "float32"
    quantization: Optional[dict[str, Any]] = None
    matmul_precision: Optional[str] = None
    mapping: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "training_args": dict(self.training_args),
            "attn_implementation": self.attn_implementation,
            "lora": self.lora,
            "weight_dtype": self.weight_dtype,
            "quantization": self.quantization,
            "matmul_precision": self.matmul_precision,
            "mapping": list(self.mapping),
            "missing": list(self.missing),
        }


def lora_targets(spec: str) -> list[str]:
    """GPT-2 module names for memtrain's ``--lora-targets`` (``qkv,proj,fc,fc_out``)."""
    names = [t.strip() for t in spec.split(",") if t.strip()]
    unknown = [n for n in names if n not in _LORA_TARGETS]
    if unknown:
        raise ConfigError(f"--lora-targets {','.join(unknown)} has no GPT-2 counterpart; use qkv, proj, fc, fc_out")
    # peft matches a listed name against the end of each module path (".attn.c_proj"), so the
    # two c_proj modules can be chosen separately.
    return sorted({_LORA_TARGETS[n] for n in names})


def _liger_patch_problem(model_type: str) -> Optional[str]:
    """Why the installed Liger-Kernel cannot patch ``model_type`` (None: it has a patch for it;
    none for gpt2 as of 0.6): not installed, installed but failing to import, or no patch."""
    if importlib.util.find_spec("liger_kernel") is None:
        return "Liger-Kernel is not installed (pip install liger-kernel)"
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except Exception as exc:  # noqa: BLE001 - any failure (its Triton, a transformers it predates): no Liger, said why
        first = f"{type(exc).__name__}: {exc}".splitlines()[0]
        return f"the installed Liger-Kernel does not import ({first})"
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        return (f"Liger-Kernel has no {model_type} patch (its fused linear cross-entropy covers llama, "
                "mistral, gemma, qwen2, phi3, ...)")
    return None


def _liger_refusal(cfg: RunConfig, model_type: str, cuda: bool) -> Optional[str]:
    """Why the Trainer side cannot take ``use_liger_kernel=True`` for this row (None: it can)."""
    if not cuda:
        return "Liger-Kernel needs CUDA (Triton)"
    problem = _liger_patch_problem(model_type)
    if problem is not None:
        return problem
    if not is_hf(cfg):
        return None
    # on this side's turn: the package imports no torch before the lockstep baton
    from memtrain.models import load_config

    config = load_config(cfg.model.model)
    transformers = f"transformers {_version('transformers')}"
    reads, calls = liger_forward_gaps(model_type, config), liger_call_gaps(model_type, config)
    gaps = []
    if reads:
        gaps.append(f"reads {', '.join('config.' + g for g in reads)}, which {transformers} configs lack")
    if calls:
        gaps.append(f"passes {', '.join(calls)} to the model, which {transformers} refuses")
    if gaps:
        return (f"the installed Liger-Kernel {_version('liger-kernel')}'s {model_type} forward {'; it '.join(gaps)} "
                "(install a Liger release written for it: benchmarks/gpu_wheels.sh pins one)")
    return None


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def _model_type(cfg: RunConfig) -> str:
    """transformers' model_type of the row's model (gpt2 for memtrain's GPT)."""
    if not is_hf(cfg):
        return "gpt2"
    # on this side's turn: the package imports no torch before the lockstep baton
    from memtrain.models import load_config

    return str(load_config(cfg.model.model).model_type)


def _transformers_model_attention(cfg: RunConfig, plan: HFPlan, mapping: list[str], none: list[str]) -> None:
    """Attention of a ``--model SPEC`` row: memtrain's own attn_implementation choice (both sides
    run one model, so they share it), and its sliding window where the architecture has one."""
    # on this side's turn: the package imports no torch before the lockstep baton
    from memtrain.models import load_config

    # on this side's turn: the package imports no torch before the lockstep baton
    from memtrain.models.hf import ATTN_IMPLEMENTATION

    t = cfg.technique
    plan.attn_implementation = ATTN_IMPLEMENTATION.get(t.attention, "eager")
    mapping.append(f"attention {t.attention} -> attn_implementation={plan.attn_implementation!r} on both sides"
                   + (" (memtrain restricts SDPA to that one kernel)" if t.attention in ("flash", "mem-efficient") else ""))
    if t.window is not None:
        config = load_config(cfg.model.model)
        if hasattr(config, "sliding_window"):
            mapping.append(f"window {t.window} -> the model config's sliding_window={t.window} on both sides")
        else:
            none.append(f"--window {t.window}: {config.model_type} has no sliding-window attention")


def _qlora(cfg: RunConfig, plan: HFPlan, cuda: bool, mapping: list[str], closest: list[str], none: list[str]) -> None:
    """QLoRA as a Trainer + peft user runs it: the checkpoint loaded through bitsandbytes' 4-bit
    NF4 (``BitsAndBytesConfig``), then ``get_peft_model``."""
    if not is_hf(cfg):
        none.append("--qlora on memtrain's GPT: the comparison quantizes a transformers --model only")
        return
    # find_spec, not an import: bitsandbytes imports torch, and a plan is made before the lockstep baton
    if importlib.util.find_spec("bitsandbytes") is None:
        none.append("--qlora: the Trainer side loads its 4-bit base through bitsandbytes, which is not installed "
                    "(pip install bitsandbytes)")
        return
    # memtrain's own CUDA QLoRA: bitsandbytes Params4bit, NF4, compress_statistics (double quant).
    compute = "bfloat16" if _computes_in_bf16(cfg) else "float32"
    plan.quantization = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
                         "bnb_4bit_compute_dtype": compute}
    mapping.append(f"qlora -> the same initial weights loaded with BitsAndBytesConfig(load_in_4bit, nf4, double quant, "
                   f"compute {compute}); prepare_model_for_kbit_training is not called (it would upcast the norms, "
                   "embeddings and head to FP32)")
    if not cuda:
        closest.append("--qlora on CPU: memtrain stores torchao's NF4, the Trainer side bitsandbytes' (the same "
                       "4-bit NF4 format with double-quantized scales; on CUDA both are bitsandbytes)")


def _computes_in_bf16(cfg: RunConfig) -> bool:
    """Whether the row's matmuls run in BF16 (autocast or BF16 weights): the 4-bit matmuls' dtype."""
    return precision_facts(cfg.technique.precision).matmul_type == "bf16"


def _map_precision(cfg: RunConfig, plan: HFPlan, cuda: bool, args: dict[str, Any], mapping: list[str], closest: list[str],
                   none: list[str]) -> None:
    """The precision: a Trainer flag (bf16, fp16, tf32), or what the Trainer lacks."""
    t = cfg.technique
    if t.precision == "fp32":
        if cuda:
            args["tf32"] = False
        mapping.append("precision fp32 -> bf16=False, fp16=False" + (", tf32=False" if cuda else ""))
    elif t.precision == "tf32":
        if cuda:
            args["tf32"] = True
            mapping.append("precision tf32 -> tf32=True")
        else:
            # TrainingArguments(tf32=True) raises without an Ampere GPU; memtrain's tf32 on CPU is
            # the same global switch, so it is set directly (identical on both sides).
            plan.matmul_precision = "high"
            mapping.append("precision tf32 -> torch.set_float32_matmul_precision('high') (tf32=True needs CUDA)")
    elif t.precision == "bf16":
        args["bf16"] = True
        mapping.append("precision bf16 -> bf16=True (autocast, FP32 weights)")
    elif t.precision == "fp16":
        args["fp16"] = True
        mapping.append("precision fp16 -> fp16=True (autocast + GradScaler)")
    elif t.precision == "bf16-pure" and t.lora_rank:
        # The frozen base in BF16 is what a Trainer + peft user runs (the model loaded in BF16,
        # bf16=True); only the small adapters differ: get_peft_model keeps them in FP32
        # (autocast_adapter_dtype) under autocast.
        plan.weight_dtype = "bfloat16"
        args["bf16"] = True
        mapping.append("precision bf16-pure + LoRA -> the model built in BF16, bf16=True (autocast)")
        ours = ("BF16 (peft's dtype of the base) with torchao's stochastically rounded AdamW" if is_hf(cfg)
                else "FP32 as well")
        closest.append("--precision bf16-pure: the Trainer side's LoRA adapters are FP32 (get_peft_model's "
                       f"autocast_adapter_dtype) under BF16 autocast; memtrain's are {ours}, without autocast")
    elif t.precision == "bf16-pure":
        none.append("--precision bf16-pure: the Trainer has no BF16-weights-without-FP32-copy mode with "
                    "stochastic rounding for AdamW")
    elif t.precision == "fp8":
        none.append("--precision fp8: the Trainer has no FP8 training of its own (TrainingArguments has no fp8 "
                    "flag; FP8 goes through accelerate's mixed_precision='fp8' with torchao or Transformer "
                    "Engine, outside the Trainer's arguments)")


def _map_attention(cfg: RunConfig, plan: HFPlan, cuda: bool, args: dict[str, Any], mapping: list[str], closest: list[str],
                   none: list[str]) -> None:
    """The attention: the model's attn_implementation (a ``--model`` row's own choice)."""
    t = cfg.technique
    hf_model = is_hf(cfg)
    if hf_model:
        _transformers_model_attention(cfg, plan, mapping, none)
    elif t.window is not None:
        none.append(f"--window {t.window}: GPT-2 in transformers has no sliding-window attention "
                    "(GPT2Config has no sliding_window), so the model would differ")
    if hf_model:
        pass  # chosen above, as memtrain chooses it for this model
    elif t.attention == "math":
        plan.attn_implementation = "eager"
        mapping.append("attention math -> attn_implementation='eager' (materialized scores)")
    elif t.attention in ("sdpa", "flash", "mem-efficient"):
        plan.attn_implementation = "sdpa"
        mapping.append(f"attention {t.attention} -> attn_implementation='sdpa' (PyTorch picks the kernel; "
                       "causal, no mask: the flash kernel on CPU and, in bf16, on CUDA)")
    elif t.attention == "flex":
        plan.attn_implementation = "flex_attention"
        mapping.append("attention flex -> attn_implementation='flex_attention'")
    elif t.attention == "flash-attn":
        plan.attn_implementation = "flash_attention_2"
        mapping.append("attention flash-attn -> attn_implementation='flash_attention_2'")


def _map_checkpointing(cfg: RunConfig, plan: HFPlan, cuda: bool, args: dict[str, Any], mapping: list[str], closest: list[str],
                       none: list[str]) -> None:
    """Activation checkpointing: the Trainer checkpoints whole layers, every N-th."""
    t = cfg.technique
    policy = checkpoint_policy(t.checkpointing)
    kind, every = policy.kind, policy.period(cfg.model.n_layers)
    if kind != "none":
        ck: dict[str, Any] = {"use_reentrant": False}
        if kind in ("every", "sqrt") and every > 1:
            # Same rule as memtrain: layers with index % every_n_layers == 0.
            ck["every_n_layers"] = every
        args["activation_checkpointing"] = True
        args["activation_checkpointing_kwargs"] = ck
        mapping.append(f"checkpointing {t.checkpointing} -> activation_checkpointing=True "
                       f"(alias gradient_checkpointing), kwargs {ck}")
        if kind in ("selective", "selective-matmul"):
            closest.append(f"--checkpointing {kind}: the Trainer checkpoints whole layers only "
                           "(no selective activation checkpointing); the HF side runs full checkpointing")


def _map_loss(cfg: RunConfig, plan: HFPlan, cuda: bool, args: dict[str, Any], mapping: list[str], closest: list[str],
              none: list[str]) -> None:
    """The chunked loss: Liger's fused linear cross-entropy where it runs."""
    t = cfg.technique
    if t.loss == "chunked":
        why = _liger_refusal(cfg, _model_type(cfg), cuda)
        if why is None:
            args["use_liger_kernel"] = True
            mapping.append("loss chunked -> use_liger_kernel=True (fused linear cross-entropy)")
        else:
            closest.append(f"--loss chunked: {why}, and the model's own forward has no other chunked loss; "
                           "the HF side materializes the full logits")


def _map_optimizer(cfg: RunConfig, plan: HFPlan, cuda: bool, args: dict[str, Any], mapping: list[str], closest: list[str],
                   none: list[str]) -> None:
    """The optimizer: TrainingArguments.optim and its arguments."""
    t = cfg.technique
    optim = trainer_optim(t.optim)
    if optim is None:
        none.append(f"--optim {t.optim}: no TrainingArguments.optim equivalent")
    else:
        args["optim"] = optim
        note = ""
        if t.optim == "adamw":
            # What memtrain.techniques.optim.default_adamw_kernel picks, without probing the device here.
            note = (" (memtrain: torch's fused AdamW kernel on CUDA where it exists, else foreach; HF passes no "
                    "kernel choice, which torch runs as foreach on CUDA: the same update)" if cuda else
                    " (both the per-tensor loop on a CPU: memtrain passes foreach=False, HF nothing, which torch "
                    "runs the same way there)")
        elif t.optim == "adafactor":
            note = (" (transformers.Adafactor, scale_parameter=False, relative_step=False: --lr is the step size "
                    "on both sides; memtrain's torch.optim.Adafactor with its parameter-scale floor eps2 = 1)")
            if t.adafactor_relative_step:
                none.append("--adafactor-relative-step: the Trainer's optim='adafactor' always takes --lr as the "
                            "step size (scale_parameter=False)")
        elif t.optim in LOW_BIT_BLOCK:
            # on this side's turn: the package imports no torch before the lockstep baton
            from memtrain.techniques.optim import low_bit_block

            block = low_bit_block(t)
            cls = "AdamW8bit" if t.optim == "adamw-8bit" else "AdamW4bit"
            note = f" (torchao {cls}, block_size {TRAINER_LOW_BIT_BLOCK}"
            if block == TRAINER_LOW_BIT_BLOCK:
                note += " on both sides)"
            else:
                note += f"; memtrain's --optim-block is {block})"
                closest.append(f"--optim-block {block}: the Trainer's torchao block is always {TRAINER_LOW_BIT_BLOCK} "
                               f"(optim_args='block_size=...' reaches torchao as a string and fails)")
        elif t.optim == "sgd":
            args["optim_args"] = "momentum=0.9"
            note = " with optim_args='momentum=0.9'"
        elif t.optim == "adamw-bnb-8bit" and not cuda:
            none.append("--optim adamw-bnb-8bit: bitsandbytes needs CUDA")
        mapping.append(f"optim {t.optim} -> optim='{optim}'{note}")


def _map_lora(cfg: RunConfig, plan: HFPlan, cuda: bool, args: dict[str, Any], mapping: list[str], closest: list[str],
              none: list[str]) -> None:
    """LoRA: the same peft LoraConfig on both sides."""
    t = cfg.technique
    hf_model = is_hf(cfg)
    if t.lora_rank and hf_model:
        # on this side's turn: the package imports no torch before the lockstep baton
        from memtrain.techniques.hf_mapping import lora_target_modules

        # The same peft LoraConfig memtrain injects (targets, rank, alpha, dropout); peft itself
        # sets fan_in_fan_out for GPT-2's Conv1D on both sides.
        plan.lora = {"r": t.lora_rank, "lora_alpha": t.lora_alpha, "lora_dropout": t.lora_dropout,
                     "target_modules": lora_target_modules(t.lora_targets), "bias": "none"}
        mapping.append(f"lora_rank {t.lora_rank} -> peft.get_peft_model(LoraConfig(r={t.lora_rank}, "
                       f"lora_alpha={t.lora_alpha:g}, target_modules={plan.lora['target_modules']!r})); memtrain: "
                       "peft.inject_adapter_in_model with the same LoraConfig")
    elif t.lora_rank:
        plan.lora = {
            "r": t.lora_rank,
            "lora_alpha": t.lora_alpha,
            "lora_dropout": t.lora_dropout,
            "target_modules": lora_targets(t.lora_targets),
            "fan_in_fan_out": True,  # GPT-2's Conv1D stores weights as (in, out)
            "bias": "none",
        }
        mapping.append(f"lora_rank {t.lora_rank} -> peft.get_peft_model(LoraConfig(r={t.lora_rank}, "
                       f"lora_alpha={t.lora_alpha:g}, target_modules={plan.lora['target_modules']}))")


def _map_compile(cfg: RunConfig, plan: HFPlan, cuda: bool, args: dict[str, Any], mapping: list[str], closest: list[str],
                 none: list[str]) -> None:
    """torch.compile: torch_compile and its mode."""
    t = cfg.technique
    if t.compile:
        args["torch_compile"] = True
        if t.compile_mode != "default":
            args["torch_compile_mode"] = t.compile_mode
        mapping.append("compile -> torch_compile=True" + (f", torch_compile_mode='{t.compile_mode}'"
                                                          if t.compile_mode != "default" else ""))
        if t.compile_scope == "block":
            closest.append("--compile-scope block: the Trainer compiles the whole model; the HF side does that")
        if t.compile_memory_budget is not None:
            closest.append(f"--compile-memory-budget {t.compile_memory_budget:g}: the Trainer has no such argument; "
                           "the HF side compiles with torch's default partition (budget 1)")
        if cuda and t.precision in ("fp32",):
            mapping.append("note: with torch_compile=True and tf32 unset, the Trainer turns TF32 on (CUDA)")


def _map_model_and_loop(cfg: RunConfig, plan: HFPlan, cuda: bool, args: dict[str, Any], mapping: list[str], closest: list[str],
                        none: list[str]) -> None:
    """The model, QLoRA, what one process cannot compare, gradient accumulation."""
    t = cfg.technique
    hf_model = is_hf(cfg)
    if t.qlora:
        _qlora(cfg, plan, cuda, mapping, closest, none)
    if hf_model:
        mapping.append(f"model {cfg.model.model} -> the same AutoModelForCausalLM on both sides, built by "
                       "memtrain.models.build_model under the run's seed (same initial weights)")
    elif cfg.model.vocab_multiple != 1:
        mapping.append(f"vocab_multiple {cfg.model.vocab_multiple} -> GPT2Config(vocab_size="
                       f"{cfg.model.padded_vocab_size})")
    if not cfg.model.bias and not hf_model:
        none.append("--bias false: GPT-2 always has biases")
    if t.distributed != "none":
        none.append(f"--distributed {t.distributed}: this comparison runs one process per side")
    if t.cpu_offload:
        none.append("--cpu-offload: needs FSDP; this comparison runs one process per side")
    if cfg.data.packing != "concat":
        none.append(f"--packing {cfg.data.packing}: the Trainer side trains on packed blocks (run_clm's group_texts); "
                    "drop --packing")
    if cfg.train.grad_accum > 1:
        args["gradient_accumulation_steps"] = cfg.train.grad_accum
        mapping.append(f"grad_accum {cfg.train.grad_accum} -> gradient_accumulation_steps={cfg.train.grad_accum}")


_MAPPING_STEPS = (_map_precision, _map_attention, _map_checkpointing, _map_loss, _map_optimizer, _map_lora, _map_compile, _map_model_and_loop)


def hf_plan(cfg: RunConfig, device_type: str) -> HFPlan:
    """Map ``cfg``'s techniques onto Trainer settings for a run on ``device_type``."""
    args: dict[str, Any] = {}
    mapping: list[str] = []
    closest: list[str] = []  # memory-only techniques the Trainer lacks
    none: list[str] = []  # differences in what is computed
    cuda = device_type == "cuda"
    plan = HFPlan(status="matched")
    for step in _MAPPING_STEPS:  # in this order: the mapping lines follow it
        step(cfg, plan, cuda, args, mapping, closest, none)
    plan.training_args = args
    plan.mapping = mapping
    if none:
        plan.status, plan.missing = "none", none + closest
    elif closest:
        plan.status, plan.missing = "closest", closest
    return plan
