"""Former name of :mod:`memtrain.model_presets` (model presets), kept so existing imports work."""

from memtrain.model_presets import PRESETS, preset, preset_names

__all__ = ["PRESETS", "preset", "preset_names"]
