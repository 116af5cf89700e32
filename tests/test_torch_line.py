"""The torch line: what answers by arithmetic imports no torch, and every caller that estimates a
step (`memtrain estimate`, a bench row) makes the same choice of method.

Torch-free: the config and its sections, what a --model names (memtrain.models.source, .spec), the
technique facts, the analytic estimator and its choice of method, plan's search, the rendering.
Torch side: building models, applying techniques, the step harness, train, trace, maxbatch,
profile. transformers imports torch whenever it is installed (its configuration module loads its
rope utilities, which import torch), so a transformers --model of a family the analytic estimator
models (a bundled config, a local config.json) is read as JSON with transformers' defaults
(memtrain.models.light_config.analytic_config); traced paths, Hub models and other families read it
through AutoConfig.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from memtrain.cli import main

HEAVY = ("torch", "transformers", "numpy")


def _loaded_after(code: str) -> dict[str, bool]:
    """Which heavy packages a fresh interpreter holds after running ``code`` (its last line of
    stdout is the answer; what ``code`` prints before it is kept in ``printed``)."""
    probe = textwrap.dedent(code) + "\nimport json, sys\nprint(json.dumps({m: m in sys.modules for m in %r}))\n" % (HEAVY,)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cli_loaded(*argvs: list[str]) -> dict[str, bool]:
    """Run ``memtrain.cli.main(argv)`` for each argv in one fresh interpreter (each must exit 0)."""
    calls = "\n".join(f"assert main({argv!r}) == 0, {argv!r}" for argv in argvs)
    return _loaded_after("import contextlib, io\nfrom memtrain.cli import main\n"
                         f"with contextlib.redirect_stdout(io.StringIO()):\n{textwrap.indent(calls, '    ')}")


def test_the_analytic_estimate_imports_no_torch():
    seen = _cli_loaded(["estimate", "--batch-size", "4"],
                       ["estimate", "--json", "--gpu", "h100", "--budget", "40GiB", "--world-size", "4", "--shard", "fsdp"],
                       ["estimate", "--params", "1B", "--mode", "inference"],
                       ["estimate", "--model", "llama-3-8b", "--mode", "inference", "--new-tokens", "512"],
                       ["estimate", "--model", "llama-7b", "--explain"])  # an analytic preset
    assert not any(seen.values()), seen


def test_plans_search_imports_no_torch():
    seen = _cli_loaded(["plan", "--budget", "8GiB"], ["plan", "--budget", "4GiB", "--max-batch", "64", "--json"],
                       ["plan", "--budget", "80GiB", "--device-type", "cuda", "--params", "1B"])
    assert not any(seen.values()), seen


def test_the_flop_report_of_our_gpt_imports_no_torch():
    """`memtrain flops` for memtrain's GPT answers from the analytic inventory (a named --gpu: the
    default looks for a visible CUDA GPU, which a CUDA build of torch answers)."""
    seen = _cli_loaded(["flops", "--gpu", "h100"],
                       ["flops", "--json", "--gpu", "a100", "--precision", "bf16", "--checkpointing", "full",
                        "--loss", "chunked", "--grad-accum", "2"],
                       ["flops", "--gpu", "l4", "--model", "gpt2", "--batch-size", "1", "--seq-len", "64"],
                       ["flops", "--gpu", "l4", "--attention", "sdpa", "--dropout", "0", "--precision", "bf16-pure"])
    assert not any(seen.values()), seen


def test_the_analytic_estimate_and_plan_of_a_bundled_transformers_config_import_no_torch():
    """Plan's search for a transformers model is analytic with CUDA kernel facts on a CPU-only
    torch (it traces otherwise)."""
    argvs = [["estimate", "--model", "llama-3-8b"], ["estimate", "--model", "qwen2.5-0.5b", "--json"],
             ["estimate", "--model", "mistral-7b", "--batch-size", "1", "--explain"],
             ["estimate", "--model", "tiny-gpt2", "--lora-rank", "4"]]
    from memtrain.runtime.extras import cpu_only_torch

    if cpu_only_torch():
        argvs.append(["plan", "--model", "llama-3-8b", "--device-type", "cuda", "--budget", "80GiB", "--max-batch", "8"])
    seen = _cli_loaded(*argvs)
    assert not any(seen.values()), seen


def test_the_flop_rule_and_the_model_names_import_no_torch():
    """`memtrain flops --count` counts a real step under FakeTensorMode (torch); its rule of thumb is
    arithmetic. Naming a bundled transformers config (what it resolves to, whether a run trains
    it) needs neither transformers nor torch; reading it does, even to check its model_type is one
    transformers ships (see the module docstring)."""
    seen = _loaded_after("""
        from memtrain.analysis.flops.rules import rule_flops_per_token
        from memtrain.config.run import ModelConfig
        assert rule_flops_per_token(ModelConfig(), 256, 124_000_000) > 6 * 124_000_000
        import memtrain.models, memtrain.techniques, memtrain.distributed.rank_errors
        from memtrain.models.spec import is_gpt_preset
        from memtrain.models.source import bundled_names, resolve
        src = resolve("llama-3-8b")
        assert "llama-3-8b" in bundled_names() and not is_gpt_preset("llama-3-8b")
        assert src.repo is None and src.config_path.name == "llama-3-8b.json"
    """)
    assert not any(seen.values()), seen


def _cli_json(capsys, argv: list[str]) -> dict:
    capsys.readouterr()
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


ROW = {"batch_size": 2, "seq_len": 32, "attention": "sdpa", "precision": "fp32", "device": "cpu"}


def _flags(settings: dict) -> list[str]:
    return [x for k, v in settings.items() for x in ("--" + k.replace("_", "-"), str(v))]


@pytest.mark.parametrize("model, method", [("tiny-llama", "analytic"), ("tiny-gpt2", "analytic"),
                                           ("relu-gpt2", "extrapolated")])
def test_a_bench_rows_estimate_is_the_models_own(capsys, tmp_path, model, method):
    """A bench row of a transformers model shows the estimate `memtrain estimate --model` gives
    for the same settings (the analytic model of its layers, or its trace), not a GPT's."""
    from memtrain.bench.worker import row_estimate
    from memtrain.config.run import build_config
    from memtrain.models.source import CONFIG_DIR

    if model == "relu-gpt2":  # an activation the analytic model does not cover: traced
        config = json.loads((CONFIG_DIR / "tiny-gpt2.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**config, "activation_function": "relu"}))
        model = str(tmp_path)

    row = row_estimate(build_config({"model": model, **ROW}))
    cli = _cli_json(capsys, ["estimate", "--model", model, "--json", *_flags(ROW)])
    assert row["method"] == cli["method"] == method
    for timing in ("trace_seconds",):  # how long the trace took: the one field that may differ
        row.pop(timing, None), cli.pop(timing, None)
    assert row == cli


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_bench_row_on_ranks_is_estimated_per_rank(capsys, monkeypatch, strategy):
    """`bench --nproc 2` measures one rank's peak: its estimate is `estimate --world-size 2`'s,
    not the unsharded step's (an fsdp + LoRA row read -6.7% against the tracked peak for an
    estimate that is within 0.1% per rank)."""
    from memtrain.bench.worker import row_estimate
    from memtrain.config.run import build_config

    settings = {"d_model": 64, "n_heads": 4, "n_layers": 2, "d_ff": 128, "max_seq_len": 64, **ROW,
                "attention": "math", "distributed": strategy}
    monkeypatch.setenv("WORLD_SIZE", "2")
    row = row_estimate(build_config(settings))
    cli = _cli_json(capsys, ["estimate", "--json", *_flags(settings), "--world-size", "2"])
    assert row["world_size"] == 2 and row == cli


def test_a_bench_rows_estimate_of_memtrains_gpt_is_the_commands(capsys):
    from memtrain.bench.worker import row_estimate
    from memtrain.config.run import build_config

    settings = {"d_model": 64, "n_heads": 4, "n_layers": 2, "d_ff": 128, "max_seq_len": 64, **ROW,
                "attention": "math"}
    row = row_estimate(build_config(settings))
    assert row == _cli_json(capsys, ["estimate", "--json", *_flags(settings)])


def test_a_cuda_trace_on_a_cpu_only_torch_is_refused_before_anything_loads():
    """--trace (or --memory-by-module) with CUDA kernels on a CPU-only build is the trace's own
    one-line refusal, said before transformers loads and the config is read (it came after both:
    seconds of imports for one line)."""
    from memtrain.runtime.extras import cpu_only_torch

    if not cpu_only_torch():
        pytest.skip("a CUDA build of torch traces with CUDA kernels")
    code = """
        import contextlib, io
        from memtrain.cli import main
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rcs = [main(["estimate", "--model", "llama-3-8b", "--device-type", "cuda", "--trace"]),
                   main(["estimate", "--model", "tiny-gpt2", "--trace-device", "cuda", "--memory-by-module"]),
                   main(["estimate", "--trace", "--device-type", "cuda"])]
        lines = err.getvalue().strip().splitlines()
        assert rcs == [2, 2, 2], rcs
        assert len(lines) == 3 and all("needs a CUDA build of torch" in line for line in lines), lines
    """
    seen = _loaded_after(code)
    assert not any(seen.values()), seen
