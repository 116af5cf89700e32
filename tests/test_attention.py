"""Attention backends and sliding-window attention: numerics, memory, and refusals."""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch
from torch.nn.attention import SDPBackend

from memtrain.attention.apply import apply_attention, build_attention
from memtrain.attention.kernels import _banded, banded_attention, causal_mask, math_attention, sdpa_attention
from memtrain.config.run import ConfigError, ModelConfig, TechniqueConfig, build_config
from memtrain.metrics import MemoryMeter
from memtrain.models.gpt import GPT
from memtrain.techniques.precision import make_precision

CPU = torch.device("cpu")
TINY = dict(vocab_size=512, d_model=64, n_heads=4, n_layers=4, d_ff=128, max_seq_len=128, dropout=0.0)
# Backends that run on CPU without dropout (mem-efficient, flex and flash-attn do not; see below).
CPU_KINDS = ("math", "sdpa", "flash")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def qkv(b: int = 2, h: int = 3, s: int = 37, d: int = 16, dtype=torch.float32, device=CPU, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(b, h, s, d, generator=g, device=device).to(dtype).requires_grad_() for _ in range(3)]


def run(fn, q, k, v, dropout_p: float = 0.0):
    """Output and (dq, dk, dv) of ``fn`` for a fixed upstream gradient."""
    for t in (q, k, v):
        t.grad = None
    out = fn(q, k, v, dropout_p)
    g = torch.Generator(device=q.device).manual_seed(1)
    out.backward(torch.randn(out.shape, generator=g, device=q.device).to(out.dtype))
    return out.detach(), [t.grad.clone() for t in (q, k, v)]


def assert_same(a, b, atol: float, rtol: float = 0.0) -> None:
    (out_a, grads_a), (out_b, grads_b) = a, b
    torch.testing.assert_close(out_a.float(), out_b.float(), atol=atol, rtol=rtol)
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(ga.float(), gb.float(), atol=atol, rtol=rtol)


def tiny_model(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(**{**TINY, **overrides}))


def applied(model: GPT, attention: str, window=None, precision: str = "fp32", device=CPU) -> GPT:
    apply_attention(model, TechniqueConfig(attention=attention, window=window, precision=precision),
                    device, make_precision(precision, device))
    return model


# --------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("kind", CPU_KINDS)
def test_cpu_backend_matches_math_fp32(kind: str) -> None:
    q, k, v = qkv()
    # fp32: fused kernels reorder the sums (online softmax), so equal to ~1e-6, stated as 1e-5.
    assert_same(run(build_attention(kind), q, k, v), run(math_attention, q, k, v), atol=1e-5)


@pytest.mark.parametrize("kind", CPU_KINDS)
def test_cpu_backend_matches_math_bf16(kind: str) -> None:
    q, k, v = qkv(dtype=torch.bfloat16)
    ref = run(math_attention, *qkv(dtype=torch.float64))
    # bf16 has 8 mantissa bits: both the kernel and the reference are within a few bf16 ulps.
    assert_same(run(build_attention(kind), q, k, v), ref, atol=3e-2, rtol=3e-2)


CASES = [  # (seq, window, block)
    (37, 8, None),   # seq not a multiple of W
    (64, 16, None),  # seq a multiple of W
    (40, 13, 7),     # block smaller than W, neither divides seq
    (33, 1, None),   # W = 1: each token sees only itself
    (50, 20, 5),
    (24, 24, None),  # W == seq: full causal attention
]


@pytest.mark.parametrize("seq,window,block", CASES)
@pytest.mark.parametrize("kernel,backend", [("math", None), ("sdpa", None), ("sdpa", "flash")])
def test_window_matches_masked_reference(seq, window, block, kernel, backend) -> None:
    from torch.nn.attention import SDPBackend

    be = SDPBackend.FLASH_ATTENTION if backend == "flash" else None
    fn = functools.partial(banded_attention, window=window, block=block, kernel=kernel, backend=be)
    q, k, v = qkv(s=seq)
    ref = run(functools.partial(math_attention, window=window), q, k, v)
    assert_same(run(fn, q, k, v), ref, atol=1e-5)
    if window == seq:
        assert_same(ref, run(math_attention, q, k, v), atol=0.0)


@pytest.mark.parametrize("seq,window,block", [(24, 24, 24), (20, 15, 15), (9, 4, 8)])
@pytest.mark.parametrize("kernel", ["math", "sdpa"])
def test_band_computation_when_band_is_wide(seq, window, block, kernel) -> None:
    # banded_attention switches to the dense masked form when the band is no narrower than a
    # full row; the band code itself must still be exact there.
    fn = functools.partial(_banded, window=window, block=block, kernel=kernel, backend=None)
    q, k, v = qkv(s=seq)
    ref = run(functools.partial(math_attention, window=window), q, k, v)
    assert_same(run(fn, q, k, v), ref, atol=1e-5)


def test_window_actually_limits_attention() -> None:
    # A change to key 0 must not reach a query W or more tokens later.
    q, k, v = qkv(s=32)
    fn = functools.partial(banded_attention, window=8)
    with torch.no_grad():
        base = fn(q, k, v, 0.0)
        k2, v2 = k.clone(), v.clone()
        k2[:, :, 0] += 5.0
        v2[:, :, 0] += 5.0
        moved = fn(q, k2, v2, 0.0)
    changed = (moved - base).abs().amax(dim=(0, 1, 3)) > 0
    assert changed[:8].all() and not changed[8:].any()
    assert causal_mask(32, CPU, 8).sum(1).max() == 8


# --------------------------------------------------------------------------- model level
def test_model_loss_sdpa_equals_math() -> None:
    x = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    results = {}
    for kind in ("math", "sdpa", "flash"):
        model = applied(tiny_model(), kind)
        loss = model(x, x)
        loss.backward()
        results[kind] = (loss.detach(), model.blocks[0].attn.qkv.weight.grad.clone())
    for kind in ("sdpa", "flash"):
        torch.testing.assert_close(results[kind][0], results["math"][0], atol=1e-5, rtol=0)
        torch.testing.assert_close(results[kind][1], results["math"][1], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["math", "sdpa", "flash"])
def test_model_loss_with_window_equals_masked_reference(kind: str) -> None:
    x = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    ref = tiny_model()
    for block in ref.blocks:
        block.attn.attn_fn = functools.partial(math_attention, window=16)
    model = applied(tiny_model(), kind, window=16)
    assert model.blocks[0].attn.attn_fn is not math_attention
    full = applied(tiny_model(), "math")(x, x)
    windowed = model(x, x)
    torch.testing.assert_close(windowed, ref(x, x), atol=1e-5, rtol=0)
    assert (windowed - full).abs() > 1e-4  # the window changes the model


@pytest.mark.parametrize("fn", [
    sdpa_attention,  # CPU SDPA runs its math kernel when dropout > 0
    math_attention,
    functools.partial(banded_attention, window=8),
    functools.partial(banded_attention, window=8, kernel="sdpa"),
], ids=["sdpa", "math", "band-math", "band-sdpa"])
def test_dropout_passes_through(fn) -> None:
    q, k, v = qkv(s=32)
    with torch.no_grad():
        clean = fn(q, k, v, 0.0)
        torch.manual_seed(0)
        a = fn(q, k, v, 0.5)
        torch.manual_seed(0)
        b = fn(q, k, v, 0.5)
    assert not torch.allclose(a, clean)  # dropout was applied
    torch.testing.assert_close(a, b)  # and is seeded like the rest of the run


def test_training_step_with_dropout_runs_under_sdpa() -> None:
    model = applied(tiny_model(dropout=0.1), "sdpa", window=16)
    x = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    model.train()
    model(x, x).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_probe_leaves_global_rng_alone() -> None:
    # The probe runs dropout; it must not shift the run's dropout and data streams.
    model = tiny_model(dropout=0.1)
    torch.manual_seed(123)
    applied(model, "sdpa", window=8)
    after_apply = torch.rand(4)
    torch.manual_seed(123)
    torch.testing.assert_close(after_apply, torch.rand(4))


# --------------------------------------------------------------------------- memory
def attention_memory(fn, seq: int) -> tuple[int, int]:
    """(activation bytes held after forward, peak bytes over forward + backward) of one call."""
    meter = MemoryMeter(None)
    q, k, v = qkv(b=1, h=4, s=seq, d=16)
    with meter:
        with meter.phase("forward"):
            out = fn(q, k, v, 0.0)
        held = meter.current()["activations"]
        with meter.phase("backward"):
            out.sum().backward()
    return held, meter.stats().peak_bytes


def test_banded_memory_grows_linearly_while_math_grows_quadratically() -> None:
    window = 32
    for name, fn, lo, hi in [
        ("math", math_attention, 3.5, 4.1),
        ("band-math", functools.partial(banded_attention, window=window), 1.8, 2.2),
        ("band-sdpa", functools.partial(banded_attention, window=window, kernel="sdpa"), 1.8, 2.2),
    ]:
        (held_1, peak_1), (held_2, peak_2) = attention_memory(fn, 256), attention_memory(fn, 512)
        assert lo <= held_2 / held_1 <= hi, (name, held_1, held_2)
        assert lo <= peak_2 / peak_1 <= hi, (name, peak_1, peak_2)
    # At one length the band holds far less than the full matrix, and the SDPA band kernel
    # (fused: no band scores kept) less than the math band.
    band_math = attention_memory(functools.partial(banded_attention, window=window), 512)[1]
    band_sdpa = attention_memory(functools.partial(banded_attention, window=window, kernel="sdpa"), 512)[1]
    assert band_sdpa < band_math and band_math * 4 < attention_memory(math_attention, 512)[1]


def test_sdpa_model_holds_fewer_activations_than_math() -> None:
    x = torch.randint(0, 512, (2, 128), generator=torch.Generator().manual_seed(0))
    held = {}
    for kind in ("math", "sdpa"):
        model = applied(tiny_model(), kind)
        meter = MemoryMeter(model)
        with meter:
            with meter.phase("forward"):
                loss = model(x, x)
            held[kind] = meter.current()["activations"]
            with meter.phase("backward"):
                loss.backward()
    # math keeps (2 x 4 heads x 128 x 128) scores and probabilities per layer; SDPA keeps none.
    assert held["sdpa"] < 0.7 * held["math"], held


# --------------------------------------------------------------------------- refusals
def test_flex_on_cpu_is_refused() -> None:
    with pytest.raises(ConfigError, match="flex needs CUDA.*no backward on cpu"):
        applied(tiny_model(), "flex")


def test_flex_with_dropout_is_refused() -> None:
    # Checked before anything touches the device, so a CUDA device name is enough here.
    with pytest.raises(ConfigError, match="no attention dropout"):
        applied(tiny_model(dropout=0.1), "flex", device=torch.device("cuda"))


def test_flash_attn_on_cpu_is_refused() -> None:
    with pytest.raises(ConfigError, match="flash-attn needs CUDA"):
        applied(tiny_model(), "flash-attn")


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash_attn is installed")
def test_flash_attn_missing_says_how_to_install() -> None:
    with pytest.raises(ConfigError, match="pip install flash-attn"):
        applied(tiny_model(), "flash-attn", device=torch.device("cuda"))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 16])
def test_mem_efficient_on_cpu_is_refused(precision: str, window) -> None:
    dt = "float32" if precision == "fp32" else "bfloat16"
    with pytest.raises(ConfigError, match=f"--attention mem-efficient cannot run on cpu with {dt}.*use --attention sdpa") as err:
        applied(tiny_model(), "mem-efficient", window=window, precision=precision)
    assert "\n" not in str(err.value)


def test_flash_with_dropout_on_cpu_is_refused() -> None:
    with pytest.raises(ConfigError, match="flash cannot run on cpu with float32 and dropout 0.1.*non-zero dropout"):
        applied(tiny_model(dropout=0.1), "flash")


def test_refused_backend_leaves_model_unchanged() -> None:
    model = tiny_model()
    with pytest.raises(ConfigError):
        applied(model, "mem-efficient")
    assert all(b.attn.attn_fn is math_attention for b in model.blocks)


def test_window_larger_than_seq_is_rejected_by_config() -> None:
    with pytest.raises(ConfigError, match="--window 65 is larger than --seq-len 64"):
        build_config(dict(TINY, seq_len=64, window=65, attention="sdpa"))


# --------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", ["sdpa", "flash", "mem-efficient", "flex", "flash-attn"])
@pytest.mark.parametrize("window", [None, 64])
def test_cuda_backend_matches_math(kind: str, window) -> None:
    if kind == "flash-attn" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash_attn not installed")
    if kind == "flash" and window is not None:
        pytest.skip("SDPA's flash kernel takes no mask (refusal tested below)")
    dev = torch.device("cuda")
    q, k, v = qkv(b=2, h=4, s=256, d=64, dtype=torch.bfloat16, device=dev)
    ref = run(functools.partial(math_attention, window=window), *qkv(b=2, h=4, s=256, d=64, dtype=torch.float32, device=dev))
    assert_same(run(build_attention(kind, window), q, k, v), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@needs_cuda
def test_cuda_flash_refusals() -> None:
    cuda = torch.device("cuda")
    with pytest.raises(ConfigError, match="flash cannot run on cuda with float32"):
        applied(tiny_model().to(cuda), "flash", device=cuda)
    with pytest.raises(ConfigError, match="flash cannot run on cuda with bfloat16 and --window 16"):
        applied(tiny_model().to(cuda), "flash", window=16, precision="bf16", device=cuda)


@pytest.mark.gpu
@needs_cuda
def test_cuda_banded_memory_is_linear() -> None:
    dev = torch.device("cuda")
    peaks = []
    for seq in (2048, 4096):
        q, k, v = qkv(b=1, h=8, s=seq, d=64, dtype=torch.bfloat16, device=dev)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        banded_attention(q, k, v, 0.0, window=128).sum().backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
    assert 1.6 <= peaks[1] / peaks[0] <= 2.4, peaks


@pytest.mark.parametrize(("kind", "window", "fn", "keywords"), [
    ("math", None, math_attention, None),
    ("math", 8, banded_attention, {"window": 8, "kernel": "math"}),  # materialized band scores
    ("sdpa", None, sdpa_attention, {"backend": None}),  # PyTorch picks the kernel
    ("sdpa", 8, banded_attention, {"window": 8, "kernel": "sdpa", "backend": None}),
    ("flash", None, sdpa_attention, {"backend": SDPBackend.FLASH_ATTENTION}),
    ("flash", 8, banded_attention, {"window": 8, "kernel": "sdpa", "backend": SDPBackend.FLASH_ATTENTION}),
    ("mem-efficient", None, sdpa_attention, {"backend": SDPBackend.EFFICIENT_ATTENTION}),
])
def test_each_choice_builds_its_own_kernel(kind, window, fn, keywords) -> None:
    """Which kernel --attention and --window name (a row labelled math must materialize the
    scores, one labelled flash must pin flash)."""
    built = build_attention(kind, window)
    if keywords is None:
        assert built is fn
    else:
        assert isinstance(built, functools.partial) and built.func is fn and built.keywords == keywords


def test_the_probe_of_a_window_runs_the_banded_path(monkeypatch) -> None:
    """A window wider than the probe's 16 tokens would take the dense path (W >= seq): the probe
    runs a window of 4, so the band code that training runs is the code proven here."""
    from memtrain.attention import apply as module

    built: list = []
    real = module.build_attention
    monkeypatch.setattr(module, "build_attention", lambda kind, window=None: built.append(window) or real(kind, window))
    module.probe_attention("sdpa", 64, CPU, torch.float32, 16, 0.0)
    assert built == [4]


def test_refusal_advice_names_the_cause() -> None:
    """flash on CPU is refused for its dropout only when there is dropout; the advice for a window
    on CUDA's flash names the kernels that take one."""
    from memtrain.attention.apply import _advice

    assert "no dropout" in _advice("flash", None, CPU, torch.float32, 0.1)
    assert "no dropout" not in _advice("flash", None, CPU, torch.float32, 0.0)
    cuda = torch.device("cuda")
    assert "flex or flash-attn" in _advice("flash", 8, cuda, torch.bfloat16, 0.0)
    assert "--precision bf16 or fp16" in _advice("flash", None, cuda, torch.float32, 0.0)
