"""Command line: parse -> config -> call one library function -> print.

Exit codes (docs/architecture.md): 0 success; 2 bad input, with one line on stderr starting
``error:`` that says what to change; 1 any other failure; 130 interrupted.

Run/model/technique flags are generated from the config dataclasses, so every config field
is a flag with its docstring as help, and a config file (YAML/TOML) may set the same keys.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import os
import pkgutil
import re
import sys
import time
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import memtrain.commands as commands
from memtrain import __version__
from memtrain.analysis.limits import MAX_WIDTH, check_at_most
from memtrain.config.aliases import (
    ALIASES,
    BY_NAME,
    EXPANDED,
    TRAINER_OPTIMIZER_DEFAULTS,
    WARMUP_RATIO,
    flag_text,
    normalize,
    refuse_disagreement,
    switch_value,
)
from memtrain.config.argtypes import rank_count
from memtrain.config.file import load_config_file
from memtrain.config.layers import given_settings, model_default_attention, refuse_long_warmup
from memtrain.config.run import (
    SECTIONS,
    ConfigError,
    DataConfig,
    ModelConfig,
    RunConfig,
    TrainConfig,
    build_config,
    check_cache_env,
    check_device_name,
    field_index,
    flatten,
    unknown_option_line,
)
from memtrain.config.train_flags import dormant_settings
from memtrain.devices.forced import check_forced_env
from memtrain.distributed.rank_errors import (
    begin_command,
    env_rank,
    error_line,
    launch_env,
    launched_by_memtrain,
    rendezvous_timeout_s,
    say_error,
)
from memtrain.errors import denied_access, is_out_of_memory, name_too_long, one_line, out_of_room
from memtrain.files.lock import FolderLock, file_lock
from memtrain.files.results import RESULT_NAME, write_json_atomic
from memtrain.report.by_module import module_table_lines
from memtrain.runtime.extras import quiet_third_party
from memtrain.runtime.notices import install_warning_format, random_base_warning
from memtrain.runtime.signals import bind_rank_to_launcher, sigterm_as_interrupt
from memtrain.runtime.streams import tolerant_std_streams
from memtrain.training.preflight import check_before_launch
from memtrain.training.resume_check import (
    continue_longer,
    moved_checkpoint_note,
    resume_state,
    resumed_settings,
    saved_state,
)

# argparse's words for an option given without its value (its aliases joined by "/").
_EXPECTED_ONE = re.compile(r"argument (\S+): expected one argument$")


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one ``error:`` line and exit code 2.

    Abbreviations are off: with argparse's default, a misspelt prefix such as ``--learning_rat``
    silently meant ``--learning_rate``; every option must be written in full.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Optional[Sequence[str]] = None, namespace: Any = None) -> Any:  # type: ignore[override]
        # Kept for error(): argparse's message does not say which value it read as a flag.
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(one_line(f"error: {message}{self._dash_value_hint(message)}; see '{self.prog} --help'") + "\n")
        raise SystemExit(2)

    def _dash_value_hint(self, message: str) -> str:
        """For "argument --budget: expected one argument" where the value given starts with a dash
        (``--budget -1GiB``): argparse read it as a flag; ``--budget=-1GiB`` reaches the value's own
        check, which then says what is wrong with it."""
        named = _EXPECTED_ONE.match(message)
        argv = getattr(self, "_argv", [])
        if named is None:
            return ""
        flags = set(named.group(1).split("/"))
        for flag, value in zip(argv, argv[1:]):
            if flag in flags and value.startswith("-") and value not in self._option_string_actions:
                return f" ({flag} {value}: a value starting with '-' reads as a flag; write {flag}={value})"
        return ""


    def reject_unknown(self, extra: Sequence[str]) -> None:
        """Refuse options this command does not know, naming the closest known one."""

        unknown = [a for a in extra if a.startswith("-")] or list(extra)
        first = unknown[0].split("=", 1)[0]
        # Only flags --help lists: not the unlisted underscore spellings (--n_layers for --n-layers).
        options = [o for o, action in self._option_string_actions.items()
                   if o.startswith("--") and action.help is not argparse.SUPPRESS]
        # A shortened option (--seq) names what it was short for, memtrain's own spelling before a
        # Trainer alias (--lora: --lora-rank, not --lora_r); else the closest spelling.
        close = sorted((o for o in options if o.startswith(first) and len(first) > 2),
                       key=lambda o: (o[2:].replace("-", "_") in BY_NAME, len(o)))[:1] \
            or difflib.get_close_matches(first, options, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        self.error(f"unrecognized arguments: {' '.join(extra)}{hint}")


def _type_name(f: Any) -> str:
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return t[len("Optional["):-1] if t.startswith("Optional[") else t


# Fields that only the training loop reads (schedule, evaluation, checkpoints, output): the
# verbs that look at one step (estimate, maxbatch, flops, plan) leave them out of their --help.
LOOP_ONLY_FIELDS: tuple[str, ...] = (
    "steps", "lr", "warmup_steps", "schedule", "min_lr_ratio", "weight_decay", "beta1", "beta2",
    "grad_clip", "eval_every", "warmup_timing_steps", "sync_steps", "out", "save", "save_every", "resume",
    "stop_after", "progress", "adafactor_relative_step", "report_to", "log_every",
)
# The --memory-by-module table's fields: train measures it and estimate traces it; the verbs that
# only size or count a step (maxbatch, flops, plan) leave them out of their flags.
MODULE_TABLE_FIELDS: tuple[str, ...] = ("memory_by_module", "module_depth", "module_top")


# The namespace attribute where switch aliases note, per field, each (flag, value) that set it:
# checked against the field's final value once parsing ends (check_switches).
SWITCHES_SET = "_switches_set"


class _ValueAlias(argparse.Action):
    """A Trainer name of a field (``--learning_rate`` for ``--lr``): it sets the field, and beside
    another name of the field asking for another value it is refused (check_switches), since
    whichever came last would silently win."""

    nargs_taken: Any = None

    def __init__(self, option_strings: Sequence[str], dest: str, alias: Any = None, **kw: Any) -> None:
        self.alias = alias
        super().__init__(option_strings, dest, nargs=self.nargs_taken, **kw)

    def value(self, parser: argparse.ArgumentParser, values: Any) -> Any:
        """The field's value this flag asks for (None: it asks for nothing)."""
        return values

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: Optional[str] = None) -> None:
        value = self.value(parser, values)
        if value is None:
            return
        noted: dict[str, list[tuple[str, Any]]] = getattr(namespace, SWITCHES_SET, None) or {}
        given = noted.setdefault(self.dest, [])
        if hasattr(namespace, self.dest) and not (given and given[-1][1] == getattr(namespace, self.dest)):
            earlier = getattr(namespace, self.dest)  # set by the field's own flag (--precision) before
            given.append((flag_text(self.dest, earlier), earlier))
        given.append((option_string or "--" + self.alias.name, value))
        setattr(namespace, SWITCHES_SET, noted)
        setattr(namespace, self.dest, value)


class _SwitchAlias(_ValueAlias):
    """A Trainer switch such as ``--bf16``: alone it sets its field; ``--bf16 false`` does not.
    Beside another name of the field asking for another value it is refused (check_switches)."""

    nargs_taken = "?"

    def value(self, parser: argparse.ArgumentParser, values: Any) -> Any:
        try:
            return switch_value(self.alias, values)
        except ValueError as exc:
            parser.error(str(exc))


def check_switches(args: argparse.Namespace) -> None:
    """Refuse a Trainer alias whose field another flag set to something else, before or after it
    (``--fp16 --bf16``, ``--precision fp16 --bf16``, ``--bf16 --precision fp16``,
    ``--lr 1e-3 --learning_rate 2e-3``)."""
    for field, given in (getattr(args, SWITCHES_SET, None) or {}).items():
        final = getattr(args, field)
        later = [(flag_text(field, final), final)] if final != given[-1][1] else []
        try:
            refuse_disagreement(field, given + later)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


def _add_aliases(parser: argparse.ArgumentParser, targets: set[str]) -> None:
    """The Trainer's option names (memtrain.config.aliases) whose field this verb uses."""

    chosen = [a for a in ALIASES if a.field in targets]
    if not chosen:
        return
    group = parser.add_argument_group(
        "transformers.TrainingArguments names",
        "Aliases for users of the Hugging Face Trainer (dash or underscore spelling). Names the Trainer "
        "shares with memtrain (--warmup_steps, --weight_decay, --seed, --lora_alpha, ...) work with "
        "underscores too, and --optim takes the Trainer's values (adamw_torch_fused, adamw_torch, adafactor, "
        "adamw_bnb_8bit, adamw_torch_8bit, adamw_torch_4bit).")
    for a in chosen:
        flags = list(dict.fromkeys(["--" + a.name, "--" + a.name.replace("_", "-")]))
        if a.expand is not None:
            # Kept under its own name: build_config expands it (several settings, or a refusal).
            group.add_argument(*flags, dest=a.name, default=argparse.SUPPRESS, metavar="VALUE", help=a.help)
        elif a.is_switch:
            group.add_argument(*flags, dest=a.field, action=_SwitchAlias, alias=a, default=argparse.SUPPRESS,
                               metavar="BOOL", help=a.help)
        else:
            group.add_argument(*flags, dest=a.field, action=_ValueAlias, alias=a, default=argparse.SUPPRESS,
                               metavar="VALUE", help=a.help)


def add_config_flags(parser: argparse.ArgumentParser, sections: Sequence[str] = tuple(SECTIONS),
                     exclude: Sequence[str] = (), helps: Optional[dict[str, str]] = None) -> None:
    """One flag per config field of ``sections`` (except the field names in ``exclude``);
    unset flags stay absent (SUPPRESS) so that a config file's values are only overridden by
    flags actually given. The Trainer's names of these fields are added as aliases. ``helps``:
    a verb's own help of a field, where the field's (train's) speaks of flags the verb lacks."""
    parser.add_argument("--config", help="YAML or TOML file with settings (sections model/data/technique/train or flat keys).")
    added: set[str] = set()
    for section in sections:
        group = parser.add_argument_group(f"{section} options")
        for f in fields(SECTIONS[section]):
            if f.name in exclude:
                continue
            added.add(f.name)
            flag = "--" + f.name.replace("_", "-")
            default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc,operator]  # MISSING ruled out just before
            help_text = f"{(helps or {}).get(f.name, f.metadata.get('help', ''))} (default: {default})"
            kind = _type_name(f)
            if kind == "bool" and f.name.startswith("no_"):
                # A negative name (no_cache) gets one switch: BooleanOptionalAction would add --no-no-cache.
                group.add_argument(flag, dest=f.name, action="store_true", default=argparse.SUPPRESS, help=help_text)
            elif kind == "bool":
                group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                                   default=argparse.SUPPRESS, help=help_text)
            else:
                group.add_argument(flag, dest=f.name, default=argparse.SUPPRESS, metavar=kind.upper(),
                                   help=help_text)
            if "_" in f.name:
                # The underscore spelling (--warmup_steps, as TrainingArguments writes it), not listed.
                if kind == "bool":
                    group.add_argument("--" + f.name, dest=f.name, action="store_const", const=True,
                                       default=argparse.SUPPRESS, help=argparse.SUPPRESS)
                else:
                    group.add_argument("--" + f.name, dest=f.name, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    _add_aliases(parser, added)


# What the verbs that size a step without reading data (estimate, plan, maxbatch) add to train's
# --loss-on help: they cannot count a batch's answer tokens, so they size the step that has some.
LOSS_ON_SIZED = (" Here no data is read (no --data, no --data-format): 'completion' sizes the step of such a run, "
                 "assuming every micro-batch holds answer tokens (the answers-only loss: an int64 copy of the "
                 "targets and a float32 weight per micro-batch).")


def add_loss_on_flag(parser: argparse.ArgumentParser) -> None:
    """train's ``--loss-on`` (the same name, help and default), for a verb that takes no data
    section: its help adds :data:`LOSS_ON_SIZED`. A config file's ``loss_on`` reaches the verb as
    ever (config_from_args reads every section of it)."""
    f = next(f for f in fields(DataConfig) if f.name == "loss_on")
    group = parser.add_argument_group("data options")
    group.add_argument("--loss-on", dest=f.name, default=argparse.SUPPRESS, metavar=_type_name(f).upper(),
                       help=f"{f.metadata.get('help', '')}{LOSS_ON_SIZED} (default: {f.default})")
    group.add_argument("--loss_on", dest=f.name, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


PACKING_SIZED = (" Here no data is read: a step is sized as one of either packing, batch x --seq-len positions (a padded "
                 "row computes as many as a packed block).")


def add_packing_flag(parser: argparse.ArgumentParser) -> None:
    """train's ``--packing`` for a verb that takes no data section (estimate, plan, maxbatch): the
    memory of a step does not depend on it (the same batch x seq_len shape), and the help says so."""
    f = next(f for f in fields(DataConfig) if f.name == "packing")
    group = parser.add_argument_group("data options")
    group.add_argument("--packing", dest=f.name, default=argparse.SUPPRESS, metavar=_type_name(f).upper(),
                       help=f"{f.metadata.get('help', '')}{PACKING_SIZED} (default: {f.default})")


def _refuse_foreign_keys_in_file(args: argparse.Namespace, file_layer: dict[str, Any]) -> None:
    """A config file holds run settings (the model, data, technique and train sections), not the
    command's own options: ``memory_budget`` in maxbatch's file was refused as "unknown option
    --memory-budget; did you mean --compile-memory-budget?", an option maxbatch's --help lists.
    A name that is no setting at all is refused naming the file too: the same line for a flag
    and for a file's key left the user to find which of the two held it."""
    try:
        keys = normalize(flatten(file_layer))  # the Trainer's names become ours, as build_config reads them
    except ValueError:
        return  # build_config names what is wrong with the file
    index = field_index()
    parser = getattr(args, "_parser", None)
    options = parser._option_string_actions if parser is not None else {}  # this command's own flags
    where = f"config file {str(args.config)!r}"
    for key in keys:
        flag = "--" + key.replace("_", "-")
        if key in index or key == WARMUP_RATIO:
            continue
        if flag in options:
            raise ConfigError(f"{where}: {key} is an option of this command, not a run setting (a config file holds "
                              f"the model, data, technique and train settings); give {flag} on the command line")
        raise ConfigError(f"{where}: {unknown_option_line(key)}")


def config_from_args(args: argparse.Namespace, base: Optional[dict[str, Any]] = None,
                     derive_max_seq_len: bool = False, resumed: bool = False) -> RunConfig:
    """Defaults <- ``base`` (e.g. a bench preset) <- config file <- flags.

    ``derive_max_seq_len`` (the verbs that size one step): when no layer sets --max-seq-len,
    it follows --seq-len, so ``estimate --seq-len 2048`` needs no second flag.
    ``resumed`` (train): a ``--resume CKPT`` (flag or config file) makes the checkpoint's saved
    settings the base, so that ``--resume CKPT`` alone continues the run
    (:func:`memtrain.training.resume_check.resumed_settings`).
    """
    check_switches(args)
    known = {f.name for cls in SECTIONS.values() for f in fields(cls)} | EXPANDED
    flags = {k: v for k, v in vars(args).items() if k in known}
    file_layer = load_config_file(args.config) if getattr(args, "config", None) else {}
    _refuse_foreign_keys_in_file(args, file_layer)
    given = given_settings(file_layer, flags)  # the user's settings, read once
    resume = given.get("resume") if resumed else None
    moved_from = None  # the --save a moved or copied checkpoint was written as
    entries = None  # the checkpoint's small entries, read once: the run's checks take them from cfg
    if resume:
        launched = bool(getattr(args, "nproc_per_node", None)) or "WORLD_SIZE" in os.environ
        out_given = "out" in given
        entries = saved_state(str(resume))
        taken, moved_from = resumed_settings(str(resume), launched, out_given, entries)
        base = {**(base or {}), **taken}
    layers = [base or {}, file_layer, flags]
    merged = given_settings(*layers)
    layers.append(model_default_attention(*layers))
    if derive_max_seq_len:
        if "max_seq_len" not in merged and "seq_len" in merged:
            try:
                seq = int(merged["seq_len"])
            except (TypeError, ValueError, OverflowError):  # a config file's .inf: no int
                seq = 0  # build_config below reports the bad value
            if seq > build_config(base or {}).model.max_seq_len:
                # The derived --max-seq-len is the user's --seq-len: a size beyond the limit is
                # refused naming the flag they gave (it named --max-seq-len, never written).
                check_at_most("--seq-len", seq, MAX_WIDTH)
                layers.append({"max_seq_len": seq})
    cfg = build_config(*layers)
    _refuse_ignored_model_flags(cfg, given)
    _refuse_flags_of_an_unused_technique(cfg, given)
    if "warmup_steps" in given:
        refuse_long_warmup(cfg.train)
    # Remembered (not a field) for defaults_note: which settings a layer named.
    cfg.given_settings = frozenset(merged)  # type: ignore[attr-defined]  # read with getattr(..., None)
    # And, for train to say after the run, the outputs a moved checkpoint did not lend.
    cfg.resume_note = moved_checkpoint_note(cfg, moved_from, given)  # type: ignore[attr-defined]
    if entries is not None and cfg.train.resume == os.path.expanduser(str(resume)):  # for resume_state: read no more
        cfg.resumed_state = (cfg.train.resume, entries)  # type: ignore[attr-defined]
    return cfg


# memtrain's GPT's settings that a transformers model has no counterpart for, and why.
GPT_ONLY_MODEL_FIELDS = {
    "bias": "builds the biases its own layer code gives it",
    "vocab_multiple": "embeds exactly its config.json's vocab_size rows",
}


def _refuse_ignored_model_flags(cfg: RunConfig, given: dict[str, Any]) -> None:
    """A ``--model`` (a transformers config or a GPT preset) sets the model fields it describes
    (shape, tied head, attention dropout) from its own config, over any flag: a flag or config-file
    value that would be dropped is refused in one line instead of ignored. Values equal to the
    model's pass (a config file written for the same model)."""
    spec = cfg.model.model
    if spec is None:
        return
    model_fields = {f.name for f in fields(ModelConfig)} - {"model"}
    transformers_model = _is_transformers_model(spec)
    for name in sorted(model_fields & set(given)):
        current = getattr(cfg.model, name)  # the model's own (models.spec.model_fields)
        try:
            same = type(current)(given[name]) == current
        except (TypeError, ValueError):
            same = False
        if same:
            continue
        if transformers_model and name in GPT_ONLY_MODEL_FIELDS:
            # A transformers model's layer code decides its biases and its embedding rows: memtrain's
            # GPT-only settings would be recorded in result.json (and counted by estimate) but never built.
            raise ConfigError(f"{flag_text(name, given[name])}: --model {spec} is a transformers model, which "
                              f"{GPT_ONLY_MODEL_FIELDS[name]}; drop the flag")
        raise ConfigError(f"--{name.replace('_', '-')} {given[name]}: --model {spec} sets {name} from its own "
                          f"config ({current}); drop the flag, or change it in a copy of the model's config")


def given_off_default(cfg: RunConfig, given: Iterable[str], names: Iterable[str]) -> list[str]:
    """Those of the settings ``names`` (in their order) that a layer named (``given``: a flag or a
    config file) and that hold another value than their default in ``cfg``. A value equal to the
    default asks for nothing: a config file may spell out every key."""
    defaults, index, named = RunConfig(), field_index(), set(given)
    return [n for n in names if n in named
            and getattr(getattr(cfg, index[n]), n) != getattr(getattr(defaults, index[n]), n)]


def _refuse_flags_of_an_unused_technique(cfg: RunConfig, given: dict[str, Any]) -> None:
    """A setting of a technique that is off (``--lora-targets`` without ``--lora-rank``, ``--compile-mode``
    without ``--compile``) would be dropped: refused in one line instead (:func:`given_off_default`)."""
    dormant = dormant_settings(cfg)
    off = given_off_default(cfg, given, dormant)
    if not off:
        return
    name = off[0]
    value, switch = getattr(getattr(cfg, field_index()[name]), name), dormant[name]
    flag = f"--{name.replace('_', '-')}"
    shown = flag if isinstance(value, bool) else f"{flag} {value}"
    raise ConfigError(f"{shown} applies only with {switch}; add {switch.split(' (')[0]} or drop {flag}")


def _is_transformers_model(spec: Any) -> bool:
    from memtrain.models.spec import is_gpt_preset  # torch-free

    return isinstance(spec, str) and not is_gpt_preset(spec)


def defaults_note(cfg: RunConfig, searched: Iterable[str] = (), trains: bool = False) -> Optional[str]:
    """One ``defaults used:`` line naming the defaults that shaped the answer and that a user of
    transformers' Trainer and peft would likely have set differently, or None. Only for configs
    read by :func:`config_from_args` (and their ``replace`` copies), which remember what was given.
    ``searched``: settings the command chooses itself (maxbatch's length search: ``seq_len``),
    never defaults. ``trains``: the answer is a training run (train), whose optimizer settings
    shape it too."""
    given = getattr(cfg, "given_settings", None)
    if given is None:
        return None
    given = frozenset(given) | frozenset(searched)
    tech = cfg.technique
    hf = _is_transformers_model(cfg.model.model)
    parts = []
    if "attention" not in given:
        parts.append(f"attention={tech.attention} (the model's default, as in transformers; --attention to choose)"
                     if hf else f"attention={tech.attention} (memtrain's GPT; --attention sdpa for the fused kernel)")
    if "seq_len" not in given:
        parts.append(_seq_len_default(cfg, hf))
    if tech.lora_rank and not tech.qlora and tech.precision in ("bf16", "fp16"):
        parts.append(f"base weights fp32 under {tech.precision} autocast (use --precision bf16-pure to store them "
                     "in bf16, as a model loaded in bfloat16 for peft)")
    if tech.lora_rank and "lora_alpha" not in given:
        # peft's LoraConfig defaults lora_alpha to 8: the same rank there scales the update by
        # 8 / r, here by 16 / r (twice the step at the same --lr).
        parts.append(f"lora-alpha {tech.lora_alpha:g} (scale alpha / r = {tech.lora_alpha / tech.lora_rank:g}; "
                     f"peft's LoraConfig default is 8; --lora-alpha)")
    if tech.lora_rank and hf and "lora_targets" not in given:
        parts.append(f"LoRA on every decoder Linear (peft's all-linear; {_fewer_targets_hint(cfg.model.model)})")
    if trains and hf:
        parts += _optimizer_defaults(cfg, given)
    return "defaults used: " + "; ".join(parts) if parts else None


def _optimizer_defaults(cfg: RunConfig, given: frozenset[str]) -> list[str]:
    """The optimizer settings a fine-tune of a transformers model ran at memtrain's default where
    the Trainer's differs (lr 3e-4 against 5e-5 is six times the step a Trainer recipe takes)."""
    adam = cfg.technique.optim.startswith("adamw")
    shown = []
    for name, theirs in TRAINER_OPTIMIZER_DEFAULTS:
        if name in given or (name == "beta2" and not adam):
            continue
        ours = getattr(cfg.train, name)
        if ours != theirs:
            flag = "--" + name.replace("_", "-")
            shown.append(f"{flag[2:]} {ours:g} (the Trainer's default is {theirs:g}; {flag})")
    return shown


def _fewer_targets_hint(spec: Any) -> str:
    """How to adapt fewer modules, in names the model has (GPT-2 has no q_proj: its q/k/v are c_attn)."""
    from memtrain.models.spec import fewer_lora_targets  # torch-free

    targets = fewer_lora_targets(spec) if isinstance(spec, str) else None
    if targets is None:
        return "--lora-targets with some of the model's Linear names for fewer"
    return f"--lora-targets {targets} for fewer"


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


# --------------------------------------------------------------------------- train
def add_train_flags(parser: argparse.ArgumentParser) -> None:
    """train's flags: every config field, and how many ranks to start (not a config field:
    it says how the run is launched, not what it computes)."""

    add_config_flags(parser)
    parser.add_argument("--nproc-per-node", dest="nproc_per_node", type=rank_count, default=None, metavar="N",
                        help="Start N data-parallel ranks on this machine (torchrun's launcher, run by memtrain: "
                        "bad input is one error: line and exit 2). Needs --distributed ddp|zero1|zero2|fsdp.")
    parser.add_argument("--nproc_per_node", dest="nproc_per_node", type=rank_count, default=None,
                        help=argparse.SUPPRESS)  # torchrun's spelling


def _launch_ranks(args: argparse.Namespace, cfg: RunConfig) -> int:
    """``--nproc-per-node N``: check everything a rank could refuse, hold the --out lock,
    then start the ranks (memtrain.distributed.launch)."""
    from memtrain.distributed.launch import launch  # torch loads only for --nproc-per-node

    if "WORLD_SIZE" in os.environ:
        raise ConfigError("--nproc-per-node starts the ranks itself; under torchrun drop it (or run without torchrun)")
    # torch loads only when train runs: --help and the analytic commands stay torch-free
    from memtrain.training.train import remove_stale_writes

    rendezvous_timeout_s()  # every rank reads it at its rendezvous: a bad value is said before any starts
    check_before_launch(cfg, args.nproc_per_node)
    with FolderLock(Path(cfg.train.out), "memtrain train", cleanup_if_unused=True), contextlib.ExitStack() as held:
        if cfg.train.save:
            held.enter_context(file_lock(Path(cfg.train.save), "memtrain train", "--save"))
        remove_stale_writes(cfg)
        return launch(args.nproc_per_node, args._argv)


def allocation_of(exc: BaseException) -> str:
    """The allocation an out-of-memory error names ("tried to allocate 6.13 GiB"), or its kind."""
    found = re.search(r"tried to allocate (\d+(?:\.\d+)?) ?(bytes|[KMGT]?i?B)\b", str(exc), re.IGNORECASE)
    if not found:
        return type(exc).__name__
    if found.group(2).lower() == "bytes":
        return f"it tried to allocate {fmt_bytes(float(found.group(1)))}"
    return f"it tried to allocate {found.group(1)} {found.group(2)}"


def _seq_len_default(cfg: RunConfig, hf: bool) -> str:
    """The defaults line's part for a sequence length nobody gave: memtrain's default, or the
    model's positions where they are fewer (build_config caps it there), named as the user set
    them: a transformers model's max_position_embeddings, our GPT's --max-seq-len."""
    seq_len = cfg.train.seq_len
    if not seq_len == cfg.model.max_seq_len < TrainConfig.seq_len:
        return f"seq-len {seq_len} (--seq-len)"
    positions = "the model's max_position_embeddings" if hf else f"--max-seq-len {seq_len}"
    return f"seq-len {seq_len} ({positions}, under memtrain's {TrainConfig.seq_len}; --seq-len)"


def parameter_line(result: dict[str, Any]) -> str:
    """The run's parameter counts in one line; with LoRA also their sum and the trainable share
    as peft's ``print_trainable_parameters`` states them (its "all params" counts the adapters,
    which ``parameters``, the model as built, leaves out)."""
    base, trainable = result["parameters"], result["trainable_parameters"]
    adapters = result.get("adapter_parameters") or 0
    if not adapters:
        return f"parameters {base:,} ({trainable:,} trainable)"
    total = base + adapters
    return (f"parameters {base:,} + {adapters:,} LoRA adapter = {total:,}; "
            f"trainable {trainable:,} ({100 * trainable / total:.4f}%)")


def _print_data_lines(data: str) -> None:
    """Which local files ``--data`` reads (stdout) and, on stderr, a warning when a folder holds
    one name in several formats: a folder is read whole, every supported format in it."""
    from memtrain.data.sources import local_data_lines  # memtrain.data imports torch: train needs it anyway

    for line in local_data_lines(data):
        print(line, file=sys.stderr if line.startswith("warning:") else sys.stdout, flush=True)


def _print_val_data_lines(data: Any) -> None:
    """What a validation source of its own (--val-data) reads, as :func:`_print_data_lines` says
    it of --data, and a warning on stderr when it is the training data itself."""
    # memtrain.data imports torch: train needs it anyway
    from memtrain.data.sources import local_data_lines
    from memtrain.data.validation import same_source_warning

    val_cfg = data.validation_config()
    if val_cfg is None:
        return
    for line in local_data_lines(val_cfg.data):
        if line.startswith("warning:"):
            print(line.replace("--data", "--val-data", 1), file=sys.stderr, flush=True)
        else:
            print(f"val {line}", flush=True)
    warning = same_source_warning(data)
    if warning:
        print(warning, file=sys.stderr, flush=True)


def _after_run_notes(cfg: Any, longer: Optional[str], moved: Optional[str]) -> None:
    """The notes train writes to stderr after its run (after it, so that a failure's stderr stays
    its one error: line): a defaulted warm-up, no --save, a longer run continued, a moved checkpoint."""
    if getattr(cfg.train, "warmup_defaulted", False):
        n = cfg.train.warmup_steps
        sys.stderr.write(f"note: warm-up was {n} step{'' if n == 1 else 's'} (10% of --steps {cfg.train.steps}, "
                         "at most 200); set --warmup-steps to choose\n")
    if not cfg.train.save:
        # The Trainer saves checkpoints by default; memtrain writes weights only where --save
        # says, and a first run's export or generate then found nothing to read.
        sys.stderr.write("note: no --save: the trained weights were not written; give --save FILE to export, "
                         "generate from or --resume a run\n")
    for line in (longer, moved):
        if line:
            sys.stderr.write(line + "\n")


def _written_since(path: Optional[str], started: float) -> bool:
    """Whether ``path`` (a checkpoint file, or a sharded checkpoint's folder) was written at or
    after ``started``: by this run, not left there by an earlier one."""
    if not path:
        return False
    try:
        return os.stat(path).st_mtime >= started - 1  # a coarse filesystem clock rounds down
    except OSError:
        return False


def _resume_note(save: Optional[str], started: float, steps_done: Optional[int] = None,
                 save_every: int = 0) -> str:
    """The line an interrupted train writes before its ``error: interrupted`` one: where the
    steps it trained are kept and the command that continues them. The interrupt said only that
    results were kept, and a user had to know that --save-every's file holds the run.
    ``steps_done``: the steps this run finished before the interrupt (None: not counted);
    ``save_every``: the run's --save-every. A run stopped while it read, tokenized or built had
    trained nothing, and was told to add the --save-every it had given."""
    if _written_since(save, started):
        return (f"note: the steps trained up to the last checkpoint are in {one_line(str(save))}; "
                f"`memtrain train --resume {one_line(str(save))}` continues the run")
    if steps_done == 0:
        where = f" to {one_line(str(save))}" if save else ""
        return (f"note: the run stopped before its first step (while it read the data or built the model), "
                f"so nothing was saved{where} yet")
    if save and save_every and steps_done is not None:
        return (f"note: no checkpoint was written before the interrupt: the run stopped after {steps_done} "
                f"step{'' if steps_done == 1 else 's'}, before its first --save-every {save_every} checkpoint "
                f"to {one_line(str(save))}")
    if save:
        return (f"note: no checkpoint was written before the interrupt; --save-every N writes {one_line(str(save))} "
                "every N steps, for --resume")
    return "note: no --save: the trained steps were not kept; --save FILE --save-every N keeps them for --resume"


def refuse_device_not_here(name: str) -> None:
    """Refuse a --device that is not supported, or a CUDA one that is not here, from the argument,
    before a verb loads its machinery (train's and maxbatch's modules took seconds to import before
    the line came). A CUDA name loads torch alone to ask for the device."""
    check_device_name(name)
    if name.startswith("cuda"):
        from memtrain.runtime.env import resolve_device  # torch: only to ask whether the GPU is here

        resolve_device(name)


def cmd_train(args: argparse.Namespace) -> int:
    cfg = config_from_args(args, resumed=True)
    refuse_device_not_here(cfg.train.device)
    from memtrain.training.train import train  # after the refusals that need no model: seconds to import

    cfg.data.check_answer_source()  # before a note is printed or a rank launched (train() checks it again)
    if getattr(args, "nproc_per_node", None) and not launched_by_memtrain():
        return _launch_ranks(args, cfg)
    out = Path(cfg.train.out)
    env = launch_env()  # bad launch variables: exit 2 before anything starts
    main_rank = env is None or env.rank == 0  # under torchrun only rank 0 writes and prints
    note = defaults_note(cfg, trains=True)
    if note and main_rank:
        print(note, flush=True)
    if main_rank:
        _print_data_lines(cfg.data.data)
        _print_val_data_lines(cfg.data)
    moved = getattr(cfg, "resume_note", None)  # said after the run, as --steps longer is
    longer = continue_longer(cfg, resume_state(cfg))  # said after the run (below), as the warm-up's note is

    def write_result(result: dict) -> None:  # before the final checkpoint (see train())
        if main_rank:
            # Its name was checked before the first step: a link there now was planted since.
            write_json_atomic(out / RESULT_NAME, result, replace_link=True)

    # SIGTERM stops like Ctrl-C (main() turns it into KeyboardInterrupt for the whole command):
    # finally blocks run, scratch is removed, exit 130. The --out lock: a second train or bench
    # on the folder is refused (exit 2). Under memtrain's launcher the launcher holds it and the
    # ranks add themselves as its writers.
    steps = _StepCount(_warn_after_first_step(random_base_warning(cfg) if main_rank else None))
    started = time.time()
    try:
        result = train(cfg, on_result=write_result, log_metrics=True, lock_out=True, on_step=steps)
    except KeyboardInterrupt:
        if main_rank:
            sys.stderr.write(_resume_note(cfg.train.save, started, steps.done, cfg.train.save_every) + "\n")
        raise
    except Exception as exc:
        if not is_out_of_memory(exc) or env is not None:  # under torchrun each rank says its own
            raise
        # The estimate's modules, read only for this refusal: the flags the run does not use yet.
        from memtrain.analysis.advice import save_memory_clause
        from memtrain.runtime.env import resolve_device

        t = cfg.train
        save = save_memory_clause(cfg, None, resolve_device(t.device).type).text
        raise ConfigError(f"out of memory training batch {t.batch_size} x seq {t.seq_len} ({allocation_of(exc)}): lower "
                          "--batch-size (--grad-accum keeps the tokens per step)" + (f", or {save}" if save else "")
                          + "; `memtrain maxbatch` finds the largest batch that fits") from None
    if not main_rank:
        return 0  # result["ranks"] has every rank's numbers
    _after_run_notes(cfg, longer, moved)
    mem = result["memory"]
    print(parameter_line(result))
    print(
        f"steps {result['steps']}  train loss {result['train_loss']:.4f}{_train_loss_span(result)}  "
        f"val loss {result['val_loss']:.4f}  val ppl {result['val_ppl']:.2f}{_val_span(result)}"
    )
    if result["steps_run"]:
        print(
            f"step time {result['step_time_s']['median'] * 1000:.1f} ms (median)  "
            f"{result['tokens_per_s']:,.0f} tokens/s{_padding_span(result)}  {result['steps_run']} "
            f"step{'' if result['steps_run'] == 1 else 's'} in {result['total_time_s']:.1f} s  "
            f"tracked peak {fmt_bytes(mem.get('peak_bytes'))}"
            # On a CPU the "device" is the host itself: the time between steps is loop work, not idling.
            + (f"  device idle between steps {result['device_idle_share']:.1%}"
               if result.get("device_idle_share") is not None
               and (result.get("env") or {}).get("device_type") not in (None, "cpu") else "")
        )
    else:  # a resume at the run's last step: its steps were timed and metered by the run it finishes
        print("no step ran: the checkpoint was at the run's last step; step time, tokens/s and memory are "
              "null in result.json")
    setup = result.get("setup_time_s") or {}
    if setup:
        first = setup.get("first_step")
        print(f"before the first step: model {setup.get('model', 0):.1f} s, techniques and optimizer "
              f"{setup.get('state', 0):.1f} s, data {setup.get('data', 0):.1f} s"
              + (f"; the first step took {first:.1f} s" if first is not None else "")
              + (" (torch.compile compiles in it)" if first is not None and cfg.technique.compile else ""))
    if mem.get("by_module"):
        print("\n".join(module_table_lines(mem["by_module"], cfg.train.module_top, fmt_bytes)))
    if _written_since(cfg.train.save, started):  # before result.json's line, which scripts read as the last
        print(f"wrote {one_line(str(cfg.train.save))} (--resume, export and generate read it)")
    print(f"wrote {one_line(str(out / 'result.json'))}")  # a newline in --out stays one line
    return 0


def _train_loss_span(result: dict[str, Any]) -> str:
    """What the train loss averages (the Trainer's train_loss is the mean over every step run)."""
    n = result.get("train_loss_steps")
    return f" (mean of the last {n} step{'' if n == 1 else 's'})" if n else ""


def _val_span(result: dict[str, Any]) -> str:
    """What the val loss covers: --val-blocks blocks, not the whole held-out split as the Trainer's
    eval, of the source result.json's ``data.val_source`` names (--val-data, --val-split)."""
    data = result.get("data") or {}
    n, held_out = data.get("val_tokens_evaluated"), data.get("val_tokens")
    if not (n and held_out):
        return ""
    source = data.get("val_source")
    own = isinstance(source, str) and not source.startswith("--val-fraction")  # a source of its own
    where = f"the {held_out:,} tokens of {source}" if own else f"{held_out:,} held-out tokens"
    answers = data.get("val_target_tokens_evaluated")
    if answers is not None:  # --loss-on completion: the average is over answers only
        return f" (on the {answers:,} answer tokens of {n:,} of {where}; --loss-on completion, --val-blocks)"
    real = (result.get("padding") or {}).get("val_targets_evaluated")
    if real is not None:  # --packing pad: the average is over real targets only
        return f" (on the {real:,} real targets of {n:,} padded positions of {where}; --packing pad, --val-blocks)"
    return f" (on {n:,} of {where}; --val-blocks)"


def _padding_span(result: dict[str, Any]) -> str:
    """--packing pad: tokens/s counts every computed position; say how many were real tokens."""
    pad, real = result.get("pad_fraction"), result.get("real_tokens_per_s")
    return f" ({real:,.0f} real, {pad:.1%} of positions padding)" if pad and real is not None else ""


class _StepCount:
    """train()'s ``on_step`` that keeps how many steps this run has finished (what an interrupted
    run's note says) and passes each step on to ``then``."""

    def __init__(self, then: Optional[Callable[[int, int, Optional[float]], None]]) -> None:
        self.done = 0
        self.then = then

    def __call__(self, done: int, total: int, median_s: Optional[float]) -> None:
        self.done = done  # before ``then``, which may raise (Ctrl-C arrives anywhere)
        if self.then is not None:
            self.then(done, total, median_s)


def _warn_after_first_step(warning: Optional[str]) -> Optional[Callable[[int, int, Optional[float]], None]]:
    """train()'s ``on_step`` that writes ``warning`` to stderr once, after the first step: early
    in the run, yet after everything that can refuse the input, whose stderr stays one error: line."""
    if warning is None:
        return None
    said = False

    def on_step(done: int, total: int, median_s: Optional[float]) -> None:
        nonlocal said
        if not said:
            said = True
            sys.stderr.write(warning + "\n")
            sys.stderr.flush()

    return on_step


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}


def register(name: str, help: str, add_args: Callable[[argparse.ArgumentParser], None],
             run: Callable[[argparse.Namespace], int]) -> None:
    """Add a subcommand (other modules register theirs in :func:`_load_commands`)."""
    COMMANDS[name] = (help, add_args, run)


def _load_commands() -> None:
    register("train", "Train one model with any combination of techniques; writes OUT/result.json.",
             add_train_flags, cmd_train)
    # Each module of memtrain/commands/ registers its own subcommand on import, so a new
    # command is a new file there and this module stays unchanged.

    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        importlib.import_module(f"memtrain.commands.{info.name}")


def build_parser() -> argparse.ArgumentParser:
    _load_commands()
    parser = _Parser(prog="memtrain", description="Train Transformer LMs under memory limits and measure what each technique buys.")

    parser.add_argument("--version", action="version", version=f"memtrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, (help_text, add_args, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_args(p)
        p.add_argument("--verbose", action="store_true", default=False,
                       help="Show third-party import warnings (torchao kernel loading, deprecations) too.")
        p.set_defaults(_run=run, _parser=p)
    return parser


def _printable_stdout() -> None:
    """Let stdout print any path: a file name that is not UTF-8 reaches Python as lone
    surrogates, which a UTF-8 locale's strict stdout refused, so a finished train or bench
    ended with exit 1 on its last line ("wrote OUT/result.json"). Written as escapes, as
    Python's own stderr writes them."""
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None and getattr(sys.stdout, "errors", None) == "strict":
        reconfigure(errors="backslashreplace")


def main(argv: Optional[Sequence[str]] = None) -> int:
    # First thing a torchrun rank runs of memtrain: a rank never outlives its launcher.
    try:
        bind_rank_to_launcher()
    except ConfigError as exc:
        # memtrain's launch variables set by mistake: said here, by rank 0, on its own stderr (the
        # launcher they name relays no line), before anything else runs.
        if env_rank() == 0:
            with contextlib.suppress(OSError):
                sys.stderr.write(f"error: {exc}\n")
                sys.stderr.flush()
        return 2
    begin_command()
    _printable_stdout()
    # SIGTERM (kill, a job scheduler) and SIGHUP (a terminal hung up) stop every verb like Ctrl-C, from its first line on:
    # finally blocks run (an export's scratch folder is removed), exit 130 with one line. It was
    # set only around training, so a SIGTERM while train read its config, or during an export,
    # ended the process at once (exit 143, no line, scratch left). Not under torchrun, whose
    # launcher owns its workers' signals.
    guard = sigterm_as_interrupt() if "WORLD_SIZE" not in os.environ else contextlib.nullcontext()
    # A hung-up terminal (EIO) or a closed pipe (EPIPE, `| head -1`) drops what is printed to it
    # instead of raising: a print must not stop a run before it writes its files.
    with tolerant_std_streams():
        try:
            with guard:
                return _main(argv)
        except KeyboardInterrupt:  # Ctrl-C while importing or parsing (a rank just started): no traceback
            _say("error: interrupted; results written so far are kept", 130)
            return 130


def _main(argv: Optional[Sequence[str]]) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args, extra = parser.parse_known_args(argv)
    if extra:
        args._parser.reject_unknown(extra)
    args._argv = argv  # memtrain.distributed.launch hands the same command line to every rank
    if getattr(args, "verbose", False):
        os.environ["MEMTRAIN_VERBOSE"] = "1"

    quiet_third_party()
    install_warning_format()
    try:
        check_forced_env()  # the probe survives a value it cannot read: say so before anything runs
        check_cache_env()  # every command's device cache (info's too) lies there
        return int(args._run(args) or 0)
    except ConfigError as exc:
        # Under torchrun every rank exits 2 (memtrain.distributed.rank_errors makes a rank-specific
        # refusal everyone's); only rank 0 says why, so the user reads the line once.
        _say(f"error: {exc}", 2, every_rank=False)  # = rank_errors.error_line(exc)
        return 2
    except KeyboardInterrupt:
        _say("error: interrupted; results written so far are kept", 130)
        return 130
    except OSError as exc:
        denied = denied_access(exc) or name_too_long(exc)
        if denied is not None and not os.environ.get("MEMTRAIN_DEBUG"):
            _say(f"error: {denied}", 2)  # the path is the user's to change: bad input
            return 2
        room = out_of_room(exc)
        if room is None or os.environ.get("MEMTRAIN_DEBUG"):
            return _failure(exc)
        _say(f"error: {room}", 1)  # not the input's fault: exit 1
        return 1
    except Exception as exc:  # noqa: BLE001 - the contract: exit 1 with the reason
        return _failure(exc)


def _say(line: str, code: int, every_rank: bool = True) -> None:
    say_error(line, code, every_rank)


def _failure(exc: BaseException) -> int:
    """Exit 1 with the reason on one line (the traceback with MEMTRAIN_DEBUG=1)."""
    if os.environ.get("MEMTRAIN_DEBUG"):
        raise exc

    _say(error_line(exc), 1)
    return 1


if __name__ == "__main__":
    sys.exit(main())
