"""bf16-pure's AdamW (memtrain.techniques.sr_adamw): torchao's stochastic-rounding update, called
once per bucket of small tensors instead of once per tensor. The same update as torchao's own
step (bit for bit where nothing is rounded stochastically), the same state, one call a bucket."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchao")

from torchao.optim import _AdamW  # noqa: E402
from torchao.optim.adam import single_param_adam  # noqa: E402

from memtrain.techniques.facts import (  # noqa: E402
    SR_ADAMW_ALONE_NUMEL,
    SR_ADAMW_BUCKET_NUMEL,
    sr_adamw_buckets,
    sr_adamw_scratch_numel,
)
from memtrain.techniques.sr_adamw import BucketedSRAdamW  # noqa: E402

# Small LoRA-like tensors, a vector, and one above the bucketing threshold (updated alone).
SHAPES = [(8, 32), (32, 8)] * 6 + [(32,), (SR_ADAMW_ALONE_NUMEL // 512 + 1, 512)]


@pytest.fixture
def eager(monkeypatch):
    """Both optimizers' updates eagerly (a cold CPU compile costs seconds; one test compiles)."""
    monkeypatch.setattr(torch, "compile", lambda fn=None, **kw: fn)


def _params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter((torch.randn(*s, generator=g) * 0.05).to(dtype)) for s in SHAPES]


def _grads(step: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(*s, generator=g) * 1e-2).to(dtype) for s in SHAPES]


def _count_calls(opt: BucketedSRAdamW) -> list[int]:
    calls = [0]
    update = opt._bucket_update

    def counted(*args):
        calls[0] += 1
        return update(*args)

    opt._bucket_update = counted
    return calls


def test_the_buckets_are_filled_in_order_up_to_the_cap():
    small, cap = 1000, SR_ADAMW_BUCKET_NUMEL
    assert sr_adamw_buckets([small] * 4) == [[0, 1, 2, 3]]
    # A tensor above the threshold is left to torchao; so is a bucket of one.
    assert sr_adamw_buckets([small, SR_ADAMW_ALONE_NUMEL + 1, small]) == [[0, 2]]
    assert sr_adamw_buckets([small, SR_ADAMW_ALONE_NUMEL + 1]) == []
    # Filled greedily: a tensor that would overflow the bucket opens the next.
    n = SR_ADAMW_ALONE_NUMEL
    assert sr_adamw_buckets([n, n, n, n, n, small, small]) == [[0, 1, 2, 3], [4, 5, 6]]
    assert sr_adamw_scratch_numel([n, n, n, n, n, small, small]) == 4 * n == cap
    assert sr_adamw_scratch_numel([small]) == 0


def test_fp32_updates_equal_torchaos_per_tensor_step_bit_for_bit(eager):
    """Nothing is rounded stochastically in FP32: every weight, moment and step count equals
    torchao's own step, over steps where one tensor has no gradient (its count lags, so it
    cannot share the bucket's count: it is updated alone)."""
    ours, theirs = _params(torch.float32), _params(torch.float32)
    a = BucketedSRAdamW(ours, lr=1e-2, weight_decay=0.1, bf16_stochastic_round=True)
    b = _AdamW(theirs, lr=1e-2, weight_decay=0.1, bf16_stochastic_round=True)
    calls = _count_calls(a)
    for step in range(4):
        for p, q, grad in zip(ours, theirs, _grads(step, torch.float32)):
            p.grad, q.grad = grad.clone(), grad.clone()
        if step == 1:
            ours[0].grad = theirs[0].grad = None
        a.step()
        b.step()
    # One bucket a step; after step 1 the lagging tensor's count is its own, so torchao updates it.
    assert calls[0] == 4
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a.state[p][key], b.state[q][key]), key
    assert float(a.state[ours[0]]["step"]) == 3 and float(a.state[ours[1]]["step"]) == 4


def test_bf16_weights_round_to_a_neighbour_of_the_fp32_update(eager):
    """Under bf16-pure the FP32 result is rounded up or down at random: each new weight is one
    of the two BF16 values around torchao's FP32 update, the moments equal torchao's, and some
    weights round to the farther one (round-to-nearest never does)."""
    ours, theirs = _params(torch.bfloat16), _params(torch.bfloat16)
    a = BucketedSRAdamW(ours, lr=1e-3, weight_decay=0.1, bf16_stochastic_round=True)
    b = _AdamW(theirs, lr=1e-3, weight_decay=0.1, bf16_stochastic_round=True)
    before = [p.detach().clone() for p in ours]
    for p, q, grad in zip(ours, theirs, _grads(0, torch.bfloat16)):
        p.grad, q.grad = grad.clone(), grad.clone()
    a.step()
    b.step()
    farther = 0
    for p, w, q in zip(ours, before, theirs):
        # torchao's update in FP32, not rounded: the value both roundings bracket
        w32 = w.float()
        m, v = torch.zeros_like(w), torch.zeros_like(w)
        single_param_adam(w32, p.grad.float(), torch.tensor(1.0), m.float(), v.float(), None,
                          torch.tensor(1e-3), 0.9, 0.999, 0.1, 1e-8, True, False)
        bits = w32.view(torch.int32)
        toward_zero = (bits & -65536).view(torch.float32)
        away = ((bits & -65536) + 65536).view(torch.float32)
        got = p.detach().float()
        assert torch.all((got == toward_zero) | (got == away))
        if p.numel() <= SR_ADAMW_ALONE_NUMEL:  # a bucket's (the large tensor is torchao's own)
            farther += int((got != w32.to(torch.bfloat16).float()).sum())
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(a.state[p][key], b.state[q][key]), key
    assert farther > 0


def test_the_step_keeps_gradients_and_torchaos_state_layout(eager):
    """The gradients are back on their tensors after the step (clipping and accumulation read
    them; zero_grad frees them); the state is torchao's, so a checkpoint loads into either."""
    ours = _params(torch.bfloat16)
    a = BucketedSRAdamW(ours, lr=1e-3, bf16_stochastic_round=True)
    grads = _grads(0, torch.bfloat16)
    for p, grad in zip(ours, grads):
        p.grad = grad
    a.step()
    assert all(p.grad is g for p, g in zip(ours, grads))
    theirs = _params(torch.bfloat16)
    b = _AdamW(theirs, lr=1e-3, bf16_stochastic_round=True)
    b.load_state_dict(a.state_dict())
    fresh = BucketedSRAdamW(_params(torch.bfloat16), lr=1e-3, bf16_stochastic_round=True)
    fresh.load_state_dict(b.state_dict())
    for i, p in enumerate(ours):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(b.state_dict()["state"][i][key], a.state[p][key])
            assert torch.equal(fresh.state_dict()["state"][i][key], a.state[p][key])


def test_the_compiled_bucket_update_equals_the_eager_one():
    """The real path: one compiled call (dynamic length) per bucket, equal to the eager update."""
    shapes = [(4, 16), (16, 4), (4, 16), (16, 4), (8,)]
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(*s, generator=g) * 0.05 for s in shapes]
    grads = [torch.randn(*s, generator=g) * 1e-2 for s in shapes]
    out = []
    for compiled in (True, False):
        params = [torch.nn.Parameter(t.clone()) for t in base]
        opt = BucketedSRAdamW(params, lr=1e-2, weight_decay=0.1, bf16_stochastic_round=True)
        if not compiled:
            opt._bucket_update = single_param_adam
        for _ in range(2):
            for p, grad in zip(params, grads):
                p.grad = grad.clone()
            opt.step()
        out.append(params)
    for p, q in zip(*out):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_a_strided_moment_is_left_to_torchaos_step_not_lost(eager):
    """The buckets copy the moments back through views; a state loaded with other strides
    (``load_state_dict`` keeps them) would take the copy-back into a reshaped copy. Such a tensor
    is updated by torchao's own step: the result equals torchao's."""
    ours, theirs = _params(torch.float32), _params(torch.float32)
    a = BucketedSRAdamW(ours, lr=1e-2, bf16_stochastic_round=True)
    b = _AdamW(theirs, lr=1e-2, bf16_stochastic_round=True)
    for step in range(2):
        for p, q, grad in zip(ours, theirs, _grads(step, torch.float32)):
            p.grad, q.grad = grad.clone(), grad.clone()
        a.step()
        b.step()
        if step == 0:
            moment = a.state[ours[0]]["exp_avg"]
            a.state[ours[0]]["exp_avg"] = moment.t().contiguous().t()  # same values, column-major
            assert not a.state[ours[0]]["exp_avg"].is_contiguous()
    assert a.updated_alone == 2  # the strided tensor and the large one
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)
        assert torch.equal(a.state[p]["exp_avg"], b.state[q]["exp_avg"])
