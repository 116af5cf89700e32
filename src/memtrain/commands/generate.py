"""`memtrain generate`: sample text from a checkpoint or an exported directory, seeded."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional

from memtrain.analysis.estimate.generation import DEFAULT_NEW_TOKENS, TOP_K
from memtrain.analysis.limits import MAX_WIDTH
from memtrain.cli import allocation_of, refuse_device_not_here, register
from memtrain.config.argtypes import (
    batch_count,
    int_in,
    sampling_temperature,
    seed_value,
    token_count,
    user_path,
    utf8_text,
)
from memtrain.config.run import ConfigError
from memtrain.errors import is_out_of_memory
from memtrain.techniques.facts import GENERATE_DTYPES
from memtrain.training.size_check import host_available_bytes


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", type=user_path, help="Checkpoint file (train --save; memtrain's GPT or a transformers --model) or a "
                   "directory written by `memtrain export`. A folder is read with safetensors weights only; one whose "
                   "config names custom code (auto_map) is refused.")
    p.add_argument("--prompt", type=utf8_text, default="", help="Text to continue (default: start of a document; with --chat, an empty user "
                   "message).")
    p.add_argument("--chat", action="store_true",
                   help="--prompt is a user message: frame it with the tokenizer's chat template (assistant turn "
                        "opened, as transformers' chat pipeline does) and print the reply, cut at the end of its "
                        "turn. A tokenizer without a template is refused.")
    # Every value is checked here (exit 2 before the model loads): NaN, inf or a negative
    # temperature, a seed or count beyond 64 bits would otherwise fail deep inside torch.
    p.add_argument("--max-new-tokens", type=token_count, default=DEFAULT_NEW_TOKENS,
                   help=f"Tokens to sample (default {DEFAULT_NEW_TOKENS}); memtrain estimate --mode inference --new-tokens "
                        "N predicts the memory. Every one is sampled and, without --chat, printed: a plain sample "
                        "does not stop at the eos, whose text (e.g. <|im_end|>, <|endoftext|>) it prints where "
                        "drawn; --chat cuts the reply at its end of turn.")
    p.add_argument("--temperature", type=sampling_temperature, default=0.8,
                   help="Softmax temperature: 0 = greedy, else finite and at least 1e-30 (default 0.8).")
    p.add_argument("--top-k", type=int_in(0, MAX_WIDTH, "a token count"), default=TOP_K,
                   help=f"Sample among the k likeliest tokens; 0 = no cut (default {TOP_K}).")
    p.add_argument("--num-samples", type=batch_count, default=1, help="Independent samples (default 1).")
    p.add_argument("--seed", type=seed_value, default=1337,
                   help="Sampling seed in [0, 2**64) (default 1337): same seed, same text (on the same device, "
                        "in the same dtype).")
    p.add_argument("--device", default="auto",
                   help="Device to sample on: auto (CUDA when present, as train; the default), cpu, cuda or cuda:N.")
    p.add_argument("--dtype", default=None, choices=GENERATE_DTYPES,
                   help="Weights and compute dtype (default: as stored: float32, or the dtype a checkpoint's run "
                        "trained in). Before sampling, the estimate of the run is held against the memory it can have "
                        "(a GPU's free memory; on the CPU the host's available memory, MemAvailable or less "
                        "under a cgroup limit): a run that cannot fit is one error line.")


def check_fits(cfg: Any, dtype: Any, prompt_tokens: int, new_tokens: int, samples: int, device: Any,
               free_bytes: Optional[int]) -> None:
    """ConfigError when ``memtrain estimate --mode inference``'s peak for this sampling run (the
    model of ``cfg`` with its weights in the torch ``dtype``, ``samples`` sequences of
    ``prompt_tokens`` + ``new_tokens``) exceeds ``free_bytes`` of ``device`` (None: unknown,
    nothing checked). A model the estimate does not model is not checked: generate runs as it
    would have."""
    from memtrain.analysis.estimate import GPT2_ARCH  # torch-free --help: read once a model is known
    from memtrain.analysis.estimate.inference import estimate_generate_run
    from memtrain.inference.generate import DTYPES
    from memtrain.models.spec import is_hf

    weights_dtype = next((k for k, v in DTYPES.items() if v == dtype), None)
    if free_bytes is None or weights_dtype is None:  # weights in a dtype the estimate does not model
        return
    try:
        run = cfg.replace(seq_len=prompt_tokens, batch_size=samples)
        need = estimate_generate_run(run, weights_dtype, None if is_hf(cfg) else GPT2_ARCH, new_tokens)["peak_bytes"]
    except ConfigError as exc:
        # Said, not silent: the check is a promise of the command, and a family the inference
        # estimate does not model (Qwen3, Falcon, ...) samples without it.
        why = str(exc).removeprefix("--mode inference: ")
        print(f"note: sampling without the memory check (memtrain estimate --mode inference: {why})", file=sys.stderr)
        return
    if need <= free_bytes:
        return
    where = f"free on {device}" if device.type == "cuda" else "available on this machine"
    cheaper = (", or --dtype bf16" if weights_dtype == "fp32" else "") + (", or --device cpu" if device.type == "cuda" else "")
    raise ConfigError(f"{samples} sample{'s' if samples > 1 else ''} of a {prompt_tokens}-token prompt + {new_tokens} "
                      f"new tokens need about {need / 2**30:.2f} GiB (memtrain estimate --mode inference), more than "
                      f"the {free_bytes / 2**30:.2f} GiB {where}; lower --num-samples or --max-new-tokens{cheaper}")


def free_memory(device: Any, host_available: Optional[int]) -> Optional[int]:
    """What generate may use on ``device``: a GPU's free memory, or on the CPU
    ``host_available``, the host's available memory read before the model was loaded (the
    estimate counts the model's own bytes), or None where unknown."""
    if device.type == "cuda":
        import torch  # torch-free --help: a CUDA device was resolved, so torch is loaded already

        return int(torch.cuda.mem_get_info(device)[0])
    return host_available


def run(args: argparse.Namespace) -> int:
    refuse_device_not_here(args.device)  # before transformers loads: seconds for one line
    from memtrain.inference.generate import generate  # torch-free --help/estimate/plan

    # Read before a checkpoint's model is loaded: the estimate the reading is held against
    # counts the model, which would otherwise be subtracted twice.
    host_available = host_available_bytes()

    def fits(cfg: Any, dtype: Any, prompt_tokens: int, device: Any) -> None:
        check_fits(cfg, dtype, prompt_tokens, args.max_new_tokens, args.num_samples, device,
                   free_memory(device, host_available))

    try:
        texts = generate(Path(args.model), args.prompt, args.max_new_tokens, args.temperature, args.top_k,
                         args.num_samples, args.seed, args.device, args.dtype, before_sampling=fits, chat=args.chat)
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        # Past the estimate's check (a lower bound; other processes take memory too): the same
        # advice as the check's, in one line, as train's out-of-memory refusal.
        raise ConfigError(f"out of memory sampling {args.num_samples} x {args.max_new_tokens} new tokens "
                          f"({allocation_of(exc)}); lower --num-samples or --max-new-tokens"
                          + (", or --dtype bf16" if args.dtype in (None, "fp32") else "")) from None
    for i, text in enumerate(texts):
        if len(texts) > 1:
            print(f"--- sample {i + 1}")
        print(text if args.chat else args.prompt + text)  # a chat prints the reply alone
    return 0


register("generate", "Sample text from a trained checkpoint or an exported model directory (seeded).", add_args, run)
