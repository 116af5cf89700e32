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
    from memtrain.training.size_check import model_parameters

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

    from memtrain.analysis.step_time import _flops_per_token

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


def test_the_rules_attention_term_is_the_counted_attention(gemma):
    """The 6ND + attention rule's attention term (also the MFU numerator where a step cannot be
    counted) is 12 x layers x heads x head_dim x seq a token: the attention matmuls (bmm: QK^T and
    AV, forward and backward) FlopCounterMode counts on the model; it was d_model wide (36,864
    FLOPs a token for 49,152)."""
    from torch.utils.flop_counter import FlopCounterMode

    from memtrain.analysis.flops import rule_flops_per_token
    from memtrain.analysis.flops.rules import RuleParams, rule_terms

    model, x = _model(gemma), _tokens()
    with FlopCounterMode(display=False) as fc:
        model(input_ids=x, use_cache=False).logits.float().sum().backward()
    bmm = fc.get_flop_counts()["Global"][torch.ops.aten.bmm]
    cfg = _cfg(gemma)
    n = sum(p.numel() for p in model.parameters())
    assert rule_terms(cfg, n, B * S, RuleParams())["attention"] == bmm
    six_n = 6.0 * n  # a rotary model: no position table to drop
    assert rule_flops_per_token(cfg.model, S, n) == six_n + bmm / (B * S)


@pytest.mark.parametrize("attention", ["math", "sdpa"])
def test_inference_qkv_are_the_models(gemma, attention):
    """The inference estimate's q, k and v (and the attention's output and q/k copies) are the
    model's widths: k and v the bytes a DynamicCache holds for a layer after a forward of the
    same length, q the q projection's output. They were d_model and kv_heads x d_model / heads
    wide (the block's peak 86,016 B for 102,400 under math attention, 49,664 for 61,952 under
    SDPA)."""
    from memtrain.analysis.estimate import estimate_inference
    from memtrain.analysis.estimate.hf import hf_arch

    model, x = _model(gemma), _tokens()
    seen = {}
    layer = model.model.layers[0].self_attn
    hooks = [layer.q_proj.register_forward_hook(lambda m, i, o: seen.__setitem__("q", o.nbytes)),
             layer.o_proj.register_forward_hook(lambda m, i, o: seen.__setitem__("out", i[0].nbytes))]
    cache = transformers.DynamicCache()
    with torch.no_grad():
        model(input_ids=x, use_cache=True, cache=cache)
    for h in hooks:
        h.remove()
    kv = cache.layers[0].keys.nbytes + cache.layers[0].values.nbytes
    q, out = seen["q"], seen["out"]
    res = estimate_inference(_cfg(gemma, attention=attention), "fp32", hf_arch(str(gemma)))
    cfg = _cfg(gemma)
    N, d, h = B * S, cfg.model.d_model, cfg.model.n_heads
    residual = N * d * 4
    if attention == "math":
        sc = B * h * S * S
        # q/k/v, then q and the k repeated to every head (q's size), then the scores and softmax
        attn = q + kv + 2 * q + max(2 * sc * 4, sc * 4 + 2 * sc * 4)
    else:
        attn = q + kv + out + B * h * S * 4  # q/k/v, the fused kernel's output and its log-sum-exp
    assert res["bytes"]["activations"] == residual + attn


@pytest.mark.parametrize("family, fields", [
    ("Qwen2Config", {}),  # q/k/v with a bias by its layer code, o_proj without
    ("LlamaConfig", dict(attention_bias=True, mlp_bias=True)),
    ("LlamaConfig", dict(attention_bias=True)),
])
def test_plans_parameter_count_holds_the_biases_the_family_builds(tmp_path, family, fields):
    """plan's and the size check's parameter count (cost_arch) left out q/k/v and o biases:
    Qwen2-7B's 129,024 q/k/v bias parameters. Now it takes the analytic model's biases
    (``with_config_biases``) and equals ``sum(p.numel())`` of the built model."""
    from memtrain.analysis.estimate import param_count
    from memtrain.models.spec import cost_arch
    from memtrain.training.size_check import model_parameters

    getattr(transformers, family)(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                                  vocab_size=301, num_hidden_layers=2, max_position_embeddings=64,
                                  **fields).save_pretrained(tmp_path)
    real = sum(p.numel() for p in _model(tmp_path).parameters())
    cfg = _cfg(tmp_path)
    assert param_count(cfg.model, cost_arch(str(tmp_path)))[0] == real == model_parameters(cfg.model)
