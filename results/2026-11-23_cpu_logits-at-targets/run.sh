#!/usr/bin/env bash
# recipes/lora.py's step time with the LM head at every position (commit c9c8f96) and only at the
# positions with a target (commit 26072cc), one CPU process, on a Llama with TinyLlama's 32,000-token
# vocabulary (4 layers, 256 wide, random weights) and the bundled data.
#   bash results/2026-11-23_cpu_logits-at-targets/run.sh [WORK_DIR]    (~4 min on 2 cores)
# Prints one line per run and writes WORK_DIR/summary.txt; each run's files are in WORK_DIR/<label>-<round>/.
set -euo pipefail
repo=$(git rev-parse --show-toplevel)
work=${1:-/tmp/logits-at-targets}
rm -rf "$work" && mkdir -p "$work"
python - "$repo" "$work/model" <<'PY'
import shutil, sys
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
repo, out = sys.argv[1], sys.argv[2]
config = AutoConfig.from_pretrained(f"{repo}/data/tiny-llama-config.json")
config.update(dict(vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=32))
torch.manual_seed(0)
AutoModelForCausalLM.from_config(config).save_pretrained(out)
AutoTokenizer.from_pretrained(f"{repo}/data/tokenizer").save_pretrained(out)
PY
for commit in c9c8f96 26072cc; do
    git -C "$repo" worktree add -f --detach "$work/$commit" "$commit" > /dev/null 2>&1
done
label() { [ "$1" = c9c8f96 ] && echo every-position || echo target-positions; }
for round in 1 2 3; do
    for commit in c9c8f96 26072cc; do
        out="$work/$(label $commit)-$round"
        (cd "$work/$commit" && OMP_NUM_THREADS=2 python recipes/lora.py --model "$work/model" --max-steps 60 \
            --batch-size 16 --grad-accum 1 --eval-every 0 --output-dir "$out" > "$out.log" 2>&1)
        python - "$out" "$(label $commit)" "$round" <<'PY' | tee -a "$work/summary.txt"
import json, sys
out, label, round_ = sys.argv[1:]
steps = {r["step"]: r for r in map(json.loads, open(f"{out}/metrics.jsonl")) if r.get("type") == "train"}
timed = steps[60]["elapsed_s"] - steps[10]["elapsed_s"]  # steps 11-60: start-up and warm-up left out
print(f"round {round_}  {label:16s}  steps 11-60 {timed:6.2f} s  {timed / 50 * 1000:6.1f} ms per step  "
      f"loss at step 1 {steps[1]['loss']:.6f}, at step 60 {steps[60]['loss']:.6f}")
PY
    done
done
for commit in c9c8f96 26072cc; do git -C "$repo" worktree remove --force "$work/$commit"; done
