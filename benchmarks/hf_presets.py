"""Moved to ``benchmarks/hf/mapping.py``; this name stays for scripts that import it."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf.mapping import *  # noqa: E402,F403
from hf.mapping import TRAINER_LOW_BIT_BLOCK, HFPlan, gpt2_config_kwargs, hf_plan, lora_targets, trainer_alignment  # noqa: E402,F401
