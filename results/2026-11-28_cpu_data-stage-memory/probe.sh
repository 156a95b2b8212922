#!/usr/bin/env bash
# probe.sh REV [FLAGS...]: one launch at REV (exported with git archive into $S/src-REV, or a tree already
# there), each rank's USS by phase into $S/probe-REV[-packed].json; prints REV, rank 0's "packing and
# loading", "preparing" and "first step" USS (MiB) and the return code. FLAGS go to the recipe (--packing).
# S (default /tmp/pk-run) holds results/2026-11-27_cpu_packing-memory's chat200000.jsonl and tiny-llama-32k
# (its run.sh makes them); rows are tokenised into $S/cache-head by the first launch.
set -euo pipefail
S=${S:-/tmp/pk-run}; rev=$1; shift
name=probe-$rev$([[ " $* " == *" --packing "* ]] && echo -packed || true)
HERE=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)/results/2026-11-27_cpu_packing-memory
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
[ -d "$S/src-$rev" ] || { mkdir -p "$S/src-$rev"; git -C "$(dirname "$0")" archive "$rev" | tar -x -C "$S/src-$rev"; }
find "$S/cache-head" -name "packed-*" -delete 2>/dev/null || true  # every packed launch packs: no plan reused
rm -rf "$S/out-$name"
(cd "$S/src-$rev" && HF_DATASETS_CACHE="$S/cache-head" python3 "$HERE/launch_memory.py" \
   --out "$S/$name.json" -- python3 -m accelerate.commands.launch --config_file accelerate_configs/ddp.yaml \
   --num_processes 2 --mixed_precision no recipes/lora.py --model "$S/tiny-llama-32k" \
   --dataset "$S/chat200000.jsonl" --max-length 1024 --max-steps 1 --report-to none \
   --output-dir "$S/out-$name" "$@") > "$S/$name.log" 2>&1 || true
python3 -c "
import json; d=json.load(open('$S/$name.json')); r=d['mib_by_rank']
print('$rev', r['0']['packing and loading']['uss'], r['0']['preparing']['uss'], r['0']['first step']['uss'], d['returncode'])"
