"""A memory-mapped checkpoint cut short while export or generate reads it (memtrain.checkpoints.mapped)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memtrain.checkpoints.mapped import file_regions, read_off_mapping
from memtrain.config.run import build_config
from memtrain.training.train import train

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")

# export, with the checkpoint cut to 64 KiB (inside the model's first weights) by someone else right
# after torch mapped it, before any weight was read.
CUT_DURING_EXPORT = """
import os, sys
import memtrain.inference.export as export
from memtrain.cli import main
real = export.read_state
def cut(p, hint, mmap=False):
    state = real(p, hint, mmap=mmap)
    os.truncate(p, 65536)
    return state
export.read_state = cut
sys.exit(main(["export", sys.argv[1], sys.argv[2]]))
"""


@pytest.fixture()
def checkpoint(tiny_run, tmp_path) -> Path:
    ckpt = tmp_path / "run" / "c.pt"
    train(build_config({**tiny_run, "steps": 2, "save": str(ckpt)}))
    return ckpt


def test_a_checkpoint_cut_while_export_reads_it_is_one_line_not_sigbus(checkpoint, tmp_path):
    """The mapped weights' pages were gone: the first touch ended export with SIGBUS (exit -7, no
    line). The weights are read with pread before anything touches them: a short read, exit 2."""
    dest = tmp_path / "exported"
    proc = subprocess.run([sys.executable, "-c", CUT_DURING_EXPORT, str(checkpoint), str(dest)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: checkpoint") and "cut short" in lines[0]
    assert not dest.exists() and not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_weights_read_off_the_mapping_are_equal_private_and_keep_their_ties(checkpoint):
    """The copies hold the same values, share one storage where the checkpoint's did (tied
    embeddings), and none of them lies in the file's mapping any more."""
    state = torch.load(checkpoint, weights_only=True, mmap=True)
    model = state["model"]
    copies = read_off_mapping(model, checkpoint)
    assert copies.keys() == model.keys()
    st = os.stat(checkpoint)
    regions = file_regions(st)
    assert regions, "torch.load(mmap=True) maps the file"
    for name, value in model.items():
        assert torch.equal(copies[name], value), name
        ptr = copies[name].untyped_storage().data_ptr()
        assert not any(r.start <= ptr < r.end for r in regions), f"{name} is still mapped"
    shared = {}
    for name, value in model.items():
        shared.setdefault(value.untyped_storage().data_ptr(), set()).add(copies[name].untyped_storage().data_ptr())
    assert all(len(ptrs) == 1 for ptrs in shared.values())  # one copy per storage
    assert len(shared) < len(model) or "lm_head.weight" not in model  # the tie is there to keep
