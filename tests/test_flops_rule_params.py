"""The 6ND + attention rule's parameter terms are the counted model's own: a transformers model's
position table (GPT-2's ``wpe``, OPT's ``embed_positions``; none in a rotary model), untied token
embedding and vectors (biases, norm weights), so that `memtrain flops` reconciles the counted
forward + backward with the rule to 0 for a plain step of every family, and the MFU numerator's
fallback (the rule, where a step cannot be counted) drops only a table the model has."""

from __future__ import annotations

from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from memtrain.analysis.flops.roofline import flops_report  # noqa: E402
from memtrain.config.run import build_config  # noqa: E402
from tiny_families import FAMILIES, VOCAB  # noqa: E402

B, S = 2, 16

pytestmark = pytest.mark.usefixtures("one_thread")


def _model_dir(root: Path, family: str, n_layers: int = 2, tie: bool = True) -> Path:
    d = root / f"{family}-{n_layers}-{'tied' if tie else 'untied'}"
    config = FAMILIES[family](n_layers)
    config.tie_word_embeddings = tie
    config.save_pretrained(d)
    return d


def _cfg(d: Path, **tech):
    return build_config({"model": str(d), "batch_size": B, "seq_len": S, "device": "cpu", **tech})


def _own_counts(d: Path) -> dict[str, int]:
    """The model's parameters as transformers builds it, read from ``named_parameters()`` by name
    and rank, independently of memtrain: (distinct) total, position table, untied token embedding
    and vectors."""
    lm = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(d))
    params = dict(lm.named_parameters())  # a tied head is listed once
    token = lm.get_input_embeddings().weight
    tied = lm.get_output_embeddings().weight is token
    return {
        "parameters": sum(p.numel() for p in params.values()),
        "position_params": sum(p.numel() for name, p in params.items()
                               if name.endswith(("wpe.weight", "embed_positions.weight"))),
        "untied_embedding_params": 0 if tied else token.numel(),
        "vector_params": sum(p.numel() for p in params.values() if p.dim() < 2),
    }


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_plain_step_reconciles_to_zero(tmp_path, family, tie):
    """The rule dropped a max_seq_len x d_model position table from every model and took the
    biases and norm weights of our GPT's parameter table (LayerNorm weight and bias, biases
    everywhere): a plain tiny Llama step was left 2,068,480 FLOPs unexplained (15% of the count),
    an OPT step 286,720. The terms are now the model's own parameters and nothing is left."""
    d = _model_dir(tmp_path, family, tie=tie)
    report = flops_report(_cfg(d, attention="sdpa"), "h100")
    own = _own_counts(d)
    assert report["parameters"] == own["parameters"]
    assert {k: report["rule"][k] for k in ("position_params", "untied_embedding_params", "vector_params")} == {
        k: own[k] for k in ("position_params", "untied_embedding_params", "vector_params")}
    assert report["rule"]["rule_params"] == own["parameters"] - own["position_params"]
    rec = report["reconciliation"]
    assert rec["unexplained"] == pytest.approx(0, abs=1e-9 * rec["counted_forward_backward"])


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_the_math_backend_reconciles_to_zero_too(tmp_path, family):
    """Under the math backend the attention runs as two bmm each way, as the rule counts it:
    no fused kernel's second q k^T in the backward."""
    d = _model_dir(tmp_path, family)
    rec = flops_report(_cfg(d, attention="math"), "h100")["reconciliation"]
    assert rec["fused_attention_backward_scores"] == 0
    assert rec["unexplained"] == pytest.approx(0, abs=1e-9 * rec["counted_forward_backward"])


def test_a_fused_kernel_recomputes_the_scores_in_its_backward(tmp_path):
    """torch counts SDPA's fused backward as five matmuls to the forward's two (it computes q k^T
    again): 2 x layers x heads x head_dim x seq FLOPs a token beyond the rule's attention term."""
    d = _model_dir(tmp_path, "llama")
    report = flops_report(_cfg(d, attention="sdpa"), "h100")
    rule = report["rule"]
    assert report["reconciliation"]["fused_attention_backward_scores"] == rule["attention"] / 6


def test_a_deep_model_is_counted_per_layer(tmp_path):
    """Deeper than the count traces whole, the vectors (Qwen2's q/k/v biases and its norms) are
    extrapolated per layer as the parameter count is."""
    from memtrain.analysis.flops.count import _TRACE_LAYERS

    d = _model_dir(tmp_path, "qwen2", n_layers=_TRACE_LAYERS + 1, tie=False)
    report = flops_report(_cfg(d, attention="sdpa"), "h100")
    own = _own_counts(d)
    assert report["parameters"] == own["parameters"]
    assert report["rule"]["vector_params"] == own["vector_params"]
    assert report["rule"]["untied_embedding_params"] == own["untied_embedding_params"]
    rec = report["reconciliation"]
    assert rec["unexplained"] == pytest.approx(0, abs=1e-9 * rec["counted_forward_backward"])


def test_only_a_technique_on_is_named_for_what_is_left(tmp_path):
    """`memtrain flops` named LoRA and a sliding window for any remainder, with neither on; with
    LoRA on the remainder is LoRA's (no weight gradients of frozen weights) and it says so."""
    from memtrain.commands.flops import _unexplained_cause, render

    d = _model_dir(tmp_path, "llama")
    plain = flops_report(_cfg(d, attention="sdpa"), "h100")
    assert "left unexplained: 0.00 GFLOP\n" in render(plain)
    assert "technique" not in render(plain)
    lora = flops_report(_cfg(d, attention="sdpa", lora_rank=4), "h100")
    assert lora["reconciliation"]["unexplained"] < 0
    text = render(lora)
    assert "a technique changes the work: LoRA computes no gradients of frozen weights)" in text
    assert "window" not in text.split("left unexplained")[1].split("\n")[0]
    assert "no technique on" in _unexplained_cause(1e6, 1e9, {"lora_rank": 0, "window": None})


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_the_mfu_fallback_drops_only_the_models_position_table(tmp_path, monkeypatch, family):
    """Where a step cannot be counted, the MFU numerator is the rule over the model as built: it
    dropped max_seq_len x d_model (here 128 x 32 = 4,096 parameters, 6 x 4,096 FLOPs a token)
    from a rotary model too, which has no position table; GPT-2's ``wpe`` is still dropped."""
    import memtrain.training.train as train_mod
    from memtrain.analysis.flops.rules import attention_width
    from memtrain.training.step import build_state

    d = _model_dir(tmp_path, family)
    cfg = _cfg(d, attention="sdpa")
    state = build_state(cfg, torch.device("cpu"))
    own = _own_counts(d)
    assert (state.n_params, state.rule_dropped_params) == (own["parameters"], own["position_params"])

    def uncountable(cfg):
        raise RuntimeError("cannot trace")

    monkeypatch.setattr(train_mod, "counted_flops_per_step", uncountable)
    flops, source = train_mod._flops_per_rank_step(cfg, state.n_params, state.rule_dropped_params)
    m = cfg.model
    per_token = 6.0 * (own["parameters"] - own["position_params"]) + 12.0 * m.n_layers * attention_width(m) * S
    assert source == "rule"
    assert flops == per_token * B * S
    # Without the built model's count, the config's rule gives the same table.
    assert train_mod._flops_per_rank_step(cfg, state.n_params)[0] == flops


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt", "bloom"])
def test_the_configs_position_table_is_the_models(tmp_path, family):
    """The rule by the config alone (no built model) took ``max_seq_len x d_model`` for every
    model without rotary positions: OPT's table is two rows longer (64 parameters short here),
    and BLOOM's ALiBi has no table at all (it subtracted one). Now it counts the model built on
    the meta device; a rotary model is known to have none from its config."""
    from memtrain.analysis.flops.rules import config_position_params

    if family == "bloom":
        d = tmp_path / "bloom"
        transformers.BloomConfig(hidden_size=32, n_head=4, n_layer=2, vocab_size=VOCAB).save_pretrained(d)
    else:
        d = _model_dir(tmp_path, family)
    own = _own_counts(d)["position_params"]
    assert config_position_params(_cfg(d).model) == own
    assert own == {"llama": 0, "gpt2": 128 * 32, "opt": 130 * 32, "bloom": 0}[family]
