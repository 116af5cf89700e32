"""``python -m hf`` (from ``benchmarks/``): the same as ``python benchmarks/compare_hf.py``."""

import sys

from .lockstep import BATON

if sys.argv[1:2] == ["--worker"]:
    BATON.acquire()  # wait for the turn before importing torch (see lockstep.Baton)

from .cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
