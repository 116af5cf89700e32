"""Precision modes: autocast dtypes, loss scaling and skipped steps, pure BF16 weights, TF32."""

from __future__ import annotations

import copy

import pytest
import torch

import memtrain.techniques.precision as precision_mod
from memtrain.config.run import ConfigError, ModelConfig, TechniqueConfig, TrainConfig
from memtrain.metrics import MemoryMeter
from memtrain.models.gpt import GPT
from memtrain.techniques.optim import build_optimizer
from memtrain.techniques.precision import make_precision
from memtrain.training.step import train_step

CPU = torch.device("cpu")
SMALL = ModelConfig(vocab_size=256, d_model=64, n_heads=4, n_layers=2, d_ff=128, max_seq_len=64, dropout=0.0)


@pytest.fixture
def eager_torchao(monkeypatch):
    """torchao's optimizers compile their update; a cold CPU compile costs tens of seconds,
    so tests run the same update eagerly."""
    monkeypatch.setattr(torch, "compile", lambda fn=None, **kw: fn)


@pytest.fixture(autouse=True)
def _restore_tf32():
    yield
    make_precision("fp32", CPU)


def _batch(b: int = 4, t: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, SMALL.vocab_size, (b, t), generator=g), torch.randint(0, SMALL.vocab_size, (b, t), generator=g)


def test_bf16_autocast_loss_close_to_fp32():
    torch.manual_seed(0)
    model = GPT(SMALL).eval()
    x, y = _batch()
    fp32 = make_precision("fp32", CPU)
    bf16 = make_precision("bf16", CPU)
    with torch.no_grad():
        with fp32.autocast():
            ref = float(model(x, y))
        with bf16.autocast():
            low = float(model(x, y))
            assert model(x).dtype == torch.bfloat16  # the matmuls really ran in BF16
    assert low != ref
    assert low == pytest.approx(ref, abs=0.02)  # tolerance: 0.02 nats on a loss of ~5.5


def test_fp16_runs_on_cpu():
    prec = make_precision("fp16", CPU)
    assert prec.scaler is not None and prec.scaler.is_enabled()
    torch.manual_seed(0)
    model = GPT(SMALL)
    with prec.autocast():
        assert model(_batch()[0]).dtype == torch.float16
    opt = build_optimizer(model, TechniqueConfig(precision="fp16"), TrainConfig(lr=1e-2, weight_decay=0.0))
    losses = [train_step(model, [_batch()], opt, prec, 1.0, CPU) for _ in range(4)]
    assert losses[-1] < losses[0] - 0.05
    # GradScaler starts at 2**16 and may skip a first step while it finds a scale that fits.
    assert prec.skipped_steps <= 1


def test_fp16_rejected_without_cpu_support(monkeypatch):
    monkeypatch.setattr(precision_mod, "_cpu_fp16_autocast_works", lambda: False)
    with pytest.raises(ConfigError, match="use --precision bf16 on CPU"):
        make_precision("fp16", CPU)


def test_grad_scaler_skips_and_counts_overflowing_step():
    """An inf gradient makes GradScaler skip the step (weights untouched), halve the scale,
    and train_step count it; the next clean step updates the weights again."""
    prec = make_precision("fp16", CPU)
    torch.manual_seed(0)
    model = GPT(SMALL)
    opt = build_optimizer(model, TechniqueConfig(precision="fp16"), TrainConfig(lr=1e-2))
    before = copy.deepcopy(model.state_dict())
    scale = prec.scaler.get_scale()
    hook = model.wpe.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    train_step(model, [_batch()], opt, prec, 1.0, CPU)
    hook.remove()
    assert prec.skipped_steps == 1
    assert prec.scaler.get_scale() == scale / 2
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    train_step(model, [_batch()], opt, prec, 1.0, CPU)
    assert prec.skipped_steps == 1
    assert not torch.equal(before["wpe.weight"], model.wpe.weight)


def test_a_disabled_grad_scaler_steps_and_counts_no_skipped_step():
    """A GradScaler built with enabled=False keeps no found-inf state: the step runs the optimizer
    as a plain one and the skipped-step count stays 0."""
    torch.manual_seed(0)
    model = GPT(SMALL)
    prec = make_precision("fp32", CPU)
    prec.scaler = torch.amp.GradScaler("cpu", enabled=False)
    opt = build_optimizer(model, TechniqueConfig(), TrainConfig(lr=1e-2))
    before = model.wpe.weight.detach().clone()
    train_step(model, [_batch()], opt, prec, 1.0, CPU)
    assert prec.skipped_steps == 0
    assert not torch.equal(before, model.wpe.weight)


def test_fp16_clips_and_logs_the_unscaled_gradient_norm():
    """Under a GradScaler the gradients are unscaled before clipping: the norm clipped and logged
    is the true one (as an FP32 step's), not the loss scale (65536) times it, which would clip
    every step down to almost nothing."""
    torch.manual_seed(0)
    model = GPT(SMALL)
    reference = copy.deepcopy(model)
    reference(*_batch()).backward()
    expected = float(torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]))
    prec = make_precision("fp16", CPU)
    opt = build_optimizer(model, TechniqueConfig(precision="fp16"), TrainConfig(lr=1e-2))
    train_step(model, [_batch()], opt, prec, 1.0, CPU)
    assert float(prec.last_grad_norm) == pytest.approx(expected, rel=0.05)


def test_bf16_pure_halves_parameter_bytes_and_trains(eager_torchao):
    prec = make_precision("bf16-pure", CPU)
    assert prec.param_dtype == torch.bfloat16 and prec.autocast_dtype is None
    torch.manual_seed(0)
    fp32_model = GPT(SMALL)
    model = copy.deepcopy(fp32_model).to(prec.param_dtype)
    with MemoryMeter(fp32_model) as m32, MemoryMeter(model) as m16:
        assert m16.current()["parameters"] * 2 == m32.current()["parameters"]
    tech = TechniqueConfig(precision="bf16-pure")
    opt = build_optimizer(model, tech, TrainConfig(lr=1e-2, weight_decay=0.0))
    assert type(opt).__name__ == "BucketedSRAdamW" and opt.bf16_stochastic_round  # torchao's _AdamW, bucketed
    losses = [train_step(model, [_batch()], opt, prec, 1.0, CPU) for _ in range(4)]
    assert losses[-1] < losses[0] - 0.05
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(g.dtype == torch.bfloat16 for s in opt.state.values() for k, g in s.items() if k != "step")


def test_stochastic_rounding_keeps_small_updates(eager_torchao):
    """Why bf16-pure needs stochastic rounding: Adam's first step moves each weight by about
    lr = 1e-6, far below half the BF16 spacing of any weight with |w| >= 2**-9 (>= 7.6e-6).
    Plain AdamW rounds those updates away; torchao's stochastic rounding keeps them in
    expectation, so some of those weights change."""
    torch.manual_seed(0)
    base = GPT(SMALL).to(torch.bfloat16)
    x, y = _batch()
    changed = {}
    for kind in ("torch", "sr"):
        model = copy.deepcopy(base)
        if kind == "torch":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
        else:
            opt = build_optimizer(model, TechniqueConfig(precision="bf16-pure"), TrainConfig(lr=1e-6, weight_decay=0.0))
        model(x, y).backward()
        opt.step()
        changed[kind] = sum(int(((a != b) & (a.abs() >= 2**-9)).sum()) for a, b in zip(base.parameters(), model.parameters()))
    assert changed["torch"] == 0
    assert changed["sr"] > 100, changed


@pytest.mark.parametrize("optim", ["adamw-fused", "adamw-foreach", "adafactor", "sgd"])
def test_bf16_pure_rejects_optimizers_without_stochastic_rounding(optim):
    with pytest.raises(ConfigError, match="bf16-pure use --optim adamw, adamw-8bit, adamw-4bit"):
        build_optimizer(GPT(SMALL), TechniqueConfig(precision="bf16-pure", optim=optim), TrainConfig())


def test_bf16_pure_low_bit_uses_stochastic_rounding():
    opt = build_optimizer(GPT(SMALL), TechniqueConfig(precision="bf16-pure", optim="adamw-8bit"), TrainConfig())
    assert type(opt).__name__ == "AdamW8bit" and opt.bf16_stochastic_round


def test_tf32_flag_set_and_reset():
    make_precision("tf32", CPU)
    assert torch.backends.cuda.matmul.allow_tf32 is True
    assert torch.get_float32_matmul_precision() == "high"
    make_precision("fp32", CPU)
    assert torch.backends.cuda.matmul.allow_tf32 is False
    assert torch.get_float32_matmul_precision() == "highest"
    make_precision("tf32", CPU)
    make_precision("bf16", CPU)  # any other mode resets it too
    assert torch.backends.cuda.matmul.allow_tf32 is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp16_and_bf16_pure_on_cuda():
    dev = torch.device("cuda")
    for name in ("fp16", "bf16-pure"):
        if name == "bf16-pure":  # its AdamW is torchao's (stochastic rounding)
            pytest.importorskip("torchao", reason="--precision bf16-pure's AdamW needs torchao")
        prec = make_precision(name, dev)
        torch.manual_seed(0)
        model = GPT(SMALL).to(dev, prec.param_dtype)
        opt = build_optimizer(model, TechniqueConfig(precision=name), TrainConfig(lr=1e-2, weight_decay=0.0))
        losses = [train_step(model, [_batch()], opt, prec, 1.0, dev) for _ in range(4)]
        assert losses[-1] < losses[0]
