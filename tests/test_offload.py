"""Activation offloading (--offload-activations): the tracked meter shows the saved activations
leave the device for the host ledger, losses and weights stay bitwise equal, impossible
combinations are refused, and the estimate and plan account for it."""

from __future__ import annotations

import pytest
import torch

from memtrain.cli import main
from memtrain.config.run import ConfigError, build_config
from memtrain.metrics import MemoryMeter
from memtrain.techniques.facts import OFFLOAD_MIN_BYTES
from memtrain.training.step import build_state, measure_steps, random_micro_batches, run_step

TINY = dict(vocab_size=512, d_model=32, n_heads=2, n_layers=2, d_ff=64, max_seq_len=64, dropout=0.1,
            batch_size=2, seq_len=32, device="cpu")
CPU = torch.device("cpu")


def _measure(**overrides):
    """The steady-state step's tracked stats and the offloader's counts (None when off)."""
    cfg = build_config(dict(TINY, **overrides))
    torch.manual_seed(0)
    state = build_state(cfg, CPU)
    meter = MemoryMeter(state.model, state.optimizer)
    gen = torch.Generator().manual_seed(1)
    measure_steps(state, lambda: random_micro_batches(cfg, cfg.train.batch_size, CPU, gen), meter=meter)
    counts = state.offload.counts if state.offload is not None else None
    return meter.stats(), counts


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_offload_moves_saved_activations_to_the_host_ledger(checkpointing):
    plain, none = _measure(checkpointing=checkpointing)
    off, counts = _measure(checkpointing=checkpointing, offload_activations=True)
    assert none is None and plain.offloaded_peak_bytes == 0  # runs without it: no host ledger
    assert counts.tensors > 0 and counts.d2h_bytes == counts.h2d_bytes > 0
    assert off.offloaded_peak_bytes > 0
    # What stays on the device are the tensors under the size floor (one each, at most).
    assert off.by_category["activations"] < plain.by_category["activations"] / 4
    assert off.by_category["activations"] <= counts.kept_small * OFFLOAD_MIN_BYTES
    assert off.peak_bytes < plain.peak_bytes
    # The host holds about what the device no longer holds (one copy per saved storage).
    saved = plain.by_category["activations"] - off.by_category["activations"]
    assert off.offloaded_peak_bytes == pytest.approx(saved, rel=0.05)


def _train_losses(steps: int = 3, **overrides) -> tuple[list[float], dict[str, torch.Tensor]]:
    cfg = build_config(dict(TINY, **overrides))
    torch.manual_seed(0)
    state = build_state(cfg, CPU)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        torch.manual_seed(len(losses))  # the same dropout masks in both runs
        losses.append(run_step(state, random_micro_batches(cfg, cfg.train.batch_size, CPU, gen)))
    return losses, {k: v.detach().clone() for k, v in state.model.state_dict().items()}


@pytest.mark.parametrize("overrides", [dict(), dict(checkpointing="full", grad_accum=2)])
def test_offload_leaves_losses_and_weights_bitwise_equal(overrides):
    ref_losses, ref_weights = _train_losses(**overrides)
    losses, weights = _train_losses(offload_activations=True, **overrides)
    assert losses == ref_losses
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)


def test_deepspeed_with_offload_is_one_line_exit_2(capsys):
    with pytest.raises(ConfigError, match="offload-activations"):
        build_config(dict(TINY, offload_activations=True, distributed="deepspeed-zero2"))
    code = main(["train", "--offload-activations", "--distributed", "deepspeed-zero3", "--steps", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: --offload-activations")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_offload_pins_host_copies_and_prefetches_on_a_side_stream():
    from memtrain.techniques.offload import ActivationOffloader

    device = torch.device("cuda")
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)]).to(device)
    x = torch.randn(64, 256, device=device, requires_grad=True)
    ref = model(x).square().sum()
    ref_grads = torch.autograd.grad(ref, [x, *model.parameters()])
    off = ActivationOffloader(model, device, prefetch=2)
    assert off.streams and off._side is not None
    with off.forward():
        y = model(x).square().sum()
    views = off._packed
    assert views and all(h().host.is_pinned() for h in views if h() is not None)
    brought_back_early = []
    original = off._bring_back

    def spy(h):
        brought_back_early.append(h.index)
        original(h)

    off._bring_back = spy
    grads = torch.autograd.grad(y, [x, *model.parameters()])
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    # The first unpack (the last saved tensor) brought the two before it back ahead of use.
    assert brought_back_early[:3] == sorted(brought_back_early[:3], reverse=True) and len(brought_back_early) > 2
    assert off.counts.d2h_bytes == off.counts.h2d_bytes > 0


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_estimate_gives_device_host_and_transfer_bytes_the_meter_measures(checkpointing):
    from memtrain.analysis.estimate import estimate

    cfg = build_config(dict(TINY, checkpointing=checkpointing, offload_activations=True))
    est = estimate(cfg, device_type="cpu")
    plain = estimate(cfg.replace(offload_activations=False), device_type="cpu")
    measured, counts = _measure(checkpointing=checkpointing, offload_activations=True)
    assert est.peak_bytes == pytest.approx(measured.peak_bytes, rel=0.03)
    off = est.offload
    assert off["host_peak_bytes"] == pytest.approx(measured.offloaded_peak_bytes, rel=0.02)
    assert off["d2h_bytes_per_step"] == pytest.approx(counts.d2h_bytes, rel=0.02)
    assert off["h2d_bytes_per_step"] == pytest.approx(counts.h2d_bytes, rel=0.02)
    assert off["transfer_bytes_per_step"] == off["d2h_bytes_per_step"] + off["h2d_bytes_per_step"]
    # The device's activations drop by what went to the host; runs without it have no offload key.
    assert est.by_category["activations"] < plain.by_category["activations"] / 4
    assert "offload" not in plain.to_dict() and est.to_dict()["offload"]["host_peak_bytes"] > 0


@pytest.mark.parametrize("loss_on", ["all", "completion"])
def test_estimate_moves_the_token_ids_the_embedding_and_the_loss_save(loss_on):
    """8 x 64 tokens: the loader's int64 ids (4 KiB a micro-batch), which the lookup saves for its
    weight's gradient, and its labels, which nll_loss saves (under --loss-on completion their
    answers-only copy instead), pass the size floor and go to the host with the activations; the
    estimate left both out (24,576 B, 12,288 B under completion, below the offloader's count over
    three micro-batches)."""
    from memtrain.analysis.estimate import estimate

    over = dict(batch_size=8, seq_len=64, grad_accum=3, loss_on=loss_on)
    est = estimate(build_config(dict(TINY, offload_activations=True, **over)), device_type="cpu").offload
    _, counts = _measure(offload_activations=True, **over)
    assert (est["d2h_bytes_per_step"], est["h2d_bytes_per_step"]) == (counts.d2h_bytes, counts.h2d_bytes)


def test_plan_offers_offload_under_a_tight_budget_and_charges_its_copies():
    from memtrain.analysis.estimate import estimate
    from memtrain.analysis.plan import plan
    from memtrain.analysis.step_time import offload_exposed_s, step_cost

    cfg = build_config(dict(TINY, batch_size=1, seq_len=256, max_seq_len=256, device="cuda"))
    space = {"precision": ["bf16"], "attention": ["sdpa"], "checkpointing": ["none", "full"], "loss": ["standard"],
             "optim": ["adamw"], "offload_activations": [False, True]}
    off_cfg = cfg.replace(precision="bf16", attention="sdpa", offload_activations=True)
    needs = estimate(off_cfg, device_type="cuda").peak_bytes
    for checkpointing in ("none", "full"):  # neither fits without offloading
        assert estimate(off_cfg.replace(offload_activations=False, checkpointing=checkpointing),
                        device_type="cuda").peak_bytes > needs * 1.02
    res = plan(cfg, int(needs * 1.1 * 1.01), "cuda", space=space, host_bandwidth=1e9)
    best = res.candidates[0]
    assert best.techniques["offload_activations"] is True and "--offload-activations" in best.train_flags
    # Its time is the step's plus the copies compute does not hide, at the stated host bandwidth.
    moved = estimate(off_cfg.replace(checkpointing=best.techniques["checkpointing"]), device_type="cuda").offload
    cost, detail = step_cost(off_cfg.replace(checkpointing=best.techniques["checkpointing"]), "cuda")
    exposed = offload_exposed_s(moved["d2h_bytes_per_step"], moved["h2d_bytes_per_step"], detail["compute_s"], 1e9)
    assert exposed > 0 and best.step_time_s == pytest.approx(cost + exposed)
    # With room to spare, the offload twin of a fitting set is not offered (it only adds copies).
    roomy = plan(cfg, 10 * 2**30, "cuda", space=space)
    assert not any(c.techniques["offload_activations"] for c in roomy.candidates)


def test_train_with_and_without_offload_same_losses_and_the_report_shows_the_host_bytes(tiny_run):
    from memtrain.bench.technique_sets import describe, technique_overrides
    from memtrain.report.tables import markdown_report
    from memtrain.training.train import train

    run = {**tiny_run, "steps": 2, "warmup_steps": 1, "warmup_timing_steps": 0, "val_blocks": 1,
           "precision": "fp32", "device": "cpu"}
    plain = train(build_config({**run, "out": run["out"] + "-plain"}))
    off = train(build_config({**run, "offload_activations": True}))
    assert off["loss_history"] == plain["loss_history"] and off["val_loss"] == plain["val_loss"]
    assert "offload" not in plain and plain["memory"]["offloaded_peak_bytes"] == 0
    assert off["offload"]["d2h_bytes"] == off["offload"]["h2d_bytes"] > 0
    assert off["memory"]["offloaded_peak_bytes"] > 0
    assert off["memory"]["by_category"]["activations"] < plain["memory"]["by_category"]["activations"]
    # The bench row names the flag, and the report gains the host column only when a row offloaded.
    assert technique_overrides("offload-bf16", "quick")["offload_activations"] is True
    rows = [{**r, "technique": name, "description": describe(name), "status": "ok"}
            for name, r in (("chunked-loss", plain), ("offload-bf16", off))]
    report = markdown_report(rows, [])
    assert "Activation offloading + chunked loss" in report and "Offloaded to host (MiB, peak)" in report
    assert "Offloaded to host" not in markdown_report(rows[:1], [])


def _compiled_losses(offload: bool) -> tuple[list[float], int]:
    """Three steps of the tiny GPT (dropout off: compiled and eager draw masks differently)
    compiled per block with AOTAutograd and no kernels ("aot_eager": the graphs inductor would
    get, fast on CPU): (losses, bytes the offloader copied to the host in the last step)."""
    from memtrain.config.run import TechniqueConfig
    from memtrain.techniques.compile import apply_compile

    torch.compiler.reset()
    cfg = build_config(dict(TINY, dropout=0.0, offload_activations=offload))
    torch.manual_seed(0)
    state = build_state(cfg, CPU)
    apply_compile(state.model, TechniqueConfig(compile=True, compile_scope="block"), backend="aot_eager")
    gen = torch.Generator().manual_seed(1)
    losses = [run_step(state, random_micro_batches(cfg, cfg.train.batch_size, CPU, gen)) for _ in range(3)]
    torch.compiler.reset()
    return losses, state.offload.counts.d2h_bytes if state.offload is not None else 0


def test_offload_works_under_compile_with_the_same_losses():
    """The compiled blocks' saved tensors pass through the hooks too (AOTAutograd's backward
    unpacks them like eager autograd): bytes move and the losses are those of the plain
    compiled run."""
    plain, none = _compiled_losses(offload=False)
    off, moved = _compiled_losses(offload=True)
    assert none == 0
    assert off == pytest.approx(plain, rel=1e-6)
    # Not only the embedding and the loss outside the blocks: about what the eager step moves
    # (the partition saves a little differently).
    cfg = build_config(dict(TINY, dropout=0.0, offload_activations=True))
    torch.manual_seed(0)
    eager = build_state(cfg, CPU)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        run_step(eager, random_micro_batches(cfg, cfg.train.batch_size, CPU, gen))
    assert eager.offload is not None
    assert moved == pytest.approx(eager.offload.counts.d2h_bytes, rel=0.05)


@pytest.mark.parametrize("rate", ["abc", "64GB", "0GB/s", "1e400GB/s", "-5GB/s"])
def test_a_bad_host_bandwidth_is_one_line_naming_a_rate(rate, capsys):
    assert main(["plan", "--budget", "8GiB", "--device-type", "cuda", f"--host-bandwidth={rate}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --host-bandwidth '{rate}'") and "64GB/s" in err[0]


_GPT2 = dict(n_embd=32, n_inner=64, n_layer=2, n_head=2, vocab_size=128, n_positions=256, bos_token_id=0, eos_token_id=0)


@pytest.mark.parametrize("model", ["ours", "gpt2"])
@pytest.mark.parametrize("batch, seq", [(2, 32), (1, 128), (2, 96), (1, 255), (2, 128)])
def test_a_layernorms_mean_and_rstd_meet_the_size_floor_each(model, batch, seq, tmp_path_factory):
    """LayerNorm saves its float32 mean and rstd as two tensors of 4 bytes a token. Between 128
    and 255 tokens each is under the offloader's 1 KiB floor and stays on the device; counted as
    one tensor of 8 bytes a token the estimate moved 8 N bytes a norm more than the trace (5 norms:
    5,120 B at 128 tokens, 7,680 at 192, 10,200 at 255). Below 128 both stay, from 256 both go."""
    from memtrain.analysis.estimate import estimate
    from memtrain.analysis.estimate.hf import analytic_estimate
    from memtrain.analysis.trace import trace_step

    tech = dict(batch_size=batch, seq_len=seq, device="cpu", offload_activations=True)
    if model == "ours":
        cfg = build_config(dict(TINY, max_seq_len=256, **tech))
        est = estimate(cfg, device_type="cpu").offload
    else:
        transformers = pytest.importorskip("transformers")
        root = tmp_path_factory.getbasetemp() / "gpt2-offload"
        if not root.exists():
            transformers.GPT2Config(**_GPT2).save_pretrained(root)
        cfg = build_config({"model": str(root), **tech})
        est = analytic_estimate(cfg, "cpu").offload
    assert OFFLOAD_MIN_BYTES == 1024  # the floor the figures above assume
    traced = trace_step(cfg, "cpu")["offload"]
    assert (est["d2h_bytes_per_step"], est["h2d_bytes_per_step"]) == (traced["d2h_bytes"], traced["h2d_bytes"])


def _estimate_json(argv, capsys):
    import json

    assert main(["estimate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("model", ["ours", "gpt2", "gpt2-full-trace"])
def test_estimate_trace_json_carries_what_the_traced_offloader_moved(model, capsys, tmp_path_factory):
    """`estimate --trace --json` put the traced step's peak and categories in ``trace`` but left
    out what its offloader moved and held on the host: ``trace.offload`` now has them under the
    analytic ``offload`` entry's names (and the offloader's tensor counts), so the two compare key
    by key; a traced transformers estimate (--full-trace) gives the same entry as its ``offload``."""
    flags = ["--batch-size", "2", "--seq-len", "64", "--offload-activations", "--device", "cpu"]
    if model == "ours":
        argv = ["--d-model", "32", "--n-heads", "2", "--n-layers", "2", "--vocab-size", "512", *flags, "--trace"]
    else:
        transformers = pytest.importorskip("transformers")
        root = tmp_path_factory.getbasetemp() / "gpt2-offload"
        if not root.exists():
            transformers.GPT2Config(**_GPT2).save_pretrained(root)
        argv = ["--model", str(root), *flags, "--trace" if model == "gpt2" else "--full-trace"]
    out = _estimate_json(argv, capsys)
    traced = out["trace"]["offload"]
    assert traced["d2h_bytes_per_step"] == traced["h2d_bytes_per_step"] > 0
    assert traced["transfer_bytes_per_step"] == 2 * traced["d2h_bytes_per_step"]
    assert 0 < traced["host_at_peak_bytes"] <= traced["host_peak_bytes"] and traced["tensors"] > 0
    if model == "gpt2-full-trace":
        assert out["offload"] == traced  # the trace is the estimate
    else:  # the analytic model moves the traced bytes at these sizes (see the size-floor test above)
        assert out["offload"]["d2h_bytes_per_step"] == traced["d2h_bytes_per_step"]
    assert main(["estimate", *argv]) == 0
    assert "traced host copies (peak)" in capsys.readouterr().out



_HOST_AT_PEAK_CASES = [
    ("ours", 2, 1, 64, "none", "standard"), ("ours", 2, 1, 128, "none", "chunked"), ("ours", 3, 1, 128, "none", "standard"),
    ("ours", 3, 4, 64, "none", "chunked"), ("ours", 2, 4, 128, "full", "standard"), ("ours", 3, 1, 64, "full", "chunked"),
    ("gpt2", 2, 1, 64, "none", "standard"), ("gpt2", 2, 1, 128, "none", "chunked"), ("gpt2", 3, 4, 64, "none", "standard"),
]


@pytest.mark.parametrize("model, layers, batch, seq, checkpointing, loss", _HOST_AT_PEAK_CASES)
def test_estimate_holds_the_traced_host_bytes_at_the_device_peak(model, layers, batch, seq, checkpointing, loss,
                                                                tmp_path_factory):
    """``host_at_peak_bytes`` is what the offloader's host copies hold when the device reaches its
    peak. A Linear's bias gradient is summed by autograd's engine after the matmul's backward has
    returned, and by then the device copy of the input it brought back for the last time is gone
    (the host copy stays until the saved variables are released). The estimate kept that copy
    through the sum, which tied the MLP's output Linear with the activation's backward after it
    and put the peak one op early, with one more activation on the host (our GPT, 2 layers at
    1 x 64: 708,608 B for the traced 446,464)."""
    from memtrain.analysis.estimate import estimate
    from memtrain.analysis.estimate.hf import analytic_estimate
    from memtrain.analysis.trace import trace_step

    tech = dict(batch_size=batch, seq_len=seq, device="cpu", offload_activations=True, checkpointing=checkpointing,
                loss=loss)
    if model == "ours":  # the default MLP width (TINY's narrow one never ties the two ops)
        cfg = build_config(dict(vocab_size=512, d_model=32, n_heads=2, n_layers=layers, max_seq_len=256, **tech))
        est = estimate(cfg, device_type="cpu").offload
    else:
        transformers = pytest.importorskip("transformers")
        root = tmp_path_factory.getbasetemp() / f"gpt2-offload-{layers}"
        if not root.exists():
            transformers.GPT2Config(**{**_GPT2, "n_layer": layers}).save_pretrained(root)
        cfg = build_config({"model": str(root), **tech})
        est = analytic_estimate(cfg, "cpu").offload
    traced = trace_step(cfg, "cpu")
    assert est is not None and 0 < traced["offloaded_at_peak_bytes"] <= traced["offloaded_peak_bytes"]
    assert est["host_at_peak_bytes"] == traced["offloaded_at_peak_bytes"]
    assert est["host_peak_bytes"] == traced["offloaded_peak_bytes"]


_LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              max_position_embeddings=256, vocab_size=128, bos_token_id=0, eos_token_id=0)


def _tiny_hf_config(family: str, layers: int, tmp_path_factory):
    """A tiny GPT-2 or Llama config.json folder of ``layers`` layers (made once per session)."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.getbasetemp() / f"{family}-offload-{layers}"
    if not root.exists():
        if family == "gpt2":
            transformers.GPT2Config(**{**_GPT2, "n_layer": layers}).save_pretrained(root)
        else:
            transformers.LlamaConfig(**{**_LLAMA, "num_hidden_layers": layers}).save_pretrained(root)
    return root


def _offload_estimate_and_trace(cfg):
    """The analytic estimate and the fake-tensor trace of ``cfg``'s step under offload, with the
    host bytes of both (at the device's peak, at the host's own peak) asserted equal."""
    # Imported here, as the other transformers tests of this file do: transformers loads with them.
    from memtrain.analysis.estimate.hf import analytic_estimate
    from memtrain.analysis.trace import trace_step

    est = analytic_estimate(cfg, "cpu")
    traced = trace_step(cfg, "cpu")
    assert est.offload is not None and traced["offloaded_at_peak_bytes"] > 0
    assert est.offload["host_at_peak_bytes"] == traced["offloaded_at_peak_bytes"]
    assert est.offload["host_peak_bytes"] == traced["offloaded_peak_bytes"]
    return est, traced


_MASK_CASES = [
    ("gpt2", 2, 4, 128, "full"), ("gpt2", 2, 1, 64, "full"), ("gpt2", 3, 4, 64, "full"), ("gpt2", 3, 1, 128, "full"),
    ("gpt2", 3, 1, 64, "every:2"), ("gpt2", 2, 4, 128, "none"),
    ("llama", 2, 4, 128, "full"), ("llama", 3, 1, 64, "full"), ("llama", 2, 4, 64, "none"), ("llama", 3, 4, 128, "none"),
]


@pytest.mark.parametrize("family, layers, batch, seq, checkpointing", _MASK_CASES)
def test_a_checkpointed_gpt2_layer_offloads_the_causal_mask_it_is_handed(family, layers, batch, seq, checkpointing,
                                                                       tmp_path_factory):
    """torch's non-reentrant checkpoint saves a layer's positional arguments through the
    saved-tensor hooks, its keyword arguments only by reference. GPT2Model hands GPT2Block its
    eager float causal mask (b, 1, s, s) positionally, so the offloader copies it to the host once
    (the first checkpointed layer; the later ones share the copy), brings it back for the last
    layer's recompute and keeps it on the device until the first layer's recompute has read it.
    The estimate kept the mask on the device and left it off the host: GPT-2, 2 layers at 4 x 128,
    201,728 B on the host at the peak for the traced 463,872 (603,136 B at most for 865,280).
    Llama-style models pass their mask by keyword: nothing of it moves."""
    root = _tiny_hf_config(family, layers, tmp_path_factory)
    cfg = build_config({"model": str(root), "batch_size": batch, "seq_len": seq, "device": "cpu",
                        "offload_activations": True, "checkpointing": checkpointing})
    assert cfg.technique.attention == "math"  # eager attention: GPT2Model builds the float mask
    est, traced = _offload_estimate_and_trace(cfg)
    assert est.offload["d2h_bytes_per_step"] == traced["offload"]["d2h_bytes"]
    # The device peak too: the mask leaves the device after the forward and comes back for the
    # recompute (GPT-2 at 1 x 64 tokens, full: +2.3% before, now within 0.01%).
    assert est.peak_bytes == pytest.approx(traced["peak_bytes"], rel=0.005)


@pytest.mark.parametrize("layers, seq", [(2, 64), (2, 128), (3, 64)])
def test_eager_attention_at_batch_1_frees_one_kv_heads_v_before_the_scores_backward(layers, seq, tmp_path_factory):
    """With one k/v head repeat_kv hands v on as a stride-0 view, which at batch 1 folds into
    bmm's batch dimension: the probabilities' matmul saves rope's v itself, and its backward (the
    first of the attention's) releases it, so the offloader's host copy is gone by the softmax's
    backward, the device peak of a tiny Llama without checkpointing. Counted in one storage with
    q and k, v stayed on the host to the scores' backward: 81,920 B at the peak for the traced
    77,824 at 64 tokens, 230,400 for 222,208 at 128, the device peak +0.7% over the trace."""
    root = _tiny_hf_config("llama", layers, tmp_path_factory)
    cfg = build_config({"model": str(root), "batch_size": 1, "seq_len": seq, "device": "cpu",
                        "offload_activations": True, "checkpointing": "none"})
    assert cfg.technique.attention == "math" and _LLAMA["num_key_value_heads"] == 1
    est, traced = _offload_estimate_and_trace(cfg)
    assert est.offload["d2h_bytes_per_step"] == traced["offload"]["d2h_bytes"]
    assert est.peak_bytes == pytest.approx(traced["peak_bytes"], rel=0.002)


@pytest.mark.parametrize("batch, seq", [(4, 128), (1, 64)])
def test_gpt2_under_lora_in_fp32_moves_and_holds_the_traced_bytes(batch, seq, tmp_path_factory):
    """GPT-2 under LoRA in float32. Its frozen position table saves no position ids (the lookup
    keeps them for the weight's gradient only); the estimate saved them, and from 128 tokens (the
    1 KiB floor) moved s x 8 bytes more each way than the offloader (1,024 B at 4 x 128). They are
    still GPT2Model.forward's local until it returns, so the device holds them through ln_f. And
    the CPU dropout's product saves its noise before the product exists, so the offloader's host
    copy of the noise is made first: at 1 x 64 the device peaks at the attention dropout's output,
    where the estimate had not copied the noise yet (324,608 B on the host for the traced 357,376)."""
    from memtrain.analysis.estimate.hf import analytic_estimate
    from memtrain.analysis.trace import trace_step

    root = _tiny_hf_config("gpt2", 2, tmp_path_factory)
    cfg = build_config({"model": str(root), "batch_size": batch, "seq_len": seq, "device": "cpu", "lora_rank": 4,
                        "offload_activations": True, "checkpointing": "none", "precision": "fp32"})
    est = analytic_estimate(cfg, "cpu")
    traced = trace_step(cfg, "cpu")
    assert est.offload is not None and traced["offloaded_at_peak_bytes"] > 0
    assert (est.offload["d2h_bytes_per_step"], est.offload["h2d_bytes_per_step"]) == (
        traced["offload"]["d2h_bytes"], traced["offload"]["h2d_bytes"])
    assert est.offload["host_peak_bytes"] == traced["offloaded_peak_bytes"]
    assert (est.peak_phase, est.offload["host_at_peak_bytes"]) == (traced["peak_phase"], traced["offloaded_at_peak_bytes"])
    assert est.peak_bytes == pytest.approx(traced["peak_bytes"], abs=64)


@pytest.mark.parametrize("family, checkpointing, precision", [("llama", "none", "fp32"), ("llama", "full", "fp32"),
                                                              ("gpt2", "none", "bf16")])
def test_lora_linears_sum_no_bias_gradient_and_hold_the_traced_host_bytes(family, checkpointing, precision,
                                                                       tmp_path_factory):
    """The engine's after-return bias-gradient sum (``Node.reduced_grads``) belongs to a Linear
    whose bias trains. Under LoRA peft freezes the base Linear, bias included, and its adapters
    have none, so the estimate models no such sum there (``linear_nodes.linear``: only a trainable
    base), and the host bytes at the device peak are the traced offloader's (2 layers at 4 x 64
    tokens; GPT-2's Conv1D biases under autocast, Llama's bias-free projections)."""
    root = _tiny_hf_config(family, 2, tmp_path_factory)
    cfg = build_config({"model": str(root), "batch_size": 4, "seq_len": 64, "device": "cpu", "lora_rank": 4,
                        "offload_activations": True, "checkpointing": checkpointing, "precision": precision})
    est, traced = _offload_estimate_and_trace(cfg)
