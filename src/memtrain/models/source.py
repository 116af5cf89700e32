"""Where ``--model SPEC`` comes from: a bundled config, a local folder or a Hub repository.

SPEC is one of (tried in this order):

* a preset of memtrain's own GPT (``memtrain.config.presets``: ``gpt2``, ``gpt2-medium`` ...);
* a bundled transformers config (``llama-3-8b``, ``qwen2.5-7b`` ... in ``models/configs/``:
  the public architecture hyper-parameters of each model's ``config.json``, no weights), so
  full-size models can be estimated offline;
* a path to a ``config.json``, or to a directory holding one (optionally with ``*.safetensors``
  weights and tokenizer files);
* ``hf:ORG/NAME``: a Hugging Face Hub repository, read by transformers' ``from_pretrained``
  (the same code path as a local directory, so the offline tests cover it).

Nothing read here can execute code: ``trust_remote_code`` is never set, and weights are read
only from ``*.safetensors`` (never pickled ``*.bin`` files).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from memtrain.config.presets import PRESETS
from memtrain.errors import ConfigError
from memtrain.files.guard import TOO_LARGE, folder_entry_problems, special_file_kind, visible_entries
from memtrain.models.config_json import CONFIG_FILES, MAX_CONFIG_JSON_BYTES, json_object

CONFIG_DIR = Path(__file__).parent / "configs"
HUB_PREFIX = "hf:"
# Weight files read by unpickling, which memtrain never does (a pickle can run code).
PICKLED_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# Every file a transformers tokenizer class may read that decides the token ids: the identity
# of a folder's tokenizer (the token cache's key) hashes exactly these names, never a file or
# folder whose name merely starts like one.
TOKENIZER_ID_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                      "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt", "spiece.model",
                      "sentencepiece.bpe.model")
# Subfolders of a model folder that transformers reads by name (AutoTokenizer loads the chat
# templates in this one); the other subfolders of a model folder are never opened.
READ_SUBFOLDERS = ("additional_chat_templates",)
# A model folder's files that memtrain or transformers read whole into memory (config, tokenizer,
# chat templates, the weights' index) may have at most this many bytes: a 3 GB tokenizer.json
# (a sparse file) took 73 s and 16 GB of memory before its refusal, where the machine had that much.
READ_WHOLE_SUFFIXES = (".json", ".txt", ".model", ".jinja")
MAX_READ_WHOLE_BYTES = 256 << 20
# A tokenizer's own files (TOKENIZER_ID_FILES) have a lower bound: parsing one takes many times
# its size in memory, all of it spent before a vocabulary too large is refused. Real models'
# stay well under it: Gemma 3's tokenizer.json is about 33 MB, Llama 3's about 9 MB, Qwen's 7 MB.
MAX_TOKENIZER_FILE_BYTES = 64 << 20


def bundled_names() -> list[str]:
    """Names of the bundled transformers configs (``--model llama-3-8b`` ...)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def model_names() -> list[str]:
    """Every model name ``--model`` knows, one per model: the GPT presets
    (:data:`memtrain.config.presets.PRESETS`), then the bundled transformers configs."""
    return [*PRESETS, *bundled_names()]


@dataclass(frozen=True)
class ModelSource:
    """A resolved ``--model SPEC`` for a transformers model."""

    spec: str
    config_path: Optional[Path]  # a local config.json, or None for a Hub repository
    repo: Optional[str]  # the Hub repository (hf:ORG/NAME), else None

    @property
    def directory(self) -> Optional[Path]:
        """The directory that may hold weights and tokenizer files (None for bundled configs)."""
        if self.repo is not None:
            return None
        assert self.config_path is not None
        return None if self.config_path.parent == CONFIG_DIR else self.config_path.parent

    @property
    def load_id(self) -> str:
        """What ``from_pretrained`` is given: the directory or the Hub repository."""
        if self.repo is not None:
            return self.repo
        return str(self.directory) if self.directory is not None else str(self.config_path)

    def weight_files(self) -> list[Path]:
        """The folder's ``*.safetensors`` files (a folder so named is no weight file)."""
        d = self.directory
        return safetensors_files(d) if d is not None else []

    def has_weights(self) -> bool:
        if self.repo is not None:
            return True  # a Hub repository of a causal LM ships its weights
        return bool(self.weight_files())

    def has_tokenizer(self) -> bool:
        if self.repo is not None:
            return True
        d = self.directory
        return d is not None and any((d / f).is_file() for f in TOKENIZER_FILES)


def resolve(spec: str) -> ModelSource:
    """The transformers model ``spec`` names (ConfigError with the choices when none)."""
    if spec.startswith(HUB_PREFIX):
        repo = spec[len(HUB_PREFIX):].strip("/")
        # The Hub's own characters only: the name is echoed in messages and sent in URLs.
        if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo, re.ASCII):
            raise ConfigError(f"--model {spec!r}: write a Hub model as hf:ORG/NAME, e.g. hf:Qwen/Qwen2.5-0.5B")
        return ModelSource(spec, None, repo)
    bundled = CONFIG_DIR / f"{spec}.json"
    if "/" not in spec and bundled.is_file():
        return ModelSource(spec, bundled, None)
    p = Path(spec).expanduser()
    _refuse_a_checkpoint(p, spec)
    kind = special_file_kind(p)
    if kind is not None:  # else the folder it sits in was checked, naming another of its entries
        raise ConfigError(f"--model {spec!r} is {kind}, not a config.json or a model folder; give a model's folder "
                          "or its config.json")
    if p.is_dir():
        p = p / "config.json"
    if os.path.lexists(p):
        check_model_folder(p.parent, spec)
    if p.is_file():
        # The folder resolved, not the file: in a Hugging Face cache snapshot config.json is a
        # link into ../../blobs, and the weights and tokenizer sit beside the link.
        return ModelSource(spec, p.parent.resolve() / p.name, None)

    twin = spelled_like(spec)
    if twin is not None:
        raise ConfigError(f"--model {spec!r} is not a model name; did you mean --model {twin}?")
    raise ConfigError(
        f"--model {spec!r} is not a preset, a bundled config, a config.json or a directory holding one; "
        f"choose one of {', '.join(model_names())}, a path, or hf:ORG/NAME")


# The first bytes of a file torch.save writes (a zip archive): a checkpoint, never a config.
_ZIP_MAGIC = b"PK\x03\x04"
_CHECKPOINT_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin")


def _refuse_a_checkpoint(p: Path, spec: str) -> None:
    """A checkpoint or a weights file given as ``--model`` is one error line saying what --model
    takes instead (reading it as a config.json said only that it is not JSON). Only its first
    bytes are read, never unpickled."""
    if p.is_dir():
        if (p / ".metadata").is_file() and not (p / "config.json").exists():
            kind = "a sharded memtrain checkpoint"
        else:
            return
    elif p.is_file() and p.suffix == ".safetensors":
        raise ConfigError(f"--model {spec!r} is a weights file; give the folder holding it and its config.json")
    elif p.is_file() and (p.suffix in _CHECKPOINT_SUFFIXES or _starts_with(p, _ZIP_MAGIC)):
        kind = "a checkpoint"
    else:
        return
    raise ConfigError(f"--model {spec!r} is {kind}, not a model config: give the model it was trained from "
                      f"(train --resume {spec} continues it), or `memtrain export {spec} DIR` and --model DIR")


def _starts_with(p: Path, magic: bytes) -> bool:
    try:
        with p.open("rb") as f:
            return f.read(len(magic)) == magic
    except OSError:
        return False  # unreadable: the JSON reader says so in its own words


def safetensors_files(folder: Path) -> list[Path]:
    """The ``*.safetensors`` files of ``folder`` (a folder so named is no weight file)."""
    return sorted(p for p in folder.glob("*.safetensors") if p.is_file())


def refuse_pickled_weights(folder: Path, what: str) -> None:
    """Refuse a model folder whose weights are only pickled files (``pytorch_model.bin`` ...), or
    only a safetensors index whose files are absent.

    They are never read, and without them the model would be built from its config alone:
    random weights, trained or sampled as if they were the folder's. A folder with no weight
    file at all is a config to train from scratch, on purpose, and passes."""
    present = safetensors_files(folder)
    if present:
        _check_safetensors_index(folder, what, {p.name for p in present})
        return
    pickled = sorted(p.name for pattern in PICKLED_WEIGHTS for p in folder.glob(pattern) if p.is_file())
    if pickled:
        raise ConfigError(f"{what} holds only pickled weights ({pickled[0]}), which memtrain never loads (a "
                          "pickle can run code); convert them to *.safetensors")
    # An index names weight files the folder does not hold (not copied, or links out of it, which
    # are never followed): the folder declares weights, so training it from random ones is refused.
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        raise ConfigError(f"{what} has {index.name} but none of the *.safetensors files it names; copy them into "
                          "the folder (or remove the index to train from random weights)")


def _check_safetensors_index(folder: Path, what: str, present: set[str]) -> None:
    """Every file ``model.safetensors.index.json`` names is one of the folder's own ``*.safetensors``
    files (``present``), by its plain name: transformers opens ``folder/NAME`` for each, so an
    index naming ``../x.safetensors``, an absolute path, a FIFO or ``/dev/zero`` made it read
    outside the folder, past the checks of its entries (a FIFO or a device blocked the run or
    filled the memory)."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file() or "model.safetensors" in present:  # transformers reads that file, not the index
        return
    weight_map = json_object(index, "the index").get("weight_map")
    if not isinstance(weight_map, dict):
        raise ConfigError(f"{what}: {index.name} has no weight_map object; fix or remove the index")
    for name in weight_map.values():
        if not isinstance(name, str) or name not in present:
            raise ConfigError(f"{what}: {index.name} names {name!r}, which is not a *.safetensors file of the "
                              "folder; an index may name only the folder's own files by name: fix the index or "
                              "copy the file into the folder")


def _snapshot_blobs(folder: Path) -> list[Path]:
    """``blobs`` of the Hugging Face cache repository whose ``snapshots/REV`` is ``folder``
    (its files are links into it), else nothing."""
    folder = folder.resolve()
    blobs = folder.parent.parent / "blobs"
    return [blobs] if folder.parent.name == "snapshots" and blobs.is_dir() else []


def check_model_folder(folder: Path, spec: str) -> None:
    """Refuse a model folder holding anything transformers or memtrain must not open.

    Every visible entry of ``folder`` (and of :data:`READ_SUBFOLDERS`) must be a folder or a
    regular file inside it (a Hugging Face cache snapshot's links into its ``blobs`` pass):
    a FIFO named tokenizer.json would block the run forever in ``open``, and a link out of the
    folder would make transformers read a file the user never meant to give."""
    entries = list(visible_entries(folder, recursive=False))
    for sub in READ_SUBFOLDERS:
        if (folder / sub).is_dir() and not (folder / sub).is_symlink():
            entries += visible_entries(folder / sub, recursive=True)
    for entry, why in folder_entry_problems(folder, entries, _snapshot_blobs(folder), _read_whole_limit):
        name = str(entry.relative_to(folder))
        if why.startswith(TOO_LARGE):
            raise ConfigError(f"--model {spec!r}: {name!r} is {why}, the most memtrain lets transformers read whole "
                              "into memory; replace it with the model's own file")
        raise ConfigError(f"--model {spec!r}: {name!r} is {why}; a model folder may hold only regular files "
                          "inside it, remove or replace that entry")


def _read_whole_limit(entry: Path) -> Optional[int]:
    if entry.name in CONFIG_FILES and entry.parent.name not in READ_SUBFOLDERS:
        return min(MAX_CONFIG_JSON_BYTES, MAX_READ_WHOLE_BYTES)
    if entry.name in TOKENIZER_ID_FILES and entry.parent.name not in READ_SUBFOLDERS:
        return min(MAX_TOKENIZER_FILE_BYTES, MAX_READ_WHOLE_BYTES)
    return MAX_READ_WHOLE_BYTES if entry.suffix.lower() in READ_WHOLE_SUFFIXES else None


def _name_key(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def spelled_like(spec: str) -> Optional[str]:
    """The known model name (preset or bundled config) that ``spec`` matches but for case and
    punctuation (``llama3-8b`` -> ``llama-3-8b``), or None. Each model has one name, so a
    near-spelling is refused rather than resolved to a second, different model."""
    key = _name_key(spec)
    return next((n for n in model_names() if n != spec and _name_key(n) == key), None)
