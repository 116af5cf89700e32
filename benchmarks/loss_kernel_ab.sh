#!/usr/bin/env bash
# The chunked loss's two CUDA kernels side by side in one session: Liger-Kernel's fused linear
# cross-entropy (what --loss chunked runs when liger_kernel is installed) and memtrain's own
# chunked loss (Liger hidden from the process), against the standard loss, on the seed GPT
# compiled and on Qwen2.5-0.5B eager. One `memtrain train` per row; prints one line per row.
#
#   bash benchmarks/loss_kernel_ab.sh OUT_FOLDER
set -u
out=${1:?usage: loss_kernel_ab.sh OUT_FOLDER}
mkdir -p "$out"
hide_liger='import sys, runpy; sys.modules["liger_kernel"] = None; sys.argv = ["memtrain", *sys.argv[1:]]; runpy.run_module("memtrain", run_name="__main__", alter_sys=True)'
seed=(train --device cuda --no-progress --batch-size 64 --seq-len 256 --steps 100 --precision bf16 --attention flash --val-blocks 2 --compile)
qwen=(train --device cuda --no-progress --model qwen2.5-0.5b --precision bf16 --attention sdpa --batch-size 4 --seq-len 1024 --steps 14 --val-blocks 2)
row() {  # row NAME KERNEL(liger|own) ARGS...
  local name=$1 kernel=$2; shift 2
  local t0=$SECONDS
  if [ "$kernel" = own ]; then python3 -c "$hide_liger" "$@" --out "$out/$name" >"$out/$name.log" 2>&1
  else python3 -m memtrain "$@" --out "$out/$name" >"$out/$name.log" 2>&1; fi
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
row seed-standard liger "${seed[@]}"
row seed-chunked-liger liger "${seed[@]}" --loss chunked
row seed-chunked-own-256 own "${seed[@]}" --loss chunked
row seed-chunked-own-1024 own "${seed[@]}" --loss chunked --loss-chunk 1024
row qwen-standard liger "${qwen[@]}"
row qwen-chunked-liger liger "${qwen[@]}" --loss chunked
row qwen-chunked-own-256 own "${qwen[@]}" --loss chunked
row qwen-chunked-own-1024 own "${qwen[@]}" --loss chunked --loss-chunk 1024
row qwen-chunked-own-4096 own "${qwen[@]}" --loss chunked --loss-chunk 4096
