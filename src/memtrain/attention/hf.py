"""``--attention flash`` / ``mem-efficient`` on a transformers model: SDPA held to one kernel.

Registered with transformers' own extension point for attention functions
(``AttentionInterface`` / ``AttentionMaskInterface``, the masks are SDPA's), so the model calls
it from each attention layer exactly where it would call SDPA. Two things differ from
``attn_implementation="sdpa"`` under ``torch.nn.attention.sdpa_kernel`` around the whole model:

* the kernel restriction is entered inside every attention call, so the recomputation of a
  checkpointed layer (which runs in backward, outside any context around the forward) uses the
  same kernel; otherwise the recomputed tensors differ from the saved ones and
  ``torch.utils.checkpoint`` stops the step (flash with full checkpointing on CUDA does);
* on CUDA, grouped-query attention repeats the key/value heads first. transformers asks SDPA
  for ``enable_gqa`` when there is no mask, and CUDA's flash and memory-efficient kernels take
  only equal head counts (torch 2.11: "No available kernel" under the restriction). CPU's flash
  kernel takes grouped heads, so CPU steps are unchanged.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["RESTRICTED_SDPA", "restricted_sdpa_implementation"]

# memtrain's --attention -> (the name registered with transformers, SDPA's backend)
# (No "flash" in a name: transformers 5.17 takes any such name for a flash-attn hub kernel.)
RESTRICTED_SDPA = {"flash": ("memtrain_sdpa_fa_only", "FLASH_ATTENTION"),
                   "mem-efficient": ("memtrain_sdpa_mea_only", "EFFICIENT_ATTENTION")}


class _OneKVGroup:
    """The attention module as transformers' SDPA function sees it once the key/value heads are
    already repeated: ``num_key_value_groups`` 1, every other attribute the module's own."""

    def __init__(self, module: Any) -> None:
        self._module = module
        self.num_key_value_groups = 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _restricted(backend_name: str) -> Any:
    def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Optional[torch.Tensor], **kwargs: Any) -> Any:
        from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

        groups = getattr(module, "num_key_value_groups", 1)
        if groups > 1 and query.device.type == "cuda":
            key, value, module = repeat_kv(key, groups), repeat_kv(value, groups), _OneKVGroup(module)
        # Only this kernel: an input it cannot take fails instead of silently using another.
        with sdpa_kernel([getattr(SDPBackend, backend_name)]):
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    return attention


def restricted_sdpa_implementation(attention: str) -> Optional[str]:
    """The ``attn_implementation`` name for ``--attention`` flash / mem-efficient (registered with
    transformers on first use), None for the other choices."""
    if attention not in RESTRICTED_SDPA:
        return None
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    name, backend = RESTRICTED_SDPA[attention]
    AttentionInterface.register(name, _restricted(backend))
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
