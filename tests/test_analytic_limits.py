"""The analytic commands answer in O(1) of the model size, or refuse it.

estimate/plan/flops count per layer *kind*: the estimator's timeline runs a few blocks and
stands one allocation per category in for the rest (estimate.simulator.Compression), flops traces a
1- and a 2-block model and scales. These tests prove both are exact (against the per-layer
computation they replace) and that absurd sizes are refused with exit 2, bounded in time and
memory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import memtrain.analysis.estimate as E
import memtrain.analysis.estimate.simulator as S
import memtrain.analysis.estimate.training as T
from memtrain.config.run import ConfigError, RunConfig

SRC = str(Path(__file__).resolve().parents[1] / "src")
TINY = dict(vocab_size=512, d_model=64, n_heads=4, d_ff=128, max_seq_len=128, batch_size=2, seq_len=32)


# Runs memtrain's CLI under an address-space limit and reports the process's own peak RSS.
# VmHWM is the high-water mark of the process's memory after exec; ru_maxrss (wait4/getrusage)
# would also count the image forked from this test process, which holds torch once earlier tests
# imported it, so it measures the test runner, not the command.
_BOUNDED = """
import resource, sys
limit, out = int(sys.argv[1]), sys.argv[2]
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
code = 1
try:
    from memtrain.cli import main
    code = main(sys.argv[3:])
except SystemExit as exc:
    code = exc.code if isinstance(exc.code, int) else 1
finally:
    with open("/proc/self/status") as fh:
        hwm = next(line for line in fh if line.startswith("VmHWM:"))
    with open(out, "w") as fh:
        fh.write(hwm.split()[1])
sys.exit(code)
"""


def _run_bounded(args: list[str], mem_bytes: int = 1 << 30, timeout: float = 60) -> tuple[subprocess.CompletedProcess, int]:
    """Run memtrain's CLI with ``args`` under an address-space limit; returns (process, peak RSS in KB)."""
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with tempfile.TemporaryDirectory() as tmp:
        hwm_file = os.path.join(tmp, "hwm")
        proc = subprocess.run([sys.executable, "-c", _BOUNDED, str(mem_bytes), hwm_file, *args],
                              capture_output=True, text=True, timeout=timeout, env=env)
        with open(hwm_file) as fh:
            rss_kb = int(fh.read())
    return proc, rss_kb


@pytest.mark.parametrize("args", [
    ["estimate", "--params", "1e30"],
    ["estimate", "--params", "1e15"],
    ["estimate", "--n-layers", "1000000000"],
    ["estimate", "--params", "inf"],
    ["plan", "--params", "1e30", "--budget", "24GiB"],
    ["flops", "--n-layers", "1000000000"],
    ["estimate", "--d-model", "100000000", "--json"],
    ["estimate", "--n-layers", "5000", "--trace"],
])
def test_absurd_sizes_are_refused_in_bounded_memory(args):
    # 1 GiB of address space: the old per-layer table grew to 11 GB on --params 1e30.
    proc, _ = _run_bounded(args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_deep_model_estimate_is_fast_and_small():
    """100,000 layers (the limit) answer; RSS stays under 300 MB (measured on the child)."""
    t0 = time.monotonic()
    proc, rss_kb = _run_bounded(["estimate", "--n-layers", "100000", "--json", "--device", "cpu"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert rss_kb < 300 * 1024
    assert time.monotonic() - t0 < 30  # generous: a shared CI core; the local figure is ~1 s


def test_param_count_matches_the_table():
    for L in (1, 3, 12):
        for ov in (dict(), dict(untie_embeddings=True), dict(bias=False)):
            cfg = RunConfig().replace(**TINY, n_layers=L, **ov)
            table = E.param_table(cfg.model)
            assert E.param_count(cfg.model) == (sum(p.numel for p in table), sum(p.numel for p in table if p.trainable))
    cfg = RunConfig().replace(**TINY, n_layers=5, lora_rank=4)
    table = E.param_table(cfg.model, tech=cfg.technique)
    assert E.param_count(cfg.model, tech=cfg.technique)[1] == sum(p.numel for p in table if p.trainable)


def test_huge_parameter_count_is_o1():
    n, _ = E.param_count(RunConfig().replace(n_layers=100_000).model)
    assert n > 100_000 * 12 * 256 * 256
    with pytest.raises(ConfigError, match="beyond"):
        E.param_count(RunConfig().replace(n_layers=100_001).model)


@pytest.mark.parametrize("L", [11, 20])
@pytest.mark.parametrize("ov", [
    dict(), dict(dropout=0.1, checkpointing="full"), dict(checkpointing="selective"),
    dict(checkpointing="every:3", loss="chunked", loss_chunk=16), dict(checkpointing="sqrt", dropout=0.1),
    dict(precision="bf16", dropout=0.1), dict(precision="bf16-pure"), dict(grad_accum=2),
    dict(lora_rank=4), dict(untie_embeddings=True, optim="adamw-8bit"), dict(optim="adafactor"),
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "plain")
def test_compressed_timeline_equals_the_per_layer_one(L, ov, monkeypatch):
    cfg = RunConfig().replace(**TINY, n_layers=L, **ov)
    for device, world, shard in (("cpu", 1, None), ("cuda", 1, None), ("cuda", 4, "zero2"), ("cuda", 2, "fsdp")):
        fast = E.estimate(cfg, device_type=device, world_size=world, shard=shard)
        assert S.compression_of(cfg).lumps > 0 or L < 20  # at 20 layers every policy lumps
        with monkeypatch.context() as mp:
            whole = S.Compression(S.compression_of(cfg).period, 0, L)
            mp.setattr(T, "compression_of", lambda c: whole)  # noqa: B023 - used inside this iteration
            slow = E.estimate(cfg, device_type=device, world_size=world, shard=shard)
        assert fast.to_dict() == slow.to_dict()


def test_flops_per_kind_equals_the_whole_trace():
    import memtrain.analysis.flops.count as F

    cfg = F._counting_config(RunConfig().replace(d_model=32, n_heads=2, n_layers=9, d_ff=64, vocab_size=128,
                                                 batch_size=2, seq_len=16, checkpointing="every:4"))
    whole = F._trace(cfg)
    kinds = F._trace_by_kind(cfg)
    assert kinds[1:] == whole[1:]
    for phase, classes in whole[0].items():
        for name, c in classes.items():
            k = kinds[0][phase][name]
            assert (k.counted, k.elementwise, k.bytes, k.ops) == (c.counted, c.elementwise, c.bytes, c.ops)


@pytest.mark.parametrize("verb", [["estimate"], ["maxbatch", "--memory-budget", "8GiB"], ["flops"]])
def test_an_absurd_seq_len_is_refused_naming_seq_len(verb, capsys):
    """--seq-len alone sets --max-seq-len on the verbs that size one step: a --seq-len beyond the
    limit was refused as "--max-seq-len 2,000,000 is beyond ...", a flag the user never gave."""
    from memtrain.cli import main

    assert main([*verb, "--seq-len", "2000000"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --seq-len 2,000,000 is beyond what memtrain"), lines


@pytest.mark.parametrize("model", [[], ["--model", "tiny-llama"]])
def test_train_refuses_an_absurd_seq_len_naming_the_limit(model, tmp_path, capsys):
    """train said "lower --seq-len or raise --max-seq-len" (for a transformers model: a config.json
    with more max_position_embeddings), advice that only met memtrain's size limit next: now the
    limit itself, as estimate says it, and nothing is written."""
    from memtrain.analysis.limits import MAX_WIDTH
    from memtrain.cli import main

    out = tmp_path / "run"
    assert main(["train", *model, "--seq-len", "2000000", "--out", str(out)]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines == [f"error: --seq-len 2,000,000 is beyond what memtrain builds or estimates (at most {MAX_WIDTH:,}); "
                     "give a real size"]
    assert not out.exists()
    # Within the limit the advice is still the flag that helps.
    assert main(["train", "--seq-len", "600", "--out", str(out)]) == 2
    assert "lower --seq-len or raise --max-seq-len" in capsys.readouterr().err
