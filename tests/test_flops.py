"""Counted FLOPs, bytes per operation class, the roofline and `memtrain flops`."""

from __future__ import annotations

import json

import pytest
import torch

from memtrain.analysis.flops import (
    count_step,
    counted_flops_per_step,
    op_bytes,
)
from memtrain.analysis.flops.count import _counting_config, _trace
from memtrain.analysis.flops.profile import profile_op_classes
from memtrain.analysis.flops.roofline import flops_report, resolve_roof
from memtrain.cli import main
from memtrain.config.run import ConfigError, build_config

# A tiny model, with dropout on so the dropout class is exercised.
TINY = {"vocab_size": 512, "d_model": 64, "n_heads": 4, "n_layers": 4, "d_ff": 128, "max_seq_len": 128,
        "dropout": 0.1, "batch_size": 2, "seq_len": 64}


def _flags(d: dict) -> list[str]:
    return [x for k, v in d.items() for x in ("--" + k.replace("_", "-"), str(v))]


def _tiny(**kw) -> object:
    return build_config({**TINY, **kw})


# --------------------------------------------------------------------------- counts
def test_default_model_counted_matches_rule_within_2_percent():
    """ModelConfig() defaults (vocab 50257), seq 256, a small batch: the counted forward+backward
    and the whole counted step are within 2% of 6ND + attention."""
    cfg = build_config({"batch_size": 2, "seq_len": 256})
    c = counted_flops_per_step(cfg)
    assert c["model_flops"] == pytest.approx(c["rule"], rel=0.02)
    assert c["total"] == pytest.approx(c["rule"], rel=0.02)
    # Not a coincidence of rounding: the only difference is the biases and LayerNorm weights,
    # which the rule's 6N counts and whose work is element-wise (reconciliation leaves 0).
    rec = flops_report(cfg, "h100")["reconciliation"]
    assert rec["unexplained"] == 0
    assert rec["bias_and_norm_params"] < 0
    # Backward is exactly twice the forward for this model's matmuls.
    assert c["backward"] == 2 * c["forward"]


def test_a_named_preset_reconciles_to_zero_too():
    """`flops --model gpt2`: the reconciliation counts one block's biases and norms times the
    depth, as for an unnamed shape (the preset's name must not bring back its full depth)."""
    cfg = build_config({"model": "gpt2", "batch_size": 1, "seq_len": 128})
    rec = flops_report(cfg, "h100")["reconciliation"]
    assert rec["unexplained"] == 0


def test_fake_count_equals_a_real_step():
    """Counting under FakeTensorMode gives exactly what the same step does with real tensors,
    and what a bare FlopCounterMode counts on a real forward+backward."""
    from torch.utils.flop_counter import FlopCounterMode

    from memtrain.models.gpt import GPT

    cfg = _counting_config(_tiny())
    fake, fake_total, *_ = _trace(cfg, fake=True)
    real, real_total, *_ = _trace(cfg, fake=False)
    assert fake_total == real_total > 0
    for phase in ("forward", "backward"):
        assert set(fake[phase]) == set(real[phase])
        for name, c in fake[phase].items():
            r = real[phase][name]
            assert (c.counted, c.elementwise, c.bytes) == (r.counted, r.elementwise, r.bytes), (phase, name)

    model = GPT(cfg.model)
    x = torch.randint(0, 512, (2, 64))
    with FlopCounterMode(display=False) as fc:
        model(x, x).backward()
    assert fc.get_total_flops() == real_total


def test_flops_are_exactly_linear_in_batch_and_accumulation():
    """Counted (matmul) FLOPs are linear in the batch; element-wise FLOPs and bytes are affine
    (ops on weight-sized tensors, such as adding the tied weight's two gradients, do not grow
    with the batch). So a count at batch 1 cannot simply be scaled: count the real batch."""
    one, two, three = (counted_flops_per_step(_tiny(batch_size=b)) for b in (1, 2, 3))
    for key in ("forward", "backward"):
        assert two[key] == 2 * one[key]
        assert three[key] == 3 * one[key]
    assert three["elementwise"] - two["elementwise"] == two["elementwise"] - one["elementwise"]
    assert two["elementwise"] != 2 * one["elementwise"]
    assert one["optimizer"] == two["optimizer"]  # the update does not scale with tokens
    accum = counted_flops_per_step(_tiny(batch_size=1, grad_accum=2))
    assert accum["forward"] == two["forward"] and accum["optimizer"] == one["optimizer"]


def test_an_accumulated_step_counts_every_micro_batch_and_its_tokens():
    """Two micro-batches of 1 are the work and the tokens of one batch of 2: the step's tokens
    (MFU's and tokens/s's denominator), the 6N rule and the counter's own total all count both."""
    accum, two = count_step(_tiny(batch_size=1, grad_accum=2)), count_step(_tiny(batch_size=2))
    assert accum.tokens == two.tokens == 2 * TINY["seq_len"]
    assert accum.rule_flops == two.rule_flops
    assert accum.counter_flops == two.counter_flops > 0


@pytest.mark.parametrize(("optim", "per_param", "states"), [("adamw", 14, 2), ("sgd", 6, 1)])
def test_the_update_and_clipping_cost_their_documented_flops_and_bytes(optim, per_param, states):
    """The optimizer phase: the update's FLOPs per trainable parameter (AdamW 14, SGD 6), plus 3
    when --grad-clip is on (square-accumulate and scale); bytes: the weight and gradient read,
    the weight written, each FP32 state tensor read and written, and the gradients read twice
    and written once for clipping."""
    def update(clip: float):
        s = count_step(_tiny(optim=optim, grad_clip=clip))
        return s.table["optimizer"]["optimizer"], s.trainable_params

    (plain, n), (clipped, _) = update(0.0), update(1.0)
    assert plain.elementwise == per_param * n and clipped.elementwise == (per_param + 3) * n
    assert plain.bytes == (3 * 4 + 2 * states * 4) * n and clipped.bytes == plain.bytes + 3 * 4 * n


def test_elementwise_ops_get_their_documented_constants():
    """FlopCounterMode counts 0 for softmax/LayerNorm/GELU; the analytic constants fill in."""
    s = count_step(_tiny(dropout=0.0))
    fwd = s.table["forward"]
    b, t, h, d, ff, layers = 2, 64, 4, 64, 128, 4
    assert fwd["softmax"].counted == 0
    assert fwd["softmax"].elementwise == 5 * b * h * t * t * layers
    assert fwd["gelu"].elementwise == 9 * b * t * ff * layers
    assert fwd["layernorm"].elementwise == 7 * b * t * d * (2 * layers + 1)
    assert "dropout" not in fwd  # p = 0: no dropout kernel runs


def test_op_bytes_counts_inputs_and_outputs_once():
    a, b = torch.zeros(4, 8), torch.zeros(8, 16)
    out = a @ b
    assert op_bytes(torch.ops.aten.mm.default, (a, b), {}, out) == (32 + 128 + 64) * 4
    # A view moves nothing; an in-place op reads and writes its argument.
    assert op_bytes(torch.ops.aten.view.default, (a, [32]), {}, a.view(32)) == 0
    assert op_bytes(torch.ops.aten.add_.Tensor, (a, a), {}, a) == 3 * 32 * 4
    # A broadcast operand is read once, not once per use.
    bias = torch.zeros(16).expand(4, 16)
    assert op_bytes(torch.ops.aten.relu.default, (bias,), {}, torch.zeros(4, 16)) == (16 + 64) * 4
    # An embedding lookup reads only the rows it returns.
    table, idx = torch.zeros(1000, 8), torch.zeros(3, dtype=torch.long)
    assert op_bytes(torch.ops.aten.embedding.default, (table, idx), {}, torch.zeros(3, 8)) == 3 * 8 + 2 * 3 * 8 * 4


def test_checkpointing_full_adds_one_forward_of_the_blocks():
    try:
        full = count_step(_tiny(checkpointing="full"))
    except ConfigError as exc:  # pragma: no cover - while the technique is not wired
        pytest.skip(f"activation checkpointing not available: {exc}")
    plain = count_step(_tiny())
    fwd = plain.table["forward"]
    blocks_forward = sum(c.counted for name, c in fwd.items() if name not in ("lm_head", "embedding", "loss"))
    assert full.phase_total("recompute", "counted") == blocks_forward > 0
    assert full.phase_total("backward", "counted") == plain.phase_total("backward", "counted")
    assert full.phase_total("forward", "counted") == plain.phase_total("forward", "counted")
    for name in ("qkv", "mlp_fc", "attn_scores"):
        assert full.table["recompute"][name].counted == fwd[name].counted
    assert "lm_head" not in full.table["recompute"]
    # every:2 recomputes half the blocks; selective-matmul saves the matmuls and recomputes
    # only element-wise work; selective (Megatron's) recomputes the attention core.
    half = count_step(_tiny(checkpointing="every:2"))
    assert half.phase_total("recompute", "counted") == blocks_forward / 2
    sel = count_step(_tiny(checkpointing="selective-matmul"))
    assert sel.phase_total("recompute", "counted") == 0
    assert sel.phase_total("recompute", "elementwise") > 0
    core = count_step(_tiny(checkpointing="selective"))
    assert set(core.table["recompute"]) <= {"attn_scores", "softmax", "dropout", "other"}
    # The recompute stops once the saved tensors are back: q k^T reruns, probs @ v does not.
    assert core.phase_total("recompute", "counted") == fwd["attn_scores"].counted > 0
    assert core.phase_total("backward", "counted") == plain.phase_total("backward", "counted")


def test_chunked_loss_counts_the_same_lm_head_work():
    """The chunked loss computes the LM-head gradients during the forward pass, one with an
    in-place addmm_ that FlopCounterMode has no formula for: the count must still match."""
    try:
        chunked = count_step(_tiny(loss="chunked", loss_chunk=32))
    except ConfigError as exc:  # pragma: no cover - while the technique is not wired
        pytest.skip(f"chunked loss not available: {exc}")
    plain = count_step(_tiny())
    fb = lambda s: s.phase_total("forward", "counted") + s.phase_total("backward", "counted")  # noqa: E731
    assert fb(chunked) == fb(plain)
    lm = lambda s: sum(s.table[p]["lm_head"].counted for p in ("forward", "backward") if "lm_head" in s.table[p])  # noqa: E731
    assert lm(chunked) == lm(plain) > 0
    assert chunked.phase_total("forward", "counted") > plain.phase_total("forward", "counted")


# --------------------------------------------------------------------------- roofline
def test_roofline_verdicts_for_the_default_model():
    report = flops_report(build_config({"batch_size": 2}), "h100")
    ops = {o["name"]: o for o in report["ops"]}
    ridge = report["ridge"]
    assert report["gpu"]["key"] == "h100-sxm"
    assert ridge == pytest.approx(66.9e12 / 3.35e12)
    assert ops["lm_head"]["intensity"] > ridge and ops["lm_head"]["bound"] == "compute"
    for name in ("layernorm", "gelu", "softmax", "loss"):
        assert ops[name]["intensity"] < ridge / 10 and ops[name]["bound"] == "memory"
    for o in report["ops"]:
        assert o["attainable_flops_per_s"] <= report["gpu"]["peak_flops"]
    assert sum(o["flops"] for o in report["ops"]) == pytest.approx(report["total_flops"])
    assert sum(o["est_time_share"] for o in report["ops"]) == pytest.approx(1.0)
    # In bf16 the ridge moves to ~295 FLOP/B and this small model's matmuls fall below it.
    bf16 = flops_report(build_config({"batch_size": 2, "precision": "bf16"}), "h100")
    assert bf16["ridge"] == pytest.approx(989.4e12 / 3.35e12)


def test_the_report_names_the_model_it_counted():
    """The first line (and the roofline plot's title) named every model "GPT d_model ...": a
    transformers model's report named memtrain's GPT."""
    from memtrain.commands.flops import render

    hf = render(flops_report(build_config({"model": "tiny-llama", "batch_size": 1, "seq_len": 16}), "h100"))
    assert hf.splitlines()[0].startswith("one training step: tiny-llama d_model 128, ") and "GPT" not in hf.splitlines()[0]
    ours = render(flops_report(build_config({"batch_size": 1, "seq_len": 16}), "h100"))
    assert ours.splitlines()[0].startswith("one training step: GPT d_model 256, ")


def test_the_fused_attention_term_is_printed_with_one_sign():
    """The term was printed after a fixed "+": a negative one (LoRA's fused attention backward
    was counted under the output projection) read "+-0.00 GFLOP". The kernel's backward is
    attention's now (tests/test_flop_inventory.py), so the term is the scores' recompute."""
    from memtrain.commands.flops import render

    cfg = build_config({**TINY, "n_layers": 1, "seq_len": 16, "dropout": 0.0, "attention": "flash", "lora_rank": 4})
    report = flops_report(cfg, "h100")
    term = report["reconciliation"]["fused_attention_backward_scores"]
    assert term > 0
    line = next(x for x in render(report).splitlines() if "fused attention kernel's backward" in x)
    assert line.endswith(f"which the rule leaves out: +{term / 1e9:.2f} GFLOP"), line
    from memtrain.commands.flops import _signed_g

    assert [_signed_g(x) for x in (-4e6, 0.0, 1.07e9, -4.29e9)] == ["+0.00", "+0.00", "+1.07", "-4.29"]


def test_unknown_gpu_is_a_config_error_listing_the_known_names(capsys):
    with pytest.raises(ConfigError, match="h100-sxm.*a100-80gb-sxm"):
        resolve_roof("b300", "fp32")
    with pytest.raises(SystemExit, match="2"):  # argparse's refusal, as every flag's (exit 2 from the command line)
        main(["flops", "--gpu", "b300", *_flags(TINY)])
    err = capsys.readouterr().err
    assert err.startswith("error: argument --gpu: 'b300' is no GPU kind memtrain knows") and "h100-sxm" in err
    assert err.count("\n") == 1


@pytest.mark.parametrize("verb", [["flops"], ["estimate"], ["plan", "--budget", "24GiB"], ["maxbatch"]])
@pytest.mark.parametrize("name", ["A100;rm", "my t4 card", "h100 $(reboot)", "rtx 4090 d", "a100\nrm"])
def test_every_verb_refuses_a_gpu_name_no_kind_answers_to(capsys, verb, name):
    """One rule on every verb: a --gpu NAME is a table key or a name made of GPU-name words.
    The device-name patterns search for a model anywhere, so "A100;rm" was an A100 (flops,
    estimate, plan) and "my t4 card" a T4; it is now one line listing the known names."""
    with pytest.raises(SystemExit, match="2"):
        main([*verb, "--gpu", name, *_flags(TINY)])
    err = capsys.readouterr().err
    assert err.startswith(f"error: argument --gpu: {name!r} is no GPU kind memtrain knows; choose one of h100-sxm"), err
    assert "for a card not listed" in err and err.count("\n") == 1


@pytest.mark.parametrize("name, key", [("NVIDIA A100-SXM4-80GB", "a100-80gb-sxm"), ("Tesla V100S-PCIE-32GB", "v100s-pcie"),
                                       ("NVIDIA GeForce RTX 4090", "rtx-4090"), ("NVIDIA H100 80GB HBM3", "h100-sxm"),
                                       ("a100-80gb", "a100-80gb-sxm"), ("rtx4090", "rtx-4090"), ("4090", "rtx-4090"),
                                       ("H100", "h100-sxm"), ("t4", "t4"), ("b200", "b200"), ("NVIDIA B200", "b200"),
                                       ("NVIDIA GB200", "gb200"), ("NVIDIA L40", "l40"), ("NVIDIA RTX A6000", "rtx-a6000")])
def test_gpu_names_as_cuda_prints_them_and_short_names_still_resolve(capsys, name, key):
    from memtrain.devices.gpu_kinds import named_gpu_key

    assert named_gpu_key(name) == key
    assert main(["flops", "--json", "--gpu", name, *_flags(TINY)]) == 0
    assert json.loads(capsys.readouterr().out)["gpu"]["key"] == key


@pytest.mark.parametrize("verb", [["estimate"], ["maxbatch"], ["plan"]])
def test_every_verb_takes_a_b200_by_the_name_cuda_prints(capsys, verb):
    """`--gpu b200` was "no GPU kind memtrain knows" on every verb; its memory is now the budget."""
    assert main([*verb, "--gpu", "NVIDIA B200", *_flags(TINY)]) == 0


def test_a_gb200_has_no_single_memory_figure_so_plan_asks_for_a_budget(capsys):
    """The GB200's per-GPU memory differs between its systems: no figure in the table, one line."""
    assert main(["plan", "--gpu", "gb200", *_flags(TINY)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --gpu gb200: its memory is not in the GPU table; add --memory-budget SIZE"]
    assert main(["plan", "--gpu", "gb200", "--memory-budget", "180GiB", *_flags(TINY)]) == 0


def test_no_bf16_tensor_cores_is_a_config_error():
    with pytest.raises(ConfigError, match="--precision fp32, tf32, fp16 "):
        resolve_roof("t4", "bf16")


def test_a_card_without_fp8_tensor_cores_offers_the_precisions_it_runs():
    """An A100 asked for fp8 was offered "fp16 or fp32" only, though BF16 is what it runs best."""
    with pytest.raises(ConfigError, match=r"a100\S* has no FP8 tensor cores for --precision fp8; choose one of "
                                          r"--precision fp32, tf32, bf16, fp16, bf16-pure"):
        resolve_roof("a100", "fp8")


# --------------------------------------------------------------------------- command
def test_json_report_has_the_contract_keys(capsys):
    assert main(["flops", "--json", "--gpu", "h100", *_flags(TINY)]) == 0
    report = json.loads(capsys.readouterr().out)
    for key in ("total_flops", "rule_flops", "ops", "phases", "gpu", "ridge", "counter_flops", "reconciliation"):
        assert key in report
    assert {"forward", "backward", "recompute", "optimizer"} <= set(report["phases"])
    names = [o["name"] for o in report["ops"]]
    for name in ("qkv", "attn_proj", "mlp_fc", "mlp_fc_out", "attn_scores", "attn_values", "softmax",
                 "layernorm", "gelu", "dropout", "embedding", "lm_head", "loss", "optimizer"):
        assert name in names
    for o in report["ops"]:
        assert {"name", "flops", "bytes", "intensity", "bound"} <= set(o)
        assert o["bound"] in ("compute", "memory")
    assert report["total_flops"] > report["counter_flops"] > 0


def test_table_output_and_plot(tmp_path, capsys):
    png = tmp_path / "roof.png"
    assert main(["flops", "--gpu", "a100-80gb-sxm", "--plot", str(png), *_flags(TINY)]) == 0
    out = capsys.readouterr().out
    assert "rule of thumb 6ND + attention" in out and "LM head" in out and "A100 80GB SXM" in out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_a_plot_path_that_cannot_be_written_is_refused_before_counting(tmp_path, capsys, monkeypatch):
    """--plot in a folder that cannot be made (/proc), or naming a folder, failed only after the
    count (or a --profile run) with exit 1 and the OSError's words; now exit 2 up front, one line
    naming --plot, and nothing is counted."""
    import memtrain.commands.flops as flops_command

    counted = []
    monkeypatch.setattr(flops_command, "flops_report", lambda *a, **k: counted.append(1) or {})
    (tmp_path / "dir.png").mkdir()
    for plot, words in [("/proc/memtrain-roof.png", "--plot (its folder) '/proc' is not writable"),
                        (str(tmp_path / "dir.png"), "is a folder")]:
        assert main(["flops", "--plot", plot, *_flags(TINY)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err and words in err, err
    assert counted == []


def test_plot_must_be_png():
    assert main(["flops", "--plot", "roof.jpg", *_flags(TINY)]) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_profile_without_cuda_says_it_needs_a_gpu(capsys):
    assert main(["flops", "--profile", *_flags(TINY)]) == 2
    assert "CUDA GPU" in capsys.readouterr().err


def test_profile_attributes_time_to_classes_on_cpu():
    """The profiler path works on any device; on CPU it proves the attribution (times are CPU
    times, which the command does not place on a GPU roof)."""
    seconds = profile_op_classes(_tiny(device="cpu", grad_clip=1.0), steps=1, warmup=0)
    for name in ("qkv", "mlp_fc", "mlp_fc_out", "attn_proj", "attn_scores", "attn_values", "softmax",
                 "layernorm", "lm_head", "loss", "optimizer"):
        assert seconds.get(name, 0) > 0, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_profile_places_measured_points_on_gpu(tmp_path, capsys):
    png = tmp_path / "measured.png"
    assert main(["flops", "--profile", "--profile-steps", "2", "--json", "--plot", str(png), *_flags(TINY)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["measured"]["step_time_s"] > 0
    lm = next(o for o in report["ops"] if o["name"] == "lm_head")
    assert lm["measured_time_s"] > 0 and lm["achieved_flops_per_s"] > 0
    assert png.stat().st_size > 20_000


def test_a_mixture_of_experts_step_counts_its_experts(tmp_path):
    """A mixture-of-experts layer (Mixtral) runs its experts through torch's grouped_mm, for
    which torch 2.13's FLOP counter has no formula and its fake kernel takes bf16 only: `flops`
    failed with exit 1 in float32 and, in bf16, counted the step without its experts. The count
    now holds them: each token meets top-k experts of 3 x hidden x intermediate weights, 6 FLOPs
    per weight and token over forward and backward, and the fake count equals a real step's."""
    transformers = pytest.importorskip("transformers")
    hidden, inter, layers, tokens = 32, 64, 2, 2 * 16
    totals = {}
    for top_k in (1, 2):
        d = tmp_path / f"top{top_k}"
        transformers.MixtralConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=384,
                                   max_position_embeddings=64, num_local_experts=4,
                                   num_experts_per_tok=top_k).save_pretrained(d)
        cfg = _counting_config(build_config({"model": str(d), "seq_len": 16, "batch_size": 2}))
        _, totals[top_k], *_ = _trace(cfg, fake=True)
        if top_k == 2:
            assert _trace(cfg, fake=False)[1] == totals[top_k]
    assert totals[2] - totals[1] == 6 * tokens * 3 * hidden * inter * layers


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_lora_on_a_mixture_of_experts_model_counts_the_expert_adapters_as_peft_runs_them(tmp_path, capsys, family):
    """peft's all-linear on Mixtral and Qwen3-MoE adapts the attention Linears and, through ParamWrapper, the
    router and the stacked expert tensors, which it re-registers in every forward: under the
    count's fake tensors that failed (an AssertionError about aten.set_), then was refused in one
    line (exit 2) and train fell back to the 6ND rule. The count now runs, fake equals real, and
    it equals what torch's FlopCounterMode counts on a plain transformers + peft step of the same
    model and batch (with the formulas torch 2.13 lacks on CPU: grouped_mm, CPU flash attention),
    adapter parameters included."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from torch.utils.flop_counter import FlopCounterMode

    from memtrain.analysis.flops import counted_flops_per_step
    from memtrain.analysis.flops.count import _extra_flop_formulas

    d = tmp_path / family
    shape = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=384,
                 max_position_embeddings=64, num_experts_per_tok=2)
    moe = (transformers.MixtralConfig(intermediate_size=64, num_local_experts=4, **shape) if family == "mixtral" else
           transformers.Qwen3MoeConfig(moe_intermediate_size=16, num_experts=4, head_dim=8, **shape))
    moe.save_pretrained(d)
    flags = ["--model", str(d), "--seq-len", "16", "--batch-size", "2", "--lora-rank", "2"]
    assert main(["flops", "--json", *flags]) == 0
    assert json.loads(capsys.readouterr().out)["total_flops"] > 0
    # SDPA, as transformers builds the model (and as the command line defaults a --model to)
    cfg = _counting_config(build_config({"model": str(d), "seq_len": 16, "batch_size": 2, "lora_rank": 2,
                                         "attention": "sdpa"}))
    _, fake_total, _, trainable, _ = _trace(cfg, fake=True)
    assert _trace(cfg, fake=False)[1] == fake_total

    torch.manual_seed(0)
    plain = peft.get_peft_model(transformers.AutoModelForCausalLM.from_config(moe),
                                peft.LoraConfig(r=2, target_modules="all-linear", lora_dropout=0.0))
    wrapped = {n.rsplit(".", 1)[-1] for n, m in plain.named_modules() if type(m).__name__ == "ParamWrapper"}
    assert {"experts", "gate"} <= wrapped  # peft adapts the experts and the router: the case counted here
    assert plain.get_nb_trainable_parameters()[0] == trainable
    x = torch.randint(0, 384, (2, 16))
    with FlopCounterMode(display=False, custom_mapping=_extra_flop_formulas()) as fc:
        plain(input_ids=x, labels=x).loss.backward()
    assert fc.get_total_flops() == fake_total
    assert counted_flops_per_step(build_config({"model": str(d), "seq_len": 16, "batch_size": 2,
                                                "lora_rank": 2}))["model_flops"] > 0


def test_the_rule_of_a_mixture_of_experts_model_counts_the_experts_a_token_meets(tmp_path):
    """The 6ND rule counted every expert of a mixture-of-experts layer, though a token meets
    top-k of them (memtrain flops on a Mixtral of hidden 64, 2 layers, 4 experts, top-2: rule 107,274,240
    FLOPs against 60,489,728 counted), and a LoRA run (whose MFU falls back to the rule)
    reported that. The rule drops the (E - k) / E
    experts a token does not meet, and the reconciliation with the count is exact."""
    transformers = pytest.importorskip("transformers")
    from memtrain.analysis.flops.rules import model_rule_params
    from memtrain.models import build_model

    d = tmp_path / "mixtral"
    transformers.MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=384, max_position_embeddings=64,
                               num_local_experts=4, num_experts_per_tok=1).save_pretrained(d)
    cfg = build_config({"model": str(d), "seq_len": 16, "batch_size": 2})
    experts = 2 * 4 * (2 * 64 * 32 + 32 * 64)  # layers x experts x (gate_up + down)
    assert model_rule_params(build_model(cfg, with_weights=False)).inactive_experts == experts * 3 // 4
    report = flops_report(cfg, "h100")
    assert report["rule"]["inactive_expert_params"] == experts * 3 // 4
    assert report["reconciliation"]["unexplained"] == 0
