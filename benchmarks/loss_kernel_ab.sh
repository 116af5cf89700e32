#!/usr/bin/env bash
# The chunked loss's CUDA kernels side by side in one session: memtrain's own chunked loss (the
# default), Liger-Kernel's fused linear cross-entropy (--loss-kernel liger; needs liger_kernel) and
# Apple's Cut Cross-Entropy (--loss-kernel cce; needs cut_cross_entropy), against the standard
# loss, on the seed GPT compiled (also under CUDA graphs: --compile-mode reduce-overhead) and on
# Qwen2.5-0.5B eager. One `memtrain train` per row; prints one markdown line per row.
#
# The run recorded in benchmarks/results/gpu-h100/runbook-2026-11-26 used this script at 1baad1a,
# with other rows (memtrain's kernel at chunks 256, 1024 and 4096), before --loss-kernel existed:
# Liger ran by default then, and memtrain's kernel ran with Liger hidden from the process
# (sys.modules["liger_kernel"] = None).
#
#   bash benchmarks/loss_kernel_ab.sh OUT_FOLDER [ROW ...]     (no ROW: every row)
#   bash benchmarks/loss_kernel_ab.sh --help                   (the rows)
#   bash benchmarks/loss_kernel_ab.sh --args ROW               (a row's memtrain arguments)
set -u
seed=(train --device cuda --no-progress --batch-size 64 --seq-len 256 --steps 100 --precision bf16 --attention flash --val-blocks 2 --compile)
qwen=(train --device cuda --no-progress --model qwen2.5-0.5b --precision bf16 --attention sdpa --batch-size 4 --seq-len 1024 --steps 14 --val-blocks 2)
graphs=(--compile-mode reduce-overhead)
ROWS=(seed-standard seed-chunked seed-liger seed-cce seed-standard-cudagraphs seed-chunked-cudagraphs
      seed-cce-cudagraphs qwen-standard qwen-chunked qwen-liger qwen-cce)
args_of() {  # the memtrain arguments of row $1
  case $1 in
    seed-standard) echo "${seed[*]}" ;;
    seed-chunked) echo "${seed[*]} --loss chunked" ;;
    seed-liger) echo "${seed[*]} --loss chunked --loss-kernel liger" ;;
    seed-cce) echo "${seed[*]} --loss chunked --loss-kernel cce" ;;
    seed-standard-cudagraphs) echo "${seed[*]} ${graphs[*]}" ;;
    seed-chunked-cudagraphs) echo "${seed[*]} ${graphs[*]} --loss chunked" ;;
    seed-cce-cudagraphs) echo "${seed[*]} ${graphs[*]} --loss chunked --loss-kernel cce" ;;
    qwen-standard) echo "${qwen[*]}" ;;
    qwen-chunked) echo "${qwen[*]} --loss chunked" ;;
    qwen-liger) echo "${qwen[*]} --loss chunked --loss-kernel liger" ;;
    qwen-cce) echo "${qwen[*]} --loss chunked --loss-kernel cce" ;;
    *) return 1 ;;
  esac
}
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
  echo "usage: loss_kernel_ab.sh OUT_FOLDER [ROW ...]; rows: ${ROWS[*]}"; exit 0
fi
if [ "${1:-}" = "--args" ]; then  # --args ROW: the row's memtrain arguments (tests parse them)
  args_of "${2:-}" || { echo "loss_kernel_ab.sh: unknown row '${2:-}'" >&2; exit 2; }; exit 0
fi
if [ -z "${1:-}" ] || [ "${1#-}" != "$1" ]; then  # no folder, or an option where the folder goes
  echo "loss_kernel_ab.sh: usage: loss_kernel_ab.sh OUT_FOLDER [ROW ...] (--help lists the rows)" >&2; exit 2
fi
out=$1
shift
chosen=("$@")
[ ${#chosen[@]} -eq 0 ] && chosen=("${ROWS[@]}")
for name in "${chosen[@]}"; do  # every name checked before any device time is spent
  args_of "$name" >/dev/null || { echo "loss_kernel_ab.sh: unknown row '$name'; rows: ${ROWS[*]}" >&2; exit 2; }
  # A second run into the same folder would overwrite the first one's log: refused, nothing touched.
  if [ -e "$out/$name" ] || [ -e "$out/$name.log" ]; then
    echo "loss_kernel_ab.sh: $out already holds row $name; give another OUT_FOLDER" >&2; exit 2
  fi
done
mkdir -p "$out"
row() {  # row NAME
  local name=$1 t0=$SECONDS rc
  read -r -a argv <<<"$(args_of "$name")"
  python3 -m memtrain "${argv[@]}" --out "$out/$name" >"$out/$name.log" 2>&1
  rc=$?
  python3 - "$out/$name/result.json" "$name" "$rc" "$((SECONDS - t0))" "$out/$name.log" <<'PY'
import json, sys
path, name, rc, wall, log = sys.argv[1:]
try:
    r = json.load(open(path))
except (OSError, ValueError):
    # memtrain's one-line refusal (a kernel's package not installed, no GPU), else the log's last line
    try:
        lines = [ln.strip() for ln in open(log, errors="replace") if ln.strip()]
    except OSError:
        lines = []
    why = next((ln for ln in reversed(lines) if ln.startswith("error:")), lines[-1] if lines else "no log")
    print(f"| {name} | exit {rc} | {wall} s | no result: {why.replace('|', '/')} |"); sys.exit()
st, mem, setup = r.get("step_time_s") or {}, r.get("memory") or {}, r.get("setup_time_s") or {}
print(f"| {name} | exit {rc} | {wall} s | step {st.get('median', 0) * 1e3:.2f} ms | first step {setup.get('first_step', 0):.1f} s "
      f"| max allocated {mem.get('max_allocated_bytes', 0) / 2**30:.2f} GiB | max reserved {mem.get('max_reserved_bytes', 0) / 2**30:.2f} GiB "
      f"| data wait {r.get('data_wait_share') or 0:.2%} | val PPL {r.get('val_ppl')} |")
PY
}
for name in "${chosen[@]}"; do row "$name"; done
