"""`memtrain generate`: sample text from a checkpoint or an exported directory, seeded."""

from __future__ import annotations

import argparse
from pathlib import Path

from memtrain.cli import register
from memtrain.config import ConfigError


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="Checkpoint file (train --save; memtrain's GPT or a transformers --model) or a "
                   "directory written by `memtrain export`. A folder is read with safetensors weights only; one whose "
                   "config names custom code (auto_map) is refused.")
    p.add_argument("--prompt", default="", help="Text to continue (default: start of a document).")
    p.add_argument("--max-new-tokens", type=int, default=64, help="Tokens to sample (default 64).")
    p.add_argument("--temperature", type=float, default=0.8, help="Softmax temperature; 0 = greedy (default 0.8).")
    p.add_argument("--top-k", type=int, default=50, help="Sample among the k likeliest tokens (default 50).")
    p.add_argument("--num-samples", type=int, default=1, help="Independent samples (default 1).")
    p.add_argument("--seed", type=int, default=1337, help="Sampling seed (default 1337): same seed, same text.")


def run(args: argparse.Namespace) -> int:
    from memtrain.generate import generate  # torch-free --help/estimate/plan

    if args.max_new_tokens < 1 or args.num_samples < 1 or args.top_k < 0 or args.temperature < 0:
        raise ConfigError("--max-new-tokens and --num-samples must be >= 1, --top-k and --temperature >= 0")
    texts = generate(Path(args.model), args.prompt, args.max_new_tokens, args.temperature, args.top_k,
                     args.num_samples, args.seed)
    for i, text in enumerate(texts):
        if len(texts) > 1:
            print(f"--- sample {i + 1}")
        print(args.prompt + text)
    return 0


register("generate", "Sample text from a trained checkpoint or an exported model directory (seeded).", add_args, run)
