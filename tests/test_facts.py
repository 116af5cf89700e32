"""The technique facts and the GPU kinds each have one home that every other table derives from.

``memtrain.techniques.facts`` holds the technique facts (precision dtypes and matmul types,
optimizer state rules, low-bit blocks and size floor, the bf16-pure optimizers, checkpoint
policies and periods, memory categories); ``memtrain.devices.gpu_kinds`` the GPU kinds (names,
peak FLOP/s, memory, caching-allocator facts). Both load without torch. These tests fail when a
second copy of a fact reappears: a table that is not the registry's object, a behaviour that does
not follow the registry, or the literal of a fact in a module other than its home.
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

from memtrain.devices import gpu_kinds as K
from memtrain.techniques import facts as F

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "memtrain"
FACTS = "src/memtrain/techniques/facts.py"
KINDS = "src/memtrain/devices/gpu_kinds.py"


# ------------------------------------------------------------------------ no torch
def test_the_registries_load_without_torch():
    code = ("import sys\n"
            "import memtrain.techniques.facts, memtrain.devices.gpu_kinds, memtrain.devices.gpu_memory\n"
            "import memtrain.config.run, memtrain.devices.numerics\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------------ no second literal copy
def _code(path: Path) -> str:
    """The module's tokens without comments, joined by spaces (strings and docstrings kept)."""
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    toks = tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
    return " ".join(t.string for t in toks if t.type not in skip)


# (what, pattern, the one file allowed to hold it; None: no file spells it out)
_ONE_HOME = [
    ("memory categories", r'"parameters"\s*,\s*"gradients"\s*,\s*"optimizer"\s*,\s*"activations"\s*,\s*"temporaries"',
     FACTS),
    ("sqrt checkpoint period", r"round\s*\(\s*math\s*\.\s*sqrt\s*\(", FACTS),
    ("checkpoint kinds", r'"none"\s*,\s*"full"\s*,\s*"sqrt"', FACTS),
    ("low-bit size floor", r"[<>]=?\s*4096\b", None),
    ("low-bit blocks", r'"adamw-8bit"\s*:\s*256|"adamw-4bit"\s*:\s*128', None),
    ("bf16-pure optimizers", r'\(\s*"adamw"\s*,\s*"adamw-8bit"\s*,\s*"adamw-4bit"\s*\)', FACTS),
    ("AdamW kernels", r'"adamw"\s*,\s*"adamw-(?:foreach|fused)"\s*,\s*"adamw-(?:foreach|fused)"', None),
    ("optimizer state counts", r'"(?:adamw|sgd)"\s*:\s*[12]\s*[,}]', None),
    ("precision -> matmul type", r'"bf16-pure"\s*:\s*"bf16"|\(\s*"bf16"\s*,\s*"bf16-pure"\s*\)', None),
    ("precision choices", r'"fp32"\s*,\s*"tf32"\s*,\s*"bf16"\s*,\s*"fp16"', None),
    ("GPU peak FLOP/s", r"989\.4\s*\*", KINDS),
    ("GPU memory", r"85_017_493_504", KINDS),
    ("CUDA context", r"787_283_968", KINDS),
    ("PCIe 4.0 x16 pinned copies", r"\b25e9\b|\b25\s*\*\s*GBs\b", KINDS),
    ("caching-allocator sizes", r"\b(?:MIN_BLOCK|SMALL_SIZE|SMALL_BUFFER|LARGE_BUFFER|MIN_LARGE_ALLOC|ROUND_LARGE)\s*=", KINDS),
    ("GPU name patterns", r"\\\\?bh100\\\\?b", KINDS),
    ("allocator GPU keys", r'"rtx4090"\s*:', None),
]


@pytest.mark.parametrize("what,pattern,home", _ONE_HOME, ids=[w for w, _, _ in _ONE_HOME])
def test_a_fact_is_spelled_out_in_its_home_only(what, pattern, home):
    files = sorted(SRC.rglob("*.py")) + sorted((ROOT / "benchmarks").rglob("*.py"))
    found = sorted(str(p.relative_to(ROOT)) for p in files if re.search(pattern, _code(p)))
    assert found == ([home] if home else []), f"{what}: import it from {home or 'the registry'}, found in {found}"


# ------------------------------------------------------------------------ the tables that derive
def test_the_configuration_choices_are_the_registry_keys():
    from memtrain.config import run

    assert run.PRECISIONS == tuple(F.PRECISION_FACTS)
    assert run.OPTIMS == tuple(F.OPTIMIZER_STATE_RULES)
    assert run.parse_checkpointing is F.parse_checkpointing
    for kind in F.CHECKPOINT_KINDS:
        assert run.TechniqueConfig(checkpointing=kind).checkpointing == kind


def test_low_bit_and_bf16_pure_optimizers_come_from_the_registry():
    from memtrain.analysis import plan
    from memtrain.bench import device_rows
    from memtrain.techniques import optim

    assert optim.LOW_BIT_BLOCK is F.LOW_BIT_BLOCK and optim.LOW_BIT_MIN_NUMEL == F.LOW_BIT_MIN_NUMEL
    assert F.LOW_BIT_BLOCK == {n: r.block for n, r in F.OPTIMIZER_STATE_RULES.items() if r.qmap}
    assert optim.BF16_PURE_OPTIMS is F.BF16_PURE_OPTIMS
    assert set(device_rows.COMPILED_OPTIMS) == set(F.LOW_BIT_BLOCK)
    # plan's search pairs bf16-pure with exactly the registry's optimizers
    space = {"precision": ["bf16-pure"], "optim": list(F.OPTIMIZER_STATE_RULES)}
    assert {t["optim"] for t in plan._sets(space)} == set(F.BF16_PURE_OPTIMS)
    # and keeps the configured AdamW kernel's family on CPU
    assert set(F.ADAMW_KERNELS) == {"adamw", "adamw-foreach", "adamw-fused"}


@pytest.mark.parametrize("optim", list(F.LOW_BIT_BLOCK))
def test_the_estimate_quantizes_exactly_the_tensors_the_registry_says(optim):
    from memtrain.analysis.estimate.optimizer import predicted_optimizer_state
    from memtrain.analysis.estimate.params import ParamInfo

    block = F.LOW_BIT_BLOCK[optim]
    floor = F.LOW_BIT_MIN_NUMEL
    fp32 = 2 * 4 * (floor - block) + 4  # two fp32 states and a step: a tensor just under the floor

    def state(numel):
        return predicted_optimizer_state([ParamInfo("w", (numel,), True)], optim, 4.0)[0]

    assert state(floor - block) == fp32
    assert state(floor) < 2 * 4 * floor  # quantized at the floor
    assert state(floor + 2) == 2 * 4 * (floor + 2) + 4  # not a multiple of the block: fp32


def test_lazy_optimizer_state_counts_follow_the_state_rules():
    from memtrain.analysis.estimate.params import ParamInfo
    from memtrain.analysis.estimate.training import _lazy_optimizer_state

    params = [ParamInfo("a", (4, 4), True), ParamInfo("b", (4,), True)]
    pbytes = {"a": 64.0, "b": 16.0}
    for optim, rule in F.OPTIMIZER_STATE_RULES.items():
        got = _lazy_optimizer_state(params, pbytes, optim, 1, 123.0)
        if rule.quantized or rule.factored:
            assert got == [123.0], optim
        else:
            assert len(got) == rule.states * len(params), optim


@pytest.mark.parametrize("layers", [1, 2, 3, 5, 8, 12, 24, 80])
def test_the_sqrt_period_is_the_policys(layers):
    from memtrain.analysis.depth_trace import _period
    from memtrain.config.run import build_config

    k = F.checkpoint_policy("sqrt").period(layers)
    cfg = build_config({"checkpointing": "sqrt", "n_layers": layers})
    assert _period(cfg) == (k, f"every:{k}")
    cfg = build_config({"checkpointing": "every:3", "n_layers": layers})
    assert _period(cfg) == (3, "every:3")


def test_memory_categories_have_one_home():
    from memtrain.metrics import CATEGORIES
    from memtrain.report import tables

    assert CATEGORIES is F.MEMORY_CATEGORIES and tables.CATEGORIES is F.MEMORY_CATEGORIES


@pytest.mark.parametrize("precision", list(F.PRECISION_FACTS))
def test_each_precision_maps_to_its_matmul_type_everywhere(precision):
    import torch

    from conftest import fake_caps
    from memtrain.bench.device_rows import nearest_native
    from memtrain.devices import advice, gpus, numerics
    from memtrain.devices.probe import precision_is_native

    facts = F.PRECISION_FACTS[precision]
    half = F.half_matmul_type(precision)
    assert half == (facts.matmul_type if facts.matmul_type in ("bf16", "fp16") else None)
    h100 = gpus.PEAK_FLOPS["h100-sxm"]
    assert gpus.peak_flops(h100, precision) == h100.flops[facts.matmul_type]
    assert gpus.peak_flops(h100, getattr(torch, facts.autocast_dtype or facts.param_dtype)) == \
        h100.flops[F.DTYPE_MATMUL_TYPE[facts.autocast_dtype or facts.param_dtype]]
    no_bf16 = fake_caps(native_bf16=False, native_fp16=True, fp16_slowdown=0.5, bf16_slowdown=0.25)
    assert precision_is_native(precision, no_bf16) == (half != "bf16")
    assert nearest_native(precision, no_bf16) == ("fp16" if half == "bf16" else "fp32")
    assert advice._reference_rate(no_bf16, precision)[1] == (half or "fp32")
    assert (precision in numerics.STANDARD_PRECISIONS) == (facts.param_dtype == "float32")


# ------------------------------------------------------------------------ GPU kinds
def test_gpu_tables_are_views_of_the_kinds():
    from memtrain.devices import gpu_memory, gpus

    assert list(gpus.PEAK_FLOPS) == list(K.GPU_KINDS) == list(gpu_memory.GPU_MEMORY_BYTES)
    for key, kind in K.GPU_KINDS.items():
        spec = gpus.PEAK_FLOPS[key]
        assert (spec.name, dict(spec.flops), spec.mem_bandwidth) == (kind.name, dict(kind.flops), kind.mem_bandwidth)
        assert tuple(kind.flops) == F.MATMUL_TYPES
        assert gpu_memory.GPU_MEMORY_BYTES[key] == kind.memory_bytes
    assert gpus.DTYPES == F.MATMUL_TYPES


def test_every_kind_answers_to_its_key_and_its_display_name():
    pattern_keys = {key for _, key in K._PATTERNS}
    assert pattern_keys == set(K.GPU_KINDS)
    for key, kind in K.GPU_KINDS.items():
        assert K.gpu_table_key(key) == key and K.gpu_table_key(kind.name) == key, key


@pytest.mark.parametrize("alias", ["rtx4090", "rtx-4090", "RTX 4090", "NVIDIA GeForce RTX 4090", "4090"])
def test_rtx4090_spellings_are_one_kind_for_flops_memory_and_the_allocator(alias):
    from memtrain.analysis.allocator import replay
    from memtrain.devices.gpu_memory import gpu_memory
    from memtrain.devices.gpus import PEAK_FLOPS, lookup_gpu

    kind = K.GPU_KINDS["rtx-4090"]
    assert lookup_gpu(alias) is PEAK_FLOPS["rtx-4090"]
    assert gpu_memory(alias) is not None and gpu_memory(alias)[0] == kind.memory_bytes
    assert kind.allocator is not None
    assert replay([], alias).cuda_context == kind.allocator.cuda_context_bytes


@pytest.mark.parametrize("name, key", [("NVIDIA B200", "b200"), ("b200", "b200"), ("NVIDIA GB200", "gb200"),
                                       ("gb200", "gb200"), ("NVIDIA L40", "l40"), ("l40", "l40"), ("NVIDIA L40S", "l40s"),
                                       ("NVIDIA RTX A6000", "rtx-a6000"), ("rtx a6000", "rtx-a6000"), ("a6000", "rtx-a6000")])
def test_current_cards_answer_to_the_names_cuda_prints(name, key):
    """`--gpu b200` (and the name torch.cuda.get_device_name gives a B200, GB200, L40 or RTX A6000)
    was "no GPU kind memtrain knows" on flops, estimate, plan and maxbatch: each is now a kind."""
    assert K.gpu_table_key(name) == key and K.named_gpu_key(name) == key


@pytest.mark.parametrize("name", ["NVIDIA GeForce RTX 5090", "NVIDIA RTX 6000 Ada Generation",
                                  "NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "NVIDIA H20"])
def test_cards_without_a_sourced_dense_rate_are_no_kind_and_no_neighbour(name):
    """A card whose dense tensor rate was not found in a datasheet stays unknown; it must not be
    taken for a neighbour whose name it contains (the RTX 6000 Ada for the A6000, the H20 for the H200)."""
    assert K.gpu_table_key(name) is None


def test_blackwell_kinds_hold_the_briefs_dense_rates_and_the_default_context():
    """The table holds dense rates: the B200's FP8 is twice its BF16, which is twice its TF32 (the
    technical brief's sparse column doubles each); its CUDA context is the unmeasured default."""
    b200, gb200 = K.GPU_KINDS["b200"], K.GPU_KINDS["gb200"]
    assert (b200.flops["bf16"], b200.flops["tf32"], b200.flops["fp8"]) == (2250e12, 1100e12, 4500e12)
    assert (gb200.flops["bf16"], gb200.flops["tf32"], gb200.flops["fp8"]) == (2500e12, 1250e12, 5000e12)
    assert b200.memory_bytes == 180 * 2**30 and gb200.memory_bytes is None  # GB200: --budget
    for kind in (b200, gb200):
        assert kind.allocator is not None and not kind.allocator.context_measured
        assert kind.allocator.cuda_context_bytes == K.DEFAULT_ALLOCATOR.cuda_context_bytes


def test_the_allocator_model_reads_the_gpu_kinds():
    from memtrain.analysis import allocator

    labels = set()
    for key, kind in K.GPU_KINDS.items():
        facts = kind.allocator or K.DEFAULT_ALLOCATOR
        dm = allocator.replay([("alloc", 1, 1000.0)], key)
        assert (dm.gpu, dm.cuda_context, dm.cublas_workspace) == \
            (facts.label, facts.cuda_context_bytes, facts.cublas_workspace_bytes), key
        labels.add(dm.gpu)
    # the allocator's GPU keys are the registry's: no table of its own
    assert labels == {(k.allocator or K.DEFAULT_ALLOCATOR).label for k in K.GPU_KINDS.values()}
    assert allocator.replay([], None).gpu == allocator.replay([], "an unknown card").gpu == K.DEFAULT_ALLOCATOR.label
    own = [name for name, value in vars(allocator).items()
           if isinstance(value, dict) and set(value) & ({"h100", "a100", "rtx4090", "default"} | set(K.GPU_KINDS))]
    assert own == []


def test_hopper_cards_get_torchs_hopper_cublas_workspace():
    """torch's default cuBLAS workspace is 4096 KiB x 8 (32 MiB) on compute capability 9.x and
    :4096:2:16:8 (8.125 MiB) before it (CublasHandlePool.cpp); the H200 is an sm90 card, yet it
    took the default facts' pre-Hopper workspace, so a two-step replay on it placed a 4x smaller
    workspace (and the batches where a cached segment is split, docs/estimation.md)."""
    hopper, before = 4096 * 1024 * 8, 4096 * 1024 * 2 + 16 * 1024 * 8
    for name in ("h100", "NVIDIA H100 80GB HBM3", "h200", "NVIDIA H200", "h200-nvl", "NVIDIA H200 NVL",
                 "NVIDIA B200", "NVIDIA GB200"):
        assert K.allocator_facts(name).cublas_workspace_bytes == hopper, name
    for name in ("a100", "rtx-4090", "l4", "l40", "NVIDIA RTX A6000", "t4", "an unknown card", None):
        assert K.allocator_facts(name).cublas_workspace_bytes == before, name


def test_plan_cost_model_keys_are_the_registrys():
    from memtrain.analysis import step_time

    for profile in step_time.DEVICE_PROFILES.values():
        assert set(profile["flops"]) == set(F.PRECISION_FACTS)
    assert set(step_time.OPTIMIZER_TRAFFIC) == set(F.OPTIMIZER_STATE_RULES)


def test_model_names_have_one_list():
    from memtrain.config.presets import PRESETS
    from memtrain.models import source

    names = source.model_names()
    assert names == [*PRESETS, *source.bundled_names()]
    assert "llama3-8b" not in names and "llama-3-8b" in names
    keys = [source._name_key(n) for n in names]
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize("name", ["NVIDIA GeForce RTX 4090 D", "rtx 4090 d", "NVIDIA GeForce RTX 3090 Ti"])
def test_a_cut_down_or_faster_sibling_is_not_its_namesakes_kind(name):
    """The RTX 4090 D has fewer SMs than the 4090 and the 3090 Ti more than the 3090: their peak
    FLOP/s are not the table's, so no kind answers (MFU is not computed against a wrong peak)."""
    assert K.gpu_table_key(name) is None


@pytest.mark.parametrize("name,label", [("NVIDIA GeForce RTX 4090 D", "rtx4090"), ("H-200", "h200"),
                                        ("a-100 custom", "a100")])
def test_the_allocator_facts_take_a_loose_spelling_squashed(name, label):
    """A spelling no pattern resolves still gets its family's allocator facts: the name is matched
    with spaces and dashes squashed out."""
    assert K.allocator_facts(name).label == label


def test_the_h200_assumes_the_h100s_measured_context():
    """Same Hopper die and driver stack: the H200's context is the H100's measured figure, not the
    default 500 MiB guess (the measured flag stays the H100's own)."""
    h100, h200 = K.allocator_facts("h100"), K.allocator_facts("h200")
    assert h200.cuda_context_bytes == h100.cuda_context_bytes != K.DEFAULT_ALLOCATOR.cuda_context_bytes
    assert h100.context_measured and not h200.context_measured


def test_datasheet_figures_keep_their_units():
    """Bandwidth is decimal GB/s on every datasheet; an unmeasured memory is the datasheet's GB
    read as GiB (the module's docstring): a GiB bandwidth or a decimal memory is a unit mix-up."""
    for key, kind in K.GPU_KINDS.items():
        assert (kind.mem_bandwidth / 1e9).is_integer(), key
        if kind.memory_bytes is not None and not kind.memory_measured:
            assert kind.memory_bytes % (1 << 30) == 0, key
