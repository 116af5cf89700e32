"""The GPU measurements memtrain still owes, as a few long commands for a lent GPU machine.

A session that is lent a GPU has about 15 minutes of device time, at most 10 minutes per
command, and gets back at most 8 files per command. This script turns the open GPU checks into
six *parts*, each one device command of under 10 minutes, run in priority order:

    hf      memtrain vs HF Trainer (+ peft) on Llama-3-8B LoRA (with and without checkpointing),
            Qwen2.5-0.5B full fine-tune (standard loss, chunked loss, checkpointing) and the seed GPT
            (flash + BF16, compiled, chunked), via benchmarks/compare_hf.py
    build   a profile of both LoRA steps (8-layer Llama-3-8B shape), the LoRA optimizer step
            (benchmarks/lora_optimizer_step.py), building Llama-3-8B before its
            first step (setup_time_s.model), the compiled seed step's data wait and first step, with
            and without the chunked loss, QLoRA against the Trainer (bitsandbytes on both sides)
    seed    `memtrain bench --scale seed`: every default row on CUDA (the compiled rows too)
    checks  `pytest -m gpu` and the allocator model on the seed and transformers rows
            (benchmarks/allocator_check.py --rows all)
    profile where the compiled seed step's time goes with the standard and the chunked loss
            (benchmarks/loss_profile.py: step times, host vs device time, top operators), the
            library loss kernels (Cut Cross-Entropy, Liger) beside memtrain's on the seed GPT and
            Qwen2.5-0.5B, and the compiled seed step with --sync-steps, beside build's overlapped one;
            optional (dropped first when the part runs late): the compiled seed step under --loss-on
            completion beside --loss-on all (benchmarks/loss_on_step.py), and the chunked loss's
            float32-epilogue addmm beside its default accumulation on the seed GPT and Qwen2.5-0.5B
    inference  `estimate --mode inference` against a measured generate on CUDA kernels, and
            `--gpu`'s fit figure against the device's used memory (benchmarks/generate_check.py)

``--part picked --only A,B,...`` runs the named steps of any parts, in that order: a session with
a few minutes of device time puts the checks it owes most first in one command.

Each step writes into a work folder outside ``--out`` (one log and one result folder per step);
after every step the whole work folder is packed into ``OUT/PART.tar.gz`` and ``OUT/PART.md``
(each step's command, exit code, wall time and headline figures) is rewritten, so a part cut
off by its time limit still returns everything it finished, in two files. A step is skipped,
and says so, when its time estimate no longer fits before ``--deadline``; an *optional* step also
when it would leave too little time for the required steps after it (it yields to them).

On the GPU machine (wheels of the packages its image lacks: benchmarks/gpu_wheels.sh, carried
as ``.whl``):

    python3 benchmarks/gpu_runbook.py --part hf --wheels .whl --commit $(git rev-parse --short HEAD) --out $OUT

``--commit`` names the commit the working tree was sent at; the machine's copy of the git
metadata can be stale, so the steps run with git hidden and that commit in ``MEMTRAIN_COMMIT``.

On a CPU, ``--smoke`` runs every step at toy size (tiny-llama for the transformers models, the
quick scale, a few steps; CUDA-only scripts show their --help), to prove that the commands
still match the command lines before device time is spent on them:

    python benchmarks/gpu_runbook.py --part hf --smoke --out /tmp/runbook
    python benchmarks/gpu_runbook.py --list
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
# One device command may run 600 s. The deadline counts from the command's start, installing the
# wheels included; the last 40 s are for a step stopped at the deadline and the packing.
DEFAULT_DEADLINE_S = 560.0


@dataclass(frozen=True)
class Sizes:
    """What differs between the real run on a GPU and the CPU smoke run of the same steps."""

    big_model: str
    mid_model: str
    long_seq: int
    mid_seq: int
    mid_batch: int
    hf_steps: int
    gpt_scale: str
    gpt_steps: int
    seed_batch: int
    seed_seq: int
    seed_steps: int
    compile: bool
    attention: str  # the seed rows' kernel: flash on a GPU; the CPU's flash kernel takes no dropout
    device: str


FULL = Sizes(big_model="llama-3-8b", mid_model="qwen2.5-0.5b", long_seq=2048, mid_seq=1024, mid_batch=4,
             hf_steps=14, gpt_scale="seed", gpt_steps=60, seed_batch=64, seed_seq=256, seed_steps=200,
             compile=True, attention="flash", device="cuda")
SMOKE = Sizes(big_model="tiny-llama", mid_model="tiny-llama", long_seq=128, mid_seq=128, mid_batch=2,
              hf_steps=4, gpt_scale="quick", gpt_steps=4, seed_batch=2, seed_seq=64, seed_steps=3,
              compile=False, attention="sdpa", device="cpu")


@dataclass(frozen=True)
class Step:
    """One measurement: a command line (built for the sizes and the step's result folder)."""

    name: str
    part: str
    checks: str  # what the figure is held against (the open target it answers)
    est_s: float  # expected wall time on an H100, start-up included
    argv: Callable[[Sizes, Path], list[str]]
    # how its headline is read (:func:`headline`): train (result.json), compare (compare_hf.md),
    # markdown (the table of the .md it wrote), table (the table it printed), log (its last lines)
    kind: str
    # An optional step yields to the required steps after it: it runs only when the time left
    # covers its estimate and theirs (:func:`_time_needed`), so a part that runs late drops it
    # first. A part's required steps fit its deadline; its optional ones may not.
    optional: bool = False


def _compare(s: Sizes, out: Path, *args: str) -> list[str]:
    return [PY, str(ROOT / "benchmarks" / "compare_hf.py"), "--device", s.device, "--no-maxbatch",
            "--repeats", "1", "--timeout", "400", "--out", str(out), *args]


def _cut_model(name: str, layers: int, folder: Path) -> str:
    """A config.json of bundled model ``name`` with ``layers`` decoder layers (written into
    ``folder``): the 8-layer Llama-3-8B shape the LoRA gap was first measured on."""
    config = json.loads((ROOT / "src" / "memtrain" / "models" / "configs" / f"{name}.json").read_text())
    config["num_hidden_layers"] = layers
    path = folder / f"{name}-{layers}-layers.json"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=1))
    return str(path)


def _train(s: Sizes, out: Path, *args: str) -> list[str]:
    return [PY, "-m", "memtrain", "train", "--device", s.device, "--no-progress", "--out", str(out), *args]


# The 8B LoRA row as it was measured against the Trainer: BF16 base, rank 16 on every Linear.
LLAMA_LORA = "precision=bf16-pure+attention=sdpa+lora_rank=16"


def _loss_profile(s: Sizes, out: Path, variants: str) -> list[str]:
    """benchmarks/loss_profile.py on the seed GPT's batch, compiled on a GPU (a toy model on a CPU)."""
    return [PY, str(ROOT / "benchmarks" / "loss_profile.py"), "--device", s.device, "--batch-size", str(s.seed_batch),
            "--seq-len", str(s.seed_seq), "--out", str(out), "--variants", variants,
            *(["--compile"] if s.compile else ["--steps", "2", "--warmup", "1", "--d-model", "64"])]


def _qwen_loss_profile(s: Sizes, out: Path, variants: str) -> list[str]:
    """benchmarks/loss_profile.py on Qwen2.5-0.5B (batch 4 x 1024; tiny-llama on a CPU), fewer steps
    than the seed's: each compiled variant compiles the 24-layer model anew."""
    return [PY, str(ROOT / "benchmarks" / "loss_profile.py"), "--device", s.device, "--model", s.mid_model,
            "--batch-size", str(s.mid_batch), "--seq-len", str(s.mid_seq), "--out", str(out), "--variants", variants,
            *(["--compile", "--steps", "3", "--warmup", "2", "--timed", "8"] if s.compile
              else ["--steps", "1", "--warmup", "1", "--timed", "1"])]


def _loss_on_step(s: Sizes, out: Path) -> list[str]:
    """benchmarks/loss_on_step.py: --loss-on completion beside --loss-on all, the seed GPT's batch
    compiled on a GPU (a toy model on a CPU)."""
    toy = ["--d-model", "64", "--n-layers", "2", "--n-heads", "4", "--d-ff", "128", "--steps", "3"]
    return [PY, str(ROOT / "benchmarks" / "loss_on_step.py"), "--device", s.device, "--batch-size", str(s.seed_batch),
            "--seq-len", str(s.seed_seq), "--precision", "bf16", "--attention", s.attention, "--out", str(out),
            *(["--compile", "--steps", "20"] if s.compile else toy)]


def _seed_train(s: Sizes, *extra: str) -> list[str]:
    """The seed GPT at batch 64 x 256, BF16 + flash, compiled (on a GPU)."""
    flags = ["--batch-size", str(s.seed_batch), "--seq-len", str(s.seed_seq), "--steps", str(s.seed_steps),
             "--precision", "bf16", "--attention", s.attention, "--val-blocks", "4", *extra]
    return flags + (["--compile"] if s.compile else [])


STEPS: list[Step] = [
    # ---- hf: memtrain vs HF Trainer (+ peft), ratios from one run
    Step("hf-llama8b-lora", "hf",
         "LoRA step time <= HF Trainer + peft's (target 1.1x faster), with and without checkpointing; "
         "checkpointing's cost no higher than HF's", 260,
         lambda s, out: _compare(s, out, "--model", s.big_model, "--no-lockstep",  # two 8B models at once may not fit
                                 "--techniques", f"{LLAMA_LORA}+checkpointing=full,{LLAMA_LORA}",
                                 "--set", "batch_size=1", "--set", f"seq_len={s.long_seq}", "--set", "val_blocks=4",
                                 "--steps", str(s.hf_steps), "--warmup-steps", "2"),
         "compare"),
    Step("hf-qwen05-full", "hf",
         "full fine-tune step time <= HF Trainer's; chunked loss (memtrain's kernel) <= 1.05x the standard step",
         150,
         lambda s, out: _compare(s, out, "--model", s.mid_model, "--techniques",
                                 "precision=bf16+attention=sdpa,precision=bf16+attention=sdpa+loss=chunked,"
                                 "precision=bf16+attention=sdpa+checkpointing=full",
                                 "--set", f"batch_size={s.mid_batch}", "--set", f"seq_len={s.mid_seq}",
                                 "--set", "val_blocks=4", "--steps", str(s.hf_steps + 6), "--warmup-steps", "2"),
         "compare"),
    Step("hf-gpt-seed", "hf",
         "seed GPT batch 64 x 256: <= 6 ms and <= 1.5 GiB per step (stretch 4 ms, 40% MFU); chunked <= 1.05x",
         130,
         lambda s, out: _compare(s, out, "--scale", s.gpt_scale,
                                 "--techniques", "flash-bf16,chunked-loss" + (",compile" if s.compile else ""),
                                 "--steps", str(s.gpt_steps)),
         "compare"),
    # ---- build: where the LoRA step's time goes, setup times, the compiled seed step, QLoRA
    Step("hf-llama8b-profile", "build",
         "where memtrain's LoRA step loses to the Trainer's: per-phase times and top operators of both steps, "
         "8-layer Llama-3-8B shape, with and without checkpointing", 100,
         lambda s, out: _compare(s, out, "--model", _cut_model(s.big_model, 8 if s.device == "cuda" else 2, out),
                                 "--techniques", f"{LLAMA_LORA}+checkpointing=full,{LLAMA_LORA}",
                                 "--set", "batch_size=1", "--set", f"seq_len={s.long_seq}", "--profile", "12"),
         "markdown"),
    Step("hf-qwen05-ckpt-profile", "build",
         "checkpointing's cost no higher than HF's: where memtrain's checkpointed Qwen2.5-0.5B step spends the time "
         "the Trainer's does not (per-phase times and top operators of both steps, with and without checkpointing; "
         "profile.md's 'What checkpointing adds, per side': added phase times, the operators and kernels whose added "
         "calls differ between the sides (none on a CPU: tests/test_checkpointing_parity.py), the most added CUDA "
         "time; on an H200 memtrain's checkpointing added 94 ms, the Trainer's 83 ms); optional", 150,
         lambda s, out: _compare(s, out, "--model", s.mid_model, "--techniques",
                                 "precision=bf16+attention=sdpa+checkpointing=full,precision=bf16+attention=sdpa",
                                 "--set", f"batch_size={s.mid_batch}", "--set", f"seq_len={s.mid_seq}",
                                 "--set", "val_blocks=2", "--profile", "12"),
         "markdown", optional=True),
    Step("lora-optimizer", "build",
         "the bf16-pure LoRA optimizer step: torchao's per-tensor compiled AdamW vs memtrain's bucketed one vs "
         "flat buffers vs torch's fused FP32 AdamW, 112 adapter tensors (the 8-layer shape's)", 60,
         lambda s, out: [PY, str(ROOT / "benchmarks" / "lora_optimizer_step.py"), "--device", s.device,
                         "--tensors", "112" if s.device == "cuda" else "8", "--d", "4096" if s.device == "cuda" else "64",
                         "--rank", "16", "--steps", "20" if s.device == "cuda" else "3", "--out", str(out),
                         # one compiled call unrolled over 112 tensors compiles for minutes: left out
                         "--variants", "torchao,memtrain,torchao-flat,torch-fp32"],
         "table"),
    Step("build-llama8b", "build", "building Llama-3-8B before the first step <= 15 s (setup_time_s.model)", 90,
         lambda s, out: _train(s, out, "--model", s.big_model, "--lora-rank", "16", "--precision", "bf16-pure",
                               "--checkpointing", "full", "--attention", "sdpa", "--batch-size", "1",
                               "--seq-len", str(s.long_seq), "--steps", "6", "--val-blocks", "2"),
         "train"),
    Step("seed-compiled", "build", "data wait <= 2% of a compiled seed step (data_wait_share; the device's own idle "
         "time between steps: device_idle_share)", 70,
         lambda s, out: _train(s, out, *_seed_train(s)), "train"),
    Step("seed-compiled-chunked", "build",
         "--compile --loss chunked: first compiled step <= 60 s (setup_time_s.first_step); its step time beside "
         "seed-compiled's (the same flags but the loss): the fastest small row", 90,
         lambda s, out: _train(s, out, *_seed_train(s, "--loss", "chunked")), "train"),
    Step("hf-llama8b-qlora", "build",
         "QLoRA step time <= HF Trainer + peft's (bitsandbytes NF4 on both sides), 8-layer Llama-3-8B shape, "
         "checkpointing", 120,
         lambda s, out: _compare(s, out, "--model", _cut_model(s.big_model, 8 if s.device == "cuda" else 2, out),
                                 "--techniques", f"{LLAMA_LORA}+qlora=true+checkpointing=full",
                                 "--set", "batch_size=1", "--set", f"seq_len={s.long_seq}", "--set", "val_blocks=4",
                                 "--steps", str(s.hf_steps), "--warmup-steps", "2"),
         "compare"),
    # ---- seed: the default bench on CUDA
    Step("seed-bench", "seed", "every default row valid on CUDA (the windowed row's kernel named), compiled rows in",
         520,
         lambda s, out: [PY, "-m", "memtrain", "bench", "--device", s.device, "--scale", s.gpt_scale, "--no-progress",
                         "--out", str(out), "--row-timeout", "240",
                         *([] if s.compile else ["--steps", str(s.gpt_steps), "--no-maxbatch",
                                                 "--techniques", "baseline,window-flash"])],
         "markdown"),
    # ---- checks: GPU tests and the allocator model (reserved memory within 3%)
    Step("gpu-tests", "checks", "every GPU test passes or skips naming its package", 240,
         lambda s, out: [PY, "-m", "pytest", "-m", "gpu", "-o", "addopts=", "-q", "-p", "no:cacheprovider",
                         "--junitxml", str(out / "junit.xml"), *([] if s.device == "cuda" else ["--co"]),
                         str(ROOT / "tests")],
         "log"),
    Step("allocator", "checks", "max_memory_reserved estimated within 3% (seed rows, Llama-3-8B LoRA, Qwen2.5-0.5B; "
         "Cut Cross-Entropy's modelled buffers on the seed GPT and Qwen2.5-0.5B)",
         290,
         lambda s, out: [PY, str(ROOT / "benchmarks" / "allocator_check.py"), "--rows", "all", "--timeout", "150",
                         "--out", str(out)] + ([] if s.device == "cuda" else ["--help"]),
         "markdown"),
    # ---- profile: the chunked loss under --compile (3.1x the standard compiled step on an H100)
    Step("loss-profile", "profile",
         "--loss chunked <= 1.05x the standard step under --compile, seed GPT <= 6 ms and <= 1.5 GiB: where the "
         "time goes (steps timed without the profiler; host vs device time per step, kernels per step, top "
         "operators, peaks of profiled steps): the standard loss; chunks 256, 1024, 2048 and 4096 (aligned logits, "
         "one compiled call per chunk); chunk 1024 with each chunk's ops launched from Python; the standard loss "
         "and chunks 256, 1024 and 4096 under CUDA graphs (--compile-mode reduce-overhead: no launch cost); chunk "
         "1024 with the logits exactly 50257 wide (as before the aligned layout)",
         150,
         lambda s, out: _loss_profile(s, out, "standard,chunked-256,chunked-1024,chunked-2048,chunked-4096,"
                                      "chunked-1024-loop,standard-cudagraphs,chunked-256-cudagraphs,"
                                      "chunked-1024-cudagraphs,chunked-4096-cudagraphs,chunked-1024-unaligned"),
         "markdown"),
    Step("loss-kernels", "profile",
         "--loss chunked <= 1.05x the standard step, seed GPT <= 6 ms: the library kernels beside memtrain's, seed GPT "
         "compiled (steps timed without the profiler, top operators): Cut Cross-Entropy with and without its "
         "gradient filter, Liger's, memtrain's chunk 1024, the standard loss; CCE, memtrain's and the standard "
         "loss under CUDA graphs. Their numerics: pytest's CCE- and Liger-vs-standard GPU test",
         150,
         lambda s, out: _loss_profile(s, out, "standard,chunked-1024,cce,cce-filter,liger,standard-cudagraphs,"
                                      "chunked-1024-cudagraphs,cce-cudagraphs"),
         "markdown"),
    Step("qwen-loss-kernels", "profile",
         "--loss chunked <= 1.05x the standard step on Qwen2.5-0.5B (batch 4 x 1024, bf16, sdpa): memtrain's "
         "chunked loss and Cut Cross-Entropy's against the standard loss, one memtrain train each", 120,
         lambda s, out: ["bash", str(ROOT / "benchmarks" / "loss_kernel_ab.sh"),
                         *([str(out), "qwen-standard", "qwen-chunked", "qwen-cce"] if s.device == "cuda"
                           else ["--help"])],
         "table"),
    Step("loss-addmm", "profile",
         "the chunked loss's weight gradient added in the GEMM's float32 epilogue (MEMTRAIN_LOSS_FP32_ADDMM=1: "
         "8 V d bytes a chunk, no bf16 rounding) against the default bf16 product added into float32 (~12 V d), "
         "seed GPT batch 64 x 256: chunks 1024 and 256, compiled and eager, and the addmm inside the compiled "
         "chunk body (inductor splits it); decides whether it becomes the CUDA default; optional", 150,
         lambda s, out: _loss_profile(s, out, "chunked-1024,chunked-1024-addmm,chunked-1024-addmm-inductor,"
                                      "chunked-256,chunked-256-addmm,standard,chunked-1024-eager,"
                                      "chunked-1024-addmm-eager"),
         "markdown", optional=True),
    Step("qwen-loss-addmm", "profile",
         "the float32-epilogue addmm on Qwen2.5-0.5B's 151,936-token head (batch 4 x 1024, bf16, sdpa), where the "
         "weight gradient's traffic is largest: chunk 1024 with and without it, eager and compiled, beside the "
         "standard loss; optional", 240,
         lambda s, out: _qwen_loss_profile(s, out, "standard-eager,chunked-1024-eager,chunked-1024-addmm-eager,"
                                           "chunked-1024,chunked-1024-addmm"),
         "markdown", optional=True),
    Step("generate", "inference",
         "estimate --mode inference within 1% of generate's tracked peak on CUDA kernels (Qwen2.5-0.5B, Llama-3-8B, "
         "Mistral-7B's shape, a prompt past its 4096 window); max allocated / reserved and the device's used memory "
         "beside --gpu's fit figure, which claims to be a lower bound of it", 150,
         lambda s, out: [PY, str(ROOT / "benchmarks" / "generate_check.py"), "--out", str(out), "--device", s.device,
                         "--rows", "full" if s.device == "cuda" else "smoke"],
         "markdown"),
    Step("seed-compiled-synced", "profile",
         "what overlapping steps buys: build's seed-compiled with --sync-steps (every step waited for, the loss "
         "read at once, host-clock timing); its step time and data wait beside seed-compiled's", 70,
         lambda s, out: _train(s, out, *_seed_train(s, "--sync-steps")), "train"),
    Step("seed-loss-on", "profile",
         "what --loss-on completion costs a step: the compiled seed GPT (batch 64 x 256, BF16, flash), half of "
         "each block the answer, beside --loss-on all on the same ids in one run (benchmarks/loss_on_step.py: "
         "first and median step, max allocated); optional, dropped first when the part runs late", 100,
         lambda s, out: _loss_on_step(s, out), "table", optional=True),
]
PARTS = ["hf", "build", "seed", "checks", "profile", "inference"]
# --part picked: the steps --only names, from any part, in the order named (a session's own list
# of the checks it owes, in one device command).
PICKED = "picked"


# ============================================================================ headlines
def _json(path: Path) -> Optional[dict[str, Any]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _section(text: str, title: str) -> list[str]:
    """The lines of the markdown section ``title`` (up to the next heading of the same depth)."""
    lines = text.splitlines()
    out: list[str] = []
    inside = False
    for line in lines:
        if line.startswith("## "):
            inside = line[3:].strip().startswith(title)
            continue
        if inside and line.strip():
            out.append(line)
    return out


def headline(step: Step, out: Path, log: Path) -> list[str]:
    """The figures of a finished step that its target is read from (markdown lines)."""
    if step.kind == "train":
        r = _json(out / "result.json")
        if r is None:
            return ["no result.json"]
        st, mem, setup = r.get("step_time_s") or {}, r.get("memory") or {}, r.get("setup_time_s") or {}
        gib = lambda b: f"{b / 2**30:.2f} GiB" if isinstance(b, (int, float)) else "-"  # noqa: E731
        pct = lambda x: f"{x:.2%}" if isinstance(x, (int, float)) else "-"  # noqa: E731
        return [f"step median {st.get('median', float('nan')) * 1e3:.1f} ms; tokens/s {r.get('tokens_per_s') or 0:,.0f}; "
                f"MFU {pct(r.get('mfu'))}; data wait share {pct(r.get('data_wait_share'))}; "
                f"device idle between steps {pct(r.get('device_idle_share'))}; "
                f"sync_steps {((r.get('config') or {}).get('train') or {}).get('sync_steps')}",
                "setup_time_s: " + ", ".join(f"{k} {v:.1f}" for k, v in setup.items() if isinstance(v, (int, float))),
                f"tracked peak {gib(mem.get('peak_bytes'))}; max allocated {gib(mem.get('max_allocated_bytes'))}; "
                f"max reserved {gib(mem.get('max_reserved_bytes'))}; val PPL {r.get('val_ppl')}"]
    if step.kind == "compare" and (out / "compare_hf.md").is_file():
        text = (out / "compare_hf.md").read_text()
        return [*_section(text, "Results"), "", *_section(text, "Ratios")]
    # the table rows of the markdown the step wrote (a profile's per-phase table, the bench's
    # report, allocator_check's): the rest stays in the archive
    written = sorted(out.glob("*.md")) if step.kind == "markdown" else []
    if written:
        return [ln for ln in written[0].read_text().splitlines() if ln.startswith("|")][:40]
    text = log.read_text(errors="replace") if log.is_file() else ""
    if step.kind == "table":  # a script that prints its table
        rows = [ln for ln in text.splitlines() if ln.startswith("|")]
        if rows:
            return rows
    return text.strip().splitlines()[-3:] or ["no output"]


# ============================================================================ running
def _env(commit: Optional[str], site: Optional[Path]) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    paths = [str(site)] if site else []
    paths.append(str(ROOT / "src"))
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if commit:
        # The device's copy of .git may be older than the tree it was sent; the commit given wins.
        env["MEMTRAIN_COMMIT"] = commit
        env["GIT_DIR"] = "/nonexistent-memtrain-git"
    return env


def _versions_of_one_package(wheels: list[Path]) -> list[str]:
    """The distributions of which ``wheels`` hold more than one file (a wheel's name is
    ``NAME-VERSION-...whl``; NAME compared as pip does, case and ``-``/``_``/``.`` aside)."""
    seen: dict[str, list[str]] = {}
    for wheel in wheels:
        name = wheel.name.split("-")[0].lower().replace(".", "_")
        seen.setdefault(name, []).append(wheel.name)
    return [" and ".join(files) for files in seen.values() if len(files) > 1]


def install_wheels(folder: Path, target: Path) -> Path:
    """pip-install every wheel of ``folder`` into ``target`` (no index, no dependencies)."""
    paths = sorted(folder.glob("*.whl"))
    if not paths:
        raise SystemExit(f"--wheels {folder}: no .whl files there (benchmarks/gpu_wheels.sh fetches them)")
    # Two versions of one package (a folder fetched before a pin changed) make pip refuse them
    # all, on the device, after its start: refused here, before anything is installed.
    twice = _versions_of_one_package(paths)
    if twice:
        raise SystemExit(f"--wheels {folder}: two versions of one package ({'; '.join(twice)}); remove the "
                         "older (benchmarks/gpu_wheels.sh empties the folder first)")
    wheels = [str(p) for p in paths]
    subprocess.run([PY, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
                    "--upgrade", "--target", str(target), *wheels], check=True)
    return target


def _machine(env: dict[str, str]) -> list[str]:
    """What ran the part: GPU, driver, packages (one markdown line each)."""
    lines = []
    smi = shutil.which("nvidia-smi")
    if smi:
        q = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True)
        lines.append(f"GPU: {q.stdout.strip() or q.stderr.strip()}")
    code = ("import importlib.metadata as m, platform, os\n"
            "v = {}\n"
            "for n in ('torch', 'transformers', 'peft', 'accelerate', 'torchao', 'liger-kernel', 'bitsandbytes', "
            "'cut-cross-entropy', 'datasets', 'triton'):\n"
            "    try: v[n] = m.version(n)\n"
            "    except m.PackageNotFoundError: v[n] = None\n"
            "print(platform.python_version(), platform.processor() or platform.machine(), os.cpu_count(), v)")
    p = subprocess.run([PY, "-c", code], capture_output=True, text=True, env=env)
    lines.append(f"host and packages: {p.stdout.strip() or p.stderr.strip()[-300:]}")
    # Every reserved figure depends on these (expandable_segments, max_split_size_mb), and the
    # allocator model (the allocator step) assumes torch's defaults.
    conf = {name: env[name] for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF") if env.get(name)}
    lines.append("allocator settings: " + (", ".join(f"{k}={v}" for k, v in conf.items())
                                          or "torch's defaults (PYTORCH_ALLOC_CONF and PYTORCH_CUDA_ALLOC_CONF unset)"))
    return lines


class Part:
    """One part's work folder, its record and its packed copy under ``out``."""

    def __init__(self, name: str, work: Path, out: Path, header: list[str]) -> None:
        self.name, self.work, self.out = name, work, out
        self.header = header
        self.records: list[dict[str, Any]] = []
        work.mkdir(parents=True, exist_ok=True)
        out.mkdir(parents=True, exist_ok=True)

    def add(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        with (self.work / "runbook.jsonl").open("a") as fh:
            fh.write(json.dumps(record) + "\n")
        self.publish()

    def publish(self) -> None:
        """Rewrite OUT/PART.md and OUT/PART.tar.gz from what is finished (each atomically)."""
        lines = [f"# GPU runbook, part {self.name}", "", *[f"- {h}" for h in self.header], ""]
        for r in self.records:
            lines += [f"## {r['step']}: {r['status']}", "", f"- checks: {r['checks']}",
                      f"- command: `{r['command']}`", f"- exit {r['rc']}, wall {r['wall_s']:.0f} s "
                      f"(estimate {r['est_s']:.0f} s)", "", *r.get("headline", []), ""]
        md = self.out / f"{self.name}.md"
        tmp = md.with_suffix(".md.tmp")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(md)
        (self.work / f"{self.name}.md").write_text("\n".join(lines) + "\n")
        tar = self.out / f"{self.name}.tar.gz"
        part = tar.with_suffix(".tmp")
        with tarfile.open(part, "w:gz") as tf:
            tf.add(self.work, arcname=self.name)
        part.replace(tar)


def _part_steps(name: str, only: Optional[list[str]]) -> list[Step]:
    """The steps part ``name`` runs: its own (those ``only`` names, when given) in the table's
    order, or for :data:`PICKED` the steps ``only`` names, from any part, in its order."""
    if name == PICKED:
        by_name = {s.name: s for s in STEPS}
        return [by_name[n] for n in only or []]
    return [s for s in STEPS if s.part == name and (only is None or s.name in only)]


def _time_needed(steps: list[Step], i: int) -> tuple[float, str]:
    """The seconds step ``i`` of ``steps`` needs left to run, and what they are: its estimate, and
    for an optional step the estimates of the required steps after it too (it yields to them)."""
    step = steps[i]
    if not step.optional:
        return step.est_s, f"estimate {step.est_s:.0f} s"
    after = sum(s.est_s for s in steps[i + 1:] if not s.optional)
    return step.est_s + after, f"optional: estimate {step.est_s:.0f} s and {after:.0f} s of required steps after it"


def run_part(name: str, sizes: Sizes, out: Path, work: Path, deadline_s: float, env: dict[str, str],
             only: Optional[list[str]], header: list[str]) -> int:
    """Run the part's steps in order within ``deadline_s``; the number of failed steps."""
    start = time.monotonic()
    part = Part(name, work / name, out, header + _machine(env))
    failed = 0
    steps = _part_steps(name, only)
    for i, step in enumerate(steps):
        folder = part.work / step.name
        folder.mkdir(parents=True, exist_ok=True)
        argv = step.argv(sizes, folder)
        left = deadline_s - (time.monotonic() - start)
        record: dict[str, Any] = {"step": step.name, "checks": step.checks, "command": shlex.join(argv),
                                  "est_s": step.est_s, "rc": None, "wall_s": 0.0}
        needed, why = _time_needed(steps, i)
        if sizes is FULL and left < needed:
            part.add({**record, "status": f"skipped: {left:.0f} s left of the part's deadline, {why}"})
            continue
        log = folder / "log.txt"
        print(f"[{name}] {step.name}: {record['command']}", flush=True)
        t0 = time.monotonic()
        with log.open("w") as fh:
            try:
                # The smoke run has no deadline: it proves the commands, not their time.
                rc = subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                    timeout=max(10.0, left - 5.0) if sizes is FULL else None).returncode
                status = "ok" if rc == 0 else "failed"
            except subprocess.TimeoutExpired:
                rc, status = 124, f"stopped at the part's deadline ({left:.0f} s left when it started)"
        failed += status != "ok"
        wall = time.monotonic() - t0
        lines = headline(step, folder, log)
        print(f"[{name}] {step.name}: {status} in {wall:.0f} s", flush=True)
        part.add({**record, "rc": rc, "wall_s": wall, "status": status, "headline": lines})
    return failed


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--part", choices=[*PARTS, PICKED],
                    help=f"which part to run (one device command each); {PICKED}: the steps --only names, from "
                         "any part, in that order")
    ap.add_argument("--out", type=Path, help="folder that gets PART.md and PART.tar.gz (on the device: $OUT)")
    ap.add_argument("--work", type=Path, default=None, help="work folder (default: a folder in /tmp)")
    ap.add_argument("--smoke", action="store_true", help="toy sizes on the CPU: check that every command still runs")
    ap.add_argument("--only", help=f"comma-separated step names of the part (of any part for --part {PICKED})")
    ap.add_argument("--deadline", type=float, default=DEFAULT_DEADLINE_S,
                    help=f"seconds the part may take, installing --wheels included (default {DEFAULT_DEADLINE_S:g}: "
                         "under a 600 s device command)")
    ap.add_argument("--wheels", type=Path, help="install these wheels first (into a folder put on PYTHONPATH)")
    ap.add_argument("--commit", help="the commit the working tree was sent at (recorded in every result)")
    ap.add_argument("--list", action="store_true", help="print the parts and steps with their estimates")
    args = ap.parse_args(argv)
    # --deadline counts from here: the wheels' installation spends the same device command's time.
    started = time.monotonic()
    if args.list:
        for p in PARTS:
            steps = [s for s in STEPS if s.part == p]
            print(f"{p} ({sum(s.est_s for s in steps if not s.optional):.0f} s estimated on an H100, "
                  f"{sum(s.est_s for s in steps if s.optional):.0f} s more if time allows):")
            for s in steps:
                print(f"  {s.name} ({s.est_s:.0f} s{', optional' if s.optional else ''}): {s.checks}")
        return 0
    if args.part is None or args.out is None:
        ap.error("--part and --out are needed (or --list)")
    only = [n for n in args.only.split(",") if n] if args.only else None
    if args.part == PICKED and not only:
        ap.error(f"--part {PICKED} runs the steps --only names; name at least one (--list shows them)")
    if only:
        known = {s.name for s in STEPS if args.part == PICKED or s.part == args.part}
        unknown = [n for n in only if n not in known]
        if unknown:
            where = "any part" if args.part == PICKED else f"part {args.part}"
            ap.error(f"--only {','.join(unknown)}: not a step of {where} ({', '.join(sorted(known))})")
        if len(set(only)) != len(only):
            ap.error(f"--only {args.only}: a step is named twice")
    work = args.work or Path("/tmp") / f"memtrain-runbook-{os.getpid()}"
    if args.out.exists() and not args.out.is_dir():
        ap.error(f"--out {args.out} is a file; give a folder")
    if (work / args.part).exists() and any((work / args.part).iterdir()):
        # the steps' own folders (compare_hf's runs.jsonl, a bench's results) would mix two runs
        ap.error(f"{work / args.part} already holds a run of part {args.part}; give another --work or remove it")
    site = install_wheels(args.wheels, work / "site") if args.wheels else None
    env = _env(args.commit, site)
    header = [f"command: `{shlex.join([Path(PY).name, *sys.argv])}`",
              f"commit: {args.commit or 'not given (--commit)'}",
              f"sizes: {'smoke (toy sizes on ' + SMOKE.device + ')' if args.smoke else 'full'}",
              f"started: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}"]
    left = args.deadline - (time.monotonic() - started)
    failed = run_part(args.part, SMOKE if args.smoke else FULL, args.out, work, left, env, only, header)
    print(f"wrote {args.out / (args.part + '.md')} and {args.out / (args.part + '.tar.gz')}; {failed} step(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
