"""How the report names a row: one label for every table and sentence that mentions it."""

from __future__ import annotations

from pathlib import PurePath
from typing import Any

__all__ = ["ANSWERS_PPL_NOTE", "OPTIM_NAMES", "answers_only", "method_cell", "model_label", "ppl_header", "ppl_words"]

OPTIM_NAMES = {"adafactor": "Adafactor", "adamw-4bit": "4-bit AdamW", "adamw-8bit": "8-bit AdamW"}

# Said beside a perplexity of --loss-on completion rows: it is over the answer tokens only, a figure
# not comparable with a perplexity over every token (the result key stays val_ppl).
ANSWERS_PPL_NOTE = "answer tokens"


def answers_only(rows: list[dict[str, Any]]) -> bool:
    """Whether the finished ``rows`` trained with ``--loss-on completion``, so that their ``val_ppl``
    averages the answer tokens of the validation blocks only (the rows of one report share it)."""
    return any(str(((r.get("config") or {}).get("data") or {}).get("loss_on")) == "completion"
               for r in rows if r.get("status") == "ok")


def ppl_header(rows: list[dict[str, Any]]) -> str:
    """The perplexity column's header: ``Val PPL``, naming the answer tokens when that is what it is over."""
    return f"Val PPL ({ANSWERS_PPL_NOTE})" if answers_only(rows) else "Val PPL"


def ppl_words(row: dict[str, Any], ppl: float) -> str:
    """A row's perplexity in a sentence (``val ppl 12.3``), naming the answer tokens when it is over them."""
    return f"val ppl {ppl:.1f}" + (f" (on {ANSWERS_PPL_NOTE} only)" if answers_only([row]) else "")


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
