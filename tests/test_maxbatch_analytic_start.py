"""The max-batch search starts from the analytic estimate and confirms it with traced probes:
the same answer as the full traced search, in fewer probes."""

from __future__ import annotations

import pytest

from conftest import TINY_MODEL
from memtrain.analysis.maxbatch import find_max_batch, resolve_method, traced_step_peak
from memtrain.cli import main
from memtrain.config.run import build_config


# The shortcut is taken where the estimate is byte-exact (the plain step, the chunked loss at 64
# tokens a chunk); where it is not (checkpointing's peaks differ by less than the estimate's error
# on this tiny model) the full search answers: the same answer either way.
@pytest.mark.parametrize("tech,shortcut", [({}, True), ({"checkpointing": "full"}, False),
                                           ({"loss": "chunked", "loss_chunk": 64}, True)])
def test_analytic_start_gives_the_traced_answer_in_fewer_probes(tech, shortcut):
    cfg = build_config({**TINY_MODEL, "vocab_size": 50257, "seq_len": 32, "device": "cpu", **tech})
    budget = traced_step_peak(cfg, 6)  # the answer is 6 (peaks grow with the batch)
    fast = find_max_batch(cfg, budget_bytes=budget, max_batch=64, progress=False)
    # A probe that is not traced_step_peak itself takes the full grow-then-bisect search.
    full = find_max_batch(cfg, budget_bytes=budget, max_batch=64, progress=False,
                          probe=lambda c, b: traced_step_peak(c, b))
    assert (fast.batch_size, fast.peak_bytes) == (full.batch_size, full.peak_bytes) == (6, budget)
    if shortcut:
        assert len(fast.probes) <= 2 < len(full.probes)  # the guess and the next batch only


@pytest.fixture(scope="module")
def plain_search():
    """The plain tiny step, a budget whose answer is batch 6, and the full traced search from
    batch 1 (computed once: every guess below is compared with it)."""
    cfg = build_config({**TINY_MODEL, "vocab_size": 50257, "seq_len": 32, "device": "cpu"})
    budget = traced_step_peak(cfg, 6)
    full = find_max_batch(cfg, budget_bytes=budget, max_batch=64, progress=False,
                          probe=lambda c, b: traced_step_peak(c, b))
    return cfg, budget, full


def test_a_wrong_guess_falls_back_to_the_full_search(monkeypatch, plain_search):
    import memtrain.analysis.maxbatch as mb

    cfg, budget, _ = plain_search
    monkeypatch.setattr(mb, "_analytic_guess", lambda *a, **k: 9)  # too large: batch 9 does not fit
    fast = find_max_batch(cfg, budget_bytes=budget, max_batch=64, progress=False)
    assert fast.batch_size == 6 and len(fast.probes) > 3


@pytest.mark.parametrize("guess", [4, 5, 7, 8, 20])
def test_a_guess_a_few_batches_off_is_corrected_from_where_it_stands(monkeypatch, plain_search, guess):
    """The search steps outward from a wrong guess (up when it fits, down when it does not) and
    bisects: the traced answer, in fewer probes than the search from batch 1 takes."""
    import memtrain.analysis.maxbatch as mb

    cfg, budget, full = plain_search
    monkeypatch.setattr(mb, "_analytic_guess", lambda *a, **k: guess)
    near = find_max_batch(cfg, budget_bytes=budget, max_batch=64, progress=False)
    assert (near.batch_size, near.peak_bytes) == (full.batch_size, full.peak_bytes) == (6, budget)
    if abs(guess - 6) <= 2:
        assert len(near.probes) < len(full.probes), (near.probes, full.probes)


def test_outward_search_is_exact_for_every_guess():
    from memtrain.analysis.fit import largest_fitting, largest_fitting_from

    for answer in (0, 1, 2, 7, 64, 100):
        for guess in (1, 2, 5, 7, 8, 63, 99, 100):
            asked: list[int] = []

            def fits(k: int, answer: int = answer, asked: list[int] = asked) -> bool:
                asked.append(k)
                return k <= answer

            got = largest_fitting_from(fits, 100, guess, fits(guess))
            assert got == (answer or None), (answer, guess, got)
            assert all(1 <= k <= 100 for k in asked)
    assert largest_fitting(lambda k: k <= 37, 100) == 37
    # The cap (--max-batch) bounds the growth too: never a probe, nor an answer, above it.
    for answer in (1, 37, 100, 1000):
        asked: list[int] = []
        got = largest_fitting(lambda k, answer=answer, asked=asked: asked.append(k) or k <= answer, 100)
        assert got == min(answer, 100) and max(asked, default=1) <= 100, (answer, got, asked)


def test_a_transformers_model_the_analytic_model_claims_starts_from_its_estimate_too(tmp_path):
    """Llama (and the other modelled families) get the analytic start as memtrain's GPT does:
    a full-size model's search took eight traced probes of seconds each from batch 1."""
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=64).save_pretrained(tmp_path)
    cfg = build_config({"model": str(tmp_path), "seq_len": 32, "device": "cpu", "attention": "sdpa"})
    budget = traced_step_peak(cfg, 6)
    fast = find_max_batch(cfg, budget_bytes=budget, max_batch=64, progress=False)
    full = find_max_batch(cfg, budget_bytes=budget, max_batch=64, progress=False,
                          probe=lambda c, b: traced_step_peak(c, b))
    assert (fast.batch_size, fast.peak_bytes) == (full.batch_size, full.peak_bytes) == (6, budget)
    assert len(fast.probes) <= 2 < len(full.probes)  # the guess and the next batch only


def test_maxbatch_help_names_what_the_default_method_does(capsys):
    """--method's default is auto, which measures on CUDA and traces elsewhere (resolve_method, as the
    README says); the help named only "default on CPU" beside trace, and auto not at all."""
    with pytest.raises(SystemExit):
        main(["maxbatch", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "auto (the default): measure on CUDA, trace elsewhere" in help_text
    assert (resolve_method("auto", "cuda"), resolve_method("auto", "cpu")) == ("measure", "trace")
