"""The sampling settings memtrain generate hands transformers: temperature, top-k, greedy at
temperature 0, a fixed length; checked on a tiny GPT-2 built from its config (no files)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from memtrain.inference.generate import generation_config, sample_ids  # noqa: E402

VOCAB = 97


@pytest.fixture(scope="module")
def tiny_lm():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    return transformers.GPT2LMHeadModel(config).eval()


def _sample(lm, settings, seed: int) -> list[list[int]]:
    torch.manual_seed(seed)
    x = torch.tensor([[1, 2, 3]] * 3)
    return sample_ids(lm, x, settings).tolist()


def test_temperature_zero_is_greedy_and_a_positive_one_samples(tiny_lm):
    greedy = generation_config(6, 0.0, 50, 0)
    assert greedy.do_sample is False
    assert _sample(tiny_lm, greedy, 1) == _sample(tiny_lm, greedy, 2)
    warm = generation_config(6, 0.8, 0, 0)
    assert warm.do_sample is True and warm.temperature == 0.8 and warm.top_k is None  # 0: no top-k cut
    # A near-uniform random model at temperature 0.8 over 97 tokens: other seeds, other text;
    # the same seed, the same text.
    assert _sample(tiny_lm, warm, 1) != _sample(tiny_lm, warm, 2)
    assert _sample(tiny_lm, warm, 1) == _sample(tiny_lm, warm, 1)


def test_top_k_one_samples_the_greedy_text_at_any_temperature(tiny_lm):
    """--top-k reaches transformers: with k=1 only the likeliest token is left to draw."""
    hot = generation_config(6, 5.0, 1, 0)
    assert hot.top_k == 1
    greedy = _sample(tiny_lm, generation_config(6, 0.0, 0, 0), 1)
    assert _sample(tiny_lm, hot, 3) == greedy


def test_every_sample_is_the_prompt_then_max_new_tokens(tiny_lm):
    """No eos in the settings: each row is the prompt followed by exactly max_new_tokens ids, even
    when the model's own generation config names as eos the very token it draws first."""
    settings = generation_config(9, 0.0, 0, 0)
    greedy = _sample(tiny_lm, settings, 4)
    tiny_lm.generation_config.eos_token_id = greedy[0][3]
    rows = _sample(tiny_lm, settings, 4)
    assert rows == greedy and [len(r) for r in rows] == [3 + 9] * 3 and all(r[:3] == [1, 2, 3] for r in rows)
