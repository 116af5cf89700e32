"""A transformers config whose head_dim is not hidden_size / num_attention_heads (Gemma-7B: 16 x 256
for 3072; Mistral-Nemo: 32 x 128 for 5120) is sized with its own head width everywhere, not only in
the training memory estimate: parameter counts, plan's FLOPs per token, the inference estimate's
q/k/v and the 6ND + attention rule, each against the real transformers model."""

from __future__ import annotations

from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from memtrain.config.run import build_config  # noqa: E402

# Gemma-7B's shape, small: q is 4 x 32 = 128 wide for hidden 96, k and v 2 x 32; odd MLP and
# vocabulary widths.
GEMMA = dict(hidden_size=96, num_attention_heads=4, head_dim=32, num_key_value_heads=2, intermediate_size=61,
             vocab_size=517, num_hidden_layers=2, max_position_embeddings=128)
B, S = 2, 16

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("wide-heads") / "gemma"
    transformers.GemmaConfig(**GEMMA).save_pretrained(d)
    return d


def _model(d: Path):
    torch.manual_seed(0)
    config = transformers.AutoConfig.from_pretrained(d)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def _cfg(d: Path, **kw):
    return build_config({"model": str(d), "batch_size": B, "seq_len": S, "attention": "math", "device": "cpu", **kw})


def _archs(d: Path):
    from memtrain.analysis.estimate.hf import hf_arch
    from memtrain.models.spec import cost_arch

    return {"hf_arch": hf_arch(str(d)), "cost_arch": cost_arch(str(d))}


def _tokens():
    return torch.randint(0, GEMMA["vocab_size"], (B, S), generator=torch.Generator().manual_seed(0))


def test_parameter_counts_are_the_models(gemma):
    """plan's and the size check's parameter count (cost_arch) counted q and o as hidden x hidden
    and k, v as hidden x kv_heads x hidden / heads: 140,544 for the model's 158,976."""
    from memtrain.analysis.estimate import param_count
    from memtrain.training.preflight import model_parameters

    real = sum(p.numel() for p in _model(gemma).parameters())
    cfg = _cfg(gemma)
    assert {name: param_count(cfg.model, arch)[0] for name, arch in _archs(gemma).items()} == {
        "hf_arch": real, "cost_arch": real}
    assert model_parameters(cfg.model) == real


def test_plans_flops_per_token_are_the_counted_forward(gemma):
    """plan's step-time model took q, the output projection's input and the attention core d_model
    wide and k, v kv_heads x d_model / heads: 292,416 forward FLOPs a token where FlopCounterMode
    counts 333,376 on the model (eager attention, whose two matmuls it counts), and three times
    that with backward."""
    from torch.utils.flop_counter import FlopCounterMode

    from memtrain.analysis.plan import _flops_per_token

    model, x = _model(gemma), _tokens()
    with FlopCounterMode(display=False) as fc:
        model(input_ids=x, use_cache=False)
    forward = fc.get_total_flops() / (B * S)
    with FlopCounterMode(display=False) as fc:
        model(input_ids=x, use_cache=False).logits.float().sum().backward()
    assert fc.get_total_flops() / (B * S) == 3 * forward
    cfg = _cfg(gemma)
    for name, arch in _archs(gemma).items():
        assert sum(_flops_per_token(cfg, arch).values()) == forward, name
