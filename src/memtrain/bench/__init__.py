"""`memtrain bench`: one model, one data set, one set of hyper-parameters, many techniques,
each in its own process; results appended as they finish; tables and plots from them."""

from memtrain.bench.runner import BenchOptions, run_bench
from memtrain.bench.scales import SCALES
from memtrain.bench.technique_sets import DEFAULT_TECHNIQUES, TECHNIQUES

__all__ = ["BenchOptions", "run_bench", "TECHNIQUES", "SCALES", "DEFAULT_TECHNIQUES"]
