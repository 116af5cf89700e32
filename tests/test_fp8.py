"""``--precision fp8``: torchao float8 training of the block Linears (CUDA, compute capability 8.9+).

On a CPU the run is refused with one line; the registry facts, the analytic memory rule, plan's
search space and the bench rows are checked here; the conversion and what it saves for backward
are checked on a real CPU step through torchao's emulated FP8 matmul (the same autograd function,
the same saved tensors; only the matmul kernel differs). The real FP8 step runs under ``gpu``.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from memtrain.config.run import ConfigError, build_config
from memtrain.devices import gpu_kinds as K
from memtrain.techniques import facts as F

TINY = {"d_model": 32, "n_heads": 2, "n_layers": 2, "d_ff": 64, "seq_len": 16, "batch_size": 2, "dropout": 0.0,
        "vocab_size": 256, "max_seq_len": 16}


def _cfg(precision: str, **extra):
    return build_config({**TINY, "precision": precision, **extra})


def _block_weight_elements(d: int, f: int, layers: int) -> int:
    """Weight elements of the block Linears of our GPT (qkv, proj, fc, fc_out), by hand."""
    return layers * (d * 3 * d + d * d + d * f + f * d)


# ------------------------------------------------------------------------ refused on CPU
def test_fp8_on_a_cpu_is_refused_with_one_error_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "memtrain", "train", "--precision", "fp8", "--d-model", "32",
                          "--n-heads", "2", "--n-layers", "2", "--d-ff", "64", "--seq-len", "16", "--batch-size", "2",
                          "--steps", "2", "--device", "cpu", "--out", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=300)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2, out.stderr
    assert len(lines) == 1 and lines[0].startswith("error: --precision fp8 needs a CUDA GPU with FP8 tensor cores")
    assert "this device is cpu: use --precision bf16" in lines[0]
    assert not (tmp_path / "run" / "result.json").exists()


def test_fp8_on_a_gpu_without_fp8_cores_names_its_capability(monkeypatch):
    from memtrain.techniques import fp8
    from memtrain.techniques.fp8 import check_fp8_device

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError, match=r"this GPU \(NVIDIA A100-SXM4-80GB\) is 8\.0: use --precision bf16"):
        check_fp8_device(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    required = []
    monkeypatch.setattr(fp8, "import_extra", required.append)  # torchao's import is not this test's subject
    check_fp8_device(torch.device("cuda"))  # H100: accepted, once torchao is there
    assert required == ["torchao"]


@pytest.mark.parametrize("extra", [{"lora_rank": 8}, {"lora_rank": 8, "qlora": True}])
def test_fp8_refuses_lora_and_qlora_at_parse(extra):
    with pytest.raises(ConfigError, match="--precision fp8 trains every weight.*use --precision bf16"):
        _cfg("fp8", **extra)


def test_fp8_refuses_deepspeed_before_asking_for_it():
    from memtrain.distributed.validation import check_distributed_run

    with pytest.raises(ConfigError, match="deepspeed-zero2 runs its own mixed precision.*--precision fp8"):
        check_distributed_run(_cfg("fp8", distributed="deepspeed-zero2"), torch.device("cpu"))


def test_estimate_and_trace_of_fp8_answer_on_cpu():
    from memtrain.analysis.trace import trace_step

    with pytest.raises(ConfigError, match="drop --trace"):
        trace_step(_cfg("fp8"), "cpu")


# ------------------------------------------------------------------------ registry
def test_fp8_facts_in_the_registry():
    f = F.precision_facts("fp8")
    assert (f.param_dtype, f.autocast_dtype, f.matmul_type) == ("float32", "bfloat16", "fp8")
    assert f.fp8 and f.linear_cast_dtype == "float8_e4m3fn" and f.min_capability == (8, 9)
    assert (f.param_bytes, f.compute_bytes) == (4, 2)  # FP32 master weights, BF16 autocast activations
    assert not any(F.precision_facts(p).fp8 for p in F.PRECISION_FACTS if p != "fp8")
    assert F.fp8_converts(32, 96) and not F.fp8_converts(40, 96) and not F.fp8_converts(32, 50257)
    assert F.matmul_type("fp8") == "fp8" and F.half_matmul_type("fp8") is None


def test_fp8_peaks_come_from_the_gpu_kinds():
    from memtrain.devices.gpus import PEAK_FLOPS, mfu, peak_flops

    assert K.GPU_KINDS["h100-sxm"].flops["fp8"] == pytest.approx(1978.9e12)
    assert K.GPU_KINDS["h200"].flops["fp8"] == pytest.approx(1978.9e12)
    # Exactly the Hopper, Ada and Blackwell kinds (compute capability 8.9+) have an FP8 rate, above their BF16 one.
    with_fp8 = {key for key, kind in K.GPU_KINDS.items() if kind.flops["fp8"] is not None}
    assert with_fp8 == {"h100-sxm", "h100-pcie", "h100-nvl", "h200", "h200-nvl", "l4", "l40s", "l40", "rtx-4090",
                        "b200", "gb200"}
    assert all(K.GPU_KINDS[k].flops["fp8"] > K.GPU_KINDS[k].flops["bf16"] for k in with_fp8)
    assert [n for n in ("h100", "h200", "l4", "l40s", "rtx4090") if not K.has_fp8(n)] == []
    assert [n for n in ("a100", "v100", "t4", "rtx-3090", "a6000", "cpu", None, "unknown card") if K.has_fp8(n)] == []
    h100 = PEAK_FLOPS["h100-sxm"]
    assert peak_flops(h100, "fp8") == K.GPU_KINDS["h100-sxm"].flops["fp8"]
    assert mfu(1978.9e12, 2.0, h100, "fp8") == pytest.approx(0.5)
    assert mfu(1e12, 1.0, PEAK_FLOPS["a100-80gb-sxm"], "fp8") is None  # no FP8 cores: no MFU


# ------------------------------------------------------------------------ the memory rule
def test_fp8_estimate_keeps_bf16s_state_and_drops_the_weight_copies():
    from memtrain.analysis.estimate import estimate

    bf16, fp8 = (estimate(_cfg(p), device_type="cuda") for p in ("bf16", "fp8"))
    for part in ("weights", "gradients", "optimizer", "logits"):
        assert fp8.bytes[part] == bf16.bytes[part], part  # FP32 master weights, grads and AdamW state
    assert fp8.peak_phase == bf16.peak_phase
    # autocast saves a BF16 copy of each block Linear's weight for backward; Float8Linear saves
    # the FP32 weight itself: 2 bytes per block weight element fewer.
    assert bf16.bytes["activations"] - fp8.bytes["activations"] == 2 * _block_weight_elements(32, 64, 2)


def test_fp8_estimate_cast_temporaries_by_hand():
    from memtrain.analysis.estimate.linear_nodes import fp8_cast_bytes

    assert fp8_cast_bytes(100, 2) == 100 * (4 + 4 + 4 + 1)  # BF16 input: FP32 copy, scaled, clamped, FP8
    assert fp8_cast_bytes(100, 4) == 100 * (4 + 4 + 1)  # FP32 weight: no copy to FP32 first


def test_estimate_cli_gives_fp8_by_component():
    from memtrain.cli import main

    assert main(["estimate", "--precision", "fp8", "--gpu", "h100", "--json"]) == 0


# ------------------------------------------------------------------------ conversion, on a CPU
@pytest.fixture
def cpu_autocast_as_cuda(monkeypatch):
    """Float8Linear reads the CUDA autocast state (``torch.is_autocast_enabled()``); point it at the
    CPU's so an emulated CPU step casts and saves what a CUDA step does."""
    enabled, dtype = torch.is_autocast_enabled, torch.get_autocast_dtype
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda *a: enabled(*a) if a else enabled("cpu"))
    monkeypatch.setattr(torch, "get_autocast_gpu_dtype", lambda: dtype("cpu"))


def _saved_bytes_and_grads(model, idx, targets):
    """Bytes autograd saves for backward (parameters themselves not counted), the loss, the grads."""
    from torch.autograd.graph import saved_tensors_hooks

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(idx, targets)
    loss.backward()
    return sum(saved.values()), loss.item(), [p.grad.clone() for p in model.parameters()]


def test_fp8_converts_the_block_linears_and_saves_what_the_estimate_says(cpu_autocast_as_cuda):
    pytest.importorskip("torchao")
    from memtrain.models.gpt import GPT
    from memtrain.techniques.fp8 import apply_fp8

    cfg = _cfg("fp8", compile=True)
    torch.manual_seed(0)
    model = GPT(cfg.model)
    ref = copy.deepcopy(model)
    assert apply_fp8(model, cfg.technique, emulate=True) == 4 * cfg.model.n_layers
    kinds = {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert kinds.pop("lm_head") == "Linear"  # the tied LM head stays in BF16
    assert set(kinds.values()) == {"Float8Linear"} and len(kinds) == 4 * cfg.model.n_layers
    assert model.lm_head.weight is model.wte.weight  # still tied

    g = torch.Generator().manual_seed(0)
    idx, targets = (torch.randint(0, 256, (2, 16), generator=g) for _ in range(2))
    saved_bf16, loss_bf16, grads_bf16 = _saved_bytes_and_grads(ref, idx, targets)
    saved_fp8, loss_fp8, grads_fp8 = _saved_bytes_and_grads(model, idx, targets)
    assert saved_bf16 - saved_fp8 == 2 * _block_weight_elements(32, 64, 2)  # the estimate's rule, measured
    assert loss_fp8 != loss_bf16 and loss_fp8 == pytest.approx(loss_bf16, rel=0.01)
    cos = torch.nn.functional.cosine_similarity(torch.cat([g.flatten() for g in grads_fp8]),
                                                torch.cat([g.flatten() for g in grads_bf16]), dim=0)
    assert cos > 0.99


def test_fp8_without_a_convertible_linear_is_refused():
    pytest.importorskip("torchao")
    from memtrain.models.gpt import GPT
    from memtrain.techniques.fp8 import apply_fp8

    cfg = _cfg("fp8", d_model=40, compile=True)  # 40 and 120 do not divide by 16
    with pytest.raises(ConfigError, match="no Linear of this model has both dimensions divisible by 16"):
        apply_fp8(GPT(cfg.model), cfg.technique, emulate=True)
    assert apply_fp8(GPT(_cfg("bf16").model), _cfg("bf16").technique) == 0  # other precisions: untouched


def test_fp8_without_compile_warns():
    pytest.importorskip("torchao")
    from memtrain.models.gpt import GPT
    from memtrain.runtime.notices import SlowPrecisionWarning
    from memtrain.techniques.fp8 import apply_fp8

    cfg = _cfg("fp8")
    with pytest.warns(SlowPrecisionWarning, match="without --compile.*add --compile"):
        apply_fp8(GPT(cfg.model), cfg.technique, emulate=True)


# ------------------------------------------------------------------------ plan, bench, HF mapping
@pytest.mark.parametrize("device_type,gpu,has", [("cuda", "h100", True), ("cuda", "rtx4090", True),
                                                  ("cuda", "a100", False), ("cuda", None, False),
                                                  ("cpu", None, False)])
def test_plan_searches_fp8_only_for_fp8_gpus(device_type, gpu, has):
    from memtrain.analysis.plan import default_space

    assert ("fp8" in default_space(build_config(), device_type, gpu)["precision"]) is has
    assert "fp8" not in default_space(build_config({"lora_rank": 8}), device_type, gpu)["precision"]


def test_plan_costs_fp8_from_the_peak_ratio():
    from memtrain.analysis.step_time import DEVICE_PROFILES, FP8_PEAK_RATIO, step_cost

    assert FP8_PEAK_RATIO == pytest.approx(2.0, rel=0.001)
    assert DEVICE_PROFILES["cuda"]["flops"]["fp8"] == DEVICE_PROFILES["cuda"]["flops"]["bf16"] * FP8_PEAK_RATIO
    bf16 = step_cost(build_config({"precision": "bf16"}), "cuda")[0]
    fp8 = step_cost(build_config({"precision": "fp8"}), "cuda")[0]
    assert bf16 / 2 < fp8 < bf16  # only the block Linears run at the FP8 rate


def test_plan_recommends_fp8_compiled():
    from memtrain.analysis.plan import Candidate, candidate_config

    c = Candidate({"precision": "fp8", "attention": "sdpa", "checkpointing": "none", "loss": "standard",
                   "optim": "adamw"}, 8, 1, 1.0, "", 1.0)
    assert candidate_config(build_config(), c).technique.compile is True


def test_bench_fp8_row_is_left_out_of_the_default_list_without_fp8_cores():
    from conftest import fake_caps
    from memtrain.bench.device_rows import adapt_fp8_rows
    from memtrain.bench.technique_sets import default_techniques, technique_overrides

    assert "fp8" in default_techniques("cuda") and "fp8" not in default_techniques("cpu")
    assert technique_overrides("fp8", "quick") == {"precision": "fp8", "attention": "flash", "compile": True}
    rows = [("bf16", _cfg("bf16")), ("fp8", _cfg("fp8", compile=True))]
    a100 = fake_caps(device_type="cuda", name="NVIDIA A100", compute_capability=[8, 0])
    h100 = fake_caps(device_type="cuda", name="NVIDIA H100", compute_capability=[9, 0])
    kept, notes = adapt_fp8_rows(rows, a100, substitute=True)
    assert [n for n, _ in kept] == ["bf16"] and "NVIDIA A100 has no FP8 tensor cores" in notes[0]
    assert adapt_fp8_rows(rows, h100, substitute=True) == (rows, [])
    assert adapt_fp8_rows(rows, a100, substitute=False) == (rows, [])  # named rows run as asked
    assert [n for n, _ in adapt_fp8_rows(rows, None, substitute=True)[0]] == ["bf16"]


def test_hf_trainer_has_no_fp8_counterpart():
    from memtrain.bench.hf.mapping import hf_plan

    plan = hf_plan(_cfg("fp8", compile=True), "cpu")
    assert plan.status == "none" and any("--precision fp8" in m for m in plan.missing)
    assert "bf16" not in plan.training_args


# ------------------------------------------------------------------------ on an FP8 GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < F.FP8_MIN_CAPABILITY,
                    reason="needs a CUDA GPU with FP8 tensor cores")
def test_fp8_trains_compiled_on_an_fp8_gpu_close_to_bf16():
    pytest.importorskip("torchao", reason="--precision fp8 needs torchao's float8 training")
    from memtrain.config.run import TechniqueConfig, TrainConfig
    from memtrain.models.gpt import GPT
    from memtrain.techniques.optim import build_optimizer
    from memtrain.techniques.order import prepare_model
    from memtrain.techniques.precision import make_precision
    from memtrain.training.step import train_step

    dev = torch.device("cuda")
    cfgs = {p: build_config({"precision": p, "d_model": 256, "n_heads": 4, "n_layers": 2, "d_ff": 1024,
                             "seq_len": 128, "vocab_size": 512, "max_seq_len": 128, "dropout": 0.0,
                             "attention": "sdpa", "compile": True}) for p in ("bf16", "fp8")}
    # One batch of random tokens, six steps on it: the model memorises it, so a loss that trains falls
    # well below its start (in FP32 on a CPU: 6.28 -> 4.20). Six fresh random batches would not do:
    # their loss sits at the entropy of uniform tokens (ln 512 = 6.24) however well the model trains.
    g = torch.Generator().manual_seed(0)
    batch = tuple(torch.randint(0, 512, (8, 128), generator=g).to(dev) for _ in range(2))
    losses = {}
    for name, cfg in cfgs.items():
        prec = make_precision(name, dev)
        torch.manual_seed(0)
        model = prepare_model(GPT(cfg.model), cfg, dev, prec)
        assert (type(model.blocks[0].mlp.fc).__name__ == "Float8Linear") is (name == "fp8")
        opt = build_optimizer(model, TechniqueConfig(precision=name), TrainConfig(lr=1e-3, weight_decay=0.0))
        losses[name] = [train_step(model, [batch], opt, prec, 1.0, dev) for _ in range(6)]
    assert losses["fp8"][-1] < 0.9 * losses["fp8"][0]
    # The same weights at the first step: only the matmuls' precision differs. Later steps follow
    # trajectories that the rounding has moved apart a little.
    assert losses["fp8"][0] == pytest.approx(losses["bf16"][0], rel=0.02)
    for lf, lb in zip(losses["fp8"], losses["bf16"]):
        assert lf == pytest.approx(lb, rel=0.05)
