"""The core install carries no optional package: torchao is the `lowbit` extra, imported only
for low-bit training, with one error line naming the pip command when it is absent; the W&B
sink is tested against a stand-in `wandb` module (wandb is no test requirement); the test
extra holds what the tests use, and every extra the code names exists."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from conftest import TINY_MODEL
from memtrain.cli import main

ROOT = Path(__file__).resolve().parents[1]
FLAGS = [x for k, v in TINY_MODEL.items() for x in ("--" + k.replace("_", "-"), str(v))]
RUN = ["train", "--steps", "4", "--batch-size", "1", "--seq-len", "16", "--val-blocks", "1", "--no-progress",
       "--warmup-steps", "1", *FLAGS]


def _project() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _extra_closure(project: dict, extra: str) -> set[str]:
    """Distribution names an extra installs, memtrain's own extras expanded (lowercase names)."""
    from packaging.requirements import Requirement

    spec = importlib.util.spec_from_file_location("install_size", ROOT / "benchmarks" / "install_size.py")
    assert spec is not None and spec.loader is not None
    install_size = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(install_size)
    return {Requirement(text).name.lower() for text in install_size.extra_requirements(project, extra)}


# --------------------------------------------------------------------------- pyproject
def test_core_install_has_no_optional_packages_and_test_extra_no_wandb():
    from packaging.requirements import Requirement

    project = _project()
    core = {Requirement(t).name.lower() for t in project["dependencies"]}
    assert not core & {"torchao", "wandb", "peft", "datasets", "pyarrow", "pandas", "transformers"}, core
    assert {Requirement(t).name for t in project["optional-dependencies"]["lowbit"]} == {"torchao"}
    test = _extra_closure(project, "test")
    assert "wandb" not in test and "pandas" not in test  # pandas comes with datasets, not asked for
    # pytest-xdist: pyproject's addopts start workers with -n auto, which plain pytest refuses;
    # pytest-timeout: the ini's `timeout` (a hung test fails instead of holding CI) needs it
    assert {"torchao", "datasets", "pyarrow", "peft", "transformers", "tensorboard", "pytest", "pytest-xdist",
            "pytest-timeout"} <= test
    assert _extra_closure(project, "dev") >= test  # CI installs dev
    assert "wandb" in _extra_closure(project, "wandb")  # users keep their extra


def test_a_hung_test_fails_at_the_ini_timeout_instead_of_holding_the_run():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert 0 < int(ini["timeout"]) <= 1800, ini.get("timeout")


def test_every_extra_an_error_names_exists_and_installs_the_module():
    from memtrain.runtime.extras import EXTRAS

    project = _project()
    for module, (extra, _) in EXTRAS.items():
        assert module in _extra_closure(project, extra), (module, extra)


# --------------------------------------------------------------------------- torchao absent
def _without_torchao(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    """The CLI in a fresh interpreter where ``import torchao`` fails, as on a core install."""
    code = ("import sys\nsys.modules['torchao'] = None\nfrom memtrain.cli import main\n"
            "rc = main(sys.argv[1:])\nassert sys.modules['torchao'] is None\nsys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=cwd, timeout=600)


def test_low_bit_optimizer_without_torchao_is_one_error_line_before_anything_is_written(tmp_path):
    for optim, precision in (("adamw-4bit", "fp32"), ("adamw-8bit", "bf16"), ("adamw", "bf16-pure")):
        out = tmp_path / f"run-{optim}-{precision}"
        r = _without_torchao(*RUN, "--optim", optim, "--precision", precision, "--out", str(out), cwd=tmp_path)
        assert r.returncode == 2, r.stderr
        assert r.stderr.startswith("error:") and r.stderr.count("\n") == 1, r.stderr
        assert "torchao" in r.stderr and "pip install 'memtrain[lowbit]'" in r.stderr
        assert not out.exists()


def test_plain_train_and_estimate_work_without_torchao(tmp_path):
    out = tmp_path / "r"
    r = _without_torchao(*RUN, "--out", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "result.json").read_text())["steps"] == 4
    # The estimate of a low-bit optimizer is arithmetic: no torchao needed.
    r = _without_torchao("estimate", "--optim", "adamw-4bit", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["bytes"]["optimizer"] > 0


def test_qlora_on_cpu_without_torchao_is_one_error_line(tmp_path, llama_dir):
    """QLoRA's NF4 weights need torchao once a step runs (here: traced); its analytic estimate is
    arithmetic and answers without it."""
    pytest.importorskip("peft")
    flags = ("estimate", "--model", str(llama_dir), "--lora-rank", "4", "--qlora", "--seq-len", "16",
             "--device-type", "cpu")
    r = _without_torchao(*flags, "--trace", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error:") and r.stderr.count("\n") == 1, r.stderr
    assert "pip install 'memtrain[lowbit]'" in r.stderr
    r = _without_torchao(*flags, "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["method"] == "analytic"


def test_the_core_cli_does_not_import_torchao():
    code = ("import sys, contextlib, io\nfrom memtrain.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n    main(['estimate', '--optim', 'adamw-8bit'])\n"
            "print('torchao' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=600)
    assert out.stdout.strip().splitlines()[-1] == "False"


# --------------------------------------------------------------------------- the W&B sink
class _FakeRun:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def log(self, data: dict, step: int | None = None) -> None:
        self.calls.append(("log", dict(data), step))

    def finish(self) -> None:
        self.calls.append(("finish",))


@pytest.fixture
def fake_wandb(monkeypatch):
    """A stand-in ``wandb`` module recording what the sink asks of it (init, log, finish)."""
    calls: list = []
    module = types.ModuleType("wandb")

    def init(**kwargs):
        calls.append(("init", kwargs))
        return _FakeRun(calls)

    module.init = init  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", module)
    return calls


def test_wandb_sink_sends_the_run_config_every_step_and_finishes(tmp_path, fake_wandb, capsys):
    out = tmp_path / "r"
    assert main([*RUN, "--out", str(out), "--report-to", "wandb"]) == 0
    inits = [c for c in fake_wandb if c[0] == "init"]
    logs = [c for c in fake_wandb if c[0] == "log"]
    assert len(inits) == 1 and fake_wandb[-1] == ("finish",) and fake_wandb.count(("finish",)) == 1
    kw = inits[0][1]
    assert kw["project"] == "memtrain" and Path(kw["dir"]) == out
    result = json.loads((out / "result.json").read_text())
    assert kw["config"]["train"]["steps"] == 4 and kw["config"]["model"] == result["config"]["model"]
    # One log per step, under train/, at its step, with the loss metrics.jsonl holds.
    lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    losses = {ln["step"]: ln["loss"] for ln in lines if "loss" in ln}
    step_logs = [(step, data) for _, data, step in logs if "train/loss" in data]
    assert [s for s, _ in step_logs] == [1, 2, 3, 4]
    assert all(data["train/loss"] == pytest.approx(losses[s]) for s, data in step_logs)
    assert all(k.startswith("train/") and v is not None for _, data, _ in logs for k, v in data.items())


def test_report_to_wandb_without_wandb_names_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)
    assert main([*RUN, "--out", str(tmp_path / "r"), "--report-to", "wandb"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1 and "pip install 'memtrain[wandb]'" in err


def test_default_bench_runs_adafactor_for_low_bit_rows_without_torchao(monkeypatch):
    import importlib.util

    from memtrain.bench.device_rows import adapt_compiled_optims
    from memtrain.bench.runner import BenchOptions, resolve_rows
    from memtrain.bench.technique_sets import DEFAULT_TECHNIQUES
    from memtrain.report.tables import optim_substitution_lines

    rows = resolve_rows(BenchOptions(techniques=DEFAULT_TECHNIQUES))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    out, subs, notes = adapt_compiled_optims(rows, "cuda", substitute=True)
    assert set(subs) == {"lowest-memory"} and dict(out)["lowest-memory"].technique.optim == "adafactor"
    assert all(dict(out)[n] == c for n, c in rows if n != "lowest-memory")
    assert len(notes) == 1 and "pip install 'memtrain[lowbit]'" in notes[0]
    foot = optim_substitution_lines([{"substituted_optim": subs["lowest-memory"]}])[0]
    assert foot.startswith("\u2020 Without torchao") and "memtrain[lowbit]" in foot and "On this CPU" not in foot
    # Rows the user names run as asked (and fail with the error line naming the extra).
    assert adapt_compiled_optims(rows, "cuda", substitute=False) == (rows, {}, [])
