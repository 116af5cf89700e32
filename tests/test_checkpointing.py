"""Activation checkpointing: bitwise-equal numerics, less activation memory, the expected
recompute FLOPs, unchanged parameter names."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from memtrain.config.run import ConfigError, ModelConfig, TechniqueConfig, build_config
from memtrain.metrics import MemoryMeter
from memtrain.models.gpt import GPT
from memtrain.techniques.checkpointing import apply_checkpointing, checkpointed_blocks, is_checkpointed

# Dropout on: checkpointing must replay the same dropout masks during the recompute.
CFG = ModelConfig(vocab_size=512, d_model=64, n_heads=4, n_layers=4, d_ff=128, max_seq_len=128, dropout=0.1)
POLICIES = ["full", "every:2", "every:3", "sqrt", "selective"]


@pytest.fixture(scope="module")
def base() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


@pytest.fixture(scope="module")
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 512, (2, 128), generator=g), torch.randint(0, 512, (2, 128), generator=g)


def checkpointed(model: GPT, policy: str) -> GPT:
    m = copy.deepcopy(model)
    apply_checkpointing(m, TechniqueConfig(checkpointing=policy))
    return m


def loss_and_grads(model: GPT, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    x, y = batch
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(42)  # same dropout masks for every model
    loss = model(x, y)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("policy", POLICIES)
def test_loss_and_gradients_bitwise_equal(base, batch, policy):
    ref_loss, ref_grads = loss_and_grads(copy.deepcopy(base), batch)
    model = checkpointed(base, policy)
    assert any(is_checkpointed(b) for b in model.blocks)
    loss, grads = loss_and_grads(model, batch)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        assert torch.equal(grads[name], ref_grads[name]), name


def test_which_blocks():
    assert checkpointed_blocks("none", 4) == []
    assert checkpointed_blocks("full", 4) == [0, 1, 2, 3]
    assert checkpointed_blocks("selective", 3) == [0, 1, 2]
    assert checkpointed_blocks("every:2", 4) == [0, 2]
    assert checkpointed_blocks("every:3", 7) == [0, 3, 6]
    assert checkpointed_blocks("every:9", 4) == [0]
    assert checkpointed_blocks("sqrt", 9) == [0, 3, 6]  # K = round(sqrt(9)) = 3
    assert checkpointed_blocks("sqrt", 12) == [0, 3, 6, 9]  # K = round(3.46) = 3
    assert checkpointed_blocks("sqrt", 8) == [0, 3, 6]  # K = round(2.83) = 3, not its floor 2
    assert checkpointed_blocks("sqrt", 1) == [0]


def test_none_leaves_model_untouched(base):
    model = checkpointed(base, "none")
    assert not any(is_checkpointed(b) for b in model.blocks)
    assert all("forward" not in b.__dict__ for b in model.blocks)


def test_names_and_state_dict_unchanged(base):
    model = checkpointed(base, "full")
    assert list(model.state_dict()) == list(base.state_dict())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in base.named_parameters()]
    # A plain checkpoint loads into a checkpointed model and the reverse.
    model.load_state_dict(base.state_dict())
    copy.deepcopy(base).load_state_dict(model.state_dict())
    # The module tree is the plain one (attention seam still reachable).
    assert type(model.blocks[0]).__name__ == "Block"
    assert model.blocks[0].attn.attn_fn is base.blocks[0].attn.attn_fn


def test_composes_with_lora(base, batch):
    """LoRA runs first (adapters inside the blocks); checkpointing must keep adapter names,
    the frozen/trainable split and bitwise-equal adapter gradients (with LoRA dropout)."""
    from memtrain.techniques.lora import apply_lora

    tech = TechniqueConfig(lora_rank=4, lora_dropout=0.1, checkpointing="full")
    plain = copy.deepcopy(base)
    apply_lora(plain, tech)
    model = copy.deepcopy(plain)
    apply_checkpointing(model, tech)
    assert list(model.state_dict()) == list(plain.state_dict())
    assert any("lora_A" in k for k in model.state_dict())
    ref_loss, ref_grads = loss_and_grads(plain, batch)
    loss, grads = loss_and_grads(model, batch)
    assert torch.equal(loss, ref_loss)
    trained = [n for n, g in ref_grads.items() if g is not None]
    assert trained and all("lora_" in n for n in trained)
    for name in ref_grads:
        assert (grads[name] is None) == (ref_grads[name] is None), name
        if ref_grads[name] is not None:
            assert torch.equal(grads[name], ref_grads[name]), name


def test_deepcopy_rebinds_to_the_copy(base, batch):
    model = checkpointed(base, "full")
    clone = copy.deepcopy(model)
    assert is_checkpointed(clone.blocks[0])
    # The copy's checkpointed forward must run the copy's weights, not the original's.
    with torch.no_grad():
        for p in clone.parameters():
            p.add_(0.01)
        model.eval(), clone.eval()
        assert not torch.equal(model(*batch), clone(*batch))


def test_applying_twice_is_refused(base):
    model = checkpointed(base, "full")
    with pytest.raises(ValueError, match="already checkpointed"):
        apply_checkpointing(model, TechniqueConfig(checkpointing="full"))


def test_eval_without_grad_matches(base, batch):
    model = checkpointed(base, "selective")
    plain = copy.deepcopy(base)
    model.eval(), plain.eval()
    with torch.no_grad():
        assert torch.equal(model(*batch), plain(*batch))


def _activation_bytes(model: GPT, batch) -> int:
    """Tracked activations + temporaries at the peak of one forward + backward."""
    x, y = batch
    model.train()
    meter = MemoryMeter(model)
    torch.manual_seed(42)
    with meter:
        with meter.phase("forward"):
            loss = model(x, y)
        with meter.phase("backward"):
            loss.backward()
    stats = meter.stats()
    return stats.by_category["activations"] + stats.by_category["temporaries"]


def test_activation_memory_shrinks(base, batch):
    mem = {p: _activation_bytes(checkpointed(base, p), batch)
           for p in ("none", "every:2", "selective", "selective-matmul", "full")}
    print({p: f"{b / 2**20:.2f} MiB" for p, b in mem.items()})
    assert mem["full"] < mem["every:2"] < mem["none"]
    assert mem["full"] < mem["selective"] < mem["none"]
    assert mem["full"] < mem["selective-matmul"] < mem["none"]
    # Full checkpointing keeps only block inputs: well under half of the plain model's.
    assert mem["full"] < 0.5 * mem["none"]


def _train_flops(model: GPT, batch) -> int:
    with FlopCounterMode(display=False) as counter:
        model(*batch).backward()
    return counter.get_total_flops()


def test_full_recompute_costs_one_forward_of_the_blocks(base, batch):
    plain = _train_flops(copy.deepcopy(base), batch)
    # One forward of the blocks alone, counted separately.
    h = torch.randn(batch[0].shape + (CFG.d_model,))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        for block in base.blocks:
            h = block(h)
    blocks_forward = counter.get_total_flops()
    assert blocks_forward > 0

    full = _train_flops(checkpointed(base, "full"), batch)
    every2 = _train_flops(checkpointed(base, "every:2"), batch)
    selective = _train_flops(checkpointed(base, "selective-matmul"), batch)
    megatron = _train_flops(checkpointed(base, "selective"), batch)
    print(f"plain {plain:,}  full {full:,}  blocks forward {blocks_forward:,}  every:2 {every2:,}  "
          f"selective-matmul {selective:,}  selective {megatron:,}")
    assert abs((full - plain) - blocks_forward) <= 0.01 * blocks_forward
    assert abs((every2 - plain) - blocks_forward / 2) <= 0.01 * blocks_forward
    # selective-matmul saves every matmul output: the recompute adds no (matmul) FLOPs.
    assert selective - plain <= 0.01 * blocks_forward
    # Megatron's selective recomputes the attention core up to what backward needs: q k^T
    # (2 b s^2 d FLOPs) reruns, probs @ v (whose output nothing saves) does not.
    b, s = batch[0].shape
    assert megatron - plain == CFG.n_layers * 2 * b * s * s * CFG.d_model


@pytest.mark.parametrize(
    "policy, message",
    [
        ("every:0", "K in every:K must be a positive integer"),
        ("every:x", "K in every:K must be a positive integer"),
        ("some", "choose none, full, every:K, sqrt, selective or selective-matmul"),
    ],
)
def test_invalid_policy_rejected(policy, message):
    with pytest.raises(ConfigError, match=message) as info:
        build_config({"checkpointing": policy})
    assert "\n" not in str(info.value)
    assert f"--checkpointing {policy!r}" in str(info.value)
