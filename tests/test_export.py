"""Export to transformers' GPT2LMHeadModel (same logits), merged LoRA, and `memtrain generate`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import TINY_MODEL
from memtrain.cli import main

transformers = pytest.importorskip("transformers")

FLAGS = [x for k, v in TINY_MODEL.items() for x in ("--" + k.replace("_", "-"), str(v))]


def _train(tmp_path: Path, *extra: str) -> Path:
    ckpt = tmp_path / "ck.pt"
    assert main(["train", "--steps", "3", "--batch-size", "1", "--seq-len", "16", "--val-blocks", "1",
                 "--no-progress", "--warmup-steps", "1", "--lr", "3e-3", "--out", str(tmp_path / "r"),
                 "--save", str(ckpt), *FLAGS, *extra]) == 0
    return ckpt


def _same_logits(ckpt: Path, out: Path) -> None:
    from memtrain.inference.export import load_trained

    ours, _ = load_trained(ckpt)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    idx = torch.randint(0, 50257, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(idx), hf(idx).logits
    assert a.shape == b.shape == (2, 24, 50257)
    assert (a - b).abs().max().item() < 1e-5


@pytest.mark.parametrize("extra", [(), ("--vocab-multiple", "64", "--untie-embeddings", "--no-bias")],
                         ids=["tied", "padded-untied-nobias"])
def test_export_loads_in_transformers_with_equal_logits(tmp_path, capsys, extra):
    ckpt = _train(tmp_path, *extra)
    out = tmp_path / "hf"
    assert main(["export", str(ckpt), str(out)]) == 0
    assert {"config.json", "model.safetensors", "vocab.json", "merges.txt", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["activation_function"] == "gelu_pytorch_tanh" and cfg["vocab_size"] == 50257
    _same_logits(ckpt, out)
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok("Hello world")["input_ids"] == [15496, 995]


@pytest.mark.parametrize("padded_vocab", [False, True], ids=["real-vocab", "padded-vocab"])
@pytest.mark.parametrize("shape", [{}, {"vocab_multiple": 64, "untie_embeddings": True},
                                   {"vocab_multiple": 64, "bias": False}], ids=["tied", "padded-untied", "padded-nobias"])
def test_gpt2_conversion_gives_memtrains_logits(shape, padded_vocab):
    """The one conversion of our GPT into GPT2LMHeadModel (export, generate and the HF comparison
    build on it) computes our logits: its GELU is ours bit for bit (transformers' gelu_pytorch_tanh
    is F.gelu(approximate="tanh"); gelu_new, the tanh formula written out, is not), and with
    ``padded_vocab`` (the comparison's) the padded embedding table is kept: the real tokens'
    logits are ours, the padded tokens' are 0."""
    import torch.nn.functional as F

    from memtrain.config.run import build_config
    from memtrain.inference.export import to_hf_model
    from memtrain.models.gpt import GPT

    cfg = build_config({**TINY_MODEL, "vocab_size": 1000, "seq_len": 32, **shape})
    torch.manual_seed(0)
    ours = GPT(cfg.model).eval()
    with torch.no_grad():  # non-zero biases, so that a dropped or misplaced one changes the logits
        for name, p in ours.named_parameters():
            if name.endswith("bias"):
                p.normal_(std=0.1)
    hf = to_hf_model(ours, cfg, padded_vocab=padded_vocab)
    V = cfg.model.vocab_size
    rows = cfg.model.padded_vocab_size if padded_vocab else V
    assert hf.config.vocab_size == rows and hf.config.eos_token_id is None  # 50256 is no token of 1000
    if padded_vocab and cfg.model.bias:
        assert hf.num_parameters() == ours.num_parameters()
    x = torch.linspace(-8, 8, 20001)
    assert torch.equal(hf.transformer.h[0].mlp.act(x), F.gelu(x, approximate="tanh"))
    idx = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(idx), hf(idx).logits
    assert b.shape == (2, 24, rows)
    torch.testing.assert_close(b[..., :V], a, atol=1e-5, rtol=1e-5)
    assert torch.equal(b[..., V:], torch.zeros_like(b[..., V:]))


def test_export_merges_lora(tmp_path, capsys):
    pytest.importorskip("peft")
    ckpt = _train(tmp_path, "--lora-rank", "4")
    out = tmp_path / "hf"
    assert main(["export", str(ckpt), str(out)]) == 0
    assert "LoRA merged" in capsys.readouterr().out
    _same_logits(ckpt, out)
    state = torch.load(ckpt, weights_only=True)["model"]
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in state.items())  # the adapters did learn
    # An adapter of our GPT would not fit GPT2LMHeadModel's Conv1D layout: merged export only.
    capsys.readouterr()
    assert main(["export", str(ckpt), str(tmp_path / "adapter"), "--adapter-only"]) == 2
    assert capsys.readouterr().err.startswith("error: --adapter-only") and not (tmp_path / "adapter").exists()


def test_export_refuses_bad_input(tmp_path, capsys):
    assert main(["export", str(tmp_path / "none.pt"), str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.startswith("error: checkpoint")
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    assert main(["export", str(bad), str(tmp_path / "o")]) == 2
    assert not (tmp_path / "o").exists()


def test_export_into_the_current_folder_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch):
    """`export CKPT .` in an empty folder passed the empty-folder check, wrote the whole export
    beside it and then failed to rename it onto the current folder (EBUSY, exit 1). It is bad
    input, said before the checkpoint is read; an export by name there still works."""
    ckpt = _train(tmp_path)
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    capsys.readouterr()
    for dest in (".", "./", ".."):
        assert main(["export", str(ckpt), dest]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error:") and "give a new directory by name" in err and err.count("\n") == 1
    assert list(here.iterdir()) == []
    assert main(["export", str(ckpt), "model"]) == 0
    assert (here / "model" / "config.json").is_file()


def test_export_to_a_path_that_is_not_utf8_is_refused_before_the_checkpoint_is_read(tmp_path, capsys, monkeypatch):
    """The tokenizers library writes to UTF-8 paths only: an OUT_DIR named with a byte that is not
    UTF-8 read the checkpoint, wrote the weights, then failed with "TypeError: failed to extract
    enum PyVocab" (exit 1). One line (exit 2) before the checkpoint is read; nothing is left."""
    import os

    from memtrain.inference import export as module

    ckpt = _train(tmp_path)
    out = os.fsdecode(bytes(tmp_path) + b"/model\xff")

    def must_not_read(*args, **kwargs):
        raise AssertionError("the checkpoint was read")

    monkeypatch.setattr(module, "read_checkpoint", must_not_read)
    capsys.readouterr()
    assert main(["export", str(ckpt), out]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "is not a UTF-8 path" in err and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.pt", "r"]


def test_export_to_a_name_of_up_to_255_bytes_is_written(tmp_path, capsys):
    """The export is written in a scratch folder beside OUT and renamed: that folder was named
    ".OUT.<random>.tmp", 14 bytes longer than OUT, so a valid name of 242-255 bytes failed once
    the checkpoint was read (`File name too long`). The scratch folder's name is its own now."""
    ckpt = _train(tmp_path)
    out = tmp_path / ("m" * 250)
    assert main(["export", str(ckpt), str(out)]) == 0, capsys.readouterr().err
    assert (out / "config.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_generate_is_seeded_from_checkpoint_and_export(tmp_path, capsys):
    ckpt = _train(tmp_path)
    capsys.readouterr()
    args = ["--prompt", "The", "--max-new-tokens", "8", "--seed", "3"]
    assert main(["generate", str(ckpt), *args]) == 0
    first = capsys.readouterr().out
    assert main(["generate", str(ckpt), *args]) == 0
    assert capsys.readouterr().out == first and first.startswith("The") and len(first) > len("The\n")
    out = tmp_path / "hf"
    assert main(["export", str(ckpt), str(out)]) == 0
    capsys.readouterr()
    assert main(["generate", str(out), *args]) == 0
    assert capsys.readouterr().out == first


def test_an_exports_files_have_the_mode_the_umask_gives(tmp_path, capsys):
    """Every file of an export, the weights included, and the folder get the mode `open` and
    `mkdir` give under the umask, as the checkpoint and result.json do: safetensors wrote
    model.safetensors 0600, so another user who could read the export's config.json and tokenizer
    (and the checkpoint) could not load the model."""
    import os
    import stat

    old = os.umask(0o022)
    exports = {}
    try:
        ckpt = _train(tmp_path)
        # 0o007: a group that shares its files (the group may write them, others nothing).
        for mask in (0o022, 0o007):
            os.umask(mask)
            exports[mask] = tmp_path / f"hf-{mask:03o}"
            assert main(["export", str(ckpt), str(exports[mask])]) == 0
    finally:
        os.umask(old)
    for mask, out in exports.items():
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
        assert "model.safetensors" in modes and "config.json" in modes
        assert modes == dict.fromkeys(modes, 0o666 & ~mask), {k: oct(v) for k, v in modes.items()}
        assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~mask
    assert stat.S_IMODE(ckpt.stat().st_mode) == 0o644
