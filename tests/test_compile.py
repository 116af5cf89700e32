"""torch.compile: compiled models match eager, in both scopes, with checkpointing on.

The fast tests trace with the ``aot_eager`` backend (dynamo + AOTAutograd, the parts that
must understand checkpointing and the chunked loss); the ``slow`` ones run inductor, which
generates and builds C++ kernels on CPU (minutes on two cores).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from memtrain.config.run import ConfigError, ModelConfig, TechniqueConfig
from memtrain.models.gpt import GPT
from memtrain.techniques.checkpointing import apply_checkpointing
from memtrain.techniques.compile import apply_compile, has_cpp_compiler
from memtrain.techniques.loss import apply_loss

CFG = ModelConfig(vocab_size=512, d_model=64, n_heads=4, n_layers=2, d_ff=128, max_seq_len=64, dropout=0.0)


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # conftest.py: counts are each test's own


@pytest.fixture(scope="module")
def base() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def two_steps(model: torch.nn.Module) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """Loss and gradients of two SGD steps on fixed batches."""
    g = torch.Generator().manual_seed(3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for _ in range(2):
        x, y = torch.randint(0, 512, (2, 32), generator=g), torch.randint(0, 512, (2, 32), generator=g)
        loss = model(x, y)
        loss.backward()
        out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


def prepared(base: GPT, backend: str, **tech) -> tuple[GPT, torch.nn.Module]:
    t = TechniqueConfig(compile=True, **tech)
    model = copy.deepcopy(base)
    apply_checkpointing(model, t)
    apply_loss(model, t, torch.device("cpu"))
    return model, apply_compile(model, t, backend=backend)


def assert_matches_eager(base: GPT, compiled: torch.nn.Module, **tech) -> None:
    eager = copy.deepcopy(base)
    apply_loss(eager, TechniqueConfig(**{k: v for k, v in tech.items() if k.startswith("loss")}), torch.device("cpu"))
    for (l_ref, g_ref), (loss, g) in zip(two_steps(eager), two_steps(compiled)):
        torch.testing.assert_close(loss, l_ref, rtol=1e-5, atol=1e-5)
        for name in g_ref:
            torch.testing.assert_close(g[name], g_ref[name], rtol=1e-5, atol=1e-5, msg=name)
    assert counters["stats"]["unique_graphs"] >= 1, "nothing was compiled"
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize(
    "tech",
    [
        {"compile_scope": "model"},
        {"compile_scope": "block"},
        {"compile_scope": "model", "checkpointing": "full", "loss": "chunked", "loss_chunk": 24},
        {"compile_scope": "block", "checkpointing": "selective"},
    ],
    ids=["model", "block", "model-full-chunked", "block-selective"],
)
def test_traced_matches_eager(base, tech):
    model, compiled = prepared(base, "aot_eager", **tech)
    assert compiled is model  # compiled in place: still a GPT
    assert_matches_eager(base, compiled, **tech)


def test_in_place_keeps_names_and_attributes(base):
    model, compiled = prepared(base, "aot_eager", compile_scope="model", checkpointing="full")
    assert isinstance(compiled, GPT)
    assert list(compiled.state_dict()) == list(base.state_dict())
    assert compiled.loss_fn is model.loss_fn and callable(compiled.hidden_states)
    assert model._compiled_call_impl is not None
    _, per_block = prepared(base, "aot_eager", compile_scope="block")
    assert per_block._compiled_call_impl is None
    assert all(b._compiled_call_impl is not None for b in per_block.blocks)


def test_off_is_a_no_op(base):
    model = copy.deepcopy(base)
    assert apply_compile(model, TechniqueConfig(compile=False)) is model
    assert model._compiled_call_impl is None


def test_cpu_without_cpp_compiler_is_a_config_error(base, monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr("shutil.which", lambda name: None)
    assert not has_cpp_compiler()
    with pytest.raises(ConfigError, match="C\\+\\+ compiler"):
        apply_compile(copy.deepcopy(base), TechniqueConfig(compile=True))


@pytest.mark.slow
@pytest.mark.skipif(not has_cpp_compiler(), reason="inductor on CPU needs a C++ compiler")
@pytest.mark.parametrize(
    "tech",
    [{"compile_scope": "model"}, {"compile_scope": "block", "checkpointing": "full"}],
    ids=["model", "block-full"],
)
def test_inductor_matches_eager(base, tech):
    _, compiled = prepared(base, "inductor", **tech)
    assert_matches_eager(base, compiled, **tech)
