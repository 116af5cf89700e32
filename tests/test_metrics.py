"""Tests for memtrain.metrics: the tracked memory meter, the step timer and MFU.

The memory tests assert exact byte counts: the meter exists so CPU tests can prove what a
technique saves, which only works if its numbers are exact.
"""

from __future__ import annotations

import gc
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state
from torch.utils._python_dispatch import TorchDispatchMode

from memtrain.metrics import (
    CATEGORIES,
    PEAK_FLOPS,
    MemoryMeter,
    StepTimer,
    device_peak_memory,
    lookup_gpu,
    mfu,
    peak_flops,
    percentile,
    reset_device_peak,
)
from memtrain.metrics.timing import RunningMedian


def mlp(device: str | None = None) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 64)
    ).to(device or "cpu")


def param_bytes(model: nn.Module) -> int:
    return sum(p.untyped_storage().nbytes() for p in model.parameters())


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the distinct storages in optimizer.state, computed independently of the meter."""
    storages = {}
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                storages[id(v.untyped_storage())] = v.untyped_storage().nbytes()
    return sum(storages.values())


def train_step(
    meter: MemoryMeter, model: nn.Module, opt: torch.optim.Optimizer | None, x: torch.Tensor
) -> None:
    with meter.phase("forward"):
        loss = model(x).square().mean()
    with meter.phase("backward"):
        loss.backward()
    del loss
    if opt is not None:
        with meter.phase("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)


# --------------------------------------------------------------------------- MemoryMeter


def test_parameters_counted_exactly_from_the_start() -> None:
    model = mlp()
    meter = MemoryMeter(model)
    with meter:
        now = meter.current()
    assert now["parameters"] == param_bytes(model) == (64 * 256 + 256 + 256 * 256 + 256 + 256 * 64 + 64) * 4
    assert now["total"] == now["parameters"]
    assert all(now[c] == 0 for c in CATEGORIES if c != "parameters")


def test_buffers_count_as_parameters() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    buffers = sum(b.untyped_storage().nbytes() for b in model.buffers())
    with MemoryMeter(model) as meter:
        assert meter.current()["parameters"] == param_bytes(model) + buffers


def test_gradients_equal_parameter_bytes_after_backward() -> None:
    model = mlp()
    x = torch.randn(16, 64)
    meter = MemoryMeter(model)
    with meter:
        with meter.phase("forward"):
            loss = model(x).square().mean()
        with meter.phase("backward"):
            loss.backward()
        now = meter.current()
    assert now["gradients"] == param_bytes(model)
    # The graph is freed: only the loss scalar, still referenced here, remains from forward,
    # and every backward intermediate has been freed.
    assert now["activations"] == loss.untyped_storage().nbytes() == 4
    assert now["temporaries"] == 0


def test_optimizer_state_after_one_adamw_step() -> None:
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    meter = MemoryMeter(model, opt)
    with meter:
        train_step(meter, model, opt, torch.randn(16, 64))
        now = meter.current()
    n_params = len(list(model.parameters()))
    # AdamW keeps exp_avg and exp_avg_sq (each the size of the parameter) and a 0-dim fp32
    # `step` tensor per parameter.
    expected = 2 * param_bytes(model) + 4 * n_params
    assert state_bytes(opt) == expected
    assert now["optimizer"] == expected
    assert now["gradients"] == 0  # zero_grad(set_to_none=True) freed them
    assert now["parameters"] == param_bytes(model)
    assert now["temporaries"] == 0


def test_optimizer_attached_later_and_state_existing_before_entry() -> None:
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()  # state and grads exist before the meter starts
    meter = MemoryMeter(model)
    meter.attach_optimizer(opt)
    with meter:
        now = meter.current()
    assert now["parameters"] == param_bytes(model)
    assert now["gradients"] == param_bytes(model)
    assert now["optimizer"] == state_bytes(opt)


def test_device_filter_leaves_out_other_devices() -> None:
    # On a GPU, AdamW's `step` counters are CPU scalars; a device filter leaves them out.
    # Here the parameters live on 'meta' and the counters on 'cpu'.
    model = mlp("meta")
    opt = torch.optim.AdamW(model.parameters())
    meter = MemoryMeter(model, opt, device="meta")
    with meter:
        train_step(meter, model, opt, torch.empty(8, 64, device="meta"))
    assert meter.current()["optimizer"] == 2 * param_bytes(model)


def forward_activations(batch: int) -> tuple[int, int]:
    """(activation bytes the meter sees after forward, bytes autograd saved + the loss)."""
    model = mlp()
    x = torch.randn(batch, 64)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        saved[id(st)] = st.nbytes()
        return t

    meter = MemoryMeter(model)
    with meter, meter.phase("forward"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).square().mean()
    outside = {id(p.untyped_storage()) for p in model.parameters()} | {id(x.untyped_storage())}
    expected = sum(n for k, n in saved.items() if k not in outside) + loss.untyped_storage().nbytes()
    return meter.current()["activations"], expected


def test_activations_are_what_autograd_saved_and_scale_with_batch() -> None:
    acts16, expected16 = forward_activations(16)
    acts32, expected32 = forward_activations(32)
    assert acts16 == expected16
    assert acts32 == expected32
    # Everything but the 4-byte loss scalar is proportional to the batch.
    assert acts32 - 4 == 2 * (acts16 - 4)
    assert acts16 > 4


def test_forward_under_no_grad_holds_only_its_output() -> None:
    model = mlp()
    meter = MemoryMeter(model)
    with meter:
        with meter.phase("forward"), torch.no_grad():
            out = model(torch.randn(32, 64))
        assert meter.current()["activations"] == out.untyped_storage().nbytes()
        del out
        assert meter.current()["activations"] == 0
        assert meter.current()["total"] == param_bytes(model)


def test_views_are_not_double_counted_and_frees_leave_the_total() -> None:
    meter = MemoryMeter()
    with meter:
        a = torch.empty(1000)
        views = [a.view(10, 100), a[:500], a.reshape(100, 10).t(), a.detach(), a.as_strided((10,), (100,))]
        assert meter.current()["total"] == 4000
        b = a.clone()
        assert meter.current()["total"] == 8000
        del a
        gc.collect()
        assert meter.current()["total"] == 8000  # views keep the storage alive
        views.clear()
        assert meter.current()["total"] == 4000
        del b
        assert meter.current()["total"] == 0
    assert meter.stats().peak_bytes == 8000


def test_in_place_resize_is_followed() -> None:
    meter = MemoryMeter()
    with meter:
        a = torch.empty(10)
        a.resize_(100)
        assert meter.current()["total"] == 400


def test_peak_breakdown_sums_to_peak_and_peak_in_backward() -> None:
    model = mlp()
    meter = MemoryMeter(model)
    with meter:
        train_step(meter, model, None, torch.randn(4, 64))
    stats = meter.stats()
    assert set(stats.by_category) == set(CATEGORIES)
    assert sum(stats.by_category.values()) == stats.peak_bytes
    # A small batch: gradients (as large as the parameters) dwarf the activations.
    assert stats.peak_phase == "backward"
    assert stats.by_category["parameters"] == param_bytes(model)
    assert stats.phase_peaks["backward"] == stats.peak_bytes
    assert stats.phase_peaks["forward"] < stats.peak_bytes
    assert stats.category_peaks["gradients"] == param_bytes(model)
    for c in CATEGORIES:
        assert stats.category_peaks[c] >= stats.by_category[c]
    d = stats.to_dict()
    assert d["peak_bytes"] == stats.peak_bytes and d["by_category"] == stats.by_category


def test_gradient_at_the_peak_counts_as_gradient() -> None:
    # The weight gradient is made by a backward matmul and becomes .grad an instant later; the
    # peak is at that matmul. The breakdown must still call those bytes gradients.
    w = nn.Linear(512, 512, bias=False)
    meter = MemoryMeter(w)
    with meter:
        with meter.phase("forward"):
            loss = w(torch.randn(1, 512)).sum()
        with meter.phase("backward"):
            loss.backward()
    stats = meter.stats()
    assert stats.peak_phase == "backward"
    assert stats.by_category["gradients"] == w.weight.nbytes == 512 * 512 * 4
    assert stats.by_category["parameters"] == w.weight.nbytes
    assert sum(stats.by_category.values()) == stats.peak_bytes


def test_first_adamw_step_peaks_in_optimizer_with_state_in_its_role() -> None:
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    meter = MemoryMeter(model, opt)
    with meter:
        train_step(meter, model, opt, torch.randn(4, 64))
    stats = meter.stats()
    # The first step allocates the state while every gradient is still alive.
    assert stats.peak_phase == "optimizer"
    assert stats.by_category["parameters"] == param_bytes(model)
    assert stats.by_category["gradients"] == param_bytes(model)
    assert 0 < stats.by_category["optimizer"] <= state_bytes(opt)
    assert sum(stats.by_category.values()) == stats.peak_bytes


def test_reset_peak_over_several_iterations() -> None:
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    meter = MemoryMeter(model, opt)
    x = torch.randn(8, 64)
    windows = []
    for _ in range(3):
        with meter:  # re-entering is allowed; live accounting carries over
            train_step(meter, model, opt, x)
        windows.append(meter.stats())
        meter.reset_peak()
    first, second, third = windows
    assert first.by_category["optimizer"] <= state_bytes(opt)
    # From the second step on the state already exists: identical steady-state windows.
    assert second.peak_bytes == third.peak_bytes
    assert second.by_category == third.by_category
    assert second.peak_phase == third.peak_phase
    assert second.by_category["optimizer"] == state_bytes(opt)
    # After a reset, the window starts at what is live now.
    after = meter.stats()
    assert after.peak_bytes == after.current_bytes == param_bytes(model) + state_bytes(opt)
    # One `with` around several iterations works too.
    with meter:
        for _ in range(2):
            train_step(meter, model, opt, x)
    assert meter.stats().peak_bytes == second.peak_bytes


def test_track_counts_external_tensors() -> None:
    x = torch.randn(32, 64)
    meter = MemoryMeter()
    with meter:
        meter.track(x)
        assert meter.current()["activations"] == x.nbytes
        with pytest.raises(ValueError):
            meter.track(x, category="weights")


def test_meta_tensors_give_the_same_numbers_as_cpu() -> None:
    results = []
    for device in ("cpu", "meta"):
        model = mlp(device)
        meter = MemoryMeter(model)
        x = torch.ones(16, 64, device=device)
        with meter:
            train_step(meter, model, None, x)
        results.append(meter.stats())
    cpu, meta = results
    assert meta.peak_bytes == cpu.peak_bytes
    assert meta.by_category == cpu.by_category
    assert meta.category_peaks == cpu.category_peaks


def test_works_under_fake_tensor_mode() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    class FakeableMLP(nn.Module):
        # nn.Linear's random init and nn.Module.to() do not run on fake tensors; plain
        # empty parameters do.
        def __init__(self) -> None:
            super().__init__()
            dims = (64, 256, 256, 64)
            self.w = nn.ParameterList(nn.Parameter(torch.empty(o, i)) for i, o in zip(dims, dims[1:]))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for k, w in enumerate(self.w):
                x = F.linear(x, w)
                x = F.relu(x) if k < len(self.w) - 1 else x
            return x

    with FakeTensorMode():
        model = FakeableMLP()
        meter = MemoryMeter(model)
        with meter:
            train_step(meter, model, None, torch.empty(16, 64))
        stats = meter.stats()
    p = (64 * 256 + 256 * 256 + 256 * 64) * 4
    assert stats.by_category["parameters"] == p
    assert stats.current_by_category["gradients"] == p
    assert stats.peak_phase == "backward"


def test_tensor_subclass_optimizer_state_counts_inner_tensors() -> None:
    pytest.importorskip("torchao")
    from torchao.optim.subclass_8bit import OptimState8bit

    model = nn.Linear(256, 256, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = OptimState8bit.zeros((256, 256), signed=True, block_size=256, device="cpu")
    # Nested, as some optimizers keep it.
    opt.state[model.weight] = {"moments": [state], "step": torch.tensor(0.0)}
    meter = MemoryMeter(model, opt)
    with meter:
        now = meter.current()
    inner = state.codes.nbytes + state.scale.nbytes + state.qmap.nbytes
    assert now["optimizer"] == inner + 4
    assert inner < 256 * 256 * 4 / 3  # the 8-bit state really is smaller than FP32

    # The subclass's own ops run on its inner tensors; their scratch is seen.
    x = torch.randn(256, 256)
    with meter:
        meter.reset_peak()
        state.copy_(x)  # quantize in place
        stats = meter.stats()
    assert stats.current_by_category["optimizer"] == inner + 4
    assert stats.peak_bytes > stats.current_bytes


@pytest.mark.skipif(
    not hasattr(TorchDispatchMode, "ignore_compile_internals"),
    reason="this torch cannot compile under a dispatch mode",
)
def test_compiled_code_runs_and_is_counted_under_the_meter() -> None:
    # fullgraph=True fails if dynamo will not compile with the meter's mode on (torchao's
    # low-bit optimizers compile their step this way).
    f = torch.compile(lambda a: (a * 2).relu(), backend="aot_eager", fullgraph=True)
    a = torch.randn(100)
    meter = MemoryMeter()
    with meter:
        out = f(a)
        assert meter.current()["activations"] == out.nbytes


def test_the_rng_operators_of_compiled_checkpointed_code_run_and_are_counted() -> None:
    # Inductor wraps a random op in these higher-order operators when a checkpointed region is
    # compiled (SDPA's CPU flash kernel under `--compile --checkpointing full`); the meter must
    # run them as any op (it raised NotImplementedError) and count what they return.
    x = torch.randn(64, 64)
    meter = MemoryMeter()
    with meter:
        state, (y, mask) = run_and_save_rng_state(torch.ops.aten.native_dropout.default, x, 0.5, True)
        assert meter.current()["activations"] == state.nbytes + y.nbytes + mask.nbytes
        y2, _ = run_with_rng_state(state, torch.ops.aten.native_dropout.default, x, 0.5, True)
    assert torch.equal(y, y2)  # replayed with the saved state: the same mask


def test_meter_removes_its_hooks_on_exit() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    meter = MemoryMeter(model, opt)
    with meter:
        train_step(meter, model, opt, torch.randn(2, 64))
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    model.to(torch.float64)  # nothing pins the parameters


def test_device_peak_memory_is_none_off_cuda() -> None:
    reset_device_peak("cpu")
    assert device_peak_memory("cpu") == {"max_allocated_bytes": None, "max_reserved_bytes": None}


# --------------------------------------------------------------------------- StepTimer


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_step_timer_excludes_warmup_and_computes_percentiles() -> None:
    timer = StepTimer(warmup=2)
    times = [9.0, 7.0, 1.0, 4.0, 2.0, 3.0, 5.0]
    for t in times:
        timer.record(t)
    s = timer.summary()
    kept = times[2:]
    assert s.steps == 5 and s.warmup_steps == 2
    assert s.median == 3.0
    assert s.p10 == pytest.approx(np.percentile(kept, 10))
    assert s.p90 == pytest.approx(np.percentile(kept, 90))
    assert s.mean == pytest.approx(3.0)
    assert (s.min, s.max) == (1.0, 5.0)
    assert s.to_dict()["median"] == 3.0
    assert s.first_s == 9.0  # the first step's own time is kept though it is a warm-up step


def test_step_timer_context_managers_and_data_wait_share() -> None:
    clock = FakeClock()
    timer = StepTimer(device="cpu", warmup=1, clock=clock)
    for i in range(4):
        with timer.data_wait():
            clock.now += 10.0 if i == 0 else 1.0  # the warm-up's slow first batch is dropped too
        with timer.step():
            clock.now += 3.0
    s = timer.summary()
    assert s.steps == 3
    assert s.median == 3.0 and s.p10 == 3.0 and s.p90 == 3.0
    assert s.data_wait_s == 3.0
    assert s.data_wait_share == pytest.approx(0.25)


def test_step_timer_empty_summary() -> None:
    s = StepTimer(warmup=3).summary()
    assert s.steps == 0 and s.median is None and s.data_wait_share is None and s.first_s is None


def test_percentile_matches_numpy() -> None:
    rng = np.random.default_rng(0)
    for n in (1, 2, 5, 100):
        xs = rng.random(n).tolist()
        for q in (0, 10, 50, 90, 100):
            assert percentile(xs, q) == pytest.approx(np.percentile(xs, q))
    with pytest.raises(ValueError):
        percentile([], 50)


class _Compared(float):
    """A float that counts the comparisons made on it (how much work a median did)."""

    count = 0

    def __lt__(self, other: object) -> bool:
        _Compared.count += 1
        return float(self) < float(other)  # type: ignore[arg-type]

    def __gt__(self, other: object) -> bool:
        _Compared.count += 1
        return float(self) > float(other)  # type: ignore[arg-type]


def test_the_running_median_is_the_percentile_after_every_step_in_log_n_comparisons() -> None:
    """StepTimer.median_so_far (train's on_step median) after every step equals percentile(·, 50)
    of the steps so far, to the last bit, with ties and warm-up; and the whole run's medians cost
    O(n log n) comparisons, where sorting the list at every step cost O(n² log n)."""
    rng = np.random.default_rng(0)
    values = np.round(rng.random(2000), 2).tolist()  # rounded: many ties
    timer = StepTimer(warmup=3)
    for i, v in enumerate(values):
        timer.record(v)
        kept = values[3:i + 1]
        assert timer.median_so_far() == (percentile(kept, 50) if kept else None)
    assert timer.summary().median == timer.median_so_far()

    _Compared.count = 0
    median = RunningMedian()
    for v in values:
        median.add(_Compared(v))
        median.value()
    n = len(values)
    assert _Compared.count <= 3 * n * math.log2(n), _Compared.count  # about 2 heap walks an add
    _Compared.count = 0
    for k in range(1, 200):  # what a per-step sort costs over just the first 200 steps
        sorted(_Compared(v) for v in values[:k])
    assert _Compared.count > 3 * n * math.log2(n)


# --------------------------------------------------------------------------- MFU


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H100 NVL", "h100-nvl"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb-sxm"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb-sxm"),
        ("NVIDIA A100-PCIE-40GB", "a100-40gb-pcie"),
        ("NVIDIA A100 80GB PCIe", "a100-80gb-pcie"),
        ("NVIDIA L4", "l4"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA A10G", "a10g"),
        ("NVIDIA A10", "a10"),
        ("NVIDIA GeForce RTX 4090", "rtx-4090"),
        ("NVIDIA GeForce RTX 3090", "rtx-3090"),
        ("Tesla V100-SXM2-16GB", "v100-sxm2"),
        ("Tesla V100-PCIE-32GB", "v100-pcie"),
        ("Tesla T4", "t4"),
        ("h100", "h100-sxm"),
        ("4090", "rtx-4090"),
        ("a100-80gb-pcie", "a100-80gb-pcie"),
    ],
)
def test_lookup_gpu(name: str, key: str) -> None:
    assert lookup_gpu(name) is PEAK_FLOPS[key]


@pytest.mark.parametrize("name", ["cpu", "", None, "NVIDIA GeForce RTX 3090 Ti", "NVIDIA GH200 480GB", "mps"])
def test_lookup_gpu_unknown(name: str | None) -> None:
    assert lookup_gpu(name) is None


def test_peak_table_is_dense_and_sane() -> None:
    h100 = PEAK_FLOPS["h100-sxm"]
    assert h100.flops["bf16"] == pytest.approx(989.4e12)
    assert h100.mem_bandwidth == pytest.approx(3.35e12)
    for spec in PEAK_FLOPS.values():
        f = spec.flops
        assert f["fp32"] and spec.mem_bandwidth > 1e11
        assert f["fp16"] is not None and f["fp16"] >= f["fp32"]
        if f["bf16"] is not None:
            assert f["tf32"] is not None and f["bf16"] >= f["tf32"] >= f["fp32"] * 0.99


def test_mfu_arithmetic() -> None:
    h100 = lookup_gpu("NVIDIA H100 80GB HBM3")
    # 494.7 TFLOP in one second on a 989.4 TFLOP/s part: half the peak.
    assert mfu(494.7e12, 1.0, h100, "bf16") == pytest.approx(0.5)
    assert mfu(989.4e12, 4.0, h100, "bf16-pure") == pytest.approx(0.25)
    assert mfu(494.7e12, 1.0, h100, torch.bfloat16) == pytest.approx(0.5)
    assert mfu(66.9e12, 1.0, h100, "fp32") == pytest.approx(1.0)
    assert mfu(1e12, 1.0, None, "bf16") is None  # CPU: unknown peak
    t4 = lookup_gpu("Tesla T4")
    assert mfu(1e12, 1.0, t4, "bf16") is None  # no BF16 tensor cores
    assert peak_flops(t4, "tf32") == t4.flops["fp32"]  # TF32 requested, FP32 runs
    with pytest.raises(ValueError):
        mfu(1e12, 0.0, h100, "bf16")
    with pytest.raises(ValueError):
        peak_flops(h100, "int3")
    assert math.isclose(h100.peak("fp16"), 989.4e12)
