"""Reading a config file: YAML, TOML or JSON text into a mapping of settings, checked before it
reaches :func:`memtrain.config.run.build_config`.

Bounded (size, nesting, integer digits) and strict (a key given twice, a setting under another
section, a section holding no settings are refused), with a one-line :class:`ConfigError` that
names the file and what to change. Parsing runs no code: YAML through a ``SafeLoader``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import tomllib
import yaml

from memtrain.config.run import SECTIONS, field_index
from memtrain.errors import ConfigError, require
from memtrain.files.guard import special_file_kind
from memtrain.files.json_text import MAX_INT_DIGITS, MAX_JSON_DEPTH, json_depth_error, loads_bounded

MAX_CONFIG_BYTES = 16 * 2**20


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or TOML config file into a dict (sections or flat keys)."""
    p = Path(path)
    suffix = _config_suffix(p)
    try:
        text = p.read_text(encoding="utf-8")
        data = _parse_config_text(text, suffix)
    except UnicodeDecodeError:
        raise ConfigError(f"config file {str(p)!r} is not UTF-8 text; save it as UTF-8") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(p)!r} ({exc.strerror}); check the --config path") from None
    except (tomllib.TOMLDecodeError, yaml.YAMLError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise ConfigError(f"cannot parse config file {str(p)!r}: {str(exc).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} holds a {type(data).__name__}; it must be a mapping of settings "
                          "(key: value, optionally under model/data/technique/train)")
    _check_key_types(data, str(p))
    data = _checked_sections(data, str(p))
    _check_placement(data, str(p))
    return data


def _config_suffix(p: Path) -> str:
    """The suffix of the config file ``p``, lower-cased, once ``p`` is known to be a regular file
    of a config's size and kind; ConfigError naming what to change otherwise. Nothing is opened."""
    require(not p.is_dir(), f"--config {str(p)!r} is a directory; give a YAML, TOML or JSON file")
    kind = special_file_kind(p)  # a FIFO (never opened: it would block), a device: named, not "not found"
    require(kind is None, f"config file {str(p)!r} is {kind}, not a file; give a YAML, TOML or JSON file")
    require(p.is_file(), f"config file {str(p)!r} not found; check the --config path")
    size = p.stat().st_size
    # Read whole before parsing: a data file given as --config (corpus.json, GBs) took minutes and
    # tens of GB before being refused as "holds a list"; settings take a few KB.
    require(size <= MAX_CONFIG_BYTES, f"config file {str(p)!r} is {size / 2**20:,.1f} MiB, more than the "
            f"{MAX_CONFIG_BYTES // 2**20} MiB a config file may be (settings take a few KB); if it is text to "
            "train on, give it as --data")
    suffix = p.suffix.lower()
    if suffix not in (".toml", ".yaml", ".yml", ".json"):
        raise ConfigError(f"config file {str(p)!r} must end in .yaml, .yml, .toml or .json")
    return suffix


def _check_key_types(data: dict[Any, Any], shown: str) -> None:
    """Every key of the file's top level and of its sections is text (YAML reads ``1:`` or ``true:``
    as a number or a bool), as a setting's name is."""
    for key, value in data.items():
        inner = value.keys() if isinstance(value, dict) else ()
        for k in (key, *inner):
            if not isinstance(k, str):
                raise ConfigError(f"config file {shown!r} has the key {k!r}; keys are setting names such as d_model")


def _checked_sections(data: dict[str, Any], shown: str) -> dict[str, Any]:
    """``data`` without its empty sections (``train:`` whose settings are all commented out is
    YAML's null: it was refused as "unknown option --train"), a section holding anything but
    settings refused naming it. ``model`` and ``data`` are settings too (``model: gpt2``): only
    their null is a section's."""
    settings = field_index()
    kept: dict[str, Any] = {}
    for key, value in data.items():
        section = key.replace("-", "_")
        if section in SECTIONS and value is None:
            continue
        if section in SECTIONS and section not in settings and not isinstance(value, dict):
            example = dataclasses.fields(SECTIONS[section])[0]  # one of its own settings, as shown in --help
            raise ConfigError(f"config file {shown!r} has {key}: holding {_yaml_kind(value)}; a section holds "
                              f"settings (key: value under {key}:), e.g. {key}: {{{example.name}: {example.default!r}}}")
        kept[key] = value
    return kept


def _yaml_kind(value: Any) -> str:
    """What a config value is, in the file's words (a list, a number, text)."""
    kinds = {list: "a list", bool: "true/false", int: "a number", float: "a number", str: "text"}
    return next((word for cls, word in kinds.items() if isinstance(value, cls)), type(value).__name__)


def _check_placement(data: dict[str, Any], shown: str) -> None:
    """Each setting of a config file once, and under its own section when under one: flattened,
    ``train: {d_model: 64}`` beside ``model: {d_model: 32}`` would silently take the later."""
    index = field_index()
    seen: dict[str, str] = {}
    for key, value in data.items():
        section = key.replace("-", "_")
        if section in SECTIONS and isinstance(value, dict):
            entries = [(k.replace("-", "_"), f"{section}:") for k in value]
        else:
            entries = [(section, "the top level")]
        for name, where in entries:
            home = index.get(name)
            if home is not None and where.endswith(":") and where != f"{home}:":
                raise ConfigError(f"config file {shown!r} has {name} under {where} but it is a {home} setting; "
                                  f"move it under {home}:")
            if name in seen:
                raise ConfigError(f"config file {shown!r} sets {name} twice ({seen[name]} and {where}); keep one")
            seen[name] = where


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load``'s loader, refusing a key given twice in one mapping: PyYAML keeps the
    later value silently, so ``steps: 3`` above ``steps: 5`` (or a second ``train:`` section,
    which replaces the first whole) ran with settings the file's reader never saw."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` merges; the keys beside it win by design
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: the base class says so
                continue
            if duplicate:
                raise ValueError(f"the key {key!r} appears twice (line {key_node.start_mark.line + 1}); keep one")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _unique_json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object of a config file, refusing a key given twice (``json`` keeps the later)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} appears twice; keep one")
        out[key] = value
    return out


def _parse_config_text(text: str, suffix: str) -> Any:
    """The settings of a config file's text; ValueError for text no config can hold.

    Nesting is measured before any parser recurses into it (a 100,000-deep list would end
    yaml, tomllib and json with a RecursionError), and integers are capped at MAX_INT_DIGITS
    digits (Python refuses to parse more than 4,300; fewer still overflow every size check).
    The bracket scan reads YAML and TOML flow collections too; YAML's block nesting by
    indentation is caught by the RecursionError guard, since it costs a line per level.
    """
    if suffix == ".json":
        return loads_bounded(text, object_pairs_hook=_unique_json_object)
    too_deep = json_depth_error([text.encode("utf-8", "surrogatepass")])
    if too_deep is not None:
        raise ValueError(f"settings nested deeper than {MAX_JSON_DEPTH} levels (line {too_deep})")
    try:
        # tomllib refuses a key given twice itself; YAML and JSON parsers keep the later one.
        data = tomllib.loads(text) if suffix == ".toml" else yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader
    except RecursionError:
        raise ValueError(f"settings nested deeper than Python can parse (keep them under {MAX_JSON_DEPTH} levels)") from None
    except ValueError as exc:
        if "integer string conversion" in str(exc):  # Python's own cap, phrased for a programmer
            raise ValueError(f"an integer of more than {MAX_INT_DIGITS} digits; no setting takes one") from None
        raise
    _check_int_digits(data)
    return data


def _check_int_digits(data: Any) -> None:
    """ValueError for an integer longer than MAX_INT_DIGITS anywhere in parsed settings.

    Each container is visited once: YAML aliases can share one list many times over (or
    make it contain itself), which a plain recursive walk would expand exponentially."""
    seen: set[int] = set()
    stack = [data]
    while stack:
        value = stack.pop()
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**MAX_INT_DIGITS:
            raise ValueError(f"an integer of more than {MAX_INT_DIGITS} digits; no setting takes one")
        if isinstance(value, (dict, list)) and id(value) not in seen:
            seen.add(id(value))
            stack.extend(value.values() if isinstance(value, dict) else value)
