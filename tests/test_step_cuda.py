"""The training step's recent changes on CUDA, with a CPU counterpart where the CPU runs the same logic.

- fp16 with torch's fused AdamW: GradScaler hands its found-inf flag to the fused step (the step
  skips inside the kernel), and memtrain counts a skipped step from that same flag
  (``training.step._found_inf``); a forced inf step is counted and a clean one is not. torch 2.13
  has the fused AdamW on the CPU too, so the CPU test runs this path here.
- ``--compile --eval-every`` on CUDA: the evaluations run uncompiled (force_eager), the run
  compiles its one training graph (the CUDA loop: steps queued, losses read per metrics line).
- ``--loss-on completion``'s weights on CUDA under BF16 give the CPU's FP32 loss within BF16's
  tolerance, with the standard and the chunked loss (the chunked loss's fused CUDA path).

The CUDA tests are marked ``gpu`` (``pytest -m gpu``) and skip, naming why, without a CUDA device.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from conftest import TINY_MODEL
from memtrain.config.run import ModelConfig, TechniqueConfig, TrainConfig, build_config
from memtrain.data.loader import IGNORE_INDEX, MicroBatches, host_target_count
from memtrain.models.gpt import GPT
from memtrain.techniques import make_precision, order
from memtrain.techniques.compile import apply_compile
from memtrain.techniques.loss import apply_loss
from memtrain.techniques.optim import build_optimizer
from memtrain.training import train as train_mod
from memtrain.training.step import _found_inf, train_step

CPU = torch.device("cpu")
SMALL = ModelConfig(vocab_size=256, d_model=64, n_heads=4, n_layers=2, d_ff=128, max_seq_len=64, dropout=0.0)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none visible to torch)")


def _batch(b: int = 4, t: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, SMALL.vocab_size, (b, t), generator=g),
            torch.randint(0, SMALL.vocab_size, (b, t), generator=g))


def _fp16_fused_skips_counted(device: torch.device) -> None:
    """fp16 + ``--optim adamw-fused`` on ``device``: a step with an inf gradient is skipped (weights
    untouched, scale halved) and counted once; every clean step after it updates the weights and
    adds nothing. The count is held against GradScaler's own record of each step (its scale backs
    off exactly when it skipped), so a flag read from the wrong place fails here either way."""
    prec = make_precision("fp16", device)
    torch.manual_seed(0)
    model = GPT(SMALL).to(device)
    opt = build_optimizer(model, TechniqueConfig(precision="fp16", optim="adamw-fused"), TrainConfig(lr=1e-2))
    assert opt.defaults["fused"] and getattr(opt, "_step_supports_amp_scaling", False)  # the fused path
    batch = _batch()
    for i in range(4):
        before = copy.deepcopy(model.state_dict())
        scale, skipped = prec.scaler.get_scale(), prec.skipped_steps
        hook = model.wpe.weight.register_hook(lambda g: torch.full_like(g, float("inf"))) if i == 0 else None
        train_step(model, [batch], opt, prec, 1.0, device)
        if hook is not None:
            hook.remove()
        backed_off = prec.scaler.get_scale() < scale
        untouched = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        assert prec.skipped_steps - skipped == int(backed_off) == int(untouched), (i, scale, prec.skipped_steps)
        if i == 0:
            assert prec.skipped_steps == 1  # the forced inf step
    # and the clean ones after it are not counted: they do not overflow FP16 at scale 2**15 (GradScaler
    # backs off at none of them on the CPU; the loop above holds every count against its back-off)
    assert prec.skipped_steps == 1


def test_fp16_fused_adamw_counts_a_forced_inf_step_and_no_clean_one_on_cpu():
    """torch 2.13's fused AdamW runs on the CPU: GradScaler takes the same fused-optimizer branch
    there (found_inf handed to the step), and the found-inf flag memtrain counts from exists."""
    _fp16_fused_skips_counted(CPU)


def test_the_found_inf_flag_is_there_for_a_fused_step():
    """GradScaler.step on a fused optimizer (``_step_supports_amp_scaling``) never calls its own
    ``unscale_``; the flag exists because the step unscales first (for clipping), and it is the
    device flag (0-d, float32), not a host number."""
    prec = make_precision("fp16", CPU)
    torch.manual_seed(0)
    model = GPT(SMALL)
    opt = build_optimizer(model, TechniqueConfig(precision="fp16", optim="adamw-fused"), TrainConfig(lr=1e-2))
    seen: list[torch.Tensor] = []
    step = prec.scaler.step

    def spy(optimizer, *args, **kwargs):
        out = step(optimizer, *args, **kwargs)
        seen.append(_found_inf(prec.scaler, optimizer))
        return out

    prec.scaler.step = spy
    train_step(model, [_batch()], opt, prec, 1.0, CPU)
    assert len(seen) == 1 and isinstance(seen[0], torch.Tensor)
    assert seen[0].dim() == 0 and seen[0].dtype == torch.float32


@pytest.mark.gpu
@needs_cuda
def test_fp16_fused_adamw_counts_a_forced_inf_step_and_no_clean_one_on_cuda():
    _fp16_fused_skips_counted(torch.device("cuda"))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.usefixtures("fresh_dynamo")
def test_a_compiled_run_with_evaluations_compiles_one_training_graph_on_cuda(tiny_run, monkeypatch):
    """--compile --eval-every on CUDA (steps queued, losses read per metrics line, evaluations
    after steps 2 and 4 with a smaller last batch): one dynamo frame from the first step to the
    end, no graph break; the evaluations ran uncompiled (force_eager). A counting backend
    (aot_eager beneath it) counts the frames without building kernels."""
    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(order, "apply_compile", functools.partial(apply_compile, backend=counter))
    run = {**tiny_run, "steps": 4, "eval_every": 2, "val_blocks": 5, "warmup_timing_steps": 1,
           "device": "cuda", "compile": True}
    frames: list[int] = []
    result = train_mod.train(build_config(run), track_memory=False,
                             on_step=lambda *a: frames.append(counter.frame_count))
    assert frames == [1] * 4, frames
    assert counter.frame_count == 1  # the final evaluation compiled nothing either
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert [v["step"] for v in result["val_history"]] == [2]
    assert torch.isfinite(torch.tensor(result["val_loss"]))


def _answer_groups(steps: int = 2, accum: int = 3, seq: int = 32) -> list[MicroBatches]:
    """Steps of ``accum`` micro-batches whose answer-token counts differ (one micro-batch holds
    none), with the host counts the loader gives them (--loss-on completion)."""
    g = torch.Generator().manual_seed(7)
    out = []
    for s in range(steps):
        group = MicroBatches()
        for i in range(accum):
            x = torch.randint(0, TINY_MODEL["max_seq_len"], (2, seq), generator=g)
            y = torch.randint(0, TINY_MODEL["max_seq_len"], (2, seq), generator=g)
            keep = 0 if (s, i) == (1, 2) else 5 + 7 * s + 3 * i
            y.view(-1)[keep:] = IGNORE_INDEX
            group.append((x, y))
        group.target_counts = [host_target_count(y) for _, y in group]
        out.append(group)
    return out


def _answers_losses(model: torch.nn.Module, device: torch.device, precision: str) -> list[float]:
    """The step losses of two --loss-on completion steps (--grad-accum 3) on ``device``."""
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prec = make_precision(precision, device)
    return [train_step(model, group, opt, prec, 1.0, device) for group in _answer_groups()]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("loss", ["standard", "chunked"])
def test_loss_on_completion_on_cuda_is_the_cpu_loss_within_bf16_tolerance(loss):
    """The same GPT (built once on the CPU, copied), the same answer-masked micro-batches: the
    CUDA steps under BF16 autocast give the CPU's FP32 step losses within 0.02 nats (BF16's
    tolerance on a loss of ~4, as tests/test_precision.py's), the answer-weighting and the loss
    kernel (the chunked loss's fused CUDA path) included."""
    cuda = torch.device("cuda")
    torch.manual_seed(0)
    cpu_model = GPT(ModelConfig(**{**TINY_MODEL, "vocab_size": TINY_MODEL["max_seq_len"]}))
    cuda_model = copy.deepcopy(cpu_model)
    tech = TechniqueConfig(loss=loss, loss_chunk=16)
    for model, device in ((cpu_model, CPU), (cuda_model, cuda)):
        apply_loss(model, tech, device)
        model.answers_only = True  # what prepare_model sets for --loss-on completion
    want = _answers_losses(cpu_model, CPU, "fp32")
    got = _answers_losses(cuda_model, cuda, "bf16")
    assert all(w > 0 for w in want)
    assert got == pytest.approx(want, abs=0.02)
