"""FSDP2's per-group gradient lifetime in the per-rank estimate (zero2, fsdp).

FSDP2 reduce-scatters a parameter group's gradients as that group's backward ends: a block's
unsharded gradients are freed after the block's backward and only its 1/N shard stays; the root
group's (embeddings, final norm, head) live until the backward's final callback."""

from __future__ import annotations

import pytest

from memtrain.analysis.estimate import estimate
from memtrain.analysis.estimate.training import estimate as run  # with _compress, the simulation's switch
from memtrain.config.run import build_config

MiB = 2**20

# A block-dominated GPT: 12 blocks of d_ff 4096 hold 51 of its 101 MiB (fp32, tied head).
DEEP = {"d_model": 128, "n_heads": 4, "n_layers": 12, "d_ff": 4096, "seq_len": 32, "batch_size": 2,
        "dropout": 0.0}


def _full_grads(cfg) -> float:
    e = estimate(cfg, device_type="cuda", world_size=1)
    return e.extra["model_state"]["gradients"]


@pytest.mark.parametrize("shard", ["zero2", "fsdp"])
def test_block_gradients_are_sharded_as_each_block_ends(shard):
    """8 layers over 8 ranks: the gradients at the peak are far below the full gradient (the old
    rule held every unsharded gradient until the backward ended); the blocks already reduced
    hold their 1/8 shards, the root group's unsharded gradients the rest."""
    cfg = build_config({"d_model": 256, "n_heads": 4, "n_layers": 8, "d_ff": 4096, "vocab_size": 50257,
                        "seq_len": 64, "batch_size": 2, "dropout": 0.0})
    full = _full_grads(cfg)
    est = estimate(cfg, device_type="cuda", world_size=8, shard=shard)
    assert est.bytes["gradients"] < 0.6 * full
    # The root group (the tied 50257 x 256 embedding, 49 MiB) is all that is left unsharded.
    root = (50257 * 256 + 1024 * 256 + 2 * 256) * 4
    assert est.bytes["gradients"] < root + full / 8 + 1 * MiB
    assert est.extra["model_state"]["gradients"] == pytest.approx(full / 8)


def test_deep_estimate_is_o1_in_layers_and_exact_under_compression():
    """The lumped periods of a deep model repeat the measured block's reduce-scatter (its input
    buffer replaces the previous block's, not adds to it): the compressed simulation gives the
    same peak as the full one."""
    for shard, extra in (("fsdp", {}), ("zero2", {"precision": "bf16", "checkpointing": "full"}),
                         ("fsdp", {"checkpointing": "selective"})):
        cfg = build_config({**DEEP, **extra})
        full = run(cfg, device_type="cpu", world_size=2, shard=shard, _compress=False)
        comp = run(cfg, device_type="cpu", world_size=2, shard=shard)
        assert comp.peak_bytes == pytest.approx(full.peak_bytes, rel=1e-9), (shard, extra)


# Measured with benchmarks/fsdp_seen_freed.py (the tracked meter told of FSDP2's in-place storage
# frees, which it cannot see otherwise), AMD EPYC, 2 shared cores, torch 2.13.0+cpu, gloo, commit
# 0599ffb (training code unchanged since), each rank's peak (result.json ranks[i].peak_bytes):
#   OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/fsdp_seen_freed.py \
#     --d-model 128 --n-heads 4 --n-layers 12 --d-ff 4096 --seq-len 32 --batch-size 2 --dropout 0 \
#     --steps 3 --warmup-steps 1 --val-blocks 2 --no-progress --distributed zero2 [EXTRA]
# Both ranks alike (to 0.01 MiB). Without the patch the tracked peak of the first row is 293.84 MiB:
# the blocks' gathered weights FSDP2 had already resharded, 51 MiB of fp32, still counted.
MEASURED_ZERO2_DEEP = {
    "fp32 tied": ({}, 254.38 * MiB, "loss backward"),  # every category equal to the estimate's
    "bf16 tied, checkpointing": ({"precision": "bf16", "checkpointing": "full"}, 201.65 * MiB,
                                 "FSDP2 reduce-scatter of the root group"),
    # The root group's reduce-scatter holds one more 50257 x 128 fp32 gradient than the
    # estimate (24.5 MiB, not identified; fsdp shows it too): the estimate peaks elsewhere.
    "fp32 untied": ({"untie_embeddings": True}, 324.35 * MiB, None),
}


@pytest.mark.parametrize("row", list(MEASURED_ZERO2_DEEP))
def test_zero2_deep_model_against_its_measured_peak(row):
    """zero2 (reshard_after_forward=False) keeps each group's gathered weights from its forward
    to its post-backward, which reshards them: a block's as its backward ends. The estimate
    held every block's until the end of backward (293.87 MiB on the first row, +15.5%)."""
    extra, measured, where = MEASURED_ZERO2_DEEP[row]
    est = estimate(build_config({**DEEP, **extra}), device_type="cpu", world_size=2, shard="zero2")
    assert est.peak_bytes == pytest.approx(measured, rel=0.001 if where else 0.03)
    if where:
        assert est.peak_detail == where


@pytest.mark.parametrize("extra", [{}, {"precision": "bf16", "checkpointing": "full"}, {"checkpointing": "every:2"},
                                   {"checkpointing": "selective"}, {"grad_accum": 2}],
                         ids=["none", "bf16-full", "every2", "selective", "accum"])
def test_zero2_lumped_blocks_gather_and_reshard_as_the_simulated_ones(extra):
    """A deep model's lumped periods repeat the measured period's all-gather (at its forward) and
    reshard (after its backward): the compressed simulation's peak is the full one's."""
    cfg = build_config({**DEEP, **extra})
    full = run(cfg, device_type="cpu", world_size=2, shard="zero2", _compress=False)
    comp = run(cfg, device_type="cpu", world_size=2, shard="zero2")
    assert comp.peak_bytes == pytest.approx(full.peak_bytes, rel=1e-9)
    assert comp.phase_peaks == pytest.approx(full.phase_peaks, rel=1e-9)


def test_gradient_accumulation_keeps_the_unreduced_gradients():
    """--grad-accum under FSDP2: no reduce-scatter until the last micro-batch, so the full
    unsharded gradient is held at the peak as before."""
    cfg = build_config({**DEEP, "grad_accum": 2})
    est = estimate(cfg, device_type="cpu", world_size=2, shard="fsdp")
    assert est.bytes["gradients"] >= _full_grads(build_config(DEEP))
