#!/usr/bin/env bash
# Regenerates the figures in bench/results/ at the checked-out commit, one benchmark at a time
# (they must not overlap: 2 cores, one disk). About an hour on the development VM.
#
#   NVME=/work bash bench/run_all.sh            # everything
#   NVME=/work bash bench/run_all.sh clip train # some of it: aio adam clip train train1b deepspeed1b
#
# DeepSpeed runs need /work/venv-ds (see bench_aio.py); fio and --reserve-hugepages need root.
# Not here: bench/results/gpu* (bench/gpu_session.sh, on a GPU machine) and finetune_3b.md
# (its own command, in that file: about 40 minutes and 60 GB of disk).
set -euo pipefail
cd "$(dirname "$0")/.."
NVME=${NVME:-/work}
R=bench/results
ONLY="$*"
want() { [ -z "$ONLY" ] || [[ " $ONLY " == *" $1 "* ]]; }
run() { echo "+ $*" >&2; "$@"; }

GPT_134M=(--layers 12 --dim 768 --vocab 64000 --seq 256 --micro 2)
GPT_1B=(--layers 20 --dim 2048 --vocab 32000 --seq 256 --micro 2)

if want aio; then
  run python bench/bench_aio.py --dir "$NVME" --size 1G --rounds 8 --buffers-ab --reserve-hugepages --output $R/aio.json
fi
if want adam; then
  run python bench/bench_adam.py --sizes 100e6 --threads 1,2 --rounds 30 --out $R/adam_100m.md
fi
if want clip; then
  run python bench/bench_clip.py --rounds 6 --nvme-path "$NVME" --output $R/clip_134m.json
  run python bench/bench_clip.py --layers 8 --dim 256 --vocab 4096 --micro 4 --seq 64 --rounds 10 \
    --nvme-path "$NVME" --output $R/clip_7m.json
fi
if want train; then
  for knobs in same tuned; do
    run python bench/bench_train.py "${GPT_134M[@]}" --steps 4 --floor-layers 12 --nvme-path "$NVME" \
      --clip 1.0 --knobs $knobs --ds-timeout 1500 --output $R/train_134m_$knobs.json
  done
fi
if want train1b; then
  run python bench/bench_train.py "${GPT_1B[@]}" --steps 5 --nvme-path "$NVME" \
    --clip 1.0 --knobs tuned --skip-deepspeed --output $R/train_1b.json
  run python bench/bench_train.py "${GPT_1B[@]}" --steps 5 --nvme-path "$NVME" \
    --clip 0 --knobs tuned --skip-deepspeed --output $R/train_1b_noclip.json
fi
if want deepspeed1b; then
  # One engine at a time at this size: DeepSpeed alone, with the knobs of --knobs same.
  run python bench/bench_train.py "${GPT_1B[@]}" --steps 2 --nvme-path "$NVME" --clip 1.0 --knobs same \
    --only-deepspeed --ds-timeout 2400 --output $R/train_1b_deepspeed.json
  run python bench/bench_train.py "${GPT_1B[@]}" --steps 5 --nvme-path "$NVME" \
    --clip 1.0 --knobs same --skip-deepspeed --output $R/train_1b_same.json
fi
