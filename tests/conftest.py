"""Shared fixtures: an isolated token cache, a small local corpus, tiny-model settings."""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("MPLBACKEND", "Agg")
# One intra-op thread for this process and every process a test starts (bench rows, torchrun
# ranks, CLI runs): set before torch is imported, which reads it once. The tests' models are
# tiny, where a second thread costs more than it gives, most of all on a machine whose cores
# other jobs share (docs/performance.md, "Figures behind choices in the code"). A value the
# caller set is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Under pytest-xdist each worker process gets a temporary folder of its own (TMPDIR, inherited
# by every process a test starts): bench row scratch folders and the stale-folder sweep a bench
# does first (memtrain.bench.process) are per temporary folder, so a test on one worker never
# sweeps a folder a test on the other is asserting about.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _WORKER_TMP = tempfile.mkdtemp(prefix=f"memtrain-tests-{os.environ['PYTEST_XDIST_WORKER']}-")
    os.environ["TMPDIR"] = tempfile.tempdir = _WORKER_TMP
    atexit.register(shutil.rmtree, _WORKER_TMP, ignore_errors=True)

# The signal tests send SIGINT, SIGTERM and SIGHUP to the commands they start and expect them
# handled. A disposition of "ignore" is inherited across exec: a test run started as a background
# job of a non-interactive shell ignores SIGINT, one under nohup ignores SIGHUP, and the commands it
# started then ignored them too (memtrain keeps an inherited ignore, as nohup means it), so those
# tests timed out or saw exit 0. Put the defaults back in this process (each xdist worker imports
# this file), so every command a test starts begins as from a terminal.
for _name in ("SIGINT", "SIGHUP", "SIGTERM"):
    _sig = getattr(signal, _name, None)
    if _sig is not None and signal.getsignal(_sig) == signal.SIG_IGN:
        signal.signal(_sig, signal.default_int_handler if _sig == signal.SIGINT else signal.SIG_DFL)

SHARED_SAMPLE = Path(__file__).resolve().parents[2] / "shared" / "data" / "stackoverflow_posts_sample.xml"

# A model small enough that a training step takes milliseconds on CPU.
TINY_MODEL = {"d_model": 32, "n_heads": 4, "n_layers": 2, "d_ff": 64, "max_seq_len": 64, "dropout": 0.0}


def pytest_xdist_auto_num_workers(config) -> int:
    """How many worker processes ``-n auto`` (pyproject's addopts) starts: two where the machine
    has two cores or more, none (the tests run in this process) on one core or when GPU tests are
    selected (they share one device, and its memory is what they measure).

    Two, not one per core: every test process runs one intra-op thread (OMP_NUM_THREADS above),
    and a good part of the suite waits on subprocesses (CLI runs, bench rows, torchrun ranks)
    whose start is single-threaded imports, so two workers keep two cores busy; the figures
    are in docs/performance.md ("Timings of the README's commands"). ``MEMTRAIN_TEST_WORKERS=N``
    sets another count (0: one process); ``-n N`` on the command line overrides it all."""
    asked = os.environ.get("MEMTRAIN_TEST_WORKERS")
    if asked:
        if not asked.isdigit():
            raise pytest.UsageError(f"MEMTRAIN_TEST_WORKERS={asked!r}: give a worker count (0: one process)")
        return int(asked)
    if "gpu" in (config.getoption("markexpr") or ""):
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return 2 if cores >= 2 else 0


def pytest_collection_modifyitems(config, items):
    """A ``bf16_heavy`` test is ``slow`` on a CPU without native BF16, where a BF16 matmul of the
    default vocabulary's LM head takes seconds (5-200x FP32), and runs by default elsewhere."""
    heavy = [item for item in items if item.get_closest_marker("bf16_heavy")]
    if not heavy:
        return
    from memtrain.devices.probe import probe

    # Before pytest's own -m filter (conftest hooks run first), so "not slow" sees the marker.
    if not probe("cpu", measure=False, kernels=False).native_bf16:
        for item in heavy:
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """memtrain runs gc.collect() after every measured batch probe (analysis.maxbatch) and when a
    distributed run ends. In the long-lived test process a full collection walks every object of
    every earlier test (~0.3 s each standalone, more late in the suite; a grid makes dozens).
    The objects alive when a test starts are set aside while it runs, its setup included
    (gc.freeze), so a collection scans what the test made; afterwards they return to the
    oldest generation (gc.unfreeze), so nothing stays uncollected."""
    gc.freeze()
    try:
        return (yield)
    finally:
        gc.unfreeze()


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Every test gets a token cache of its session, never the user's ~/.cache."""
    monkeypatch.setenv("MEMTRAIN_CACHE", str(tmp_path_factory.getbasetemp() / "token-cache"))


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    """A JSONL corpus of real-looking technical text (a few thousand tokens)."""
    import json

    d = tmp_path_factory.mktemp("corpus")
    path = d / "posts.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in _small_corpus_texts()))
    return path


@pytest.fixture(scope="session")
def small_text_corpus(tmp_path_factory) -> Path:
    """The documents of :func:`small_corpus` as a folder of .txt files, one document each: reading
    .txt needs no optional package (.jsonl needs ``datasets``), so the GPU tests that train run on
    a GPU machine without it. (One .txt file of them all would be read as a few 8 KB documents,
    too few for the document-level validation split.)"""
    d = tmp_path_factory.mktemp("text-corpus")
    for i, text in enumerate(_small_corpus_texts()):
        (d / f"post-{i:03d}.txt").write_text(text + "\n")
    return d


def _small_corpus_texts() -> list[str]:
    """The documents of :func:`small_corpus` and :func:`small_text_corpus`."""
    words = ("memory gradient tensor batch layer attention optimizer checkpoint python function "
             "value error list string return class module import loop index").split()
    return [f"Question {i}: " + " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(40 + i % 30)) + "."
            for i in range(300)]


@pytest.fixture
def tiny_text_run(tiny_run, small_text_corpus) -> dict:
    """:func:`tiny_run` on :func:`small_text_corpus` (no optional package needed to read it)."""
    return {**tiny_run, "data": str(small_text_corpus)}


@pytest.fixture
def tiny_run(small_corpus, tmp_path) -> dict:
    """Flat config overrides for a fast training run on the small corpus."""
    return {**TINY_MODEL, "data": str(small_corpus), "batch_size": 4, "seq_len": 32, "steps": 6,
            "warmup_steps": 2, "val_blocks": 4, "progress": False, "out": str(tmp_path / "run"),
            "warmup_timing_steps": 2}


def cli_flags(settings: dict) -> list[str]:
    """Command-line flags for flat config settings (``{"seq_len": 32, "bias": False}`` ->
    ``["--seq-len", "32", "--no-bias"]``)."""
    out = []
    for k, v in settings.items():
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            out.append(flag if v else "--no-" + flag[2:])
        else:
            out += [flag, str(v)]
    return out


def fake_caps(**kw):
    """Device capabilities of a CPU without native BF16 (5.3x slower BF16 matmul); ``kw`` overrides."""
    from memtrain.devices import probe as D

    base = dict(device_type="cpu", name="Test CPU", torch="x", threads=2, native_bf16=False, native_fp16=False,
                tf32=False, bf16_reason="no avx512_bf16/amx_bf16 flag", fp16_reason="no avx512_fp16 flag",
                fused_adamw=True, foreach_adamw=True, sdpa_flash=True, sdpa_mem_efficient=False,
                gemm_fp32_flops=50e9, gemm_bf16_flops=50e9 / 5.3, bf16_slowdown=5.3, fp16_slowdown=4.0,
                gemm_shapes={"fp32": [512, 512, 512], "low_precision": [64, 256, 512]})
    base.update(kw)
    return D.DeviceCaps(**base)


@pytest.fixture
def fresh_probe(monkeypatch):
    """No forced BF16/FP16 answer and no cached probe before and after the test."""
    from memtrain.devices import probe as D

    monkeypatch.delenv(D.FORCE_BF16_ENV, raising=False)
    monkeypatch.delenv(D.FORCE_FP16_ENV, raising=False)
    D._PROBES.clear()
    yield
    D._PROBES.clear()


@pytest.fixture
def one_thread():
    """Tiny models run faster on one thread than on several busy ones (docs/performance.md)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    """A tiny Llama without tokenizer files: GPT-2's vocabulary, so memtrain's BPE reads its data."""
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("tiny-llama")
    transformers.LlamaConfig(vocab_size=50257, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                             eos_token_id=50256, bos_token_id=50256).save_pretrained(d)
    return d



@pytest.fixture
def one_rank_group(tmp_path):
    """A 1-process gloo group: enough to build the distributed wrappers (FSDP2, DDP, DCP) in
    this process, without torchrun."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def tiny_run_state(cfg, batch_index: int = 3):
    """The train state of a tiny GPT run (CPU) for checkpoint tests: model, optimizer, scheduler,
    precision, and a loader position (at ``batch_index``) without data."""
    import torch

    from memtrain.models.gpt import GPT
    from memtrain.techniques import build_optimizer, make_precision
    from memtrain.training.step import TrainState

    class Position:  # the loader's state_dict protocol, without data
        def __init__(self) -> None:
            self.state = {"epoch": 0, "batch_index": batch_index}

        def state_dict(self):
            return dict(self.state)

        def load_state_dict(self, s):
            self.state = dict(s)

    torch.manual_seed(0)
    model = GPT(cfg.model)
    opt = build_optimizer(model, cfg.technique, cfg.train)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    cpu = torch.device("cpu")
    return TrainState(cfg, cpu, model, opt, make_precision("fp32", cpu), model.num_parameters(),
                      scheduler=sched, loader=Position())


@pytest.fixture
def cce_traceable(monkeypatch):
    """A stand-in cut_cross_entropy that imports (a trace never calls it: fake tensors take
    memtrain's _CutCrossEntropyBuffers), and no refusal of it on the CPU: what an estimate or a
    trace of ``--loss-kernel cce`` needs where the library is absent."""
    import importlib.machinery
    import importlib.util
    import sys
    import types

    import memtrain.techniques.loss as loss_mod  # imported here: conftest stays free of memtrain at import

    module = types.ModuleType("cut_cross_entropy")
    module.linear_cross_entropy = lambda *a, **k: pytest.fail("the trace called the library")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cut_cross_entropy", module)
    monkeypatch.setattr(loss_mod, "loss_kernel_refusal", lambda *a: None)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: importlib.machinery.ModuleSpec(name, None)
                        if name == "cut_cross_entropy" else real(name, *a, **k))


@pytest.fixture
def fresh_dynamo():
    """dynamo's caches and counters emptied before and after the test: its graph and recompile
    counts are the test's own, and no compiled frame outlives it."""
    import torch  # imported here: conftest stays light at import
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
