"""Bring your own model: transformers causal LMs through train, estimate --trace, maxbatch, plan.

Tiny configs of six families are written to disk as a user would bring them (config.json +
a tokenizer trained here with the `tokenizers` library, saved as a PreTrainedTokenizerFast),
so every test runs offline and in seconds.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from memtrain.config.run import ConfigError, build_config  # noqa: E402

SAMPLE = Path(__file__).resolve().parents[2] / "shared" / "data" / "stackoverflow_posts_sample.xml"
VOCAB = 384
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=128, vocab_size=VOCAB)
FAMILIES = {
    "llama": lambda **kw: transformers.LlamaConfig(**{**TINY, "num_key_value_heads": 2, **kw}),
    "qwen2": lambda **kw: transformers.Qwen2Config(**{**TINY, "num_key_value_heads": 2, **kw}),
    "mistral": lambda **kw: transformers.MistralConfig(**{**TINY, "num_key_value_heads": 2, "sliding_window": 64, **kw}),
    "gemma": lambda **kw: transformers.GemmaConfig(**{**TINY, "num_key_value_heads": 1, "head_dim": 16, **kw}),
    "phi3": lambda **kw: transformers.Phi3Config(**{**TINY, "num_key_value_heads": 4, "pad_token_id": 0, **kw}),
    "gpt2": lambda **kw: transformers.GPT2Config(**{"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128,
                                                     "vocab_size": VOCAB, **kw}),
}


# Tiny models: one thread (conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


def _corpus_texts() -> list[str]:
    words = ("memory gradient tensor batch layer attention optimizer checkpoint python function "
             "value error list string return class module import loop index").split()
    return [f"Question {i}: " + " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(40)) for i in range(200)]


@pytest.fixture(scope="session")
def tokenizer_files(tmp_path_factory) -> Path:
    """A byte-level BPE of VOCAB - 16 tokens (including <eos>; room for tokens a family's tokenizer class adds) saved as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 16, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = _corpus_texts()
    if SAMPLE.is_file():
        texts += [SAMPLE.read_text()[:200_000]]
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    d = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(d)
    return d


def make_model_dir(root: Path, family: str, tokenizer_dir: Path | None, weights: bool = False, **overrides) -> Path:
    import shutil

    d = root / family
    d.mkdir(parents=True, exist_ok=True)
    cfg = FAMILIES[family](**overrides)
    cfg.save_pretrained(d)
    if tokenizer_dir is not None:
        for f in tokenizer_dir.iterdir():
            shutil.copy(f, d / f.name)
    if weights:
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory, tokenizer_files) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {f: make_model_dir(root, f, tokenizer_files) for f in FAMILIES}


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hfcorpus")
    p = d / "posts.jsonl"
    p.write_text("".join(json.dumps({"text": t}) + "\n" for t in _corpus_texts()))
    return p


def run_cfg(model_dir: Path, corpus: Path, tmp_path: Path, **kw):
    base = {"model": str(model_dir), "data": str(corpus), "batch_size": 4, "seq_len": 32, "steps": 8,
            "warmup_steps": 0, "lr": 3e-3, "schedule": "constant", "val_blocks": 4, "progress": False,
            "out": str(tmp_path / "run"), "warmup_timing_steps": 1, "attention": "sdpa", "device": "cpu"}
    base.update(kw)
    return build_config(base)


# ------------------------------------------------------------------------------ spec and config
def test_spec_mirrors_the_model_shape(model_dirs):
    cfg = build_config({"model": str(model_dirs["llama"] / "config.json"), "seq_len": 32})
    assert (cfg.model.vocab_size, cfg.model.d_model, cfg.model.n_layers, cfg.model.max_seq_len) == (VOCAB, 64, 2, 128)
    big = build_config({"model": "llama-3-8b", "seq_len": 2048})
    assert (big.model.vocab_size, big.model.d_model, big.model.n_layers) == (128256, 4096, 32)


def test_bad_specs_are_config_errors(tmp_path):
    for spec in ("no-such-model", str(tmp_path), "hf:justaname"):
        with pytest.raises(ConfigError):
            build_config({"model": spec})
    with pytest.raises(ConfigError, match="analytic"):
        build_config({"model": "llama-7b"})
    with pytest.raises(ConfigError, match="did you mean --model llama-3-8b"):
        build_config({"model": "llama3-8b"})


def test_hub_spec_offline_is_a_clear_error(monkeypatch):
    """hf:ORG/NAME goes through the same from_pretrained as a directory; offline it must end in
    one ConfigError, not a traceback."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from memtrain.models.auto_config import load_config

    load_config.cache_clear()
    with pytest.raises(ConfigError, match="cannot read the model config of --model 'hf:memtrain-test/no-such-model'"):
        build_config({"model": "hf:memtrain-test/no-such-model"})


def test_seq_len_checked_against_the_models_positions(model_dirs):
    with pytest.raises(ConfigError, match="exceeds the max_position_embeddings 128 of --model"):
        build_config({"model": str(model_dirs["llama"]), "seq_len": 256})


# ------------------------------------------------------------------------------ numerics
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_loss_on_hidden_states_equals_transformers_loss(model_dirs, corpus, tmp_path, family):
    """Our forward (decoder -> final hidden -> loss_fn) is the same loss transformers computes
    from its own logits with labels (it shifts labels; memtrain's targets are already shifted)."""
    from memtrain.models import build_model
    from memtrain.techniques import make_precision, prepare_model

    cfg = run_cfg(model_dirs[family], corpus, tmp_path, attention="math")
    torch.manual_seed(0)
    model = prepare_model(build_model(cfg), cfg, torch.device("cpu"), make_precision("fp32", torch.device("cpu")))
    model.eval()
    ids = torch.randint(0, VOCAB, (2, 17))
    ours = model(ids[:, :-1], ids[:, 1:])
    theirs = model.lm(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma", "phi3"])
def test_bf16_pure_keeps_the_float32_buffers_transformers_keeps(model_dirs, corpus, tmp_path, family):
    """bf16-pure cast the whole model with Module.to, rope's inv_freq buffer too: its frequencies
    rounded to BF16 (up to 0.4% off) turned every position by other angles than transformers'
    own BF16 model (from_config/from_pretrained with dtype=bfloat16, as HF Trainer trains it)."""
    import transformers

    from memtrain.techniques import make_precision, prepare_model
    from memtrain.training.step import build_base_model

    cpu = torch.device("cpu")
    cfg = run_cfg(model_dirs[family], corpus, tmp_path, precision="bf16-pure", attention="math")
    precision = make_precision("bf16-pure", cpu)
    torch.manual_seed(0)
    ours = prepare_model(build_base_model(cfg, cpu, precision), cfg, cpu, precision).eval()
    config = transformers.AutoConfig.from_pretrained(str(model_dirs[family]), trust_remote_code=False)
    theirs = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="eager",
                                                          trust_remote_code=False).eval()
    buffers = dict(ours.lm.named_buffers())
    assert buffers and buffers.keys() == dict(theirs.named_buffers()).keys()
    for name, buffer in theirs.named_buffers():
        assert buffers[name].dtype == buffer.dtype and torch.equal(buffers[name], buffer), name
    theirs.load_state_dict(ours.lm.state_dict())
    ids = torch.randint(0, VOCAB, (1, 120), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ours.lm(ids).logits, theirs(ids).logits)


def test_chunked_loss_equals_standard_loss_and_gradients(model_dirs, corpus, tmp_path):
    from memtrain.models import build_model
    from memtrain.techniques import make_precision, prepare_model

    cpu = torch.device("cpu")
    ids = torch.randint(0, VOCAB, (2, 33))
    out = {}
    for loss in ("standard", "chunked"):
        cfg = run_cfg(model_dirs["qwen2"], corpus, tmp_path, loss=loss, loss_chunk=16)
        torch.manual_seed(0)
        model = prepare_model(build_model(cfg), cfg, cpu, make_precision("fp32", cpu))
        value = model(ids[:, :-1], ids[:, 1:])
        value.backward()
        out[loss] = (value.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(out["chunked"][0], out["standard"][0], rtol=1e-5, atol=1e-6)
    for name, g in out["standard"][1].items():
        torch.testing.assert_close(out["chunked"][1][name], g, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------ training
@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_trains_and_loss_falls(model_dirs, corpus, tmp_path, family):
    from memtrain.training.train import train

    res = train(run_cfg(model_dirs[family], corpus, tmp_path, steps=10))
    hist = res["loss_history"]
    assert len(hist) == 10 and all(math.isfinite(v) for v in hist)
    assert sum(hist[-3:]) / 3 < hist[0] - 0.3, hist  # falls from ln(384) ~ 5.95
    assert res["parameters"] > 0 and res["memory"]["peak_bytes"] > 0
    assert res["config"]["model"]["model"] == str(model_dirs[family])


@pytest.mark.skipif(not SAMPLE.is_file(), reason="StackOverflow sample not present")
def test_loss_falls_on_the_stackoverflow_sample(model_dirs, tmp_path):
    from memtrain.training.train import train

    cfg = run_cfg(model_dirs["llama"], SAMPLE, tmp_path, strip_html=True, max_documents=300, steps=12)
    res = train(cfg)
    hist = res["loss_history"]
    assert sum(hist[-3:]) / 3 < hist[0] - 0.5, hist
    assert res["data"]["train_tokens"] > 10_000


@pytest.mark.parametrize("tech", [
    {"attention": "math"},
    {"attention": "flash"},  # SDPA held to its flash kernel (CPU has one)
    {"checkpointing": "full"},
    {"checkpointing": "every:2"},
    {"checkpointing": "selective-matmul"},
    {"loss": "chunked", "loss_chunk": 32},
    {"lora_rank": 4},
    {"lora_rank": 4, "lora_targets": "q_proj,v_proj"},
    {"optim": "adafactor"},
    {"precision": "bf16", "loss": "chunked"},
    {"grad_accum": 2},
])
def test_techniques_train_on_a_transformers_model(model_dirs, corpus, tmp_path, tech):
    from memtrain.training.train import train

    res = train(run_cfg(model_dirs["llama"], corpus, tmp_path, steps=4, **tech))
    hist = res["loss_history"]
    assert all(math.isfinite(v) for v in hist)
    if "lora_rank" in tech:  # adapters start at B = 0: 4 steps barely move the loss of a random base
        assert 0 < res["trainable_parameters"] < res["parameters"] / 2
    else:
        assert hist[-1] < hist[0], hist


def test_flash_holds_sdpa_to_its_kernel_in_every_call_recompute_included(model_dirs, corpus, tmp_path, monkeypatch):
    """--attention flash on a transformers model: every SDPA call, the checkpointed layers'
    recomputation in backward included, runs with only the flash kernel enabled (a restriction
    around the forward alone left the recomputation free to pick another kernel, which stopped
    the step on CUDA)."""
    import torch.nn.functional as F

    from memtrain.techniques import make_precision
    from memtrain.training.step import build_state

    sdpa, seen = F.scaled_dot_product_attention, []

    def recording_sdpa(*args, **kwargs):
        seen.append((torch.backends.cuda.flash_sdp_enabled(),
                     torch.backends.cuda.math_sdp_enabled()))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording_sdpa)
    cfg = run_cfg(model_dirs["llama"], corpus, tmp_path, attention="flash", checkpointing="full")
    cpu = torch.device("cpu")
    state = build_state(cfg, cpu, make_precision("fp32", cpu))
    ids = torch.randint(0, VOCAB, (2, 33))
    state.model(ids[:, :-1], ids[:, 1:]).backward()
    layers = cfg.model.n_layers
    assert len(seen) == 2 * layers  # each layer's forward, then its recomputation in backward
    assert all(flash and not math_ for flash, math_ in seen), seen
    assert torch.backends.cuda.math_sdp_enabled()  # restored after each call


def test_checkpointing_and_chunked_loss_cut_the_tracked_peak(model_dirs, corpus, tmp_path):
    from memtrain.analysis.maxbatch import measure_step_memory

    base = run_cfg(model_dirs["llama"], corpus, tmp_path, seq_len=128)
    plain = measure_step_memory(base, 8)
    ckpt = measure_step_memory(base.replace(checkpointing="full"), 8)
    chunk = measure_step_memory(base.replace(loss="chunked", loss_chunk=64), 8)
    assert ckpt["by_category"]["activations"] < 0.6 * plain["by_category"]["activations"]
    assert chunk["peak_bytes"] < plain["peak_bytes"]


def test_lora_trains_only_the_adapters(model_dirs, corpus, tmp_path):
    from memtrain.models import build_model
    from memtrain.techniques import build_optimizer, make_precision, prepare_model
    from memtrain.training.step import train_step

    cpu = torch.device("cpu")
    cfg = run_cfg(model_dirs["gemma"], corpus, tmp_path, lora_rank=4, lora_targets="q_proj,v_proj")
    precision = make_precision("fp32", cpu)
    model = prepare_model(build_model(cfg), cfg, cpu, precision)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert {n.split(".")[-2] for n, p in model.named_parameters() if p.requires_grad} == {"default"}
    assert {n.split(".")[-4] for n, p in model.named_parameters() if p.requires_grad} == {"q_proj", "v_proj"}
    opt = build_optimizer(model, cfg.technique, cfg.train)
    ids = torch.randint(0, VOCAB, (2, 33))
    for _ in range(2):
        train_step(model, [(ids[:, :-1], ids[:, 1:])], opt, precision, 1.0, cpu)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) != p.requires_grad, n  # adapters moved, the base did not


def test_lora_freezes_the_base_and_shrinks_optimizer_state(model_dirs, corpus, tmp_path):
    from memtrain.analysis.maxbatch import measure_step_memory

    base = run_cfg(model_dirs["mistral"], corpus, tmp_path)
    full = measure_step_memory(base, 4)
    lora = measure_step_memory(base.replace(lora_rank=4), 4)
    assert lora["by_category"]["optimizer"] < 0.25 * full["by_category"]["optimizer"]


def test_qlora_nf4_on_cpu_stores_4bit_base_weights_and_trains(tmp_path_factory, tokenizer_files, corpus, tmp_path):
    """torchao NF4 needs weights of a multiple of 64 x 256 values: a 128-wide model."""
    from memtrain.analysis.maxbatch import measure_step_memory
    from memtrain.training.train import train

    d = make_model_dir(tmp_path_factory.mktemp("q"), "llama", tokenizer_files, hidden_size=128,
                       intermediate_size=256, num_key_value_heads=4)
    cfg = run_cfg(d, corpus, tmp_path, lora_rank=4, steps=4)
    lora = measure_step_memory(cfg, 4)
    qlora = measure_step_memory(cfg.replace(qlora=True), 4)
    # 7 decoder matrices per layer go from 4 bytes to ~0.5 byte per value (+ scales).
    assert qlora["by_category"]["parameters"] < lora["by_category"]["parameters"] - 2 * 7 * 128 * 128 * 3
    res = train(cfg.replace(qlora=True))
    assert res["loss_history"][-1] < res["loss_history"][0]


def test_qlora_says_once_which_weights_stay_unquantized(tmp_path_factory, tokenizer_files, corpus, tmp_path):
    """A 64-wide model: the 64 x 64 attention matrices do not fill NF4's blocks and stay in
    float. The run says so once; the FLOP count after the run (the MFU numerator), which builds
    the model again, said it a second time."""
    import warnings

    from memtrain.runtime.notices import QLoRASkipWarning
    from memtrain.training.train import train

    d = make_model_dir(tmp_path_factory.mktemp("q64"), "llama", tokenizer_files, hidden_size=64,
                       intermediate_size=256, num_key_value_heads=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(run_cfg(d, corpus, tmp_path, lora_rank=4, qlora=True, steps=2))
    assert len([w for w in caught if issubclass(w.category, QLoRASkipWarning)]) == 1


def test_qlora_says_a_mixture_of_experts_models_stacked_experts_stay_unquantized(tmp_path):
    """Mixtral's experts are 3-D tensors, not Linear weights: --qlora left them (most of the
    model) at full width and said nothing, so a run looked like a 4-bit base. It quantizes the
    Linears as before and says, once, which share stays in its dtype."""
    import warnings

    from memtrain.models.hf import build_hf_model
    from memtrain.models.qlora import quantize_base_weights
    from memtrain.runtime.notices import QLoRASkipWarning
    from memtrain.techniques.hf_mapping import apply_hf_lora

    d = tmp_path / "mixtral"
    transformers.MixtralConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128,
                               num_local_experts=4, num_experts_per_tok=2).save_pretrained(d)
    cfg = build_config({"model": str(d), "seq_len": 16, "lora_rank": 2, "qlora": True})
    model = build_hf_model(cfg, with_weights=False)
    apply_hf_lora(model, cfg.technique)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert quantize_base_weights(model, torch.device("cpu")) == 0  # every Linear fits NF4's blocks
    said = [str(w.message) for w in caught if issubclass(w.category, QLoRASkipWarning)]
    experts = 2 * 4 * (2 * 512 * 256 + 256 * 512)  # layers x experts x (gate_up + down)
    share = experts / sum({id(p): p.numel() for p in model.parameters()}.values())
    assert round(share, 2) == 0.83  # most of the model
    assert said == ["--qlora: 4 frozen weights of no Linear layer (83% of the parameters, e.g. "
                    "model.layers.0.mlp.experts.gate_up_proj: a mixture-of-experts layer's stacked experts) stay "
                    "unquantized in their dtype"], said
    assert hasattr(model.lm.model.layers[0].self_attn.q_proj.base_layer.weight, "get_original_weight")  # NF4
    # Another frozen 3-D weight (a convolution's, as in Falcon-H1's Mamba mixers) is said to stay too,
    # without being called an expert.
    other = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Conv1d(128, 128, 4, groups=128))
    other.requires_grad_(False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quantize_base_weights(other, torch.device("cpu"))
    assert [str(w.message) for w in caught] == ["--qlora: 1 frozen weights of no Linear layer (3% of the parameters, "
                                                "e.g. 1.weight) stay unquantized in their dtype"]

def test_qlora_without_lora_is_an_error(model_dirs, corpus, tmp_path):
    from memtrain.training.train import train

    with pytest.raises(ConfigError, match="lora-rank"):
        train(run_cfg(model_dirs["llama"], corpus, tmp_path, qlora=True))


def test_gpu_only_backends_are_clear_errors_on_cpu(model_dirs, corpus, tmp_path):
    from memtrain.training.train import train

    for attention in ("flash-attn", "flex", "mem-efficient"):
        with pytest.raises(ConfigError):
            train(run_cfg(model_dirs["llama"], corpus, tmp_path, attention=attention))


@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
def test_resume_is_exact(model_dirs, corpus, tmp_path, family):
    """GPT-2's dropouts (0.1) draw from the RNG the checkpoint saves; the end-of-run FLOP count,
    which builds the model again with peft's adapters (random init), must not move it."""
    from memtrain.analysis.flops.count import _count_step_cached
    from memtrain.training.train import train

    ckpt = tmp_path / "ck.pt"
    full = train(run_cfg(model_dirs[family], corpus, tmp_path, steps=6, lora_rank=4))
    _count_step_cached.cache_clear()  # as in a new process: the stopped run counts its FLOPs itself
    train(run_cfg(model_dirs[family], corpus, tmp_path, steps=6, lora_rank=4, stop_after=3, save=str(ckpt)))
    resumed = train(run_cfg(model_dirs[family], corpus, tmp_path, steps=6, lora_rank=4, resume=str(ckpt)))
    assert resumed["loss_history"] == full["loss_history"]


def test_pretrained_weights_are_loaded(tmp_path_factory, tokenizer_files, corpus, tmp_path):
    from memtrain.models import build_model

    d = make_model_dir(tmp_path_factory.mktemp("w"), "llama", tokenizer_files, weights=True)
    ref = transformers.AutoModelForCausalLM.from_pretrained(d)
    torch.manual_seed(123)  # a from_config build would draw different weights
    ours = build_model(run_cfg(d, corpus, tmp_path))
    torch.testing.assert_close(ours.lm.model.layers[0].mlp.up_proj.weight, ref.model.layers[0].mlp.up_proj.weight)


def test_vocabulary_mismatch_is_a_clear_error(tmp_path_factory, tokenizer_files, corpus, tmp_path):
    from memtrain.training.train import train

    d = make_model_dir(tmp_path_factory.mktemp("v"), "llama", tokenizer_files, vocab_size=100)
    with pytest.raises(ConfigError, match="tokenizer .* tokens .* vocab_size 100"):
        train(run_cfg(d, corpus, tmp_path))
    bare = make_model_dir(tmp_path_factory.mktemp("bare"), "llama", None)
    with pytest.raises(ConfigError, match="no tokenizer files"):
        train(run_cfg(bare, corpus, tmp_path))


# ------------------------------------------------------------------------------ estimate / trace
TRACE_GRID = [
    ("llama", {}),
    ("llama", {"checkpointing": "full"}),
    ("llama", {"loss": "chunked", "loss_chunk": 32}),
    ("qwen2", {"lora_rank": 4}),
    ("qwen2", {"attention": "math"}),
    ("mistral", {"checkpointing": "every:2", "lora_rank": 4}),
    ("gemma", {}),
    ("gemma", {"precision": "bf16", "lora_rank": 4}),
    ("phi3", {"optim": "sgd"}),
    ("gpt2", {}),  # HF's GPT2 with its default gelu_new and attention dropout in training
    ("gpt2", {"attention": "math", "checkpointing": "full"}),
]


@pytest.mark.parametrize("family,tech", TRACE_GRID)
def test_trace_matches_a_measured_step_within_one_percent(model_dirs, corpus, tmp_path, family, tech):
    """The fake-tensor trace of a transformers model's step against the tracked peak of the
    same step run for real (memtrain.analysis.maxbatch.measure_step_memory)."""
    from memtrain.analysis.maxbatch import measure_step_memory
    from memtrain.analysis.trace import trace_step

    cfg = run_cfg(model_dirs[family], corpus, tmp_path, seq_len=64, **tech)
    measured = measure_step_memory(cfg, 4)["peak_bytes"]
    traced = trace_step(cfg.replace(batch_size=4), "cpu")["peak_bytes"]
    assert abs(traced / measured - 1) < 0.01, (traced, measured)


@pytest.mark.parametrize("tech", [{}, {"lora_rank": 2}, {"optim": "sgd", "checkpointing": "full"}],
                         ids=["full", "lora", "sgd-ckpt"])
def test_a_mixture_of_experts_step_traces_in_float32_as_measured(corpus, tmp_path, tech):
    """A mixture-of-experts layer (Mixtral: its experts run torch's grouped_mm) was no estimate:
    torch's fake kernel of grouped_mm takes only the CUDA kernel's bf16 inputs, so the trace of
    the float32 step a CPU runs failed with exit 1 ("Expected inputs of BF16 type"). The trace
    now gives the float32 outputs the CPU kernel makes: equal to the measured step's peak."""
    from memtrain.analysis.maxbatch import measure_step_memory
    from memtrain.analysis.trace import trace_step

    d = tmp_path / "mixtral"
    transformers.MixtralConfig(**{**TINY, "num_key_value_heads": 2, "num_local_experts": 4,
                                  "num_experts_per_tok": 2}).save_pretrained(d)
    cfg = run_cfg(d, corpus, tmp_path, seq_len=32, **tech)
    measured = measure_step_memory(cfg, 2)["peak_bytes"]
    traced = trace_step(cfg.replace(batch_size=2), "cpu")["peak_bytes"]
    assert abs(traced / measured - 1) < 0.001, (traced, measured)

def test_lora_on_mixture_of_experts_warns_nothing_about_peft_own_patterns(tmp_path):
    """peft's all-linear on Mixtral adapts the stacked experts with its own rank pattern (twice
    the rank for the fused gate_up_proj), which it applies, then warns twice on stderr in
    train, export and generate that the pattern "matched no targeted module and was ignored".
    memtrain gives peft no pattern: the warning is not passed on, and the rank did apply."""
    import warnings

    from memtrain.models.hf import build_hf_model
    from memtrain.techniques.hf_mapping import apply_hf_lora

    d = tmp_path / "mixtral"
    transformers.MixtralConfig(**{**TINY, "num_key_value_heads": 2, "num_local_experts": 4,
                                  "num_experts_per_tok": 2}).save_pretrained(d)
    cfg = build_config({"model": str(d), "seq_len": 16, "lora_rank": 2})
    model = build_hf_model(cfg, with_weights=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_hf_lora(model, cfg.technique)
    assert not [w for w in caught if "pattern" in str(w.message)], [str(w.message) for w in caught]
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if "layers.0.mlp.experts" in n and "lora_A" in n}
    # 4 experts x rank 2 for down_proj; 4 experts x rank 4 for gate_up_proj: the pattern applied
    assert sorted(shapes.values()) == [(8, 128), (16, 64)], shapes

def test_estimate_cli_traces_a_transformers_model(model_dirs, capsys):
    from memtrain.cli import main

    rc = main(["estimate", "--model", str(model_dirs["qwen2"]), "--seq-len", "32", "--batch-size", "2",
               "--attention", "sdpa", "--lora-rank", "4", "--full-trace", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["method"] == "trace" and out["peak_bytes"] > 0
    assert set(out["bytes"]) == {"weights", "gradients", "optimizer", "activations", "logits", "temporaries"}
    assert out["bytes"]["gradients"] == 0  # LoRA: the base has no gradients... adapters' are freed by then
    # a preset of our GPT still goes the analytic way
    assert main(["estimate", "--model", "gpt2", "--seq-len", "64", "--batch-size", "1", "--json"]) == 0
    assert "method" not in json.loads(capsys.readouterr().out)


def test_a_traced_estimate_gives_the_adapter_count_under_the_analytic_key(tmp_path, capsys):
    """estimate's JSON has ``adapter_parameters`` (LoRA's A and B matrices; 0 without LoRA) beside
    ``parameters``: the analytic answer gave it, a traced family's (GPT-NeoX here) left it out
    while its text said "+ N LoRA adapter parameters". Both forms give it, equal to train's count."""
    from memtrain.cli import main

    d = tmp_path / "neox"
    transformers.GPTNeoXConfig(**TINY).save_pretrained(d)
    flags = ["estimate", "--model", str(d), "--seq-len", "32", "--batch-size", "2", "--json"]
    assert main(flags) == 0
    assert json.loads(capsys.readouterr().out)["adapter_parameters"] == 0
    assert main([*flags, "--lora-rank", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    from memtrain.models import build_model
    from memtrain.techniques.hf_mapping import apply_hf_lora

    cfg = build_config({"model": str(d), "seq_len": 32, "lora_rank": 2})
    with torch.device("meta"):
        model = build_model(cfg, with_weights=False)
    base = model.num_parameters()
    apply_hf_lora(model, cfg.technique)
    assert out["method"] != "analytic" and out["parameters"] == base
    assert out["adapter_parameters"] == out["trainable_parameters"] == model.num_parameters() - base > 0

def test_estimate_gpu_models_the_allocator_for_a_transformers_model(model_dirs, capsys):
    """--gpu on the analytic transformers path replays the step through the caching-allocator
    model (a traced family says it has none; tracing for CUDA needs a CUDA build of torch)."""
    from memtrain.cli import main

    base = ["estimate", "--seq-len", "32", "--batch-size", "2", "--attention", "sdpa", "--device-type", "cuda",
            "--gpu", "h100", "--json"]
    assert main(base + ["--model", str(model_dirs["llama"])]) == 0
    out = json.loads(capsys.readouterr().out)
    dmem = out["device_memory"]
    assert out["method"] == "analytic" and dmem["gpu"] == "h100"
    # allocated counts every tensor in 512-byte blocks plus the two cuBLAS workspaces (the
    # forward's and the backward thread's)
    assert dmem["allocated"] >= out["peak_bytes"] + 2 * dmem["cublas_workspace"]
    assert dmem["reserved"] >= dmem["allocated"]
    for family in ("llama", "gpt2"):  # the analytic and the traced path refuse CPU kernels alike
        assert main(["estimate", "--model", str(model_dirs[family]), "--seq-len", "32", "--gpu", "h100",
                     "--device-type", "cpu"]) == 2


# ------------------------------------------------------------------------------ maxbatch / plan
def test_maxbatch_on_a_transformers_model(model_dirs, capsys):
    from memtrain.cli import main

    args = ["maxbatch", "--model", str(model_dirs["llama"]), "--seq-len", "32", "--attention", "sdpa",
            "--max", "16", "--method", "measure", "--json"]
    assert main(args + ["--memory-budget", "4MiB"]) == 0
    small = json.loads(capsys.readouterr().out)
    assert main(args + ["--memory-budget", "6MiB"]) == 0
    large = json.loads(capsys.readouterr().out)
    assert 1 <= small["batch_size"] < large["batch_size"]
    assert small["peak_bytes"] <= small["budget_bytes"]


@pytest.mark.slow  # ~10 traces plus a real run with tokenization: ~20-60 s on a shared 2-core CPU
def test_plan_picks_and_verifies_on_a_transformers_model(model_dirs, capsys):
    """plan traces every candidate of a transformers model; --verify trains the pick for real
    (embedded default data through the model's own tokenizer) and the tracked peak agrees."""
    from memtrain.cli import main

    rc = main(["plan", "--model", str(model_dirs["qwen2"]), "--budget", "6MiB", "--seq-len", "32",
               "--batch-size", "4", "--precisions", "fp32", "--attentions", "sdpa", "--losses", "standard,chunked",
               "--checkpointings", "none,full", "--verify", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["candidates"]
    assert any("traced" in n for n in out["notes"])
    v = out["verified"]
    assert abs(v["error"]) < 0.01, v


def test_flops_counts_a_transformers_model_by_class(model_dirs, capsys):
    from memtrain.cli import main

    assert main(["flops", "--model", str(model_dirs["llama"]), "--seq-len", "32", "--batch-size", "2",
                 "--attention", "sdpa", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    ops = {o["name"]: o["flops"] for o in out["ops"]}
    assert {"qkv", "attn_proj", "mlp_fc", "mlp_fc_out", "lm_head"} <= set(ops)
    # 2 layers x (q 64x64 + k,v 64x32 each) x 64 tokens x 2 FLOPs x 3 (forward + two backward matmuls)
    assert ops["qkv"] == pytest.approx(2 * (64 * 64 + 2 * 64 * 32) * 64 * 2 * 3, rel=0.01)


def test_train_cli_with_a_model_directory(model_dirs, corpus, tmp_path, capsys):
    from memtrain.cli import main

    out = tmp_path / "cli"
    rc = main(["train", "--model", str(model_dirs["phi3"]), "--data", str(corpus), "--steps", "3",
               "--batch-size", "2", "--seq-len", "32", "--attention", "sdpa", "--no-progress", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "result.json").read_text())
    assert res["config"]["model"]["model"] == str(model_dirs["phi3"]) and res["config"]["model"]["vocab_size"] == VOCAB
    capsys.readouterr()  # the first run's output (its warm-up note) is not the bad spec's
    assert main(["train", "--model", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --model")
    assert not (tmp_path / "x").exists()


def test_train_refuses_a_folder_whose_weights_are_only_pickled(tmp_path_factory, tokenizer_files, corpus, tmp_path,
                                                                capsys):
    from memtrain.cli import main

    d = make_model_dir(tmp_path_factory.mktemp("pickled"), "llama", tokenizer_files, weights=True)
    (d / "model.safetensors").unlink()
    torch.save({}, d / "pytorch_model.bin")  # never read: training it from random weights would be silent
    capsys.readouterr()  # save_pretrained's progress bar is not the run's
    out = tmp_path / "run"
    assert main(["train", "--model", str(d), "--data", str(corpus), "--steps", "2", "--batch-size", "2",
                 "--seq-len", "32", "--attention", "sdpa", "--no-progress", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --model"), err
    assert "pytorch_model.bin" in err[0] and "*.safetensors" in err[0]
    assert not (out / "result.json").exists()


def test_train_refuses_a_folder_whose_safetensors_index_names_absent_files(tmp_path_factory, tokenizer_files,
                                                                            corpus, tmp_path, capsys):
    """A folder with its weights' index and none of the shards it names (not copied) trained from
    random weights with no word; the folder declares weights, so the run is refused."""
    import json

    from memtrain.cli import main

    d = make_model_dir(tmp_path_factory.mktemp("index"), "llama", tokenizer_files)
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    capsys.readouterr()
    out = tmp_path / "run"
    assert main(["train", "--model", str(d), "--data", str(corpus), "--steps", "2", "--batch-size", "2",
                 "--seq-len", "32", "--attention", "sdpa", "--no-progress", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has model.safetensors.index.json but none of the *.safetensors files" in err[0], err
    assert not (out / "result.json").exists()


def test_qlora_trace_matches_a_measured_step(tmp_path_factory, corpus, tmp_path):
    """NF4 base weights under fake tensors: the trace equals the real step's tracked peak."""
    from memtrain.analysis.maxbatch import measure_step_memory
    from memtrain.analysis.trace import trace_step

    d = make_model_dir(tmp_path_factory.mktemp("qt"), "llama", None, hidden_size=128,
                       intermediate_size=256, num_key_value_heads=4)
    cfg = run_cfg(d, corpus, tmp_path, seq_len=64, lora_rank=4, qlora=True, checkpointing="full",
                  loss="chunked", loss_chunk=32)
    measured = measure_step_memory(cfg, 4)["peak_bytes"]
    traced = trace_step(cfg.replace(batch_size=4), "cpu")["peak_bytes"]
    assert abs(traced / measured - 1) < 0.01, (traced, measured)


def test_qlora_resume_is_exact(tmp_path_factory, tokenizer_files, corpus, tmp_path):
    """NF4 base weights go through the checkpoint (weights_only load) and back."""
    from memtrain.training.train import train

    d = make_model_dir(tmp_path_factory.mktemp("qr"), "llama", tokenizer_files, hidden_size=128,
                       intermediate_size=256, num_key_value_heads=4)
    kw = dict(steps=4, lora_rank=4, qlora=True)
    full = train(run_cfg(d, corpus, tmp_path, **kw))
    train(run_cfg(d, corpus, tmp_path, stop_after=2, save=str(tmp_path / "q.pt"), **kw))
    resumed = train(run_cfg(d, corpus, tmp_path, resume=str(tmp_path / "q.pt"), **kw))
    assert resumed["loss_history"] == full["loss_history"]


def test_attention_core_checkpointing_is_refused_for_transformers_models(model_dirs, corpus, tmp_path):
    """Megatron's selective policy needs memtrain's attention seam; a transformers layer has none,
    so the run is refused before anything is built rather than run with another policy."""
    from memtrain.training.train import train

    with pytest.raises(ConfigError, match="selective-matmul"):
        train(run_cfg(model_dirs["llama"], corpus, tmp_path, steps=2, checkpointing="selective"))


def _step_results(cfg, ids):
    """(loss, parameters after one AdamW step) of one training step from seed 0."""
    from memtrain.models import build_model
    from memtrain.techniques import build_optimizer, make_precision, prepare_model
    from memtrain.training.step import train_step

    cpu = torch.device("cpu")
    precision = make_precision("fp32", cpu)
    torch.manual_seed(0)
    model = prepare_model(build_model(cfg), cfg, cpu, precision)
    opt = build_optimizer(model, cfg.technique, cfg.train)
    loss = train_step(model, [(ids[:, :-1], ids[:, 1:])], opt, precision, 1.0, cpu)
    return loss, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("policy", ["full", "every:2"])
def test_opt_trains_with_checkpointing_as_without(tmp_path, corpus, policy):
    """OPT keeps its layers under model.decoder: checkpointing finds them there, and the
    checkpointed step computes what the plain step does."""
    from memtrain.models import build_model

    d = tmp_path / "opt"
    transformers.OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                           max_position_embeddings=128, vocab_size=VOCAB, word_embed_proj_dim=64).save_pretrained(d)
    ids = torch.randint(0, VOCAB, (2, 33))
    plain = _step_results(run_cfg(d, corpus, tmp_path), ids)
    cfg = run_cfg(d, corpus, tmp_path, checkpointing=policy)
    assert len(build_model(cfg).blocks) == 2
    ckpt = _step_results(cfg, ids)
    torch.testing.assert_close(ckpt[0], plain[0], rtol=0, atol=0)
    assert ckpt[1].keys() == plain[1].keys()
    for name, p in plain[1].items():
        torch.testing.assert_close(ckpt[1][name], p, rtol=1e-6, atol=1e-7)


def _gemma2_dir(tmp_path: Path) -> Path:
    d = tmp_path / "gemma2"
    transformers.Gemma2Config(**{**TINY, "num_key_value_heads": 2, "head_dim": 16, "final_logit_softcapping": 3.0,
                                 "attn_logit_softcapping": 50.0}).save_pretrained(d)
    return d


@pytest.mark.parametrize("loss", ["chunked", "naive"])
def test_a_fused_loss_on_a_head_with_a_bias_is_refused_naming_the_loss_and_the_fix(tmp_path, capsys, loss):
    """Phi-2's LM head has a bias, which the fused losses (they take the head's weight alone)
    cannot apply: the refusal came from inside the first forward, named --loss chunked for
    --loss naive as well, and said nothing to do. It names the loss asked for and the one to use."""
    from memtrain.cli import main

    d = tmp_path / "phi"
    transformers.PhiConfig(**TINY).save_pretrained(d)
    flags = ["estimate", "--model", str(d), "--seq-len", "32", "--batch-size", "2"]
    assert main([*flags, "--loss", loss]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: --loss {loss} needs an LM head without a bias; --model {str(d)!r} has one: use --loss "
                   "standard"), err
    assert main([*flags, "--loss", "standard"]) == 0


def test_the_forward_refuses_a_fused_loss_on_a_head_with_a_bias_in_the_same_words(tmp_path):
    """A model whose fused loss was set without prepare_hf_model (library use) meets the
    forward's own refusal: it says what the command's refusal says, not "--loss chunked" for
    every fused loss with nothing to do."""
    from memtrain.models.hf import build_hf_model
    from memtrain.techniques.loss import NaiveLoss

    d = tmp_path / "phi"
    transformers.PhiConfig(**TINY).save_pretrained(d)
    model = build_hf_model(build_config({"model": str(d), "seq_len": 16}), with_weights=False)
    model.loss_fn = NaiveLoss()  # --loss naive's
    idx = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ConfigError) as caught:
        model(idx, idx)
    assert str(caught.value) == (f"--loss chunked or naive needs an LM head without a bias; --model {str(d)!r} has "
                                 "one: use --loss standard")


@pytest.mark.parametrize("family", ["cohere", "granite", "falcon_h1"])
@pytest.mark.parametrize("loss", ["standard", "chunked"])
def test_scaled_logits_train_with_the_models_own_loss(tmp_path, corpus, family, loss):
    """Cohere multiplies its logits by logit_scale after the LM head (Falcon-H1 by
    lm_head_multiplier), Granite divides them by logits_scaling: memtrain's losses read the head's weight and left the scale out, so a run
    trained (and reported the perplexity of) other logits than the model's (Cohere's tiny model:
    loss 5.961 against transformers' 5.950, logits 1.27 apart). Every loss equals transformers'
    own now, the fused one included, and the logits are the model's."""
    from memtrain.models import build_model
    from memtrain.techniques import make_precision, prepare_model

    d = tmp_path / family
    config = {"cohere": lambda: transformers.CohereConfig(**TINY, num_key_value_heads=2, logit_scale=0.25),
              "granite": lambda: transformers.GraniteConfig(**TINY, num_key_value_heads=2, logits_scaling=8.0),
              "falcon_h1": lambda: transformers.FalconH1Config(**TINY, num_key_value_heads=2, lm_head_multiplier=0.5,
                                                               mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
                                                               mamba_d_state=16)}[family]()
    config.save_pretrained(d)
    cpu = torch.device("cpu")
    cfg = run_cfg(d, corpus, tmp_path, loss=loss, loss_chunk=16)
    torch.manual_seed(0)
    model = prepare_model(build_model(cfg), cfg, cpu, make_precision("fp32", cpu))
    model.eval()
    ids = torch.randint(0, VOCAB, (2, 17))
    with torch.no_grad():
        theirs = model.lm(input_ids=ids, labels=ids).loss
        torch.testing.assert_close(model(ids[:, :-1], ids[:, 1:]), theirs, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(ids), model.lm(input_ids=ids).logits, rtol=1e-5, atol=1e-5)

def test_gemma2_soft_capped_logits_train_with_the_standard_loss(tmp_path, corpus, capsys):
    """Gemma-2's final_logit_softcapping is applied by the standard loss (the loss equals
    transformers' own); the fused losses, which never hold the logits, are refused in one line;
    the estimate traces it."""
    from memtrain.cli import main
    from memtrain.models import build_model
    from memtrain.techniques import make_precision, prepare_model

    d = _gemma2_dir(tmp_path)
    cpu = torch.device("cpu")
    cfg = run_cfg(d, corpus, tmp_path, attention="math")
    torch.manual_seed(0)
    model = prepare_model(build_model(cfg), cfg, cpu, make_precision("fp32", cpu))
    model.eval()
    ids = torch.randint(0, VOCAB, (2, 17))
    theirs = model.lm(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(model(ids[:, :-1], ids[:, 1:]), theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model(ids), model.lm(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    for loss in ("chunked", "naive"):
        with pytest.raises(ConfigError, match="final_logit_softcapping.*--loss standard"):
            fused = run_cfg(d, corpus, tmp_path, attention="math", loss=loss)
            prepare_model(build_model(fused), fused, cpu, make_precision("fp32", cpu))
    flags = ["estimate", "--model", str(d), "--seq-len", "32", "--batch-size", "2", "--attention", "math", "--json"]
    assert main(flags) == 0
    assert json.loads(capsys.readouterr().out)["method"] == "trace"
    assert main([*flags, "--loss", "chunked"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "--loss standard" in err[0]
    # transformers has no SDPA path for Gemma-2: the refusal names memtrain's eager option.
    assert main([*flags[:-3], "--attention", "sdpa", "--json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "use --attention math" in err[0] and "http" not in err[0]


def test_a_folder_with_weights_refusing_sdpa_blames_the_attention_not_the_weights(tmp_path, corpus, capsys):
    """transformers refuses --attention sdpa for Gemma-2 while reading its weights too: the line
    names the attention and memtrain's eager option, not the (sound) *.safetensors files."""
    from memtrain.cli import main

    d = _gemma2_dir(tmp_path)
    transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(d)).save_pretrained(d)
    capsys.readouterr()  # transformers' progress bar while writing
    flags = ["train", "--model", str(d), "--data", str(corpus), "--steps", "1", "--batch-size", "1",
             "--seq-len", "16", "--out", str(tmp_path / "run")]
    assert main([*flags, "--attention", "sdpa"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "use --attention math" in err[0] and "cannot read the weights" not in err[0], err
    assert not (tmp_path / "run").exists()


def test_lora_on_gpt2s_conv1d_layers_asks_peft_for_their_layout(model_dirs, corpus, tmp_path):
    """GPT-2's projections are Conv1D (weight stored in x out): the adapters are made for that
    layout without peft's per-layer warning, and the model with fresh adapters computes what the
    base does (lora_B starts at zero)."""
    import warnings

    from memtrain.models import build_model
    from memtrain.techniques import make_precision, prepare_model

    cpu = torch.device("cpu")
    cfg = run_cfg(model_dirs["gpt2"], corpus, tmp_path, lora_rank=4)
    base = build_model(cfg)
    ids = torch.randint(0, VOCAB, (2, 16))
    with torch.no_grad():
        want = base.eval().lm(ids).logits  # eval: no dropout
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = prepare_model(base, cfg, cpu, make_precision("fp32", cpu))
    assert not [w for w in caught if "fan_in_fan_out" in str(w.message)]
    assert all(m.fan_in_fan_out for n, m in model.named_modules() if n.endswith("c_attn"))
    with torch.no_grad():
        assert torch.equal(model.eval().lm(ids).logits, want)
