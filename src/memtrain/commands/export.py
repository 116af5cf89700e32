"""`memtrain export`: a checkpoint as a transformers-loadable model directory (or a peft adapter)."""

from __future__ import annotations

import argparse

from memtrain.cli import register
from memtrain.config.argtypes import user_path
from memtrain.errors import one_line
from memtrain.training.preflight import check_writable_dir


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", type=user_path, help="Checkpoint file written by `memtrain train --save`.")
    p.add_argument("out_dir", type=user_path, help="New directory: config.json, model.safetensors, generation_config.json and the tokenizer files "
                   "(memtrain's GPT: GPT2LMHeadModel with GPT-2's tokenizer; a transformers --model: its own "
                   "architecture, tokenizer and generation settings, GPT-2's tokenizer when its folder had none).")
    p.add_argument("--adapter-only", action="store_true", default=False,
                   help="For a transformers --model trained with --lora-rank: write the LoRA adapter as a peft adapter "
                   "(adapter_config.json, adapter_model.safetensors) for PeftModel.from_pretrained(base, OUT_DIR), "
                   "instead of merging it into the weights (the default). The base is the --model folder the run "
                   "started from; its weights must be unchanged.")


# The adapters of a --qlora run learnt to correct the NF4-rounded base, not the full-precision one
# from_pretrained loads: there the model is another one (a tiny Llama's logits moved 0.2 apart, more
# than the adapters' own effect), which nothing in the adapter folder records.
QLORA_ADAPTER_NOTE = ("note: these adapters were trained on the base in NF4 (--qlora); on the base loaded in full "
                      "precision the logits differ from the trained model's: load the base in 4-bit NF4 (e.g. "
                      "BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4')), or export without "
                      "--adapter-only (the NF4 base dequantized, the adapters merged: the trained model's logits)")

# Likewise a --precision bf16-pure run's adapters learnt on the base rounded to bf16; from_pretrained
# loads it in float32 by default, the weights before that rounding. A tiny Llama's logits moved 0.002
# (tests/test_export_transformers.py); loaded in bf16, then .float(), the weights are the trained ones.
BF16_PURE_ADAPTER_NOTE = ("note: these adapters were trained on the base rounded to bf16 (--precision bf16-pure); on "
                          "the base loaded in float32 (from_pretrained's default) the logits differ from the trained "
                          "model's by that rounding: load the base with torch_dtype=torch.bfloat16 (then .float() "
                          "for float32 arithmetic on exactly the trained weights), or export without --adapter-only")


def adapter_note(res: dict) -> str | None:
    """The note an --adapter-only export needs when the run's base was stored rounded (NF4, bf16).
    A --qlora run that quantized no weight (each too small for NF4's blocks) trained on the base as
    from_pretrained loads it: the NF4 note would send the user to a 4-bit base it never had."""
    if res["qlora"] and res.get("quantized_weights", 1):
        return QLORA_ADAPTER_NOTE
    if res.get("precision") == "bf16-pure":
        return BF16_PURE_ADAPTER_NOTE
    return None


def run(args: argparse.Namespace) -> int:
    from memtrain.inference.export import export_hf  # torch-free --help/estimate/plan

    # A file in the way or a read-only place: one line (exit 2) before the checkpoint is read.
    check_writable_dir(args.out_dir, "OUT_DIR")
    res = export_hf(args.checkpoint, args.out_dir, adapter_only=args.adapter_only)
    if args.adapter_only:
        print(f"wrote {one_line(str(res['out']))}: {res['kind']}, {res['parameters']:,} parameters; load with "
              f"peft.PeftModel.from_pretrained(base_model, {res['out']!r})")
        if (note := adapter_note(res)) is not None:
            print(note)
        return 0
    merged = " (LoRA merged)" if res["lora_merged"] else ""
    print(f"wrote {one_line(str(res['out']))}: {res['kind']}, {res['parameters']:,} parameters{merged}; "
          f"load with transformers.AutoModelForCausalLM.from_pretrained({res['out']!r})")
    return 0


register("export", "Export a checkpoint as a Hugging Face transformers model directory (safetensors + tokenizer): "
         "memtrain's GPT as GPT2LMHeadModel, a transformers --model as its own architecture; LoRA merged, or a peft "
         "adapter with --adapter-only. QLoRA's NF4 base weights (CPU) are dequantized before the merge.",
         add_args, run)
