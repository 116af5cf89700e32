"""--compile-memory-budget: torch.compile's activation memory budget.

A lower budget makes the min-cut partitioner save fewer bytes for backward, at the same losses;
the tracer (fake tensors, inductor's partitioner) counts exactly what a real compiled CPU step's
tracked meter counts. The fast tests compile with ``aot_eager_decomp_partition`` (inductor's
decompositions and partitioner, no kernels) in block scope (one small graph, compiled once);
the ``slow`` one runs inductor itself.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch._functorch.config as functorch_config

from memtrain.analysis.depth_trace import NotAffine, extrapolated_trace
from memtrain.analysis.plan import COMPILE_BUDGETS, default_space, plan
from memtrain.analysis.step_time import step_cost
from memtrain.bench.runner import BenchOptions, resolve_rows
from memtrain.bench.technique_sets import DEFAULT_TECHNIQUES, TECHNIQUES, default_techniques, describe
from memtrain.cli import main
from memtrain.config.run import ConfigError, TechniqueConfig, build_config
from memtrain.metrics import MemoryMeter
from memtrain.techniques import make_precision
from memtrain.techniques.compile import apply_compile, has_cpp_compiler, under_memory_budget
from memtrain.training.step import build_state, random_micro_batches, run_step

CPU = torch.device("cpu")
TINY = ["--d-model", "32", "--n-heads", "2", "--n-layers", "2", "--d-ff", "64", "--seq-len", "16", "--max-seq-len", "16",
        "--batch-size", "2", "--vocab-size", "512", "--dropout", "0", "--device", "cpu"]
TINY_CFG = {"d_model": 32, "n_heads": 2, "n_layers": 2, "d_ff": 64, "max_seq_len": 16, "seq_len": 16,
            "batch_size": 2, "vocab_size": 512, "dropout": 0.0, "device": "cpu"}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch.compiler.reset()
    yield
    torch.compiler.reset()


@pytest.mark.parametrize("tech, message", [
    ({"compile_memory_budget": 0.5}, "add --compile"),
    ({"compile": True, "compile_memory_budget": 0.0}, r"in \(0, 1\]"),
    ({"compile": True, "compile_memory_budget": 1.5}, r"in \(0, 1\]"),
    ({"compile": True, "compile_memory_budget": float("inf")}, r"in \(0, 1\]"),
    ({"compile": True, "compile_memory_budget": -0.1}, r"in \(0, 1\]"),
])
def test_the_budget_needs_compile_and_a_fraction(tech, message):
    with pytest.raises(ConfigError, match=message):
        TechniqueConfig(**tech)
    assert TechniqueConfig(compile=True, compile_memory_budget=1.0).compile_memory_budget == 1.0


def test_the_cli_refuses_a_budget_without_compile_in_one_line(capsys):
    assert main(["train", *TINY, "--steps", "1", "--compile-memory-budget", "0.5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --compile-memory-budget sets torch.compile's partitioner: add --compile"]


def test_the_budget_is_set_around_the_compiled_call_only():
    """The partitioner reads the global when dynamo compiles, at a call: the wrapper sets it for
    the call (every call, so a recompile sees it too) and leaves torch's default outside."""
    seen = []
    call = under_memory_budget(lambda: seen.append(functorch_config.activation_memory_budget), 0.25)
    call()
    call()
    assert seen == [0.25, 0.25]
    assert functorch_config.activation_memory_budget == 1.0


def _metered_compiled_step(budget):
    """Two real CPU steps of the tiny GPT compiled per block (inductor's partitioner, no
    kernels), the second metered: (losses, the meter's stats). dynamo does not guard on the
    budget, so the graphs of an earlier compile are dropped first (under_memory_budget)."""
    torch.compiler.reset()
    cfg = build_config(TINY_CFG)
    torch.manual_seed(0)
    state = build_state(cfg, CPU, make_precision("fp32", CPU))
    tech = TechniqueConfig(compile=True, compile_scope="block", compile_memory_budget=budget)
    apply_compile(state.model, tech, backend="aot_eager_decomp_partition")
    return _two_metered_steps(state, cfg)


def _two_metered_steps(state, cfg):
    """Two real CPU steps, the second metered: (losses, the meter's stats)."""
    meter = MemoryMeter(state.model, state.optimizer)
    g = torch.Generator().manual_seed(1)
    losses = []
    for i in range(2):
        micro = random_micro_batches(cfg, 2, CPU, generator=g)
        with meter:
            if i == 1:
                meter.reset_peak()
            losses.append(run_step(state, micro, meter))
    return losses, meter.stats()


def _traced(budget, capsys):
    assert main(["estimate", *TINY, "--compile", "--compile-scope", "block", "--compile-memory-budget", str(budget),
                 "--trace", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_lower_budget_saves_fewer_bytes_at_the_same_losses_and_the_trace_counts_them_exactly(capsys):
    """Budget 0.1 against torch's default partition (no budget): the same losses (fp32
    tolerance), fewer activation bytes in the real step's tracked meter; the traced estimate
    (fake tensors) finds the same peak, byte for byte by category, and the same drop in what the
    partitioner saves between budget 1 and 0.1."""
    plain_losses, plain = _metered_compiled_step(None)
    low_losses, low = _metered_compiled_step(0.1)
    torch.testing.assert_close(torch.tensor(low_losses), torch.tensor(plain_losses), rtol=1e-5, atol=1e-6)
    assert low.category_peaks["activations"] < plain.category_peaks["activations"]

    traced_low, traced_one = _traced(0.1, capsys), _traced(1.0, capsys)
    assert traced_low["trace"]["by_category"] == low.by_category
    assert traced_one["trace"]["by_category"] == plain.by_category  # budget 1 is torch's default
    saved_low, saved_one = traced_low["trace"]["compile"], traced_one["trace"]["compile"]
    assert saved_low["forward_calls"] == 2  # one compiled call per block
    assert 0 < saved_low["saved_activation_bytes"] < saved_one["saved_activation_bytes"]
    # The meter's activations at the end of the forward hold what the partitioner saved: the
    # two figures drop by the same bytes.
    assert (plain.category_peaks["activations"] - low.category_peaks["activations"]
            == saved_one["saved_activation_bytes"] - saved_low["saved_activation_bytes"])
    # Without --trace the estimate answers with a labelled interpolation, never a traced figure.
    assert traced_low["compile_memory_budget"]["method"] == "interpolated"


def test_a_budgeted_trace_is_never_extrapolated_from_shallow_probes():
    """The partition under a budget is chosen for the whole graph: every layer is traced."""
    cfg = build_config({**TINY_CFG, "compile": True, "compile_memory_budget": 0.5})
    with pytest.raises(NotAffine, match="whole graph"):
        extrapolated_trace(cfg)


def test_the_analytic_estimate_interpolates_between_no_and_full_checkpointing(capsys):
    def estimate(*flags):
        assert main(["estimate", *TINY, "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)

    none, full = estimate(), estimate("--checkpointing", "full")
    half = estimate("--compile", "--compile-memory-budget", "0.5")
    assert "compile_memory_budget" not in none  # unchanged without a budget
    entry = half["compile_memory_budget"]
    assert entry["peak_bytes"] == round((full["peak_bytes"] + none["peak_bytes"]) / 2)
    assert full["peak_bytes"] < entry["peak_bytes"] < none["peak_bytes"]
    assert entry["recompute_share"] == 0.5
    with_ckpt = estimate("--compile", "--compile-memory-budget", "0.5", "--checkpointing", "full")
    assert with_ckpt["compile_memory_budget"]["method"] is None and "peak_bytes" not in with_ckpt["compile_memory_budget"]


def test_plan_tries_budgets_only_with_compile_between_none_and_full():
    cfg = build_config({**TINY_CFG, "seq_len": 256, "max_seq_len": 256, "batch_size": 8, "vocab_size": 50257})
    assert "compile_memory_budget" not in default_space(cfg, "cpu")  # no compile: the old space, the old plan
    compiled = cfg.replace(compile=True)
    assert default_space(compiled, "cpu")["compile_memory_budget"] == [None, *COMPILE_BUDGETS]
    res = plan(compiled, 2**40, "cpu", top=10**6)
    budgeted = [c for c in res.candidates if c.techniques.get("compile_memory_budget") is not None]
    assert {c.techniques["compile_memory_budget"] for c in budgeted} == set(COMPILE_BUDGETS)
    assert all(c.techniques["checkpointing"] == "none" for c in budgeted)
    assert all("(interpolated)" in c.label() and "--compile-memory-budget" in c.train_flags for c in budgeted)
    assert any("interpolated between checkpointing none and full" in n for n in res.notes)
    # Cost: strictly between no checkpointing and full checkpointing, falling with the budget.
    at = {c: compiled.replace(checkpointing=c) for c in ("none", "full")}
    costs = [step_cost(compiled.replace(compile_memory_budget=b), "cpu")[0] for b in (0.75, 0.5, 0.25)]
    assert step_cost(at["none"], "cpu")[0] < costs[0] < costs[1] < costs[2] < step_cost(at["full"], "cpu")[0]


def test_the_budget_row_is_optional():
    assert TECHNIQUES["compile-budget"] == {**TECHNIQUES["compile"], "compile_memory_budget": 0.5}
    assert "compile-budget" not in DEFAULT_TECHNIQUES + default_techniques("cuda")
    (name, row), = resolve_rows(BenchOptions(techniques=["compile-budget"]))
    assert (row.technique.compile, row.technique.compile_memory_budget) == (True, 0.5)
    assert "budget 0.5" in describe(name)  # the report's row label


@pytest.mark.slow
@pytest.mark.skipif(not has_cpp_compiler(), reason="inductor on CPU needs a C++ compiler")
def test_inductor_under_a_budget_matches_the_plain_compiled_losses():
    """Inductor itself (C++ kernels, minutes on two cores): model scope, budget 0.1 against the
    default partition: equal losses, fewer activation bytes in the tracked meter."""
    def run(budget):
        torch.compiler.reset()
        cfg = build_config({**TINY_CFG, "compile": True, "compile_memory_budget": budget})
        torch.manual_seed(0)
        state = build_state(cfg, CPU, make_precision("fp32", CPU))  # prepare_model compiles with inductor
        losses, stats = _two_metered_steps(state, cfg)
        return losses, stats.category_peaks["activations"]

    plain_losses, plain = run(None)
    low_losses, low = run(0.1)
    torch.testing.assert_close(torch.tensor(low_losses), torch.tensor(plain_losses), rtol=1e-5, atol=1e-6)
    assert low < plain
