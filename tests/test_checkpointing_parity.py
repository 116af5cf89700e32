"""memtrain's ``--checkpointing full`` on a transformers model costs no more than transformers'
own ``gradient_checkpointing_enable(use_reentrant=False)`` (what HF Trainer's
``gradient_checkpointing=True`` runs): counted, not timed.

On an H200 (benchmarks/results/gpu-h200/README.md, Qwen2.5-0.5B, 4 x 1024, BF16 autocast, sdpa)
memtrain's checkpointing added 94 ms a step and the Trainer's 83 ms. These tests run one
training step of a tiny Qwen2 and Llama three ways (plain, memtrain's, transformers') under BF16
autocast with SDPA and compare what checkpointing adds on each side: the FLOPs
(``FlopCounterMode``), every aten operator by name (a ``TorchDispatchMode``: copies and casts,
views, the rotary and mask arithmetic, the attention kernel) and the RNG-state saves and
restores (``torch.get_rng_state`` / ``set_rng_state``). Without gradients (evaluation)
neither side may enter the checkpoint machinery at all.
"""

from __future__ import annotations

import collections
import copy
import types
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from memtrain.bench.hf.trainer_side import enable_checkpointing
from memtrain.config.run import TechniqueConfig
from memtrain.models.hf import HFCausalLM
from memtrain.techniques.checkpointing import apply_checkpointing, is_checkpointed
from tiny_families import VOCAB, tiny_config

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ["qwen2", "llama"]


class _AtenOps(TorchDispatchMode):
    """Every aten operator call, by overload name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _rng_calls(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    """Count the CPU RNG-state saves and restores (``torch.utils.checkpoint`` makes one of each
    per checkpointed call and recompute; none is an aten operator the dispatch mode sees)."""
    calls: collections.Counter[str] = collections.Counter()
    for name in ("get_rng_state", "set_rng_state"):
        real = getattr(torch, name)

        def counted(*a: Any, _real: Any = real, _name: str = name, **k: Any) -> Any:
            calls[_name] += 1
            return _real(*a, **k)

        monkeypatch.setattr(torch, name, counted)
    return calls


def _models(family: str, **overrides: Any) -> dict[str, HFCausalLM]:
    """The same tiny model three times: plain, memtrain's checkpointing, transformers'."""
    config = tiny_config(family, 2, use_cache=False, **overrides)
    torch.manual_seed(0)
    lm = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    plain = HFCausalLM(lm, types.SimpleNamespace(spec=f"tiny-{family}"))  # type: ignore[arg-type]  # only .spec is read
    ours, theirs = copy.deepcopy(plain), copy.deepcopy(plain)
    apply_checkpointing(ours, TechniqueConfig(checkpointing="full"))
    enable_checkpointing(theirs.lm, {"use_reentrant": False})  # as the Trainer's gradient_checkpointing=True
    assert all(is_checkpointed(b) for b in ours.blocks)
    assert all(layer.gradient_checkpointing for layer in theirs.blocks)
    return {"plain": plain, "ours": ours, "theirs": theirs}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (2, 64), generator=g), torch.randint(0, VOCAB, (2, 64), generator=g)


def _step(model: HFCausalLM, batch: tuple[torch.Tensor, torch.Tensor], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """One forward + backward under BF16 autocast (as on the H200): its loss, gradients, FLOPs,
    aten operators and RNG-state calls."""
    model.train()
    model.zero_grad(set_to_none=True)
    with monkeypatch.context() as m:
        rng = _rng_calls(m)
        torch.manual_seed(42)
        with _AtenOps() as ops, FlopCounterMode(display=False) as flops:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(*batch)
            loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.detach(), "grads": grads, "flops": flops.get_total_flops(), "ops": ops.counts,
            "rng": collections.Counter(rng)}


@pytest.mark.parametrize("family, overrides", [
    ("qwen2", {}),
    ("llama", {}),
    # attention dropout on: the recompute must replay the same masks, from the same RNG restores
    ("llama", {"attention_dropout": 0.1}),
], ids=["qwen2", "llama", "llama-attention-dropout"])
def test_checkpointing_adds_no_more_than_transformers_own(family, overrides, monkeypatch):
    batch = _batch()
    steps = {name: _step(model, batch, monkeypatch) for name, model in _models(family, **overrides).items()}
    plain, ours, theirs = steps["plain"], steps["ours"], steps["theirs"]

    # Numerics: checkpointing changes nothing (same ops, same order, same dropout masks).
    assert torch.equal(ours["loss"], plain["loss"])
    assert ours["grads"].keys() == plain["grads"].keys()
    for name, grad in plain["grads"].items():
        torch.testing.assert_close(ours["grads"][name], grad, rtol=0, atol=0, msg=name)

    # Recomputed FLOPs: one forward of the decoder layers, on both sides; not one more on ours.
    recomputed_ours, recomputed_theirs = ours["flops"] - plain["flops"], theirs["flops"] - plain["flops"]
    assert recomputed_ours > 0
    assert recomputed_ours <= recomputed_theirs, (recomputed_ours, recomputed_theirs)

    # Every aten operator, by name (copies, casts, views, rotary and mask arithmetic, attention
    # kernel, matmuls): what checkpointing adds on our side is at most what it adds on theirs.
    added_ours = ours["ops"] - plain["ops"]
    added_theirs = theirs["ops"] - plain["ops"]
    assert sum(added_ours.values()) > 0
    more = {op: (n, added_theirs[op]) for op, n in added_ours.items() if n > added_theirs[op]}
    assert not more, f"operators memtrain's checkpointing runs more often than transformers' (ours, theirs): {more}"
    # The recompute itself is there: each layer's attention runs once more (SDPA's fused CPU
    # kernel; with dropout SDPA's math path, its softmax and its dropout draw).
    attention = [op for op in plain["ops"] if any(k in op for k in ("scaled_dot_product", "_safe_softmax", "bernoulli"))
                 and "backward" not in op]
    assert attention and all(added_ours[op] == 2 for op in attention), {op: added_ours[op] for op in attention}
    # ... and the loss (its log-softmax over the vocabulary) stays outside the checkpoint.
    assert plain["ops"]["aten._log_softmax.default"] == 1
    assert added_ours["aten._log_softmax.default"] == 0

    # RNG-state saves and restores: one save per checkpointed layer, one restore per recompute.
    assert ours["rng"] == theirs["rng"], (ours["rng"], theirs["rng"])
    # 2 layers: a save at each checkpointed call and fork_rng's save in each recompute
    assert ours["rng"] == {"get_rng_state": 4, "set_rng_state": 4}, ours["rng"]


@pytest.mark.parametrize("family", FAMILIES)
def test_without_gradients_no_layer_enters_the_checkpoint(family, monkeypatch):
    """Evaluation (``torch.no_grad``): transformers runs its layers plainly; memtrain's
    checkpointed layers saved the RNG state at every call (and, on a GPU, the device's)."""
    models = _models(family)
    batch = _batch()
    calls = {}
    for name, model in models.items():
        model.eval()
        with monkeypatch.context() as m, torch.no_grad():
            rng = _rng_calls(m)
            loss = model(*batch)
        calls[name] = (loss, dict(rng))
    assert calls["ours"][1] == calls["theirs"][1] == {}, calls
    assert torch.equal(calls["ours"][0], calls["plain"][0])
