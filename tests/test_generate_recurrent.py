"""`memtrain generate` on models whose layers are all recurrent (RecurrentGemma, Qwen3-Next, Jamba,
LFM2, GraniteMoeHybrid, Bamba of recurrent blocks only: a tiny one whose block pattern puts its
first attention layer beyond its depth). transformers 5 builds such a model a cache of recurrent
layers only, and its mask builder asks that cache its length before the first token: a ValueError
("get_seq_length can only be called on Attention layers"), exit 1. They now sample without a cache
(one warning line), the text greedy decoding by whole forwards gives."""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from memtrain.cli import main  # noqa: E402
from memtrain.inference.generate import cache_counts_positions, generation_config, sample_ids  # noqa: E402
from memtrain.runtime.notices import NoticeWarning  # noqa: E402

VOCAB = 50257  # GPT-2's: a folder without tokenizer files is read with GPT-2's BPE
SHAPE = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
             max_position_embeddings=64)
# Two layers, none of them attention: each family's own field for its block pattern.
ALL_RECURRENT = {
    "recurrent_gemma": dict(num_hidden_layers=2, head_dim=8, lru_width=32, attention_window_size=16,
                            block_types=["recurrent", "recurrent"]),
    "qwen3_next": dict(num_hidden_layers=2, head_dim=8, layer_types=["linear_attention"] * 2, linear_num_value_heads=2,
                       linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, moe_intermediate_size=16,
                       num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=32),
    "jamba": dict(num_hidden_layers=2, attn_layer_period=4, attn_layer_offset=3, num_experts=1, mamba_d_state=8,
                  mamba_dt_rank=4),
    "lfm2": dict(num_hidden_layers=2, layer_types=["conv", "conv"]),
    "granitemoehybrid": dict(num_hidden_layers=2, layer_types=["mamba", "mamba"], mamba_n_heads=4, mamba_d_head=16,
                             mamba_d_state=8, num_local_experts=0, shared_intermediate_size=64),
    "bamba": dict(num_hidden_layers=2, attn_layer_indices=[], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8),
}


def _folder(tmp_path, model_type: str, **fields):
    config = transformers.AutoConfig.for_model(model_type, **{**SHAPE, **fields})
    torch.manual_seed(0)
    lm = transformers.AutoModelForCausalLM.from_config(config).eval()
    d = tmp_path / model_type
    lm.save_pretrained(d)
    return d, lm


def _greedy_by_whole_forwards(lm, x: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy decoding without generate or a cache: the whole sequence forward for every token."""
    with torch.no_grad():
        for _ in range(n):
            x = torch.cat([x, lm(x, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return x


@pytest.mark.parametrize("model_type", sorted(ALL_RECURRENT))
def test_a_model_of_recurrent_layers_only_generates(tmp_path, capsys, model_type):
    d, lm = _folder(tmp_path, model_type, **ALL_RECURRENT[model_type])
    assert not cache_counts_positions(lm.config)
    with pytest.warns(NoticeWarning, match=f"a {model_type} model without attention layers samples without a cache"):
        assert main(["generate", str(d), "--prompt", "Hello", "--max-new-tokens", "4", "--seed", "1",
                     "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Hello") and len(out.strip()) > len("Hello")
    x = torch.tensor([[15496, 11, 995]])
    assert torch.equal(sample_ids(lm, x, generation_config(5, 0.0, 0, 0)), _greedy_by_whole_forwards(lm, x, 5))


def test_a_model_with_an_attention_layer_keeps_its_cache(tmp_path, capsys):
    """RecurrentGemma's own pattern (recurrent, recurrent, attention) at depth 3: the cache counts
    positions, generate uses it, no warning."""
    d, lm = _folder(tmp_path, "recurrent_gemma", num_hidden_layers=3, head_dim=8, lru_width=32, attention_window_size=16)
    assert cache_counts_positions(lm.config)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoticeWarning)
        assert main(["generate", str(d), "--prompt", "Hello", "--max-new-tokens", "4", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("Hello")
