"""export and generate take a transformers checkpoint's weights as they are in the file.

The checkpoint is mapped, not read (its optimizer state is never touched), the model's
parameters are the checkpoint's own tensors in the dtypes training kept them in,
LoRA is merged in FP32 and rounded once, and the file is never written. Before, the model was
built in FP32 and the weights copied in: a BF16 checkpoint took up to three times its size in
host memory (an 8B model: 16 GB read, 32 GB copied), more than a 24 GiB machine holds.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import test_hf_models as hf_models  # noqa: E402
from memtrain.config.run import build_config  # noqa: E402
from tiny_families import tiny_config  # noqa: E402

tokenizer_files = hf_models.tokenizer_files  # the tiny BPE tokenizer fixture


def _write_checkpoint(folder: Path, ckpt: Path, lora_rank: int = 0, tokenizer: Path | None = None,
                      **overrides: object) -> None:
    """A memtrain checkpoint of a Llama config (head tied to the embedding) in BF16 (``bf16-pure``), as train --save writes its
    model and config, with learned-looking (non-zero) adapters when ``lora_rank``, and the
    ``tokenizer`` folder's files beside the config (needed to export or sample)."""
    from memtrain.models.hf import build_hf_model
    from memtrain.techniques.hf_mapping import apply_hf_lora

    tiny_config("llama", 2, **{"tie_word_embeddings": True, **overrides}).save_pretrained(folder)
    for f in tokenizer.iterdir() if tokenizer is not None else ():
        shutil.copy(f, folder / f.name)
    cfg = build_config({"model": str(folder), "seq_len": 16, "precision": "bf16-pure", "attention": "sdpa",
                        "lora_rank": lora_rank})
    torch.manual_seed(0)
    model = build_hf_model(cfg, with_weights=False).to(torch.bfloat16)
    if lora_rank:
        apply_hf_lora(model, cfg.technique)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
    optimizer = {"state": {0: {"exp_avg": torch.ones(1000)}}}  # mapped and never read
    torch.save({"model": model.state_dict(), "config": cfg.to_dict(), "optimizer": optimizer}, ckpt)


def test_the_unmerged_model_holds_the_checkpoints_own_tensors_in_their_dtypes(tmp_path):
    from memtrain.inference.export import _load_transformers, read_checkpoint

    ckpt = tmp_path / "ck.pt"
    _write_checkpoint(tmp_path / "m", ckpt, lora_rank=4)
    state, cfg = read_checkpoint(ckpt)
    weights = state["model"]
    model = _load_transformers(weights, cfg, ckpt, merge=False)
    params = dict(model.named_parameters())
    base = "lm.model.layers.0.self_attn.q_proj.base_layer.weight"
    adapter = "lm.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert params[base].dtype == torch.bfloat16 and params[adapter].dtype == weights[adapter].dtype
    # No copy: the parameter is the checkpoint's tensor (its storage), not a copy of it.
    assert params[base].data_ptr() == weights[base].data_ptr()
    assert params[adapter].data_ptr() == weights[adapter].data_ptr()
    # The head and the embedding are one tensor again after the one-by-one assignment.
    assert model.lm.lm_head.weight is model.lm.model.embed_tokens.weight


def test_merge_is_in_fp32_rounded_once_and_the_checkpoint_file_is_never_written(tmp_path):
    from memtrain.inference.export import _load_transformers, read_checkpoint

    ckpt = tmp_path / "ck.pt"
    _write_checkpoint(tmp_path / "m", ckpt, lora_rank=4)
    before = hashlib.sha256(ckpt.read_bytes()).hexdigest()
    reference = torch.load(ckpt, weights_only=True)["model"]
    state, cfg = read_checkpoint(ckpt)
    merged = _load_transformers(state["model"], cfg, ckpt, merge=True)
    prefix = "lm.model.layers.1.mlp.down_proj."
    w, a, b = (reference[prefix + k] for k in ("base_layer.weight", "lora_A.default.weight", "lora_B.default.weight"))
    scale = cfg.technique.lora_alpha / cfg.technique.lora_rank
    expected = (w.float() + scale * (b.float() @ a.float())).to(torch.bfloat16)  # one rounding
    got = dict(merged.named_parameters())["lm.model.layers.1.mlp.down_proj.weight"]
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)
    assert not torch.equal(got, w)  # the adapter did change the weight
    # The merge wrote into mapped tensors: the private mapping copied those pages, the file kept its bytes.
    assert hashlib.sha256(ckpt.read_bytes()).hexdigest() == before


def test_loading_a_bf16_checkpoint_holds_no_copy_of_its_weights(tmp_path):
    """Measured in a fresh process: the anonymous memory (RssAnon: not the file's mapped pages,
    which the kernel may drop and read again) a loaded model holds, against the checkpoint's
    weight bytes. When the file was read and its weights copied into an FP32 model then cast
    back, the model held a copy of all of them."""
    ckpt = tmp_path / "ck.pt"
    # About 40M parameters, 80 MB in BF16: large beside the interpreter's own noise.
    _write_checkpoint(tmp_path / "m", ckpt, hidden_size=512, intermediate_size=1376, num_attention_heads=8,
                      num_key_value_heads=8, num_hidden_layers=8, vocab_size=32000)
    weights = torch.load(ckpt, weights_only=True)["model"]
    weight_bytes = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in weights.values()}.values())
    script = textwrap.dedent(f"""
        import gc
        from memtrain.inference.export import load_trained
        import transformers.models.llama.modeling_llama  # imported before the baseline

        def anonymous():
            for line in open("/proc/self/status"):
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024

        before = anonymous()
        model, _ = load_trained({str(ckpt)!r})
        gc.collect()
        print(anonymous() - before)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    held = int(out.stdout.strip().splitlines()[-1])
    print(f"the loaded model holds {held} anonymous bytes for {weight_bytes} weight bytes")
    assert weight_bytes > 60e6
    assert held < 0.25 * weight_bytes, (held, weight_bytes)


def test_a_checkpoint_sampled_in_bf16_keeps_ropes_float32_frequencies_as_its_export(tmp_path, tokenizer_files):
    """generate CKPT --dtype bf16 cast the whole model with Module.to, rope's inv_freq buffer too:
    its frequencies rounded to BF16 turned far positions by other angles than training and than
    the export read in BF16 (whose inv_freq transformers computes in float32), so the same seed
    could sample other text from a checkpoint than from its export."""
    from memtrain.inference.export import export_hf
    from memtrain.inference.generate import load_for_sampling

    ckpt = tmp_path / "ck.pt"
    _write_checkpoint(tmp_path / "m", ckpt, tokenizer=tokenizer_files, max_position_embeddings=512)
    export_hf(ckpt, tmp_path / "hf")
    from_ckpt, _, _ = load_for_sampling(ckpt, torch.bfloat16)
    from_export, _, _ = load_for_sampling(tmp_path / "hf", torch.bfloat16)
    ours, theirs = dict(from_ckpt.named_buffers()), dict(from_export.named_buffers())
    assert ours.keys() == theirs.keys() and ours
    for name, buffer in ours.items():
        assert buffer.dtype == theirs[name].dtype and torch.equal(buffer, theirs[name]), name
    assert next(from_ckpt.parameters()).dtype == torch.bfloat16
    idx = torch.randint(0, 384, (1, 500), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(from_ckpt(idx).logits, from_export(idx).logits)


def test_a_bf16_checkpoint_exports_on_a_host_its_fp32_build_would_not_fit(tmp_path, tokenizer_files, monkeypatch,
                                                                          capsys):
    """The size check before an export counted every parameter in FP32 (a build's bytes): an 8B
    BF16 checkpoint, which the in-place load holds in 16 GB, was refused on a 24 GiB host."""
    import memtrain.training.size_check as size_check
    from memtrain.cli import main
    from memtrain.inference.export import read_checkpoint

    ckpt = tmp_path / "ck.pt"
    _write_checkpoint(tmp_path / "m", ckpt, tokenizer=tokenizer_files)
    params = size_check.model_parameters(read_checkpoint(ckpt)[1].model)
    monkeypatch.setattr(size_check, "host_memory_bytes", lambda: 3 * params)  # BF16 fits, FP32 does not
    capsys.readouterr()
    assert main(["export", str(ckpt), str(tmp_path / "hf")]) == 0, capsys.readouterr().err
    state = torch.load(ckpt, weights_only=True)
    for name in state["model"]:
        state["model"][name] = state["model"][name].float()
    torch.save(state, tmp_path / "fp32.pt")
    assert main(["export", str(tmp_path / "fp32.pt"), str(tmp_path / "hf32")]) == 2
    assert "in FP32, more than this machine's" in capsys.readouterr().err
