"""`memtrain estimate`: predicted memory by component, analytic or traced (fake tensors)."""

from __future__ import annotations

import argparse
import json
from typing import Any, Optional

from memtrain.analysis.advice import size_text
from memtrain.analysis.estimate import GPT2_ARCH, estimate_inference, parse_count, shape_for_params
from memtrain.analysis.estimate.generation import DEFAULT_NEW_TOKENS
from memtrain.analysis.estimate.hf import why_not_modelled
from memtrain.analysis.estimate.inference import estimate_generate_run
from memtrain.analysis.estimate.method import HF_ANALYTIC_MODEL, StepEstimate, estimate_step
from memtrain.analysis.estimate.training import traced_offload
from memtrain.analysis.limits import MAX_WIDTH
from memtrain.cli import (
    LOOP_ONLY_FIELDS,
    add_config_flags,
    add_loss_on_flag,
    add_packing_flag,
    config_from_args,
    defaults_note,
    fmt_bytes,
    given_off_default,
    register,
)
from memtrain.config.argtypes import gpu_name, int_in, token_count, world_size
from memtrain.config.presets import PRESETS, preset
from memtrain.config.run import ConfigError, parse_size
from memtrain.models.source import bundled_names
from memtrain.report.by_module import module_table_lines
from memtrain.runtime.extras import cpu_only_torch, cuda_trace_refusal
from memtrain.techniques.facts import foreign_loss_kernel


def add_model_choice(p: argparse.ArgumentParser) -> None:
    """--model PRESET | --params COUNT (shared with `memtrain plan`)."""

    g = p.add_mutually_exclusive_group()
    # --model_name_or_path: the Trainer scripts' name of the same choice (memtrain.config.aliases).
    g.add_argument("--model", "--model_name_or_path", "--model-name-or-path", dest="preset", default=None, metavar="SPEC",
                   help="Model preset: " + ", ".join(PRESETS) + " (flags given next to it override it); or a "
                   "transformers model: a bundled config (" + ", ".join(bundled_names()) + "), a config.json or "
                   "a directory holding one, or hf:ORG/NAME (Llama, Qwen2, Mistral, Phi-3, Gemma and GPT-2 "
                   "layers answered analytically, other families traced; \"method\" in --json says which).")
    g.add_argument("--params", default=None, metavar="COUNT",
                   help="Parameter count such as 3B or 124M: a GPT-2-style shape of that size is derived.")


# --device-type and --gpu, shared by estimate, maxbatch and plan: one spelling, one set of choices
# and one refusal, so the verbs cannot drift; each verb's help says what they mean for it.
DEVICE_TYPES = ("cpu", "cuda")


def add_device_type_flag(p: argparse.ArgumentParser, help: str) -> None:
    """--device-type cpu|cuda: the kernel facts to assume (default: from --device)."""
    p.add_argument("--device-type", choices=DEVICE_TYPES, default=None, help=help)


# One type for the three verbs' --gpu: a name no kind answers to is refused, and a card not
# listed is asked for as a budget (--budget: plan's and maxbatch's other name of --memory-budget).
_GPU_NAME = gpu_name("--budget")


def add_gpu_flag(p: argparse.ArgumentParser, help: str) -> None:
    """--gpu NAME: a CUDA GPU kind (h100, a100-80gb, rtx4090, ...; memtrain.devices.gpu_kinds)."""
    p.add_argument("--gpu", default=None, metavar="NAME", type=_GPU_NAME, help=help)


def add_max_len_flag(p: argparse.ArgumentParser, when: str) -> None:
    """--max-len N: the longest length a longest-context search tries (shared by estimate,
    maxbatch and plan; ``when`` says which of the verb's answers it bounds)."""
    p.add_argument("--max-len", type=token_count, default=None, metavar="N",
                   help=f"{when}: the longest length to try (default: the model's positions, a transformers "
                        "config's max_position_embeddings or --max-seq-len; memtrain's GPT without --max-seq-len "
                        f"sizes its position table to each length, up to {MAX_WIDTH:,}). A transformers model with rotary "
                        "positions may be searched beyond max_position_embeddings (memory only: said in the output).")


def refuse_gpu_off_cuda(args: argparse.Namespace, device_type: str, what: str) -> None:
    """--gpu names a CUDA GPU kind: refused next to CPU kernel facts (``device_type``), in one line
    ``--gpu <what>`` where ``what`` says what the card is for in this verb and what to change."""
    if getattr(args, "gpu", None) is not None and device_type != "cuda":
        raise ConfigError(f"--gpu {what}")


def resolve_model(args: argparse.Namespace) -> tuple[Any, Any]:
    """(RunConfig, Arch) from --model/--params and the config flags. A transformers model
    (any --model that is not a preset) has no Arch: None (memtrain.models, traced)."""

    base: dict[str, Any] = {}
    arch = GPT2_ARCH
    if getattr(args, "preset", None) and args.preset not in PRESETS:
        if getattr(args, "params", None):
            raise ConfigError("--params sizes memtrain's GPT; drop it next to a transformers --model")
        return config_from_args(args, base={"model": args.preset}), None
    if getattr(args, "preset", None):
        base, arch = preset(args.preset)
    cfg = config_from_args(args, base=base, derive_max_seq_len=True)
    if getattr(args, "params", None) and cfg.model.model is not None:
        # A model named in --config fixes the shape (ModelConfig.from_spec): no size to derive.
        raise ConfigError(f"--params sizes memtrain's GPT; drop it, or the model setting ({cfg.model.model!r}) "
                          "of the --config file")
    if getattr(args, "params", None):
        m = shape_for_params(parse_count(args.params), cfg.model)
        cfg = cfg.replace(d_model=m.d_model, n_heads=m.n_heads, n_layers=m.n_layers, d_ff=m.d_ff)
    return cfg, arch


def device_type_for(args: argparse.Namespace, cfg: Any) -> str:
    """The kernel facts to assume: --device-type (or --trace-device) when given; --gpu NAME alone
    (no --device cpu) asks about that card, so CUDA kernels; else the --device, or this machine."""
    explicit = getattr(args, "device_type", None) or getattr(args, "trace_device", None)
    if explicit:
        return explicit
    if getattr(args, "gpu", None) is not None and cfg.train.device == "auto":
        return "cuda"
    if cfg.train.device.startswith("cuda"):
        return "cuda"
    if cfg.train.device == "cpu":
        return "cpu"
    if cpu_only_torch():
        return "cpu"
    # torch loads only where a CUDA build may find a GPU (see cpu_only_torch)
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_choice(p)
    p.add_argument("--mode", choices=("train", "inference"), default="train",
                   help="train: one steady-state training step; inference: memtrain generate, --batch-size "
                        "sequences of a --seq-len-token prompt and --new-tokens sampled tokens (weights, KV cache, "
                        "the prompt's forward, sampling), analytic; with --new-tokens 0, one forward of memtrain's GPT "
                        "over every position without autograd. Default train.")
    # None until resolved (bf16) by _run_inference: the `defaults used:` line names the default only
    # when it was not given.
    p.add_argument("--weights-dtype", choices=("fp32", "bf16", "fp16", "int8"), default=None,
                   help="Inference mode: the dtype the weights are stored in and computed in (default bf16; "
                        "memtrain generate itself loads float32; int8 only with --new-tokens 0).")
    p.add_argument("--new-tokens", type=int_in(0, MAX_WIDTH, "a token count"), default=DEFAULT_NEW_TOKENS, metavar="N",
                   help=f"Inference mode: tokens generate samples after the --seq-len prompt (default "
                        f"{DEFAULT_NEW_TOKENS}, as memtrain generate --max-new-tokens); the KV cache ends at "
                        "prompt + N - 1 positions. 0: one forward without a cache (memtrain's GPT only).")
    add_device_type_flag(p, "Kernel facts to assume (dropout masks, SDPA kernels); default: from --device.")
    p.add_argument("--world-size", type=world_size, default=1, help="Data-parallel ranks (memory is per rank; default 1).")
    p.add_argument("--shard", choices=("none", "zero1", "zero2", "fsdp"), default=None,
                   help="Sharding over --world-size ranks (default: --distributed).")
    add_gpu_flag(p, "With CUDA kernels: also model PyTorch's caching allocator and report allocated, reserved "
                    "and device total (nvidia-smi) for this GPU kind (h100, a100, rtx4090, ...; a card not "
                    "listed: --device-type cuda --budget SIZE, a default CUDA context stated as an assumption).")
    # --memory-budget too: plan and maxbatch take both names, and estimate's refusal of it named
    # --compile-memory-budget, another setting, as the flag meant.
    p.add_argument("--budget", "--memory-budget", dest="budget", default=None, metavar="SIZE",
                   help="Memory to fit in, e.g. 24GiB: a verdict line (fits, headroom, largest batch, and the cheapest "
                        "changes that fit the asked batch); with CUDA kernels counted as the card holds it (caching "
                        "allocator + CUDA context). --gpu alone takes the card's memory as the budget. "
                        "--memory-budget: maxbatch's and plan's name.")
    add_max_len_flag(p, "With --budget or --gpu, the fit verdict's longest context")
    p.add_argument("--trace", action="store_true",
                   help="Also run one real step under fake tensors (nothing allocated) and compare.")
    p.add_argument("--trace-device", choices=("cpu", "cuda"), default=None,
                   help="Device type of the fake tensors (cuda needs a CUDA build of torch); default: as --device-type.")
    p.add_argument("--full-trace", action="store_true",
                   help="A transformers --model: trace every decoder layer instead of extrapolating from two "
                        "shallow copies (memtrain.analysis.depth_trace; the same bytes, seconds instead of minutes).")
    p.add_argument("--explain", action="store_true", help="Print the formula behind each line.")
    p.add_argument("--json", action="store_true", help="Print JSON only.")
    add_config_flags(p, ("model", "technique", "train"), exclude=(*LOOP_ONLY_FIELDS, "model"))  # --model is add_model_choice's
    add_loss_on_flag(p)  # --loss-on completion: the answers-only step, sized without data
    add_packing_flag(p)  # --packing pad: the same batch x seq_len step, taken so a train command's flags fit


def _parameter_words(total: int, adapters: int, trainable: int) -> str:
    """The model's parameter count as train and flops give it, LoRA's ``adapters`` apart."""
    if adapters:
        return f"{total:,} parameters + {adapters:,} LoRA adapter parameters ({trainable:,} trainable)"
    return f"{total:,} parameters ({trainable:,} trainable)"


def _data_words(cfg: Any) -> str:
    """The step's data settings off their defaults, for the header line after the batch shape:
    ``--packing pad`` (its pads are ignored targets: a pad step is sized apart from a concat one)
    and ``--loss-on completion``; "" for a default step (its header stays as it was)."""
    words = ([f"packing {cfg.data.packing}"] if cfg.data.packing != "concat" else []) + (
        [f"loss on {cfg.data.loss_on}"] if cfg.data.loss_on != "all" else [])
    return "".join(f", {w}" for w in words)


def _table(rows: list[tuple[str, str, str]]) -> str:
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(f"  {a:<{w[0]}}  {b:>{w[1]}}  {c}" for a, b, c in rows)


def run(args: argparse.Namespace) -> int:
    cfg, arch = resolve_model(args)
    rc = _run(args, cfg, arch)
    # generate's estimate is SDPA's whatever the training default: no attention default to name
    generate = args.mode == "inference" and args.new_tokens > 0
    note = defaults_note(cfg.replace(attention="sdpa") if generate else cfg)
    if args.mode == "inference" and getattr(args, "weights_dtype_defaulted", False):
        note = _with_default(note, WEIGHTS_DTYPE_DEFAULT_NOTE)
    if rc == 0 and note and not args.json:
        print(note)
    return rc


# estimate --mode inference sizes bf16 weights unless told, where generate loads them as stored
# (float32, unless the run trained in bf16): the two answers differ by the weights' factor 2.
DEFAULT_WEIGHTS_DTYPE = "bf16"
WEIGHTS_DTYPE_DEFAULT_NOTE = ("weights-dtype bf16 (memtrain generate loads the weights as stored: float32 unless "
                              "the run trained in bf16; --weights-dtype fp32 sizes that)")


def _with_default(note: Optional[str], part: str) -> str:
    """``note`` (a ``defaults used:`` line, or None) with ``part`` added to it."""
    return f"{note}; {part}" if note else f"defaults used: {part}"


def _run(args: argparse.Namespace, cfg: Any, arch: Any) -> int:
    _check_module_table(args, cfg)
    _check_max_len(args)
    _check_cuda_trace(args, cfg)
    if args.mode == "inference":
        return _run_inference(args, cfg, arch)
    if arch is None:
        return _run_traced(args, cfg)
    device_type = device_type_for(args, cfg)
    shard = _shard(args, cfg)
    _check_gpu_flag(args, device_type)
    step = estimate_step(cfg, device_type, arch, world_size=args.world_size, shard=shard, gpu=args.gpu)
    est = step.analytic
    assert est is not None  # memtrain's GPT and the analytic presets are always analytic
    out = step.json
    out.update(_fit(args, cfg, arch, device_type, shard))
    out.update(_loss_kernel(cfg, device_type))
    traced = None
    if args.trace or cfg.train.memory_by_module:
        if arch.name != "gpt2":
            raise ConfigError(f"--trace runs our GPT-2-style model; --model {args.preset} is estimated analytically only")
        if args.world_size > 1:
            raise ConfigError("--trace traces one process; drop --world-size to trace, or use the analytic estimate")

        # Under --memory-by-module the trace (memtrain's GPT: every layer) brings its module table.
        traced = _trace_any_depth(cfg, args.trace_device or device_type)
        out["trace"] = _trace_check(traced, est)
        out.update(_module_table(traced))
    if args.json:
        print(json.dumps(out, indent=2, default=float))
        return 0
    m, t = cfg.model, cfg.train
    print(f"{arch.name} d_model {m.d_model}, {m.n_layers} layers, {m.n_heads} heads, vocab {m.padded_vocab_size}: "
          f"{_parameter_words(est.parameters, est.adapter_parameters, est.trainable_parameters)}")
    print(f"batch {t.batch_size} x seq {t.seq_len} x accum {t.grad_accum}{_data_words(cfg)}, {cfg.technique.precision}, "
          f"attention {cfg.technique.attention}, checkpointing {cfg.technique.checkpointing}, "
          f"loss {cfg.technique.loss}, optim {cfg.technique.optim} ({device_type} kernels"
          + (f", {est.shard} over {est.world_size} ranks, per rank" if est.world_size > 1 else "") + ")")
    rows = [("component at the peak", "bytes", "")]
    for k, v in est.bytes.items():
        rows.append((k, fmt_bytes(v), ""))
    rows.append(("peak", fmt_bytes(est.peak_bytes), f"{est.peak_phase} ({est.peak_detail})"))
    rows.append(("activations per layer", fmt_bytes(est.activations_per_layer),
                 f"kept by one block for backward, checkpointing {cfg.technique.checkpointing}"
                 + ("" if cfg.technique.checkpointing == "none"
                    else f" ({fmt_bytes(est.activations_per_layer_no_checkpointing)} without)")))
    rows += _device_memory_rows(est.device_memory)
    rule = est.rules
    rows.append(("rule of thumb: optimizer", fmt_bytes(rule["optimizer_bytes"]),
                 f"{rule['bytes_per_param']:g} B/param ({rule['optimizer']})"))
    if traced is not None:
        rows.append(("traced peak (fake tensors)", fmt_bytes(traced["peak_bytes"]),
                     f"{traced['peak_phase']}; {_trace_error_words(out['trace'])}"))
    rows += _offload_rows(out.get("offload"), out.get("trace"))
    rows += _compile_budget_rows(out)
    print(_table(rows))
    _print_loss_kernel(out)
    _print_fit(out)
    _print_module_table(out, cfg)
    if args.explain:
        print("how:")
        print("\n".join("  " + line for line in est.explanation))
    return 0


def _fit(args: argparse.Namespace, cfg: Any, arch: Any, device_type: str, shard: Any) -> dict[str, Any]:
    """The ``fit`` entry (and ``fit_note`` where there is no verdict) of --budget/--gpu; {} without either."""
    if args.budget is None and args.gpu is None:
        return {}
    from memtrain.analysis.fit import budget_for, fit_verdict  # torch-free --help/estimate/plan

    found = budget_for(parse_size(args.budget) if args.budget is not None else None, args.gpu)
    if found is None and args.max_len is not None:
        raise ConfigError(f"--gpu {args.gpu}: its memory is not in the GPU table, so there is no longest context for "
                          "--max-len to bound; add --budget SIZE")
    if found is None:
        return _no_budget(args)
    verdict = fit_verdict(cfg, arch, device_type, found, gpu=args.gpu, world_size=args.world_size, shard=shard,
                          max_len=args.max_len)
    return {"fit": verdict.to_dict(), "fit_line": verdict.line()}


def _no_budget(args: argparse.Namespace) -> dict[str, Any]:
    """The ``fit`` entry where --gpu names a card without one memory figure and no --budget is given."""
    return {"fit": None, "fit_note": f"no fit verdict: --gpu {args.gpu}'s memory is not in the GPU table "
                                     "(memtrain.devices.gpu_memory); add --budget SIZE"}


def _loss_kernel(cfg: Any, device_type: str) -> dict[str, Any]:
    """``loss_kernel``, where the run would use another loss kernel than the one estimated
    (``--loss-kernel liger|cce``: :func:`memtrain.techniques.facts.foreign_loss_kernel`); {} otherwise."""
    tech = cfg.technique
    kernel = foreign_loss_kernel(tech.loss, tech.loss_kernel, device_type)
    return {"loss_kernel": kernel.note} if kernel is not None else {}


def _print_loss_kernel(out: dict[str, Any]) -> None:
    if "loss_kernel" in out:
        print(f"  note: {out['loss_kernel']}")


def _print_fit(out: dict[str, Any]) -> None:
    """The verdict line of --budget/--gpu (a training step's, or generate's with --mode
    inference), its measure and assumptions (nothing without them)."""
    if "fit_line" in out:
        fit = out["fit"]
        print(f"fit: {out['fit_line']}")
        print(f"  compared: {fit['measure']}, {size_text(fit['needed_bytes'])} at batch {fit['batch_size']}; "
              "estimated, not measured")
        for line in fit["assumptions"]:
            print(f"  model: {line}")
        ctx = fit.get("longest_context")
        if ctx is not None:
            from memtrain.analysis.fit import context_line  # torch-free --help/estimate/plan

            print(f"fit: {context_line(ctx)}")
            print(f"  {ctx['capped_note'] or ctx['note']}")
    elif "fit_note" in out:
        print(f"fit: {out['fit_note']}")


def _check_max_len(args: argparse.Namespace) -> None:
    """--max-len bounds the longest context of the fit verdict, which --budget or --gpu asks for."""
    if args.max_len is not None and args.mode == "inference":
        raise ConfigError("--max-len bounds the longest context of a training step; drop --mode inference, "
                          "or drop --max-len")
    if args.max_len is not None and args.budget is None and args.gpu is None:
        raise ConfigError("--max-len bounds the fit verdict's longest context: add --budget SIZE (or --gpu NAME), "
                          "or drop --max-len")


def refuse_max_len_when_traced(max_len: Optional[int], cfg: Any, device_type: str, also: Optional[str] = None) -> None:
    """A traced transformers model (``why_not_modelled`` with ``device_type`` kernels, or ``also``:
    a flag that asks for the trace) has no analytic longest context for --max-len to bound: one
    error line naming the search that bounds it (estimate and plan)."""
    if max_len is None:
        return
    reason = why_not_modelled(cfg, device_type) or also
    if reason is not None:
        raise ConfigError(f"--max-len bounds the analytic longest context, and this model is traced ({reason}): "
                          "search its longest context with memtrain maxbatch --search seq-len --max-len N")


def _check_gpu_flag(args: argparse.Namespace, device_type: str) -> None:
    """--gpu models the CUDA caching allocator: it needs CUDA kernel facts (every model path)."""
    refuse_gpu_off_cuda(args, device_type, "models the CUDA caching allocator: add --device-type cuda (or --device cuda)")


def _shard(args: argparse.Namespace, cfg: Any) -> Any:
    """The sharding to estimate: --shard, else --distributed; plain DDP over --world-size ranks."""
    shard = args.shard if args.shard not in (None, "none") else None
    if args.world_size > 1 and shard is None and cfg.technique.distributed in ("none", "ddp"):
        shard = "none"
    return shard


# The settings of a training step that neither generate nor one forward has: given with
# another value than their default, --mode inference would answer for a run they do not shape.
TRAINING_ONLY_SETTINGS = (
    "precision", "checkpointing", "loss", "loss_chunk", "loss_kernel", "optim", "optim_block",
    "adafactor_relative_step", "lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "qlora", "compile",
    "compile_mode", "compile_scope", "compile_memory_budget", "distributed", "cpu_offload",
    "offload_activations", "grad_accum", "loss_on", "packing",
)


def _refuse_training_settings(cfg: Any) -> None:
    """--mode inference with a training setting given (a flag, or a config file written for
    train) at another value than its default: one ConfigError naming them, instead of an
    answer that silently ignores them (``--qlora``'s 4-bit weights, ``--checkpointing``)."""
    named = given_off_default(cfg, getattr(cfg, "given_settings", None) or (), TRAINING_ONLY_SETTINGS)
    if named:
        flags = ", ".join(f"--{n.replace('_', '-')}" for n in named)
        raise ConfigError(f"--mode inference estimates generate, which does not train: {flags} "
                          f"{'is a training setting' if len(named) == 1 else 'are training settings'}; drop "
                          f"{'it' if len(named) == 1 else 'them'}"
                          + (" (--weights-dtype sets the weights' dtype)" if {"precision", "qlora"} & set(named) else ""))


def _run_inference(args: argparse.Namespace, cfg: Any, arch: Any) -> int:
    """--mode inference: memtrain generate's memory (--new-tokens N), or one forward of
    memtrain's GPT (--new-tokens 0); analytic either way."""
    if args.trace or args.full_trace:
        raise ConfigError("--trace traces a training step; --mode inference is analytic (checked against a measured "
                          "generate in the tests), drop --trace")
    _refuse_training_settings(cfg)
    args.weights_dtype_defaulted = args.weights_dtype is None
    args.weights_dtype = args.weights_dtype or DEFAULT_WEIGHTS_DTYPE
    if args.new_tokens == 0:
        if arch is None:
            raise ConfigError("--new-tokens 0 (one forward of every position) is modelled for memtrain's GPT only; "
                              "give --new-tokens N (>= 1) to estimate a transformers model's generate")
        if args.budget is not None or args.gpu is not None:
            raise ConfigError("--budget and --gpu judge generate (--new-tokens N >= 1) or a training step; give "
                              "--new-tokens N, or drop --budget/--gpu")
        return _print_forward(args, cfg, estimate_inference(cfg, args.weights_dtype, arch))
    _check_generate_flags(cfg)
    res = estimate_generate_run(cfg, args.weights_dtype, arch, args.new_tokens)
    res.update(_generate_fit(args, cfg, arch))
    if args.json:
        print(json.dumps(res, indent=2, default=float))
        return 0
    b = res["bytes"]
    name = cfg.model.model or args.preset or "memtrain's GPT (generated as GPT2LMHeadModel)"
    print(f"inference (memtrain generate), {name}: {res['parameters']:,} parameters, weights {args.weights_dtype}; "
          f"{res['batch']} sequences x (prompt {res['prompt_tokens']} + {res['new_tokens']} new tokens), "
          f"sampling {res['sampling']}, SDPA")
    print(_table([("weights", fmt_bytes(b["weights"]), ""),
                  ("KV cache (end of generate)", fmt_bytes(b["kv_cache"]), _cache_note(res)),
                  ("transient at the peak", fmt_bytes(b["activations"]), "activations, logits, sampling, token ids"),
                  ("peak", fmt_bytes(res["peak_bytes"]), res["peak_phase"]),
                  _rule_row(res)]))
    print("  live tensor bytes (what memtrain's memory meter counts); a GPU adds the CUDA context and the "
          "caching allocator's rounding")
    if args.explain:
        print("\n".join("  " + line for line in res["explanation"]))
    _print_fit(res)
    return 0


def _generate_fit(args: argparse.Namespace, cfg: Any, arch: Any) -> dict[str, Any]:
    """The ``fit`` entry of --mode inference with --budget/--gpu (``fit_note`` where the card's
    memory is unknown); {} without either."""
    if args.budget is None and args.gpu is None:
        return {}
    from memtrain.analysis.fit import budget_for  # torch-free --help/estimate/plan
    from memtrain.analysis.generate_fit import generate_fit  # likewise

    found = budget_for(parse_size(args.budget) if args.budget is not None else None, args.gpu)
    if found is None:
        return _no_budget(args)
    verdict = generate_fit(cfg, args.weights_dtype, arch, args.new_tokens, found, gpu=args.gpu)
    return {"fit": verdict.to_dict(), "fit_line": verdict.line()}


def _cache_note(res: dict[str, Any]) -> str:
    """The KV cache row's note: the positions it stores (a sliding window's cap) and its bytes at the peak."""
    stored, written, window = res["cache_stored_positions"], res["cache_positions"], res["cache_window"]
    held = f"{fmt_bytes(res['kv_cache_at_peak'])} at the peak"
    if window is None:
        return f"{written} positions; {held}"
    full = "" if res["sliding_layers"] == res["n_layers"] else " in the sliding layers"
    return f"{stored} of {written} positions stored{full} (sliding_window {window}); {held}"


def _check_generate_flags(cfg: Any) -> None:
    """The settings generate's estimate cannot honour: another attention than the SDPA memtrain
    generate loads, a sliding window of our own."""
    tech = cfg.technique
    if "attention" in (getattr(cfg, "given_settings", None) or ()) and tech.attention != "sdpa":
        raise ConfigError(f"--attention {tech.attention}: memtrain generate loads the model with SDPA, the only "
                          "attention its estimate models; drop --attention (or --new-tokens 0 for one forward of "
                          "memtrain's GPT)")
    if tech.window is not None:
        raise ConfigError("--window is not modelled for generate (its KV cache keeps every position); drop --window")


def _rule_row(res: dict[str, Any]) -> tuple[str, str, str]:
    """The inference table's last row: the 1.2 x weights rule of thumb and whether ``res`` holds it."""
    return ("rule: 1.2 x weights", fmt_bytes(res["rule_of_thumb_bytes"]),
            "holds" if res["rule_holds"] else f"breaks ({res['ratio_to_weights']:.2f} x weights)")


def _print_forward(args: argparse.Namespace, cfg: Any, res: dict[str, Any]) -> int:
    """--mode inference --new-tokens 0: one forward of memtrain's GPT (every position's logits)."""
    if args.json:
        print(json.dumps(res, indent=2, default=float))
        return 0
    b = res["bytes"]
    print(f"inference (one forward, no KV cache), {res['parameters']:,} parameters, weights {args.weights_dtype}, "
          f"batch {cfg.train.batch_size} x seq {cfg.train.seq_len}")
    print(_table([("weights", fmt_bytes(b["weights"]), ""),
                  ("one block (transient)", fmt_bytes(b["activations"]), ""),
                  ("logits (all positions)", fmt_bytes(b["logits"]), ""),
                  ("peak", fmt_bytes(res["peak_bytes"]), res["peak_phase"]),
                  _rule_row(res)]))
    if args.explain:
        print("\n".join("  " + line for line in res["explanation"]))
    return 0


def _run_traced(args: argparse.Namespace, cfg: Any) -> int:
    device_type = args.trace_device or device_type_for(args, cfg)
    _check_gpu_flag(args, device_type)
    refuse_max_len_when_traced(args.max_len, cfg, device_type, "--full-trace" if args.full_trace else None)
    step = estimate_step(cfg, device_type, None, world_size=args.world_size, shard=_shard(args, cfg), gpu=args.gpu,
                         full_trace=args.full_trace and args.world_size == 1)
    if args.world_size > 1 and (args.trace or args.full_trace):
        raise ConfigError("--trace traces one process; drop --world-size to trace, or use the analytic estimate")
    if step.method == "analytic":
        return _run_hf_analytic(args, step, device_type)
    cfg, out = step.cfg, step.json
    out.update(_loss_kernel(cfg, device_type))
    out.update(_module_table_traced(cfg, device_type))
    if args.gpu is not None:
        # The allocator model replays the analytic simulator's events; a trace records none yet.
        out["device_memory"] = None
        out["device_memory_note"] = "--gpu: the caching-allocator model needs the analytic model; this one was traced"
    if args.budget is not None or args.gpu is not None:
        out["fit"] = None
        out["fit_note"] = f"no fit verdict: the caching-allocator model needs the analytic model ({out['not_analytic']})"
    if args.json:
        print(json.dumps(out, indent=2, default=float))
        return 0
    m, t, tech = cfg.model, cfg.train, cfg.technique
    words = _parameter_words(out["parameters"], out["adapter_parameters"], out["trainable_parameters"])
    print(f"{cfg.model.model}: {words}, d_model {m.d_model}, {m.n_layers} "
          f"layers, vocab {m.vocab_size}; "
          f"batch {t.batch_size} x seq {t.seq_len} x accum {t.grad_accum}{_data_words(cfg)}, {tech.precision}, attention {tech.attention}, "
          f"checkpointing {tech.checkpointing}, loss {tech.loss}, optim {tech.optim}"
          + (f", LoRA r{tech.lora_rank}" if tech.lora_rank else "") + (" + NF4 base (QLoRA)" if tech.qlora else ""))
    rows = [("component at the peak", "bytes", "")]
    rows += [(k, fmt_bytes(v), "") for k, v in out["trace"]["by_category"].items()]
    rows.append(("peak", fmt_bytes(out["peak_bytes"]), f"{out['peak_phase']}"))
    rows += _offload_rows(None, out["trace"])
    print(_table(rows))
    print(f"  {out['note']}, in {out['trace_seconds']:.1f} s ({out['device_type']} kernels); "
          f"not analytic: {out['not_analytic']}")
    if "device_memory_note" in out:
        print(f"  {out['device_memory_note']}")
    _print_loss_kernel(out)
    _print_fit(out)
    a = out["analytic_approximation"]
    if a is not None and a["error_vs_trace"] is not None:
        print(f"  (our GPT's analytic model with llama substitutions would say {fmt_bytes(a['peak_bytes'])}, "
              f"{a['error_vs_trace']:+.1%} off the trace)")
    _print_module_table(out, cfg)
    return 0


def _run_hf_analytic(args: argparse.Namespace, step: StepEstimate, device_type: str) -> int:
    """A transformers family the analytic model covers (memtrain.analysis.estimate.hf): the
    analytic estimate, with --trace the (extrapolated) trace beside it and the error."""
    cfg, est, out = step.cfg, step.analytic, step.json
    assert est is not None
    out.update(_fit(args, cfg, step.arch, device_type, _shard(args, cfg)))
    out.update(_loss_kernel(cfg, device_type))
    if args.trace:
        traced = _trace_any_depth(cfg, device_type)
        out["trace"] = _trace_check(traced, est, method=traced["method"],
                                    probe_layers=traced["probe_layers"])
        out["note"] = HF_ANALYTIC_MODEL  # the check the note suggests is the row above it
    out.update(_module_table_traced(cfg, device_type))
    if args.json:
        print(json.dumps(out, indent=2, default=float))
        return 0
    t, tech = cfg.train, cfg.technique
    print(f"{cfg.model.model}: {_parameter_words(est.parameters, est.adapter_parameters, est.trainable_parameters)}; "
          f"batch {t.batch_size} x seq {t.seq_len} x accum {t.grad_accum}{_data_words(cfg)}, {tech.precision}, attention {tech.attention}, "
          f"checkpointing {tech.checkpointing}, loss {tech.loss}, optim {tech.optim}"
          + (f", LoRA r{tech.lora_rank}" if tech.lora_rank else "") + (" + NF4 base (QLoRA)" if tech.qlora else "")
          + (f"; {est.shard} over {est.world_size} ranks, per rank" if est.world_size > 1 else ""))
    rows = [("component at the peak", "bytes", "")]
    rows += [(k, fmt_bytes(v), "") for k, v in est.bytes.items()]
    rows.append(("peak", fmt_bytes(est.peak_bytes), f"{est.peak_phase} ({est.peak_detail})"))
    rows += _device_memory_rows(est.device_memory)
    if "trace" in out:
        tr = out["trace"]
        rows.append(("traced peak (fake tensors)", fmt_bytes(tr["peak_bytes"]),
                     f"{tr['peak_phase']}, {tr['method']}; {_trace_error_words(tr)}"))
    rows += _offload_rows(out.get("offload"), out.get("trace"))
    print(_table(rows))
    print(f"  {out['note']}")
    _print_loss_kernel(out)
    _print_fit(out)
    _print_module_table(out, cfg)
    if args.explain:
        print("\n".join("  " + line for line in est.explanation))
    return 0


register("estimate", "Predict training (or inference) memory by component without running it; --trace to check with fake tensors.",
         add_args, run)


def _trace_any_depth(cfg: Any, device_type: str) -> dict[str, Any]:
    """--trace: the step traced under fake tensors (memtrain.analysis.depth_trace). The command's
    one crossing of the torch line: every other path of `memtrain estimate` is arithmetic, so
    the tracing code (and torch) is imported only when --trace asks for it."""
    from memtrain.analysis.depth_trace import trace_any_depth  # the torch line, crossed on --trace only

    return trace_any_depth(cfg, device_type)


def _check_cuda_trace(args: argparse.Namespace, cfg: Any) -> None:
    """A trace asked for (--trace, --full-trace, --memory-by-module) with CUDA kernels on a
    CPU-only torch is refused before anything loads: the trace's own check sits behind
    transformers' import and the config's load (8-25 s on 2 cores before the same one line)."""
    asked = args.trace or args.full_trace or cfg.train.memory_by_module
    if not asked or args.mode != "train":
        return
    if (args.trace_device or device_type_for(args, cfg)) == "cuda" and cpu_only_torch():
        raise ConfigError(cuda_trace_refusal())


def _check_module_table(args: argparse.Namespace, cfg: Any) -> None:
    """--memory-by-module traces one training step of one process."""
    if not cfg.train.memory_by_module:
        return
    if args.mode != "train":
        raise ConfigError("--memory-by-module traces a training step; drop --mode inference (or --memory-by-module)")
    if args.world_size > 1:
        raise ConfigError("--memory-by-module traces one process; drop --world-size (or --memory-by-module)")


def _module_table(traced: dict[str, Any]) -> dict[str, Any]:
    """``by_module`` of a trace made under --memory-by-module; {} otherwise."""
    return {"by_module": traced["by_module"]} if "by_module" in traced else {}


def _module_table_traced(cfg: Any, device_type: str) -> dict[str, Any]:
    """--memory-by-module on a transformers model: every layer traced (an extrapolated trace
    has no module of the real depth to name); {} without the flag."""
    if not cfg.train.memory_by_module:
        return {}
    from memtrain.analysis.trace import trace_step  # the torch line, crossed on --memory-by-module only

    return _module_table(trace_step(cfg, device_type))


def _print_module_table(out: dict[str, Any], cfg: Any) -> None:
    if "by_module" in out:
        print("\n".join(module_table_lines(out["by_module"], cfg.train.module_top, fmt_bytes)))


def _device_memory_rows(dmem: Any) -> list[tuple[str, str, str]]:
    """The caching-allocator model's rows (``--gpu NAME``), none without it."""
    if not dmem:
        return []
    return [("CUDA allocated (max_memory_allocated)", fmt_bytes(dmem["allocated"]),
             "512 B blocks, cuBLAS workspaces (forward and backward threads)"),
            ("CUDA reserved (max_memory_reserved)", fmt_bytes(dmem["reserved"]), f"{dmem['segments']} cached segments"),
            ("device total (nvidia-smi)", fmt_bytes(dmem["device_total"]),
             f"reserved + CUDA context {fmt_bytes(dmem['cuda_context'])} (assumed for {dmem['gpu']})")]


# The phases before the optimizer step: what an eagerly traced torchao step leaves exact.
_BEFORE_OPTIMIZER = ("forward", "backward")


def _trace_check(traced: dict[str, Any], est: Any, **how: Any) -> dict[str, Any]:
    """The ``trace`` entry of ``estimate --trace``: the traced step, how it was traced (``how``),
    and the estimate's error against it; with ``--compile-memory-budget``, ``compile`` (what the
    partitioner saved, memtrain.analysis.trace); with torchao's optimizer, ``optimizer_step``
    (its step was traced eagerly: an upper bound) and ``error_before_optimizer``, the error on
    the larger of the forward and backward peaks, which that bound does not touch."""
    extra: dict[str, Any] = {k: traced[k] for k in ("compile", "optimizer_step") if k in traced}
    if "offload" in traced:
        extra["offload"] = traced_offload(traced)
    if "optimizer_step" in traced:
        mine = max(est.phase_peaks.get(p, 0.0) for p in _BEFORE_OPTIMIZER)
        theirs = max(traced["phase_peaks"].get(p, 0.0) for p in _BEFORE_OPTIMIZER)
        extra["error_before_optimizer"] = mine / theirs - 1 if theirs else None
    return {"peak_bytes": traced["peak_bytes"], "by_category": traced["by_category"],
            "peak_phase": traced["peak_phase"], "device_type": traced["device_type"], **how, **extra,
            "error": est.peak_bytes / traced["peak_bytes"] - 1 if traced["peak_bytes"] else None}


def _offload_rows(analytic: Optional[dict[str, Any]], check: Optional[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """--offload-activations' rows: the host copies the estimate and (with --trace) the traced
    offloader hold at most and move each way in a step; none without the flag."""
    rows = []
    if analytic:
        rows.append(("host copies (peak)", fmt_bytes(analytic["host_peak_bytes"]),
                     f"{fmt_bytes(analytic['d2h_bytes_per_step'])} to the host, "
                     f"{fmt_bytes(analytic['h2d_bytes_per_step'])} back a step"))
    moved = (check or {}).get("offload")
    if moved:
        rows.append(("traced host copies (peak)", fmt_bytes(moved["host_peak_bytes"]),
                     f"{fmt_bytes(moved['d2h_bytes_per_step'])} to the host, "
                     f"{fmt_bytes(moved['h2d_bytes_per_step'])} back a step; {moved.get('tensors', 0)} tensors"))
    return rows


def _trace_error_words(check: dict[str, Any]) -> str:
    """The traced-peak row's comparison. When torchao's compiled optimizer step was traced
    eagerly the traced peak is an upper bound, so the error that means something is the one
    before the optimizer step."""
    if check.get("error_before_optimizer") is None:
        return f"estimate {check['error']:+.1%}"
    if check["peak_phase"] != "optimizer":
        return f"estimate {check['error']:+.1%} (the optimizer step was traced eagerly: an upper bound)"
    return (f"forward/backward: estimate {check['error_before_optimizer']:+.1%}; the optimizer step "
            f"was traced eagerly, an upper bound (estimate {check['error']:+.1%} of it)")


def _compile_budget_rows(out: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Rows of --compile-memory-budget: the interpolated peak, and with --trace what the
    partitioner saved (none without a budget)."""
    entry = out.get("compile_memory_budget")
    if entry is None:
        return []
    rows = []
    if entry.get("peak_bytes") is not None:
        rows.append((f"peak at compile budget {entry['memory_budget']:g}", fmt_bytes(entry["peak_bytes"]),
                     f"interpolated, not traced (docs/estimation.md); recompute {entry['recompute_share']:.0%} "
                     "of full checkpointing's"))
    else:
        rows.append((f"compile budget {entry['memory_budget']:g}", "-", entry["note"]))
    saved = out.get("trace", {}).get("compile")
    if saved:
        rows.append(("saved for backward (traced partition)", fmt_bytes(saved["saved_activation_bytes"]),
                     f"per forward pass, {saved['scope']} scope, {saved['forward_calls']} compiled call(s)"))
    return rows
