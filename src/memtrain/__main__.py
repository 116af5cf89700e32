"""``python -m memtrain`` is the same as the ``memtrain`` command."""

import sys

from memtrain.cli import main

sys.exit(main())
