"""memtrain vs Hugging Face Trainer: the same model, tokens and schedule, the same meters.

    python benchmarks/compare_hf.py --scale quick --techniques baseline,bf16,chunked-loss \
        --out benchmarks/results/cpu [--model tiny-llama] [--budget 1GiB] [--steps N] [--repeats R]

A script over the package :mod:`memtrain.bench.hf` (what each module does: its ``__init__``;
what is identical on both sides and how: benchmarks/README.md); ``python -m memtrain.bench.hf``
takes the same flags.
"""

from __future__ import annotations

import sys

from memtrain.bench.hf.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
