"""``python -m memtrain.bench.hf``: the comparison's command line, and the script each side's
worker process runs (``--worker SIDE SPEC OUT``)."""

import sys

from memtrain.bench.hf.lockstep import BATON

if sys.argv[1:2] == ["--worker"]:
    # Wait for the turn before importing torch: the import is heavy and the other side may be
    # in the middle of a timed step.
    BATON.acquire()

from memtrain.bench.hf.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:], prog="python -m memtrain.bench.hf"))
