"""Data-parallel training (--distributed) on CPU: 2 ranks on gloo. The DDP run is launched as users
launch it (``torchrun --standalone --nproc_per_node 2 -m memtrain train ...``, here through
``python -m torch.distributed.run``, the module behind the torchrun script); the other scenarios
go through the same launcher API from one driver process whose ranks are forked after the
imports (tests/dist_launch.py: a scenario then costs its training, not three interpreter starts).

One launch per scenario; each result is compared with a single process training on the
same global batch (2 ranks x batch 2 == 1 process x batch 4, dropout 0).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import TINY_MODEL, cli_flags
from memtrain.cli import main
from memtrain.config.run import ConfigError, build_config
from memtrain.distributed.deepspeed_engine import deepspeed_train_step
from memtrain.training.train import train

TIMEOUT_S = 240  # per torchrun call; far above its normal duration, so only a hang reaches it
# Loss of 2 ranks vs 1 process on the same global batch: the same arithmetic summed in another
# order (measured differences are ~1e-7 relative); a rank training on the wrong data or without
# gradient exchange is off by ~1e-3 after one update.
LOSS_RTOL = 1e-5

UNTIED = {**TINY_MODEL, "untie_embeddings": True}  # two equal V x d matrices: ZeRO-1 balances them
RUN = {"seq_len": 32, "steps": 4, "warmup_steps": 1, "val_blocks": 4, "warmup_timing_steps": 1}



def _torchrun(settings: dict, cache: Path, env: dict | None = None,
              entry: tuple[str, ...] = ("-m", "memtrain")) -> subprocess.CompletedProcess:
    """``entry`` is what each rank runs: ``python -m memtrain`` by default."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           *entry, "train", *cli_flags({**settings, "progress": False})]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "MEMTRAIN_CACHE": str(cache), **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=full_env)


def _result(proc: subprocess.CompletedProcess, out: Path) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "result.json").read_text())


@pytest.fixture(scope="module")
def runs(small_corpus, tmp_path_factory) -> dict:
    """The 2-rank runs shared by the tests below. zero1 and fsdp stop after 2 of 4 steps with a
    sharded checkpoint and resume to the end (their two checkpoint layouts differ)."""
    root = tmp_path_factory.mktemp("dist")
    cache = root / "cache"
    done: dict = {}

    # Through real torchrun, as users launch it.
    base = {**UNTIED, **RUN, "data": str(small_corpus), "batch_size": 2}
    proc = _torchrun({**base, "distributed": "ddp", "out": str(root / "ddp")}, cache)
    done["ddp"] = _result(proc, root / "ddp")
    done["ddp_stdout"] = proc.stdout

    # The others from one driver process, in this order (a resume follows the run that saved it).
    plan: list[tuple[str, dict]] = [
        ("zero2", {**base, "distributed": "zero2"}),
        ("zero1_half", {**base, "distributed": "zero1", "stop_after": 2, "save": str(root / "ck1")}),
        ("zero1", {**base, "distributed": "zero1", "resume": str(root / "ck1")}),
    ]
    # fsdp with the tied LM head, gradient accumulation and activation checkpointing.
    tied = {**TINY_MODEL, **RUN, "data": str(small_corpus), "batch_size": 2, "grad_accum": 2,
            "checkpointing": "full", "distributed": "fsdp"}
    plan += [("fsdp_half", {**tied, "stop_after": 2, "save": str(root / "ck2")}),
             ("fsdp", {**tied, "resume": str(root / "ck2")})]
    # zero1 with the tied 50257-row embedding (~98% of this model, 80% of the default one):
    # sharded within tensors, every rank keeps about half of DDP's optimizer state.
    tied_plain = {**TINY_MODEL, **RUN, "data": str(small_corpus), "batch_size": 2}
    plan += [("ddp_tied", {**tied_plain, "distributed": "ddp"}),
             ("zero1_tied", {**tied_plain, "distributed": "zero1"}),
             ("fsdp_tied", {**tied_plain, "distributed": "fsdp"}),
             ("zero2_bf16", {**tied_plain, "distributed": "zero2", "precision": "bf16"})]  # tiny: bf16 is slow here
    # Activation offloading inside FSDP2's sharded step (its all-gathered weights stay where they are).
    plan += [("fsdp_offload", {**tied_plain, "distributed": "fsdp", "offload_activations": True})]
    logs = root / "logs"
    logs.mkdir()
    runs_json = [(name, ["train", *cli_flags({**settings, "progress": False, "out": str(root / name)})])
                 for name, settings in plan]
    (root / "plan.json").write_text(json.dumps({"nproc": 2, "logs": str(logs), "runs": runs_json}))
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("dist_launch.py")), str(root / "plan.json")],
                          capture_output=True, text=True, timeout=TIMEOUT_S * len(plan),
                          env={**os.environ, "OMP_NUM_THREADS": "1", "MEMTRAIN_CACHE": str(cache)})
    rank_logs = {name: "".join(p.read_text() for p in sorted(logs.glob(f"{name}-rank*.log"))) for name, _ in plan}
    assert proc.returncode == 0, proc.stderr[-3000:] + "".join(rank_logs.values())[-3000:]
    for name, _ in plan:
        done[name] = json.loads((root / name / "result.json").read_text())
        done[name + "_stdout"] = rank_logs[name]
    done["ckpt"] = root / "ck2"
    return done


def test_strategies_match_single_process_on_the_global_batch(runs, small_corpus, tmp_path):
    single = train(build_config({**UNTIED, **RUN, "data": str(small_corpus), "batch_size": 4,
                                 "progress": False, "out": str(tmp_path / "one")}))
    for s in ("ddp", "zero1", "zero2"):
        r = runs[s]
        assert r["loss_history"] == pytest.approx(single["loss_history"], rel=LOSS_RTOL), s
        assert r["val_loss"] == pytest.approx(single["val_loss"], rel=LOSS_RTOL), s
        assert r["tokens"] == single["tokens"]  # the global batch
        assert r["distributed"] == {"strategy": s, "world_size": 2, "backend": "gloo"}
        assert [m["rank"] for m in r["ranks"]] == [0, 1]
        assert {"peak_bytes", "by_category", "max_allocated_bytes", "sharded_state"} <= set(r["ranks"][0])
        wrote = [line for line in runs[s + "_stdout"].splitlines() if line.startswith("wrote ")]
        assert len(wrote) == len(set(wrote)) and sum("result.json" in w for w in wrote) == 1, wrote  # rank 0 only


def test_sharded_state_halves_per_rank(runs):
    """Tracked per-rank bytes: zero1 halves optimizer state, zero2 also gradients, fsdp also
    the weights at the peak (each vs ddp, which keeps everything on every rank)."""
    ddp = runs["ddp"]["ranks"]
    full = ddp[0]["sharded_state"]
    assert ddp[0]["by_category"]["parameters"] == full["parameters"]
    for rank in runs["zero1"]["ranks"]:
        st = rank["sharded_state"]
        assert st["optimizer"] <= 0.55 * full["optimizer"]
        assert st["gradients"] == full["gradients"] and st["parameters"] == full["parameters"]
        assert rank["by_category"]["optimizer"] <= 0.55 * ddp[0]["by_category"]["optimizer"]
        assert rank["peak_bytes"] < ddp[0]["peak_bytes"]
    assert sum(r["sharded_state"]["optimizer"] for r in runs["zero1"]["ranks"]) == pytest.approx(full["optimizer"], rel=0.01)
    for rank in runs["zero2"]["ranks"]:
        st = rank["sharded_state"]
        assert st["optimizer"] <= 0.55 * full["optimizer"] and st["gradients"] <= 0.55 * full["gradients"]
        # FSDP2 without resharding after forward: the gathered weights stay until backward,
        # beside the shard, so the weights at the peak are *more* than DDP's (documented).
        assert rank["by_category"]["parameters"] > full["parameters"]
        assert rank["peak_bytes"] < ddp[0]["peak_bytes"]
    fsdp = runs["fsdp"]
    weight_bytes = 4 * fsdp["parameters"]  # FP32, tied head counted once
    for rank in fsdp["ranks"]:
        st = rank["sharded_state"]
        assert rank["by_category"]["parameters"] <= 0.55 * weight_bytes
        assert st["parameters"] <= 0.55 * weight_bytes and st["gradients"] <= 0.55 * weight_bytes
        assert st["optimizer"] <= 0.55 * 2 * weight_bytes + 1024  # + step counters


def test_zero1_shards_within_tensors_the_tied_embedding(runs, small_corpus, tmp_path):
    """torch's ZeroRedundancyOptimizer would leave the whole embedding's state on one rank
    (~98% of DDP's here); dim-0 chunks give each rank about half, and training is unchanged."""
    ddp = runs["ddp_tied"]["ranks"][0]
    ranks = runs["zero1_tied"]["ranks"]
    for rank in ranks:
        assert rank["sharded_state"]["optimizer"] <= 0.55 * ddp["sharded_state"]["optimizer"]
        assert rank["by_category"]["optimizer"] <= 0.55 * ddp["by_category"]["optimizer"]
        assert rank["sharded_state"]["parameters"] == ddp["sharded_state"]["parameters"]
    assert sum(r["sharded_state"]["optimizer"] for r in ranks) == pytest.approx(ddp["sharded_state"]["optimizer"], rel=0.01)
    single = train(build_config({**TINY_MODEL, **RUN, "data": str(small_corpus), "batch_size": 4,
                                 "progress": False, "out": str(tmp_path / "one")}))
    r = runs["zero1_tied"]
    assert r["loss_history"] == pytest.approx(single["loss_history"], rel=LOSS_RTOL)
    assert r["val_loss"] == pytest.approx(single["val_loss"], rel=LOSS_RTOL)


def test_per_rank_estimate_matches_the_measured_peaks(runs):
    """`estimate --world-size 2 --shard ...` against every rank's tracked peak of the runs above
    (fp32 and bf16, tied and untied): DDP's persistent gradient buckets, zero1's chunked state, zero2's
    shard plus gathered weights, fsdp's root group kept gathered."""
    from memtrain.analysis.estimate import estimate

    cases = {"ddp": (UNTIED, "none"), "zero2": (UNTIED, "zero2"), "zero1": (UNTIED, "zero1"),
             "ddp_tied": (TINY_MODEL, "none"), "zero1_tied": (TINY_MODEL, "zero1"),
             "fsdp_tied": (TINY_MODEL, "fsdp"), "zero2_bf16": ({**TINY_MODEL, "precision": "bf16"}, "zero2"),
             # --grad-accum under FSDP2: the unreduced full-size gradients wait for the last micro-batch.
             "fsdp": ({**TINY_MODEL, "grad_accum": 2, "checkpointing": "full"}, "fsdp")}
    for name, (model, shard) in cases.items():
        cfg = build_config({**RUN, **model, "batch_size": 2})
        est = estimate(cfg, device_type="cpu", world_size=2, shard=shard).peak_bytes
        for rank in runs[name]["ranks"]:
            assert est == pytest.approx(rank["peak_bytes"], rel=0.03), (name, rank["rank"])


def test_fsdp_with_offloaded_activations_trains_the_same_steps(runs):
    """--offload-activations with --distributed fsdp on 2 ranks: the same losses, bit for bit, as
    fsdp alone; each rank moves its saved activations to the host ledger and holds fewer at its
    peak."""
    plain, off = runs["fsdp_tied"], runs["fsdp_offload"]
    assert off["loss_history"] == plain["loss_history"] and off["val_loss"] == plain["val_loss"]
    assert off["distributed"] == {"strategy": "fsdp", "world_size": 2, "backend": "gloo"}
    assert off["offload"]["d2h_bytes"] == off["offload"]["h2d_bytes"] > 0
    assert off["offload"]["kept_parameters"] > 0  # FSDP's unsharded weights stay on the device
    for rank_off, rank_plain in zip(off["ranks"], plain["ranks"], strict=True):
        assert rank_off["offloaded_peak_bytes"] > 0 and rank_plain["offloaded_peak_bytes"] == 0
        assert rank_off["by_category"]["activations"] < rank_plain["by_category"]["activations"]


def test_fsdp_cpu_offload_with_offloaded_activations_on_cpu_is_one_error_line(tiny_run, monkeypatch, capsys):
    """On a CPU run --cpu-offload has nothing to move, with or without --offload-activations."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    argv = ["train", *cli_flags({**tiny_run, "distributed": "fsdp", "cpu_offload": True, "offload_activations": True,
                             "device": "cpu"})]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --cpu-offload") and err.count("\n") == 1, err


def test_zero1_chunks_cover_every_row_once():
    from memtrain.distributed.zero1 import dim0_range

    for rows in (1, 2, 3, 7, 50257):
        for world in (1, 2, 3, 4, 8):
            spans = [dim0_range(rows, r, world) for r in range(world)]
            assert spans[0][0] == 0 and spans[-1][1] == rows
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            assert max(e - s for s, e in spans) == -(-rows // world)


def test_resume_continues_identically_and_fsdp_keeps_the_tie(runs, small_corpus, tmp_path):
    """Stopped and resumed runs (zero1 above, fsdp here) follow the uninterrupted reference."""
    for name in ("zero1", "fsdp"):
        half, resumed = runs[name + "_half"], runs[name]
        assert half["stopped_early"] and resumed["steps_run"] == 2
        assert resumed["loss_history"][:2] == half["loss_history"]  # restored, not recomputed
    resumed = runs["fsdp"]
    # The uninterrupted reference: one process on the same global batch.
    single = train(build_config({**TINY_MODEL, **RUN, "data": str(small_corpus), "batch_size": 4, "grad_accum": 2,
                                 "checkpointing": "full", "progress": False, "out": str(tmp_path / "one")}))
    assert resumed["loss_history"] == pytest.approx(single["loss_history"], rel=LOSS_RTOL)
    assert resumed["val_loss"] == pytest.approx(single["val_loss"], rel=LOSS_RTOL)
    # lm_head.weight is still wte.weight after fully_shard: counted once among trainable tensors.
    assert resumed["trainable_parameters"] == resumed["parameters"] == single["parameters"]
    ckpt = runs["ckpt"]
    assert {"meta.json", "rank-0.pt", "rank-1.pt", ".metadata"} <= {p.name for p in ckpt.iterdir()}
    # The tied head is written once (it is 80% of this model's weights), and restored as the tie.
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    assert "model.wte.weight" in saved and "model.lm_head.weight" not in saved


def test_failing_rank_fails_the_run_without_hanging(small_corpus, tmp_path):
    settings = {**UNTIED, **RUN, "data": str(small_corpus), "batch_size": 2, "distributed": "ddp",
                "out": str(tmp_path / "run")}
    # Rank 1 raises in its second forward (tests/failing_rank.py), after the first step's collectives.
    proc = _torchrun(settings, tmp_path / "cache", env={"MEMTRAIN_DIST_TIMEOUT": "60"},
                     entry=(str(Path(__file__).with_name("failing_rank.py")), "1"))
    assert proc.returncode != 0
    assert "injected failure on rank 1" in proc.stderr + proc.stdout
    assert not (tmp_path / "run" / "result.json").exists()


# --------------------------------------------------------------------------- in-process checks
def test_distributed_needs_torchrun(tiny_run, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match="add --nproc-per-node N .*`torchrun --nproc_per_node N"):
        train(build_config({**tiny_run, "distributed": "fsdp"}))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="--distributed is none"):
        train(build_config(tiny_run))


def test_bad_combinations_are_config_errors(tiny_run, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match="--cpu-offload"):
        train(build_config({**tiny_run, "distributed": "fsdp", "cpu_offload": True, "device": "cpu"}))
    with pytest.raises(ConfigError, match="--cpu-offload needs sharded state"):
        train(build_config({**tiny_run, "distributed": "ddp", "cpu_offload": True}))
    with pytest.raises(ConfigError, match="precision bf16"):
        train(build_config({**tiny_run, "distributed": "zero2", "precision": "fp16"}))
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        with pytest.raises(ConfigError, match="pip install deepspeed"):
            train(build_config({**tiny_run, "distributed": "deepspeed-zero3"}))


def test_deepspeed_config_maps_options():
    from memtrain.distributed.deepspeed_engine import deepspeed_config

    cfg = build_config({"distributed": "deepspeed-zero3", "batch_size": 4, "grad_accum": 2, "grad_clip": 0.5,
                        "precision": "bf16", "cpu_offload": True})
    ds = deepspeed_config(cfg, world_size=8)
    assert ds["train_batch_size"] == 4 * 2 * 8 and ds["train_micro_batch_size_per_gpu"] == 4
    assert ds["zero_optimization"]["stage"] == 3 and ds["gradient_clipping"] == 0.5
    assert ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]
    assert ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    two = deepspeed_config(cfg.replace(distributed="deepspeed-zero2", cpu_offload=False), world_size=2)
    assert two["zero_optimization"]["stage"] == 2 and "offload_optimizer" not in two["zero_optimization"]



def test_fully_shard_keeps_weight_tying_and_no_sync_skips_reduction(one_rank_group):
    from torch.distributed.tensor import DTensor

    from memtrain.config.run import ModelConfig
    from memtrain.distributed.session import DistContext
    from memtrain.distributed.wrapping import apply_distributed
    from memtrain.models.gpt import GPT
    from memtrain.techniques.precision import make_precision

    torch.manual_seed(0)
    cfg = build_config({**TINY_MODEL, "seq_len": 32, "distributed": "fsdp"})
    model = apply_distributed(GPT(ModelConfig(**TINY_MODEL)), cfg.technique, torch.device("cpu"),
                              make_precision("fp32", torch.device("cpu")))
    assert isinstance(model.wte.weight, DTensor) and model.lm_head.weight is model.wte.weight
    no_sync = DistContext(strategy="fsdp").no_sync(model)
    assert no_sync is not None
    groups = [g for m in model.modules() if hasattr(m, "_get_fsdp_state") for g in m._get_fsdp_state()._fsdp_param_groups]
    with no_sync():
        assert not any(g.reduce_grads for g in groups)
    assert all(g.reduce_grads for g in groups)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 50257, (2, 16))
    model(x, x).backward()
    opt.step()
    assert model.lm_head.weight is model.wte.weight
    assert len(opt.param_groups[0]["params"]) == len({id(p) for p in model.parameters()})


def test_session_frees_the_run_before_leaving_the_group(tiny_run, monkeypatch):
    """The wrapped model must be gone (and its collectives settled) when the group is destroyed:
    left to interpreter shutdown, gloo's threads release tensors during finalization and abort
    a run that had finished ("terminate called without an active exception")."""
    import gc
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)
    seen: dict = {}
    destroy = dist.destroy_process_group

    def checking_destroy(*args, **kwargs):
        seen["alive"] = [o for o in gc.get_objects() if type(o) is torch.nn.parallel.DistributedDataParallel]
        return destroy(*args, **kwargs)

    monkeypatch.setattr(dist, "destroy_process_group", checking_destroy)
    train(build_config({**tiny_run, "steps": 2, "distributed": "ddp"}))
    assert seen["alive"] == [], "the DDP model outlived the run into destroy_process_group"
    assert not dist.is_initialized()


def test_optimizer_state_bytes_counts_sharded_state(one_rank_group):
    """FSDP2 keeps AdamW's moments as DTensors: the count is their local shards' bytes."""
    from torch.distributed.fsdp import fully_shard

    from memtrain.metrics import optimizer_state_bytes

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    n_params = sum(p.numel() for p in model.parameters())
    # Two FP32 moments per value and one FP32 step counter per tensor (one rank: the whole).
    assert optimizer_state_bytes(opt) == 8 * n_params + 4 * 4


def test_the_deepspeed_step_returns_the_mean_loss_and_calls_before_wait_after_its_last_step():
    """deepspeed_train_step drives the engine itself: the feed's fetch (``before_wait``) comes
    after every micro-batch's step is queued, and the loss is the micro-batches' mean."""
    events: list[str] = []

    class Engine:
        def __call__(self, x, y):
            return (x.float().mean() + y.float().mean()) / 2

        def backward(self, loss):
            events.append("backward")

        def step(self):
            events.append("step")

    micro = [(torch.full((2, 3), float(v)), torch.full((2, 3), float(v))) for v in (1, 3)]
    loss = deepspeed_train_step(Engine(), micro, None, None, 1.0, torch.device("cpu"),
                                before_wait=lambda: events.append("fetch"))
    assert loss == 2.0
    assert events == ["backward", "step", "backward", "step", "fetch"]


def test_a_sharded_checkpoint_at_the_last_step_resumes_to_the_runs_result(small_corpus, tmp_path):
    """`train --resume CKPT --nproc-per-node 2` of an fsdp checkpoint at its run's last step whose
    result.json is gone runs the final evaluation only and writes the result the run wrote (the
    same losses and perplexity, every rank listed), with every memory figure null as no step ran:
    `ranks[].sharded_state` too, which held the figures of the zero-gradient optimizer step that
    restoring a sharded optimizer runs (gradients one bias short of the run's). A second resume,
    the result written, is refused and keeps it."""
    out = tmp_path / "o"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEMTRAIN_CACHE": str(tmp_path / "cache")}
    flags = cli_flags({**TINY_MODEL, "seq_len": 16, "batch_size": 2, "steps": 2, "warmup_steps": 0, "val_blocks": 2,
                       "data": str(small_corpus), "distributed": "fsdp", "progress": False, "device": "cpu"})

    def memtrain(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "memtrain", "train", *args], capture_output=True, text=True,
                              timeout=TIMEOUT_S, env=env)

    first = memtrain(*flags, "--nproc-per-node", "2", "--out", str(out), "--save", str(out / "ck"))
    assert first.returncode == 0, first.stderr[-3000:]
    full = json.loads((out / "result.json").read_text())
    (out / "result.json").unlink()
    resumed = memtrain("--resume", str(out / "ck"), "--nproc-per-node", "2", "--no-progress")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "no step ran" in resumed.stdout
    got = json.loads((out / "result.json").read_text())
    assert got.keys() == full.keys()
    for key in ("val_loss", "val_ppl", "loss_history", "train_loss", "steps", "tokens"):
        assert got[key] == full[key], key
    assert got["steps_run"] == 0 and got["memory"]["peak_bytes"] is None
    assert [r["rank"] for r in got["ranks"]] == [0, 1] and got["distributed"] == full["distributed"]
    assert all(r["peak_bytes"] is None and r["sharded_state"] is None for r in got["ranks"]), got["ranks"]
    assert all(r["sharded_state"]["gradients"] > 0 for r in full["ranks"])
    last = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["step"] == 2 and last["val_loss"] == full["val_loss"] and last["resumed_from_step"] == 2
    before = (out / "result.json").read_bytes()
    again = memtrain("--resume", str(out / "ck"), "--nproc-per-node", "2", "--no-progress")
    assert again.returncode == 2 and "holds its result" in again.stderr
    assert (out / "result.json").read_bytes() == before
