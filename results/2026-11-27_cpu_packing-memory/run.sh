#!/usr/bin/env bash
# Every launch of this folder, in the order run. From the repository root:
#
#   bash results/2026-11-27_cpu_packing-memory/run.sh /tmp/pk-run
#
# The code measured is exported from its commit (git archive), so uncommitted work in the tree is not
# measured: FIXED (packing as arrays), PARENT (its parent: the same code but packing.py, best-fit's Python
# lists) and ISSUE (the code issue 57 measured: the LM head's logits whole, before dc0a4cb's chunked loss).
# Each launch: lora.py under accelerate_configs/ddp.yaml, 2 CPU processes, --max-length 1024
# --max-steps 1, watched by launch_memory.py (each rank's USS every 0.05 s, by phase; the seconds to
# the first step), under ../shared/tools/capped 20. Records: SCRATCH/NAME.json and SCRATCH/NAME.log.
set -euo pipefail
SCRATCH=${1:?a scratch folder (tens of GB free)}
FIXED=${FIXED:-ac51586}
PARENT=${PARENT:-1d53007}
ISSUE=${ISSUE:-9d69d54}
REPO=$(pwd)
HERE=$REPO/results/2026-11-27_cpu_packing-memory
CAPPED=$(realpath "$REPO/../shared/tools/capped")
mkdir -p "$SCRATCH"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1

for rev in "$FIXED" "$PARENT" "$ISSUE"; do
  [ -d "$SCRATCH/src-$rev" ] || { mkdir -p "$SCRATCH/src-$rev"; git archive "$rev" | tar -x -C "$SCRATCH/src-$rev"; }
done
for rows in 200000 ${WITH_2M_LAUNCHES:+2000000}; do  # scripts/measure/prepare_speed.py's chat rows, as results/2026-11-25_cpu_packing-200k made them
  [ -f "$SCRATCH/chat$rows.jsonl" ] || python3 -c "import sys; sys.path.insert(0, 'scripts/measure'); from pathlib import Path; import prepare_speed; prepare_speed.chat_file(Path('$SCRATCH/chat$rows.jsonl'), $rows, seed=1)"
done
[ -f "$SCRATCH/tiny-llama-32k/config.json" ] || python3 "$HERE/tiny_model.py" "$SCRATCH/tiny-llama-32k"

# launch NAME REVISION ROWS CACHE [FLAGS...]: one measured launch; CACHE "fresh:NAME" empties it first.
# ONLY="NAME ..." runs those launches alone.
launch() {
  local name=$1 rev=$2 rows=$3 cache=$4; shift 4
  [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]] && return 0
  local fresh=0
  if [[ $cache == fresh:* ]]; then cache=${cache#fresh:}; fresh=1; fi
  [ $fresh = 1 ] && rm -rf "$SCRATCH/$cache"
  find "$SCRATCH/$cache" -name "packed-*" -delete 2>/dev/null || true  # every packed launch packs: no plan reused
  rm -rf "$SCRATCH/out-$name"
  echo "== $name ($rev, $rows rows, cache $cache$([ $fresh = 1 ] && echo ', fresh'), flags: $*)" >&2
  (cd "$SCRATCH/src-$rev" && HF_DATASETS_CACHE="$SCRATCH/$cache" "$CAPPED" 20 python3 "$HERE/launch_memory.py" \
     --out "$SCRATCH/$name.json" -- python3 -m accelerate.commands.launch --config_file accelerate_configs/ddp.yaml \
     --num_processes 2 --mixed_precision no recipes/lora.py --model "$SCRATCH/tiny-llama-32k" \
     --dataset "$SCRATCH/chat$rows.jsonl" --max-length 1024 --max-steps 1 --report-to none \
     --output-dir "$SCRATCH/out-$name" "$@") > "$SCRATCH/$name.log" 2>&1
  tail -1 "$SCRATCH/$name.log" >&2
}

# 200,000 rows, each launch on an empty datasets cache (as issue 57 measured), at the code issue 57 measured
# and with packing as arrays
launch 200k-plain-issue "$ISSUE" 200000 fresh:cache-200k-plain-issue
launch 200k-packed-issue "$ISSUE" 200000 fresh:cache-200k-packed-issue --packing
launch 200k-plain "$FIXED" 200000 fresh:cache-200k-plain
launch 200k-packed "$FIXED" 200000 fresh:cache-200k-packed --packing
# on the caches just made (no tokenising): the data stage split at the data line (launch_memory.py's phases
# "preparing" / "packing and loading" came after the four launches above), and fewer sequences a micro-batch:
# 2 x 1,024 tokens, against 8 rows padded to the longest unpacked
launch 200k-plain-cached "$FIXED" 200000 cache-200k-plain
launch 200k-packed-cached "$FIXED" 200000 cache-200k-packed --packing
launch 200k-packed-batch2 "$FIXED" 200000 cache-200k-packed --packing --batch-size 2

# 2,000,000 rows through the launch: stopped while tokenising (43% after 9.6 min, ~1,000 rows/s beside
# another engineer's test suite on the same 2 cores), so 2,000,000 rows were measured with
# packing_at_scale.py instead (below). The launches, for a quieter machine:
[ -n "${WITH_2M_LAUNCHES:-}" ] && {
  launch 2m-plain-cold "$FIXED" 2000000 fresh:cache-2m
  launch 2m-plain "$FIXED" 2000000 cache-2m
  launch 2m-packed "$FIXED" 2000000 cache-2m --packing
  launch 2m-packed-parent "$PARENT" 2000000 cache-2m --packing
}

# A rank's data stage on generated tokenised sets of 200,000 and 2,000,000 rows, their lengths drawn from the
# 200,000 rows the launches tokenised: without packing, packing (the plan computed: rank 0) and reading the
# plan (the other ranks), at FIXED and at PARENT. Records: SCRATCH/scale/NAME.json
if [ -z "${ONLY:-}" ]; then
  tokenised=$(find "$SCRATCH/cache-200k-plain" -name "cache-*_of_*.arrow" | sort)
  mkdir -p "$SCRATCH/scale"
  for size in 200k:200000 2m:2000000; do
    label=${size%%:*} rows=${size#*:}
    [ -f "$SCRATCH/set-$label/tokenised.arrow" ] || python3 "$HERE/packing_at_scale.py" write --lengths-from $tokenised --rows $rows --out "$SCRATCH/set-$label"
    for rev in "$FIXED" "$PARENT"; do
      for mode in plain packed "packed --keep-plan"; do
        [ "$rev" = "$PARENT" ] && [ "$mode" = plain ] && continue
        name="$label-$rev-$(echo "$mode" | tr ' ' '_' | sed 's/--//')"
        "$CAPPED" 16 python3 "$HERE/packing_at_scale.py" measure --set "$SCRATCH/set-$label" --mode $mode \
          --recipes "$SCRATCH/src-$rev/recipes" > "$SCRATCH/scale/$name.json" 2> "$SCRATCH/scale/$name.err"
      done
    done
  done
fi

# The records into this folder (the launches' output without progress bars), then its table
mkdir -p "$HERE/launches" "$HERE/scale"
for record in "$SCRATCH"/*.json; do
  name=$(basename "$record" .json)
  cp "$record" "$HERE/launches/"
  tr '\r' '\n' < "$SCRATCH/$name.log" | grep -v -E '[0-9]+/[0-9]+ \[|it/s\]|examples/s\]|real_accelerator|^\s*$' > "$HERE/launches/$name.log" || true
done
cp "$SCRATCH"/scale/*.json "$HERE/scale/" 2>/dev/null || true
python3 "$HERE/summarise.py"
