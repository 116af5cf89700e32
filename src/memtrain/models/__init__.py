"""Models: memtrain's own GPT (the default) and any transformers causal LM (``--model SPEC``).

One seam for every command that runs a step: a ``ModelFamily`` in ``FAMILIES`` (:mod:`.families`)
says which configs it claims, how to build its model and how the techniques map onto it.
``build_model`` builds through it, ``memtrain.techniques.prepare_model`` (called by the
step harness, :mod:`memtrain.training.step`) applies the techniques through the family's mapping
(``memtrain.techniques.order.PREPARERS``, by the family's name: models never import techniques), and
``data_tokenizer`` names the tokenizer the data must be read with. A new model family is
one more entry in ``FAMILIES`` (claimed before the GPT, which takes every config left).

    spec.py       what --model SPEC names (preset, bundled config, path, hf:ORG/NAME); no torch
    families.py   the family seam: FAMILIES, build_model, family_of, data_tokenizer (torch)
    gpt.py        memtrain's GPT
    hf.py         HFCausalLM (GPT's forward/loss/blocks seams); its technique mapping: techniques/hf_mapping.py
    qlora.py      NF4 base weights (torchao on CPU, bitsandbytes on CUDA)
    tokenizer.py  the model's own tokenizer for the data pipeline
    configs/      public architecture hyper-parameters of full-size models (no weights)

Importing this package loads no torch: the analytic commands read :mod:`.spec` through it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memtrain.models.auto_config import load_config
from memtrain.models.source import bundled_names, resolve
from memtrain.models.spec import is_hf

if TYPE_CHECKING:
    from memtrain.models.families import FAMILIES, ModelFamily, build_model, data_tokenizer, family_of

__all__ = ["FAMILIES", "ModelFamily", "build_model", "family_of", "is_hf", "data_tokenizer", "bundled_names",
           "load_config", "resolve"]

# The torch side (memtrain.models.families), resolved on first use (PEP 562), so that
# `import memtrain.models.spec` loads no torch. Code in the package imports families directly.
_LAZY = frozenset({"FAMILIES", "ModelFamily", "build_model", "family_of", "data_tokenizer"})


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from memtrain.models import families  # the torch line: crossed when a model is built

        return getattr(families, name)
    raise AttributeError(f"module 'memtrain.models' has no attribute {name!r}")
