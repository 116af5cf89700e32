"""`memtrain bench` on a GPU: the runner (the parent of every row's process) never initialises
CUDA. torch keeps a process's CUDA state once made, and a context holds GPU memory; a runner
holding one for the whole bench would sit beside every row it measures. Checked on the CPU with
CUDA faked present and every way into torch's CUDA initialisation refusing."""

from __future__ import annotations

import json
import subprocess
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import memtrain.bench.cuda_caps as cuda_caps
import memtrain.bench.runner as runner
from conftest import TINY_MODEL
from memtrain.bench.runner import BenchOptions, bench_settings, run_bench
from memtrain.devices.probe import DeviceCaps

_CHILD_ANSWER = cuda_caps._child_answer  # memoized: each test starts without its answers

H100 = DeviceCaps(device_type="cuda", name="NVIDIA H100 80GB HBM3", torch=torch.__version__, threads=16,
                  native_bf16=True, native_fp16=True, tf32=True, bf16_reason="compute capability 9.0",
                  fp16_reason="compute capability 9.0", fused_adamw=None, foreach_adamw=None, sdpa_flash=None,
                  sdpa_mem_efficient=None, compute_capability=[9, 0])


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """CUDA visible (one GPU) to the code that only asks whether it is; initialising it is
    recorded and refused. Returns the record."""
    inits: list[str] = []

    def refuse(*args: Any, **kwargs: Any) -> None:
        inits.append("init")
        raise AssertionError("the bench runner initialised CUDA")

    monkeypatch.setattr(torch.cuda, "_lazy_init", refuse)
    monkeypatch.setattr(torch.cuda, "init", refuse)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    _CHILD_ANSWER.cache_clear()
    yield inits
    _CHILD_ANSWER.cache_clear()


def _fake_row(name: str, cfg: Any, opts: BenchOptions, eta: Any = None, known_max_batch: Any = None) -> dict:
    return {"status": "ok", "config": cfg.to_dict(), "val_ppl": 100.0, "val_loss": 4.6,
            "step_time_s": {"median": 0.1, "p10": 0.1, "p90": 0.1}, "tokens_per_s": 100.0,
            "memory": {"peak_bytes": 2**20, "by_category": {}}, "env": {"device": "cuda"}, "max_batch": None}


def _opts(out: Path) -> BenchOptions:
    overrides = {**TINY_MODEL, "seq_len": 32, "val_blocks": 2, "device": "cuda", "progress": False,
                 "steps": 2, "batch_size": 2}
    return BenchOptions(techniques=["baseline", "bf16"], out=out, overrides=overrides, maxbatch=True,
                        progress=False, eta=False)


def test_the_bench_runner_never_initialises_cuda(fake_cuda, monkeypatch, tmp_path):
    children: list[str] = []

    def child(device: str) -> DeviceCaps:
        children.append(device)
        return H100

    monkeypatch.setattr(cuda_caps, "_child_answer", child)
    monkeypatch.setattr(runner, "run_row_subprocess", _fake_row)
    ran: list[str] = []
    run_bench(_opts(tmp_path / "b"), on_row=lambda name, row: ran.append(name))
    assert fake_cuda == []
    assert ran == ["baseline", "bf16"]
    # The GPU's model and capabilities came from the child: the settings name it, and the BF16
    # row ran as asked (native on compute capability 9.0).
    assert bench_settings(_opts(tmp_path / "b"))["device_name"] == H100.name
    assert children and set(children) == {"cuda"}


def test_the_child_answer_is_read_back_and_a_failed_child_is_none(fake_cuda, monkeypatch):
    answers = iter([
        subprocess.CompletedProcess([], 0, stdout="a warning first\n" + json.dumps(H100.to_dict()) + "\n", stderr=""),
        subprocess.CompletedProcess([], 1, stdout="", stderr="RuntimeError: no CUDA GPUs are available"),
    ])
    cmds: list[list[str]] = []

    def fake_run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess:
        cmds.append(cmd)
        return next(answers)

    monkeypatch.setattr(cuda_caps.subprocess, "run", fake_run)
    assert cuda_caps.cuda_caps_in_child(torch.device("cuda")) == H100
    assert cuda_caps.cuda_caps_in_child(torch.device("cuda")) == H100  # asked once per device
    assert cuda_caps.cuda_caps_in_child(torch.device("cuda", 1)) is None
    assert [c[-3:] for c in cmds] == [["-m", "memtrain.bench.cuda_caps", "cuda"],
                                      ["-m", "memtrain.bench.cuda_caps", "cuda:1"]]
    assert fake_cuda == []


def test_the_child_refuses_a_device_that_is_not_cuda(capsys):
    assert cuda_caps.main(["cpu"]) == 2
    assert "usage" in capsys.readouterr().err


def test_a_cuda_result_records_the_allocator_settings(monkeypatch):
    """result.json's env on CUDA names the allocator settings its reserved figures ran under."""
    from memtrain.runtime import env as run_env

    class Props:
        total_memory = 80 * 2**30

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    for name in run_env.ALLOC_CONF_VARS:
        monkeypatch.delenv(name, raising=False)
    assert run_env.environment(torch.device("cuda"))["allocator_conf"] == {}
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    recorded = run_env.environment(torch.device("cuda"))
    assert recorded["allocator_conf"] == {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    assert "allocator_conf" not in run_env.environment(torch.device("cpu"))


def test_the_comparison_report_names_the_gpu_without_initialising_cuda(fake_cuda, monkeypatch, tmp_path):
    """compare_hf's parent rewrites its report after every row; while no run has recorded its
    machine (every one so far failed), the report names it itself, from the child on a GPU."""
    from memtrain.bench.hf.cli import settings_of
    from memtrain.bench.hf.report import write_report
    from memtrain.bench.hf.rows import resolve_rows

    monkeypatch.setattr(cuda_caps, "_child_answer", lambda device: H100)
    rows = resolve_rows("quick", ["baseline"], {**TINY_MODEL, "seq_len": 32, "device": "cuda"}, "cuda")
    opts = types.SimpleNamespace(scale="quick", repeats=1, threads=None, device="cuda", lockstep=True,
                                 exact_schedule=False, model=None)
    report = write_report(tmp_path, rows, settings_of(opts, rows, None, None), "compare_hf.py --device cuda", 0.0)
    assert fake_cuda == []
    assert report["env"]["device_model"] == H100.name and report["env"]["device_type"] == "cuda"
    assert report["env"]["torch"] == torch.__version__ and report["env"]["host_threads"] >= 1
    assert H100.name in (tmp_path / "compare_hf.md").read_text()


def test_the_default_cuda_list_is_fitted_to_the_gpu_without_initialising_cuda(fake_cuda, monkeypatch, tmp_path):
    """Every row of the GPU default list (compiled, windowed, fp8 ones) goes through the runner's
    adaptation to the device: all of it reads the child's answer, none of it asks CUDA."""
    from memtrain.bench.technique_sets import NOISE_ROWS, default_techniques

    monkeypatch.setattr(cuda_caps, "_child_answer", lambda device: H100)
    monkeypatch.setattr(runner, "run_row_subprocess", _fake_row)
    opts = _opts(tmp_path / "b")
    overrides = {**opts.overrides, "seq_len": 256, "max_seq_len": 256}  # the windowed rows' 128-token window fits
    opts = BenchOptions(**{**vars(opts), "overrides": overrides,
                           "techniques": default_techniques("cuda") + NOISE_ROWS, "substitute_slow": True})
    ran: list[str] = []
    run_bench(opts, on_row=lambda name, row: ran.append(name))
    assert fake_cuda == []
    assert len(ran) >= len(default_techniques("cuda"))
