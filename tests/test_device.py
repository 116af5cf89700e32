"""The device probe: capabilities, the per-machine cache, the slow-precision warning, CPU MFU."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

from conftest import fake_caps
from memtrain.cli import main
from memtrain.config.run import build_config
from memtrain.devices import probe as D
from memtrain.devices.advice import mfu_for_run, run_device_facts
from memtrain.report.tables import mfu_lines
from memtrain.runtime.notices import SlowPrecisionWarning, install_warning_format
from memtrain.training.train import train

pytestmark = pytest.mark.usefixtures("fresh_probe")


def test_probe_on_cpu_measures_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMTRAIN_CACHE", str(tmp_path))
    caps = D.probe("cpu")
    assert caps.device_type == "cpu" and caps.name == D.cpu_model() and caps.name
    assert caps.threads == torch.get_num_threads()
    # The answers agree with what torch itself reports for this CPU.
    onednn = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert caps.native_bf16 == (onednn or bool({"avx512_bf16", "amx_bf16"} & set(caps.isa_flags))
                                or ("bf16" in caps.isa_flags))
    assert isinstance(caps.fused_adamw, bool) and caps.foreach_adamw is True  # foreach runs on every device
    assert caps.sdpa_flash is True  # torch's CPU flash kernel (torch >= 2.2)
    assert caps.gemm_fp32_flops and caps.gemm_fp32_flops > 1e8  # > 0.1 GFLOP/s on any CPU of this decade
    assert caps.bf16_slowdown and caps.bf16_slowdown > 0 and caps.from_cache is False
    files = list((tmp_path / "device").glob("*.json"))
    assert len(files) == 1
    cached = json.loads(files[0].read_text())  # plain JSON, keyed by model + torch + threads
    assert caps.name in cached["key"] and torch.__version__ in cached["key"]
    assert cached["rates"]["gemm_fp32_flops"] == caps.gemm_fp32_flops

    D._PROBES.clear()
    again = D.probe("cpu", measure_fn=None)
    assert again.from_cache and again.gemm_fp32_flops == caps.gemm_fp32_flops

    # A damaged cache file is ignored and rewritten.
    files[0].write_text("{not json")
    D._PROBES.clear()
    calls = []
    fake = {"gemm_fp32_flops": 7e9, "bf16_slowdown": 2.0}
    rates = D.probe("cpu", measure_fn=lambda dev, low: calls.append(1) or fake)
    assert calls and rates.gemm_fp32_flops == 7e9
    D._PROBES.clear()
    fresh = D.probe("cpu")
    assert not fresh.from_cache and json.loads(files[0].read_text())["rates"]["gemm_fp32_flops"] > 1e8


@pytest.mark.parametrize("flags, onednn, bf16, fp16", [
    (["avx2", "fma", "f16c"], {}, False, False),  # AVX2-only: torch's reference BF16 kernel
    (["avx2", "avx512f", "avx512bw"], {"bf16": True}, True, False),  # AVX512-core: oneDNN converts BF16
    (["avx2", "avx512f", "avx512_bf16"], {}, True, False),  # AVX-512 with the BF16 instruction
    (["avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16"], {"bf16": True, "fp16": True},
     True, True),  # AMX with BF16 and FP16
], ids=["avx2", "avx512-core", "avx512-bf16", "amx"])
def test_each_cpu_kind_gets_its_own_answer(flags, onednn, bf16, fp16, monkeypatch):
    """The native answers from a CPU's flags and oneDNN's checks, whichever CPU runs the test."""
    monkeypatch.setattr(D.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(D, "_mkldnn_check", lambda name: onednn.get("bf16" if "bf16" in name else "fp16", False))
    native_bf16, bf16_reason, native_fp16, _ = D._cpu_native(flags)
    assert (native_bf16, native_fp16) == (bf16, fp16), bf16_reason
    assert ("oneDNN has a BF16 kernel" in bf16_reason) == (bf16 and "avx512_bf16" not in flags)


def test_force_env_sets_both_answers(monkeypatch):
    monkeypatch.setenv(D.FORCE_BF16_ENV, "0")
    off = D.probe("cpu", measure=False)
    assert off.native_bf16 is False and off.forced == "MEMTRAIN_FORCE_NATIVE_BF16=0"
    monkeypatch.setenv(D.FORCE_BF16_ENV, "1")
    on = D.probe("cpu", measure=False)
    assert on.native_bf16 is True and "forced by MEMTRAIN_FORCE_NATIVE_BF16=1" in on.bf16_reason
    assert "no native BF16" in off.label and "native BF16" in on.label


def test_force_fp16_env_sets_the_fp16_answer(monkeypatch):
    monkeypatch.setenv(D.FORCE_FP16_ENV, "1")
    on = D.probe("cpu", measure=False)
    assert on.native_fp16 is True and on.forced == "MEMTRAIN_FORCE_NATIVE_FP16=1"
    assert "forced by MEMTRAIN_FORCE_NATIVE_FP16=1" in on.fp16_reason
    assert D.precision_is_native("fp16", on) and D.slow_precision_message("fp16", on) is None
    monkeypatch.setenv(D.FORCE_FP16_ENV, "0")
    monkeypatch.setenv(D.FORCE_BF16_ENV, "1")
    off = D.probe("cpu", measure=False)  # a new answer, not the memoized one
    assert off.native_fp16 is False and off.native_bf16 is True
    assert off.forced == "MEMTRAIN_FORCE_NATIVE_BF16=1, MEMTRAIN_FORCE_NATIVE_FP16=0"
    assert D.slow_precision_message("fp16", off).startswith("--precision fp16:")


def test_warning_text_names_the_measured_slowdown():
    slow = fake_caps()
    msg = D.slow_precision_message("bf16", slow)
    assert msg.startswith("--precision bf16: bf16 matmul here is 5.3x slower than fp32; this CPU has no native BF16")
    assert "fp32" in msg.split(";")[-1]
    assert D.slow_precision_message("bf16-pure", slow).startswith("--precision bf16-pure: bf16 matmul here is 5.3x")
    assert D.slow_precision_message("fp16", slow).startswith("--precision fp16: fp16 matmul here is 4.0x slower")
    assert D.slow_precision_message("fp32", slow) is None and D.slow_precision_message("tf32", slow) is None
    assert D.slow_precision_message("bf16", fake_caps(native_bf16=True)) is None


class _Stop(Exception):
    pass


def _stop_at_data(*args, **kwargs):
    raise _Stop


def test_train_warns_up_front_before_any_step(tiny_run, monkeypatch):
    """The warning comes before tokenization and the first step (stopped there: a BF16 step on a
    CPU without native BF16 is the slow path this test must not take)."""
    import memtrain.training.train as T

    monkeypatch.setattr(T, "prepare_splits", _stop_at_data)
    monkeypatch.setenv(D.FORCE_BF16_ENV, "0")
    with pytest.warns(SlowPrecisionWarning, match=r"bf16 matmul here .*this CPU has no native BF16"), \
            pytest.raises(_Stop):
        train(build_config({**tiny_run, "precision": "bf16"}))
    monkeypatch.setenv(D.FORCE_BF16_ENV, "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowPrecisionWarning)
        with pytest.raises(_Stop):
            train(build_config({**tiny_run, "precision": "bf16"}))
    _, facts = run_device_facts("bf16", torch.device("cpu"))
    assert facts["precision_native"] is True and facts["precision_warning"] is None
    monkeypatch.setenv(D.FORCE_BF16_ENV, "0")
    _, facts = run_device_facts("bf16", torch.device("cpu"))
    assert facts["precision_native"] is False and "no native BF16" in facts["precision_warning"]


def test_warning_shown_as_one_error_style_line():
    from memtrain.runtime.notices import QLoRASkipWarning
    from memtrain.techniques.optim import LowBitSkipWarning

    install_warning_format()
    assert warnings.formatwarning("x is slow", SlowPrecisionWarning, "f.py", 1) == "warning: x is slow\n"
    # QLoRA's unquantized weights and a low-bit optimizer's FP32 tensors printed the file, the
    # class and the source line under it.
    for category in (QLoRASkipWarning, LowBitSkipWarning):
        assert warnings.formatwarning("kept", category, "hf_mapping.py", 118, "quantize()") == "warning: kept\n"
    assert "UserWarning" in warnings.formatwarning("other", UserWarning, "f.py", 1)


def test_the_qlora_warning_is_one_line_on_the_cli(tmp_path):
    """Through the CLI (a process of its own: pytest records warnings in-process)."""
    import subprocess
    import sys

    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torchao")
    transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                             num_hidden_layers=1, vocab_size=320, max_position_embeddings=64).save_pretrained(tmp_path / "m")
    proc = subprocess.run([sys.executable, "-m", "memtrain", "estimate", "--model", str(tmp_path / "m"), "--seq-len", "16",
                           "--lora-rank", "4", "--qlora", "--trace"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [x for x in proc.stderr.splitlines() if "--qlora" in x or "quantize_base_weights" in x]
    assert len(lines) == 1 and lines[0].startswith("warning: --qlora: 7 of 7 frozen Linear weights"), proc.stderr
    assert "UserWarning" not in proc.stderr


def test_cpu_mfu_against_measured_gemm(tiny_run):
    r = train(build_config({**tiny_run, "steps": 6}))
    assert r["device_caps"]["name"] == D.cpu_model() and r["device_caps"]["precision_native"] is True
    assert r["optimizer_kernel"] == "for-loop"  # --optim adamw on CPU
    assert r["mfu"] is not None and 0 < r["mfu"] <= 1
    ref = r["mfu_reference"]
    assert ref["kind"] == "measured_gemm" and "measured FP32 GEMM" in ref["name"]
    assert r["mfu"] == pytest.approx(r["flops_per_step"] / r["step_time_s"]["median"] / ref["flops_per_s"])


def test_cpu_mfu_reference_is_measured_right_after_the_steps(tiny_run, monkeypatch):
    """The reference GEMM rate is measured after the last training step (the same load as the
    steps), not taken from the probe's cache; the rate is forced here, so the MFU is exact."""
    import memtrain.devices.advice as A

    steps_done, measured_at = [], []
    monkeypatch.setattr(A, "measure_fp32_rate", lambda: measured_at.append(len(steps_done)) or 123e9)
    r = train(build_config({**tiny_run, "steps": 6}), on_step=lambda done, total, step_s: steps_done.append(done))
    assert measured_at == [6]
    ref = r["mfu_reference"]
    assert ref["flops_per_s"] == 123e9 and ref["measured"].startswith("measured right after the run's training steps")
    assert ref["name"].endswith("measured FP32 GEMM 1024x1024x1024")
    assert r["mfu"] == pytest.approx(r["flops_per_step"] / r["step_time_s"]["median"] / 123e9)
    md_line = "\n".join(mfu_lines([{**r, "status": "ok"}]))
    assert "123.0 GFLOP/s, measured right after the run's training steps" in md_line


def test_mfu_reference_by_precision():
    caps = fake_caps(native_bf16=True, bf16_slowdown=0.25)  # BF16 4x faster than FP32 here
    m32, ref32 = mfu_for_run(50e9, 1.0, torch.device("cpu"), "fp32", caps)
    m16, ref16 = mfu_for_run(50e9, 1.0, torch.device("cpu"), "bf16", caps)
    assert m32 == pytest.approx(1.0) and ref32["dtype"] == "fp32"
    assert m16 == pytest.approx(0.25) and ref16["dtype"] == "bf16"
    # Slow BF16: judged against the faster kernel (FP32), so its low MFU shows the slowness.
    assert mfu_for_run(50e9, 1.0, torch.device("cpu"), "bf16", fake_caps())[1]["dtype"] == "fp32"
    assert mfu_for_run(1e9, None, torch.device("cpu"), "fp32", caps) == (None, None)


def test_info_command(capsys, monkeypatch):
    monkeypatch.setenv(D.FORCE_BF16_ENV, "0")
    assert main(["info", "--device", "cpu", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["device_type"] == "cpu" and out["native_bf16"] is False and out["gemm_fp32_flops"] > 0
    assert {"tf32", "fused_adamw", "foreach_adamw", "sdpa_flash", "sdpa_mem_efficient", "bf16_slowdown"} <= out.keys()
    assert main(["info", "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert "native BF16:       no" in text and "GEMM FP32:" in text and "MEMTRAIN_FORCE_NATIVE_BF16=0" in text
    assert main(["info", "--device", "tpu"]) == 2


def test_info_says_whether_it_could_cache_the_rates(capsys, monkeypatch, tmp_path):
    """A cache folder that cannot be written (here: a file in a folder's place) costs only the
    next run another measurement, and info says so instead of "cached for next time"."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("MEMTRAIN_CACHE", str(blocker / "cache"))
    assert main(["info", "--device", "cpu"]) == 0
    assert "measured now (not cached: the cache folder cannot be written" in capsys.readouterr().out
    D._PROBES.clear()
    monkeypatch.setenv("MEMTRAIN_CACHE", str(tmp_path / "cache"))
    assert main(["info", "--device", "cpu"]) == 0
    assert "measured now (cached for next time)" in capsys.readouterr().out
    D._PROBES.clear()
    assert main(["info", "--device", "cpu", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["from_cache"] is True and out["cached_at"] is None


def test_adamw_default_kernel_per_device(monkeypatch):
    """--optim adamw: the fused kernel on CUDA (foreach where fused is missing), the per-tensor
    loop on CPU; adamw-fused / adamw-foreach pin a kernel everywhere."""
    from memtrain.techniques import optim as O

    assert O.default_adamw_kernel(torch.device("cpu")) == {"foreach": False}
    answers = {"fused": True, "foreach": True}
    monkeypatch.setattr(D, "probe", lambda device, measure=True, kernels=True: fake_caps(
        device_type="cuda", fused_adamw=answers["fused"], foreach_adamw=answers["foreach"]))
    assert O.default_adamw_kernel(torch.device("cuda")) == {"fused": True}
    answers["fused"] = False
    assert O.default_adamw_kernel(torch.device("cuda")) == {"foreach": True}
    answers["foreach"] = False
    assert O.default_adamw_kernel(torch.device("cuda")) == {"foreach": False}


def test_stale_low_rate_is_measured_again(tmp_path, monkeypatch):
    """A reference measured on busy cores (here: absurdly low) is measured again when a run beats
    it, and the better rate is kept, so CPU MFU stays a share of what the machine does."""
    monkeypatch.setenv("MEMTRAIN_CACHE", str(tmp_path))
    caps = fake_caps(name=D.cpu_model(), threads=torch.get_num_threads(), gemm_fp32_flops=1e6)
    m, ref = mfu_for_run(2e8, 1.0, torch.device("cpu"), "fp32", caps)
    assert ref["flops_per_s"] == caps.gemm_fp32_flops > 1e8  # measured again, kept
    assert 0 < m <= 1
    assert caps.gemm_bf16_flops == pytest.approx(caps.gemm_fp32_flops / caps.bf16_slowdown)


def test_probe_leaves_the_random_generator_alone(tmp_path, monkeypatch):
    """A run seeds, probes, then builds its weights: the probe (measuring or not) must not move
    the generator, or the weights would depend on whether the rates were cached."""
    monkeypatch.setenv("MEMTRAIN_CACHE", str(tmp_path))
    torch.manual_seed(0)
    expected = torch.rand(3)
    for _ in range(2):  # measured, then from the cache
        D._PROBES.clear()
        torch.manual_seed(0)
        D.probe("cpu")
        assert torch.equal(torch.rand(3), expected)


def _device_entries(folder) -> list:
    return sorted(folder.rglob("device/*.json"))


def test_probe_caches_its_rates_in_the_given_cache_dir_only(tmp_path, monkeypatch):
    """A probe told its run's cache folder reads and writes its rates there, not in the folder
    of $MEMTRAIN_CACHE nor the default one; forgetting and refreshing use the same file."""
    run_dir, env_dir, home = tmp_path / "run-cache", tmp_path / "env-cache", tmp_path / "home"
    monkeypatch.setenv("MEMTRAIN_CACHE", str(env_dir))
    monkeypatch.setenv("HOME", str(home))
    caps = D.probe("cpu", cache_dir=run_dir)
    assert not caps.from_cache
    assert len(_device_entries(run_dir)) == 1
    assert _device_entries(env_dir) == [] and not (home / ".cache" / "memtrain").exists()
    D._PROBES.clear()
    assert D.probe("cpu", cache_dir=run_dir).from_cache  # read back from the same folder
    entry = _device_entries(run_dir)[0]
    stored = json.loads(entry.read_text())
    stored["rates"]["gemm_fp32_flops"] = 1e6  # as if measured on busy cores
    entry.write_text(json.dumps(stored))
    low = fake_caps(name=caps.name, threads=caps.threads, gemm_fp32_flops=1e6)
    D.refresh_fp32_rate(low, cache_dir=run_dir)  # a run that beat the cached rate updates this entry
    assert json.loads(entry.read_text())["rates"]["refreshed_from"] == 1e6
    D.cache_clear("cpu", cache_dir=run_dir)
    assert _device_entries(run_dir) == [] and _device_entries(env_dir) == []


def test_train_caches_the_device_rates_in_its_cache_dir(tiny_run, tmp_path, monkeypatch):
    """``--cache-dir`` holds a run's device rates as it holds its tokens (no $MEMTRAIN_CACHE)."""
    monkeypatch.delenv("MEMTRAIN_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    run_dir = tmp_path / "run-cache"
    train(build_config({**tiny_run, "steps": 2, "cache_dir": str(run_dir)}))
    assert len(_device_entries(run_dir)) == 1
    assert not (tmp_path / "home" / ".cache" / "memtrain").exists()


@pytest.mark.parametrize("plant", ["fifo", "dev-zero", "huge"])
def test_a_device_cache_entry_that_is_no_small_regular_file_is_not_read(tmp_path, plant):
    """A FIFO in an entry's place (a shared MEMTRAIN_CACHE) blocked `info` and every train for ever
    in open(); a link to /dev/zero was read without end. Neither is opened: the rates are measured
    again."""
    import threading

    from memtrain.devices.probe import _read_cache

    entry = tmp_path / "device" / "k.json"
    entry.parent.mkdir()
    if plant == "fifo":
        os.mkfifo(entry)
    elif plant == "dev-zero":
        entry.symlink_to("/dev/zero")
    else:
        entry.write_text('{"pad": "' + "x" * 2**17 + '"}')
    got: list = []
    reader = threading.Thread(target=lambda: got.append(_read_cache(entry, "k")), daemon=True)
    reader.start()
    reader.join(timeout=30)
    if reader.is_alive() and plant == "fifo":
        with open(entry, "wb"):  # release the blocked open, so the test process can end
            pass
    assert got == [None]


@pytest.mark.parametrize("value", ["on", "2", "maybe"])
def test_a_force_variable_the_probe_cannot_read_is_one_line_before_anything_runs(monkeypatch, tmp_path, capsys, value):
    """MEMTRAIN_FORCE_NATIVE_BF16=on was read as unset: the probe's own answer stood and the run
    went on as measured, silently. It is one line (exit 2) before the command runs; an empty
    value is still unset."""
    from memtrain.cli import main

    out = tmp_path / "run"
    argv = ["train", "--steps", "1", "--batch-size", "1", "--seq-len", "16", "--d-model", "16", "--n-heads", "2",
            "--n-layers", "1", "--d-ff", "32", "--val-blocks", "1", "--warmup-steps", "0", "--no-progress",
            "--out", str(out), "--cache-dir", str(tmp_path / "cache")]
    for env in (D.FORCE_BF16_ENV, D.FORCE_FP16_ENV):
        monkeypatch.setenv(env, value)
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: environment variable {env}={value!r} is not 1/0") and err.count("\n") == 1
        assert not out.exists()
        monkeypatch.setenv(env, "")
    assert D.probe("cpu", measure=False).forced is None


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_cuda_mfu_is_against_the_datasheet_peak_of_the_runs_precision(monkeypatch, precision):
    """On CUDA the reference is the card's dense peak for the run's precision (an H100's BF16 peak
    is many times its FP32 one), and the MFU is the step's FLOP/s over that same figure."""
    import memtrain.devices.advice as A
    from memtrain.devices.gpus import lookup_gpu, peak_flops

    h100 = lookup_gpu("h100")
    assert h100 is not None
    monkeypatch.setattr(A, "device_gpu", lambda device: h100)
    value, ref = mfu_for_run(1e14, 0.5, torch.device("cuda"), precision, None)
    assert ref is not None and ref["kind"] == "datasheet_peak" and ref["dtype"] == precision
    assert ref["flops_per_s"] == peak_flops(h100, precision) and ref["flops_per_s"] > 0
    assert value == pytest.approx(1e14 / 0.5 / ref["flops_per_s"])
    assert peak_flops(h100, "bf16") > 2 * peak_flops(h100, "fp32")  # so a wrong dtype shows
