"""Chunked LM-head loss: same loss and gradients as the standard one, a fraction of its memory."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from memtrain.config.run import ModelConfig, TechniqueConfig
from memtrain.metrics import MemoryMeter
from memtrain.models.gpt import GPT, standard_lm_loss
from memtrain.techniques.loss import apply_loss, chunked_lm_loss


def make_inputs(n: int = 300, d: int = 32, v: int = 1000, seed: int = 0, ignore_every: int = 5):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g).requires_grad_()
    weight = (0.1 * torch.randn(v, d, generator=g)).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    if ignore_every:
        targets[::ignore_every] = -100
    return hidden, weight, targets


def loss_and_grads(fn, hidden, weight, targets):
    loss = fn(hidden, weight, targets)
    gh, gw = torch.autograd.grad(loss, (hidden, weight))
    return loss.detach(), gh, gw


@pytest.mark.parametrize("chunk", [7, 64, 128, 300, 1024])
def test_matches_standard_fp32(chunk):
    hidden, weight, targets = make_inputs()
    ref = loss_and_grads(standard_lm_loss, hidden, weight, targets)
    out = loss_and_grads(functools.partial(chunked_lm_loss, chunk=chunk), hidden, weight, targets)
    assert out[0].dtype == torch.float32
    torch.testing.assert_close(out[0], ref[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(out[1], ref[1], rtol=1e-5, atol=1e-8)  # d loss / d hidden
    torch.testing.assert_close(out[2], ref[2], rtol=1e-5, atol=1e-8)  # d loss / d weight


def test_ignored_positions_get_no_gradient():
    hidden, weight, targets = make_inputs(ignore_every=3)
    loss, gh, _ = loss_and_grads(functools.partial(chunked_lm_loss, chunk=50), hidden, weight, targets)
    ignored = targets == -100
    assert torch.all(gh[ignored] == 0) and torch.all(gh[~ignored].abs().sum(1) > 0)
    # The mean is over the valid targets only.
    per_token = torch.nn.functional.cross_entropy(hidden @ weight.t(), targets, reduction="none")
    torch.testing.assert_close(loss, per_token[~ignored].mean(), rtol=1e-6, atol=0)


def test_gradient_scaled_by_upstream_gradient():
    hidden, weight, targets = make_inputs()
    _, gh1, gw1 = loss_and_grads(functools.partial(chunked_lm_loss, chunk=64), hidden, weight, targets)
    loss = chunked_lm_loss(hidden, weight, targets, chunk=64) * 0.25  # e.g. 1 / grad_accum
    gh, gw = torch.autograd.grad(loss, (hidden, weight))
    torch.testing.assert_close(gh, 0.25 * gh1)
    torch.testing.assert_close(gw, 0.25 * gw1)


def test_second_backward_through_same_graph_is_refused():
    hidden, weight, targets = make_inputs()
    loss = chunked_lm_loss(hidden, weight, targets, chunk=64)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_frozen_weight_and_no_grad():
    hidden, weight, targets = make_inputs()
    ref_loss, ref_gh, _ = loss_and_grads(standard_lm_loss, hidden, weight, targets)
    frozen = weight.detach()  # e.g. under LoRA the LM head is frozen
    loss = chunked_lm_loss(hidden, frozen, targets, chunk=64)
    (gh,) = torch.autograd.grad(loss, (hidden,))
    torch.testing.assert_close(gh, ref_gh, rtol=1e-5, atol=1e-8)
    with torch.no_grad():
        torch.testing.assert_close(chunked_lm_loss(hidden, weight, targets, chunk=64), ref_loss, rtol=1e-6, atol=0)


def test_bf16_autocast_close_to_standard():
    hidden, weight, targets = make_inputs(n=256, d=64, v=2000)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = loss_and_grads(standard_lm_loss, hidden, weight, targets)
        out = loss_and_grads(functools.partial(chunked_lm_loss, chunk=64), hidden, weight, targets)
    # Gradients come back in the inputs' dtype (float32 master weights), the loss in float32.
    assert out[0].dtype == out[1].dtype == out[2].dtype == torch.float32
    # Both compute bf16 logits and float32 softmax statistics; differences are bf16 rounding
    # of the gradient matmuls (chunked sums chunk results in float32).
    torch.testing.assert_close(out[0], ref[0], rtol=1e-4, atol=0)
    for o, r in zip(out[1:], ref[1:]):
        torch.testing.assert_close(o, r, rtol=0, atol=1e-2 * float(r.abs().max()))
    # And both are close to the float32 answer.
    exact = loss_and_grads(standard_lm_loss, hidden, weight, targets)
    torch.testing.assert_close(out[0], exact[0], rtol=1e-2, atol=0)


def test_bf16_inputs_give_bf16_gradients():
    hidden, weight, targets = make_inputs()
    h, w = hidden.detach().bfloat16().requires_grad_(), weight.detach().bfloat16().requires_grad_()
    loss, gh, gw = loss_and_grads(functools.partial(chunked_lm_loss, chunk=64), h, w, targets)
    ref = loss_and_grads(standard_lm_loss, h, w, targets)
    assert gh.dtype == gw.dtype == torch.bfloat16
    torch.testing.assert_close(loss, ref[0], rtol=1e-2, atol=0)


def test_tied_model_end_to_end():
    cfg = ModelConfig(vocab_size=512, d_model=64, n_heads=4, n_layers=2, d_ff=128, max_seq_len=64, dropout=0.0)
    torch.manual_seed(0)
    plain = GPT(cfg)
    chunked = copy.deepcopy(plain)
    apply_loss(chunked, TechniqueConfig(loss="chunked", loss_chunk=48), torch.device("cpu"))
    assert chunked.lm_head.weight is chunked.wte.weight
    x = torch.randint(0, 512, (3, 50))
    y = torch.randint(0, 512, (3, 50))
    y[:, :5] = -100
    losses = []
    for m in (plain, chunked):
        loss = m(x, y)
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    for (name, p), q in zip(plain.named_parameters(), chunked.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
    # The tied weight received both the LM-head and the embedding contributions.
    head_only = torch.autograd.grad(
        standard_lm_loss(plain.hidden_states(x).detach().reshape(-1, 64), plain.lm_head.weight, y.reshape(-1)),
        plain.lm_head.weight,
    )[0]
    embedding_part = chunked.wte.weight.grad - head_only
    seen = torch.zeros(512, dtype=torch.bool)
    seen[x.unique()] = True
    assert embedding_part[seen].abs().max() > 1e-5
    assert embedding_part[~seen].abs().max() < 1e-7


def test_apply_loss_selects_function():
    cfg = ModelConfig(vocab_size=512, d_model=64, n_heads=4, n_layers=1, d_ff=128, max_seq_len=64)
    model = GPT(cfg)
    apply_loss(model, TechniqueConfig(loss="standard"), torch.device("cpu"))
    assert model.loss_fn is standard_lm_loss
    apply_loss(model, TechniqueConfig(loss="chunked", loss_chunk=96), torch.device("cpu"))
    assert model.loss_fn.func is chunked_lm_loss and model.loss_fn.keywords == {"chunk": 96}


def _loss_memory(fn, hidden, weight, targets):
    head = torch.nn.Module()
    head.weight = torch.nn.Parameter(weight.detach().clone())
    meter = MemoryMeter(head)
    with meter:
        with meter.phase("forward"):
            loss = fn(hidden, head.weight, targets)
        with meter.phase("backward"):
            loss.backward()
    return meter.stats()


def test_memory_on_gpt2_vocabulary():
    """Default vocabulary 50257, d_model 256, 4 x 256 tokens: the logits dominate."""
    n, d, v = 4 * 256, 256, 50257
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, d, generator=g).requires_grad_()
    weight = 0.02 * torch.randn(v, d, generator=g)
    targets = torch.randint(0, v, (n,), generator=g)
    std = _loss_memory(standard_lm_loss, hidden, weight, targets)
    hidden.grad = None
    chk = _loss_memory(functools.partial(chunked_lm_loss, chunk=256), hidden, weight, targets)

    def act_temp(s):
        return s.by_category["activations"] + s.by_category["temporaries"]

    params = std.by_category["parameters"]
    print(
        f"\nstandard: peak {std.peak_bytes / 2**20:.1f} MiB, activations+temporaries {act_temp(std) / 2**20:.1f} MiB"
        f"\nchunked(256): peak {chk.peak_bytes / 2**20:.1f} MiB, activations+temporaries {act_temp(chk) / 2**20:.1f} MiB"
        f"\nratio activations+temporaries {act_temp(chk) / act_temp(std):.3f}, "
        f"ratio peak-minus-weights {(chk.peak_bytes - params) / (std.peak_bytes - params):.3f}"
    )
    # Measured: 51.3 / 589 MiB (0.087). The float32 grad_weight the chunked loss builds in
    # forward is counted as a gradient; with it (peak minus weights) the ratio is 0.17.
    assert act_temp(chk) <= 0.15 * act_temp(std)
    assert chk.peak_bytes - params <= 0.25 * (std.peak_bytes - params)
    # The standard loss holds at least two full float32 (N x V) buffers at its peak.
    assert act_temp(std) >= 2 * n * v * 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_chunked_matches_standard():
    from memtrain.techniques.loss import make_loss_fn

    dev = torch.device("cuda")
    fn = make_loss_fn(TechniqueConfig(loss="chunked", loss_chunk=128), dev)  # memtrain's kernel (the default)
    hidden, weight, targets = (t.to(dev) for t in make_inputs(n=1000, d=64, v=5000))
    hidden, weight = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    ref = loss_and_grads(standard_lm_loss, hidden, weight, targets)
    out = loss_and_grads(fn, hidden, weight, targets)
    torch.testing.assert_close(out[0], ref[0], rtol=1e-4, atol=0)
    for o, r in zip(out[1:], ref[1:]):
        torch.testing.assert_close(o, r, rtol=0, atol=1e-3 * float(r.abs().max()))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref = loss_and_grads(standard_lm_loss, hidden, weight, targets)
        out = loss_and_grads(fn, hidden, weight, targets)
    torch.testing.assert_close(out[0], ref[0], rtol=1e-2, atol=0)
    for o, r in zip(out[1:], ref[1:]):
        torch.testing.assert_close(o.float(), r.float(), rtol=0, atol=2e-2 * float(r.abs().max()))

