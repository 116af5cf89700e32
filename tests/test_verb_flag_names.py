"""The same setting has the same flag name on every verb that takes it: a user who learnt a name on
one verb (``maxbatch --memory-budget``) can give it to the others."""

from __future__ import annotations

import argparse
import json

import pytest

from conftest import TINY_MODEL
from memtrain.cli import build_parser, main


def _verb_parser(verb: str) -> argparse.ArgumentParser:
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[verb]


@pytest.mark.parametrize("verb", ["estimate", "plan", "maxbatch", "bench"])
def test_the_budget_verbs_take_both_names_of_the_budget(verb):
    options = _verb_parser(verb)._option_string_actions
    assert "--memory-budget" in options and "--budget" in options, verb
    assert options["--memory-budget"] is options["--budget"], f"{verb}: the two names set one option"
    assert options["--budget"].metavar == "SIZE", f"{verb}: --help shows one placeholder for a size on every verb"


def test_estimate_memory_budget_gives_the_fit_verdict_of_budget(capsys):
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in TINY_MODEL.items()] + ["--seq-len", "32", "--batch-size", "2"]
    fits = []
    for name in ("--budget", "--memory-budget"):
        capsys.readouterr()
        assert main(["estimate", *flags, name, "256MiB", "--json"]) == 0, name
        fits.append(json.loads(capsys.readouterr().out)["fit"])
    assert fits[0]["budget_bytes"] == fits[1]["budget_bytes"] == 256 * 2**20
    assert fits[0]["largest_batch"] == fits[1]["largest_batch"] > 2
