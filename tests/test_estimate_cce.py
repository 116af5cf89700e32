"""``--loss-kernel cce``: the estimate models Cut Cross-Entropy's own buffers (no logits; one
float32 log-sum-exp per token kept; both gradients made in backward in the compute dtype), and
agrees with a trace of the same step, in which memtrain.techniques.loss._CutCrossEntropyBuffers
stands for the library's Triton kernels under fake tensors. The library runs on CUDA only; here
both sides run with CPU facts, which the kernel's buffers do not depend on (the refusal of CUDA-only
kernels off CUDA is lifted for the trace).

With so small a loss, the end of backward is the peak where the head is tied to the embedding:
there autograd sums the two gradients only after the embedding's backward has dropped its output's
gradient (the estimate summed them before: +49 KB on the tied rows below)."""

from __future__ import annotations

import pytest

from memtrain.analysis.estimate import estimate
from memtrain.analysis.trace import trace_step
from memtrain.config.run import build_config

# cce_traceable (conftest.py): a stand-in library for every test here
pytestmark = pytest.mark.usefixtures("one_thread", "cce_traceable")

SHAPE = {"batch_size": 3, "seq_len": 40, "device": "cpu", "loss": "chunked", "loss_kernel": "cce"}
OURS = {"d_model": 104, "n_heads": 4, "n_layers": 3, "d_ff": 216, "vocab_size": 5003, "max_seq_len": 64,
        "dropout": 0.0}


# The estimate's forward and backward peaks against the trace's, in bytes. memtrain's own chunked
# loss is within this too (its largest gap here: 14 KB under full checkpointing, in the blocks).
TOLERANCE_BYTES = 16 * 1024


def _gaps(est_peaks: dict, traced: dict) -> dict[str, float]:
    return {phase: est_peaks[phase] - traced["phase_peaks"][phase] for phase in ("forward", "backward")}


@pytest.mark.parametrize("overrides", [
    {"precision": "bf16"},
    {"precision": "fp16"},
    {"precision": "bf16", "checkpointing": "full"},
    {"precision": "bf16", "lora_rank": 8},  # a frozen head: cast and kept, no gradient
    {"precision": "bf16-pure"},
    {"precision": "bf16", "untie_embeddings": True},
    {"precision": "bf16", "grad_accum": 2},
], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_our_gpt_with_cce_is_estimated_as_traced(overrides):
    if overrides.get("precision") == "bf16-pure":
        pytest.importorskip("torchao")
    if overrides.get("lora_rank"):
        pytest.importorskip("peft")
    cfg = build_config({**OURS, **SHAPE, **overrides})
    est = estimate(cfg, device_type="cpu")
    traced = trace_step(cfg, "cpu")
    gaps = _gaps(est.phase_peaks, traced)
    assert all(abs(g) <= TOLERANCE_BYTES for g in gaps.values()), gaps


def test_cce_holds_less_than_memtrains_chunked_loss():
    """What the kernel buys, in the estimate: no chunk of logits in forward and no float32 grad_w
    held from forward to backward."""
    cfg = build_config({**OURS, **SHAPE, "precision": "bf16"})
    own = build_config({**OURS, **SHAPE, "precision": "bf16", "loss_kernel": "memtrain"})
    assert estimate(cfg, device_type="cpu").peak_bytes < estimate(own, device_type="cpu").peak_bytes


def test_a_transformers_model_with_cce_is_estimated_as_traced(tmp_path):
    transformers = pytest.importorskip("transformers")
    from memtrain.analysis.estimate.hf import analytic_estimate  # transformers' layers

    transformers.LlamaConfig(hidden_size=104, intermediate_size=216, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=128,
                             vocab_size=3001).save_pretrained(tmp_path)
    cfg = build_config({"model": str(tmp_path), **SHAPE, "precision": "bf16", "attention": "sdpa"})
    gaps = _gaps(analytic_estimate(cfg, "cpu").phase_peaks, trace_step(cfg, "cpu"))
    assert all(abs(g) <= TOLERANCE_BYTES for g in gaps.values()), gaps



def test_the_stand_in_saves_the_targets_as_the_library_does():
    """Cut Cross-Entropy saves its targets for backward (``ctx.save_for_backward(e, c, bias, lse,
    params.targets, params.valids, logit_avg)``, the library's cce.py); the stand-in the trace
    runs saved the operands and the log-sum-exp only."""
    import torch

    from memtrain.techniques.loss import _CutCrossEntropyBuffers

    saved: list[torch.Tensor] = []
    e = torch.randn(6, 4, requires_grad=True)
    c = torch.randn(11, 4, requires_grad=True)
    targets = torch.arange(6)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        _CutCrossEntropyBuffers.apply(e, c, targets, False)
    assert any(t is targets or (t.dtype == torch.int64 and t.data_ptr() == targets.data_ptr()) for t in saved)


@pytest.mark.parametrize("loss_on", ["all", "completion"])
def test_cce_saves_its_targets_and_an_offloader_moves_them(loss_on):
    """Under --offload-activations at 4 x 40 tokens (1,280 B of int64 labels, past the 1 KiB floor)
    the library's saved targets go to the host with the rest; the stand-in and the estimate left
    them out (1,280 B a step fewer each way than on CUDA), and under --loss-on completion the
    answers-only copy, which the library keeps for backward, was freed as the forward returned.
    The estimate's loss node now saves them, and moves what the trace's offloader moves."""
    from memtrain.analysis.estimate.dims import run_dims
    from memtrain.analysis.estimate.embedding_nodes import TARGETS
    from memtrain.analysis.estimate.head_nodes import ANSWER_TARGETS, head_nodes
    from memtrain.config.archs import GPT2_ARCH

    cfg = build_config({**OURS, **SHAPE, "batch_size": 4, "precision": "bf16", "offload_activations": True,
                        "loss_on": loss_on})
    dm = run_dims(cfg, GPT2_ARCH, "cpu")
    kernel = head_nodes(dm, cfg.model, cfg.technique, GPT2_ARCH, True, True, 1,
                        answers_only=loss_on == "completion")
    saved = {k for node in kernel if node.name in ("loss", "loss.kernel") for k in node.saves}
    assert (ANSWER_TARGETS if loss_on == "completion" else TARGETS) in saved
    traced = trace_step(cfg, "cpu")
    est = estimate(cfg, device_type="cpu")
    assert traced["offload"]["d2h_bytes"] == est.offload["d2h_bytes_per_step"]
    gaps = _gaps(est.phase_peaks, traced)
    assert all(abs(g) <= TOLERANCE_BYTES for g in gaps.values()), gaps


def test_a_pad_step_keeps_the_librarys_index_of_valid_targets_as_traced():
    """--packing pad always has ignored targets (its pads are -100), so the library keeps its int32
    index of the valid ones to backward, as under --loss-on completion; the estimate sized a pad
    step as a concat one (every target valid, the index dropped), so its forward peak in the
    kernel missed what the trace holds there."""
    concat = build_config({**OURS, **SHAPE, "precision": "bf16"})
    pad = build_config({**OURS, **SHAPE, "precision": "bf16", "packing": "pad"})
    assert pad.data.ignores_targets and not concat.data.ignores_targets
    est = {name: estimate(cfg, device_type="cpu").phase_peaks for name, cfg in (("concat", concat), ("pad", pad))}
    traced = {name: trace_step(cfg, "cpu")["phase_peaks"] for name, cfg in (("concat", concat), ("pad", pad))}
    # The kernel's forward holds the index, the log-sum-exp and the target-logit dot (4 B a token
    # each) and its locks and output: 8 B above the int64 nonzero() and its int32 copy it holds
    # when every target counts (tests/test_estimate_loss_on.py, the same under --loss-on completion).
    assert traced["pad"]["forward"] - traced["concat"]["forward"] == 8
    for phase in ("forward", "backward", "optimizer"):
        assert est["pad"][phase] - est["concat"][phase] == traced["pad"][phase] - traced["concat"][phase], phase
    for name in est:
        assert all(abs(g) <= TOLERANCE_BYTES for g in _gaps(est[name], {"phase_peaks": traced[name]}).values())
