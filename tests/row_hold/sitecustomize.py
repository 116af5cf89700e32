"""Holds a bench row process before it starts, for tests/test_bench_signals.py.

Python imports ``sitecustomize`` at start-up from the first folder on ``sys.path`` that has one;
the test puts this folder on the bench's PYTHONPATH. In a ``python -m memtrain.bench.worker``
process (a row; the bench and the row launcher's small Python are left alone) it sleeps
``MEMTRAIN_TEST_ROW_SLEEP`` seconds first, so a signal sent to the bench always arrives mid-row;
with ``MEMTRAIN_TEST_ROW_IGNORE_TERM`` it ignores SIGTERM meanwhile, so its bench must wait out the
grace period and SIGKILL it.
"""

import os
import sys
import time

if sys.orig_argv[1:3] == ["-m", "memtrain.bench.worker"] and os.environ.get("MEMTRAIN_TEST_ROW_SLEEP"):
    if os.environ.get("MEMTRAIN_TEST_ROW_IGNORE_TERM"):  # a row slow to stop (in a long kernel): only SIGKILL ends it
        import signal

        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        time.sleep(float(os.environ["MEMTRAIN_TEST_ROW_SLEEP"]))
    except KeyboardInterrupt:  # stopped by its bench, as the worker itself exits
        sys.exit(130)
