"""The environment variables that force the device probe's answers (native BF16, native FP16),
read without torch so that the CLI checks them before any command runs.

The probe (:mod:`memtrain.devices.probe`) reads them on every run, and a run survives a probe
that fails (it records the error and goes on): a value the probe could not read was therefore
silently its own answer, and a run meant to be forced ran, and was timed, as measured.
"""

from __future__ import annotations

import os
from typing import Optional

from memtrain.errors import ConfigError

__all__ = ["FORCE_BF16_ENV", "FORCE_FP16_ENV", "check_forced_env", "forced"]

FORCE_BF16_ENV = "MEMTRAIN_FORCE_NATIVE_BF16"
FORCE_FP16_ENV = "MEMTRAIN_FORCE_NATIVE_FP16"


def forced(env: str) -> Optional[bool]:
    """The answer forced by environment variable ``env`` (1/0, true/false, yes/no), None where it
    is unset or empty; ConfigError for any other value."""
    raw = os.environ.get(env, "")
    value = raw.strip().lower()
    if value in ("1", "true", "yes"):
        return True
    if value in ("0", "false", "no"):
        return False
    if value:
        raise ConfigError(f"environment variable {env}={raw[:40]!r} is not 1/0, true/false or yes/no; set one of "
                          f"them, or unset {env} for the probe's own answer")
    return None


def check_forced_env() -> None:
    """Refuse a forcing variable set to a value :func:`forced` cannot read (before a command runs)."""
    for env in (FORCE_BF16_ENV, FORCE_FP16_ENV):
        forced(env)
