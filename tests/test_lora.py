"""LoRA: only adapters train, state shrinks with them, merging reproduces the adapted model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from memtrain.config.run import ConfigError, ModelConfig, TechniqueConfig, TrainConfig, build_config
from memtrain.metrics import optimizer_state_bytes
from memtrain.models.gpt import GPT
from memtrain.techniques import make_precision, prepare_model
from memtrain.techniques.lora import apply_lora, lora_target_names, merge_lora
from memtrain.techniques.optim import build_optimizer

CPU = torch.device("cpu")
CFG = ModelConfig(vocab_size=512, d_model=64, n_heads=4, n_layers=2, d_ff=128, max_seq_len=128, dropout=0.0)
TARGETS = ("qkv", "proj", "fc", "fc_out")


def _lora_model(rank: int = 4, targets: str = "qkv,proj,fc,fc_out", seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(CFG)
    apply_lora(model, TechniqueConfig(lora_rank=rank, lora_alpha=8.0, lora_targets=targets))
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 512, (4, 32), generator=g), torch.randint(0, 512, (4, 32), generator=g)


def _train(model: nn.Module, steps: int = 3, lr: float = 1e-2) -> torch.optim.Optimizer:
    opt = build_optimizer(model, TechniqueConfig(), TrainConfig(lr=lr, weight_decay=0.0))
    x, y = _batch()
    for _ in range(steps):
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return opt


def test_only_adapters_train_and_count_matches_formula():
    rank = 4
    model = _lora_model(rank)
    assert isinstance(model, GPT)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert not model.wte.weight.requires_grad and not model.ln_f.weight.requires_grad
    plain = GPT(CFG)
    expected = sum(
        rank * (lin.in_features + lin.out_features)
        for name, lin in plain.named_modules()
        if isinstance(lin, nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS
    )
    assert sum(p.numel() for p in trainable.values()) == expected == 2 * rank * (64 + 192 + 64 + 64 + 64 + 128 + 128 + 64)


def test_targets_subset():
    model = _lora_model(targets="qkv")
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all(".attn.qkv." in n for n in names)


def test_optimizer_state_scales_with_rank_and_is_small():
    """AdamW state is 8 bytes per trainable parameter: rank 8 doubles rank 4; both are a few
    percent of full fine-tuning."""
    states = {}
    for rank in (4, 8):
        model = _lora_model(rank)
        states[rank] = optimizer_state_bytes(_train(model, steps=1))
    full = GPT(CFG)
    full_state = optimizer_state_bytes(_train(full, steps=1))
    assert states[8] / states[4] == pytest.approx(2.0, rel=0.01)
    assert states[8] < 0.15 * full_state
    assert states[4] < 0.08 * full_state


def test_base_frozen_adapters_learn():
    model = _lora_model()
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    lora_before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    x, y = _batch()
    with torch.no_grad():
        loss0 = float(model(x, y))
    _train(model, steps=5)
    params = dict(model.named_parameters())
    assert all(torch.equal(params[n], v) for n, v in base_before.items())
    assert all(not torch.equal(params[n], v) for n, v in lora_before.items() if ".lora_B." in n)
    with torch.no_grad():
        assert float(model(x, y)) < loss0 - 0.05


def test_merged_model_matches_adapted_logits():
    model = _lora_model()
    _train(model, steps=5)  # B is zero at start: train so the adapters change the output
    model.eval()
    x, _ = _batch()
    with torch.no_grad():
        adapted = model(x)
        merged = merge_lora(model)
        assert type(merged) is GPT
        assert not any("lora" in n for n, _ in merged.named_parameters())
        assert merged.lm_head.weight is merged.wte.weight  # tying survives the copy
        out = merged(x)
    assert (out - adapted).abs().max().item() < 1e-5
    # The adapters mattered (merging them is not a no-op) and the source model is untouched.
    assert not torch.allclose(merged.blocks[0].attn.qkv.weight, model.blocks[0].attn.qkv.base_layer.weight)
    # --lora-alpha reaches peft: the update is scaled by alpha / r (8 / 4), not by peft's own default.
    qkv = model.blocks[0].attn.qkv
    update = 8.0 / 4 * (qkv.lora_B["default"].weight @ qkv.lora_A["default"].weight)
    torch.testing.assert_close(merged.blocks[0].attn.qkv.weight, qkv.base_layer.weight + update)
    assert any("lora" in n for n, _ in model.named_parameters())
    assert set(merged.state_dict()) == set(GPT(CFG).state_dict())


def test_a_bf16_merge_leaves_every_layer_in_bf16():
    """Each layer is merged in FP32 and rounded back to its dtype before the next one: a BF16
    model comes out of the merge in BF16, not as FP32 layers of twice its bytes."""
    from memtrain.techniques.lora import merge_adapters_in_place

    model = _lora_model()
    _train(model, steps=1)
    model.to(torch.bfloat16)
    merge_adapters_in_place(model)
    assert not any("lora" in n for n, _ in model.named_parameters())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("targets", ["qkv,mlp", "attn", ""])
def test_invalid_targets_rejected(targets):
    with pytest.raises(ConfigError, match="choose from fc, fc_out, proj, qkv"):
        apply_lora(GPT(CFG), TechniqueConfig(lora_rank=4, lora_targets=targets))


def test_all_linear_is_every_linear_of_the_blocks_as_on_a_transformers_model():
    """peft's all-linear adapts what the default list names, in training and in the estimate."""
    from memtrain.analysis.estimate import estimate
    from memtrain.config.run import build_config

    named, all_linear = GPT(CFG), GPT(CFG)
    apply_lora(named, TechniqueConfig(lora_rank=4))
    apply_lora(all_linear, TechniqueConfig(lora_rank=4, lora_targets="all-linear"))
    assert [n for n, _ in named.named_parameters()] == [n for n, _ in all_linear.named_parameters()]
    cfgs = [build_config({"d_model": 32, "n_heads": 4, "n_layers": 2, "d_ff": 64, "vocab_size": 97, "seq_len": 16,
                          "max_seq_len": 16, "lora_rank": 4, **extra}) for extra in ({}, {"lora_targets": "all-linear"})]
    a, b = (estimate(c, device_type="cpu") for c in cfgs)
    assert (a.trainable_parameters, a.peak_bytes) == (b.trainable_parameters, b.peak_bytes) and a.trainable_parameters > 0


def test_bad_dropout_rejected():
    with pytest.raises(ConfigError, match="--lora-dropout"):
        apply_lora(GPT(CFG), TechniqueConfig(lora_rank=4, lora_dropout=1.5))


def test_target_names_from_model():
    assert lora_target_names(GPT(CFG)) == sorted(TARGETS)


def test_rank_zero_is_a_no_op():
    model = GPT(CFG)
    apply_lora(model, TechniqueConfig(lora_rank=0))
    assert all(p.requires_grad for p in model.parameters())
    assert type(model.blocks[0].attn.qkv) is nn.Linear


def test_prepare_model_keeps_a_gpt(tmp_path):
    cfg = build_config({"vocab_size": 512, "d_model": 64, "n_heads": 4, "n_layers": 2, "d_ff": 128,
                        "max_seq_len": 128, "seq_len": 32, "dropout": 0.0, "lora_rank": 2, "lora_dropout": 0.1})
    prec = make_precision("fp32", CPU)
    model = prepare_model(GPT(cfg.model), cfg, CPU, prec)
    assert isinstance(model, GPT)
    x, y = _batch()
    loss = model(x, y)  # the train loop's call
    loss.backward()
    assert model.blocks[0].attn.qkv.lora_B["default"].weight.grad is not None
    assert model.wte.weight.grad is None
    copy.deepcopy(model)  # checkpoint/export paths copy the model


def test_low_bit_optimizer_warns_that_adapters_stay_fp32():
    """Rank-4 adapters are under torchao's 4096-element floor: 8-bit state would save nothing."""
    from memtrain.techniques.optim import LowBitSkipWarning

    with pytest.warns(LowBitSkipWarning, match="small LoRA adapters"):
        build_optimizer(_lora_model(4), TechniqueConfig(optim="adamw-8bit"), TrainConfig())
