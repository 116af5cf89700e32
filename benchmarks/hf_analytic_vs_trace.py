"""The analytic estimate of each full-size row of hf_models_table.jsonl beside its traced peak.

    python benchmarks/hf_analytic_vs_trace.py [--table benchmarks/results/cpu-hf-models/hf_models_table.jsonl]

Prints a Markdown table (model, techniques, analytic GiB and phase, traced GiB and phase, error)
for every row whose family the analytic model claims; QLoRA rows are traced only. Seconds: no
model is built.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_models_table import BASE, SETS  # noqa: E402
from memtrain.analysis.estimate.hf import analytic_estimate  # noqa: E402
from memtrain.config.run import build_config  # noqa: E402
from memtrain.files.results import read_jsonl  # noqa: E402

GIB = 2**30


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--table", type=Path, default=Path(__file__).resolve().parent / "results" / "cpu-hf-models"
                    / "hf_models_table.jsonl")
    args = ap.parse_args(argv)
    if not args.table.is_file():
        ap.error(f"--table {args.table}: not found; give a hf_models_table.jsonl")
    print("| model | set | analytic GiB | trace GiB | error |\n|---|---|---:|---:|---:|")
    for r in read_jsonl(args.table).rows:
        if r.get("set") not in SETS:
            continue
        est = analytic_estimate(build_config({**BASE, **SETS[r["set"]], "model": r["model"]}), "cpu")
        if est is None:  # a family or technique (QLoRA's NF4) the analytic model does not claim
            continue
        print(f"| {r['model']} | {r['set']} | {est.peak_bytes / GIB:.2f} ({est.peak_phase}) | "
              f"{r['peak_bytes'] / GIB:.2f} ({r['peak_phase']}) | {est.peak_bytes / r['peak_bytes'] - 1:+.1%} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
