"""Where a training step's time goes with the standard loss and with the chunked loss, side by side.

On an H100 the compiled seed GPT (batch 64 x 256, BF16 + flash) took 9.06 ms a step with the
standard loss and 27.9 ms with ``--loss chunked`` (20.2 ms at ``--loss-chunk 1024``;
benchmarks/results/gpu-h100/runbook-2026-11-26, run 3). Two chunk sizes put about 0.16 ms on each
chunk and the rest on the loss as a whole, more than its arithmetic needs. This script answers
where: for each variant it builds the run as ``memtrain train`` does (the step harness,
:mod:`memtrain.training.step`), runs warm-up steps, then profiles a few steps with
``torch.profiler`` and writes, per variant:

* the median step time (synchronized) and the first step's (compilation lands there);
* host time and device time per step, and device kernels launched per step: a step whose host
  time is near its wall time while the device idles is bound by launches, not arithmetic;
* the top operators by self device time (self host time on a CPU), with calls per step.

Variants (``--variants``): ``standard``; ``chunked-N`` (the chunked loss at chunk N, as
``--loss chunked`` runs it: under ``--compile`` one opaque operator in the graph, each chunk one
compiled call on CUDA, the logits laid out 64 columns wide); ``chunked-N-outside`` (the same loss
left out of the compiled graph: the model compiled, the loss eager); ``chunked-N-traced`` (the chunk
loop traced into the compiled graph, one copy per chunk, for a few large chunks: what inductor
makes of the whole loss when it sees it); ``chunked-N-loop`` (each chunk's ops launched from Python
around one compiled logit gradient, :func:`per_op_chunk_step`, as before the one-call body);
``chunked-N-unaligned`` (the logits exactly vocab columns wide, as before the aligned layout);
``liger`` and ``cce`` (``--loss-kernel liger|cce``: the library's kernel, outside the compiled graph;
``cce`` exact, as memtrain calls it, ``cce-filter`` with Cut Cross-Entropy's own gradient filter);
``chunked-N-addmm`` (the weight gradient added with the float32-epilogue ``addmm(..., out_dtype=float32,
out=grad_w)`` after each compiled chunk call, as ``MEMTRAIN_LOSS_FP32_ADDMM=1`` runs it; every other
variant runs the default accumulation, whatever the environment says) and ``chunked-N-addmm-inductor``
(that addmm inside the compiled chunk body, where inductor splits it into a float32 matmul and an
add); both CUDA only, skipped elsewhere or where torch's kernel lacks the overload. Any
variant ending in ``-cudagraphs`` runs with ``--compile-mode reduce-overhead``: with ``--compile``
on a GPU, CUDA graphs replay the compiled forward and backward in one launch each, which says how
much of a step is launch cost (their max allocated leaves out the graphs' own pool: read reserved).
Any variant ending in ``-eager`` runs without ``--compile`` (the chunk bodies are compiled on CUDA
all the same), so one run holds eager and compiled rows. ``--model`` profiles a transformers model
(``--model qwen2.5-0.5b``: its 151,936-token head) instead of the seed GPT.
Each variant's step time is the median of steps timed without the profiler (``--timed``), which
adds host time to every operator it records.
A variant that fails is recorded with its error, and the next one runs. A library kernel that
cannot run here (its package not installed, or a device other than CUDA) is recorded as skipped,
with memtrain's reason.

    python benchmarks/loss_profile.py --device cuda --compile --out /tmp/loss-profile
    python benchmarks/loss_profile.py --device cpu --batch-size 2 --seq-len 64 --d-model 64 --steps 2
    python benchmarks/loss_profile.py --device cuda --model qwen2.5-0.5b --batch-size 4 --seq-len 1024 \
        --variants standard-eager,chunked-1024-eager,chunked-1024-addmm-eager --out /tmp/qwen-addmm

Writes OUT/loss_profile.json and OUT/loss_profile.md after each variant (a later failure loses
none before it). Timing figures are for comparing the variants of one run, on one machine.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from torch.profiler import ProfilerActivity, profile

from memtrain.config.argtypes import positive_int
from memtrain.config.run import build_config
from memtrain.files.results import benchmark_out_problem, write_json_atomic, write_text_atomic
from memtrain.metrics.timing import synchronize
from memtrain.runtime.env import device_name, git_commit
from memtrain.techniques import loss as loss_module
from memtrain.techniques.facts import loss_kernel_refusal
from memtrain.techniques.precision import make_precision
from memtrain.training.step import build_state, random_micro_batches, run_step

VARIANT_HOW = ("", "outside", "traced", "loop", "unaligned", "addmm", "addmm-inductor")
# The variants that run the float32-epilogue addmm (CUDA only).
ADDMM_HOW = ("addmm", "addmm-inductor")
# The library kernels' variants: name -> (--loss-kernel, how its loss runs).
LIBRARY_VARIANTS = {"liger": ("liger", ""), "cce": ("cce", ""), "cce-filter": ("cce", "filter")}


CUDA_GRAPHS = "-cudagraphs"
EAGER = "-eager"


def parse_variant(name: str) -> tuple[dict[str, Any], str]:
    """A variant's config overrides and how its loss runs (one of VARIANT_HOW); ValueError naming
    the accepted forms. A ``-cudagraphs`` suffix on any variant compiles it with
    ``--compile-mode reduce-overhead`` (CUDA graphs: one launch replays the compiled graph); an
    ``-eager`` suffix runs it without ``--compile``."""
    base, graphs = (name[:-len(CUDA_GRAPHS)], True) if name.endswith(CUDA_GRAPHS) else (name, False)
    base, eager = (base[:-len(EAGER)], True) if base.endswith(EAGER) else (base, False)
    if graphs and eager:
        raise ValueError(f"variant {name!r}: CUDA graphs replay a compiled step; drop {EAGER} or {CUDA_GRAPHS}")
    mode = {"compile_mode": "reduce-overhead"} if graphs else {"compile": False} if eager else {}
    if base == "standard":
        return {"loss": "standard", **mode}, ""
    if base in LIBRARY_VARIANTS:
        kernel, how = LIBRARY_VARIANTS[base]
        return {"loss": "chunked", "loss_kernel": kernel, **mode}, how
    parts = base.split("-", 2)
    if parts[0] == "chunked" and len(parts) >= 2 and parts[1].isdigit() and int(parts[1]) > 0 \
            and (len(parts) == 2 or parts[2] in VARIANT_HOW[1:]):
        return {"loss": "chunked", "loss_chunk": int(parts[1]), **mode}, parts[2] if len(parts) == 3 else ""
    raise ValueError(f"unknown variant {name!r}: use standard, chunked-N, chunked-N-outside, chunked-N-traced, "
                     f"chunked-N-loop, chunked-N-unaligned, chunked-N-addmm, chunked-N-addmm-inductor, liger, cce "
                     f"or cce-filter, each optionally ending in {CUDA_GRAPHS} or {EAGER}")


def per_op_chunk_step(backend: str = "inductor") -> Callable[..., None]:
    """The chunk step as it ran before :func:`memtrain.techniques.loss._chunk_body` (same arguments,
    same effect): the logits matmul, the compiled logit gradient, then ``g @ w`` copied into the
    chunk's rows of grad_h, ``g.t() @ h`` added into grad_w and the loss added, each op launched
    from Python (about eight launches and one compiled call per chunk). Kept to time the two side
    by side. Where the loss module would run its eager body (a CPU), that body runs. ``backend``:
    torch.compile's, for the logit gradient (a test passes aot_eager, which builds no kernels)."""
    compiled = torch.compile(loss_module._logit_gradient, backend=backend)
    eager_step = loss_module._chunk_step

    def step(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, grad_h_rows: Optional[torch.Tensor],
             grad_w: Optional[torch.Tensor], loss_sum: torch.Tensor, fused: Any, vocab: int,
             fp32_addmm: bool = False) -> None:
        if fused is None:
            eager_step(h, w, t, grad_h_rows, grad_w, loss_sum, None, vocab, fp32_addmm)
            return
        chunk_loss, g = compiled(h @ w.t(), t, vocab)
        loss_sum += chunk_loss
        loss_module._accumulate(grad_h_rows, grad_w, g, h, w, fp32_addmm)

    return step


def inductor_addmm_chunk_body(backend: str = "inductor") -> Callable[..., None]:
    """The chunk body with the float32-epilogue addmm inside the compiled call (compiled with
    ``backend``): inductor decomposes ``addmm.dtype`` into ``mm(out_dtype=float32)`` and an add
    (see the comment above :data:`memtrain.techniques.loss.FP32_ADDMM_ENV`), so this times what the
    library's variant avoids by running the addmm after the compiled call."""
    def body(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, grad_h_rows: Optional[torch.Tensor],
             grad_w: Optional[torch.Tensor], loss_sum: torch.Tensor, vocab: int) -> None:
        g = loss_module._chunk_head(h, w, t, grad_h_rows, loss_sum, vocab)
        if grad_w is not None:
            grad_w.copy_(torch.addmm(grad_w, g.t(), h, out_dtype=torch.float32))

    return torch.compile(body, backend=backend)


def _addmm_refusal(how: str, device: torch.device) -> Optional[str]:
    """Why a float32-epilogue addmm variant cannot run here (its kernel is CUDA's, and torch's may
    lack the overload), or None."""
    if how not in ADDMM_HOW:
        return None
    if device.type != "cuda":
        return f"the float32-epilogue addmm (addmm.dtype_out) is a CUDA kernel; --device is {device.type}"
    if not loss_module._fp32_addmm_supported(device):
        return (f"torch {torch.__version__}'s CUDA addmm does not add a 16-bit product into a float32 tensor "
                "(addmm.dtype_out)")
    return None


@contextlib.contextmanager
def _loss_placement(state: Any, how: str) -> Iterator[None]:
    """Leave the loss out of the compiled graph ("outside"), trace its chunk loop into it
    ("traced"), run the per-op chunk step ("loop"), lay the logits out exactly vocab columns wide
    ("unaligned"), turn Cut Cross-Entropy's own gradient filter on ("filter"), add the weight
    gradient with the float32-epilogue addmm after each compiled chunk call ("addmm") or inside it
    ("addmm-inductor"); everything is put back afterwards."""
    if how == "outside":
        state.model.loss_fn = torch.compiler.disable(state.model.loss_fn)
    previous = loss_module._chunked_forward_op, loss_module._chunk_step
    if how == "traced":  # the loop itself where the compiled forward calls the operator: dynamo unrolls it
        loss_module._chunked_forward_op = loss_module._chunked_forward
    if how == "loop":  # the loop looks its step up at each chunk, on the operator's path and the eager one
        loss_module._chunk_step = per_op_chunk_step()
    align, cce_filter = loss_module.ALIGN_VOCAB, loss_module.CCE_FILTER_EPS
    fp32_addmm, compiled_body = loss_module.FP32_ADDMM, loss_module._compiled_chunk_body
    # Only the addmm variant runs the library's float32-epilogue path: a MEMTRAIN_LOSS_FP32_ADDMM=1
    # in the environment must not relabel the others.
    loss_module.FP32_ADDMM = how == "addmm"
    if how == "addmm-inductor":  # the one-call body, the addmm inside it
        body = inductor_addmm_chunk_body()
        loss_module._compiled_chunk_body = lambda: body  # type: ignore[assignment]  # the cached maker, swapped
    if how == "unaligned":  # the logits exactly vocab columns wide, as before the aligned layout
        loss_module.ALIGN_VOCAB = 1
    if how == "filter":  # Cut Cross-Entropy skipping its backward's blocks below bf16's eps / 32
        loss_module.CCE_FILTER_EPS = "high"
    try:
        yield
    finally:
        loss_module._chunked_forward_op, loss_module._chunk_step = previous
        loss_module.ALIGN_VOCAB, loss_module.CCE_FILTER_EPS = align, cce_filter
        loss_module.FP32_ADDMM, loss_module._compiled_chunk_body = fp32_addmm, compiled_body


def profile_variant(overrides: dict[str, Any], steps: int, warmup: int, top: int, how: str = "",
                    timed: int = 0) -> dict[str, Any]:
    """Build one run, run ``warmup`` steps, time ``timed`` more without the profiler, profile ``steps``
    more; the figures described above."""
    cfg = build_config(overrides)
    device = torch.device(overrides["device"])
    # Each variant compiles a new model: dynamo's caches of the last one's graphs would count
    # towards its recompile limit, past which the model would silently run eagerly.
    torch.compiler.reset()
    if device.type == "cuda":  # the last variant's cached blocks would count in this one's reserved peak
        gc.collect()
        torch.cuda.empty_cache()
    torch.manual_seed(0)
    state = build_state(cfg, device, make_precision(cfg.technique.precision, device))
    with _loss_placement(state, how):
        return _profile_steps(state, cfg, device, steps, warmup, top, overrides, timed)


def _profile_steps(state: Any, cfg: Any, device: torch.device, steps: int, warmup: int, top: int,
                   overrides: dict[str, Any], timed: int = 0) -> dict[str, Any]:
    micro = random_micro_batches(cfg, cfg.train.batch_size, device, torch.Generator().manual_seed(0))

    def timed_steps(n: int) -> list[float]:
        out = []
        for _ in range(n):
            synchronize(device)
            t0 = time.perf_counter()
            run_step(state, micro)
            synchronize(device)
            out.append(time.perf_counter() - t0)
        return out

    times = timed_steps(warmup)
    # The profiler adds host time to every operator it records, so the step times it sees overstate
    # a host-bound step: the comparison uses steps timed without it.
    unprofiled = timed_steps(timed)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        profiled = timed_steps(steps)
    events = prof.key_averages()
    on_device = device.type == "cuda"

    def self_time(e: Any) -> float:  # microseconds
        return float(e.self_device_time_total if on_device else e.self_cpu_time_total)

    ranked = sorted(events, key=self_time, reverse=True)[:top]
    device_us = sum(float(e.self_device_time_total) for e in events) if on_device else None
    kernels = sum(e.count for e in events if on_device and float(e.self_device_time_total) > 0
                  and not e.key.startswith(("aten::", "memtrain::", "cudaLaunch", "cuLaunch")))
    return {
        "config": overrides,
        "first_step_s": times[0] if times else None,
        "step_s_median": statistics.median(unprofiled or profiled),
        "unprofiled_steps": len(unprofiled),
        "profiled_step_s_median": statistics.median(profiled),
        "profiled_steps": steps,
        "host_us_per_step": sum(float(e.self_cpu_time_total) for e in events) / steps,
        "device_us_per_step": device_us / steps if device_us is not None else None,
        "kernels_per_step": kernels / steps if on_device else None,
        # the profiled steps' peaks (the steady state: the optimizer's state exists)
        "max_allocated_bytes": torch.cuda.max_memory_allocated(device) if on_device else None,
        "max_reserved_bytes": torch.cuda.max_memory_reserved(device) if on_device else None,
        "top": [{"op": e.key, "calls_per_step": e.count / steps, "self_us_per_step": self_time(e) / steps}
                for e in ranked],
    }


def _variant_refusal(extra: dict[str, Any], how: str, device: torch.device) -> Optional[str]:
    """Why a variant cannot run here (a library kernel's, :func:`_library_refusal`, or the float32-epilogue
    addmm's, :func:`_addmm_refusal`), or None."""
    return _library_refusal(extra, device) or _addmm_refusal(how, device)


def _library_refusal(extra: dict[str, Any], device: torch.device) -> Optional[str]:
    """Why a library kernel's variant cannot run here (its package is not installed, or it is
    Triton code and the device is not CUDA), or None: memtrain's refusal, as train gives it."""
    if "loss_kernel" not in extra:
        return None
    return loss_kernel_refusal(extra["loss"], extra["loss_kernel"], device.type)


def _markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = ["# Where the step's time goes: standard vs chunked loss", "",
             f"- command: `{meta['command']}`", f"- commit: {meta['commit']}", f"- device: {meta['device_name']}",
             f"- torch {meta['torch']}", "",
             "Step ms: the median of the steps timed without the profiler (of the profiled ones where none "
             "were); profiled ms, host and device time, kernels and peaks: the profiled steps.", "",
             "| variant | step ms (median) | profiled ms | first step s | host us/step | device us/step | kernels/step "
             "| max allocated GiB | max reserved GiB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r or "skipped" in r:
            what = f"failed: {r['error']}" if "error" in r else f"skipped: {r['skipped']}"
            lines.append(f"| {r['name']} | {what.replace('|', '/')} | | | | | | | |")
            continue
        dev = "-" if r["device_us_per_step"] is None else f"{r['device_us_per_step']:,.0f}"
        ker = "-" if r["kernels_per_step"] is None else f"{r['kernels_per_step']:,.0f}"
        first = "-" if r["first_step_s"] is None else f"{r['first_step_s']:.2f}"
        gib = [("-" if r.get(k) is None else f"{r[k] / 2**30:.2f}") for k in ("max_allocated_bytes", "max_reserved_bytes")]
        prof = r.get("profiled_step_s_median", r["step_s_median"]) * 1e3
        lines.append(f"| {r['name']} | {r['step_s_median'] * 1e3:.2f} | {prof:.2f} | {first} | {r['host_us_per_step']:,.0f} "
                     f"| {dev} | {ker} | {gib[0]} | {gib[1]} |")
    for r in (r for r in rows if "error" not in r and "skipped" not in r):
        lines += ["", f"## {r['name']}: top operators by self {'device' if r['device_us_per_step'] is not None else 'host'} "
                  "time", "", "| op | calls/step | self us/step |", "|---|---:|---:|"]
        lines += [f"| `{t['op']}` | {t['calls_per_step']:g} | {t['self_us_per_step']:,.1f} |" for t in r["top"]]
    return "\n".join(lines) + "\n"


def base_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings every variant shares (each variant's own overrides go on top)."""
    cuda = args.device.startswith("cuda")
    base: dict[str, Any] = {"device": args.device, "batch_size": args.batch_size, "seq_len": args.seq_len,
                            "precision": "bf16" if cuda else "fp32",
                            # flash is the seed GPT's kernel; a transformers model runs sdpa
                            "attention": "flash" if cuda and not args.model else "sdpa",
                            "compile": args.compile}
    if args.model:
        base["model"] = args.model
    if args.d_model:
        base.update(d_model=args.d_model, d_ff=4 * args.d_model)
    return base


def parser() -> argparse.ArgumentParser:
    """The command line (a test reads the runbook's commands through it)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch-size", type=positive_int, default=64)
    ap.add_argument("--seq-len", type=positive_int, default=256)
    ap.add_argument("--d-model", type=positive_int, default=None, help="a smaller model for a quick look")
    ap.add_argument("--model", default=None, help="a transformers model instead of the seed GPT (as memtrain "
                    "train --model takes it: qwen2.5-0.5b, a config.json or a folder); attention sdpa")
    ap.add_argument("--variants", default="standard,chunked-256,chunked-1024",
                    help="comma-separated: standard, chunked-N, chunked-N-outside, chunked-N-traced, "
                         "chunked-N-loop, chunked-N-unaligned, chunked-N-addmm, chunked-N-addmm-inductor, liger, "
                         "cce, cce-filter, each optionally ending in -eager or -cudagraphs (see above)")
    ap.add_argument("--compile", action="store_true", help="--compile for every variant")
    ap.add_argument("--steps", type=positive_int, default=6, help="profiled steps per variant (default 6)")
    ap.add_argument("--warmup", type=positive_int, default=3, help="steps before timing (default 3; the first "
                    "one's time is reported: compilation lands there)")
    ap.add_argument("--timed", type=int, default=20, help="steps timed without the profiler after the warm-up "
                    "(default 20; 0: the profiled steps' times)")
    ap.add_argument("--top", type=positive_int, default=25, help="operators listed per variant (default 25)")
    ap.add_argument("--out", default="benchmarks/results/loss-profile")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    try:
        variants = [(v, *parse_variant(v)) for v in args.variants.split(",") if v]
    except ValueError as e:
        ap.error(f"--variants: {e}")
    if not variants:
        ap.error("--variants: name at least one (standard, chunked-N, ...)")
    if args.model is not None and args.d_model:
        ap.error("--d-model resizes the seed GPT; --model names its own shape (drop one)")
    if args.model is not None and not args.model.strip():
        ap.error("--model is empty; name a model (qwen2.5-0.5b) or drop --model for the seed GPT")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: no CUDA device here (torch {torch.__version__}); use --device cpu")
    base = base_overrides(args)
    out = Path(args.out)
    problem = benchmark_out_problem(out, "loss_profile.json")
    if problem:
        ap.error(problem)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    meta = {"command": " ".join([sys.executable, *sys.argv]), "commit": git_commit() or "unknown",
            "torch": torch.__version__, "device_name": device_name(device)}
    rows: list[dict[str, Any]] = []
    for name, extra, how in variants:
        skip = _variant_refusal(extra, how, device)
        if skip is not None:
            # Not installed, or not a kernel for this device: the row is left out with the reason
            # (a failure would read as a defect of the kernel, the others' device time unspent).
            rows.append({"name": name, "config": {**base, **extra}, "skipped": skip})
            print(f"{name}: skipped: {skip}", file=sys.stderr, flush=True)
            write_json_atomic(out / "loss_profile.json", {**meta, "rows": rows})
            write_text_atomic(out / "loss_profile.md", _markdown(meta, rows))
            continue
        try:
            row = {"name": name, **profile_variant({**base, **extra}, args.steps, args.warmup, args.top, how,
                                                   max(0, args.timed))}
        except Exception as exc:  # noqa: BLE001 - one variant's failure must not cost the others' device time
            row = {"name": name, "config": {**base, **extra}, "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
            print(f"{name}: failed: {row['error']}", file=sys.stderr, flush=True)
        else:
            print(f"{name}: {row['step_s_median'] * 1e3:.2f} ms/step", flush=True)
        rows.append(row)
        write_json_atomic(out / "loss_profile.json", {**meta, "rows": rows})
        write_text_atomic(out / "loss_profile.md", _markdown(meta, rows))
    print(f"wrote {out / 'loss_profile.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
