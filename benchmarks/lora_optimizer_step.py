"""Time the optimizer step of many small LoRA adapters under ``--precision bf16-pure``.

memtrain trains BF16 adapters with torchao's stochastically rounded AdamW (``torchao.optim._AdamW``,
``bf16_stochastic_round=True``), whose own step calls a compiled single-parameter update once per
tensor: Llama-3-8B with LoRA on every Linear has 448 adapter tensors. A Trainer + peft user
trains FP32 adapters with torch's AdamW (fused on CUDA). This script times, on the same tensors:

* ``torchao``: torchao's ``_AdamW`` as it steps (one compiled call per tensor);
* ``memtrain``: memtrain's ``BucketedSRAdamW`` (memtrain.techniques.sr_adamw), what ``--optim
  adamw`` runs under bf16-pure: torchao's update once per bucket of concatenated tensors, copied
  back; the state stays per tensor;
* ``torchao-grouped``: torchao's own update (``torchao.optim.adam.single_param_adam``) for every
  tensor inside one compiled call (a candidate fix; the same math, one call per step);
* ``torchao-flat``: the same update once over one flat buffer that every tensor is a view of
  (weights and moments; the gradients gathered by one ``torch.cat`` per step): one compiled
  kernel whatever the tensor count, for a copy of the gradients (2 bytes per adapter weight);
* ``torch-fp32``: ``torch.optim.AdamW`` on FP32 copies (fused on CUDA, foreach on CPU).

For each: the first step's time (the compile lands there) and the median of the next steps.

    python benchmarks/lora_optimizer_step.py --tensors 56 --out /tmp/lora-opt
    python benchmarks/lora_optimizer_step.py --device cuda --tensors 448 --d 4096 --rank 16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from memtrain.config.argtypes import positive_int
from memtrain.files.results import benchmark_out_problem, write_json_atomic


def adapter_shapes(n: int, d: int, rank: int) -> list[tuple[int, int]]:
    """LoRA's A (rank x d) and B (d x rank) matrices, alternating."""
    return [(rank, d) if i % 2 == 0 else (d, rank) for i in range(n)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(step: Callable[[], None], fill: Callable[[], None], device: torch.device, steps: int) -> dict[str, float]:
    fill()
    _sync(device)
    t0 = time.perf_counter()
    step()
    _sync(device)
    first = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        fill()
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return {"first_s": first, "median_ms": statistics.median(times) * 1e3}


def _grouped_adamw(base: type) -> type:
    """torchao's _AdamW whose step updates every tensor of a group in one compiled call."""
    from torchao.optim.adam import single_param_adam

    def update_all(ps: list, gs: list, steps: list, m1: list, m2: list, lr: torch.Tensor, beta1: float,
                   beta2: float, wd: float, eps: float, adamw: bool, sr: bool) -> None:
        for p, g, s, a, b in zip(ps, gs, steps, m1, m2):
            s.add_(1)
            single_param_adam(p, g, s, a, b, None, lr, beta1, beta2, wd, eps, adamw, sr)

    compiled = torch.compile(update_all, fullgraph=True, dynamic=False)

    class GroupedAdamW(base):  # type: ignore[misc,valid-type]
        @torch.no_grad()
        def step(self, closure: Any = None) -> None:
            for group in self.param_groups:
                ps = [p for p in group["params"] if p.grad is not None]
                for p in ps:
                    state = self.state[p]
                    if not state:  # as torchao initializes it
                        state["step"] = torch.tensor(0.0)
                        state["exp_avg"] = self._new_buffer(p, True)
                        state["exp_avg_sq"] = self._new_buffer(p, False)
                states = [self.state[p] for p in ps]
                compiled([p.detach() for p in ps], [p.grad for p in ps], [s["step"] for s in states],
                         [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], group["lr"],
                         group["betas"][0], group["betas"][1], group["weight_decay"], group["eps"],
                         self.is_adamw, self.bf16_stochastic_round)

    return GroupedAdamW


class FlatAdamW:
    """torchao's update over flat buffers: every tensor's weight and moments are views of one
    buffer each, the gradients are concatenated once per step, one compiled call updates all."""

    def __init__(self, params: list[torch.nn.Parameter], lr: torch.Tensor, weight_decay: float,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        from torchao.optim.adam import single_param_adam

        self.params = params
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        offset = 0
        for p in params:  # each weight becomes a view of the flat buffer (apex's flat master weights)
            p.data = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.flat = flat
        self.m1, self.m2 = torch.zeros_like(flat), torch.zeros_like(flat)
        self.step_t = torch.tensor(0.0)
        self.lr, self.wd, self.betas, self.eps = lr, weight_decay, betas, eps
        self.update = torch.compile(single_param_adam, fullgraph=True, dynamic=False)

    @torch.no_grad()
    def step(self) -> None:
        grads = torch.cat([p.grad.reshape(-1) for p in self.params])  # type: ignore[union-attr]
        self.step_t += 1
        self.update(self.flat, grads, self.step_t, self.m1, self.m2, None, self.lr, self.betas[0], self.betas[1],
                    self.wd, self.eps, True, True)


VARIANTS = ("torchao", "memtrain", "torchao-grouped", "torchao-flat", "torch-fp32")


def run(n: int, d: int, rank: int, device: torch.device, steps: int,
        variants: tuple[str, ...] = VARIANTS) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each variant's (name, timings), as it finishes."""
    from torchao.optim import _AdamW

    from memtrain.techniques.sr_adamw import BucketedSRAdamW

    shapes = adapter_shapes(n, d, rank)
    g = torch.Generator(device=device).manual_seed(0)

    def tensors(dtype: torch.dtype) -> list[torch.nn.Parameter]:
        return [torch.nn.Parameter(torch.randn(*s, generator=g, device=device, dtype=dtype) * 0.02) for s in shapes]

    def filler(params: list[torch.nn.Parameter]) -> Callable[[], None]:
        def fill() -> None:
            for p in params:
                p.grad = torch.randn(p.shape, generator=g, device=device, dtype=p.dtype) * 1e-3
        return fill

    def bf16_step(name: str) -> tuple[Callable[[], None], list[torch.nn.Parameter]]:
        params = tensors(torch.bfloat16)
        lr = torch.tensor(1e-4, device=device)  # torchao keeps the learning rate as a tensor
        if name == "torchao-flat":
            return FlatAdamW(params, lr=lr, weight_decay=0.1).step, params
        cls = {"torchao": _AdamW, "memtrain": BucketedSRAdamW, "torchao-grouped": _grouped_adamw(_AdamW)}[name]
        return cls(params, lr=lr, weight_decay=0.1, bf16_stochastic_round=True).step, params

    for name in variants:
        if name == "torch-fp32":
            fp32 = tensors(torch.float32)
            kind = {"fused": True} if device.type == "cuda" else {"foreach": True}
            torch_opt = torch.optim.AdamW(fp32, lr=1e-4, weight_decay=0.1, **kind)
            yield name, {**_time(torch_opt.step, filler(fp32), device, steps), "kernel": next(iter(kind))}
        else:
            step, params = bf16_step(name)
            yield name, _time(step, filler(params), device, steps)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--tensors", type=positive_int, default=56, help="adapter tensors (Llama-3-8B all-linear: 448)")
    ap.add_argument("--d", type=positive_int, default=128, help="the adapted Linears' width")
    ap.add_argument("--rank", type=positive_int, default=16)
    ap.add_argument("--steps", type=positive_int, default=20, help="timed steps after the first")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated, in order (default: all of {', '.join(VARIANTS)})")
    ap.add_argument("--out", type=Path, help="folder for lora_optimizer_step.json")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        ap.error(f"--variants: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(VARIANTS)}")
    problem = None if args.out is None else benchmark_out_problem(args.out, "lora_optimizer_step.json")
    if problem:
        ap.error(problem)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(f"{args.tensors} adapter tensors ({args.rank} x {args.d} and {args.d} x {args.rank}) on {name}, torch {torch.__version__}")
    print("| optimizer | first step (s) | median step (ms) |\n|---|---:|---:|", flush=True)
    payload = {"command": " ".join(["python", *sys.argv]), "device": name, "torch": torch.__version__,
               "tensors": args.tensors, "d": args.d, "rank": args.rank, "results": {}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for variant, timing in run(args.tensors, args.d, args.rank, device, args.steps, variants):
            print(f"| {variant} | {timing['first_s']:.2f} | {timing['median_ms']:.2f} |", flush=True)
            payload["results"][variant] = timing
            if args.out is not None:  # after each variant: a later one that fails loses nothing
                write_json_atomic(args.out / "lora_optimizer_step.json", payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
