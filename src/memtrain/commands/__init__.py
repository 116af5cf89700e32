"""Subcommands beyond ``train``: each module here calls :func:`memtrain.cli.register` on
import (keep imports of torch inside the command functions so ``--help`` stays fast)."""
