"""--memory-by-module: who holds the tracked peak, by category (memtrain.metrics.by_module).

The table sums to the meter's peak category by category, changes nothing the meter measures,
names the loss's logits where the standard loss keeps them, equals between the traced estimate
and the measured run, and costs nothing (no hook) when off."""

from __future__ import annotations

import pytest
import torch

from memtrain.cli import main
from memtrain.config.run import build_config
from memtrain.metrics import CATEGORIES, MemoryMeter
from memtrain.metrics.by_module import LOSS, MODEL
from memtrain.report.by_module import OTHER, module_table_lines, top_entries
from memtrain.report.tables import markdown_report
from memtrain.training.resume_check import config_differences
from memtrain.training.step import build_state, measure_steps, random_micro_batches

pytestmark = pytest.mark.usefixtures("one_thread")

# A small vocabulary keeps the steps fast; the logits (tokens x vocab) stay the largest activation.
TINY = dict(d_model=32, n_heads=2, n_layers=2, d_ff=64, seq_len=16, max_seq_len=16, batch_size=2, dropout=0.0,
            vocab_size=1024)
# "offload": the host copies of --offload-activations are booked apart from the device
# categories, so the table still sums to the device peak.
CASES = {"plain": {}, "checkpointing": {"checkpointing": "full"}, "lora": {"lora_rank": 4},
         "offload": {"offload_activations": True}}


def _measure(settings: dict, by_module: bool, module_depth=None):
    """The meter's stats of the second (steady-state) step of ``settings`` on the CPU."""
    cfg = build_config(settings)
    device = torch.device("cpu")
    torch.manual_seed(0)
    state = build_state(cfg, device)
    meter = MemoryMeter(state.model, state.optimizer, by_module=by_module, module_depth=module_depth)
    generator = torch.Generator().manual_seed(0)
    measure_steps(state, lambda: random_micro_batches(cfg, cfg.train.batch_size, device, generator), meter=meter)
    return meter.stats()


@pytest.fixture(scope="module")
def tables():
    return {name: _measure({**TINY, **extra}, by_module=True) for name, extra in CASES.items()}


def _sums(table) -> dict[str, int]:
    return {c: sum(r[c] for r in table["modules"]) for c in CATEGORIES}


@pytest.mark.parametrize("case", list(CASES))
def test_every_entry_sums_to_the_peak_category_by_category(tables, case):
    stats = tables[case]
    table = stats.by_module
    assert table["peak_bytes"] == stats.peak_bytes and table["peak_phase"] == stats.peak_phase
    assert _sums(table) == stats.by_category
    assert sum(r["bytes"] for r in table["modules"]) == stats.peak_bytes
    assert all(r["bytes"] == sum(r[c] for c in CATEGORIES) > 0 for r in table["modules"])
    assert (stats.offloaded_peak_bytes > 0) == (case == "offload")  # the offload case did move bytes
    # One entry per Transformer block at the default depth, each holding its own parameters.
    blocks = {r["module"]: r for r in table["modules"] if r["module"].startswith("blocks.")}
    assert set(blocks) == {"blocks.0", "blocks.1"} and all(r["parameters"] > 0 for r in blocks.values())


def test_the_tracker_changes_nothing_the_meter_measures(tables):
    """Checkpointing recomputes blocks inside backward: a module tracker that hooks the
    recomputed tensors (torch.utils.module_tracker) kept them alive and raised this peak."""
    on, off = tables["checkpointing"], _measure({**TINY, **CASES["checkpointing"]}, by_module=False)
    assert (on.peak_bytes, on.by_category, on.peak_phase) == (off.peak_bytes, off.by_category, off.peak_phase)
    assert off.by_module is None and "by_module" not in off.to_dict()


def test_the_standard_losss_logits_lead_the_activations(tables):
    """Under the standard FP32 loss the (tokens x vocab) log-probabilities are kept for backward:
    the loss holds them, the largest activation entry, with its own 0-d float32 output (a step of
    one micro-batch keeps that as the step's loss); the tied LM-head weight belongs to wte."""
    table = tables["plain"].by_module
    cfg = build_config(TINY)
    assert cfg.train.grad_accum == 1
    logits = cfg.train.batch_size * cfg.train.seq_len * cfg.model.vocab_size * 4
    top = max(table["modules"], key=lambda r: r["activations"])
    assert top["module"] == LOSS and top["activations"] == logits + 4
    wte = next(r for r in table["modules"] if r["module"] == "wte")
    assert wte["parameters"] == cfg.model.padded_vocab_size * cfg.model.d_model * 4
    assert not any(r["module"] == "lm_head" for r in table["modules"])  # tied: no second copy


def test_backward_temporaries_belong_to_the_module_running_backward(tables):
    """With checkpointing the peak comes in the embedding's backward: the tied weight's two
    gradients (one from the loss, one from the embedding) are the temporaries, nothing of the
    blocks, whose backward ended. A dropout module returns its input unchanged (p=0): its
    "backward began" hook runs after its "backward ended" one, and taking the deepest module
    name still listed as running gave the embedding's gradient to blocks.1."""
    stats = tables["checkpointing"]
    cfg = build_config(TINY)
    weight_grad = cfg.model.padded_vocab_size * cfg.model.d_model * 4
    holders = {r["module"]: r["temporaries"] for r in stats.by_module["modules"] if r["temporaries"] > 4}
    assert stats.peak_phase == "backward" and holders == {"wte": weight_grad, LOSS: weight_grad}


def test_module_depth_one_merges_the_blocks(tables):
    deep = tables["plain"]
    shallow = _measure(TINY, by_module=True, module_depth=1).by_module
    assert shallow["depth"] == 1 and "blocks" in {r["module"] for r in shallow["modules"]}
    merged = next(r for r in shallow["modules"] if r["module"] == "blocks")
    parts = [r for r in deep.by_module["modules"] if r["module"].startswith("blocks.")]
    assert merged["bytes"] == sum(r["bytes"] for r in parts)
    assert _sums(shallow) == deep.by_category


def test_traced_table_equals_the_measured_one(tiny_run):
    """estimate --memory-by-module (fake tensors) against train --memory-by-module (real CPU step)."""
    from memtrain.analysis.trace import trace_step
    from memtrain.training.train import train

    cfg = build_config({**tiny_run, "steps": 2, "warmup_steps": 0, "batch_size": 2, "seq_len": 16, "val_blocks": 1,
                        "memory_by_module": True})
    measured = train(cfg)["memory"]["by_module"]
    traced = trace_step(cfg, "cpu")["by_module"]
    assert traced == measured
    assert {r["module"] for r in measured["modules"]} >= {"blocks.0", "blocks.1", LOSS, MODEL}


def test_a_transformers_model_sums_to_its_peak_by_decoder_layer(tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, max_position_embeddings=32, vocab_size=128).save_pretrained(tmp_path)
    stats = _measure({"model": str(tmp_path), "batch_size": 2, "seq_len": 16, "checkpointing": "full"}, by_module=True)
    table = stats.by_module
    assert table["depth"] == 3 and _sums(table) == stats.by_category
    names = {r["module"] for r in table["modules"]}
    assert {"model.layers.0", "model.layers.1", "model.embed_tokens"} <= names  # the wrapper's "lm." left out


def test_a_transformers_head_with_a_bias_keeps_its_standard_loss(tmp_path):
    """Phi's LM head has a bias: the model accepts only the standard loss, and asks which loss
    it holds; the table's scoped loss answers with the one it wraps."""
    transformers = pytest.importorskip("transformers")
    transformers.PhiConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           max_position_embeddings=32, vocab_size=128).save_pretrained(tmp_path)
    stats = _measure({"model": str(tmp_path), "batch_size": 2, "seq_len": 16}, by_module=True)
    assert _sums(stats.by_module) == stats.by_category and stats.by_module["modules"][0]["module"] == "model.layers.0"


def test_paths_leave_out_wrappers_but_not_a_one_block_list():
    from memtrain.metrics.by_module import default_module_depth, module_paths
    from memtrain.models.gpt import GPT

    gpt = GPT(build_config({**TINY, "n_layers": 1}).model)
    wrapped = torch.nn.Module()
    wrapped.inner = gpt  # one child, nothing of its own: a wrapper, as memtrain's transformers model
    paths = module_paths(wrapped)
    assert paths["inner.blocks.0.attn"] == "blocks.0.attn" and paths["inner"] == ""
    assert default_module_depth(gpt) == 2 and default_module_depth(torch.nn.Linear(2, 2)) == 2


def test_off_installs_no_hook_and_on_removes_its_own():
    cfg = build_config(TINY)
    state = build_state(cfg, torch.device("cpu"))
    hooks = torch.nn.modules.module._global_forward_pre_hooks
    before, loss_fn = len(hooks), state.model.loss_fn
    with MemoryMeter(state.model, state.optimizer):
        assert len(hooks) == before and state.model.loss_fn is loss_fn
    with MemoryMeter(state.model, state.optimizer, by_module=True):
        assert len(hooks) == before + 1 and state.model.loss_fn.__wrapped__ is loss_fn
    assert len(hooks) == before and state.model.loss_fn is loss_fn


@pytest.mark.parametrize("argv, text", [
    (["estimate", "--memory-by-module", "--module-depth", "0"], "--module-depth must be >= 1"),
    (["estimate", "--module-depth", "2"], "add --memory-by-module"),
    (["estimate", "--memory-by-module", "--module-top", "0"], "--module-top must be >= 1"),
    (["estimate", "--memory-by-module", "--mode", "inference"], "traces a training step"),
    (["estimate", "--memory-by-module", "--world-size", "2"], "traces one process"),
    (["train", "--memory-by-module", "--module-depth", "0"], "--module-depth must be >= 1"),
])
def test_bad_module_table_input_is_one_error_line(argv, text, capsys, tmp_path):
    if argv[0] == "train":
        argv = [*argv, "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and text in err and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_resuming_with_or_without_the_table_is_the_same_run():
    saved = build_config(TINY).to_dict()
    for key in ("memory_by_module", "module_depth", "module_top"):
        del saved["train"][key]  # a checkpoint saved before these settings existed
    now = build_config({**TINY, "memory_by_module": True, "module_depth": 1, "module_top": 3}).to_dict()
    assert config_differences(saved, now) == []


def test_top_entries_keep_the_sum_in_other(tables):
    table = tables["plain"].by_module
    shown = top_entries(table, 3)
    assert len(shown) == 4 and shown[-1]["module"].startswith(OTHER)
    for key in ("bytes", *CATEGORIES):
        assert sum(r[key] for r in shown) == sum(r[key] for r in table["modules"])
    text = module_table_lines(table, 3, str)
    assert "backward phase" in text[0] and len(text) == 2 + 4  # title, header, 3 entries, other


def test_report_shows_the_table_of_rows_that_have_one(tables):
    table = tables["plain"].by_module
    row = {"status": "ok", "technique": "baseline", "config": build_config(TINY).to_dict(),
           "memory": {"peak_bytes": table["peak_bytes"], "by_category": tables["plain"].by_category,
                      "peak_phase": "backward"}}
    plain = markdown_report([row], [])
    assert "by module" not in plain  # the default report is unchanged
    odd = {**row, "technique": "odd", "memory": {**row["memory"], "by_module": {"modules": [{"module": 1}]}}}
    with_table = markdown_report([{**row, "memory": {**row["memory"], "by_module": table}}, odd], [])
    section = with_table.split("## Memory at the peak, by module", 1)[1]
    assert "**baseline**" in section and "(loss)" in section and "**odd**" not in section
