"""The host's cost per training step: memtrain's loop against a plain PyTorch loop and HF Trainer.

    python benchmarks/step_overhead.py [--steps 200] [--skip 20] [--repeats 5] [--log-every 1] [--no-hf]
        [--profile N]

On a model so small that its arithmetic is negligible (d_model 8, one layer, sequence 8,
batch 1), a step's wall time is the host's work: the framework's Python, its hooks, meters,
logging and data handling. On a GPU that time is what a step of a few milliseconds cannot
hide. Three loops train the same model for ``--steps`` steps, side by side in one process:

- ``memtrain``: :func:`memtrain.training.train.train` (the ``memtrain train`` loop: its loader,
  timer, metered first steps, a metrics.jsonl line every ``--log-every`` steps, 1 by default as in
  ``memtrain train``);
- ``plain``: the same model, optimizer, schedule and clipping (built by memtrain's step harness)
  under the loop a PyTorch tutorial writes: forward, backward, clip, step, schedule, zero_grad,
  losses kept on the device and read once at the end; its batches are made beforehand;
- ``trainer``: ``transformers.Trainer`` on a tiny Llama of the same size (its own model built
  from the same config; ``logging_strategy="no"``), and memtrain and the plain loop on that same
  transformers model.

Each loop's ms/step is the wall time from the end of step ``--skip`` to the end of the last
step, over those steps (the first steps build optimizer state and run memtrain's meters). The
minimum over ``--repeats`` runs is printed, with the ratio to the plain loop. ``--profile N``
then runs memtrain's loop once more under cProfile and prints its N most costly functions of
its own. The output names the command, commit, CPU and torch.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from memtrain.config.run import RunConfig, build_config
from memtrain.devices.probe import cpu_model
from memtrain.runtime.env import git_commit
from memtrain.training.step import build_state, random_micro_batches
from memtrain.training.train import train

TINY_GPT = {"d_model": 8, "n_heads": 1, "n_layers": 1, "d_ff": 32, "max_seq_len": 8, "dropout": 0.0}
# A Llama of the same size, for the Trainer (transformers' config.json keys).
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8,
              "intermediate_size": 32, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 8,
              "num_hidden_layers": 1, "max_position_embeddings": 16, "vocab_size": 50257, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": True, "bos_token_id": 50256, "eos_token_id": 50256}
RUN = {"batch_size": 1, "seq_len": 8, "warmup_steps": 1, "val_blocks": 1, "progress": False, "device": "cpu",
       "warmup_timing_steps": 2}


def _ms_per_step(marks: list[float], skip: int) -> float:
    """Wall ms per step from the end of step ``skip`` to the end of the last one."""
    return (marks[-1] - marks[skip - 1]) / (len(marks) - skip) * 1e3


def memtrain_loop(cfg: RunConfig, skip: int) -> float:
    """ms/step of ``memtrain train``'s loop (library call; metrics lines when --log-every asks)."""
    marks: list[float] = []
    train(cfg, log_metrics=True, on_step=lambda done, total, median: marks.append(time.perf_counter()))
    return _ms_per_step(marks, skip)


def profile_memtrain_loop(cfg: RunConfig, top: int) -> None:
    """cProfile of one ``memtrain train`` loop (the steps only, not the setup or the result):
    the ``top`` functions of memtrain and the standard library's json by their own time per step."""
    import cProfile  # only for --profile
    import pstats  # only for --profile

    from memtrain.training import train as train_module  # the loop's class, to profile it alone

    profiler, real_run = cProfile.Profile(), train_module._Loop.run

    def profiled(loop: Any, *args: Any, **kwargs: Any) -> None:
        profiler.enable()
        try:
            real_run(loop, *args, **kwargs)
        finally:
            profiler.disable()

    train_module._Loop.run = profiled  # type: ignore[method-assign]
    try:
        train(cfg, log_metrics=True)
    finally:
        train_module._Loop.run = real_run  # type: ignore[method-assign]
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    rows = sorted(((tt, nc, f"{Path(file).name}:{line}({name})") for (file, line, name), (_, nc, tt, _, _)
                   in stats.items() if "memtrain" in file or "json" in file), reverse=True)[:top]
    print(f"memtrain's own functions in {cfg.train.steps} steps under cProfile (own time, µs per step):")
    for tt, calls, where in rows:
        print(f"  {tt / cfg.train.steps * 1e6:8.1f}  {calls:6d} calls  {where}")


def plain_loop(cfg: RunConfig, skip: int) -> float:
    """ms/step of a plain PyTorch loop over the same model, optimizer, schedule and clipping."""
    torch.manual_seed(cfg.train.seed)
    state = build_state(cfg, torch.device("cpu"), schedule=True)
    g = torch.Generator().manual_seed(0)
    batches = [random_micro_batches(cfg, 1, torch.device("cpu"), g)[0] for _ in range(cfg.train.steps)]
    model, opt, sched = state.model, state.optimizer, state.scheduler
    params = [p for p in model.parameters() if p.requires_grad]
    losses, marks = [], []
    for x, y in batches:
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        marks.append(time.perf_counter())
    torch.stack(losses).tolist()
    return _ms_per_step(marks, skip)


def trainer_loop(cfg: RunConfig, skip: int, out: str) -> float:
    """ms/step of ``transformers.Trainer`` on ``cfg``'s transformers model, logging off."""
    # transformers loads only for the rows that need it (--no-hf runs without it)
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    class Marks(TrainerCallback):
        def __init__(self) -> None:
            self.marks: list[float] = []

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.marks.append(time.perf_counter())

    torch.manual_seed(cfg.train.seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.model.model))
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": x[0], "labels": x[0]}
            for x, _ in (random_micro_batches(cfg, 1, torch.device("cpu"), g)[0] for _ in range(cfg.train.steps))]
    t = cfg.train
    args = TrainingArguments(output_dir=out, max_steps=t.steps, per_device_train_batch_size=1, learning_rate=t.lr,
                             weight_decay=t.weight_decay, adam_beta2=t.beta2, max_grad_norm=t.grad_clip,
                             warmup_steps=t.warmup_steps, lr_scheduler_type="cosine", logging_strategy="no",
                             save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True,
                             use_cpu=True, dataloader_pin_memory=False, train_sampling_strategy="sequential")
    marks = Marks()
    Trainer(model=model, args=args, train_dataset=data, callbacks=[marks]).train()
    return _ms_per_step(marks.marks, skip)


def tiny_tokenizer_model(folder: Path, corpus: str) -> None:
    """A transformers model folder: the tiny Llama and a byte-level BPE tokenizer of a few hundred
    ids trained on ``corpus`` (with GPT-2's 50257 ids the LM head alone is most of the step)."""
    # tokenizers and transformers load only for the rows that need them (--no-hf runs without them)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([corpus], trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(str(folder))
    config = {**TINY_LLAMA, "vocab_size": tok.get_vocab_size(), "bos_token_id": 0, "eos_token_id": 0}
    (folder / "config.json").write_text(json.dumps(config))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="optimizer steps a loop runs, each repeat (default 200)")
    p.add_argument("--skip", type=int, default=20,
                   help="steps left out at the start (optimizer state, meters) (default 20)")
    p.add_argument("--repeats", type=int, default=5,
                   help="runs of each loop, interleaved; the table shows the best (default 5)")
    p.add_argument("--log-every", type=int, default=1, help="memtrain's metrics.jsonl line every N steps (default 1)")
    p.add_argument("--no-hf", action="store_true", help="leave out the transformers rows")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also print the N memtrain functions with the most own time per step (cProfile; default 0: none)")
    return p


def main() -> None:
    p = _parser()
    args = p.parse_args()
    if not 1 <= args.skip < args.steps:
        p.error(f"--skip {args.skip} must be at least 1 and below --steps {args.steps}")
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats} must be at least 1")
    torch.set_num_threads(1)  # the host's own work, not how a kernel spreads over cores
    warnings.filterwarnings("ignore")
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        text = "the quick brown fox jumps over the lazy dog. " * 200
        corpus = Path(tmp, "corpus.txt")
        corpus.write_text((text + "\n\n") * 100)
        base = {**RUN, "steps": args.steps, "data": str(corpus), "log_every": args.log_every,
                "cache_dir": str(Path(tmp, "cache"))}
        sides: list[tuple[str, dict[str, Any]]] = [("GPT, vocab 50257", TINY_GPT)]
        if not args.no_hf:
            tiny_tokenizer_model(Path(tmp), text)
            sides.append(("Llama, vocab 289", {"model": tmp}))
        runs = iter(range(10**6))  # a fresh --out for every memtrain run

        def cfg(model: dict[str, Any]) -> RunConfig:
            return build_config({**base, **model, "out": str(Path(tmp, f"run{next(runs)}"))})

        for _ in range(args.repeats):  # interleaved: a neighbour's load falls on every loop alike
            for name, model in sides:
                times.setdefault(f"{name}: plain PyTorch loop", []).append(plain_loop(cfg(model), args.skip))
                times.setdefault(f"{name}: memtrain train", []).append(memtrain_loop(cfg(model), args.skip))
                if "model" in model:
                    times.setdefault(f"{name}: transformers.Trainer", []).append(
                        trainer_loop(cfg(model), args.skip, str(Path(tmp, "hf"))))
        if args.profile:
            profile_memtrain_loop(cfg(sides[-1][1]), args.profile)
    print(f"command: python benchmarks/{Path(__file__).name} {' '.join(sys.argv[1:])}".rstrip())
    print(f"commit: {git_commit()}; torch {torch.__version__}; {platform.python_implementation()} "
          f"{platform.python_version()}; CPU: {cpu_model()} ({os.cpu_count()} cores, 1 intra-op thread)")
    print(f"ms per step over steps {args.skip + 1}-{args.steps}, best of {args.repeats} (all runs in brackets):")
    print("| loop | ms/step | vs plain | runs |\n|---|---:|---:|---|")
    for label, xs in times.items():
        plain = min(times[label.split(":")[0] + ": plain PyTorch loop"])
        print(f"| {label} | {min(xs):.3f} | {min(xs) / plain:.2f} | {', '.join(f'{x:.2f}' for x in xs)} |")



if __name__ == "__main__":
    main()
