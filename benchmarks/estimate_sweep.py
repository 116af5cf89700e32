"""A random sweep of small transformers configurations: the analytic estimate against the trace.

Each configuration (family, width, heads, k/v heads, depth, MLP width, vocabulary, tied head,
attention dropout; batch, tokens, precision, attention, checkpointing, loss, gradient
accumulation, LoRA) is drawn from ``--seed``, written as a config.json in a scratch folder,
estimated analytically and traced; one JSON line per configuration goes to ``--out`` (its phase
peaks, or why it was refused), and the cases outside 1% in the forward, the backward or the
optimizer step (where the trace is no upper bound) are printed at the end.

    python benchmarks/estimate_sweep.py --seed 8282 --count 260 --out /tmp/sweep8282.jsonl
    python benchmarks/estimate_sweep.py --seed 8181 --count 400 --head-dims 2,4,6,8,16 \\
        --checkpointing every:1,every:2,every:3,sqrt,sqrt,selective,selective,selective-matmul \\
        --out /tmp/sweep8181.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import transformers

from memtrain.analysis.estimate.hf import analytic_estimate
from memtrain.analysis.trace import trace_step
from memtrain.config.run import ConfigError, build_config

CONFIGS = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "mistral": "MistralConfig", "phi3": "Phi3Config",
           "gemma": "GemmaConfig", "gpt2": "GPT2Config"}
IDS = {"pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0}  # (Phi-3's and GPT-2's defaults exceed a tiny vocabulary)
PHASES = ("forward", "backward", "optimizer")


def sample(r: random.Random, head_dims: list[int], checkpointing: list[str]) -> tuple[str, dict, dict]:
    """One configuration: (family, config.json fields, run settings)."""
    fam = r.choice(list(CONFIGS))
    nh = r.choice([1, 1, 2, 3, 4])
    hd = r.choice(head_dims)
    h = nh * hd
    kv = r.choice([k for k in range(1, nh + 1) if nh % k == 0])
    layers = r.randint(1, 4)
    ff = r.choice([3, 8, 20, 2 * h + 8, 4 * h])
    vocab = r.choice([17, 61, 130, 257, 301])
    tied = r.choice([True, False])
    if fam == "gpt2":
        fields: dict[str, Any] = {"n_embd": h, "n_inner": ff, "n_layer": layers, "n_head": nh, "vocab_size": vocab,
                                  "tie_word_embeddings": tied}
    else:
        fields = {"hidden_size": h, "intermediate_size": ff, "num_hidden_layers": layers, "num_attention_heads": nh,
                  "num_key_value_heads": kv, "vocab_size": vocab, "tie_word_embeddings": tied}
        if fam == "gemma":
            fields["head_dim"] = hd
    if r.random() < 0.15 and fam != "gpt2":
        fields["attention_dropout"] = 0.1
    ck = r.choice(checkpointing)
    precision = r.choice(["fp32", "bf16", "bf16-pure", "fp16"])
    tech: dict[str, Any] = {"batch_size": r.randint(1, 5), "seq_len": r.choice([1, 2, 3, 5, 9, 17, 24]),
                            "precision": precision, "attention": r.choice(["sdpa", "math"]), "checkpointing": ck,
                            "loss": r.choice(["standard", "chunked"]), "grad_accum": r.choice([1, 2, 3])}
    if tech["loss"] == "chunked":
        tech["loss_chunk"] = r.choice([1, 5, 7, 50])
    if r.random() < 0.5:
        tech["lora_rank"] = r.choice([1, 2, 4, 8])
        if r.random() < 0.3:
            tech["lora_dropout"] = 0.1
    return fam, fields, tech


def compare(fam: str, fields: dict, tech: dict, scratch: Path) -> dict[str, Any]:
    """The estimate's and the trace's phase peaks of one configuration (or why it was not compared)."""
    d = Path(tempfile.mkdtemp(dir=scratch))
    ids = IDS if fam in ("phi3", "gpt2") else {}
    positions = "n_positions" if fam == "gpt2" else "max_position_embeddings"
    getattr(transformers, CONFIGS[fam])(**{positions: 128, **ids, **fields}).save_pretrained(d)
    try:
        cfg = build_config({"model": str(d), "device": "cpu", **tech})
    except ConfigError as e:  # refused as configured (a LoRA rank above the width, ...)
        return {"status": "refused", "error": str(e)}
    est = analytic_estimate(cfg, "cpu")
    if est is None:
        return {"status": "not-analytic"}
    traced = trace_step(cfg, "cpu")
    return {"status": "ok", "upper_bound": traced.get("optimizer_step"),
            "bytes": {ph: [est.phase_peaks[ph], traced["phase_peaks"][ph]] for ph in PHASES}}


def outside(rec: dict, tolerance: float = 0.01) -> dict[str, float]:
    """A compared record's phases outside ``tolerance`` (the optimizer's only where the trace is exact)."""
    errs = {ph: a / t - 1 for ph, (a, t) in rec.get("bytes", {}).items()}
    return {ph: e for ph, e in errs.items() if abs(e) >= tolerance and not (ph == "optimizer" and rec["upper_bound"])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, required=True, help="the sweep's random seed")
    ap.add_argument("--count", type=int, default=100, help="how many configurations (default 100)")
    ap.add_argument("--head-dims", default="4,6,8,16,32", help="head widths to draw from (default 4,6,8,16,32)")
    ap.add_argument("--checkpointing", default="every:1,every:2,every:3,sqrt,sqrt,selective-matmul,selective-matmul",
                    help="--checkpointing values to draw from (a value twice: drawn twice as often)")
    ap.add_argument("--out", type=Path, required=True, help="JSONL file the records are appended to")
    args = ap.parse_args(argv)
    if args.out.exists() and not args.out.is_file():
        print(f"error: --out {args.out} is not a file; name a .jsonl file", file=sys.stderr)
        return 2
    r = random.Random(args.seed)
    head_dims = [int(x) for x in args.head_dims.split(",")]
    checkpointing = args.checkpointing.split(",")
    bad = []
    with tempfile.TemporaryDirectory() as scratch, args.out.open("a") as f:
        for i in range(args.count):
            fam, fields, tech = sample(r, head_dims, checkpointing)
            rec = {"i": i, "seed": args.seed, "fam": fam, "fields": fields, "tech": tech,
                   **compare(fam, fields, tech, Path(scratch))}
            f.write(json.dumps(rec) + "\n")
            f.flush()
            if outside(rec):
                bad.append(rec)
    for rec in bad:
        print(rec["i"], rec["fam"], rec["fields"], rec["tech"], {k: f"{v:+.2%}" for k, v in outside(rec).items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
