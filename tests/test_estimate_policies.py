"""What `estimate` says per layer describes the configured checkpointing policy."""

from __future__ import annotations

import pytest

import memtrain.estimate as E
from memtrain.config import RunConfig

TINY = dict(vocab_size=512, d_model=64, n_heads=4, n_layers=12, d_ff=128, max_seq_len=128, batch_size=2,
            seq_len=32)


def _timeline_kept_per_block(cfg: RunConfig, device: str) -> float:
    """Activation bytes the step timeline keeps per block (measured on the lumped period)."""
    kept = {}
    original = E._Graph._lump_forward

    def spy(self, before, held, n):
        original(self, before, held, n)
        kept.update(self._kept_by_tag)

    E._Graph._lump_forward = spy
    try:
        E.estimate(cfg, device_type=device)
    finally:
        E._Graph._lump_forward = original
    return kept["activations"] / E._compression(cfg).period


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("ov", [dict(), dict(checkpointing="full", dropout=0.1), dict(checkpointing="selective"),
                                dict(checkpointing="every:3"), dict(precision="bf16", checkpointing="selective"),
                                dict(precision="bf16", dropout=0.1)],
                         ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "plain")
def test_activations_per_layer_is_what_the_timeline_keeps(ov, device):
    cfg = RunConfig().replace(**TINY, **ov)
    est = E.estimate(cfg, device_type=device)
    assert est.activations_per_layer == pytest.approx(_timeline_kept_per_block(cfg, device), rel=1e-12)
    d = est.to_dict()
    assert d["activations_per_layer_no_checkpointing"] >= d["activations_per_layer"]
    if cfg.technique.checkpointing == "none":
        assert d["activations_per_layer_no_checkpointing"] == d["activations_per_layer"]


def test_full_checkpointing_keeps_the_block_input_only():
    cfg = RunConfig().replace(**TINY, checkpointing="full")
    n, d = 2 * 32, 64
    assert E.estimate(cfg, device_type="cuda").activations_per_layer == n * d * 4
    assert E.estimate(cfg, device_type="cpu").activations_per_layer == n * d * 4 + E._CPU_RNG_STATE_BYTES
