"""`memtrain bench`: one model, one data set, one set of hyper-parameters, many techniques,
each in its own process; results appended as they finish; tables and plots from them."""

from memtrain.bench.presets import DEFAULT_TECHNIQUES, SCALES, TECHNIQUES
from memtrain.bench.runner import BenchOptions, run_bench

__all__ = ["BenchOptions", "run_bench", "TECHNIQUES", "SCALES", "DEFAULT_TECHNIQUES"]
