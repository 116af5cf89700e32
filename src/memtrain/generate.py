"""Sampling through transformers' ``generate`` (a checkpoint is mapped onto GPT2LMHeadModel
first, see :mod:`memtrain.export`), so the sampling rules are the library's, not ours."""

from __future__ import annotations

from pathlib import Path

import torch

from memtrain.config import ConfigError, ModelConfig
from memtrain.data.tokenizer import EOT_ID, get_tokenizer
from memtrain.export import _require_transformers, load_trained, to_hf_model
from memtrain.preflight import check_model_size


def generate(model_path: Path, prompt: str, max_new_tokens: int, temperature: float, top_k: int,
             num_samples: int, seed: int) -> list[str]:
    """``num_samples`` continuations of ``prompt`` (the new text only)."""

    transformers = _require_transformers()
    if model_path.is_dir():
        if not (model_path / "config.json").is_file():
            raise ConfigError(f"{str(model_path)!r} has no config.json; give a directory written by `memtrain export`")
        # The shape its config.json declares, checked before transformers builds it.
        check_model_size(ModelConfig(model=str(model_path)))
        # use_safetensors: never fall back to a pickled pytorch_model.bin
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_path), use_safetensors=True).eval()
    else:
        model, cfg = load_trained(model_path)
        hf = to_hf_model(model, cfg)
    tok = get_tokenizer()
    ids = tok.encode_ordinary(prompt) if prompt else [EOT_ID]
    limit = hf.config.n_positions
    if len(ids) + max_new_tokens > limit:
        raise ConfigError(f"prompt ({len(ids)} tokens) + --max-new-tokens {max_new_tokens} exceeds the model's "
                          f"{limit} positions; shorten one")
    torch.manual_seed(seed)
    x = torch.tensor([ids] * num_samples)
    with torch.no_grad():
        kw = dict(do_sample=True, temperature=temperature, top_k=top_k or None) if temperature > 0 else dict(do_sample=False)
        y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                        pad_token_id=EOT_ID, eos_token_id=None, **kw)
    return [tok.decode(row[len(ids):].tolist()) for row in y]
