"""The GPT itself: shapes, parameter count, weight tying, causality, summary."""

import math

import pytest
import torch

from memtrain.config.run import ModelConfig
from memtrain.models.gpt import GPT, standard_lm_loss

TINY = dict(vocab_size=97, d_model=32, n_heads=4, n_layers=2, d_ff=64, max_seq_len=16, dropout=0.0)


def test_default_config_matches_spec():
    c = ModelConfig()
    assert (c.d_model, c.n_heads, c.n_layers, c.d_ff, c.max_seq_len, c.dropout, c.vocab_size) == (
        256, 8, 4, 1024, 512, 0.1, 50257)


def test_parameter_count_matches_formula_and_tying():
    cfg = ModelConfig(**TINY)
    m = GPT(cfg)
    d, f, v, s, L = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.max_seq_len, cfg.n_layers
    block = (d * 3 * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d) + 4 * d
    expected = v * d + s * d + L * block + 2 * d
    assert m.num_parameters() == expected
    assert m.lm_head.weight is m.wte.weight
    untied = GPT(ModelConfig(**TINY, untie_embeddings=True))
    assert untied.num_parameters() == expected + v * d
    assert untied.lm_head.weight is not untied.wte.weight


def test_default_model_size():
    # 50257*256 + 512*256 + 4 * (256*768 + 768 + 256*256 + 256 + 256*1024 + 1024 + 1024*256 + 256 + 4*256) + 2*256
    assert GPT(ModelConfig()).num_parameters() == 16_156_416


def test_untrained_loss_is_log_vocab():
    torch.manual_seed(0)
    m = GPT(ModelConfig(**TINY))
    idx = torch.randint(0, 97, (4, 16))
    targets = torch.randint(0, 97, (4, 16))
    loss = m(idx, targets)
    assert abs(loss.item() - math.log(97)) < 0.1


def test_causality_future_tokens_do_not_change_past_logits():
    torch.manual_seed(0)
    m = GPT(ModelConfig(**TINY)).eval()
    a = torch.randint(0, 97, (1, 16))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 1) % 97
    la, lb = m(a), m(b)
    assert torch.allclose(la[0, :10], lb[0, :10], atol=1e-6)
    assert not torch.allclose(la[0, 10:], lb[0, 10:])


def test_loss_equals_cross_entropy_of_logits():
    torch.manual_seed(0)
    m = GPT(ModelConfig(**TINY)).eval()
    idx = torch.randint(0, 97, (2, 16))
    y = torch.randint(0, 97, (2, 16))
    ref = torch.nn.functional.cross_entropy(m(idx).reshape(-1, 97), y.reshape(-1))
    assert torch.allclose(m(idx, y), ref, atol=1e-6)


def test_padded_vocab_and_too_long_input():
    m = GPT(ModelConfig(**{**TINY, "vocab_multiple": 64}))
    assert m.wte.weight.shape[0] == 128
    with pytest.raises(ValueError, match="max_seq_len"):
        m(torch.zeros(1, 17, dtype=torch.long))


def test_summary_lists_total():
    text = GPT(ModelConfig(**TINY)).summary()
    assert "token embedding" in text and "total" in text
    assert f"{GPT(ModelConfig(**TINY)).num_parameters():,}" in text


def test_standard_loss_ignores_index():
    h = torch.randn(6, 8)
    w = torch.randn(11, 8)
    t = torch.tensor([1, 2, -100, 3, -100, 4])
    keep = t != -100
    ref = torch.nn.functional.cross_entropy(h[keep] @ w.T, t[keep])
    assert torch.allclose(standard_lm_loss(h, w, t), ref)


def test_vocab_padding_changes_storage_not_the_model():
    """Same seed, padded or not: same initial weights for real tokens, same loss and gradients;
    padded rows are zero and stay out of the logits."""
    idx = torch.randint(0, 97, (2, 16))
    y = torch.randint(0, 97, (2, 16))
    for untie in (False, True):
        torch.manual_seed(3)
        plain = GPT(ModelConfig(**TINY, untie_embeddings=untie))
        torch.manual_seed(3)
        padded = GPT(ModelConfig(**TINY, untie_embeddings=untie, vocab_multiple=64))
        assert padded.wte.weight.shape[0] == 128 and padded.lm_head.weight.shape[0] == 128
        assert torch.equal(padded.wte.weight[:97], plain.wte.weight)
        assert torch.count_nonzero(padded.wte.weight[97:]) == 0
        assert torch.equal(padded.blocks[1].mlp.fc.weight, plain.blocks[1].mlp.fc.weight)
        lp, lq = plain(idx, y), padded(idx, y)
        assert torch.allclose(lp, lq, atol=1e-6)
        lp.backward()
        lq.backward()
        assert torch.allclose(padded.wte.weight.grad[:97], plain.wte.weight.grad, atol=1e-6)
        assert padded(idx).shape[-1] == 97
