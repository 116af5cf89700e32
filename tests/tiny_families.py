"""One tiny config per transformers family, for tests that run a step or count a model of each
(tests/test_hf_depth.py, tests/test_flops_rule_params.py): hidden 32, 4 heads, FFN 64, 128
positions, a 384-token vocabulary, ``n`` layers."""

from __future__ import annotations

from typing import Any, Callable

import transformers

VOCAB = 384
TINY = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, max_position_embeddings=128,
            vocab_size=VOCAB)

FAMILIES: dict[str, Callable[[int], Any]] = {
    "llama": lambda n: transformers.LlamaConfig(**TINY, num_hidden_layers=n, num_key_value_heads=2),
    # q/k/v biases
    "qwen2": lambda n: transformers.Qwen2Config(**TINY, num_hidden_layers=n, num_key_value_heads=2),
    "mistral": lambda n: transformers.MistralConfig(**TINY, num_hidden_layers=n, num_key_value_heads=2),
    # heads x head_dim (4 x 16) wider than hidden_size, a head_dim apart from hidden / heads (8)
    "gemma": lambda n: transformers.GemmaConfig(**TINY, num_hidden_layers=n, num_key_value_heads=1, head_dim=16),
    # fused q/k/v and gate/up projections
    "phi3": lambda n: transformers.Phi3Config(**TINY, num_hidden_layers=n, num_key_value_heads=2, pad_token_id=0),
    # a learned position table, LayerNorm weights and biases, biases everywhere
    "gpt2": lambda n: transformers.GPT2Config(n_embd=32, n_layer=n, n_head=4, n_positions=128, vocab_size=VOCAB),
    # a learned position table with two rows more than max_position_embeddings
    "opt": lambda n: transformers.OPTConfig(hidden_size=32, ffn_dim=64, num_attention_heads=4, num_hidden_layers=n,
                                            max_position_embeddings=128, vocab_size=VOCAB, word_embed_proj_dim=32),
}


def tiny_config(family: str, n_layers: int, **overrides: Any) -> Any:
    """``family``'s tiny config with ``n_layers`` layers and ``overrides`` set on it."""
    config = FAMILIES[family](n_layers)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config
