"""How the report names a row: one label for every table and sentence that mentions it."""

from __future__ import annotations

from pathlib import PurePath
from typing import Any

__all__ = ["OPTIM_NAMES", "method_cell", "model_label"]

OPTIM_NAMES = {"adafactor": "Adafactor", "adamw-4bit": "4-bit AdamW", "adamw-8bit": "8-bit AdamW"}


def method_cell(rec: dict[str, Any]) -> str:
    """A table record's method as every table of the report names it: with its status when it did
    not finish and the marks of what ran in place of what was asked (footnoted below the table)."""
    cell = str(rec.get("method"))
    if rec.get("status") != "ok":
        cell += f" ({rec.get('status')})"
    if rec.get("substituted_from"):
        cell += f" [ran in {str(rec.get('precision')).upper()}*]"
    if rec.get("optim_substituted_to"):
        cell += f" [ran {OPTIM_NAMES.get(rec['optim_substituted_to'], rec['optim_substituted_to'])}\u2020]"
    if rec.get("attention_substituted_to"):
        cell += f" [ran {rec['attention_substituted_to']} attention\u2021]"
    return cell


def model_label(model: dict[str, Any]) -> str:
    """The model a recorded config's ``model`` section describes, as headings name it: memtrain's
    GPT (no ``--model``), else the ``--model`` it was given (a bundled name, ``hf:ORG/NAME``, a
    GPT preset; a local folder by its own name), followed by its width (``d_model``: the hidden
    size)."""
    spec = model.get("model")
    if spec is None:
        return f"GPT d_model {model.get('d_model')}"
    name = str(spec) if str(spec).startswith("hf:") else PurePath(str(spec)).name or str(spec)
    return f"{name} d_model {model.get('d_model')}"


def hardware_text(env: dict[str, Any]) -> str:
    """The hardware of a recorded ``runtime.env.environment`` as a report names it: the device's model and
    its description ("AMD EPYC, cpu (x86_64, 2 cores)"; a GPU's name once). Results written before
    ``device_model`` was recorded give their ``device`` alone."""
    device, model = str(env.get("device")), env.get("device_model")
    return device if not model or str(model) in device else f"{model}, {device}"
