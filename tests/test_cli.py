"""The command line: exit codes, one-line errors, nothing half-written."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from conftest import SHARED_SAMPLE, TINY_MODEL
from memtrain.cli import build_parser, main


def _flags(d: dict) -> list[str]:
    out = []
    for k, v in d.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        elif v is False:
            out.append("--no-" + k.replace("_", "-"))
        else:
            out += [flag, str(v)]
    return out


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    code = main(args)
    cap = capsys.readouterr()
    return code, cap.out, cap.err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--bogus", "1"], "unrecognized arguments"),
        (["--seq-len", "1024"], "exceeds --max-seq-len"),
        (["--data", "/nonexistent/x.jsonl"], "x.jsonl"),
        (["--precision", "fp4"], "unknown --precision"),
        (["--n-heads", "5"], "must divide --d-model"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(extra, message, tmp_path, capsys):
    out = tmp_path / "out"
    try:
        code, _, err = run_cli(["train", "--out", str(out), "--no-progress", *extra], capsys)
    except SystemExit as exc:  # argparse errors
        code, err = exc.code, capsys.readouterr().err
    assert code == 2
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0]
    assert not out.exists()


def test_field_absent_and_empty_and_too_small_corpus(tmp_path, capsys):
    absent = tmp_path / "a.jsonl"
    absent.write_text(json.dumps({"title": "x"}) + "\n")
    empty = tmp_path / "e.txt"
    empty.write_text("")
    small = tmp_path / "s.txt"
    small.write_text("just a few words")
    bad_xml = tmp_path / "Posts.xml"
    bad_xml.write_text('<posts><row Body="x"></posts>')
    for path, message in ((absent, "text"), (empty, "no documents"), (small, "is one document"),
                          (bad_xml, "XML")):
        code, _, err = run_cli(["train", "--data", str(path), "--out", str(tmp_path / "o"), "--no-progress",
                                "--seq-len", "32",
                                *_flags(TINY_MODEL)], capsys)
        assert code == 2, err
        assert err.startswith("error:") and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_train_writes_result_json(small_corpus, tmp_path, capsys):
    out = tmp_path / "run"
    code, stdout, _ = run_cli(["train", "--data", str(small_corpus), "--out", str(out), "--steps", "3",
                               "--batch-size", "2", "--seq-len", "32", "--warmup-steps", "1", "--no-progress",
                               *_flags(TINY_MODEL)], capsys)
    assert code == 0
    result = json.loads((out / "result.json").read_text())
    assert result["steps"] == 3 and "val ppl" in stdout


def test_config_file_and_override(small_corpus, tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'data = "{small_corpus}"\nsteps = 2\n[model]\nd_model = 32\nn_heads = 4\nn_layers = 1\n'
                   f'd_ff = 64\nmax_seq_len = 64\n[train]\nbatch_size = 2\nseq_len = 16\nwarmup_steps = 1\n')
    code, _, err = run_cli(["train", "--config", str(cfg), "--steps", "3", "--out", str(tmp_path / "r"),
                            "--no-progress"], capsys)
    assert code == 0, err
    result = json.loads((tmp_path / "r" / "result.json").read_text())
    assert result["steps"] == 3 and result["config"]["model"]["n_layers"] == 1


@pytest.mark.skipif(not SHARED_SAMPLE.is_file(), reason="../shared/data is not beside this checkout")
def test_train_on_stackoverflow_posts_xml(tmp_path, capsys):
    code, _, err = run_cli(["train", "--data", str(SHARED_SAMPLE), "--strip-html", "--out", str(tmp_path / "so"),
                            "--steps", "4", "--batch-size", "2", "--seq-len", "32", "--warmup-steps", "1",
                            "--no-progress", *_flags(TINY_MODEL)], capsys)
    assert code == 0, err
    r = json.loads((tmp_path / "so" / "result.json").read_text())
    assert r["data"]["train_documents"] + r["data"]["val_documents"] == 1000


def test_python_dash_m_and_help():
    env = {**os.environ}
    proc = subprocess.run([sys.executable, "-m", "memtrain", "--help"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0
    for command in ("train", "bench", "maxbatch", "report"):
        assert command in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "memtrain", "train", "--seq-len", "9999"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and "Traceback" not in proc.stderr


# Prints the exit code, then which of the heavy modules the command imported.
_IMPORTS_AFTER = ("import json, sys\nfrom memtrain.cli import main\nrc = main(sys.argv[1:])\n"
                  "print(json.dumps([rc, [m for m in ('torch', 'transformers', 'sympy', 'memtrain.analysis.trace') "
                  "if m in sys.modules]]))")


@pytest.mark.parametrize("argv, says, not_imported", [
    (["maxbatch", "--device", "cpu"], "on CPU the max batch needs a budget",
     ["memtrain.analysis.trace", "sympy", "torch", "transformers"]),
    (["maxbatch", "--device", "cpu", "--search", "seq-len"], "on CPU the longest context needs a budget",
     ["memtrain.analysis.trace", "sympy", "torch", "transformers"]),
    (["maxbatch", "--budget", "1GiB", "--multiple-of", "8", "--max-batch", "4"], "--multiple-of 8 is larger than",
     ["memtrain.analysis.trace", "sympy", "torch", "transformers"]),
    # --device auto: whether CUDA is here is torch's to say, so torch loads, but nothing of the search.
    (["maxbatch"], "on CPU the max batch needs a budget", ["memtrain.analysis.trace", "sympy", "transformers"]),
    (["plan"], "plan needs a budget", ["memtrain.analysis.trace", "sympy", "torch", "transformers"]),
])
def test_argument_errors_come_before_the_heavy_imports(argv, says, not_imported):
    """maxbatch's refusals that need no model (no budget off CUDA, --multiple-of past --max-batch)
    came after the search's modules loaded (torch, the tracer, FSDP, sympy): ~12 s for a line.
    Each is now said with none of them imported (torch only where --device auto asks it for CUDA)."""
    if argv == ["maxbatch"]:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a CUDA device is here: maxbatch needs no budget")
    proc = subprocess.run([sys.executable, "-c", _IMPORTS_AFTER, *argv, "--model", "tiny-llama"], capture_output=True,
                          text=True, timeout=600)
    assert proc.stderr.count("\n") == 1 and says in proc.stderr, proc.stderr
    rc, imported = json.loads(proc.stdout)
    assert rc == 2 and not set(not_imported) & set(imported), proc.stdout


@pytest.mark.parametrize("argv", [
    ["maxbatch", "--budget", "1GiB"], ["maxbatch", "--search", "seq-len", "--budget", "1GiB"],
    ["train", "--out", "{tmp}/run"], ["bench", "--out", "{tmp}/bench", "--techniques", "baseline"],
    ["generate", "{tmp}/model", "--prompt", "hi"], ["estimate"], ["plan", "--budget", "1GiB"], ["flops"],
])
def test_a_device_memtrain_does_not_run_on_is_refused_from_the_argument(argv, tmp_path):
    """--device mps (or any name but auto, cpu, cuda[:N]) is one line, exit 2, before torch or any
    verb's machinery loads: maxbatch, train, bench and generate said it after seconds of imports,
    and estimate, plan and flops answered as if for a CPU. Nothing is written."""
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    proc = subprocess.run([sys.executable, "-c", _IMPORTS_AFTER, *argv, "--device", "mps"], capture_output=True,
                          text=True, timeout=600)
    assert proc.stderr == "error: --device 'mps' is not supported; use auto, cpu, cuda or cuda:N\n", proc.stderr
    rc, imported = json.loads(proc.stdout)
    assert rc == 2 and imported == [], proc.stdout
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv", [["maxbatch", "--budget", "1GiB"], ["train", "--out", "{tmp}/run"],
                                  ["generate", "{tmp}/model", "--prompt", "hi"]])
def test_a_cuda_device_that_is_not_here_is_refused_before_the_verbs_imports(argv, tmp_path):
    """--device cuda without a GPU loads torch alone to ask for it, never the search, the
    training loop or transformers."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    proc = subprocess.run([sys.executable, "-c", _IMPORTS_AFTER, *argv, "--device", "cuda"], capture_output=True,
                          text=True, timeout=600)
    assert proc.stderr.count("\n") == 1 and "no CUDA GPU is visible" in proc.stderr, proc.stderr
    rc, imported = json.loads(proc.stdout)
    assert rc == 2 and imported == ["torch"], proc.stdout
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("verb", ["estimate", "plan"])
def test_model_help_names_every_bundled_config_and_what_is_analytic(verb, capsys):
    """estimate's and plan's --model help left out tiny-llama and tiny-gpt2 and called every
    transformers model traced, while six families are answered analytically."""
    from memtrain.models.source import bundled_names

    with pytest.raises(SystemExit):
        main([verb, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(name in text for name in bundled_names())
    assert "hf:ORG/NAME (traced)" not in text and "layers answered analytically" in text


def test_every_option_help_states_its_default():
    """The README's promise: every command's --help gives each option's meaning and default. An
    option whose default is a value says it; so do those whose unset default is derived."""
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    derived = {("bench", "--max-batch"), ("bench", "--row-timeout"), ("estimate", "--trace-device")}
    missing = []
    for verb, parser in subparsers.choices.items():
        for action in parser._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction) or not action.help:
                continue
            has_value = action.default not in (None, False, argparse.SUPPRESS)
            if not has_value and (verb, action.option_strings[0]) not in derived:
                continue
            text = action.help.lower()
            if "default" not in text and "same as" not in text:
                missing.append((verb, action.option_strings[0]))
    assert not missing, missing
