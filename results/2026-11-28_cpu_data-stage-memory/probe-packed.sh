#!/usr/bin/env bash
# probe.sh REV: the plain launch's "packing and loading" USS on rank 0 at REV
set -euo pipefail
S=/tmp/pk-run; rev=$1
HERE=/work/main/results/2026-11-27_cpu_packing-memory
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
[ -d "$S/src-$rev" ] || { mkdir -p "$S/src-$rev"; git -C /work/main archive "$rev" | tar -x -C "$S/src-$rev"; }
rm -rf "$S/out-probe-packed-$rev"
(cd "$S/src-$rev" && HF_DATASETS_CACHE="$S/cache-head" python3 "$HERE/launch_memory.py" \
   --out "$S/probe-packed-$rev.json" -- python3 -m accelerate.commands.launch --config_file accelerate_configs/ddp.yaml \
   --num_processes 2 --mixed_precision no recipes/lora.py --model "$S/tiny-llama-32k" \
   --dataset "$S/chat200000.jsonl" --max-length 1024 --max-steps 1 --report-to none --packing \
   --output-dir "$S/out-probe-packed-$rev") > "$S/probe-packed-$rev.log" 2>&1 || true
python3 -c "
import json; d=json.load(open('$S/probe-packed-$rev.json')); r=d['mib_by_rank']
print('$rev', r['0']['packing and loading']['uss'], r['0']['preparing']['uss'], r['0']['first step']['uss'], d['returncode'])"
