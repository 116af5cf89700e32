"""Export a memtrain checkpoint as a Hugging Face ``GPT2LMHeadModel`` directory.

Our GPT is GPT-2's architecture with other parameter names, so the weights map one to one
onto transformers' ``GPT2LMHeadModel``; transformers writes the directory
(``save_pretrained``: ``config.json`` + ``model.safetensors``) and its GPT-2 tokenizer class
writes the tokenizer files from the vocabulary memtrain ships. Differences handled here:

* GPT-2 stores its projections in ``Conv1D`` modules, weight shape (in, out): our
  ``nn.Linear`` weights (out, in) are transposed.
* ``--vocab-multiple`` padding rows are dropped (the padded rows are never used).
* The LM head is tied to the token embedding unless ``--untie-embeddings``.
* Our MLP uses ``F.gelu(approximate="tanh")``: transformers' ``gelu_pytorch_tanh`` is the
  same function (``gelu`` would be the exact erf form and change the logits).
* ``--no-bias`` models get zero biases (GPT-2 always has them; a zero bias adds nothing).
* LoRA adapters are merged into the base weights (``W + alpha/r * B A``) first.

Checkpoints are read with ``torch.load(weights_only=True)``: no pickled code runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from memtrain.checkpoint import read_state
from memtrain.config import ConfigError, RunConfig, build_config
from memtrain.data.tokenizer import EOT_ID, vocab_dir
from memtrain.extras import require
from memtrain.model import GPT
from memtrain.preflight import check_model_size
from memtrain.techniques.lora import apply_lora, merge_lora


def _require_transformers() -> Any:
    return require("transformers")


def load_trained(ckpt: str | Path) -> tuple[GPT, RunConfig]:
    """Our GPT with a checkpoint's weights (LoRA merged), in FP32 and eval mode."""
    p = Path(ckpt)
    if p.is_dir():
        raise ConfigError(f"{str(p)!r} is a directory; give the single-file checkpoint written by --save "
                          "(a sharded distributed checkpoint cannot be exported yet)")
    state = read_state(p, "give the file written by train --save")
    if not isinstance(state, dict) or "model" not in state or "config" not in state:
        raise ConfigError(f"checkpoint {str(p)!r} is not a memtrain checkpoint (no model or config)")
    cfg = build_config(state["config"])
    check_model_size(cfg.model)  # a checkpoint's config is read, not trusted: its shape could be absurd
    model = GPT(cfg.model)
    if cfg.technique.lora_rank:
        apply_lora(model, cfg.technique)
        model.load_state_dict(state["model"])
        model = merge_lora(model)
    else:
        model.load_state_dict(state["model"])
    return model.float().eval(), cfg


def hf_config(cfg: RunConfig) -> Any:
    """The ``GPT2Config`` of our model's shape."""
    transformers = _require_transformers()
    m = cfg.model

    return transformers.GPT2Config(
        vocab_size=m.vocab_size, n_positions=m.max_seq_len, n_embd=m.d_model, n_layer=m.n_layers,
        n_head=m.n_heads, n_inner=m.d_ff, activation_function="gelu_pytorch_tanh",
        resid_pdrop=m.dropout, embd_pdrop=m.dropout, attn_pdrop=m.dropout, layer_norm_epsilon=1e-5,
        tie_word_embeddings=not m.untie_embeddings, bos_token_id=EOT_ID, eos_token_id=EOT_ID,
        architectures=["GPT2LMHeadModel"],
    )


def hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """Our parameters under GPT2LMHeadModel's names and layouts."""
    m = model.cfg
    V = m.vocab_size
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}

    def bias(name: str, size: int) -> torch.Tensor:
        return sd.get(name, torch.zeros(size))

    out: dict[str, torch.Tensor] = {
        "transformer.wte.weight": sd["wte.weight"][:V],
        "transformer.wpe.weight": sd["wpe.weight"],
        "transformer.ln_f.weight": sd["ln_f.weight"],
        "transformer.ln_f.bias": bias("ln_f.bias", m.d_model),
    }
    for i in range(m.n_layers):
        a, h = f"blocks.{i}.", f"transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            out[h + ln + ".weight"] = sd[a + ln + ".weight"]
            out[h + ln + ".bias"] = bias(a + ln + ".bias", m.d_model)
        for ours, theirs, width in (("attn.qkv", "attn.c_attn", 3 * m.d_model), ("attn.proj", "attn.c_proj", m.d_model),
                                    ("mlp.fc", "mlp.c_fc", m.d_ff), ("mlp.fc_out", "mlp.c_proj", m.d_model)):
            out[h + theirs + ".weight"] = sd[a + ours + ".weight"].t().contiguous()  # Linear (out,in) -> Conv1D (in,out)
            out[h + theirs + ".bias"] = bias(a + ours + ".bias", width)
    out["lm_head.weight"] = sd["lm_head.weight"][:V] if m.untie_embeddings else out["transformer.wte.weight"]
    return out


def to_hf_model(model: GPT, cfg: RunConfig) -> Any:
    """A ``GPT2LMHeadModel`` holding ``model``'s weights (eval mode)."""
    transformers = _require_transformers()
    hf = transformers.GPT2LMHeadModel(hf_config(cfg))
    missing, unexpected = hf.load_state_dict(hf_state_dict(model), strict=False)
    # Only non-persistent buffers may be absent from our mapping (older transformers keep the
    # causal mask as a buffer); a missing parameter would be a mapping bug.
    params = {n for n, _ in hf.named_parameters()}
    bad = [k for k in missing if k in params and k != "lm_head.weight"] + list(unexpected)
    if bad:
        raise RuntimeError(f"weight mapping incomplete: {bad[:5]}")
    if cfg.model.untie_embeddings:
        hf.lm_head.weight.data.copy_(hf_state_dict(model)["lm_head.weight"])
    return hf.eval()


def save_tokenizer(out: Path) -> None:
    """GPT-2's tokenizer files (vocab.json, merges.txt, tokenizer.json, ...) into ``out``.

    vocab.json and merges.txt are OpenAI's encoder.json and vocab.bpe under the names
    transformers reads; its GPT-2 tokenizer class then loads them and writes the rest
    (tokenizer.json, tokenizer_config.json), whatever its major version calls its arguments.
    """
    import shutil

    transformers = _require_transformers()

    d = vocab_dir()
    shutil.copyfile(d / "encoder.json", out / "vocab.json")
    shutil.copyfile(d / "vocab.bpe", out / "merges.txt")
    tok = transformers.GPT2TokenizerFast.from_pretrained(str(out))
    tok.save_pretrained(str(out))


def export_hf(ckpt: str | Path, out: str | Path) -> dict[str, Any]:
    """Write ``out`` as a transformers-loadable directory; return a summary."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{str(out)!r} exists and is not empty; give a new directory")
    model, cfg = load_trained(ckpt)
    hf = to_hf_model(model, cfg)
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out), safe_serialization=True)
    save_tokenizer(out)
    return {"out": str(out), "parameters": model.num_parameters(), "lora_merged": bool(cfg.technique.lora_rank),
            "files": sorted(p.name for p in out.iterdir())}
