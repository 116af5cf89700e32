"""memtrain vs Hugging Face Trainer: the same model, tokens and schedule, the same meters.

    python benchmarks/compare_hf.py --scale quick --techniques baseline,bf16,chunked-loss \
        --out benchmarks/results/cpu [--model tiny-llama] [--budget 1GiB] [--steps N] [--repeats R]

The entry point of the package ``benchmarks/hf/`` (what each module does: ``hf/__init__.py``;
what is identical on both sides and how: benchmarks/README.md). It is also the script each
side's worker process runs (``--worker SIDE SPEC OUT``), which waits for its lockstep turn
before importing torch.

The names below are re-exported for scripts and tests written against the single-file version.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a file: put benchmarks/ on sys.path so the package imports by name.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf.lockstep import BATON, BATON_ENV, STEP_WINDOWS, Baton, run_pair, run_subprocess, window_overlap_s  # noqa: E402

if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    # Wait for the turn before importing torch: the import is heavy and the other side may be
    # in the middle of a timed step.
    BATON.acquire()

from hf.cli import main, parse_args  # noqa: E402
from hf.data import OrderedBlocks, hf_train_dataset, training_order  # noqa: E402
from hf.hf_model import apply_hf_lora, build_hf_model, copy_gpt_weights, transformers_model  # noqa: E402
from hf.memtrain_side import run_ours  # noqa: E402
from hf.probe import HFStep, hf_step_peak, profile_phases  # noqa: E402
from hf.report import aggregate, render_markdown, write_profiles, write_report  # noqa: E402
from hf.rows import (  # noqa: E402
    COMMANDS_FILE,
    REPORT_JSON,
    REPORT_MD,
    RUNS_FILE,
    SIDES,
    config_hash,
    read_runs,
    resolve_rows,
)
from hf.trainer_side import StepMeter, hf_evaluate, make_hf_optimizer, run_theirs, training_arguments  # noqa: E402
from hf.worker import run_side, traced_peak, worker_main  # noqa: E402

__all__ = [
    "BATON", "BATON_ENV", "STEP_WINDOWS", "Baton", "run_pair", "run_subprocess", "window_overlap_s", "main",
    "parse_args", "OrderedBlocks", "hf_train_dataset", "training_order", "apply_hf_lora", "build_hf_model",
    "copy_gpt_weights", "transformers_model", "run_ours", "HFStep", "hf_step_peak", "profile_phases", "aggregate",
    "render_markdown", "write_profiles", "write_report", "COMMANDS_FILE", "REPORT_JSON", "REPORT_MD", "RUNS_FILE",
    "SIDES", "config_hash", "read_runs", "resolve_rows", "StepMeter", "hf_evaluate", "make_hf_optimizer",
    "run_theirs", "training_arguments", "run_side", "traced_peak", "worker_main",
]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
