#!/usr/bin/env bash
# The chunked loss's two CUDA kernels side by side in one session: Liger-Kernel's fused linear
# cross-entropy (--loss-kernel liger; needs liger_kernel) and memtrain's own chunked loss (the
# default) at three chunk sizes, against the standard loss, on the seed GPT compiled and on
# Qwen2.5-0.5B eager. One `memtrain train` per row; prints one line per row.
#
# The run recorded in benchmarks/results/gpu-h100/runbook-2026-11-26 used this script at 1baad1a,
# before --loss-kernel existed: Liger ran by default then, and memtrain's kernel ran with Liger
# hidden from the process (sys.modules["liger_kernel"] = None).
#
#   bash benchmarks/loss_kernel_ab.sh OUT_FOLDER
set -u
out=${1:?usage: loss_kernel_ab.sh OUT_FOLDER}
mkdir -p "$out"
seed=(train --device cuda --no-progress --batch-size 64 --seq-len 256 --steps 100 --precision bf16 --attention flash --val-blocks 2 --compile)
qwen=(train --device cuda --no-progress --model qwen2.5-0.5b --precision bf16 --attention sdpa --batch-size 4 --seq-len 1024 --steps 14 --val-blocks 2)
row() {  # row NAME ARGS...
  local name=$1; shift
  local t0=$SECONDS
  python3 -m memtrain "$@" --out "$out/$name" >"$out/$name.log" 2>&1
  local rc=$?
  python3 - "$out/$name/result.json" "$name" "$rc" "$((SECONDS - t0))" <<'PY'
import json, sys
path, name, rc, wall = sys.argv[1:]
try:
    r = json.load(open(path))
except (OSError, ValueError):
    print(f"| {name} | exit {rc} | {wall} s | no result |"); sys.exit()
st, mem, setup = r.get("step_time_s") or {}, r.get("memory") or {}, r.get("setup_time_s") or {}
print(f"| {name} | exit {rc} | {wall} s | step {st.get('median', 0) * 1e3:.2f} ms | first step {setup.get('first_step', 0):.1f} s "
      f"| max allocated {mem.get('max_allocated_bytes', 0) / 2**30:.2f} GiB | data wait {r.get('data_wait_share') or 0:.2%} | val PPL {r.get('val_ppl')} |")
PY
}
row seed-standard "${seed[@]}"
row seed-chunked-liger "${seed[@]}" --loss chunked --loss-kernel liger
row seed-chunked-own-256 "${seed[@]}" --loss chunked
row seed-chunked-own-1024 "${seed[@]}" --loss chunked --loss-chunk 1024
row qwen-standard "${qwen[@]}"
row qwen-chunked-liger "${qwen[@]}" --loss chunked --loss-kernel liger
row qwen-chunked-own-256 "${qwen[@]}" --loss chunked
row qwen-chunked-own-1024 "${qwen[@]}" --loss chunked --loss-chunk 1024
row qwen-chunked-own-4096 "${qwen[@]}" --loss chunked --loss-chunk 4096
