#!/usr/bin/env bash
# Wheels of the packages the lent GPU machine's image lacks, for benchmarks/gpu_runbook.py --wheels.
#
# The machine (Python 3.12, x86-64, torch 2.11 + CUDA, transformers, peft, accelerate, tiktoken,
# triton, pyarrow already there) cannot reach a package index, so they travel with the working
# tree as .whl/ (.gitignore keeps it out of commits; about 47 MB of the 64 MiB a command may
# carry, named in the run's `carry`). Prints the folder's size and the tree's and .whl's total
# against that limit (exit 1 past it).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
mkdir -p .whl
# From an empty folder: a wheel left by an earlier pin beside the new one is two versions of one
# package, which gpu_runbook.py --wheels refuses (pip would refuse them all, on the device).
rm -f .whl/*.whl
# Pinned to the versions the recorded GPU runs used (benchmarks/results/gpu-h100/; cut-cross-entropy
# not yet measured there, 22 kB, needs the image's triton); datasets
# needs dill and multiprocess besides what the image has. liger-kernel 0.8.5 on transformers 5.24:
# its llama and qwen2 forwards (what use_liger_kernel=True patches in) read config.use_return_dict and
# pass past_key_values, both deprecated there but still answered (a property; an alias of `cache`
# until 5.40), so they run, with deprecation warnings: run on the CPU with a plain-torch loss in place
# of the Triton one, the same loss as the unpatched model's. Its module patches find what they need
# there too: RMSNorm's variance_epsilon, the MLPs' gate/up/down_proj, the module-level
# apply_rotary_pos_emb(q, k, cos, sin) that the attention calls. memtrain's LigerFusedLinearCrossEntropyLoss
# call (ignore_index, reduction, accum_dtype) matches 0.8.5's signature. compare_hf refuses Liger for a
# model whose patched forward reads a config attribute the installed transformers lacks, or passes
# the model a keyword that its forward, decoder layers or attention refuse (memtrain.bench.hf.liger_calls,
# which reads the forward's file: on transformers 5.24 0.8.5's llama and qwen2 forwards pass nothing refused).
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl torchao==0.18.0 liger-kernel==0.8.5 cut-cross-entropy==25.1.1 bitsandbytes==0.50.2 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
du -sh .whl
# What a device command carries: the working tree (tracked files and untracked ones git does not
# ignore) and .whl, together at most 64 MiB.
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
wheels=$(du -sb .whl | cut -f1)
mib=$(( (tree + wheels + 1048575) / 1048576 ))
echo "carried: tree $(( tree / 1048576 )) MiB + .whl $(( wheels / 1048576 )) MiB = about $mib MiB of 64 MiB"
if [ $(( tree + wheels )) -gt $(( 64 * 1048576 )) ]; then
  echo "gpu_wheels.sh: the tree and .whl exceed the 64 MiB a device command carries; drop a wheel or large untracked files" >&2
  exit 1
fi
