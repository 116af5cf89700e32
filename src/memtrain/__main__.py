"""``python -m memtrain`` is the same as the ``memtrain`` command."""

import sys

try:
    from memtrain.cli import main
except KeyboardInterrupt:  # Ctrl-C while torch is still importing: one line, not a traceback
    sys.stderr.write("error: interrupted\n")
    sys.exit(130)

sys.exit(main())
