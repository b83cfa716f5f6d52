#!/usr/bin/env bash
# [4/7]: a full fine-tune of llama-7b (6.74B parameters, a preset's shapes, random init) on a machine
# whose disk cannot hold its fp32 optimizer state: parameters and AdamW state on NVMe, the moments in
# 8 bits (optimizer.params.moment_format), gradient_clipping 0 and one micro-step, so that each unit
# is updated in backward and no gradient accumulator is kept or spilled. Records the engine's
# per-step figures (`infinity finetune --metrics`), the peak RSS and the most bytes the NVMe
# directory held (du every 5 s).
#   bash bench/bench_7b.sh [NVME_DIR] [OUT_JSON]      # STEPS=3 SEQ=128 by default
set -euo pipefail
nvme=${1:-/work}/bench-7b-$$
out=${2:-bench/results/llama7b_8bit.json}
mkdir -p "$nvme"
trap 'rm -rf "$nvme" "$nvme.du"' EXIT
cat > "$nvme.json" <<JSON
{"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
 "bf16": {"enabled": true}, "steps_per_print": 1000000000,
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.0, "moment_format": "8bit"}},
 "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 1e8,
   "offload_param": {"device": "nvme", "nvme_path": "$nvme", "max_in_cpu": 0},
   "offload_optimizer": {"device": "nvme", "nvme_path": "$nvme", "max_in_cpu": 0}}}
JSON
( while sleep 5; do du -sb "$nvme" 2>/dev/null | cut -f1; done > "$nvme.du" ) &
monitor=$!
start=$(date +%s)
infinity finetune --model "${MODEL:-llama-7b}" --config "$nvme.json" --steps "${STEPS:-3}" --seq-len "${SEQ:-128}" \
  --sample-tokens 0 --metrics "$out.steps" 2>&1 | tr '\r' '\n' | grep -v '^finetune:' | tail -30
kill $monitor
python3 - "$out" "$nvme.du" "$nvme.json" "$start" <<'PY'
import json, subprocess, sys, time
out, du, cfg, start = sys.argv[1:]
steps = json.load(open(out + ".steps"))
sizes = [int(line) for line in open(du) if line.strip()]
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
json.dump({"command": "bash bench/bench_7b.sh", "commit": commit, "config": json.load(open(cfg)),
           "wall_s": time.time() - int(start), "nvme_peak_bytes": max(sizes, default=0), **steps},
          open(out, "w"), indent=1)
print(f"peak NVMe {max(sizes, default=0) / 1e9:.1f} GB, peak RSS {steps['peak_rss_bytes'] / 1e9:.2f} GB, "
      f"steps {[round(s, 1) for s in steps['step_s']]} s, losses {[round(x, 3) for x in steps['loss']]}")
PY
rm -f "$out.steps" "$nvme.json"
