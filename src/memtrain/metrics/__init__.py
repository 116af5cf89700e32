"""Measurement: tracked memory by category, device peaks, step timing, MFU.

- ``MemoryMeter`` counts live tensor storage by category (parameters, gradients, optimizer,
  activations, temporaries) during a step, exactly and on any device, CPU and fake tensors
  included, so CPU tests can prove what a technique saves.
- ``device_peak_memory`` / ``reset_device_peak`` read the CUDA allocator's own peaks.
- ``optimizer_state_bytes`` / ``ShardedStateBytes`` measure the training state one rank holds.
- ``StepTimer`` synchronizes, drops warm-up steps and reports median and spread.
- ``PEAK_FLOPS`` / ``lookup_gpu`` / ``mfu`` turn a FLOP count and a step time into MFU.
- ``HostSyncCounter`` counts the calls in a step that would make the host wait for a GPU.
"""

from memtrain.devices.gpus import PEAK_FLOPS, GpuSpec, device_gpu, lookup_gpu, mfu, peak_flops
from memtrain.metrics.device_peak import device_peak_memory, reset_device_peak
from memtrain.metrics.host_syncs import HostSyncCounter
from memtrain.metrics.memory import CATEGORIES, MemoryMeter, MemoryStats
from memtrain.metrics.state import ShardedStateBytes, optimizer_state_bytes, state_bytes_per_param
from memtrain.metrics.storage import storage_bytes
from memtrain.metrics.timing import StepTimer, TimingStats, percentile, synchronize

__all__ = [
    "CATEGORIES",
    "GpuSpec",
    "HostSyncCounter",
    "MemoryMeter",
    "MemoryStats",
    "PEAK_FLOPS",
    "ShardedStateBytes",
    "StepTimer",
    "TimingStats",
    "device_gpu",
    "device_peak_memory",
    "storage_bytes",
    "lookup_gpu",
    "mfu",
    "optimizer_state_bytes",
    "peak_flops",
    "percentile",
    "reset_device_peak",
    "state_bytes_per_param",
    "synchronize",
]
