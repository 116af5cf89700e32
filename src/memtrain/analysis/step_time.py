"""The step-time model ``memtrain plan`` ranks technique sets by: modelled seconds of one
optimizer step (:func:`step_cost`) and what ``--offload-activations``' copies add to it
(:func:`offload_exposed_s`).

A model, not a measurement (docs/estimation.md gives its table): FLOPs of the step (6 x
parameters x tokens + attention, plus what checkpointing recomputes), divided by a device
throughput that depends on precision and on how full a micro-batch keeps the device, plus the
optimizer step as memory traffic. Its job is to order candidates sensibly; use ``memtrain
bench`` to time the ones that matter. Arithmetic only: no torch import.
"""

from __future__ import annotations

from typing import Any

from memtrain.analysis.estimate import GPT2_ARCH, Arch, param_count
from memtrain.analysis.estimate.compile_budget import recompute_share
from memtrain.analysis.estimate.params import head_widths
from memtrain.config.run import RunConfig
from memtrain.devices.gpu_kinds import GPU_KINDS, PCIE4_X16_PINNED_COPY
from memtrain.techniques.facts import checkpoint_policy, optimizer_kernel, precision_facts

__all__ = ["DEVICE_PROFILES", "FP8_PEAK_RATIO", "HOST_BANDWIDTH", "MATH_ATTENTION_PENALTY", "OPTIMIZER_TRAFFIC",
           "SELECTIVE_RECOMPUTE_SHARE", "offload_exposed_s", "step_cost"]


# Per device type: matmul throughput by precision (FLOP/s, the order of magnitude of what eager
# PyTorch reaches, not the datasheet), memory bandwidth for the optimizer step, and the
# micro-batch size (tokens) at which the device runs at half its throughput.
DEVICE_PROFILES: dict[str, dict[str, Any]] = {
    "cuda": {"flops": {"fp32": 40e12, "tf32": 120e12, "bf16": 250e12, "fp16": 250e12, "bf16-pure": 280e12},
             "bandwidth": 2.0e12, "half_tokens": 2048},
    # CPUs without AMX/AVX512-BF16 emulate bf16 matmuls through fp32: not faster, usually slower.
    "cpu": {"flops": {"fp32": 1.0e11, "tf32": 1.0e11, "bf16": 0.8e11, "fp16": 0.5e11, "bf16-pure": 0.8e11},
            "bandwidth": 2.0e10, "half_tokens": 64},
}
# --precision fp8 runs the block Linears' matmuls on FP8 tensor cores and the rest (attention
# core, LM head) in BF16 (memtrain.techniques.fp8): its rate is the BF16 rate times the FP8/BF16
# ratio of the H100 SXM's datasheet peaks (memtrain.devices.gpu_kinds: 2.0; 2.0 to 2.02 on the
# other kinds with FP8), charged to the block matmuls only (step_cost). A CPU never runs it (the device check refuses
# it); its entry is the BF16 rate so the table has every precision.
_H100_PEAKS = GPU_KINDS["h100-sxm"].flops
FP8_PEAK_RATIO: float = _H100_PEAKS["fp8"] / _H100_PEAKS["bf16"]  # type: ignore[operator]  # both listed for H100
DEVICE_PROFILES["cuda"]["flops"]["fp8"] = DEVICE_PROFILES["cuda"]["flops"]["bf16"] * FP8_PEAK_RATIO
DEVICE_PROFILES["cpu"]["flops"]["fp8"] = DEVICE_PROFILES["cpu"]["flops"]["bf16"]
# Host link bandwidth (bytes/s, each way) that --offload-activations' copies run at, when plan is
# given no --host-bandwidth. CUDA: a PCIe 4.0 x16 link's pinned copies (its fact and source:
# memtrain.devices.gpu_kinds), an assumption, so a measured or stated figure is better. CPU: the
# copy stays in RAM, at the profile's bandwidth.
HOST_BANDWIDTH: dict[str, float] = {"cuda": PCIE4_X16_PINNED_COPY, "cpu": DEVICE_PROFILES["cpu"]["bandwidth"]}
# Bytes of memory traffic per trainable parameter in one optimizer step (read/write of
# weights, gradients and states; kernel-launch overhead folded in for the per-tensor loop).
OPTIMIZER_TRAFFIC = {"adamw": 40, "adamw-foreach": 28, "adamw-fused": 24, "sgd": 16, "adafactor": 24,
                     "adamw-8bit": 24, "adamw-4bit": 24, "adamw-bnb-8bit": 16}
# Extra time of the attention core (QK^T, softmax, AV) when the (s x s) scores are materialized,
# relative to a fused kernel: the softmax and masking passes are memory-bound.
MATH_ATTENTION_PENALTY = {"cuda": 2.0, "cpu": 1.0}
# Selective checkpointing recomputes only the cheap (elementwise) ops: charged as this share of
# a block's forward.
SELECTIVE_RECOMPUTE_SHARE = 0.05


def _flops_per_token(cfg: RunConfig, arch: Arch) -> dict[str, float]:
    """Forward FLOPs per token: block matmuls, attention core, LM head (2 per multiply-add).
    q and the attention's output are ``q`` wide and k and v ``kv`` (heads and key/value heads
    times the head width: ``Arch.head_dim`` where a transformers config sets one apart from
    d_model / n_heads)."""
    m, s = cfg.model, cfg.train.seq_len
    q, kv = head_widths(m, arch)
    mlp = (3 if arch.mlp == "swiglu" else 2) * m.d_model * m.d_ff
    block = 2 * (m.d_model * (q + 2 * kv) + q * m.d_model + mlp)
    window = cfg.technique.window
    keys = min(window, s) if window else s
    attn = 2 * 2 * keys * q  # QK^T and AV, every query head
    head = 2 * m.padded_vocab_size * m.d_model
    return {"blocks": block * m.n_layers, "attention": attn * m.n_layers, "head": head}


def step_cost(cfg: RunConfig, device_type: str, arch: Arch = GPT2_ARCH) -> tuple[float, dict[str, float]]:
    """Modelled seconds of one optimizer step (``batch_size x grad_accum`` sequences)."""
    prof = DEVICE_PROFILES[device_type]
    tech, t = cfg.technique, cfg.train
    f = _flops_per_token(cfg, arch)
    tokens = t.batch_size * t.grad_accum * t.seq_len
    attn = f["attention"] * (MATH_ATTENTION_PENALTY[device_type] if _materialized(cfg, device_type) else 1.0)
    fwd_blocks = f["blocks"] + attn
    train = 3 * (fwd_blocks + f["head"])
    policy = checkpoint_policy(tech.checkpointing)
    kind = policy.kind
    L = cfg.model.n_layers
    if kind == "full":
        recompute = fwd_blocks
    elif kind == "selective":
        # Megatron's selective: the attention core reruns up to what backward needs: q k^T
        # (half the attention matmul FLOPs); probs @ v does not rerun (checkpoint's early stop).
        recompute = 0.5 * attn
    elif kind == "selective-matmul":
        recompute = SELECTIVE_RECOMPUTE_SHARE * fwd_blocks
    elif policy.mixed:
        recompute = fwd_blocks * policy.n_checkpointed(L) / L
    elif tech.compile and tech.compile_memory_budget is not None:
        # Between none and full: a share of full checkpointing's recompute (compile_budget's model).
        recompute = fwd_blocks * recompute_share(tech.compile_memory_budget)
    else:
        recompute = 0.0
    if tech.loss == "chunked":
        train += 0.02 * 3 * f["head"]  # the per-chunk loop and its casts
    micro_tokens = t.batch_size * t.seq_len
    efficiency = micro_tokens / (micro_tokens + prof["half_tokens"])
    rate = prof["flops"][tech.precision] * efficiency
    compute = (train + recompute) * tokens / rate
    if precision_facts(tech.precision).fp8:
        # Only the block Linears (and their recompute) run in FP8; attention and head at BF16's rate.
        fp8_share = f["blocks"] / fwd_blocks
        fp8_flops = (3 * f["blocks"] + recompute * fp8_share) * tokens
        compute = fp8_flops / rate + ((train + recompute) * tokens - fp8_flops) / (prof["flops"]["bf16"] * efficiency)
    trainable = param_count(cfg.model, arch, tech)[1]
    kernel = optimizer_kernel(tech.optim, tech.precision, device_type)  # plain adamw is the fused kernel on CUDA
    optimizer = OPTIMIZER_TRAFFIC.get(kernel, 32) * trainable / prof["bandwidth"]
    return compute + optimizer, {"compute_s": compute, "recompute_flops_per_token": recompute,
                                 "optimizer_s": optimizer, "micro_batch_efficiency": efficiency}


def offload_exposed_s(d2h_bytes: float, h2d_bytes: float, compute_s: float, host_bandwidth: float) -> float:
    """Seconds of --offload-activations' copies that compute does not hide: the device-to-host
    copies overlap the forward (a third of the step's compute), the host-to-device ones the
    backward (the rest); what a copy takes beyond its phase's compute is added to the step."""
    forward = compute_s / 3
    return (max(0.0, d2h_bytes / host_bandwidth - forward)
            + max(0.0, h2d_bytes / host_bandwidth - (compute_s - forward)))


def _materialized(cfg: RunConfig, device_type: str) -> bool:
    tech = cfg.technique
    if tech.attention == "math":
        return True
    return tech.attention == "sdpa" and device_type == "cpu" and cfg.model.dropout > 0
