"""Optimizers: each one trains; low-bit and factored state is as small as claimed.

torchao's low-bit optimizers compile their per-parameter update with Inductor on first use;
on a 2-core CPU a cold compile costs tens of seconds per distinct parameter shape. These tests
run the same update eagerly (``eager_torchao``): the arithmetic and the quantized state are
torchao's; only the kernel fusion is skipped.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

from memtrain.config.run import ConfigError, ModelConfig, TechniqueConfig, TrainConfig
from memtrain.metrics import MemoryMeter, optimizer_state_bytes, state_bytes_per_param
from memtrain.models.gpt import GPT
from memtrain.techniques.optim import LowBitSkipWarning, build_optimizer, low_bit_skipped

SMALL = ModelConfig(vocab_size=256, d_model=64, n_heads=4, n_layers=1, d_ff=128, max_seq_len=64, dropout=0.0)


@pytest.fixture
def eager_torchao(monkeypatch):
    """Run torchao's optimizer update without torch.compile (see the module docstring)."""
    monkeypatch.setattr(torch, "compile", lambda fn=None, **kw: fn)


def _batch(vocab: int, b: int = 4, t: int = 32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (b, t), generator=g)
    return x, torch.randint(0, vocab, (b, t), generator=g)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, vocab: int) -> list[float]:
    x, y = _batch(vocab)
    losses = []
    for _ in range(steps):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("name", ["adamw", "adamw-foreach", "adamw-fused", "adafactor", "adamw-8bit", "adamw-4bit", "sgd"])
def test_each_optimizer_reduces_loss(name, eager_torchao):
    torch.manual_seed(0)
    model = GPT(SMALL)
    opt = build_optimizer(model, TechniqueConfig(optim=name), TrainConfig(lr=1e-2, weight_decay=0.0))
    losses = _train(model, opt, 4, SMALL.vocab_size)
    assert losses[-1] < losses[0] - 0.05, losses


def test_optimizer_classes():
    model = GPT(SMALL)
    built = {n: build_optimizer(model, TechniqueConfig(optim=n), TrainConfig())
             for n in ("adamw", "adamw-foreach", "adamw-fused", "adafactor", "adamw-8bit", "adamw-4bit", "sgd")}
    assert built["adamw"].defaults["foreach"] is False
    assert built["adamw-foreach"].defaults["foreach"] is True
    assert built["adamw-fused"].defaults["fused"] is True
    assert isinstance(built["adafactor"], torch.optim.Adafactor)
    assert type(built["adamw-8bit"]).__name__ == "AdamW8bit" and built["adamw-8bit"].block_size == 256
    assert type(built["adamw-4bit"]).__name__ == "AdamW4bit" and built["adamw-4bit"].block_size == 128
    # Decay on matrices only.
    decayed = {id(p) for p in built["adamw"].param_groups[0]["params"]}
    assert id(model.wte.weight) in decayed and id(model.ln_f.weight) not in decayed


def test_fused_and_foreach_match_plain_adamw():
    """Same maths, different kernels: parameters agree to 1e-5 after 3 steps at lr 1e-3,
    while each step moves them by about 1e-3."""
    torch.manual_seed(0)
    base = GPT(SMALL)
    models = {}
    for name in ("adamw", "adamw-foreach", "adamw-fused"):
        m = copy.deepcopy(base)
        _train(m, build_optimizer(m, TechniqueConfig(optim=name), TrainConfig(lr=1e-3)), 3, SMALL.vocab_size)
        models[name] = m
    moved = max((a - b).abs().max().item() for a, b in zip(base.parameters(), models["adamw"].parameters()))
    assert moved > 1e-3
    for name in ("adamw-foreach", "adamw-fused"):
        diff = max((a - b).abs().max().item() for a, b in zip(models["adamw"].parameters(), models[name].parameters()))
        assert diff < 1e-5, (name, diff)


def test_adamw_state_bytes_exact():
    """Two FP32 moments per parameter plus one FP32 step counter per tensor."""
    model = GPT(SMALL)
    opt = build_optimizer(model, TechniqueConfig(optim="adamw"), TrainConfig())
    assert optimizer_state_bytes(opt) == 0  # state is created by the first step
    _train(model, opt, 1, SMALL.vocab_size)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    assert optimizer_state_bytes(opt) == 8 * n + 4 * len(params)
    assert state_bytes_per_param(opt, model) == pytest.approx(8.0, abs=0.01)


def _mlp() -> nn.Module:
    # Matrices of 512 x 512: above torchao's 4096-element floor and a multiple of both blocks.
    return nn.Sequential(nn.Linear(512, 512, bias=False), nn.GELU(), nn.Linear(512, 512, bias=False))


@pytest.mark.parametrize("name,bits,block", [("adamw-8bit", 8, 256), ("adamw-4bit", 4, 128)])
def test_low_bit_state_fraction(name, bits, block, eager_torchao):
    """8-bit state is ~1/4 of AdamW's and 4-bit ~1/8; the exact fraction adds one FP32 scale
    per block per moment (+1.6% at 8-bit/256, +6.3% at 4-bit/128). Tolerance: 2% of that."""
    torch.manual_seed(0)
    x = torch.randn(8, 512)
    measured = {}
    for optim in ("adamw", name):
        model = _mlp()
        opt = build_optimizer(model, TechniqueConfig(optim=optim), TrainConfig())
        model(x).square().mean().backward()
        opt.step()
        measured[optim] = optimizer_state_bytes(opt)
        # The tracked meter's optimizer category sees the same storages.
        with MemoryMeter(model, opt) as meter:
            assert meter.current()["optimizer"] == pytest.approx(measured[optim], rel=0.01)
        if optim == name:
            assert type(opt.state[model[0].weight]["exp_avg"]).__name__ == f"OptimState{bits}bit"
    expected = (bits / 8 + 4 / block) / 4
    assert measured[name] / measured["adamw"] == pytest.approx(expected, rel=0.02)


def test_skip_warning_for_gpt2_vocabulary():
    """50257 x 64 is not a multiple of 256 (nor 128): the embedding would keep FP32 state."""
    odd = ModelConfig(vocab_size=50257, d_model=64, n_heads=4, n_layers=1, d_ff=128, max_seq_len=16, dropout=0.0)
    model = GPT(odd)
    assert low_bit_skipped(model, 256) == [("wte.weight", (50257, 64))]
    for optim in ("adamw-8bit", "adamw-4bit"):
        with pytest.warns(LowBitSkipWarning, match=r"wte\.weight.*--vocab-multiple 64 \(pads 50257 to 50304"):
            build_optimizer(model, TechniqueConfig(optim=optim), TrainConfig())
    padded = GPT(ModelConfig(**{**odd.__dict__, "vocab_multiple": 64}))
    with warnings.catch_warnings():
        warnings.simplefilter("error", LowBitSkipWarning)
        build_optimizer(padded, TechniqueConfig(optim="adamw-8bit"), TrainConfig())
    # Plain AdamW has no block size: no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error", LowBitSkipWarning)
        build_optimizer(model, TechniqueConfig(optim="adamw"), TrainConfig())


def test_odd_vocabulary_loses_the_saving(eager_torchao):
    """What the warning is about, measured: with vocabulary 50257 the 8-bit optimizer's state
    is still ~8 bytes/param (the embedding dominates); padded to 50304 it is ~2."""
    per_param = {}
    for multiple in (1, 64):
        cfg = ModelConfig(vocab_size=50257, vocab_multiple=multiple, d_model=64, n_heads=4, n_layers=1,
                          d_ff=128, max_seq_len=16, dropout=0.0)
        torch.manual_seed(0)
        model = GPT(cfg)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", LowBitSkipWarning)
            opt = build_optimizer(model, TechniqueConfig(optim="adamw-8bit"), TrainConfig())
        x, y = _batch(50257, b=2, t=16)
        model(x, y).backward()
        opt.step()
        per_param[multiple] = state_bytes_per_param(opt, model)
    assert per_param[1] > 7.0
    assert per_param[64] < 2.2


def test_adafactor_state_is_factored():
    """For an (m x n) matrix Adafactor keeps a row and a column average: m + n values."""
    model = GPT(SMALL)
    opt = build_optimizer(model, TechniqueConfig(optim="adafactor"), TrainConfig())
    _train(model, opt, 1, SMALL.vocab_size)
    for p in model.parameters():
        state = opt.state[p]
        values = sum(v.numel() for k, v in state.items() if k != "step")
        if p.dim() == 2:
            m, n = p.shape
            assert values == m + n, (tuple(p.shape), {k: tuple(v.shape) for k, v in state.items()})
        else:
            assert values == p.numel()
    assert state_bytes_per_param(opt, model) < 0.3


def _adafactor_step(relative: bool, lr: float = 3e-4) -> tuple[torch.Tensor, torch.Tensor]:
    """One Adafactor step on a GPT-sized matrix (weights with RMS 0.02): (weight before, change)."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(256, 128) * 0.02)
    opt = build_optimizer(nn.ParameterList([w]), TechniqueConfig(optim="adafactor", adafactor_relative_step=relative),
                          TrainConfig(lr=lr, weight_decay=0.0))
    before = w.detach().clone()
    w.grad = torch.randn_like(w) * 1e-3
    opt.step()
    return before, w.detach() - before


def _rms(t: torch.Tensor) -> float:
    return float(t.pow(2).mean().sqrt())


def test_adafactor_takes_lr_as_the_step_size():
    """Default: the RMS-clipped update moves the weights by --lr (as AdamW's first steps do);
    with --adafactor-relative-step by --lr x RMS(weight), 50x less for RMS 0.02 weights."""
    before, change = _adafactor_step(relative=False)
    assert 0.5 * 3e-4 < _rms(change) <= 3e-4 * 1.0001
    before, rel_change = _adafactor_step(relative=True)
    assert _rms(rel_change) == pytest.approx(_rms(change) * _rms(before), rel=1e-4)


def test_adafactor_matches_the_trainers_adafactor():
    """The Trainer's optim='adafactor': transformers.Adafactor(scale_parameter=False,
    relative_step=False, warmup_init=False) at the same lr. Three steps, same gradients."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ours = nn.Parameter(torch.randn(256, 128) * 0.02)
    theirs = nn.Parameter(ours.detach().clone())
    opt_ours = build_optimizer(nn.ParameterList([ours]), TechniqueConfig(optim="adafactor"),
                               TrainConfig(lr=3e-4, weight_decay=0.0))
    opt_theirs = transformers.Adafactor([theirs], lr=3e-4, scale_parameter=False, relative_step=False,
                                        warmup_init=False, weight_decay=0.0)
    start = ours.detach().clone()
    for step in range(3):
        g = torch.randn(256, 128, generator=torch.Generator().manual_seed(step)) * 1e-3
        ours.grad, theirs.grad = g.clone(), g.clone()
        opt_ours.step()
        opt_theirs.step()
    moved = ours.detach() - start
    assert _rms(moved) > 3e-4  # it did move, by about 3 steps of lr
    torch.testing.assert_close(moved, theirs.detach() - start, rtol=1e-3, atol=1e-8)


def test_optim_block_sets_torchaos_block(eager_torchao):
    """--optim-block reaches torchao (fewer, coarser scales), and the estimator counts it."""
    pytest.importorskip("torchao")
    from memtrain.analysis.estimate import ParamInfo, predicted_optimizer_state as estimated_state

    model = nn.Sequential(nn.Linear(512, 512, bias=False))
    sizes = {}
    for block in (0, 256):
        opt = build_optimizer(model, TechniqueConfig(optim="adamw-4bit", optim_block=block), TrainConfig())
        _train_linear(model, opt)
        sizes[block] = optimizer_state_bytes(opt)
        predicted, _ = estimated_state([ParamInfo("0.weight", (512, 512))], "adamw-4bit", 4, block)
        assert predicted == pytest.approx(sizes[block], rel=0.01)
    # 512 x 512 values, 2 states: 4-bit codes 262,144 B; FP32 scales 16,384 B per 128-block, half per 256.
    assert sizes[0] - sizes[256] == pytest.approx(2 * 4 * 512 * 512 * (1 / 128 - 1 / 256), rel=0.01)


def _train_linear(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(8, 512)
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def test_bnb_rejected_on_cpu():
    with pytest.raises(ConfigError, match=r"adamw-bnb-8bit needs CUDA and `pip install bitsandbytes`; use --optim adamw-8bit"):
        build_optimizer(GPT(SMALL), TechniqueConfig(optim="adamw-bnb-8bit"), TrainConfig())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bnb_on_cuda():
    pytest.importorskip("bitsandbytes")
    model = nn.Sequential(nn.Linear(512, 512, bias=False), nn.GELU(), nn.Linear(512, 512, bias=False)).cuda()
    opt = build_optimizer(model, TechniqueConfig(optim="adamw-bnb-8bit"), TrainConfig())
    x = torch.randn(8, 512, device="cuda")
    model(x).square().mean().backward()
    opt.step()
    assert state_bytes_per_param(opt, model) < 2.5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["adamw-8bit", "adamw-4bit"])
def test_low_bit_compiled_on_cuda(name):
    """The real (compiled) torchao path on a GPU."""
    pytest.importorskip("torchao", reason=f"--optim {name} needs torchao")
    torch.manual_seed(0)
    model = GPT(SMALL).cuda()
    opt = build_optimizer(model, TechniqueConfig(optim=name), TrainConfig(lr=1e-2, weight_decay=0.0))
    x, y = (t.cuda() for t in _batch(SMALL.vocab_size))
    losses = []
    for _ in range(4):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.05


def test_low_bit_state_survives_a_weights_only_checkpoint(tmp_path, eager_torchao):
    """Checkpoints load with weights_only=True; torchao registers its state classes as safe."""
    torch.manual_seed(0)
    model = _mlp()
    opt = build_optimizer(model, TechniqueConfig(optim="adamw-8bit"), TrainConfig())
    model(torch.randn(4, 512)).square().mean().backward()
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    fresh = build_optimizer(model, TechniqueConfig(optim="adamw-8bit"), TrainConfig())
    fresh.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    assert optimizer_state_bytes(fresh) == optimizer_state_bytes(opt)
    a, b = opt.state[model[0].weight]["exp_avg"], fresh.state[model[0].weight]["exp_avg"]
    assert torch.equal(a.dequantize(), b.dequantize())


@pytest.mark.filterwarnings("ignore::memtrain.techniques.optim.LowBitSkipWarning")  # the FP32 state is the point
@pytest.mark.parametrize("name,precision", [("adamw-8bit", "bf16"), ("adamw-4bit", "bf16"),
                                            ("adamw-8bit", "bf16-pure"), ("adamw-4bit", "bf16-pure")])
def test_low_bit_state_of_a_transformers_llama_is_the_estimates(name, precision, eager_torchao, tmp_path):
    """A transformers Llama holds q_proj, k_proj and v_proj (gate_proj and up_proj) as separate
    tensors, and torchao decides per tensor whether it quantizes the state: here the grouped-query
    k_proj and v_proj (32 x 64) are under its 4096-element floor and gate_proj and up_proj
    (137 x 64) are no multiple of its block, so they keep full state. The estimate decided it on the
    fused table entries (q/k/v 128 x 64, gate/up 274 x 64) and came out 6% (8-bit) and 47% (4-bit)
    under the state torchao builds. That full state is ``zeros_like`` the weight: bf16 under
    bf16-pure, where the estimate counted float32 (8-bit: 794,612 bytes against 550,132)."""
    transformers = pytest.importorskip("transformers")
    from memtrain.analysis.estimate.hf import analytic_estimate
    from memtrain.config.run import build_config
    from memtrain.models.families import build_model

    transformers.LlamaConfig(hidden_size=64, intermediate_size=137, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=1000,
                             max_position_embeddings=128).save_pretrained(tmp_path)
    cfg = build_config({"model": str(tmp_path), "optim": name, "precision": precision, "device": "cpu",
                        "batch_size": 1, "seq_len": 16})
    model = build_model(cfg, with_weights=False)
    if precision == "bf16-pure":
        model.to(torch.bfloat16)  # the weights (so the optimizer's full state) in bf16, as prepare_model casts them
    opt = build_optimizer(model, cfg.technique, cfg.train)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    est = analytic_estimate(cfg, "cpu")
    assert est is not None
    assert est.extra["model_state"]["optimizer"] == optimizer_state_bytes(opt)
