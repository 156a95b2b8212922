#!/usr/bin/env bash
# One long row per step, LoRA, 2 CPU processes under sp.yaml (2-way sequence parallel) against one process:
# each rank's peak memory and the step time, on two models at ~8,000 and ~16,000 tokens a row.
#   bash results/2026-11-27_cpu_sequence-parallel/run.sh SCRATCH
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
SCRATCH=${1:?scratch folder}
LAYOUTS=${LAYOUTS:-one sp}  # e.g. LAYOUTS=one to rerun the one-process launches alone
mkdir -p "$SCRATCH" "$HERE/launches"
[ -d "$SCRATCH/wide" ] || python3 "$HERE/make_inputs.py" "$SCRATCH"
cd "$REPO"
for model in bundled-long wide; do
  for rows in 8k 16k; do
    for layout in $LAYOUTS; do
      name=$model-$rows-$layout
      # one process: the recipe itself (under the launcher it would be a child without RANK to find it by)
      if [ "$layout" = sp ]; then start=(python3 -m accelerate.commands.launch --config_file accelerate_configs/sp.yaml
                                          --num_processes 2 --mixed_precision no)
      else start=(python3); fi
      /work/shared/tools/capped 20 python3 "$HERE/launch_phases.py" --last-step 3 \
        --out "$HERE/launches/$name.json" -- \
        "${start[@]}" recipes/lora.py \
        --model "$SCRATCH/$model" --dataset "$SCRATCH/rows-$rows.jsonl" --eval-dataset "$SCRATCH/rows-$rows.jsonl" \
        --max-length 16384 --batch-size 1 --grad-accum 1 --max-steps 3 --lora-dropout 0 --report-to none \
        --output-dir "$SCRATCH/out-$name" > "$HERE/launches/$name.log" 2>&1
      cp "$SCRATCH/out-$name/metrics.jsonl" "$HERE/launches/$name.metrics.jsonl"
    done
  done
done
python3 "$HERE/summarise.py" > "$HERE/results.md"
