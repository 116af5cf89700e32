"""What keeps a full-size trace fast, checked without a clock: a traced step dispatches as many
ops for an 8B-wide model as for a tiny one (nothing loops over the weights' values), and the
fake mode never falls back to computing "constants" for real."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("torchao")

import memtrain  # noqa: E402
from memtrain.config.run import build_config  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# Every technique that issues ops per weight or per chunk: LoRA over NF4 base weights (QLoRA),
# checkpointing (recomputation), the chunked loss, AdamW.
TECH = {"lora_rank": 4, "qlora": True, "checkpointing": "full", "loss": "chunked", "loss_chunk": 16,
        "optim": "adamw", "attention": "sdpa", "batch_size": 1, "seq_len": 32, "device": "cpu"}


def _llama(root: Path, name: str, heads: int, ffn: int) -> Path:
    """A 1-layer Llama with head_dim 64: only the width differs between the ones used below."""
    d = root / name
    transformers.LlamaConfig(hidden_size=64 * heads, intermediate_size=ffn, num_attention_heads=heads,
                             num_key_value_heads=heads // 2, num_hidden_layers=1, vocab_size=384,
                             max_position_embeddings=64).save_pretrained(d)
    return d


def _traced_ops(model_dir: Path, monkeypatch) -> tuple[int, dict]:
    """(ops the step issued, memory stats) of one traced training step (the optimizer creates
    its state and steps: every kind of op a step issues). Counted where they enter the fake
    mode, not counting the ops its own decompositions issue (those depend on what its kernel
    cache already holds), nor ``torch.tensor`` literals (``lift_fresh``: some libraries make a
    few once per process)."""
    from memtrain.analysis import trace

    count = [0]
    literal = torch.ops.aten.lift_fresh.default
    make_mode = trace._fake_mode

    def counting_mode():  # type: ignore[no-untyped-def]
        mode = make_mode()

        class Counting(type(mode)):  # type: ignore[misc]
            depth = 0

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                count[0] += Counting.depth == 0 and func is not literal
                Counting.depth += 1
                try:
                    return super().__torch_dispatch__(func, types, args, kwargs)
                finally:
                    Counting.depth -= 1

        mode.__class__ = Counting
        return mode

    monkeypatch.setattr(trace, "_fake_mode", counting_mode)
    stats = trace.trace_step(build_config({"model": str(model_dir), **TECH}), "cpu", steps=1)
    return count[0], stats


def test_a_full_width_trace_dispatches_no_more_ops_than_a_tiny_one(tmp_path, monkeypatch):
    # Llama-3-8B's width (4096 hidden, 14336 FFN): each MLP weight has 58.7M values, 56 of
    # torchao's 1M-value quantization chunks; the tiny one fits in one chunk.
    tiny_ops, tiny = _traced_ops(_llama(tmp_path, "tiny", heads=4, ffn=1024), monkeypatch)
    wide_ops, wide = _traced_ops(_llama(tmp_path, "wide", heads=64, ffn=14336), monkeypatch)
    assert wide["peak_bytes"] > 100 * tiny["peak_bytes"]  # the trace did see the full-width weights
    assert wide_ops == tiny_ops


def test_nf4_quantization_is_the_same_in_one_chunk_as_in_many():
    """The reason a fake weight may be quantized in one chunk: the chunks only bound scratch."""
    from torchao.quantization import to_nf4
    from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor

    from memtrain.models.qlora import NF4_BLOCK, NF4_SCALER_BLOCK

    w = torch.randn(256, 512)
    one = to_nf4(w, NF4_BLOCK, NF4_SCALER_BLOCK)
    saved = nf4_tensor.CHUNK_SIZE
    nf4_tensor.CHUNK_SIZE = 4096  # 32 chunks
    try:
        many = to_nf4(w, NF4_BLOCK, NF4_SCALER_BLOCK)
    finally:
        nf4_tensor.CHUNK_SIZE = saved
    for name in ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean"):
        assert torch.equal(getattr(one, name), getattr(many, name)), name


def test_quantizing_a_fake_weight_runs_one_chunk_and_a_real_one_keeps_torchao_chunks():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor

    from memtrain.models.qlora import _one_chunk_if_fake

    default = nf4_tensor.CHUNK_SIZE
    with FakeTensorMode():
        big = torch.empty(4096, 14336)
    with _one_chunk_if_fake(big):
        assert nf4_tensor.CHUNK_SIZE == big.numel()
    assert nf4_tensor.CHUNK_SIZE == default
    with _one_chunk_if_fake(torch.empty(2048, 1024)):  # real: torchao bounds its scratch
        assert nf4_tensor.CHUNK_SIZE == default


def test_a_trace_keeps_no_fake_constants(tmp_path, monkeypatch):
    """AdamW's ``step`` and ``lr`` are one-element tensors: as fake "constants" every op on them
    ran for real and bypassed the fake-kernel cache (most of a traced optimizer step)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    before = FakeTensorMode.cache_bypasses.get("constant attribute", 0)
    ops, stats = _traced_ops(_llama(tmp_path, "tiny", heads=4, ffn=1024), monkeypatch)
    assert ops > 0 and stats["current_by_category"]["optimizer"] > 0  # AdamW made its state
    assert FakeTensorMode.cache_bypasses.get("constant attribute", 0) == before


# AOTAutograd, its partitioner (networkx) and inductor's decompositions: what only a trace compiled
# under --compile-memory-budget uses. torch._dynamo itself is not among them: torch.compiler's
# set_stance, which every trace enters, and transformers' modeling_utils import it.
COMPILE_ONLY = ("torch._functorch.aot_autograd", "functorch.compile", "torch._inductor.compile_fx", "networkx")


def test_an_eager_trace_does_not_import_the_compiled_trace_machinery():
    """A trace without a compile budget left AOTAutograd and inductor unloaded only since
    memtrain.analysis.trace imports compile_trace where it compiles (it loaded them at import:
    0.3-0.5 s of every traced estimate, docs/performance.md)."""
    code = ("import sys\n"
            "from memtrain.analysis.trace import trace_step\n"
            "from memtrain.config.run import build_config\n"
            "cfg = build_config({'d_model': 32, 'n_heads': 2, 'n_layers': 1, 'vocab_size': 64, 'batch_size': 1, "
            "'seq_len': 8, 'device': 'cpu'})\n"
            "assert trace_step(cfg)['peak_bytes'] > 0\n"
            f"print([m for m in {COMPILE_ONLY!r} if m in sys.modules])\n")
    assert _last_line_printed(code) == "[]"


# What a traced estimate of our GPT needs is torch (and torch._dynamo, which FakeTensorMode imports);
# these it never uses: transformers and peft (models users bring, LoRA on them), datasets and
# pyarrow (data files), matplotlib (plots), scipy (imported by transformers' loss module), torchao
# (low-bit optimizers, NF4), tiktoken (memtrain.data's tokenizer, once reached through the model
# family table: 0.04 s of the command).
TRACE_NEVER = ("transformers", "peft", "datasets", "pyarrow", "matplotlib", "scipy", "torchao", "tiktoken")


def test_a_traced_estimate_of_our_gpt_imports_no_heavy_module_it_does_not_use():
    code = ("import contextlib, io, sys\n"
            "from memtrain.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    assert main(['estimate', '--d-model', '32', '--n-heads', '2', '--n-layers', '1', '--vocab-size', '64',\n"
            "                 '--batch-size', '1', '--seq-len', '8', '--device', 'cpu', '--trace', '--json']) == 0\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {TRACE_NEVER!r}))\n")
    assert _last_line_printed(code) == "[]"


def _last_line_printed(code: str) -> str:
    """The last line ``code`` prints, run in a fresh process (so ``sys.modules`` holds only what it
    imported) against this checkout's memtrain, whatever the environment installs."""
    src = str(Path(memtrain.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]
