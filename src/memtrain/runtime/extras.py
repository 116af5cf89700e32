"""Optional dependencies: a clear error naming the extra to install, and quiet imports.

Only some users need LoRA (peft), structured or hub data (datasets, pyarrow), TensorBoard,
wandb, transformers or torchao (low-bit optimizers, NF4 on CPU); they are extras of the package
(pyproject.toml), imported when used.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import logging
import os
import re
import warnings
from pathlib import Path
from types import ModuleType

from memtrain.config.run import ConfigError

# module -> (extra, what needs it)
EXTRAS: dict[str, tuple[str, str]] = {
    "peft": ("lora", "LoRA (--lora-rank)"),
    "datasets": ("hub", "Hugging Face datasets and .jsonl/.json/.parquet/.csv files"),
    "pyarrow": ("hub", "Parquet and other structured files"),
    "transformers": ("hf", "transformers models, export and generate"),
    "torchao": ("lowbit", "low-bit training (--optim adamw-8bit/adamw-4bit, --precision bf16-pure with --optim "
                          "adamw, --qlora's NF4 weights on CPU)"),
}


def import_extra(module: str) -> ModuleType:
    """Import ``module`` or raise a ConfigError that names the extra providing it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        extra, what = EXTRAS[module]
        raise ConfigError(f"{what} needs the {module} package, an optional extra: "
                          f"pip install 'memtrain[{extra}]'") from None


# Loggers whose import-time chatter is known and harmless: torchao reports the optional CUDA
# kernels it cannot load on a CPU machine and the missing triton; torch's pytree warns about a
# deprecated registration that torchao makes.
NOISY_LOGGERS = ("torchao", "torch.utils._pytree")
NOISY_MODULES = r"(torchao|peft|transformers|datasets|accelerate|torch\.utils\._pytree)(\..*)?"
NOISY_PATHS = r".*[/\\](torchao|peft|transformers|datasets|accelerate)[/\\]"


def quiet_third_party() -> None:
    """Keep known third-party import warnings off the terminal (unless MEMTRAIN_VERBOSE=1).

    The environment variable carries the choice into bench's row processes.
    """
    if os.environ.get("MEMTRAIN_VERBOSE") == "1":
        return
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for category in (DeprecationWarning, FutureWarning, UserWarning):
        warnings.filterwarnings("ignore", category=category, module=NOISY_MODULES)
    # A SyntaxWarning is raised while a module's source is compiled (the first import after an
    # install, e.g. torchao's "invalid escape sequence"); its "module" is then the file's path.
    warnings.filterwarnings("ignore", category=SyntaxWarning, module=NOISY_PATHS)


def quiet_datasets() -> None:
    """datasets and huggingface_hub log what memtrain then says in its one ``error:`` line
    (a JSON parse error as ERROR, every Hub retry as WARNING); keep their logs to CRITICAL
    through their own verbosity switches (unless MEMTRAIN_VERBOSE=1). Call after importing
    datasets: it sets its loggers' level when first configured."""
    if os.environ.get("MEMTRAIN_VERBOSE") == "1":
        return
    import datasets

    datasets.utils.logging.set_verbosity(logging.CRITICAL)
    with contextlib.suppress(ImportError):
        import huggingface_hub

        huggingface_hub.utils.logging.set_verbosity(logging.CRITICAL)


def cpu_only_torch() -> bool:
    """True when the installed torch is a CPU-only build, read from its version.py as text:
    importing torch costs seconds and ~200 MB, more than a whole analytic estimate, so a
    question that torch would answer with "no CUDA" is answered without it."""
    try:
        spec = importlib.util.find_spec("torch")
        locations = list(spec.submodule_search_locations or []) if spec else []
        text = (Path(locations[0]) / "version.py").read_text(encoding="utf-8") if locations else ""
    except (OSError, ValueError, ImportError, UnicodeDecodeError):
        return False
    builds = re.findall(r"^(cuda|hip)\b[^=\n]*=\s*(.+)$", text, flags=re.M)
    return len(builds) == 2 and all(v.strip() == "None" for _, v in builds)


def cuda_trace_refusal() -> str:
    """The one line refusing a trace with CUDA kernels on a torch without CUDA (fake CUDA tensors
    cannot run autograd there): said by the trace itself and, before anything loads, by
    ``memtrain estimate``."""
    return ("--trace-device cuda needs a CUDA build of torch (fake CUDA tensors cannot run autograd "
            f"in this CPU-only build, torch {_installed_version('torch')}); use --trace-device cpu, or the "
            "analytic estimate (its cuda kernel facts: 1-byte dropout masks, fused SDPA with dropout)")


def _installed_version(package: str) -> str:
    """``package``'s installed version from its metadata (no import: torch's costs seconds)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
