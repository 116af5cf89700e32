"""The chunked loss's opt-in float32-epilogue accumulation of the LM-head weight gradient
(``MEMTRAIN_LOSS_FP32_ADDMM=1``: ``torch.addmm(grad_w, g.t(), h, out_dtype=torch.float32, out=grad_w)``).

Its kernel exists on CUDA only (on a CPU ``addmm.dtype`` raises NotImplementedError). On the CPU these
tests check which path is chosen, the operator's shapes and dtypes on the Meta device, and the chunk
loop's wiring with the kernel *emulated* (a float32 matmul of the bf16 operands, which bf16 x bf16
products fit exactly: what the CUDA kernel is documented to compute, not a measurement of it). The
``gpu`` tests check the real kernel's numerics.
"""

from __future__ import annotations

import pytest
import torch

from memtrain.config.run import ConfigError, TechniqueConfig
from memtrain.techniques import loss as loss_module
from memtrain.techniques.loss import FP32_ADDMM_ENV, make_loss_fn

CUDA = torch.device("cuda")


@pytest.fixture
def kernel_present(monkeypatch):
    """The capability probe answers yes (no CUDA here: the selection is what is tested)."""
    monkeypatch.setattr(loss_module, "_fp32_addmm_supported", lambda device: True)
    monkeypatch.delenv(FP32_ADDMM_ENV, raising=False)
    monkeypatch.setattr(loss_module, "FP32_ADDMM", None)


def test_off_by_default_even_where_the_kernel_exists(kernel_present):
    assert not loss_module._fp32_addmm_path(CUDA, torch.bfloat16, fake=False, need_grad_weight=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_opted_in_on_cuda_with_16_bit_operands(kernel_present, monkeypatch, dtype):
    monkeypatch.setenv(FP32_ADDMM_ENV, "1")
    assert loss_module._fp32_addmm_path(CUDA, dtype, fake=False, need_grad_weight=True)


@pytest.mark.parametrize("device,dtype,fake,need_w", [
    (torch.device("cpu"), torch.bfloat16, False, True),  # the kernel is CUDA's
    (CUDA, torch.float32, False, True),  # float32 operands: addmm_ adds without rounding already
    (CUDA, torch.bfloat16, True, True),  # the estimator's fake tensors keep today's buffers
    (CUDA, torch.bfloat16, False, False),  # a frozen head: no weight gradient to add
])
def test_today_s_path_elsewhere(kernel_present, monkeypatch, device, dtype, fake, need_w):
    monkeypatch.setenv(FP32_ADDMM_ENV, "1")
    assert not loss_module._fp32_addmm_path(device, dtype, fake=fake, need_grad_weight=need_w)


def test_a_torch_without_the_kernel_keeps_today_s_path(monkeypatch):
    monkeypatch.setenv(FP32_ADDMM_ENV, "1")
    monkeypatch.setattr(loss_module, "_fp32_addmm_supported", lambda device: False)
    assert not loss_module._fp32_addmm_path(CUDA, torch.bfloat16, fake=False, need_grad_weight=True)


def test_the_module_attribute_overrides_the_environment(kernel_present, monkeypatch):
    monkeypatch.setattr(loss_module, "FP32_ADDMM", True)
    assert loss_module._fp32_addmm_path(CUDA, torch.bfloat16, fake=False, need_grad_weight=True)
    monkeypatch.setenv(FP32_ADDMM_ENV, "1")
    monkeypatch.setattr(loss_module, "FP32_ADDMM", False)
    assert not loss_module._fp32_addmm_path(CUDA, torch.bfloat16, fake=False, need_grad_weight=True)


def test_a_cpu_tensor_is_not_asked_further(monkeypatch):
    """Off CUDA the choice is made from the device alone (no is_fake, which dynamo cannot trace, and no probe)."""
    monkeypatch.setenv(FP32_ADDMM_ENV, "1")
    monkeypatch.setattr(loss_module, "_fp32_addmm_path", lambda *a: pytest.fail("asked past the device"))
    assert not loss_module._uses_fp32_addmm(torch.zeros(2, 2, dtype=torch.bfloat16), torch.bfloat16, True)


def test_the_probe_says_no_on_a_cpu():
    """The real probe, not a mock: the CPU has no ``addmm.dtype`` kernel, and saying so is no error."""
    loss_module._fp32_addmm_supported.cache_clear()
    assert loss_module._fp32_addmm_supported(torch.device("cpu")) is False


@pytest.mark.parametrize("value", ["yes", "true", "2", " 1"])
def test_a_bad_environment_value_is_refused_before_training(monkeypatch, value):
    monkeypatch.setenv(FP32_ADDMM_ENV, value)
    with pytest.raises(ConfigError, match=f"{FP32_ADDMM_ENV}=.*set it to 1"):
        make_loss_fn(TechniqueConfig(loss="chunked"), torch.device("cpu"))
    # The standard loss does not read it.
    make_loss_fn(TechniqueConfig(loss="standard"), torch.device("cpu"))


@pytest.mark.parametrize("value", ["", "0", "1"])
def test_the_accepted_environment_values(monkeypatch, value):
    monkeypatch.setenv(FP32_ADDMM_ENV, value)
    make_loss_fn(TechniqueConfig(loss="chunked"), torch.device("cpu"))


def test_the_operator_on_the_meta_device_adds_into_grad_w_in_place():
    """Shapes and dtypes (torch's Meta kernel): a float32 (V x d) result, written into grad_w itself."""
    v, d, n = 1000, 64, 256
    grad_w = torch.empty((v, d), dtype=torch.float32, device="meta")
    g = torch.empty((n, v), dtype=torch.bfloat16, device="meta")
    h = torch.empty((n, d), dtype=torch.bfloat16, device="meta")
    out = loss_module._addmm_fp32_(grad_w, g, h)
    assert out is grad_w
    assert out.shape == (v, d) and out.dtype == torch.float32
    with pytest.raises(RuntimeError):  # the product's shape must be grad_w's
        loss_module._addmm_fp32_(grad_w, g, h[:, :32])


# ---- the chunk loop's wiring, with the CUDA kernel emulated on the CPU

def _emulated(calls):
    """``grad_w += g.t() @ h`` accumulated in float32 from the bf16 operands, recording them."""
    def addmm_fp32_(grad_w, g, h):
        calls.append((g.clone(), h.clone()))
        return grad_w.add_(g.float().t() @ h.float())
    return addmm_fp32_


def _inputs(n=1024, d=64, v=3000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen).to(torch.bfloat16)
    weight = 0.2 * torch.randn(v, d, generator=gen)
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[::7] = -100
    return hidden, weight, targets


def _relative_error(x, ref):
    return float((x.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("body", ["eager", "fused"])
def test_the_variant_adds_each_chunk_in_float32(monkeypatch, body):
    """Chosen, the variant adds every chunk's product through ``_addmm_fp32_`` (the emulated kernel);
    its grad_w is the float32 sum of the chunks' bf16 operands (to 1e-5 of a float64 sum of the same
    operands), where today's path, rounding each chunk's product to bf16, is 1e-4 or more away."""
    hidden, weight, targets = _inputs()
    chunk = 128
    if body == "fused":  # the CUDA path's bodies, run eagerly on the CPU
        monkeypatch.setattr(loss_module, "_fused_chunk_body", lambda hidden: loss_module._chunk_body)
        monkeypatch.setattr(loss_module, "_compiled_chunk_head", lambda: loss_module._chunk_head)

    def grad_w(variant: bool, calls: list) -> torch.Tensor:
        with monkeypatch.context() as m:
            m.setattr(loss_module, "_uses_fp32_addmm", lambda *a, chosen=variant: chosen)
            m.setattr(loss_module, "_addmm_fp32_", _emulated(calls))
            out = loss_module._chunked_forward(hidden, weight, targets, chunk, torch.bfloat16, True, True)[2]
        assert out is not None
        return out

    calls: list = []
    ours = grad_w(True, calls)
    assert len(calls) == hidden.shape[0] // chunk  # one addmm per chunk
    reference = sum(g.double().t() @ h.double() for g, h in calls)[: weight.shape[0]]
    assert _relative_error(ours, reference) <= 1e-5
    today_calls: list = []
    today = grad_w(False, today_calls)
    assert today_calls == []  # not chosen: today's path, untouched
    assert _relative_error(today, reference) >= 1e-4


def test_the_variant_leaves_the_loss_and_hidden_gradient_alone(monkeypatch):
    hidden, weight, targets = _inputs(n=512)
    runs = []
    for variant in (False, True):
        with monkeypatch.context() as m:
            m.setattr(loss_module, "_uses_fp32_addmm", lambda *a, chosen=variant: chosen)
            m.setattr(loss_module, "_addmm_fp32_", _emulated([]))
            runs.append(loss_module._chunked_forward(hidden, weight, targets, 100, torch.bfloat16, True, True))
    (loss_a, gh_a, _, n_a), (loss_b, gh_b, _, n_b) = runs
    assert torch.equal(loss_a, loss_b) and torch.equal(gh_a, gh_b) and torch.equal(n_a, n_b)


# ---- the real kernel (CUDA)

def _skip_without_kernel():
    if not loss_module._fp32_addmm_supported(CUDA):
        pytest.skip(f"torch {torch.__version__}'s CUDA addmm does not add a bf16 product into a float32 tensor "
                    "(aten addmm.dtype_out); the chunked loss keeps its default accumulation there")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fp32_epilogue_is_tighter_than_a_bf16_product():
    """16 chunks of bf16 operands (Qwen2.5-0.5B's head width, a GPT-2-sized vocabulary slice): the
    kernel's float32 epilogue within 1e-5 of a float64 sum, in place; today's bf16 product added into
    float32 at least 10x further away."""
    _skip_without_kernel()
    gen = torch.Generator(device="cuda").manual_seed(0)
    v, d, n, chunks = 8192, 896, 1024, 16
    ours = torch.zeros((v, d), dtype=torch.float32, device="cuda")
    today = torch.zeros_like(ours)
    reference = torch.zeros((v, d), dtype=torch.float64, device="cuda")
    for _ in range(chunks):
        g = (torch.randn((n, v), generator=gen, device="cuda") / v).to(torch.bfloat16)
        h = torch.randn((n, d), generator=gen, device="cuda").to(torch.bfloat16)
        ptr = ours.data_ptr()
        assert loss_module._addmm_fp32_(ours, g, h).data_ptr() == ptr
        today.add_(g.t() @ h)
        reference += g.double().t() @ h.double()
    ours_err, today_err = _relative_error(ours, reference), _relative_error(today, reference)
    assert ours_err <= 1e-5, ours_err
    assert 10 * ours_err <= today_err, (ours_err, today_err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_chunked_loss_with_the_variant(monkeypatch):
    """The whole loss opted in, as a run sets it (the environment variable), on the compiled CUDA
    body: each chunk goes through the kernel, grad_w is the float32 sum of the operands it was given,
    and the loss and gradients still match the standard loss under bf16 autocast."""
    _skip_without_kernel()
    from memtrain.models.gpt import standard_lm_loss

    monkeypatch.setenv(FP32_ADDMM_ENV, "1")
    calls = []
    real = loss_module._addmm_fp32_

    def recording(grad_w, g, h):
        calls.append((g.clone(), h.clone()))
        return real(grad_w, g, h)

    monkeypatch.setattr(loss_module, "_addmm_fp32_", recording)
    hidden, weight, targets = (x.to(CUDA) for x in _inputs(n=1024, d=64, v=5000))
    grad_w = loss_module._chunked_forward(hidden, weight, targets, 256, torch.bfloat16, True, True)[2]
    assert grad_w is not None and len(calls) == 4
    reference = sum(g.double().t() @ h.double() for g, h in calls)[: weight.shape[0]]
    assert _relative_error(grad_w, reference) <= 1e-5
    fn = make_loss_fn(TechniqueConfig(loss="chunked", loss_chunk=256), CUDA)
    h32, w32 = hidden.float().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, ref = fn(h32, w32, targets), standard_lm_loss(h32, w32, targets)
    torch.testing.assert_close(out, ref.float(), rtol=1e-2, atol=0)
    for o, r in zip(torch.autograd.grad(out, (h32, w32)), torch.autograd.grad(ref, (h32, w32))):
        torch.testing.assert_close(o.float(), r.float(), rtol=0, atol=2e-2 * float(r.abs().max()))
