"""`memtrain export`: a checkpoint as a transformers-loadable GPT2LMHeadModel directory."""

from __future__ import annotations

import argparse

from memtrain.cli import register
from memtrain.preflight import check_writable_dir


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="Checkpoint file written by `memtrain train --save`.")
    p.add_argument("out_dir", help="New directory: config.json, model.safetensors and GPT-2 tokenizer files.")


def run(args: argparse.Namespace) -> int:
    from memtrain.export import export_hf  # torch-free --help/estimate/plan

    # A file in the way or a read-only place: one line (exit 2) before the checkpoint is read.
    check_writable_dir(args.out_dir, "OUT_DIR")
    res = export_hf(args.checkpoint, args.out_dir)
    merged = " (LoRA merged)" if res["lora_merged"] else ""
    print(f"wrote {res['out']}: GPT2LMHeadModel, {res['parameters']:,} parameters{merged}; "
          f"load with transformers.AutoModelForCausalLM.from_pretrained({res['out']!r})")
    return 0


register("export", "Export a checkpoint as a Hugging Face transformers model directory (GPT2LMHeadModel, safetensors).",
         add_args, run)
