"""The Trainer side of a chunked-loss row on CUDA takes ``use_liger_kernel=True`` only where the
installed Liger-Kernel's patched forward can run on the installed transformers.

Liger replaces ``<Model>ForCausalLM.forward`` with its own, written against some transformers
release; one that reads a config attribute the installed transformers dropped fails at the first
step, on the GPU. Checked here without a GPU or Triton: the forward's source is read, not run. A
stand-in Liger package carries forwards with the reads of Liger-Kernel 0.8.5's
(``liger_kernel/transformers/model/{qwen2,llama}.py``)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Iterator

import pytest

pytest.importorskip("transformers")

from transformers import PretrainedConfig  # noqa: E402
from transformers.utils.deprecation import deprecate_kwarg  # noqa: E402

from memtrain.bench.hf import liger_calls, mapping  # noqa: E402
from memtrain.config.run import build_config  # noqa: E402
from memtrain.models import load_config  # noqa: E402

# What Liger-Kernel 0.8.5's forwards read from self.config (the llama one also pretraining_tp),
# and the keywords they pass the inner model (liger_kernel/transformers/model/{qwen2,llama}.py).
_READS = """
    output_attentions = output_attentions if output_attentions is not None else self.config.output_attentions
    output_hidden_states = (
        output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
    )
    return_dict = return_dict if return_dict is not None else self.config.use_return_dict
    {extra}
    outputs = self.model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        output_attentions=output_attentions,
        output_hidden_states=output_hidden_states,
        return_dict=return_dict,
        cache_position=cache_position,
        **kwargs,
    )
    return self.config.hidden_size, self.config.vocab_size
"""
_LIGER_085_CALL = ["attention_mask", "cache_position", "input_ids", "inputs_embeds", "output_attentions",
                   "output_hidden_states", "past_key_values", "position_ids", "return_dict", "use_cache"]


def _forward(extra: str = "") -> str:
    return ("def lce_forward(self, input_ids=None, attention_mask=None, position_ids=None,\n"
            "                past_key_values=None, inputs_embeds=None, labels=None, use_cache=None,\n"
            "                output_attentions=None, output_hidden_states=None, return_dict=None,\n"
            "                cache_position=None, **kwargs):\n"
            + textwrap.indent(textwrap.dedent(_READS.format(extra=extra)), "    "))


def _drop_liger_modules() -> None:
    for name in [n for n in sys.modules if n == "liger_kernel" or n.startswith("liger_kernel.")]:
        del sys.modules[name]


@pytest.fixture
def stand_in_liger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A Liger-Kernel package on sys.path with qwen2 and llama patches; yields its model folder."""
    if "liger_kernel" in sys.modules or any((Path(p) / "liger_kernel").exists() for p in sys.path if p):
        pytest.skip("a real Liger-Kernel is installed; the stand-in would shadow it")
    root = tmp_path / "liger_kernel"
    model = root / "transformers" / "model"
    model.mkdir(parents=True)
    for folder in (root, root / "transformers", model):
        (folder / "__init__.py").write_text("")
    (root / "transformers" / "monkey_patch.py").write_text(
        "MODEL_TYPE_TO_APPLY_LIGER_FN = {'llama': None, 'qwen2': None}\n")
    (model / "qwen2.py").write_text(_forward())
    (model / "llama.py").write_text(_forward("if self.config.pretraining_tp > 1:\n        raise Exception('tp')"))
    monkeypatch.syspath_prepend(str(tmp_path))
    _drop_liger_modules()
    yield model
    _drop_liger_modules()


def _chunked(model: str):
    return build_config({"model": model, "loss": "chunked", "precision": "bf16", "seq_len": 16})


@pytest.mark.parametrize("model", ["qwen2.5-0.5b", "tiny-llama"])
def test_liger_085_forwards_read_only_what_the_installed_transformers_configs_have(stand_in_liger, model):
    config = load_config(model)
    assert mapping.liger_forward_gaps(config.model_type, config) == []
    assert liger_calls.model_call_keywords(liger_calls.lce_forward_tree(config.model_type)) == _LIGER_085_CALL
    # past_key_values: a deprecated alias of `cache`; the rest reach the attention through **kwargs
    assert liger_calls.liger_call_gaps(config.model_type, config) == []
    plan = mapping.hf_plan(_chunked(model), "cuda")
    assert plan.training_args.get("use_liger_kernel") is True
    assert not any("Liger" in m for m in plan.missing)


def test_a_forward_reading_a_config_attribute_transformers_dropped_is_refused_with_the_reason(
        stand_in_liger, monkeypatch):
    # transformers without config.use_return_dict (deprecated in 5; the forward still reads it)
    monkeypatch.delattr(PretrainedConfig, "use_return_dict")
    config = load_config("qwen2.5-0.5b")
    assert mapping.liger_forward_gaps("qwen2", config) == ["use_return_dict"]
    plan = mapping.hf_plan(_chunked("qwen2.5-0.5b"), "cuda")
    assert "use_liger_kernel" not in plan.training_args
    assert plan.status == "closest"
    (line,) = [m for m in plan.missing if m.startswith("--loss chunked")]
    assert "qwen2 forward reads config.use_return_dict" in line and "gpu_wheels.sh" in line
    assert "the HF side materializes the full logits" in line


def test_a_patch_for_another_family_is_read_against_this_family_config(stand_in_liger):
    # Qwen2's config has no pretraining_tp: the llama forward's read of it would fail there.
    (stand_in_liger / "qwen2.py").write_text(_forward("if self.config.pretraining_tp > 1:\n        raise Exception('tp')"))
    assert mapping.liger_forward_gaps("qwen2", load_config("qwen2.5-0.5b")) == ["pretraining_tp"]


def test_no_forward_to_read_leaves_the_patch_list_to_decide(stand_in_liger):
    (stand_in_liger / "qwen2.py").write_text("X = 1\n")  # no lce_forward
    assert mapping.liger_forward_gaps("qwen2", load_config("qwen2.5-0.5b")) == []
    assert mapping.liger_forward_gaps("mistral", load_config("qwen2.5-0.5b")) == []  # no module


@pytest.mark.parametrize("model", ["qwen2.5-0.5b", "tiny-llama"])
def test_the_installed_liger_forwards_run_on_the_installed_transformers(model):
    """Where a real Liger-Kernel is installed (the GPU machine's carried wheel): its forwards."""
    pytest.importorskip("liger_kernel.transformers.monkey_patch")
    config = load_config(model)
    assert mapping.liger_forward_gaps(config.model_type, config) == []
    assert liger_calls.liger_call_gaps(config.model_type, config) == []


def test_a_liger_that_does_not_import_leaves_the_row_without_it_and_says_why(stand_in_liger):
    """An installed Liger-Kernel whose import fails (its Triton, a transformers it predates) made
    the whole comparison fail while planning its rows; now the row runs without Liger and says why."""
    (stand_in_liger.parent / "monkey_patch.py").write_text("raise RuntimeError('triton 9 is not supported')\n")
    plan = mapping.hf_plan(_chunked("qwen2.5-0.5b"), "cuda")
    assert "use_liger_kernel" not in plan.training_args and plan.status == "closest"
    (line,) = [m for m in plan.missing if m.startswith("--loss chunked")]
    assert "the installed Liger-Kernel does not import (RuntimeError: triton 9 is not supported)" in line


def test_without_liger_the_row_says_it_is_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # find_spec: not installed
    plan = mapping.hf_plan(_chunked("qwen2.5-0.5b"), "cuda")
    (line,) = [m for m in plan.missing if m.startswith("--loss chunked")]
    assert "Liger-Kernel is not installed (pip install liger-kernel)" in line
    assert "has no qwen2 patch" not in line  # it has one: the old message said otherwise


# A base model forward of a transformers that names each keyword it takes (no **kwargs), with the
# cache's old name renamed; the same with that alias told to raise from a version already installed.
@deprecate_kwarg("past_key_values", "99.0.0", new_name="cache")
def _named_only_forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                        inputs_embeds=None, use_cache=None, output_attentions=None):
    raise AssertionError("read, never run")


@deprecate_kwarg("past_key_values", "5.0.0", new_name="cache", raise_if_greater_or_equal_version=True)
def _alias_raising_forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                           inputs_embeds=None, use_cache=None, **kwargs):
    raise AssertionError("read, never run")


def test_a_keyword_the_base_model_does_not_take_refuses_liger_and_names_it(stand_in_liger, monkeypatch):
    from transformers.models.qwen2 import modeling_qwen2

    monkeypatch.setattr(modeling_qwen2.Qwen2Model, "forward", _named_only_forward)
    gaps = liger_calls.liger_call_gaps("qwen2", load_config("qwen2.5-0.5b"))
    assert gaps == [f"{name} (_named_only_forward takes no such argument)"
                    for name in ("cache_position", "output_hidden_states", "return_dict")]
    plan = mapping.hf_plan(_chunked("qwen2.5-0.5b"), "cuda")
    assert "use_liger_kernel" not in plan.training_args and plan.status == "closest"
    (line,) = [m for m in plan.missing if m.startswith("--loss chunked")]
    assert "qwen2 forward passes cache_position (_named_only_forward takes no such argument)" in line
    assert "gpu_wheels.sh" in line


def test_a_keyword_handed_on_through_kwargs_must_reach_a_layer_that_takes_it(stand_in_liger, monkeypatch):
    from transformers.models.qwen2 import modeling_qwen2

    def layer_forward(self, hidden_states, attention_mask=None, position_embeddings=None, position_ids=None,
                      cache=None, use_cache=None):
        raise AssertionError("read, never run")

    monkeypatch.setattr(modeling_qwen2.Qwen2DecoderLayer, "forward", layer_forward)
    gaps = liger_calls.liger_call_gaps("qwen2", load_config("qwen2.5-0.5b"))
    # past_key_values is renamed before it gets there; the others reach the layer through **kwargs
    assert [g.split(" ")[0] for g in gaps] == ["cache_position", "output_attentions", "output_hidden_states",
                                               "return_dict"]
    assert all("layer_forward takes no such argument" in g for g in gaps)


def test_a_deprecated_alias_that_raises_in_the_installed_transformers_is_a_gap(stand_in_liger, monkeypatch):
    from transformers.models.qwen2 import modeling_qwen2

    assert liger_calls.renamed_keywords(_named_only_forward) == {"past_key_values": "cache"}
    assert liger_calls.renamed_keywords(_alias_raising_forward) == {"past_key_values": None}
    monkeypatch.setattr(modeling_qwen2.Qwen2Model, "forward", _alias_raising_forward)
    assert liger_calls.liger_call_gaps("qwen2", load_config("qwen2.5-0.5b")) == [
        "past_key_values (_alias_raising_forward refuses it, deprecated, in this transformers)"]


def test_the_forward_is_read_from_its_file_without_importing_liger(stand_in_liger, monkeypatch):
    """Importing liger_kernel.transformers imports its Triton kernels (none on a CPU machine, where
    the check then found nothing to read): the check reads the file."""
    (stand_in_liger.parent / "__init__.py").write_text("raise RuntimeError('triton is not installed')\n")
    assert liger_calls.lce_forward_tree("qwen2") is not None
    assert liger_calls.liger_call_gaps("qwen2", load_config("qwen2.5-0.5b")) == []
    monkeypatch.delattr(PretrainedConfig, "use_return_dict")
    assert mapping.liger_forward_gaps("qwen2", load_config("qwen2.5-0.5b")) == ["use_return_dict"]
    assert "liger_kernel.transformers" not in sys.modules


def test_a_model_type_mapped_to_several_base_classes_is_read_against_the_first(monkeypatch):
    from transformers.models.auto import modeling_auto
    from transformers.models.llama.modeling_llama import LlamaModel
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Model

    config = load_config("qwen2.5-0.5b")
    monkeypatch.setattr(modeling_auto, "MODEL_MAPPING", {type(config): (Qwen2Model, LlamaModel)})
    assert liger_calls._inner_model_class(config) is Qwen2Model
