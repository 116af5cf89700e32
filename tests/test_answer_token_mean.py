"""--loss-on completion with gradient accumulation: a step averages its loss over every answer token
of the accumulated batch, as transformers' Trainer does with ``num_items_in_batch``, not over each
micro-batch's own answers and then over the micro-batches (which made a micro-batch with few answer
tokens weigh as much as one with many)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from memtrain.config.run import build_config
from memtrain.data import make_train_loader
from memtrain.data.device_feed import DeviceFeed
from memtrain.data.loader import IGNORE_INDEX, MicroBatches
from memtrain.techniques import make_precision
from memtrain.training.step import build_state, run_step

CPU = torch.device("cpu")
SEQ = 16
CFG = dict(vocab_size=128, d_model=32, n_heads=4, n_layers=2, d_ff=64, max_seq_len=SEQ, dropout=0.0, seq_len=SEQ,
           optim="sgd", lr=1.0, weight_decay=0.0, warmup_steps=0, grad_clip=0.0, batch_size=2, grad_accum=2)


def _tokens_and_mask(blocks: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Random tokens whose blocks hold very different numbers of answer tokens (1 to 16 of 17)."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 128, blocks * (SEQ + 1)).astype(np.uint16)
    mask = np.zeros(blocks * (SEQ + 1), dtype=np.uint8)
    for b in range(blocks):
        answers = 1 + (b * 5) % 16
        mask[b * (SEQ + 1) + SEQ + 1 - answers:(b + 1) * (SEQ + 1)] = 1
    return tokens, mask


def _state(loss: str):
    cfg = build_config({**CFG, "data": "chat.jsonl", "data_format": "chat", "loss_on": "completion", "loss": loss,
                        "loss_chunk": 8})
    torch.manual_seed(0)
    return build_state(cfg, CPU, make_precision("fp32", CPU))


def _grads_of_one_batch(model: torch.nn.Module, micro: list) -> list[torch.Tensor]:
    """The gradient of the mean loss over every answer token of all ``micro`` batches held as one batch."""
    x = torch.cat([m[0] for m in micro])
    y = torch.cat([m[1] for m in micro])
    model.zero_grad(set_to_none=True)
    model(x, y).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("loss", ["standard", "chunked", "naive"])
def test_an_accumulated_step_is_the_gradient_of_one_batch_holding_its_micro_batches(loss):
    tokens, mask = _tokens_and_mask()
    feed = DeviceFeed(make_train_loader(tokens, SEQ, 2, seed=3, mask=mask), CPU)
    micro = feed.next_group(2)
    counts = [int((y != IGNORE_INDEX).sum()) for _, y in micro]
    assert micro.target_counts == counts and counts[0] != counts[1], counts  # counted on the host, unequal

    state = _state(loss)
    reference = copy.deepcopy(state.model)
    want = _grads_of_one_batch(reference, micro)
    before = [p.detach().clone() for p in state.model.parameters()]
    step_loss = run_step(state, micro)
    with torch.no_grad():
        assert step_loss == pytest.approx(float(reference(torch.cat([m[0] for m in micro]),
                                                          torch.cat([m[1] for m in micro]))), rel=1e-5)
    # SGD at lr 1 without clipping: each parameter moved by minus its gradient.
    got = [b - p.detach() for b, p in zip(before, state.model.parameters())]
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-6, rtol=1e-4)

    # The mean of the two micro-batches' means (what a step did) is another gradient: the test can fail.
    reference.zero_grad(set_to_none=True)
    sum(reference(x, y) / 2 for x, y in micro).backward()
    assert not all(torch.allclose(p.grad, w, atol=1e-6, rtol=1e-4) for p, w in zip(reference.parameters(), want))


def test_a_step_without_any_answer_token_changes_nothing():
    tokens, mask = _tokens_and_mask()
    micro = MicroBatches([(torch.from_numpy(tokens[:32].astype(np.int64)).view(2, SEQ),
                           torch.full((2, SEQ), IGNORE_INDEX))] * 2)
    micro.target_counts = [0, 0]
    state = _state("standard")
    before = [p.detach().clone() for p in state.model.parameters()]
    assert run_step(state, micro) == 0.0
    assert all(torch.equal(b, p) for b, p in zip(before, state.model.parameters()))


@pytest.mark.parametrize("loss", ["standard", "chunked", "naive"])
def test_our_gpts_loss_on_a_micro_batch_without_an_answer_is_zero_with_zero_gradients(loss):
    """Prompt tokens only: a loss kernel would divide 0 by 0 (NaN). The model's own loss is 0 and its
    gradient zero, whatever a step then scales it by (as the transformers model's loss is)."""
    model = _state(loss).model
    x = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(0))
    got = model(x, torch.full((2, SEQ), IGNORE_INDEX))
    got.backward()
    assert float(got) == 0.0
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_text_data_steps_are_bit_for_bit_the_mean_of_micro_batch_means():
    """Text data: no counts are taken and each micro-batch's loss is divided by their number, exactly
    as before answer-token weighting existed (the same bits, not merely close)."""
    tokens, _ = _tokens_and_mask()
    feed = DeviceFeed(make_train_loader(tokens, SEQ, 2, seed=3), CPU)
    micro = feed.next_group(2)
    assert micro.target_counts is None
    cfg = build_config(CFG)
    torch.manual_seed(0)
    state = build_state(cfg, CPU, make_precision("fp32", CPU))
    reference = copy.deepcopy(state.model)
    run_step(state, micro)
    for x, y in micro:  # the step as it was written: loss / N per micro-batch, then SGD at lr 1
        (reference(x, y) / 2).backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= p.grad
    assert all(torch.equal(p, q) for p, q in zip(state.model.parameters(), reference.parameters()))


def _rank_scales(rank: int, world: int, port: int, out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        micro = MicroBatches()
        micro.target_counts = [[3, 9], [20, 0]][rank]
        out.put((rank, [float(s) for s in micro.loss_scales(CPU)]))
    finally:
        dist.destroy_process_group()


def _ddp_rank_step(rank: int, world: int, port: int, out) -> None:
    """One DDP step of rank ``rank`` over its two micro-batches of the shared data; its parameters after."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        state = _state("standard")
        state.model = torch.nn.parallel.DistributedDataParallel(state.model)
        state.no_sync = state.model.no_sync
        tokens, mask = _tokens_and_mask(16)
        micro = DeviceFeed(make_train_loader(tokens, SEQ, 2, seed=3, mask=mask, rank=rank, world_size=world), CPU).next_group(2)
        run_step(state, micro)
        # numpy copies: a tensor would travel as shared memory that dies with this process
        out.put((rank, [p.detach().numpy().copy() for p in state.model.module.parameters()],
                 [(x.numpy().copy(), y.numpy().copy()) for x, y in micro]))
    finally:
        dist.destroy_process_group()


def _spawn(target, world: int = 2) -> dict:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict((r, rest) for r, *rest in (out.get(timeout=180) for _ in procs))
    for p in procs:
        p.join(timeout=60)
    return got


def test_a_ddp_step_is_the_gradient_of_one_batch_holding_every_ranks_micro_batches():
    """Two DDP ranks (gloo), two micro-batches each, unequal answer counts: the step moves the
    weights by the gradient of the mean over all answer tokens of the four micro-batches."""
    got = _spawn(_ddp_rank_step)
    micro = [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in got[0][1] + got[1][1]]
    # Unequal within a rank and between the ranks (a rank-local mean would then be another gradient).
    assert len({int((y != IGNORE_INDEX).sum()) for _, y in micro}) > 1
    assert sum(int((y != IGNORE_INDEX).sum()) for _, y in micro[:2]) != sum(int((y != IGNORE_INDEX).sum()) for _, y in micro[2:])
    state = _state("standard")
    want = _grads_of_one_batch(copy.deepcopy(state.model), micro)
    for params in (got[0][0], got[1][0]):
        for before, after, w in zip(state.model.parameters(), params, want):
            assert torch.allclose(before.detach() - torch.from_numpy(after), w, atol=1e-6, rtol=1e-4)


def test_data_parallel_ranks_weigh_their_micro_batches_by_the_global_answer_count():
    """Two gloo ranks with 12 and 20 answer tokens: each micro-batch's loss is scaled by
    count * ranks / 32 (the Trainer's average_tokens_across_devices, its default), so the ranks'
    averaged gradients are the mean over all 32 answer tokens."""
    got = {r: v[0] for r, v in _spawn(_rank_scales).items()}
    assert got[0] == pytest.approx([3 * 2 / 32, 9 * 2 / 32]) and got[1] == pytest.approx([20 * 2 / 32, 0.0])


def test_a_transformers_models_accumulated_step_is_the_trainers(tmp_path):
    """A tiny Qwen2 trained by memtrain: the step's gradient equals the Trainer's, whose micro-batch
    losses are the model's own loss with ``num_items_in_batch`` (the step's answer-token count), summed."""
    pytest.importorskip("transformers")
    from test_chat_data import CHATML, _chat_folder

    model_dir = _chat_folder(tmp_path / "qwen2", CHATML)
    cfg = build_config({"model": str(model_dir), "data": "chat.jsonl", "data_format": "chat", "loss_on": "completion",
                        "seq_len": SEQ, "optim": "sgd", "lr": 1.0, "weight_decay": 0.0, "warmup_steps": 0,
                        "grad_clip": 0.0, "batch_size": 2, "grad_accum": 2, "dropout": 0.0})
    torch.manual_seed(0)
    state = build_state(cfg, CPU, make_precision("fp32", CPU))
    tokens, mask = _tokens_and_mask()
    micro = DeviceFeed(make_train_loader(tokens, SEQ, 2, seed=3, mask=mask), CPU).next_group(2)
    lm = copy.deepcopy(state.model.lm)
    items = torch.tensor(sum(micro.target_counts))
    for x, y in micro:  # the Trainer's training_step: loss already divided by num_items_in_batch
        lm(input_ids=x, labels=y, shift_labels=y, num_items_in_batch=items).loss.backward()
    before = [p.detach().clone() for p in state.model.lm.parameters()]
    run_step(state, micro)
    moved = [b - p.detach() for b, p in zip(before, state.model.lm.parameters())]
    for (name, p), g in zip(lm.named_parameters(), moved):
        want = p.grad if p.grad is not None else torch.zeros_like(p)
        assert torch.allclose(g, want, atol=1e-6, rtol=1e-4), name


class _Engine:
    """What deepspeed_train_step uses of DeepSpeed's engine: a forward returning the micro-batch's
    mean loss, a backward that divides by the accumulation steps (as the engine's does) and a step."""

    def __init__(self, losses: list[float], steps: int) -> None:
        self.losses, self.steps, self.backed = iter(losses), steps, []

    def __call__(self, x, y):
        return torch.tensor(next(self.losses), requires_grad=True)

    def backward(self, loss):
        self.backed.append(float(loss) / self.steps)

    def step(self):
        pass


def test_deepspeeds_step_weighs_micro_batches_by_their_answer_tokens():
    """The engine divides each micro-batch's loss by the accumulation steps itself: the step hands
    it count_i / total x steps, so what it back-propagates sums to the mean over all answer tokens."""
    from memtrain.distributed.deepspeed_engine import deepspeed_train_step

    micro = MicroBatches([(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long))] * 2)
    micro.target_counts = [1, 3]
    engine = _Engine([2.0, 6.0], steps=2)  # means over 1 and 3 answer tokens: sums 2 and 18
    loss = deepspeed_train_step(engine, micro, None, None, 0.0, CPU)
    assert sum(engine.backed) == pytest.approx((2.0 + 18.0) / 4) and loss == pytest.approx(5.0)
    plain = _Engine([2.0, 6.0], steps=2)  # text data: the engine's own mean of the micro-batches
    assert deepspeed_train_step(plain, [(x, y) for x, y in micro], None, None, 0.0, CPU) == pytest.approx(4.0)
    assert sum(plain.backed) == pytest.approx(4.0)
