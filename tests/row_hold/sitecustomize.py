"""Holds a bench row process before it starts, for tests/test_bench_signals.py.

Python imports ``sitecustomize`` at start-up from the first folder on ``sys.path`` that has one;
the test puts this folder on the bench's PYTHONPATH. In a ``python -m memtrain.bench.worker``
process (a row; the bench and the row launcher's small Python are left alone) it sleeps
``MEMTRAIN_TEST_ROW_SLEEP`` seconds first, so a signal sent to the bench always arrives mid-row.
"""

import os
import sys
import time

if sys.orig_argv[1:3] == ["-m", "memtrain.bench.worker"] and os.environ.get("MEMTRAIN_TEST_ROW_SLEEP"):
    try:
        time.sleep(float(os.environ["MEMTRAIN_TEST_ROW_SLEEP"]))
    except KeyboardInterrupt:  # stopped by its bench, as the worker itself exits
        sys.exit(130)
