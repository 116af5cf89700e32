"""What `estimate` says per layer describes the configured checkpointing policy."""

from __future__ import annotations

import pytest

import memtrain.analysis.estimate as E
import memtrain.analysis.estimate.simulator as S
import memtrain.analysis.estimate.training as T
from memtrain.config.run import RunConfig

TINY = dict(vocab_size=512, d_model=64, n_heads=4, n_layers=12, d_ff=128, max_seq_len=128, batch_size=2,
            seq_len=32)


def _timeline_kept_per_block(cfg: RunConfig, device: str) -> float:
    """Activation bytes the step timeline keeps per block (measured on the lumped period)."""
    kept = {}
    original = S.Graph._lump_forward

    def spy(self, before, held, n):
        original(self, before, held, n)
        kept.update(self._kept_by_tag)

    S.Graph._lump_forward = spy
    try:
        E.estimate(cfg, device_type=device)
    finally:
        S.Graph._lump_forward = original
    return kept["activations"] / S.compression_of(cfg).period


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("ov", [dict(), dict(checkpointing="full", dropout=0.1), dict(checkpointing="selective"),
                                dict(checkpointing="every:3"), dict(precision="bf16", checkpointing="selective"),
                                dict(precision="bf16", dropout=0.1)],
                         ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "plain")
def test_activations_per_layer_is_what_the_timeline_keeps(ov, device):
    cfg = RunConfig().replace(**{**TINY, "n_layers": 18}, **ov)  # every policy lumps periods; 18 = 6 periods of every:3
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
    # (The CPU RNG state the checkpoint stores is made outside the dispatcher: no meter sees it.)
    assert E.estimate(cfg, device_type="cpu").activations_per_layer == n * d * 4


# --------------------------------------------------------------------------- selective (Megatron)
SEL = dict(vocab_size=512, d_model=64, n_heads=4, n_layers=3, d_ff=128, max_seq_len=128, batch_size=2,
           seq_len=128, device="cpu")


@pytest.mark.parametrize("ov", [dict(), dict(dropout=0.1), dict(attention="sdpa"), dict(loss="chunked", loss_chunk=64)],
                         ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "plain")
def test_selective_estimate_matches_measured_tracked_memory(ov):
    """Megatron's selective policy on a real CPU step (MemoryMeter) against the estimate."""
    from memtrain.analysis.maxbatch import measure_step_memory
    from memtrain.config.run import build_config

    cfg = build_config(dict(SEL, checkpointing="selective", **ov))
    measured = measure_step_memory(cfg, cfg.train.batch_size)
    est = E.estimate(cfg, device_type="cpu")
    assert est.peak_bytes == pytest.approx(measured["peak_bytes"], rel=0.02), (est.peak_bytes, measured)
    acts = est.by_category["activations"]
    assert acts == pytest.approx(measured["by_category"]["activations"], rel=0.05), (est.by_category, measured)


def test_selective_keeps_no_s_squared_term_and_sits_between_none_and_full():
    cfg = RunConfig().replace(**{k: v for k, v in SEL.items() if k != "device"})
    per = {p: E.estimate(cfg.replace(checkpointing=p), device_type="cuda").activations_per_layer
           for p in ("none", "selective-matmul", "selective", "full")}
    assert per["full"] < per["selective"] < per["selective-matmul"] < per["none"]
    # Doubling the sequence doubles a selective layer (no s^2 term) but more than doubles none.
    longer = cfg.replace(seq_len=256, max_seq_len=256)
    sel2 = E.estimate(longer.replace(checkpointing="selective"), device_type="cuda").activations_per_layer
    none2 = E.estimate(longer, device_type="cuda").activations_per_layer
    assert sel2 == pytest.approx(2 * per["selective"], rel=0.02)
    assert none2 > 2.2 * per["none"]


@pytest.mark.parametrize("ov", [dict(dropout=0.1), dict(attention="sdpa")], ids=["math-dropout", "sdpa"])
def test_selective_numerics_equal_no_checkpointing(ov):
    import torch

    from memtrain.attention.apply import apply_attention
    from memtrain.config.run import build_config
    from memtrain.models.gpt import GPT
    from memtrain.techniques import make_precision
    from memtrain.techniques.checkpointing import apply_checkpointing, is_checkpointed

    cfg = build_config(dict(SEL, seq_len=32, **ov))
    torch.manual_seed(0)
    plain = GPT(cfg.model)
    sel = GPT(cfg.model)
    sel.load_state_dict(plain.state_dict())
    prec = make_precision(cfg.technique.precision, torch.device("cpu"))
    for m in (plain, sel):
        apply_attention(m, cfg.technique, torch.device("cpu"), prec)
    apply_checkpointing(sel, cfg.replace(checkpointing="selective").technique)
    assert all(is_checkpointed(b) for b in sel.blocks) and not any(is_checkpointed(b) for b in plain.blocks)
    idx = torch.randint(0, 512, (2, 32))
    losses, grads = [], []
    for m in (plain, sel):
        torch.manual_seed(1)
        loss = m(idx, idx)
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in m.parameters()])
    assert torch.equal(losses[0], losses[1])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("b, s, h, a", [(2, 128, 64, 4), (4, 256, 128, 8), (1, 1024, 256, 4)])
def test_per_layer_formula_is_korthikanti_plus_the_pytorch_facts(b, s, h, a):
    """Korthikanti et al. 2022 (fp16, 1-byte masks, no tensor parallelism): 34 s b h + 5 a s^2 b
    bytes per layer without recomputation, 34 s b h with selective recomputation. Our model on
    CUDA under bf16 autocast adds (docs/estimation.md): fp32 LayerNorm inputs (+4 s b h), fp32
    LayerNorm mean/rstd (+16 s b), autocast's cached bf16 weight copies (+24 h^2), and without
    recomputation the fp32 softmax output (4 bytes where the paper has 2: +2 a s^2 b) and the
    s x s bool mask that masked_fill saves (+s^2)."""
    cfg = RunConfig().replace(vocab_size=512, d_model=h, n_heads=a, n_layers=4, d_ff=4 * h, max_seq_len=s,
                              batch_size=b, seq_len=s, dropout=0.1, precision="bf16")
    selective = E.estimate(cfg.replace(checkpointing="selective"), device_type="cuda").activations_per_layer
    none = E.estimate(cfg, device_type="cuda").activations_per_layer
    paper_selective, paper_none = 34 * s * b * h, 34 * s * b * h + 5 * a * s * s * b
    facts = 4 * s * b * h + 16 * s * b + 24 * h * h
    assert selective == paper_selective + facts
    assert none == paper_none + facts + 2 * a * s * s * b + s * s


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_naive_loss_keeps_the_callers_logits_and_the_estimate_follows(precision):
    """--loss naive (logits kept by the caller, as `logits = model(x); loss = F.cross_entropy(...)`
    does): measured tracked peak on CPU against the estimate, and one more logits-sized buffer
    than the standard loss."""
    from memtrain.analysis.maxbatch import measure_step_memory
    from memtrain.config.run import build_config

    base = dict(vocab_size=2048, d_model=64, n_heads=4, n_layers=2, d_ff=128, max_seq_len=128, batch_size=4,
                seq_len=64, device="cpu", precision=precision)
    peaks = {}
    for loss in ("standard", "naive"):
        cfg = build_config(dict(base, loss=loss))
        measured = measure_step_memory(cfg, 4)
        est = E.estimate(cfg, device_type="cpu")
        assert est.peak_bytes == pytest.approx(measured["peak_bytes"], rel=0.005)
        assert est.peak_phase == measured["peak_phase"]
        peaks[loss] = measured["peak_bytes"]
    logits = 4 * 64 * 2048 * (4 if precision == "fp32" else 2)
    assert peaks["naive"] - peaks["standard"] == pytest.approx(logits, rel=0.01)


# --------------------------------------------------------------------------- ZeRO-1 per rank
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("untie", [False, True])
def test_zero1_partition_is_the_sharded_optimizers(world, untie):
    """The estimator's per-rank split equals what ShardedZeRO1 gives each rank (built here for
    every rank in turn; its constructor needs no process group when rank and size are given):
    the same tensor shapes, so the same optimizer state."""
    import torch

    from memtrain.distributed.zero1 import ShardedZeRO1
    from memtrain.models.gpt import GPT
    from memtrain.techniques.optim import param_groups

    cfg = RunConfig().replace(vocab_size=511, d_model=64, n_heads=4, n_layers=3, d_ff=256, untie_embeddings=untie)
    model = GPT(cfg.model)
    ours = T._zero1_partition(E.param_table(cfg.model), world)
    for rank in range(world):
        z = ShardedZeRO1(param_groups(model, 0.1), torch.optim.AdamW, rank=rank, world_size=world, lr=1e-3)
        theirs = sorted(tuple(p.shape) for g in z.optim.param_groups for p in g["params"])
        assert sorted(p.shape for p in ours[rank]) == theirs


def test_zero1_estimate_splits_the_tied_embedding():
    """On the default model (tied 50257-row embedding, ~80% of the weights) ZeRO-1 at 2 ranks
    keeps half of the optimizer state per rank (rank 0 one embedding row more)."""
    cfg = RunConfig().replace(loss="chunked", seq_len=128, batch_size=4, dropout=0.0)
    full = E.estimate(cfg, device_type="cpu").extra["model_state"]["optimizer"]
    est = E.estimate(cfg, device_type="cpu", world_size=2, shard="zero1")
    per_rank = est.extra["zero1"]["optimizer_per_rank"]
    assert est.extra["zero1"]["rank"] == 0 and per_rank[0] - per_rank[1] == 2 * 4 * cfg.model.d_model
    assert sum(per_rank) == pytest.approx(full, rel=1e-4)  # + one step counter per tensor on each rank
    assert est.extra["model_state"]["optimizer"] == per_rank[0] <= 0.51 * full


# The checkpointed attention core recomputes lazily, as a checkpointed block does: the backward of
# SDPA's cast back (its math path on 16-bit inputs, the CPU with dropout) runs before the first
# unpack, and the recompute stops as probs @ v saves its inputs, before its output exists. The
# estimate recomputed as the core's backward began, through that output: +1.3% backward
# (bf16-pure, LoRA rank 4, 2 x 9 tokens), +1.2% (fp16, window 5 over 40 tokens).
SELECTIVE_LAZY = [dict(), dict(precision="bf16", lora_rank=0),
                  dict(precision="fp16", lora_rank=0, window=5, seq_len=40, batch_size=3, n_layers=2)]


@pytest.mark.parametrize("ov", SELECTIVE_LAZY, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "plain")
def test_selective_core_recomputes_lazily(ov):
    from memtrain.analysis.trace import trace_step  # (the trace imports torch: this test only)
    from memtrain.config.run import build_config

    base = dict(batch_size=2, seq_len=9, precision="bf16-pure", attention="sdpa", checkpointing="selective",
                device="cpu", lora_rank=4, vocab_size=33, d_model=30, n_heads=5, n_layers=1, d_ff=90,
                max_seq_len=64, dropout=0.1, untie_embeddings=True)
    cfg = build_config({**base, **ov})
    mine, traced = E.estimate(cfg, device_type="cpu").phase_peaks, trace_step(cfg, "cpu")["phase_peaks"]
    for phase in ("forward", "backward", "optimizer"):
        assert abs(mine[phase] / traced[phase] - 1) < 0.01, (phase, mine, traced)


# Under LoRA on Linears other than qkv, q, k and v require no gradient: the checkpointed attention
# core records nothing, so torch's checkpoint packs nothing and keeps none of its inputs (it holds
# them through what it packs). The estimate kept q, k and v (the qkv output) to the core's backward:
# +6.3% forward, +6.7% backward (2 layers of width 10, 1 x 23 tokens, LoRA on fc and fc_out, the
# chunked loss; a random sweep, seed 6161), +3.2% (4 layers, LoRA on proj with dropout).
SELECTIVE_FROZEN_CORE = [
    dict(d_model=10, n_heads=5, n_layers=2, d_ff=22, vocab_size=97, batch_size=1, seq_len=23, attention="sdpa",
         loss="chunked", loss_chunk=7, grad_accum=2, lora_rank=4, lora_targets="fc,fc_out", window=22),
    dict(d_model=10, n_heads=1, n_layers=4, d_ff=35, vocab_size=61, batch_size=5, seq_len=3, attention="math",
         loss="chunked", loss_chunk=5, grad_accum=2, lora_rank=2, lora_dropout=0.1, lora_targets="proj"),
    dict(d_model=20, n_heads=5, n_layers=2, d_ff=22, vocab_size=97, batch_size=1, seq_len=23, attention="sdpa",
         lora_rank=4, lora_targets="proj", precision="bf16"),
    # The same sweep: +1.5% (bf16-pure, 1 x 9 tokens) and +1.3% (fp16, 2 x 3 tokens).
    dict(d_model=84, n_heads=7, n_layers=1, d_ff=170, vocab_size=301, batch_size=1, seq_len=9, attention="math",
         precision="bf16-pure", loss="chunked", loss_chunk=7, grad_accum=2, lora_rank=8, lora_targets="fc,fc_out,proj"),
    dict(d_model=30, n_heads=3, n_layers=1, d_ff=62, vocab_size=130, batch_size=2, seq_len=3, attention="math",
         precision="fp16", lora_rank=1, lora_dropout=0.1, lora_targets="fc,proj"),
]


@pytest.mark.parametrize("ov", SELECTIVE_FROZEN_CORE, ids=lambda o: f"L{o['n_layers']}-{o['lora_targets']}-{o.get('precision', 'fp32')}")
def test_selective_core_without_a_gradient_keeps_no_input(ov):
    from memtrain.analysis.trace import trace_step  # (the trace imports torch: this test only)
    from memtrain.config.run import build_config

    cfg = build_config({"checkpointing": "selective", "device": "cpu", "max_seq_len": 64, "dropout": 0.0, **ov})
    mine, traced = E.estimate(cfg, device_type="cpu").phase_peaks, trace_step(cfg, "cpu")["phase_peaks"]
    for phase in ("forward", "backward", "optimizer"):
        assert abs(mine[phase] / traced[phase] - 1) < 0.01, (phase, mine, traced)
