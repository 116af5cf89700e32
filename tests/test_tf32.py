"""TF32 switches: memtrain's probe and precision work whichever of torch's two APIs set them first.

transformers' ``TrainingArguments(tf32=...)`` sets ``torch.backends.fp32_precision`` (torch 2.9+);
after that, torch 2.13 raises on reading ``torch.backends.cuda.matmul.allow_tf32`` or
``torch.get_float32_matmul_precision()``. These tests set the new API first, as it does, then run
the code that used to read the legacy one."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch

from memtrain.devices import probe as probe_mod
from memtrain.devices.tf32 import fp32_matmul_state, fp32_only, restore_fp32_matmul, set_tf32
from memtrain.techniques.precision import make_precision

pytestmark = pytest.mark.skipif(not hasattr(torch.backends, "fp32_precision"),
                                reason="torch before 2.9 has only the legacy TF32 API")


def _fresh() -> None:
    """The switches as a new process has them: no new-API value set, TF32 off for matmuls."""
    torch.set_float32_matmul_precision("highest")  # the legacy default ("high" would hide a mix)
    torch.backends.cuda.matmul.fp32_precision = "none"
    torch.backends.mkldnn.matmul.fp32_precision = "none"
    torch.backends.fp32_precision = "none"


@pytest.fixture(autouse=True)
def fresh_tf32() -> Iterator[None]:
    """Each test starts from, and leaves, a new process's switches (they are process-wide)."""
    _fresh()
    yield
    _fresh()


def _legacy_reads() -> bool:
    try:
        torch.backends.cuda.matmul.allow_tf32  # noqa: B018 - the read is the test
        torch.get_float32_matmul_precision()
    except RuntimeError:
        return False
    return True


def test_probe_rates_read_the_state_after_the_new_api(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.backends.fp32_precision = "tf32"  # as TrainingArguments(tf32=True) does
    before = fp32_matmul_state()
    seen: list[tuple[str, str]] = []

    def fake_gemm(device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int], **kw: object) -> float:
        seen.append((torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision))
        return 1e9

    monkeypatch.setattr(probe_mod, "measure_gemm", fake_gemm)
    rates = probe_mod._rates(torch.device("cpu"), [torch.bfloat16])
    assert rates["gemm_fp32_flops"] == 1e9
    # Measured in plain FP32 on both backends, then the settings put back as they were.
    assert seen and all(s == ("ieee", "ieee") for s in seen)
    assert fp32_matmul_state() == before
    assert torch.backends.fp32_precision == "tf32"


def test_measure_fp32_rate_after_the_new_api(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    monkeypatch.setattr(probe_mod, "measure_gemm", lambda *a, **kw: 2e9)
    assert probe_mod.measure_fp32_rate(budget_s=0.01) == 2e9
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"


def test_fp32_only_restores_a_legacy_state_readable() -> None:
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.set_float32_matmul_precision("high")
    with fp32_only():
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
        assert torch.get_float32_matmul_precision() == "highest"
    assert _legacy_reads()
    assert torch.backends.cuda.matmul.allow_tf32 is True
    assert torch.get_float32_matmul_precision() == "high"


@pytest.mark.parametrize("first", ["new", "legacy"])
def test_make_precision_fp32_overrides_tf32_from_either_api(first: str) -> None:
    if first == "new":
        torch.backends.fp32_precision = "tf32"
    else:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.set_float32_matmul_precision("high")
    make_precision("fp32", torch.device("cpu"))
    # No TF32 left anywhere: the global new-API value another library set is overridden too, and
    # the legacy readers (inductor's get_float32_matmul_precision) work.
    assert torch.backends.fp32_precision == "ieee"
    assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    assert _legacy_reads() and torch.get_float32_matmul_precision() == "highest"
    assert torch.backends.cuda.matmul.allow_tf32 is False


def test_make_precision_tf32_then_state_round_trips() -> None:
    torch.backends.fp32_precision = "ieee"
    make_precision("tf32", torch.device("cpu"))
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    assert torch.get_float32_matmul_precision() == "high"
    state = fp32_matmul_state()
    set_tf32(False)
    restore_fp32_matmul(state)
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    assert torch.get_float32_matmul_precision() == "high"


def test_trainer_arguments_leave_inductors_legacy_reads_working(monkeypatch: pytest.MonkeyPatch) -> None:
    """TrainingArguments(bf16, torch_compile) on an Ampere GPU turns TF32 on through the new API
    only; inductor's max-autotune then keys its kernel cache on get_float32_matmul_precision()."""
    from transformers import training_args
    from transformers.utils import import_utils

    from memtrain.bench.hf.mapping import hf_plan
    from memtrain.bench.hf.trainer_side import training_arguments
    from memtrain.config.run import build_config

    # What TrainingArguments does on CUDA, here on the CPU: its TF32 check passes, and its
    # enable_tf32 (cached per value per process) runs afresh.
    monkeypatch.setattr(training_args, "is_torch_tf32_available", lambda: True)
    import_utils.enable_tf32.cache_clear()
    try:
        cfg = build_config({"vocab_size": 512, "d_model": 32, "n_heads": 2, "n_layers": 1, "d_ff": 64,
                            "max_seq_len": 32, "seq_len": 32, "precision": "bf16", "compile": True})
        args = training_arguments(cfg, hf_plan(cfg, "cpu"), "/tmp/unused", torch.device("cpu"))
    finally:
        import_utils.enable_tf32.cache_clear()
    assert args.torch_compile and args.bf16
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"  # the Trainer's choice stands
    assert _legacy_reads() and torch.get_float32_matmul_precision() == "high"
    from torch._inductor.select_algorithm import create_precompile_key  # the max-autotune read itself

    assert create_precompile_key("mm", "inputs", []).endswith(":high")


def test_max_autotune_compiles_after_the_trainer_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    """The read itself, on a CPU: a frozen Linear under max-autotune has two candidate GEMM
    kernels (ATen's and inductor's C++ template), so inductor keys its autotuning cache on
    get_float32_matmul_precision(); after TrainingArguments set TF32 through the new API only,
    that compile raised ("mix of the legacy and new APIs")."""
    import torch._inductor.config as inductor_config
    from transformers import training_args
    from transformers.utils import import_utils

    from memtrain.bench.hf.mapping import hf_plan
    from memtrain.bench.hf.trainer_side import training_arguments
    from memtrain.config.run import build_config

    monkeypatch.setattr(training_args, "is_torch_tf32_available", lambda: True)
    import_utils.enable_tf32.cache_clear()
    try:
        cfg = build_config({"vocab_size": 512, "d_model": 32, "n_heads": 2, "n_layers": 1, "d_ff": 64,
                            "max_seq_len": 32, "seq_len": 32, "precision": "bf16", "compile": True})
        training_arguments(cfg, hf_plan(cfg, "cpu"), "/tmp/unused", torch.device("cpu"))
    finally:
        import_utils.enable_tf32.cache_clear()
    torch._dynamo.reset()
    linear = torch.nn.Linear(64, 32).eval()
    x = torch.randn(16, 64)
    with inductor_config.patch(freezing=True), torch.no_grad():
        out = torch.compile(linear, mode="max-autotune-no-cudagraphs")(x)
    torch._dynamo.reset()
    torch.testing.assert_close(out, linear(x), rtol=1e-2, atol=1e-2)  # TF32 or not: the same product
