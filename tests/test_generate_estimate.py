"""estimate --mode inference against a measured ``generate``: tiny transformers models (and
memtrain's GPT as generate runs it) sample on the CPU under the tracked memory meter, with the
GenerationConfig memtrain generate uses; the estimate's peak must be within 1% of the measured
peak and its KV cache exactly the bytes of the DynamicCache generate filled.

1%, not the 5% aimed at: the estimate counts the tensors transformers' code holds, so what is left
is the rotary inv_freq buffers (a few hundred bytes), a decode step's small per-token tensors
(Phi-3's fused q/k/v output) and, at bf16, the float32 RMSNorm's (tokens, 1) statistics; measured
errors on this grid are under 0.1% (docs/estimation.md).
"""

from __future__ import annotations

import json

import pytest
import torch

from memtrain.analysis.estimate import GPT2_ARCH, estimate_inference
from memtrain.cli import main
from memtrain.config.run import build_config
from memtrain.metrics import MemoryMeter

transformers = pytest.importorskip("transformers")

VOCAB = 512
_BASE = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=VOCAB, max_position_embeddings=1024)


def _config(family: str, **over):
    """A tiny config of ``family`` (GPT-2: with gelu_new, or gelu_pytorch_tanh as memtrain's export)."""
    if family.startswith("gpt2"):
        act = "gelu_pytorch_tanh" if family == "gpt2-tanh" else "gelu_new"
        return transformers.GPT2Config(**{**dict(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=1024,
                                                 bos_token_id=0, eos_token_id=0, activation_function=act), **over})
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "phi3": transformers.Phi3Config,
           "gemma": transformers.GemmaConfig, "mistral": transformers.MistralConfig}[family]
    extra = {"phi3": dict(pad_token_id=0), "gemma": dict(head_dim=16), "mistral": dict(sliding_window=None)}
    return cls(**{**_BASE, **extra.get(family, {}), **over})


def _measure(model, batch: int, prompt: int, new_tokens: int, cache=None, vocab: int = VOCAB) -> int:
    """Peak tracked bytes of memtrain generate's sampling call on ``model`` (weights included)."""
    from memtrain.inference.generate import generation_config, sample_ids

    torch.manual_seed(0)
    x = torch.randint(1, vocab, (batch, prompt))
    extra = {} if cache is None else {"cache": cache}
    meter = MemoryMeter(model)
    with torch.no_grad(), meter:
        meter.track(x)
        sample_ids(model, x, generation_config(new_tokens, 0.8, 50, 0), **extra)
    return meter.stats().peak_bytes


def _saved(tmp_path, config, dtype):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
    model.save_pretrained(tmp_path)
    return model


def _estimate(capsys, *flags: str) -> dict:
    assert main(["estimate", "--mode", "inference", *flags, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# How a grid case's overrides show in its id.
_ID_PARTS = {"intermediate_size": "-narrow", "n_inner": "-narrow", "num_key_value_heads": "-mha",
             "use_sliding_window": "", "max_window_layers": "-all_slide"}


def _id_parts(over: dict) -> str:
    """A case's overrides in its id (one k/v head: "-mqa"; an MLP wider than the base's: "-wide")."""
    return "".join("-mqa" if (k, v) == ("num_key_value_heads", 1) else
                   "-wide" if k in ("intermediate_size", "n_inner") and v > _BASE["intermediate_size"] else
                   f"-v{v}" if k == "vocab_size" else f"-h{v}" if k in ("hidden_size", "n_embd") else _ID_PARTS[k]
                   for k, v in over.items())

# family, dtype, batch, prompt, new tokens: prefill-bound, decode-bound, attention-bound, sampling-bound
GRID = [
    ("llama", "fp32", 4, 64, 32, {}),
    ("llama", "fp32", 4, 16, 200, {}),
    ("llama", "bf16", 4, 64, 32, {}),
    ("llama", "bf16", 4, 64, 4, dict(intermediate_size=16)),
    ("llama", "fp32", 8, 4, 2, {}),
    ("llama", "fp32", 4, 64, 4, dict(intermediate_size=16, num_key_value_heads=4)),  # rope on k peaks
    ("qwen2", "fp32", 2, 32, 64, {}),
    ("mistral", "fp32", 3, 48, 20, {}),
    ("phi3", "fp32", 4, 64, 4, dict(intermediate_size=16)),
    ("phi3", "fp32", 2, 8, 300, {}),
    ("gemma", "bf16", 4, 64, 8, {}),
    ("gpt2", "fp32", 4, 16, 200, {}),
    ("gpt2", "bf16", 4, 64, 8, {}),
    ("gpt2-tanh", "fp32", 2, 16, 100, {}),
    ("gpt2", "fp32", 4, 64, 4, dict(n_inner=16)),
    # One-token prompts and a wide MLP: the last decode step's MLP over one token a sequence is the
    # peak (left out, the estimate was -4.8% and -6.5%).
    ("llama", "fp32", 16, 1, 3, dict(intermediate_size=1024)),
    ("gpt2", "fp32", 16, 1, 3, dict(n_inner=1024)),
    # A vocabulary under 2.4 x top-k's 50 on a narrow model: torch.topk's values and indices are
    # the sampling head's busiest point (left out, -3.1% and -6.6%).
    ("llama", "fp32", 16, 2, 3, dict(hidden_size=16, intermediate_size=16, vocab_size=97)),
    ("gpt2", "bf16", 16, 2, 3, dict(n_embd=16, n_inner=16, vocab_size=61)),
    # A batch of 64 one-token prompts on a narrow model: a decode step's four int64 tensors of one
    # entry a sequence (its input ids and positions, the last sampled tokens, the unfinished flags)
    # (left out, -2.6%).
    ("llama", "fp32", 64, 1, 2, dict(hidden_size=16, intermediate_size=16, vocab_size=17)),
]


@pytest.mark.parametrize("family,dtype,batch,prompt,new,over", GRID,
                         ids=[f"{g[0]}-{g[1]}-b{g[2]}-s{g[3]}-n{g[4]}" + _id_parts(g[5]) for g in GRID])
def test_generate_peak_matches_the_measured_one(tmp_path, capsys, family, dtype, batch, prompt, new, over):
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = _saved(tmp_path, _config(family, **over), torch_dtype)
    measured = _measure(model, batch, prompt, new, vocab=over.get("vocab_size", VOCAB))
    est = _estimate(capsys, "--model", str(tmp_path), "--weights-dtype", dtype, "--batch-size", str(batch),
                    "--seq-len", str(prompt), "--new-tokens", str(new))
    # `pytest -s` prints the figures docs/estimation.md quotes
    print(f"\n{family} {dtype} b{batch} s{prompt} n{new}{_id_parts(over)}: measured {measured:,} B, "
          f"estimated {est['peak_bytes']:,} B ({est['peak_bytes'] / measured - 1:+.3%}), {est['peak_phase']}; "
          f"KV cache {est['bytes']['kv_cache']:,} B")
    assert est["peak_bytes"] == pytest.approx(measured, rel=0.01), (est["peak_phase"], est["phase_bytes"], measured)
    assert est["bytes"]["weights"] == sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_kv_cache_is_exactly_the_dynamic_cache(tmp_path, capsys, family):
    model = _saved(tmp_path, _config(family), torch.float32)
    cache = transformers.DynamicCache(config=model.config)
    _measure(model, 3, 20, 12, cache=cache)
    held = sum(t.untyped_storage().nbytes() for layer in cache.layers for t in (layer.keys, layer.values))
    est = _estimate(capsys, "--model", str(tmp_path), "--weights-dtype", "fp32", "--batch-size", "3",
                    "--seq-len", "20", "--new-tokens", "12")
    assert est["cache_positions"] == 20 + 12 - 1 and cache.get_seq_length() == est["cache_positions"]
    assert est["bytes"]["kv_cache"] == held


def test_our_gpt_generates_as_gpt2_with_its_cache():
    """memtrain generate samples memtrain's GPT as GPT2LMHeadModel (memtrain.inference.export):
    its real vocabulary (not the padded table), biases, gelu_pytorch_tanh, a DynamicCache."""
    from memtrain.inference.export import to_hf_model
    from memtrain.models.gpt import GPT

    cfg = build_config(dict(vocab_size=500, vocab_multiple=64, d_model=64, n_heads=4, n_layers=2, d_ff=256,
                            max_seq_len=128, dropout=0.0, batch_size=4, seq_len=48))
    torch.manual_seed(0)
    hf = to_hf_model(GPT(cfg.model), cfg)
    measured = _measure(hf, 4, 48, 40, vocab=500)
    est = estimate_inference(cfg, "fp32", GPT2_ARCH, new_tokens=40)
    assert est["peak_bytes"] == pytest.approx(measured, rel=0.01)
    assert est["bytes"]["kv_cache"] == 2 * 2 * 4 * 64 * (48 + 40 - 1) * 4


def _error_line(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("flags,expect", [
    (["--weights-dtype", "int8"], "choose fp32, bf16, fp16"),
    (["--attention", "math"], "loads the model with SDPA"),
    (["--trace"], "drop --trace"),
    (["--new-tokens", "0"], "memtrain's GPT only"),
    (["--seq-len", "1000", "--new-tokens", "100"], "exceeds the model's 1024 positions"),
    (["--window", "16"], "drop --window"),
])
def test_what_generate_does_not_model_is_one_error_line(tmp_path, capsys, flags, expect):
    _config("llama").save_pretrained(tmp_path)
    assert expect in _error_line(capsys, ["estimate", "--mode", "inference", "--model", str(tmp_path), *flags])


# A sliding window on every layer (config.json's sliding_window): family, dtype, batch, prompt, new
# tokens, window, overrides. The window caps the cache in decode (prompt + new past it), masks the
# prefill (prompt >= window: repeated k/v, the float mask), or neither (the sliding cache's update
# still holds both old tensors); a prompt longer than the window is freed in the first decode step.
WINDOWED = [
    ("mistral", "fp32", 3, 16, 200, 32, {}),
    ("mistral", "fp32", 4, 8, 40, 64, dict(intermediate_size=16)),
    ("mistral", "fp32", 3, 48, 40, 32, {}),
    ("mistral", "bf16", 4, 64, 8, 32, {}),
    ("mistral", "fp32", 4, 64, 4, 16, dict(intermediate_size=16)),
    ("mistral", "bf16", 4, 64, 4, 16, dict(intermediate_size=16)),
    ("mistral", "fp32", 4, 64, 4, 16, dict(intermediate_size=16, num_key_value_heads=4)),
    ("mistral", "fp32", 2, 200, 3, 8, dict(intermediate_size=16)),
    ("phi3", "fp32", 2, 8, 300, 64, {}),
    ("phi3", "fp32", 4, 64, 4, 16, dict(intermediate_size=16)),
    ("phi3", "bf16", 4, 64, 4, 16, dict(intermediate_size=16)),
    ("qwen2", "fp32", 2, 32, 64, 16, dict(use_sliding_window=True, max_window_layers=0)),
    # One k/v head: repeat_kv's expand-and-reshape is a view, no copy (counted as two q-wide
    # copies, the masked prefill was +7.9% in both).
    ("mistral", "bf16", 5, 64, 4, 5, dict(intermediate_size=16, num_key_value_heads=1)),
    ("phi3", "fp32", 3, 40, 2, 3, dict(intermediate_size=16, num_key_value_heads=1)),
]


@pytest.mark.parametrize("family,dtype,batch,prompt,new,window,over", WINDOWED,
                         ids=[f"{g[0]}-{g[1]}-b{g[2]}-s{g[3]}-n{g[4]}-w{g[5]}" + _id_parts(g[6])
                              for g in WINDOWED])
def test_a_sliding_window_cache_matches_the_measured_generate(tmp_path, capsys, family, dtype, batch, prompt, new,
                                                              window, over):
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = _saved(tmp_path, _config(family, sliding_window=window, **over), torch_dtype)
    cache = transformers.DynamicCache(config=model.config)
    assert all(layer.is_sliding for layer in cache.layers)
    measured = _measure(model, batch, prompt, new, cache=cache)
    est = _estimate(capsys, "--model", str(tmp_path), "--weights-dtype", dtype, "--batch-size", str(batch),
                    "--seq-len", str(prompt), "--new-tokens", str(new))
    print(f"\n{family} {dtype} b{batch} s{prompt} n{new} window {window}: measured {measured:,} B, "
          f"estimated {est['peak_bytes']:,} B ({est['peak_bytes'] / measured - 1:+.3%}), {est['peak_phase']}")
    assert est["peak_bytes"] == pytest.approx(measured, rel=0.01), (est["peak_phase"], est["phase_bytes"], measured)
    # The cache generate leaves: each layer's storage (a view of the last window - 1 positions of it).
    held = sum(t.untyped_storage().nbytes() for layer in cache.layers for t in (layer.keys, layer.values))
    assert est["bytes"]["kv_cache"] == held
    assert est["cache_positions"] == cache.get_seq_length() == prompt + new - 1
    assert est["cache_stored_positions"] == min(prompt + new - 1, window)


def test_a_prompt_past_the_window_names_its_masked_sdpa(tmp_path, capsys):
    _config("mistral", sliding_window=16, intermediate_size=16).save_pretrained(tmp_path)
    est = _estimate(capsys, "--model", str(tmp_path), "--weights-dtype", "fp32", "--batch-size", "4",
                    "--seq-len", "64", "--new-tokens", "4")
    assert est["peak_phase"] == "prefill (the last layer's masked SDPA)"


@pytest.mark.parametrize("window,full_layers", [(None, 0), (8, 0), (40, 0), (200, 0), (8, 1), (40, 2)])
@pytest.mark.parametrize("prompt,cached", [(24, 24), (24, 60), (100, 100)])
def test_a_decode_steps_cache_update_peaks_as_counted(window, full_layers, prompt, cached):
    """The cache's bytes at their busiest while a decode step adds one position, measured on
    transformers' own cache layers (DynamicLayer; DynamicSlidingWindowLayer, whose first step after
    a prompt longer than the window frees that prompt layer by layer; Qwen2's mix of the two)."""
    from memtrain.analysis.estimate.generation import _update_bytes

    L, b, kv_heads, hd = 3, 2, 2, 8
    if full_layers:
        config = _config("qwen2", sliding_window=window, num_hidden_layers=L, use_sliding_window=True,
                         max_window_layers=full_layers)
    else:
        config = _config("mistral", sliding_window=window, num_hidden_layers=L)
    cache = transformers.DynamicCache(config=config)
    windows = [window if layer.is_sliding else None for layer in cache.layers]
    assert sum(w is None for w in windows) == (L if window is None else full_layers)
    kv = lambda n: torch.randn(b, kv_heads, n, hd)  # noqa: E731 - a key or value of n positions
    for i in range(L):
        cache.update(kv(prompt), kv(prompt), i)
    for _ in range(cached - prompt):
        for i in range(L):
            cache.update(kv(1), kv(1), i)
    keep = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    meter = MemoryMeter(torch.nn.Linear(1, 1, bias=False))
    with meter:
        meter.track(*keep)
        del keep
        for i in range(L):
            cache.update(kv(1), kv(1), i)
    # Besides the cache: the meter's module (one float32 weight) and the step's new key and value
    # (the token's tensors in the estimate).
    others = 4 + 2 * b * kv_heads * hd * 4
    assert meter.stats().peak_bytes - others == _update_bytes(b, kv_heads * hd, 4, prompt, cached, windows)


@pytest.mark.parametrize("prompt,new", [(32, 64), (8, 60), (40, 2)])
def test_qwen2s_full_and_sliding_layers_match_the_measured_generate(tmp_path, capsys, prompt, new):
    """Qwen2's max_window_layers: its first layer attends to every position (a DynamicLayer), the
    two after it slide (the window caps their cache, masks their prefill)."""
    config = _config("qwen2", num_hidden_layers=3, sliding_window=16, use_sliding_window=True, max_window_layers=1)
    model = _saved(tmp_path, config, torch.float32)
    cache = transformers.DynamicCache(config=model.config)
    assert [layer.is_sliding for layer in cache.layers] == [False, True, True]
    measured = _measure(model, 2, prompt, new, cache=cache)
    est = _estimate(capsys, "--model", str(tmp_path), "--weights-dtype", "fp32", "--batch-size", "2",
                    "--seq-len", str(prompt), "--new-tokens", str(new))
    assert est["peak_bytes"] == pytest.approx(measured, rel=0.01), (est["peak_phase"], est["phase_bytes"], measured)
    held = sum(t.untyped_storage().nbytes() for layer in cache.layers for t in (layer.keys, layer.values))
    assert est["bytes"]["kv_cache"] == held and est["sliding_layers"] == 2


# A random sweep (seed 5151) left three configurations outside 1%, each modelled since: Gemma's
# norm keeps one per-token float32 statistic, not two (+1.36% prefill); a one-layer model's layer
# input is the embedding itself in a decode step too (+1.13%); Phi-3 holds its fused q/k/v output
# to o_proj in a decode step, the step's peak (-1.24%). A later sweep (seeds 2020 and 2121): where the
# cache is short (one-token prompts) the last layer's rope, before its cache grows, outweighs the update:
# q's three one-token temporaries, or k's beside q's result (left out, -1.47%).
SWEPT = [
    ("gemma", "bf16", 2, 33, 2, dict(hidden_size=12, intermediate_size=3, num_hidden_layers=1, num_attention_heads=6,
                                     num_key_value_heads=3, vocab_size=61, head_dim=2, tie_word_embeddings=False)),
    ("gemma", "bf16", 8, 2, 5, dict(hidden_size=96, intermediate_size=3, num_hidden_layers=1, num_attention_heads=6,
                                    num_key_value_heads=6, vocab_size=61, head_dim=16)),
    ("phi3", "fp32", 4, 1, 2, dict(hidden_size=72, intermediate_size=3, num_hidden_layers=2, num_attention_heads=6,
                                   num_key_value_heads=3, vocab_size=131, tie_word_embeddings=False)),
    ("llama", "bf16", 4, 1, 2, dict(hidden_size=20, intermediate_size=20, num_hidden_layers=2, num_attention_heads=1,
                                    num_key_value_heads=1, vocab_size=17)),
]


@pytest.mark.parametrize("family,dtype,batch,prompt,new,over", SWEPT,
                         ids=[f"{g[0]}-{g[1]}-h{g[5]['hidden_size']}-L{g[5]['num_hidden_layers']}-b{g[2]}-s{g[3]}-n{g[4]}"
                              for g in SWEPT])
def test_swept_generate_peaks_match_the_measured_one(tmp_path, capsys, family, dtype, batch, prompt, new, over):
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = _saved(tmp_path, _config(family, **over), torch_dtype)
    measured = _measure(model, batch, prompt, new, vocab=over["vocab_size"])
    est = _estimate(capsys, "--model", str(tmp_path), "--weights-dtype", dtype, "--batch-size", str(batch),
                    "--seq-len", str(prompt), "--new-tokens", str(new))
    assert est["peak_bytes"] == pytest.approx(measured, rel=0.01), (est["peak_phase"], est["phase_bytes"], measured)


def test_a_window_of_one_position_is_refused(tmp_path, capsys):
    """transformers' sliding cache keeps positions [-window + 1:]: a window of 1 keeps them all."""
    _config("mistral", sliding_window=1).save_pretrained(tmp_path)
    err = _error_line(capsys, ["estimate", "--mode", "inference", "--model", str(tmp_path), "--seq-len", "32"])
    assert "sliding_window 1 in config.json is not modelled" in err and "at least 2" in err


def test_the_cli_prints_the_cache_and_the_peak_phase(capsys):
    assert main(["estimate", "--mode", "inference", "--model", "llama-3-8b", "--batch-size", "8", "--seq-len", "2048",
                 "--new-tokens", "2048"]) == 0
    out = capsys.readouterr().out
    assert "KV cache (end of generate)" in out and "4.00 GiB" in out and "4095 positions" in out
    assert "decode cache update" in out and "attention=" not in out


def test_the_cache_at_the_peak_is_the_cache_written_by_then(tmp_path, capsys):
    """Before the last layer's cache update (Llama's rope) the cache holds one layer less; at its
    RMSNorm (bf16, a narrow MLP) and in decode every layer's."""
    _config("llama", intermediate_size=16).save_pretrained(tmp_path)
    flags = ["--model", str(tmp_path), "--batch-size", "4", "--seq-len", "64", "--new-tokens", "4"]
    layer = 2 * 4 * 32 * 64  # k and v of one layer: batch x kv width x prompt, one byte each
    fp32 = _estimate(capsys, *flags, "--weights-dtype", "fp32")
    bf16 = _estimate(capsys, *flags, "--weights-dtype", "bf16")
    assert fp32["peak_phase"] == bf16["peak_phase"] == "prefill (the last layer before its MLP)"
    assert fp32["kv_cache_at_peak"] == 4 * layer  # rope on q, layer 1's cache not written yet
    assert bf16["kv_cache_at_peak"] == 2 * 2 * layer  # the post-attention RMSNorm: both layers'


def test_the_default_weights_dtype_is_named_beside_what_generate_loads(capsys):
    """estimate --mode inference sizes bf16 weights by default where memtrain generate loads them as
    stored (float32 for a folder saved in it): the `defaults used:` line names the default, and
    only when --weights-dtype was not given; the JSON holds the dtype sized either way."""
    flags = ["estimate", "--mode", "inference", "--model", "tiny-llama", "--seq-len", "16", "--new-tokens", "4"]
    assert main(flags) == 0
    note = capsys.readouterr().out.strip().splitlines()[-1]
    assert note.startswith("defaults used: ") and "weights-dtype bf16 (memtrain generate loads the weights as stored" in note
    assert main([*flags, "--weights-dtype", "bf16"]) == 0
    assert "weights-dtype" not in capsys.readouterr().out
    assert main([*flags, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["weights_dtype"] == "bf16"
