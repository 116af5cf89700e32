"""--distributed on a transformers --model: 2 ranks on gloo (CPU), launched as users launch it
(``python -m torch.distributed.run``, the module behind torchrun), each run compared with one
process training the same tiny Llama on the same global batch (2 ranks x batch 2 == 1 x 4).

Each torchrun launch costs ~15-50 s on a shared 2-core CPU, so those tests are marked slow and
one launch carries most checks (FSDP2 + LoRA + checkpointing + chunked loss); by default the
wrap is checked in this process on a 1-rank group (structure, and training through ``train``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import cli_flags
from memtrain.config.run import build_config
from memtrain.training.train import train

transformers = pytest.importorskip("transformers")

TIMEOUT_S = 300  # per torchrun call; far above its normal duration, so only a hang reaches it
LOSS_RTOL = 1e-5  # as tests/test_distributed.py: the same sums in another order (~1e-7 measured)
RUN = {"seq_len": 32, "steps": 4, "warmup_steps": 1, "val_blocks": 4, "warmup_timing_steps": 1, "lr": 1e-2}
# All of it at once on the decoder layers FSDP2 shards: frozen base weights beside trainable
# adapters in one parameter group, checkpoint wrappers around the layers, the loss on hidden states.
COMPOSED = {"lora_rank": 4, "checkpointing": "full", "loss": "chunked", "loss_chunk": 16}


def _llama(root: Path, tie: bool) -> Path:
    d = root / ("llama-tied" if tie else "llama")
    # GPT-2's vocabulary (memtrain's BPE reads the corpus); two layers: two FSDP2 groups + the root.
    transformers.LlamaConfig(vocab_size=50257, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                             eos_token_id=50256, bos_token_id=50256, tie_word_embeddings=tie).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def llamas(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dist-hf")
    return {"untied": _llama(root, False), "tied": _llama(root, True)}


def _torchrun(settings: dict, cache: Path) -> dict:
    out = Path(settings["out"])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "memtrain", "train", *cli_flags({**settings, "progress": False})]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEMTRAIN_CACHE": str(cache)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "result.json").read_text())


def _single(settings: dict, out: Path) -> dict:
    """The reference: one process, the global batch (2 x the per-rank batch)."""
    return train(build_config({**settings, "batch_size": 2 * settings["batch_size"], "progress": False,
                               "out": str(out)}))


def _assert_same_training(dist_run: dict, single: dict) -> None:
    assert dist_run["loss_history"] == pytest.approx(single["loss_history"], rel=LOSS_RTOL)
    assert dist_run["val_loss"] == pytest.approx(single["val_loss"], rel=LOSS_RTOL)
    assert dist_run["tokens"] == single["tokens"]  # the global batch
    assert single["loss_history"][-1] < single["loss_history"][0]  # it trained: a wrong update would show


@pytest.mark.slow  # one torchrun launch plus a reference run: 25-55 s on the shared 2-core CPU
def test_fsdp2_with_lora_checkpointing_and_chunked_loss_matches_one_process(llamas, small_corpus, tmp_path):
    """FSDP2 per decoder layer on a transformers model, with LoRA (frozen base weights in the
    sharded groups), full checkpointing and the chunked loss: the same losses as one process,
    only the adapters get gradients and optimizer state, and the per-rank analytic estimate
    (memtrain estimate --world-size 2 --shard fsdp) matches each rank's tracked peak."""
    from memtrain.analysis.estimate.hf import analytic_estimate

    base = {"model": str(llamas["untied"]), "data": str(small_corpus), **RUN, **COMPOSED, "batch_size": 2}
    res = _torchrun({**base, "distributed": "fsdp", "out": str(tmp_path / "fsdp")}, tmp_path / "cache")
    single = _single(base, tmp_path / "one")
    _assert_same_training(res, single)
    assert res["distributed"] == {"strategy": "fsdp", "world_size": 2, "backend": "gloo"}
    # Only the adapters train: r x (in + out) per targeted Linear (7 per layer, 2 layers).
    lora = sum(4 * (i + o) for i, o in [(16, 16), (16, 8), (16, 8), (16, 16), (16, 32), (16, 32), (32, 16)]) * 2
    assert res["trainable_parameters"] == single["trainable_parameters"] == lora
    for rank in res["ranks"]:
        held = rank["sharded_state"]
        # each rank holds half of the adapters' FP32 gradients and two AdamW moments (+ step counters) ...
        assert held["gradients"] == pytest.approx(4 * lora / 2, rel=0.05)
        assert held["optimizer"] <= 8 * lora / 2 * 1.05 + 4 * 64
        # ... and half of every weight, frozen ones included (the 50257 x 16 embedding and head dominate)
        assert held["parameters"] == pytest.approx(4 * (res["parameters"] + lora) / 2, rel=0.01)
    est = analytic_estimate(build_config(base), "cpu", world_size=2, shard="fsdp")
    assert est is not None
    for rank in res["ranks"]:
        assert est.peak_bytes == pytest.approx(rank["peak_bytes"], rel=0.03), rank["rank"]


@pytest.mark.slow  # two torchrun launches (~40-50 s here)
def test_fsdp2_full_finetune_resumes_exactly_and_keeps_the_tied_head(llamas, small_corpus, tmp_path):
    """A full fine-tune (every weight sharded and trained) with a tied embedding/LM head, stopped
    after 2 of 4 steps with a sharded checkpoint and resumed: the resumed history is the
    uninterrupted one-process history."""
    import torch.distributed.checkpoint as dcp

    base = {"model": str(llamas["tied"]), "data": str(small_corpus), **RUN, "batch_size": 2, "distributed": "fsdp"}
    ckpt = tmp_path / "ck"
    half = _torchrun({**base, "stop_after": 2, "save": str(ckpt), "out": str(tmp_path / "half")}, tmp_path / "cache")
    resumed = _torchrun({**base, "resume": str(ckpt), "out": str(tmp_path / "resumed")}, tmp_path / "cache")
    assert half["stopped_early"] and resumed["steps_run"] == 2
    assert resumed["loss_history"][:2] == half["loss_history"]  # restored, not recomputed
    single = _single({k: v for k, v in base.items() if k != "distributed"}, tmp_path / "one")
    _assert_same_training(resumed, single)
    # The tie survives fully_shard: one sharded tensor under both names, counted and saved once.
    assert resumed["trainable_parameters"] == resumed["parameters"] == single["parameters"]
    saved = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    assert any(k.endswith("embed_tokens.weight") for k in saved)
    assert not any(k.endswith("lm_head.weight") for k in saved)


@pytest.mark.slow  # one torchrun launch (~20-25 s here)
def test_zero1_matches_one_process_and_halves_optimizer_state(llamas, small_corpus, tmp_path):
    base = {"model": str(llamas["untied"]), "data": str(small_corpus), **RUN, "batch_size": 2}
    res = _torchrun({**base, "distributed": "zero1", "out": str(tmp_path / "z1")}, tmp_path / "cache")
    _assert_same_training(res, _single(base, tmp_path / "one"))
    full_state = 8 * res["parameters"]  # two FP32 AdamW moments per weight, on one process
    for rank in res["ranks"]:
        assert rank["sharded_state"]["optimizer"] <= 0.55 * full_state
        assert rank["sharded_state"]["parameters"] == 4 * res["parameters"]  # whole weights on every rank
    assert sum(r["sharded_state"]["optimizer"] for r in res["ranks"]) == pytest.approx(full_state, rel=0.01)


@pytest.mark.slow  # two torchrun launches (~50 s here)
def test_zero2_and_bf16_fsdp2_per_rank_estimates(llamas, small_corpus, tmp_path):
    """The composed techniques under zero2 (fp32) and under fsdp with bf16 (FSDP2 gathers bf16
    weights, so the chunked loss casts no head weight): losses as one process, and the per-rank
    analytic estimate within 3% of every rank's tracked peak."""
    from memtrain.analysis.estimate.hf import analytic_estimate

    base = {"model": str(llamas["untied"]), "data": str(small_corpus), **RUN, **COMPOSED, "batch_size": 2}
    for name, extra, shard, rtol in (("zero2", {}, "zero2", LOSS_RTOL),
                                     # bf16 gathers vs autocast's casts: 3e-5 relative measured
                                     ("fsdp-bf16", {"precision": "bf16"}, "fsdp", 1e-3)):
        settings = {**base, **extra}
        res = _torchrun({**settings, "distributed": shard, "out": str(tmp_path / name)}, tmp_path / "cache")
        single = _single(settings, tmp_path / f"one-{name}")
        assert res["loss_history"] == pytest.approx(single["loss_history"], rel=rtol), name
        est = analytic_estimate(build_config(settings), "cpu", world_size=2, shard=shard)
        assert est is not None
        for rank in res["ranks"]:
            assert est.peak_bytes == pytest.approx(rank["peak_bytes"], rel=0.03), (name, rank["rank"])


# --------------------------------------------------------------------------- in-process checks
def test_nf4_weights_that_fsdp2_cannot_split_are_named():
    """QLoRA under zero2/fsdp: torchao's NF4Tensor splits its scale blocks into equal shards,
    so a weight of one 64 x 256-value scale block cannot go to 2 ranks (an assertion inside
    fully_shard); memtrain names it before sharding."""
    pytest.importorskip("torchao")
    from memtrain.models.qlora import nf4_unshardable, quantize_base_weights

    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(256, 256))  # 1 and 4 scale blocks
    for p in model.parameters():
        p.requires_grad_(False)
    quantize_base_weights(model, torch.device("cpu"))
    assert nf4_unshardable(model, 1) == []
    assert nf4_unshardable(model, 2) == ["0"]
    assert nf4_unshardable(model, 4) == ["0"]
    assert nf4_unshardable(model, 8) == ["0", "1"]


def test_estimate_per_rank_for_a_transformers_model(llamas, capsys):
    """`memtrain estimate --model DIR --world-size N --shard S`: the analytic model's per-rank
    share for the families it covers; a traced family is refused with one line."""
    from memtrain.cli import main

    common = ["estimate", "--model", str(llamas["untied"]), "--seq-len", "32", "--batch-size", "2",
              "--device", "cpu", "--json"]
    peaks = {}
    for shard in ("none", "zero1", "zero2", "fsdp"):
        assert main([*common, "--world-size", "2", "--shard", shard]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["method"] == "analytic" and out["world_size"] == 2
        peaks[shard] = out["peak_bytes"]
    assert peaks["none"] > peaks["zero1"] > peaks["fsdp"]
    assert main([*common, "--world-size", "2", "--shard", "fsdp", "--trace"]) == 2
    assert capsys.readouterr().err.startswith("error: --trace traces one process")
    # --distributed on one process: the trace needs no process group (it holds no shards)
    assert main([*common, "--distributed", "fsdp", "--qlora", "--lora-rank", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["method"] in ("trace", "extrapolated")
    # QLoRA's NF4 weights are modelled whole on every rank (DDP, ZeRO-1), not as FSDP2 shards.
    assert main([*common, "--world-size", "2", "--qlora", "--lora-rank", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["method"] == "analytic"
    assert main([*common, "--world-size", "2", "--shard", "fsdp", "--qlora", "--lora-rank", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --world-size for a transformers --model needs its analytic model")


def test_qlora_under_fsdp2_is_refused_when_a_weight_cannot_be_split(monkeypatch):
    """The refusal names the weight and what to change, before fully_shard would assert; on
    CUDA (bitsandbytes' Params4bit, whose quant_state a DTensor shard loses) it is refused outright."""
    pytest.importorskip("torchao")
    from memtrain.config.run import ConfigError
    from memtrain.models.qlora import quantize_base_weights
    from memtrain.techniques import hf_mapping

    model = torch.nn.Sequential(torch.nn.Linear(128, 128))  # one 64 x 256-value scale block
    model[0].weight.requires_grad_(False)
    quantize_base_weights(model, torch.device("cpu"))
    monkeypatch.setattr(hf_mapping.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(hf_mapping.dist, "get_world_size", lambda: 2)
    cfg = build_config({"qlora": True, "lora_rank": 4, "distributed": "fsdp"})
    with pytest.raises(ConfigError, match=r"NF4 weight\(s\) \(e.g. 0\) do not split into 2 equal shards.*ddp or zero1"):
        hf_mapping._check_qlora_shards(model, cfg.technique, torch.device("cpu"))  # type: ignore[arg-type]
    hf_mapping._check_qlora_shards(model, cfg.replace(distributed="zero1").technique, torch.device("cpu"))  # type: ignore[arg-type]
    monkeypatch.setattr(hf_mapping.dist, "get_world_size", lambda: 1)
    hf_mapping._check_qlora_shards(model, cfg.technique, torch.device("cpu"))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="bitsandbytes"):
        hf_mapping._check_qlora_shards(model, cfg.technique, torch.device("cuda"))  # type: ignore[arg-type]



def test_prepare_model_shards_each_decoder_layer_then_the_root(llamas, one_rank_group):
    """The structure the 2-rank runs rely on, checked without torchrun: every decoder layer and
    the root are FSDP2 modules, every weight a DTensor, LoRA's adapters the only trainable ones,
    the tied head still the embedding, and a step runs."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from memtrain.models import build_model
    from memtrain.techniques import build_optimizer, make_precision, prepare_model

    cfg = build_config({"model": str(llamas["tied"]), **RUN, **COMPOSED, "batch_size": 2, "distributed": "fsdp"})
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    model = prepare_model(build_model(cfg), cfg, cpu, make_precision("fp32", cpu))
    assert isinstance(model, FSDPModule) and len(model.blocks) == 2
    assert all(isinstance(block, FSDPModule) for block in model.blocks)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    lm = model.lm
    assert lm.get_output_embeddings().weight is lm.get_input_embeddings().weight
    opt = build_optimizer(model, cfg.technique, cfg.train)
    x = torch.randint(0, 50257, (2, 32))
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    model(x, x).backward()
    opt.step()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p.full_tensor(), before[n])}
    assert changed and changed <= trainable  # only adapters move (B starts at zero, so A may not yet)


def test_train_under_fsdp_on_one_rank_matches_plain_training(llamas, small_corpus, tmp_path, monkeypatch):
    """``memtrain train --distributed fsdp`` on a transformers model through the whole run path
    (session, wrap, per-rank memory, result) in this process, as a 1-rank torchrun would start it:
    the same losses as without --distributed (the 2-rank equality is the slow tests')."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base = {"model": str(llamas["untied"]), "data": str(small_corpus), **RUN, **COMPOSED, "steps": 3,
            "batch_size": 2, "progress": False}
    plain = train(build_config({**base, "out": str(tmp_path / "plain")}))
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)
    res = train(build_config({**base, "distributed": "fsdp", "out": str(tmp_path / "fsdp")}))
    assert res["distributed"]["strategy"] == "fsdp" and len(res["ranks"]) == 1
    assert res["loss_history"] == pytest.approx(plain["loss_history"], rel=LOSS_RTOL)
    assert res["trainable_parameters"] == plain["trainable_parameters"]
