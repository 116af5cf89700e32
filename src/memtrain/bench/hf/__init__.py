"""memtrain vs Hugging Face ``transformers.Trainer`` (+ ``peft``): the same model, tokens and
schedule on both sides, measured by memtrain's own meters, each side in a fresh process.

Run it as ``python benchmarks/compare_hf.py`` or ``python -m memtrain.bench.hf`` (the same flags;
see benchmarks/README.md). One job per module:

    cli.py            flags -> rows -> the loop over rows x repetitions
    rows.py           a row's resolved config + HF plan; the runs.jsonl line (the library's store
                      and config hash)
    mapping.py        memtrain techniques -> TrainingArguments / attn_implementation / peft
    memtrain_side.py  memtrain.training.train.train(cfg) with the lockstep hook (where a step harness plugs in)
    trainer_side.py   transformers.Trainer with memtrain's meters in callbacks
    hf_model.py       the Trainer's model: GPT2LMHeadModel with our GPT's weights (the conversion of
                      :mod:`memtrain.inference.export`), or --model SPEC's model built through memtrain's model seam
    data.py           memtrain's blocks as Trainer examples, in memtrain's batch order
    probe.py          the Trainer's step outside the Trainer (max-batch probes, phase profiles)
    worker.py         one side in one process (training, then the max-batch search)
    lockstep.py       two processes taking turns step by step (no torch import); each runs
                      ``python -m memtrain.bench.hf --worker SIDE SPEC OUT``
    report.py         medians, paired ratios, compare_hf.json / compare_hf.md

Nothing here imports torch at package import (nor do ``memtrain`` and ``memtrain.bench``): a
worker waits for its turn first.
"""
