#!/usr/bin/env bash
# What a lent GPU machine runs (bench/results/gpu.md records what it showed): build, the `gpu`
# tests, host <-> device copies, bf16 steps, then the whole suite on the CUDA device.
#   bash bench/gpu_session.sh OUT_DIR [STEP_LAYERS] [STEP_DIM]
#   ONLY_BIG=1 BIG=1 bash bench/gpu_session.sh OUT_DIR   # just the largest NVMe step (one call)
#   ONLY_BIG=1 FORMATS=1 bash bench/gpu_session.sh OUT_DIR   # just the moment formats' disk-bound steps
set -uo pipefail
out=${1:?output directory}
layers=${2:-8}
dim=${3:-2048}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  nproc; free -g; df -h . /tmp
  python3 -c "import torch, sys; print(sys.version, torch.__version__, torch.version.cuda)"
} 2>&1 | tee "$out/machine.txt"
if ! python3 -c "import infinity._aio" 2>/dev/null; then
  if ls .whl-infinity/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-deps --no-index .whl-infinity/*.whl
  else
    python3 -m pip wheel -q --no-deps --no-build-isolation -w "$out" . && python3 -m pip install -q --no-deps "$out"/*.whl
  fi || { echo "build failed"; exit 1; }
fi
if [ "${ONLY_BIG:-0}" != 1 ]; then
cd tests && python3 -m pytest -m gpu -q -p no:cacheprovider -p no:benchmark 2>&1 | tee "$out/gpu_tests.txt"; cd ..
python3 bench/bench_gpu.py copies --output "$out/copies.json" 2>&1 | tail -3
for mode in plain nvme; do
  python3 bench/bench_gpu.py step --mode $mode --layers "$layers" --dim "$dim" --nvme-path /tmp \
    --output "$out/step_${mode}.json" 2>&1 | grep -v '^step ' | tail -8
done
fi
# BIG=1: the largest GPT (dim 4096) whose parameters and optimizer state fit this disk on NVMe
# (18 bytes a parameter in 90% of the free space: bf16 parameters 2, the fp32 master, both Adam
# moments and the spilled gradient 16; about 3.1B parameters on 60 GB free), with plain PyTorch at
# the same size (its JSON says whether it ran out of GPU memory). On 2026-11-27 the 14 bytes this
# used to assume asked for 4.36B, which the optimizer's store refused (63.3 GiB for 55.8 free).
# MOMENT_FORMAT=8bit (or bf16): the optimizer's moments in fewer bytes ([4/7]), the gradient accumulators
# in host memory (max_grad_in_cpu), so NVMe holds 2 + 4 + 2.03 bytes a parameter; BIG_PARAMS=5e9 asks for
# that size (the layers that reach it) instead of the most the disk holds; nothing of the optimizer state
# is kept in host memory (max_in_cpu 0).
if [ "${BIG:-0}" = 1 ]; then
  nvme=${NVME:-/tmp}
  fmt=${MOMENT_FORMAT:-fp32}
  per=$(python3 -c "print({'fp32': 18, 'bf16': 10.1, '8bit': 8.1}['$fmt'])")
  big=$(python3 -c "import shutil; n = shutil.disk_usage('$nvme').free * 0.9 / $per; n = min(n, float('${BIG_PARAMS:-inf}')); print(max(1, int((n - 32000 * 4096) // (12 * 4096 ** 2))))")
  extra=""
  [ "$fmt" != fp32 ] && extra="--moment-format $fmt --max-grad-in-cpu 1e11 --optim-max-in-cpu 0"
  for mode in nvme plain; do
    python3 bench/bench_gpu.py step --mode $mode --layers "$big" --dim 4096 --steps 2 --nvme-path "$nvme" $extra \
      --output "$out/step_big_${mode}_${fmt}.json" 2>&1 | grep -v '^step ' | tail -8
  done
fi
# FORMATS=1 ([4/7]): fp32, bf16 and 8-bit moments at one size, a step the disk bounds on a GPU. The pool
# holds a fraction of the state (4 buffers of 2e7, max_in_cpu 0), gradients stay in host memory, clipping
# 1.0 (CLIP=0: none); FMT_ROUNDS rounds, the formats interleaved in each, 2 steps a run after the first
# (which reads nothing back). About 30 s a run at the default 6 x 2048 (0.37B parameters, 4.5 GB of fp32
# state each way). `bench_gpu.py formats` prints each format's step and disk bytes against fp32's.
if [ "${FORMATS:-0}" = 1 ]; then
  for r in $(seq 1 "${FMT_ROUNDS:-2}"); do
    for fmt in fp32 bf16 8bit; do
      python3 bench/bench_gpu.py step --mode nvme --layers "${FMT_LAYERS:-6}" --dim 2048 --steps 2 \
        --nvme-path "${NVME:-/tmp}" --moment-format $fmt --sub-group-size 2e7 --optim-buffers 4 \
        --optim-max-in-cpu 0 --max-grad-in-cpu 1e11 --clip "${CLIP:-1.0}" \
        --output "$out/fmt_${fmt}_r$r.json" 2>&1 | grep -v '^step ' | tail -3
    done
  done
  python3 bench/bench_gpu.py formats "$out" --output "$out/formats.json"
fi
# The whole suite on the CUDA device (its parity tests compare with plain PyTorch on the CPU).
[ "${FULL_SUITE:-0}" = 1 ] && (cd tests && timeout "${SUITE_TIMEOUT:-300}" python3 -m pytest -v -n 8 -p no:cacheprovider \
  -p no:benchmark . > "$out/suite.txt" 2>&1; grep -E "FAILED|ERROR" "$out/suite.txt" | sort | uniq | head -80)
