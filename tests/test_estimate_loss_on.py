"""``--loss-on completion`` in the estimate: the answers-only loss (memtrain.models.gpt.answer_targets)
makes an int64 copy of the targets and a float32 weight per micro-batch, which the analytic model
counts op by op (memtrain.analysis.estimate.head_nodes.answer_nodes). Checked against the fake-tensor
trace of the same step, which runs the answers-only path (the model is built with ``answers_only``
set from the config): each phase's change from ``--loss-on all`` is the trace's to the byte, for
every loss kernel, our GPT and transformers models, gradient accumulation 1 and 3, LoRA or not."""

from __future__ import annotations

import json

import pytest

from memtrain.analysis.estimate.method import estimate_step, model_arch
from memtrain.analysis.trace import trace_step
from memtrain.cli import main
from memtrain.config.run import build_config

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPE = {"batch_size": 2, "seq_len": 32, "device": "cpu"}
N = 2 * 32  # targets per micro-batch
ANSWERS_BYTES = 8 * N + 4  # the int64 copy of the targets and the float32 weight
GPT = {"vocab_size": 384, "d_model": 64, "n_heads": 4, "n_layers": 2, "d_ff": 128, "max_seq_len": 64, "dropout": 0.0}
GPT_FLAGS = ["--vocab-size", "384", "--d-model", "64", "--n-heads", "4", "--n-layers", "2", "--d-ff", "128",
             "--max-seq-len", "64", "--dropout", "0", "--seq-len", "32", "--device", "cpu"]
# Our GPT with the chunked loss (one chunk), LoRA and three micro-batches: the forward is the peak phase.
FORWARD_PEAK = {"loss": "chunked", "loss_chunk": 64, "grad_accum": 3, "lora_rank": 4}
PHASES = ("forward", "backward", "optimizer")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, str]:
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("loss-on")
    configs = {
        "llama": transformers.LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
        "gpt2": transformers.GPT2Config(vocab_size=384, n_embd=64, n_layer=2, n_head=4, n_positions=64),
    }
    for name, c in configs.items():
        c.save_pretrained(root / name)
    return {name: str(root / name) for name in configs}


def _config(model: str, tech: dict, loss_on: str, hf_dirs: dict[str, str]):
    base = GPT if model == "gpt" else {"model": hf_dirs[model]}
    return build_config({**base, **SHAPE, **tech, "loss_on": loss_on})


def _phases(model: str, tech: dict, hf_dirs: dict[str, str]) -> dict[str, dict[str, tuple[int, int]]]:
    """Per --loss-on: each phase's (estimated, traced) peak."""
    out = {}
    for loss_on in ("all", "completion"):
        cfg = _config(model, tech, loss_on, hf_dirs)
        est = estimate_step(cfg, "cpu", model_arch(cfg))
        assert est.method == "analytic"
        traced = trace_step(cfg)
        out[loss_on] = {p: (int(est.json["phase_peaks"][p]), traced["phase_peaks"][p]) for p in PHASES}
    return out


@pytest.mark.parametrize("model,tech", [
    ("gpt", {}),
    ("gpt", {"grad_accum": 3, "lora_rank": 4}),
    ("gpt", {"loss": "chunked", "loss_chunk": 16, "grad_accum": 3}),
    ("gpt", FORWARD_PEAK),
    ("gpt", {"loss": "naive", "precision": "bf16"}),
    ("llama", {}),
    ("llama", {"loss": "chunked", "loss_chunk": 16, "grad_accum": 3}),
    ("llama", {"lora_rank": 4, "precision": "bf16", "grad_accum": 3}),
    ("gpt2", {"loss": "chunked", "lora_rank": 4}),
    # 8 x 64 targets: their copy (4 KiB), which nll_loss saves, is offloaded to the host.
    ("gpt", {"offload_activations": True, "grad_accum": 3, "batch_size": 8, "seq_len": 64}),
], ids=["gpt-standard", "gpt-standard-accum3-lora", "gpt-chunked-accum3", "gpt-chunked-accum3-lora",
        "gpt-naive-bf16", "llama-standard", "llama-chunked-accum3", "llama-lora-bf16-accum3", "gpt2-chunked-lora",
        "gpt-offload-accum3"])
def test_the_answers_only_loss_changes_each_phase_as_the_trace_does(model, tech, hf_dirs):
    got = _phases(model, tech, hf_dirs)
    for phase in PHASES:
        est_change = got["completion"][phase][0] - got["all"][phase][0]
        traced_change = got["completion"][phase][1] - got["all"][phase][1]
        assert est_change == traced_change, (phase, est_change, traced_change)
    if not tech.get("offload_activations"):
        # The copy and the weight live through the loss, where the forward peaks.
        assert got["completion"]["forward"][1] - got["all"]["forward"][1] == ANSWERS_BYTES


def test_where_the_forward_peaks_the_estimate_is_within_one_percent_of_the_trace(hf_dirs):
    cfg = _config("gpt", FORWARD_PEAK, "completion", hf_dirs)
    est = estimate_step(cfg, "cpu", model_arch(cfg)).json
    traced = trace_step(cfg)
    assert est["peak_phase"] == traced["peak_phase"] == "forward"
    assert abs(est["peak_bytes"] / traced["peak_bytes"] - 1) < 0.01
    plain = estimate_step(_config("gpt", FORWARD_PEAK, "all", hf_dirs), "cpu", model_arch(cfg)).json
    assert est["peak_bytes"] - plain["peak_bytes"] == ANSWERS_BYTES


@pytest.mark.usefixtures("cce_traceable")
def test_cut_cross_entropy_under_answers_only_changes_each_phase_as_the_trace_does(hf_dirs):
    got = _phases("gpt", {"loss": "chunked", "loss_kernel": "cce", "precision": "bf16", "grad_accum": 3}, hf_dirs)
    for phase in PHASES:
        assert got["completion"][phase][0] - got["all"][phase][0] == got["completion"][phase][1] - got["all"][phase][1]
    # With ignored targets the library keeps its int32 index of the valid ones (4 N) to backward, so
    # the forward peaks in the kernel (the index, the log-sum-exp and the target-logit dot, 4 N each,
    # its locks and its output, 4 bytes each: 12 N + 8) above the int64 nonzero() and its int32 copy
    # (12 N), where every target counts; counted as dropped, the peak stayed there (+ANSWERS_BYTES).
    assert got["completion"]["forward"][1] - got["all"]["forward"][1] == ANSWERS_BYTES + 8


def _json(capsys, argv: list[str]) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def _forward_peak_flags() -> list[str]:
    return GPT_FLAGS + ["--loss", "chunked", "--loss-chunk", "64", "--grad-accum", "3", "--lora-rank", "4"]


def test_estimate_takes_loss_on_without_data_and_traces_the_answers_only_step(capsys):
    argv = ["estimate", *_forward_peak_flags(), "--batch-size", "2", "--trace", "--json"]
    plain = _json(capsys, argv)
    answers = _json(capsys, argv + ["--loss-on", "completion"])
    assert answers["peak_bytes"] - plain["peak_bytes"] == ANSWERS_BYTES
    assert answers["shape"]["loss_on"] == "completion" and "loss_on" not in plain["shape"]
    assert answers["trace"]["peak_bytes"] - plain["trace"]["peak_bytes"] == ANSWERS_BYTES
    assert main(["estimate", *GPT_FLAGS, "--loss-on", "answers"]) == 2
    assert "unknown --loss-on 'answers'" in capsys.readouterr().err


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_estimate_names_its_packing_in_the_json_shape_and_the_header(model, capsys, hf_dirs):
    """``shape`` named ``loss_on`` but not ``packing``, though a pad step is sized apart from a
    concat one (its pads are ignored targets): both JSON shapes now name it, and a pad step's
    header line says so (a concat step's, the default, stays as it was)."""
    flags = GPT_FLAGS if model == "gpt" else ["--model", hf_dirs[model], "--seq-len", "32", "--device", "cpu"]
    concat = _json(capsys, ["estimate", *flags, "--json"])
    pad = _json(capsys, ["estimate", *flags, "--packing", "pad", "--json"])
    assert (concat["shape"]["packing"], pad["shape"]["packing"]) == ("concat", "pad")
    assert main(["estimate", *flags, "--packing", "pad", "--loss-on", "completion"]) == 0
    header = capsys.readouterr().out.splitlines()[:2]
    assert any("x accum 1, packing pad, loss on completion, " in line for line in header), header
    assert main(["estimate", *flags]) == 0
    assert "packing" not in capsys.readouterr().out


def test_maxbatch_probes_the_answers_only_step(capsys):
    # One loss chunk (256 tokens) for every probed batch: the forward stays the peak phase.
    flags = GPT_FLAGS + ["--loss", "chunked", "--loss-chunk", "256", "--grad-accum", "3", "--lora-rank", "4"]
    argv = ["maxbatch", *flags, "--memory-budget", "1.5MiB", "--method", "trace", "--json"]
    plain = {p["batch_size"]: p["peak_bytes"] for p in _json(capsys, argv)["probes"]}
    answers = {p["batch_size"]: p["peak_bytes"] for p in _json(capsys, argv + ["--loss-on", "completion"])["probes"]}
    both = sorted(set(plain) & set(answers))
    assert both
    for b in both:  # a micro-batch of b sequences: b x 32 targets
        assert answers[b] - plain[b] == 8 * b * 32 + 4


def test_plan_carries_loss_on_into_the_train_command_and_names_the_records_it_needs(capsys):
    argv = ["plan", *GPT_FLAGS, "--batch-size", "2", "--budget", "4MiB", "--loss-on", "completion"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("best: memtrain train "))
    assert "--loss-on completion" in lines[at]
    assert "--data-format chat, prompt-completion or auto" in lines[at + 1]
    plain = ["plan", *GPT_FLAGS, "--batch-size", "2", "--budget", "4MiB"]
    assert main(plain) == 0
    assert "--loss-on" not in capsys.readouterr().out
    # --verify would train on the embedded text, which has no answers: refused before any output.
    assert main(argv + ["--verify"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: --verify trains on the run's data")


def test_inference_mode_refuses_loss_on_completion(capsys):
    """generate computes no loss: --loss-on completion would be silently ignored there."""
    assert main(["estimate", *GPT_FLAGS, "--mode", "inference", "--loss-on", "completion"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--loss-on is a training setting" in err
    assert main(["estimate", *GPT_FLAGS, "--mode", "inference", "--new-tokens", "8", "--loss-on", "all", "--json"]) == 0


def _rank_scales_memory(rank: int, world: int, port: int, out) -> None:
    """What the memory meter counts of ``MicroBatches.loss_scales`` on one of ``world`` gloo ranks,
    for one and for three micro-batches: (peak, live after) bytes each."""
    import torch
    import torch.distributed as dist

    from memtrain.data.loader import MicroBatches
    from memtrain.metrics import MemoryMeter

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        got = []
        for counts in ([5], [3, 9, 0]):
            micro = MicroBatches([(torch.zeros(1), torch.zeros(1))] * len(counts))
            micro.target_counts = counts
            meter = MemoryMeter(None, None)
            with meter:
                scales = micro.loss_scales(torch.device("cpu"))
                stats = meter.stats()
            assert len(scales) == len(counts)
            got.append((stats.peak_bytes, stats.current_bytes))
        out.put((rank, got))
    finally:
        dist.destroy_process_group()


def test_data_parallel_loss_scales_are_counted_as_the_meter_sees_them():
    """Under data parallelism the step's loss scales are device tensors (the all-reduced answer
    count and a float32 scale per micro-batch): the estimate's sequence of them has the meter's
    peak and leaves what the meter counts after, and they add 4 bytes per micro-batch to a step."""
    import socket

    import torch.multiprocessing as mp

    from memtrain.analysis.estimate.simulator import Simulator
    from memtrain.analysis.estimate.training import _answer_loss_scales

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_scales_memory, args=(r, 2, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    measured = dict(out.get(timeout=180) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    modelled = []
    for k in (1, 3):
        sim = Simulator()
        _answer_loss_scales(sim, k)
        modelled.append((int(sim.peak), int(sim.total)))
    assert modelled == [(32, 4), (36, 12)]
    for rank in (0, 1):
        assert [peak for peak, _ in measured[rank]] == [32, 36]
        # The all-reduced float64 count goes as the method returns, or (some runs) a little later,
        # with gloo's record of the collective: 8 bytes more, then.
        assert all(left in (kept, kept + 8) for (_, left), (_, kept) in zip(measured[rank], modelled))
    for k in (1, 3):
        peaks = {lo: estimate_step(build_config({**GPT, **SHAPE, "grad_accum": k, "distributed": "ddp", "loss_on": lo}),
                                   "cpu", model_arch(build_config(GPT)), world_size=2).json["phase_peaks"]
                 for lo in ("all", "completion")}
        assert peaks["completion"]["forward"] - peaks["all"]["forward"] == ANSWERS_BYTES + 4 * k
        assert peaks["completion"]["optimizer"] - peaks["all"]["optimizer"] == 4 * k
