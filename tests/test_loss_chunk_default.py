"""``--loss-chunk 0`` (the default) runs 256 tokens a chunk on a CPU and, on CUDA, the largest power
1024, halved (down to 256) while its logits would hold more than 2^28 values (1024 for every
vocabulary up to 262,144 tokens: each chunk's pass over the weight gradient grows with the
vocabulary, so a large head needs large chunks as much as a small one); the loss
and the analytic estimate resolve it the same way; the CUDA path's logits and weight gradient are
laid out ``aligned_vocab`` wide in the estimate too."""

from __future__ import annotations

import pytest
import torch

from memtrain.analysis.estimate.training import estimate
from memtrain.config.run import ConfigError, TechniqueConfig, build_config
from memtrain.techniques.facts import LOSS_CHUNK_CPU, aligned_vocab, effective_loss_chunk
from memtrain.techniques.loss import chunked_lm_loss, make_loss_fn

SMALL = {"d_model": 32, "n_heads": 4, "n_layers": 2, "d_ff": 64, "max_seq_len": 64, "seq_len": 64,
         "batch_size": 40, "loss": "chunked", "precision": "bf16"}


def test_the_default_chunk_is_picked_by_device_and_vocabulary():
    assert TechniqueConfig().loss_chunk == 0
    assert effective_loss_chunk(0, "cpu", 50257) == effective_loss_chunk(0, "cpu", 151936) == LOSS_CHUNK_CPU == 256
    assert effective_loss_chunk(0, "mps", 50257) == 256  # any other device as a CPU
    # CUDA: GPT-2's 50257 (50304 aligned), Llama-3's 128256, Qwen2.5's 151936, Gemma's 256000 and
    # Gemma-3's 262144 (1024 x 262144 = 2^28 exactly) -> 1024; past 2^18 rows 512, past 2^19 256, never
    # fewer; a small vocabulary is capped at 1024
    for vocab, chunk in ((50257, 1024), (128256, 1024), (151936, 1024), (256000, 1024), (262144, 1024),
                         (262145, 512), (524288, 512), (524289, 256), (4_000_000, 256), (32000, 1024), (97, 1024)):
        assert effective_loss_chunk(0, "cuda", vocab) == effective_loss_chunk(0, "cuda:1", vocab) == chunk, vocab
    assert effective_loss_chunk(512, "cuda", 50257) == effective_loss_chunk(512, "cpu", 50257) == 512  # given: kept


def test_the_loss_resolves_the_chunk_at_each_call(monkeypatch):
    """make_loss_fn passes --loss-chunk on; 0 is resolved from the hidden states' device and the
    head's rows when the loss runs."""
    import memtrain.techniques.loss as loss_module

    fn = make_loss_fn(TechniqueConfig(loss="chunked"), torch.device("cpu"))
    assert fn.keywords == {"chunk": 0}  # type: ignore[attr-defined]  # a functools.partial
    seen: list[int] = []
    real = loss_module._chunked_forward

    def spy(hidden, weight, targets, chunk, *rest):
        seen.append(chunk)
        return real(hidden, weight, targets, chunk, *rest)

    monkeypatch.setattr(loss_module, "_chunked_forward", spy)
    hidden = torch.randn(300, 8, requires_grad=True)
    weight = torch.randn(50, 8, requires_grad=True)
    targets = torch.randint(0, 50, (300,))
    fn(hidden, weight, targets).backward()
    assert seen == [256]
    chunked_lm_loss(hidden, weight, targets, chunk=64).backward()
    assert seen == [256, 64]
    with pytest.raises(ValueError, match="positive"):
        chunked_lm_loss(hidden, weight, targets, chunk=-1)


def test_a_negative_chunk_is_refused():
    with pytest.raises(ConfigError, match="--loss-chunk must be positive"):
        build_config({"loss": "chunked", "loss_chunk": -1})


@pytest.mark.parametrize("device, chunk", [("cpu", 256), ("cuda", 1024)])  # GPT-2's vocabulary
def test_the_estimate_follows_the_devices_chunk(device, chunk):
    by_default = estimate(build_config(SMALL), device_type=device).to_dict()
    explicit = estimate(build_config({**SMALL, "loss_chunk": chunk}), device_type=device).to_dict()
    other = estimate(build_config({**SMALL, "loss_chunk": 2048 if chunk == 256 else 256}), device_type=device).to_dict()
    assert by_default == explicit
    assert by_default["peak_bytes"] != other["peak_bytes"]


def test_the_cuda_estimate_lays_the_chunk_buffers_out_aligned():
    """On CUDA the chunk's logits, its gradient, the weight copy and grad_w are aligned_vocab rows wide:
    an odd vocabulary costs what the next multiple of 64 costs; on a CPU exactly its own width."""
    def peak(vocab: int, device: str) -> int:
        cfg = build_config({**SMALL, "vocab_size": vocab, "loss_chunk": 256, "batch_size": 8})
        return int(estimate(cfg, device_type=device).to_dict()["bytes"]["logits"])

    assert aligned_vocab(50257) == 50304 and aligned_vocab(50304) == 50304
    assert peak(50257, "cuda") == peak(50304, "cuda")
    assert peak(50257, "cpu") < peak(50304, "cpu")  # the eager body: exactly vocab wide
