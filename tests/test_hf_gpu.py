"""transformers models on CUDA: the technique paths that exist only there (bitsandbytes QLoRA,
flex attention, SDPA's memory-efficient kernel, Liger's fused loss, flash_attention_2), each
trained for a few steps of the tiny configs of test_hf_models. Skipped without a GPU
(``-m gpu`` selects them; CPU CI skips them)."""

from __future__ import annotations

import math

import pytest
import torch

from test_hf_models import VOCAB, _corpus_texts, model_dirs, run_cfg, tokenizer_files  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The tiny corpus as plain text, a .txt file per document: reading .txt needs no optional
    package (.jsonl needs ``datasets``), so a GPU machine without ``datasets`` still runs these
    checks. (In one file the 200 texts would be read as seven 8 KB documents, and the
    document-level validation split would get none.)"""
    folder = tmp_path_factory.mktemp("gpucorpus")
    for i, text in enumerate(_corpus_texts()):
        (folder / f"post-{i:03d}.txt").write_text(text + "\n")
    return folder


def _skip_without_packages(tech: dict) -> None:
    """Skip, naming the package, when a technique's optional package is absent."""
    if tech.get("qlora"):
        pytest.importorskip("bitsandbytes", reason="--qlora on CUDA needs bitsandbytes")
    if tech.get("lora_rank"):
        pytest.importorskip("peft", reason="--lora-rank on a transformers model needs peft")
    if tech.get("loss_kernel") == "liger":
        pytest.importorskip("liger_kernel", reason="--loss-kernel liger needs liger-kernel")
    if tech.get("loss_kernel") == "cce":
        pytest.importorskip("cut_cross_entropy", reason="--loss-kernel cce needs cut-cross-entropy")


def _train(model_dir, corpus_path, tmp_path, **tech):
    from memtrain.training.train import train

    return train(run_cfg(model_dir, corpus_path, tmp_path, device="cuda", steps=12, **tech))


def _loss_falls(res) -> None:
    hist = res["loss_history"]
    assert all(math.isfinite(v) for v in hist), hist
    assert sum(hist[-3:]) / 3 < hist[0] - 0.3, hist  # from ln(384) ~ 5.95


@pytest.mark.parametrize("tech", [
    {"precision": "bf16", "attention": "sdpa"},
    {"precision": "bf16", "attention": "flex"},
    {"precision": "bf16", "attention": "mem-efficient"},
    {"precision": "bf16", "attention": "flash", "checkpointing": "full"},
    {"precision": "bf16", "loss": "chunked"},  # memtrain's chunked loss (one compiled call per chunk on CUDA)
    {"precision": "bf16", "loss": "chunked", "loss_kernel": "liger"},  # Liger's fused kernel
    {"precision": "bf16", "loss": "chunked", "loss_kernel": "cce"},  # Cut Cross-Entropy's
    {"precision": "bf16-pure", "lora_rank": 8, "qlora": True, "checkpointing": "full"},
])
def test_gpu_paths_train_a_transformers_model(model_dirs, corpus, tmp_path, tech):  # noqa: F811
    _skip_without_packages(tech)
    res = _train(model_dirs["llama"], corpus, tmp_path, **tech)
    _loss_falls(res)
    assert res["memory"]["max_allocated_bytes"] > 0


def test_bnb_qlora_stores_the_base_in_nf4(model_dirs, corpus, tmp_path):  # noqa: F811
    bnb = pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    from memtrain.techniques import make_precision
    from memtrain.training.step import build_state

    cfg = run_cfg(model_dirs["llama"], corpus, tmp_path, device="cuda", precision="bf16-pure",
                  lora_rank=8, qlora=True)
    dev = torch.device("cuda")
    state = build_state(cfg, dev, make_precision("bf16-pure", dev))
    four_bit = [n for n, p in state.model.named_parameters() if isinstance(p, bnb.nn.Params4bit)]
    assert four_bit and all("lora_" not in n for n in four_bit)
    assert all(p.requires_grad == ("lora_" in n) for n, p in state.model.named_parameters())


def test_flex_matches_sdpa_on_cuda(model_dirs, corpus, tmp_path):  # noqa: F811
    """Same weights, same batch: the loss and the gradients agree across attention backends."""
    from memtrain.techniques import make_precision
    from memtrain.training.step import build_state

    dev = torch.device("cuda")
    ids = torch.randint(0, VOCAB, (2, 33), device=dev)
    out = {}
    for attention in ("sdpa", "flex", "math"):
        cfg = run_cfg(model_dirs["llama"], corpus, tmp_path, device="cuda", attention=attention)
        torch.manual_seed(0)
        state = build_state(cfg, dev, make_precision("fp32", dev))
        state.model.eval()  # no dropout
        loss = state.model(ids[:, :-1], ids[:, 1:])
        loss = loss[1] if isinstance(loss, tuple) else loss
        loss.backward()
        out[attention] = (loss.detach(), [p.grad.detach().clone() for p in state.model.parameters() if p.grad is not None])
    for name in ("flex", "math"):
        torch.testing.assert_close(out[name][0], out["sdpa"][0], rtol=1e-4, atol=1e-4)
        for g, r in zip(out[name][1], out["sdpa"][1]):
            torch.testing.assert_close(g, r, rtol=1e-3, atol=1e-4)


def test_flash_attention_2_trains_where_installed(model_dirs, corpus, tmp_path):  # noqa: F811
    pytest.importorskip("flash_attn")
    _loss_falls(_train(model_dirs["llama"], corpus, tmp_path, precision="bf16", attention="flash-attn"))
