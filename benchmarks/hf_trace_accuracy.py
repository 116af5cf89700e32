"""Trace vs a measured step on tiny transformers configs (the grid of tests/test_hf_models.py).

For each (family, techniques) of ``TRACE_GRID``: the tracked peak of two real steps
(memtrain.analysis.maxbatch.measure_step_memory) and of the same steps traced under fake tensors
(memtrain.analysis.trace.trace_step), batch 4 x seq 64. Prints a Markdown table.

    PYTHONPATH=src python benchmarks/hf_trace_accuracy.py
"""

from __future__ import annotations

import pathlib
import sys
import tempfile

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
torch.set_num_threads(1)

import test_hf_models as T  # noqa: E402  (the tiny configs the tests use)
from memtrain.analysis.maxbatch import measure_step_memory  # noqa: E402
from memtrain.analysis.trace import trace_step  # noqa: E402


def main() -> None:
    root = pathlib.Path(tempfile.mkdtemp())
    dirs = {f: T.make_model_dir(root, f, None) for f in T.FAMILIES}
    print("| family | techniques | measured bytes | traced bytes | error |\n|---|---|---:|---:|---:|")
    for fam, tech in T.TRACE_GRID:
        cfg = T.run_cfg(dirs[fam], root / "unused.jsonl", root, seq_len=64, **tech)
        m = measure_step_memory(cfg, 4)["peak_bytes"]
        t = trace_step(cfg.replace(batch_size=4), "cpu")["peak_bytes"]
        print(f"| {fam} | {tech or 'plain'} | {m} | {t} | {t / m - 1:+.4%} |", flush=True)


if __name__ == "__main__":
    main()
