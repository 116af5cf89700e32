"""``--loss-kernel liger|cce``: a library's fused linear cross-entropy instead of memtrain's own
chunked loss. Neither library runs off CUDA, so these tests check what memtrain does around them:
which kernel runs when, the one-line refusals, the estimate's note, and how the Cut Cross-Entropy
adapter calls the library (a stand-in records the call); the GPU test compares the real kernel
with the standard loss."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import memtrain.techniques.loss as loss_mod
from memtrain.config.run import ConfigError, TechniqueConfig
from memtrain.models.gpt import standard_lm_loss

KERNELS = {"liger": "_liger_loss", "cce": "_cce_loss"}  # --loss-kernel -> the loss module's maker
SIXTEEN_BIT = {"liger": "fp32", "cce": "bf16"}  # a precision each kernel accepts


def make_inputs(n: int = 40, d: int = 16, v: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g).requires_grad_()
    weight = (0.1 * torch.randn(v, d, generator=g)).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::7] = -100
    return hidden, weight, targets


@pytest.fixture
def kernels_installed(monkeypatch):
    """importlib finds liger_kernel, cut_cross_entropy and triton (none is installed here); nothing
    imports them."""
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name in ("liger_kernel", "cut_cross_entropy", "triton"):
            return importlib.machinery.ModuleSpec(name, None)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_a_library_kernel_runs_only_when_asked_for(kernel, kernels_installed, monkeypatch):
    """memtrain's own chunked loss is the default on every device, the libraries installed or not
    (it was the faster one on an H100 against Liger's); --loss-kernel K runs K's kernel on CUDA,
    outside the compiled graph, and is refused elsewhere in one line."""
    def stand_in(*own):  # Liger's maker takes memtrain's loss (its fake-tensor path), CCE's nothing
        def loss(hidden, weight, targets):
            return torch.zeros(())
        return loss

    monkeypatch.setattr(loss_mod, KERNELS[kernel], stand_in)
    h, w, t = make_inputs()
    precision = SIXTEEN_BIT[kernel]
    default = TechniqueConfig(loss="chunked", precision=precision)
    chosen = TechniqueConfig(loss="chunked", loss_kernel=kernel, precision=precision)
    assert loss_mod.make_loss_fn(default, torch.device("cuda"))(h, w, t).item() > 0.0  # memtrain's
    fn = loss_mod.make_loss_fn(chosen, torch.device("cuda"))
    assert fn(h, w, t).item() == 0.0  # the library's
    assert getattr(fn, "_torchdynamo_disable", False)  # torch.compiler.disable's mark: not traced
    with pytest.raises(ConfigError, match=f"--loss-kernel {kernel} runs on CUDA only"):
        loss_mod.make_loss_fn(chosen, torch.device("cpu"))
    monkeypatch.undo()
    package = {"liger": ("liger_kernel", "liger-kernel"), "cce": ("cut_cross_entropy", "cut-cross-entropy")}[kernel]
    if importlib.util.find_spec(package[0]) is None:
        with pytest.raises(ConfigError, match=f"needs {package[0]}.*pip install {package[1]}"):
            loss_mod.make_loss_fn(chosen, torch.device("cuda"))


def test_a_kernel_that_does_not_import_is_one_line(kernels_installed, monkeypatch):
    """Found by importlib but failing to import: the error names the import that shows why."""
    monkeypatch.setattr(loss_mod, "_cce_loss", lambda *a: None)
    with pytest.raises(ConfigError, match="cut_cross_entropy is installed but does not import.*import cut_cross_entropy"):
        loss_mod.make_loss_fn(TechniqueConfig(loss="chunked", loss_kernel="cce", precision="bf16"), torch.device("cuda"))


def test_loss_kernel_is_checked_with_the_config():
    """An unknown kernel, a kernel for a loss that has none, or Cut Cross-Entropy (16-bit only)
    under a 32-bit precision is one line that says what to change, on any device."""
    with pytest.raises(ConfigError, match="unknown --loss-kernel 'cut'; choose one of memtrain, liger, cce"):
        TechniqueConfig(loss="chunked", loss_kernel="cut")
    with pytest.raises(ConfigError, match="picks the kernel of --loss chunked; add --loss chunked"):
        TechniqueConfig(loss="standard", loss_kernel="liger")
    for precision in ("fp32", "tf32"):
        with pytest.raises(ConfigError, match=f"--loss-kernel cce computes in 16 bits .* not under --precision "
                                              f"{precision}: add --precision bf16"):
            TechniqueConfig(loss="chunked", loss_kernel="cce", precision=precision)
    for precision in ("bf16", "fp16", "bf16-pure", "fp8"):  # fp8 computes the LM head in bf16
        TechniqueConfig(loss="chunked", loss_kernel="cce", precision=precision)
    TechniqueConfig(loss="chunked", loss_kernel="liger", precision="fp32")


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_train_refuses_a_library_kernel_off_cuda(kernel, tmp_path, capsys):
    """The CLI turns the refusal into one error line and a non-zero exit, writing no result."""
    from memtrain.cli import main

    rc = main(["train", "--device", "cpu", "--steps", "1", "--batch-size", "1", "--seq-len", "16", "--d-model", "32",
               "--n-layers", "1", "--n-heads", "2", "--d-ff", "64", "--loss", "chunked", "--loss-kernel", kernel,
               "--precision", SIXTEEN_BIT[kernel], "--no-progress", "--out", str(tmp_path / "run")])
    # One error line (a CPU without native BF16 adds a warning about --precision bf16 before it).
    errors = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("warning:")]
    assert rc != 0 and len(errors) == 1 and f"--loss-kernel {kernel} runs on CUDA only" in errors[0]
    assert not (tmp_path / "run" / "result.json").exists()


@pytest.mark.parametrize("kernel,title", [("liger", "Liger-Kernel"), ("cce", "Cut Cross-Entropy")])
def test_the_estimate_says_when_a_library_kernel_would_run(kernel, title, kernels_installed, capsys):
    """Where a library's kernel would run (--loss-kernel K on CUDA), the estimate says what it
    models for it (memtrain's chunked loss for Liger, CCE's own buffers), in JSON and in text;
    nowhere else, installed or not."""
    from memtrain.cli import main

    base = ["estimate", "--d-model", "64", "--n-layers", "2", "--n-heads", "4", "--vocab-size", "512",
            "--seq-len", "64", "--batch-size", "2", "--precision", "bf16"]
    chosen = ["--loss", "chunked", "--loss-kernel", kernel, "--device-type", "cuda"]
    assert main([*base, *chosen, "--json"]) == 0
    assert title in json.loads(capsys.readouterr().out)["loss_kernel"]
    assert main([*base, *chosen]) == 0
    assert f"note: --loss-kernel {kernel} runs" in capsys.readouterr().out
    for other in (["--loss", "chunked", "--device-type", "cuda"], ["--loss", "standard", "--device-type", "cuda"],
                  ["--loss", "chunked", "--loss-kernel", kernel, "--device-type", "cpu"]):
        assert main([*base, *other, "--json"]) == 0
        assert "loss_kernel" not in json.loads(capsys.readouterr().out)


@pytest.fixture
def recorded_cce(monkeypatch):
    """A stand-in ``cut_cross_entropy`` module: its ``linear_cross_entropy`` records each call
    (the operands' dtypes, whether autocast was on, the keywords) and computes the loss the real one
    documents, ``F.cross_entropy((e @ c.T).float(), targets)``."""
    calls: list[dict] = []

    def linear_cross_entropy(e, c, targets, **kwargs):
        calls.append({"e": e.dtype, "c": c.dtype, "autocast": torch.is_autocast_enabled("cpu"), **kwargs})
        return F.cross_entropy((e @ c.T).float(), targets, ignore_index=kwargs["ignore_index"],
                               reduction=kwargs["reduction"])

    module = types.ModuleType("cut_cross_entropy")
    module.linear_cross_entropy = linear_cross_entropy  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cut_cross_entropy", module)
    return calls


def test_cce_gets_both_operands_in_the_compute_dtype(recorded_cce):
    """Under bf16 autocast the adapter hands Cut Cross-Entropy the hidden states and the head in
    bf16 with autocast off (its kernels take one dtype), ignore index -100, a mean, and no gradient
    filter (exact); the loss comes back float32 and the gradients reach the float32 parameters
    in float32, close to the standard loss's."""
    cce = loss_mod._cce_loss()
    h, w, t = make_inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = cce(h, w, t)
        ref = standard_lm_loss(h, w, t)
    assert recorded_cce == [{"e": torch.bfloat16, "c": torch.bfloat16, "autocast": False, "ignore_index": -100,
                             "reduction": "mean", "filter_eps": None}]
    assert loss.dtype == torch.float32
    gh, gw = torch.autograd.grad(loss, (h, w))
    rh, rw = torch.autograd.grad(ref, (h, w))
    assert gh.dtype == gw.dtype == torch.float32
    torch.testing.assert_close(loss, ref.float(), rtol=1e-2, atol=0)
    torch.testing.assert_close(gw, rw, rtol=0, atol=2e-2 * float(rw.abs().max()))
    torch.testing.assert_close(gh, rh, rtol=0, atol=2e-2 * float(rh.abs().max()))


def _recording_liger(monkeypatch, accum_dtype: bool) -> list[dict]:
    """A stand-in ``liger_kernel.transformers``: its ``LigerFusedLinearCrossEntropyLoss`` records
    how it was built and called; without ``accum_dtype``, the constructor of a Liger before 0.6.2."""
    calls: list[dict] = []

    class LigerFusedLinearCrossEntropyLoss:
        def __init__(self, ignore_index=-100, reduction="mean", accum_dtype=None):
            calls.append({"ignore_index": ignore_index, "reduction": reduction,
                          **({} if accum_dtype is None else {"accum_dtype": accum_dtype})})

        def __call__(self, lin_weight, _input, target):
            calls.append({"weight": lin_weight.dtype, "input": _input.dtype,
                          "autocast": torch.is_autocast_enabled("cpu")})
            return F.cross_entropy((_input @ lin_weight.T).float(), target, ignore_index=-100)

    if not accum_dtype:
        def __init__(self, ignore_index=-100, reduction="mean"):
            calls.append({"ignore_index": ignore_index, "reduction": reduction})

        LigerFusedLinearCrossEntropyLoss.__init__ = __init__  # type: ignore[method-assign]
    module = types.ModuleType("liger_kernel.transformers")
    module.LigerFusedLinearCrossEntropyLoss = LigerFusedLinearCrossEntropyLoss  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", module)
    return calls


@pytest.mark.parametrize("accum_dtype", [True, False])
def test_liger_accumulates_the_heads_gradient_in_float32(accum_dtype, monkeypatch):
    """The adapter hands Liger the head in the 16-bit compute dtype (Liger's mixed-dtype bugs under
    autocast), and Liger accumulates the head's gradient in its weight's dtype: it is asked for
    float32 accumulation, as memtrain's own chunked loss and Liger under autocast with float32
    weights accumulate, where the installed Liger takes accum_dtype. Operands (weight first),
    ignore index -100 and the mean as Liger's module takes them."""
    calls = _recording_liger(monkeypatch, accum_dtype)
    liger = loss_mod._liger_loss(standard_lm_loss)
    assert liger is not None
    h, w, t = make_inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = liger(h, w, t)
    built = {"ignore_index": -100, "reduction": "mean"}
    assert calls == [{**built, **({"accum_dtype": torch.float32} if accum_dtype else {})},
                     {"weight": torch.bfloat16, "input": torch.bfloat16, "autocast": False}]
    assert loss.dtype == torch.float32


def test_cce_under_fake_tensors_makes_its_buffers_and_gradients_of_the_right_shape(recorded_cce):
    """The tracer's fake tensors cannot enter a Triton kernel: _CutCrossEntropyBuffers stands in,
    without calling the library, and gives both gradients the parameters' shapes and dtypes (a
    frozen head gets none)."""
    cce = loss_mod._cce_loss()
    with FakeTensorMode() as mode:
        h, w, t = (mode.from_tensor(x) for x in make_inputs())
        h, w = h.requires_grad_(), w.requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = cce(h, w, t)
        assert loss.dtype == torch.float32 and loss.shape == ()
        gh, gw = torch.autograd.grad(loss, (h, w))
        assert (gh.shape, gh.dtype, gw.shape, gw.dtype) == (h.shape, torch.float32, w.shape, torch.float32)
        frozen = w.detach()
        (gh,) = torch.autograd.grad(cce(h.to(torch.bfloat16), frozen.to(torch.bfloat16), t), (h,))
        assert gh.dtype == torch.float32
    assert recorded_cce == []


def test_cce_under_fake_tensors_keeps_the_valid_index_where_targets_may_be_ignored(recorded_cce):
    """Cut Cross-Entropy drops its int32 index of the valid targets when every target counts and
    keeps it with its saved tensors otherwise (``--loss-on completion``'s prompt tokens): the
    stand-in saves one int32 per target (an upper bound) only when told targets may be ignored."""
    with FakeTensorMode() as mode:
        h, w, t = (mode.from_tensor(x) for x in make_inputs())
        h = h.requires_grad_()
        for ignores, kept in ((False, []), (True, [(torch.int32, (h.shape[0],))])):
            loss = loss_mod._cce_loss(ignores)(h.to(torch.bfloat16), w.to(torch.bfloat16), t)
            node = loss.grad_fn  # the kernel's node (its float32 loss's .float() makes none)
            assert type(node).__name__ == "_CutCrossEntropyBuffersBackward"
            saved = [(x.dtype, tuple(x.shape)) for x in node.saved_tensors if x.dtype == torch.int32]
            assert saved == kept
    assert recorded_cce == []


def test_the_cce_adapter_with_the_librarys_own_torch_implementation_matches_the_standard_loss(monkeypatch):
    """The adapter's call, made on the real package: Cut Cross-Entropy's pure-torch implementation
    (``impl="torch_compile"``, which runs on a CPU where its Triton kernels cannot) takes memtrain's
    arguments and gives the standard loss and its gradients under bf16 autocast, ignored targets
    included. Skipped without the package (and triton, which it imports); the Triton kernels
    themselves are the GPU test's (test_cuda_library_kernel_matches_the_standard_loss)."""
    lib = pytest.importorskip("cut_cross_entropy", reason="needs cut-cross-entropy (and triton)")
    import functools

    monkeypatch.setitem(sys.modules, "cut_cross_entropy", types.SimpleNamespace(
        linear_cross_entropy=functools.partial(lib.linear_cross_entropy, impl="torch_compile")))
    cce = loss_mod._cce_loss()
    h, w, t = make_inputs(n=96, d=32, v=300)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = cce(h, w, t)
        ref = standard_lm_loss(h, w, t)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref.float(), rtol=1e-2, atol=0)
    for got, want in zip(torch.autograd.grad(loss, (h, w)), torch.autograd.grad(ref, (h, w))):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=0, atol=2e-2 * float(want.abs().max()))


def test_cce_is_absent_without_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "cut_cross_entropy", None)  # an import of it raises ImportError
    assert loss_mod._cce_loss() is None


# How far each kernel's gradients may sit from the standard loss's (both under BF16 autocast), as
# (largest element error / largest element, norm of the error / norm): Liger accumulates in FP32.
# Cut Cross-Entropy 25.1.1 adds each vocabulary block's share of the hidden states' gradient into a
# BF16 buffer (cce_backward.py: ``tl_lock_add`` into ``de``, in ``e``'s dtype; the library has no FP32
# option), one rounding per block: 5000 rows in blocks of 128 put single elements 3% of the largest
# away and the whole 1% (a CPU simulation of that accumulation; an H200 measured 3.3% of the largest,
# 58 of 64,000 elements past 2%). A wrong gradient (a missed block, a wrong scale) is off by far more.
_GRAD_TOLERANCE = {"liger": (2e-2, 1e-2), "cce": (8e-2, 3e-2)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernel,module,package", [("cce", "cut_cross_entropy", "cut-cross-entropy"),
                                                   ("liger", "liger_kernel.transformers", "liger-kernel")])
def test_cuda_library_kernel_matches_the_standard_loss(kernel, module, package):
    """Cut Cross-Entropy's kernel (exact: no gradient filter, but BF16 accumulation of the hidden
    states' gradient across vocabulary blocks) and Liger's fused linear cross-entropy (FP32
    accumulation), as memtrain calls them, against the standard loss under bf16 autocast: the
    numerics behind the runbook's loss-kernels timings."""
    pytest.importorskip(module, reason=f"--loss-kernel {kernel} needs {package}")
    dev = torch.device("cuda")
    fn = loss_mod.make_loss_fn(TechniqueConfig(loss="chunked", loss_kernel=kernel, precision="bf16"), dev)
    hidden, weight, targets = (x.to(dev) for x in make_inputs(n=1000, d=64, v=5000))
    hidden, weight = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref = standard_lm_loss(hidden, weight, targets)
        out = fn(hidden, weight, targets)
    torch.testing.assert_close(out, ref.float(), rtol=1e-2, atol=0)
    largest, whole = _GRAD_TOLERANCE[kernel]
    for o, r in zip(torch.autograd.grad(out, (hidden, weight)), torch.autograd.grad(ref, (hidden, weight))):
        o, r = o.float(), r.float()
        torch.testing.assert_close(o, r, rtol=0, atol=largest * float(r.abs().max()))
        assert float((o - r).norm()) <= whole * float(r.norm())


def _kernel_config(kernel: str, **train):
    from memtrain.config.run import build_config

    return build_config({"model": {"n_layers": 2, "d_model": 64, "n_heads": 4, "d_ff": 128, "vocab_size": 1000,
                                   "dropout": 0.0},
                         "train": {"device": "cuda", "batch_size": 2, "seq_len": 32, **train},
                         "technique": {"loss": "chunked", "loss_kernel": kernel, "precision": "bf16",
                                       "attention": "sdpa"}})


@pytest.mark.parametrize("path", ["count", "inventory"])
def test_flops_of_a_library_kernel(path):
    """The FLOP count of a run with a library kernel (Triton: it cannot run where the count does)
    is memtrain's chunked loss's, whose head matmuls are the same, plus Cut Cross-Entropy's second
    logits matmul in its backward as recompute: the MFU numerator (forward + backward) is the same,
    the hardware FLOPs are 2 N d V more. Both the fake-tensor count and the inventory say so."""
    from memtrain.analysis.flops.count import count_step
    from memtrain.analysis.flops.inventory import inventory_step

    step_of = count_step if path == "count" else inventory_step
    own, liger, cce = (step_of(_kernel_config(k, grad_accum=3)) for k in ("memtrain", "liger", "cce"))
    assert not own.notes
    assert liger.table == own.table and liger.counter_flops == own.counter_flops
    assert "--loss-kernel liger: counted as memtrain's chunked loss" in " ".join(liger.notes)
    extra = 2.0 * (2 * 32) * 64 * 1000 * 3  # 2 N d V, three micro-batches
    for phase in ("forward", "backward", "optimizer"):
        assert cce.phase_total(phase) == own.phase_total(phase)
    assert cce.phase_total("recompute") == own.phase_total("recompute") + extra
    assert cce.table["recompute"]["lm_head"].counted == extra
    assert cce.counter_flops == own.counter_flops + extra
    assert "computes the logits again in its backward" in " ".join(cce.notes)


def test_a_library_kernel_run_gets_counted_flops_for_its_mfu():
    """The train loop's MFU numerator for a library-kernel run comes from the count (it fell back to
    the 6ND rule when the count, on CPU, refused the CUDA-only kernel)."""
    from memtrain.analysis.flops.count import counted_flops_per_step
    from memtrain.training.train import _flops_per_rank_step

    cfg = _kernel_config("cce")
    flops, source = _flops_per_rank_step(cfg, 0)
    assert source == "counted"
    c = counted_flops_per_step(cfg)
    assert flops == c["model_flops"] == counted_flops_per_step(_kernel_config("memtrain"))["model_flops"]
    assert c["hardware_flops"] == c["model_flops"] + 2.0 * 64 * 64 * 1000


@pytest.mark.parametrize("kernel,module,name", [("liger", "liger_kernel.transformers", "LigerFusedLinearCrossEntropyLoss"),
                                                ("cce", "cut_cross_entropy", "linear_cross_entropy")])
def test_a_kernel_whose_import_raises_another_error_is_one_line_too(kernel, module, name, kernels_installed,
                                                                     monkeypatch):
    """An installed kernel whose import fails with something other than ImportError (a Triton or
    transformers it does not fit: RuntimeError, AttributeError) is the same one line, not a traceback."""
    def broken(attr):
        raise RuntimeError(f"triton 9 is not supported ({attr})")

    for part in (module.split(".")[0], module):
        stand_in = types.ModuleType(part)
        stand_in.__path__ = []  # a package, so that its submodule resolves from sys.modules
        monkeypatch.setitem(sys.modules, part, stand_in)
    sys.modules[module].__getattr__ = broken  # PEP 562: `from module import name` asks it
    tech = TechniqueConfig(loss="chunked", loss_kernel=kernel, precision=SIXTEEN_BIT[kernel])
    with pytest.raises(ConfigError, match=f"{module} is installed but does not import"):
        loss_mod.make_loss_fn(tech, torch.device("cuda"))
