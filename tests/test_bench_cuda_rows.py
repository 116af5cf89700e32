"""The default bench list on a GPU: every row runs there (the windowed flash row takes a kernel
that accepts a window), and a compiled row is timed. Checked on CPU by the row adaptation the
runner applies, which needs no GPU to decide."""

from __future__ import annotations

import importlib.util

from memtrain.bench.device_rows import adapt_window_kernels, window_kernel
from memtrain.bench.runner import BenchOptions, resolve_rows
from memtrain.bench.technique_sets import DEFAULT_TECHNIQUES, NOISE_ROWS, default_techniques
from memtrain.report.tables import markdown_report


def _default_rows():
    return resolve_rows(BenchOptions(techniques=default_techniques("cuda") + NOISE_ROWS))


def test_the_cuda_default_list_times_a_compiled_row_and_the_cpu_list_does_not():
    assert "compile" in default_techniques("cuda")
    assert default_techniques("cpu") == DEFAULT_TECHNIQUES
    assert "compile" not in default_techniques("cpu")


def test_the_cuda_default_list_times_the_chunked_loss_compiled_under_cuda_graphs():
    """The row the H200 measured fastest and small (benchmarks/results/gpu-h200): compiled with the
    chunked loss in reduce-overhead mode, at the device's default chunk."""
    rows = dict(_default_rows())
    assert "compile-chunked" in rows and "compile-chunked" not in default_techniques("cpu")
    tech = rows["compile-chunked"].technique
    assert (tech.compile, tech.compile_mode, tech.loss, tech.loss_chunk) == (True, "reduce-overhead", "chunked", 0)
    assert (tech.precision, tech.attention) == ("bf16", "flash")


def test_windowed_flash_rows_take_a_kernel_that_accepts_a_window_on_cuda():
    rows = _default_rows()
    windowed = [n for n, c in rows if c.technique.window is not None]
    assert windowed, "the default list has a windowed row"
    out, subs, notes = adapt_window_kernels(rows, "cuda", substitute=True)
    expected = "flash-attn" if importlib.util.find_spec("flash_attn") else "mem-efficient"
    assert window_kernel() == expected
    for name, cfg in out:
        tech = cfg.technique
        # no row of the list left pairing SDPA's flash kernel (no mask on CUDA) with a window
        assert not (tech.attention == "flash" and tech.window is not None), name
        if name in windowed:
            assert tech.attention == expected and tech.window is not None and subs[name]["to"] == expected
    assert set(subs) == set(windowed)
    assert len(notes) == 1 and expected in notes[0]
    # everything else about the rows is unchanged
    before = dict(rows)
    for name, cfg in out:
        if name not in subs:
            assert cfg == before[name]


def test_rows_named_by_the_user_and_cpu_rows_run_as_asked():
    rows = _default_rows()
    for device_type, substitute in (("cuda", False), ("cpu", True)):
        out, subs, notes = adapt_window_kernels(rows, device_type, substitute=substitute)
        assert out == rows and subs == {} and notes == []


def test_the_report_names_the_kernel_a_row_ran(tmp_path):
    rows = _default_rows()
    _, subs, _ = adapt_window_kernels(rows, "cuda", substitute=True)
    name, cfg = next((n, c) for n, c in rows if n in subs)
    result = {"technique": name, "description": "Windowed Attn + FlashAttn", "status": "ok",
              "config": cfg.to_dict(), "substituted_attention": subs[name]}
    text = markdown_report([result], [])
    kernel = subs[name]["to"]
    assert f"[ran {kernel} attention\u2021]" in text
    assert "\u2021 On this GPU" in text and "takes no mask" in text
