"""The chunked LM-head loss is compilable and its GPU path computes what the eager path does."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import memtrain.techniques.loss as loss_module
from memtrain.config.run import build_config
from memtrain.techniques import make_precision
from memtrain.techniques.facts import aligned_vocab
from memtrain.techniques.loss import IGNORE_INDEX, _chunk_body, chunked_lm_loss
from memtrain.training.step import build_state, random_micro_batches

CPU = torch.device("cpu")


def _inputs(n=96, d=16, v=301, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, requires_grad=True)
    weight = torch.randn(v, d, generator=g, requires_grad=True)
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::7] = IGNORE_INDEX
    return hidden, weight, targets


def _loss_and_grads(fn, hidden, weight, targets):
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    loss = fn(h, w, targets)
    loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("kernel", ["eager", "aot_eager"])
def test_the_fused_chunk_kernel_matches_the_standard_loss(monkeypatch, kernel):
    """The one-call chunk body that CUDA compiles, run here eagerly and through dynamo +
    AOTAutograd, gives the standard loss's value and gradients."""
    fn = _chunk_body if kernel == "eager" else torch.compile(_chunk_body, backend="aot_eager")
    monkeypatch.setattr(loss_module, "_fused_chunk_body", lambda hidden: fn)
    hidden, weight, targets = _inputs()
    ref = _loss_and_grads(lambda h, w, t: F.cross_entropy(h @ w.t(), t, ignore_index=IGNORE_INDEX),
                          hidden, weight, targets)
    got = _loss_and_grads(functools.partial(chunked_lm_loss, chunk=40), hidden, weight, targets)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_fused_path_lays_the_logits_out_aligned_and_masks_the_padding(monkeypatch):
    """The fused (CUDA) path computes the logits ALIGN_VOCAB columns wide: a 301-token head runs
    as 320 columns; the 19 padding columns change neither the loss nor a gradient, and the
    weight's gradient comes back with the head's own 301 rows."""
    widths: list[int] = []

    def recording(h, w, *rest):
        widths.append(w.shape[0])
        return _chunk_body(h, w, *rest)

    monkeypatch.setattr(loss_module, "_fused_chunk_body", lambda hidden: recording)
    hidden, weight, targets = _inputs(v=301)
    ref = _loss_and_grads(lambda h, w, t: F.cross_entropy(h @ w.t(), t, ignore_index=IGNORE_INDEX),
                          hidden, weight, targets)
    got = _loss_and_grads(functools.partial(chunked_lm_loss, chunk=40), hidden, weight, targets)
    assert set(widths) == {aligned_vocab(301)} == {320}
    assert got[2].shape == weight.shape
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # Under BF16 autocast: the same as the unaligned eager loop, to rounding.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _loss_and_grads(functools.partial(chunked_lm_loss, chunk=40), hidden, weight, targets)
        monkeypatch.setattr(loss_module, "_fused_chunk_body", lambda hidden: None)
        ref = _loss_and_grads(functools.partial(chunked_lm_loss, chunk=40), hidden, weight, targets)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2 * float(b.abs().max()))


def test_the_fused_kernel_is_used_only_on_real_cuda_tensors():
    hidden, _, _ = _inputs()
    assert loss_module._fused_chunk_body(hidden) is None  # CPU: the in-place eager loop


def _compiled_step_graphs(chunk: int) -> tuple[list[torch.fx.GraphModule], float, float]:
    cfg = build_config({"d_model": 32, "n_heads": 4, "n_layers": 2, "d_ff": 64, "max_seq_len": 64, "seq_len": 64,
                        "batch_size": 4, "dropout": 0.0, "loss": "chunked", "loss_chunk": chunk, "device": "cpu"})
    graphs: list[torch.fx.GraphModule] = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.manual_seed(0)
    state = build_state(cfg, CPU, make_precision("fp32", CPU))
    x, y = random_micro_batches(cfg, 4, CPU, generator=torch.Generator().manual_seed(1))[0]
    eager = state.model(x, y).item()
    torch._dynamo.reset()
    state.model.compile(backend=recording_backend)
    compiled = state.model(x, y)
    compiled.backward()
    return graphs, eager, compiled.item()


def _all_nodes(graphs: list[torch.fx.GraphModule]) -> list[torch.fx.Node]:
    """Every node of the captured graphs and of their subgraphs (an autograd.Function's body)."""
    return [n for g in graphs for m in g.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes]


def test_compile_keeps_the_chunk_loop_one_opaque_node():
    """Under --compile the chunk loop is one operator in one graph: no captured graph holds the
    loss's log-sum-exp, the graph does not grow with the number of chunks (256 tokens in chunks
    of 16 would otherwise unroll 16 copies of the loss), there is no graph break, and the
    compiled loss equals the eager one."""
    sizes = {}
    for chunk in (16, 128):
        graphs, eager, compiled = _compiled_step_graphs(chunk)
        assert len(graphs) == 1, "one graph: no break at the loss"
        nodes = _all_nodes(graphs)
        targets = [str(n.target) for n in nodes]
        assert not any("logsumexp" in t for t in targets), targets
        assert any("chunked_linear_cross_entropy" in t for t in targets), targets
        sizes[chunk] = len(nodes)
        assert compiled == pytest.approx(eager, rel=1e-6)
    assert sizes[16] == sizes[128]
