"""`memtrain generate`: sample text from a checkpoint or an exported directory, seeded."""

from __future__ import annotations

import argparse
from pathlib import Path

from memtrain.analysis.estimate.generation import DEFAULT_NEW_TOKENS
from memtrain.analysis.limits import MAX_WIDTH
from memtrain.cli import register
from memtrain.config.argtypes import batch_count, int_in, non_negative_float, seed_value, token_count, user_path


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", type=user_path, help="Checkpoint file (train --save; memtrain's GPT or a transformers --model) or a "
                   "directory written by `memtrain export`. A folder is read with safetensors weights only; one whose "
                   "config names custom code (auto_map) is refused.")
    p.add_argument("--prompt", default="", help="Text to continue (default: start of a document).")
    # Every value is checked here (exit 2 before the model loads): NaN, inf or a negative
    # temperature, a seed or count beyond 64 bits would otherwise fail deep inside torch.
    p.add_argument("--max-new-tokens", type=token_count, default=DEFAULT_NEW_TOKENS,
                   help=f"Tokens to sample (default {DEFAULT_NEW_TOKENS}); memtrain estimate --mode inference --new-tokens "
                        "N predicts the memory.")
    p.add_argument("--temperature", type=non_negative_float, default=0.8,
                   help="Softmax temperature, finite and >= 0; 0 = greedy (default 0.8).")
    p.add_argument("--top-k", type=int_in(0, MAX_WIDTH, "a token count"), default=50,
                   help="Sample among the k likeliest tokens; 0 = no cut (default 50).")
    p.add_argument("--num-samples", type=batch_count, default=1, help="Independent samples (default 1).")
    p.add_argument("--seed", type=seed_value, default=1337,
                   help="Sampling seed in [0, 2**64) (default 1337): same seed, same text.")


def run(args: argparse.Namespace) -> int:
    from memtrain.inference.generate import generate  # torch-free --help/estimate/plan

    texts = generate(Path(args.model), args.prompt, args.max_new_tokens, args.temperature, args.top_k,
                     args.num_samples, args.seed)
    for i, text in enumerate(texts):
        if len(texts) > 1:
            print(f"--- sample {i + 1}")
        print(args.prompt + text)
    return 0


register("generate", "Sample text from a trained checkpoint or an exported model directory (seeded).", add_args, run)
