"""--packing pad, interrupted and resumed: the same losses, the same rows in the same order, the same
final weights and the same padding figures as one uninterrupted run (tests/test_train.py checks
the same of --packing concat). With gradient accumulation, a --val-data of its own, --loss-on
completion's prompt-completion records and a periodic --save-every checkpoint; each run stops
mid-epoch and crosses an epoch boundary after the resume."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import memtrain.training.train as train_mod
from memtrain.config.run import build_config
from memtrain.data.loader import RecordRows
from memtrain.training.train import train

GPT = {"d_model": 32, "n_heads": 4, "n_layers": 2, "d_ff": 64, "max_seq_len": 64}
# 4 rows a batch, about 24 training records: 6 batches an epoch, so 8 steps (16 batches under
# --grad-accum 2) cross one epoch boundary or more, after a stop at step 4 (mid-epoch either way).
STEPS, STOP, BATCH = 8, 4, 4


def _texts(n: int = 30, salt: str = "") -> list[str]:
    """Records of 3 to about 60 tokens: short ones pad most of a row of 16, every seventh is cut."""
    return [(f"Record{salt} {i}: " + " ".join(f"w{(i * 5 + j) % 23}" for j in range(2 + i % 9))
             + (" long tail" * 40 if i % 7 == 0 else "")) for i in range(n)]


def _jsonl(path: Path, records: list[dict[str, str]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _base(tmp_path: Path, **kw: Any) -> dict[str, Any]:
    data = _jsonl(tmp_path / "r.jsonl", [{"text": t} for t in _texts()])
    return {**GPT, "data": data, "packing": "pad", "seq_len": 16, "batch_size": BATCH, "steps": STEPS,
            "warmup_steps": 2, "val_blocks": 6, "val_fraction": 0.2, "dropout": 0.1, "progress": False,
            "warmup_timing_steps": 1, "cache_dir": str(tmp_path / "cache"), **kw}


class _RowLog:
    """The training rows each run reads, in order: every :meth:`RecordRows.batch` call's indices
    (validation batches are built from :meth:`RecordRows.blocks`, not logged)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rows: list[list[int]] = []
        real = RecordRows.batch

        def logged(rows: RecordRows, indices: list[int]):
            self.rows.append(list(indices))
            return real(rows, indices)

        monkeypatch.setattr(RecordRows, "batch", logged)

    def take(self) -> list[list[int]]:
        rows, self.rows = self.rows, []
        return rows


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return torch.load(ckpt, weights_only=True)["model"]


def _run(settings: dict[str, Any], log: _RowLog, out: Path) -> tuple[dict[str, Any], list[list[int]]]:
    result = train(build_config({**settings, "out": str(out)}))
    return result, log.take()


def _interrupted_and_resumed(base: dict[str, Any], tmp_path: Path, log: _RowLog):
    """One uninterrupted run, then the same run stopped at STOP and resumed; each saves its final
    weights. Returns (full result, its rows, resumed result, the rows read before + after the stop)."""
    full, full_rows = _run({**base, "save": str(tmp_path / "full.pt")}, log, tmp_path / "full")
    ckpt = tmp_path / "half.pt"
    half, half_rows = _run({**base, "stop_after": STOP, "save": str(ckpt)}, log, tmp_path / "half")
    assert half["stopped_early"] and half["loss_history"] == full["loss_history"][:STOP]
    resumed, resumed_rows = _run({**base, "resume": str(ckpt), "save": str(tmp_path / "resumed.pt")}, log,
                                 tmp_path / "resumed")
    return full, full_rows, resumed, half_rows + resumed_rows


def _assert_same_run(full: dict[str, Any], resumed: dict[str, Any], tmp_path: Path) -> None:
    """The resumed run is the uninterrupted one: losses, evaluations, weights and padding figures."""
    assert resumed["steps_run"] == STEPS - STOP
    assert resumed["loss_history"] == full["loss_history"]
    assert resumed["val_loss"] == full["val_loss"]
    assert resumed["val_history"] == full["val_history"]
    a, b = _weights(tmp_path / "full.pt"), _weights(tmp_path / "resumed.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["pad_fraction"] == full["pad_fraction"] and 0 < full["pad_fraction"] < 1
    assert resumed["padding"] == full["padding"]
    for r in (full, resumed):
        assert r["real_tokens_per_s"] == pytest.approx(r["tokens_per_s"] * (1 - r["pad_fraction"]))


# Three `train` runs a test: the plain case and --val-data (which covers grad-accum and eval-every
# too) run by default, the other variants with the slow tests (`-m slow`).
@pytest.mark.parametrize("extra", [{}, pytest.param({"grad_accum": 2}, marks=pytest.mark.slow),
                                   pytest.param({"eval_every": 3}, marks=pytest.mark.slow)],
                         ids=["plain", "grad-accum-2", "eval-every-3"])
def test_a_pad_run_resumed_is_the_uninterrupted_run(tmp_path, monkeypatch, extra):
    log = _RowLog(monkeypatch)
    base = _base(tmp_path, **extra)
    full, full_rows, resumed, rows = _interrupted_and_resumed(base, tmp_path, log)
    accum = extra.get("grad_accum", 1)
    assert len(full_rows) == STEPS * accum and rows == full_rows
    per_epoch = full["padding"]["train_rows"] // BATCH
    assert STOP * accum % per_epoch and STEPS * accum > per_epoch  # stopped mid-epoch, crossed one after
    _assert_same_run(full, resumed, tmp_path)


def test_a_pad_run_with_its_own_val_data_resumes_exactly(tmp_path, monkeypatch):
    """--val-data: the validation rows come from another file, read and padded the same way."""
    log = _RowLog(monkeypatch)
    val = _jsonl(tmp_path / "val.jsonl", [{"text": t} for t in _texts(8, salt="v")])
    base = _base(tmp_path, val_data=val, grad_accum=2, eval_every=4)
    del base["val_fraction"]  # --val-data trains on all of --data
    full, full_rows, resumed, rows = _interrupted_and_resumed(base, tmp_path, log)
    assert rows == full_rows
    assert full["data"]["val_source"] == resumed["data"]["val_source"] and "val.jsonl" in full["data"]["val_source"]
    assert full["padding"]["val_targets_evaluated"] > 0
    _assert_same_run(full, resumed, tmp_path)


@pytest.mark.slow
def test_answers_only_pad_run_resumes_exactly(tmp_path, monkeypatch):
    """--loss-on completion over prompt-completion records under --packing pad: the prompts' and the
    pads' targets are both -100 and every micro-batch is weighed by its answer tokens."""
    log = _RowLog(monkeypatch)
    pairs = [{"prompt": f"Q{i}:" + " why" * (i % 3), "completion": f" A{i}." + " so" * (i % 9)} for i in range(30)]
    data = _jsonl(tmp_path / "pc.jsonl", pairs)
    base = _base(tmp_path, data=data, data_format="prompt-completion", loss_on="completion", grad_accum=2)
    full, full_rows, resumed, rows = _interrupted_and_resumed(base, tmp_path, log)
    assert rows == full_rows
    assert resumed["data"]["val_target_tokens_evaluated"] == full["data"]["val_target_tokens_evaluated"]
    _assert_same_run(full, resumed, tmp_path)


@pytest.mark.slow
def test_a_pad_run_resumed_from_its_periodic_checkpoint(tmp_path, monkeypatch):
    """A --save-every 2 run stopped at step 4 saved a checkpoint at step 2 on the way; resumed from a
    copy of that one it trains steps 3 and 4 again, on the same rows, and ends as the uninterrupted
    run does."""
    log = _RowLog(monkeypatch)
    base = _base(tmp_path, grad_accum=2)
    full, full_rows = _run({**base, "save": str(tmp_path / "full.pt")}, log, tmp_path / "full")
    ckpt = tmp_path / "periodic.pt"
    real_save = train_mod._Loop._save_periodic

    def save_and_copy(loop: Any, path: str, done: int) -> None:
        """The periodic save, its step-2 file copied aside (the save as the run stops replaces it)."""
        real_save(loop, path, done)
        if done == 2:
            shutil.copy(path, ckpt)

    monkeypatch.setattr(train_mod._Loop, "_save_periodic", save_and_copy)
    _, half_rows = _run({**base, "stop_after": STOP, "save": str(tmp_path / "half.pt"), "save_every": 2}, log,
                        tmp_path / "half")
    assert torch.load(ckpt, weights_only=True)["step"] == 2
    resumed, resumed_rows = _run({**base, "resume": str(ckpt), "save": str(tmp_path / "resumed.pt")}, log,
                                 tmp_path / "resumed")
    assert half_rows[:4] + resumed_rows == full_rows
    assert resumed["steps_run"] == STEPS - 2 and resumed["loss_history"] == full["loss_history"]
    a, b = _weights(tmp_path / "full.pt"), _weights(tmp_path / "resumed.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["padding"] == full["padding"] and resumed["pad_fraction"] == full["pad_fraction"]
