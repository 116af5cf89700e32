"""The step harness (memtrain.training.step) and the technique facts it and the estimator share
(memtrain.techniques.facts)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from conftest import TINY_MODEL
from memtrain.analysis.estimate import param_table, predicted_optimizer_state
from memtrain.config.run import ConfigError, build_config
from memtrain.metrics import MemoryMeter, optimizer_state_bytes as measured_state_bytes
from memtrain.techniques.checkpointing import checkpointed_blocks
from memtrain.techniques.facts import (
    PRECISION_FACTS,
    checkpoint_policy,
    optimizer_state_rule,
    precision_facts,
)
from memtrain.training.step import TrainState, build_state, measure_steps, random_micro_batches, run_step

CPU = torch.device("cpu")
RUN = {**TINY_MODEL, "vocab_size": 512, "batch_size": 2, "seq_len": 16, "device": "cpu", "progress": False}


def _cfg(**kw):
    return build_config({**RUN, **kw})


# ------------------------------------------------------------------------------- facts
@pytest.mark.parametrize("text, layers, blocks", [
    ("none", 5, []),
    ("full", 3, [0, 1, 2]),
    ("selective", 2, [0, 1]),
    ("selective-matmul", 2, [0, 1]),
    ("every:2", 5, [0, 2, 4]),
    ("every:3", 7, [0, 3, 6]),
    ("sqrt", 9, [0, 3, 6]),
])
def test_checkpoint_policy_names_the_blocks_the_technique_wraps(text, layers, blocks):
    policy = checkpoint_policy(text)
    assert policy.blocks(layers) == blocks == checkpointed_blocks(text, layers)
    assert policy.n_checkpointed(layers) == len(blocks)
    # Whole-block checkpointing: Megatron's selective keeps the block and wraps only its core.
    whole = [i for i in range(layers) if policy.whole_block(i, layers)]
    assert whole == ([] if text == "selective" else blocks)
    assert policy.mixed == (text.startswith("every") or text == "sqrt")


def test_checkpoint_policy_is_parsed_once_and_refuses_unknown_text():
    assert checkpoint_policy("every:2") is checkpoint_policy("every:2")
    assert (checkpoint_policy("every:4").kind, checkpoint_policy("every:4").every) == ("every", 4)
    with pytest.raises(ConfigError, match="every:K must be a positive integer"):
        checkpoint_policy("every:0")
    with pytest.raises(ConfigError, match="unknown --checkpointing 'half'"):
        checkpoint_policy("half")


@pytest.mark.parametrize("name", sorted(PRECISION_FACTS))
def test_make_precision_takes_its_dtypes_from_the_facts(name):
    from memtrain.techniques.precision import make_precision

    facts = precision_facts(name)
    try:
        prec = make_precision(name, CPU)
    except ConfigError:
        pytest.skip(f"{name} is not available on this CPU build")
    finally:
        make_precision("fp32", CPU)  # TF32 is process-wide: leave it off for other tests
    assert prec.param_dtype == getattr(torch, facts.param_dtype)
    assert prec.param_dtype.itemsize == facts.param_bytes
    assert (prec.autocast_dtype is not None) == facts.autocast
    if facts.autocast:
        assert prec.autocast_dtype.itemsize == facts.compute_bytes
    assert (prec.scaler is not None) == facts.scaler


@pytest.mark.parametrize("optim", ["adamw", "sgd", "adafactor"])
def test_optimizer_state_rule_predicts_the_measured_state(optim):
    """The rule the estimator uses (state tensors x element size, step counters; Adafactor's
    factored rows and columns) gives the bytes torch's optimizer really holds after a step."""
    cfg = _cfg(optim=optim)
    torch.manual_seed(0)
    state = build_state(cfg, CPU)
    run_step(state, random_micro_batches(cfg, 2, CPU, torch.Generator().manual_seed(0)))
    predicted, _ = predicted_optimizer_state(param_table(cfg.model), optim, 4)
    assert measured_state_bytes(state.optimizer) == predicted
    if optim == "adafactor":
        return  # no per-element state rule: the factored state is summed per tensor above
    rule = optimizer_state_rule(optim)
    assert rule.states == (2 if optim == "adamw" else 1) and rule.state_bytes(4) == 4
    assert optimizer_state_rule("adamw-4bit").state_bytes(4) == 0.5
    assert optimizer_state_rule("adamw-bnb-8bit").quant_block(64) == 256  # bitsandbytes: its own block
    assert optimizer_state_rule("adamw-8bit").quant_block(64) == 64


# ------------------------------------------------------------------------------- harness
def test_the_gradient_norm_covers_every_parameter_with_a_gradient():
    """The norm clipped (and logged as grad_norm) is torch's over every gradient, biases and
    LayerNorm weights included, as one backward of the same batch gives it."""
    cfg = _cfg(grad_clip=1.0)
    torch.manual_seed(0)
    state = build_state(cfg, CPU)
    micro = random_micro_batches(cfg, 2, CPU, torch.Generator().manual_seed(0))
    reference = copy.deepcopy(state.model)
    reference(*micro[0]).backward()
    grads = [p.grad for p in reference.parameters() if p.grad is not None]
    assert any(g.dim() == 1 for g in grads)  # vectors (biases, LayerNorms) have gradients too
    run_step(state, micro)
    assert float(state.precision.last_grad_norm) == pytest.approx(float(torch.nn.utils.get_total_norm(grads)),
                                                                  rel=1e-5)


def test_build_state_builds_one_train_state_and_steps_it():
    cfg = _cfg(grad_accum=2, lr=1e-2, warmup_steps=0)
    torch.manual_seed(0)
    state = build_state(cfg, CPU, schedule=True)
    assert isinstance(state, TrainState) and state.model.training
    assert state.n_params == state.model.num_parameters() == state.trainable_parameters
    assert set(state.scheduler.get_last_lr()) == {1e-2}  # no warm-up: the peak LR from step 0
    micro = random_micro_batches(cfg, 2, CPU, torch.Generator().manual_seed(0))
    assert len(micro) == 2 and micro[0][0].shape == (2, 16)
    first = run_step(state, micro)
    losses = [run_step(state, micro) for _ in range(3)]
    assert math.isfinite(first) and losses[-1] < first  # the same batch, learnt
    assert all(p.grad is None for p in state.model.parameters())  # zero_grad(set_to_none)


def test_measure_steps_reports_the_steady_state_peak_of_the_second_step():
    """The peak window restarts before the last step: optimizer state exists (it is in the
    breakdown) and the first step's creation of it is not the peak."""
    cfg = _cfg()
    torch.manual_seed(0)
    state = build_state(cfg, CPU)
    meter = MemoryMeter(state.model, state.optimizer)
    micro = random_micro_batches(cfg, 2, CPU, torch.Generator().manual_seed(0))
    measure_steps(state, lambda: micro, steps=2, meter=meter)
    stats = meter.stats()
    assert stats.by_category["optimizer"] == measured_state_bytes(state.optimizer) > 0
    assert stats.peak_bytes >= stats.by_category["parameters"] + stats.by_category["optimizer"]


def test_checkpoint_saves_and_restores_the_train_state(tmp_path):
    from memtrain.checkpoints.exact import load_checkpoint, save_checkpoint

    class Position:  # the loader's state_dict protocol, without data
        def __init__(self, batch_index: int) -> None:
            self.state = {"epoch": 0, "batch_index": batch_index}

        def state_dict(self):
            return dict(self.state)

        def load_state_dict(self, s):
            self.state = dict(s)

    cfg = _cfg()
    torch.manual_seed(0)
    run = build_state(cfg, CPU, schedule=True)
    run.loader = Position(3)
    micro = random_micro_batches(cfg, 2, CPU, torch.Generator().manual_seed(0))
    run.losses = [run_step(run, micro)]
    run.scheduler.step()
    run.step = 1
    save_checkpoint(tmp_path / "ck.pt", run)
    torch.manual_seed(1)
    fresh = build_state(cfg, CPU, schedule=True)
    fresh.loader = Position(0)
    assert load_checkpoint(tmp_path / "ck.pt", fresh) == {"step": 1, "losses": run.losses}
    assert (fresh.step, fresh.losses, fresh.loader.state) == (1, run.losses, run.loader.state)
    for a, b in zip(run.model.state_dict().values(), fresh.model.state_dict().values()):
        assert torch.equal(a, b)
    assert fresh.scheduler.state_dict() == run.scheduler.state_dict()
    assert run_step(fresh, micro) == run_step(run, micro)  # the resumed run continues identically


def test_a_model_family_plugs_in_at_one_seam(monkeypatch):
    """A new family is one entry in memtrain.models.families.FAMILIES and its technique mapping one in
    memtrain.techniques.order.PREPARERS: build_state (and so train, maxbatch, trace, profiling)
    builds and prepares its model through them."""
    import memtrain.models.families as models
    import memtrain.techniques.order as order
    from memtrain.models.gpt import GPT

    seen = []

    def build(cfg, with_weights):
        seen.append("build")
        return GPT(cfg.model)

    def prepare(model, cfg, device, precision):
        seen.append("prepare")
        return model.to(device)

    family = models.ModelFamily("toy", lambda cfg: cfg.model.d_model == 48, build)
    monkeypatch.setattr(models, "FAMILIES", [family, *models.FAMILIES])
    monkeypatch.setitem(order.PREPARERS, "toy", prepare)
    cfg = _cfg(d_model=48)
    state = build_state(cfg, CPU)
    assert seen == ["build", "prepare"] and models.family_of(cfg) is family
    assert math.isfinite(run_step(state, random_micro_batches(cfg, 2, CPU)))
    assert models.family_of(_cfg()).name == "gpt"


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_clipping_walks_the_models_modules_once_not_at_every_step(lora_rank):
    """``model.parameters()`` visits every submodule (thousands in a peft-wrapped model): the
    clip's parameter list is made once per model, and clips the same gradients as the walk did."""
    cfg = _cfg(lora_rank=lora_rank)
    torch.manual_seed(0)
    state, twin = build_state(cfg, CPU), build_state(cfg, CPU)
    twin.model.load_state_dict(state.model.state_dict())
    real, walks = state.model.parameters, []

    def parameters(*args, **kwargs):
        walks.append(1)
        return real(*args, **kwargs)

    state.model.parameters = parameters  # an instance attribute: what the step calls on this model
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        micro = random_micro_batches(cfg, cfg.train.batch_size, CPU, g)
        run_step(state, micro)
        for p in twin.model.parameters():  # the walk of every step, as the step made it before
            p.grad = None
        loss = sum(twin.model(x, y) for x, y in micro)
        loss.backward()
        expected = torch.nn.utils.clip_grad_norm_([p for p in twin.model.parameters() if p.grad is not None],
                                                  cfg.train.grad_clip)
        twin.optimizer.step()
        assert torch.equal(state.precision.last_grad_norm, expected)
    assert len(walks) == 1


@pytest.mark.parametrize("warmup", [0, 3])
def test_linear_schedule_is_transformers_linear_schedule_floored_at_min_lr_ratio(warmup):
    """--schedule linear: transformers' get_linear_schedule_with_warmup (min_lr_ratio 0), and with a
    floor, the same line lifted to end at min_lr_ratio."""
    from transformers import get_linear_schedule_with_warmup

    from memtrain.training.schedule import lr_lambda

    steps = 12
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    theirs = get_linear_schedule_with_warmup(opt, warmup, steps).lr_lambdas[0]
    ours = lr_lambda(build_config({"schedule": "linear", "min_lr_ratio": 0.0, "steps": steps, "warmup_steps": warmup}))
    for step in range(warmup, steps + 1):  # transformers' warm-up starts at 0, memtrain's at 1/warmup
        assert ours(step) == pytest.approx(theirs(step), abs=1e-12), step
    floored = lr_lambda(build_config({"schedule": "linear", "min_lr_ratio": 0.1, "steps": steps,
                                      "warmup_steps": warmup}))
    for step in range(warmup, steps + 1):
        assert floored(step) == pytest.approx(0.1 + 0.9 * theirs(step), abs=1e-12), step
