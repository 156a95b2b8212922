set -x
for i in 1 2 3; do
  (cd /tmp/wt-old && python3 scripts/load_memory.py --model /tmp/llama-0.8b --out /tmp/z3/old$i --launches ddp:2 zero3:2)
  (cd /tmp/wt-measure && git checkout -q --detach 5c82cf7 2>/dev/null; python3 scripts/load_memory.py --model /tmp/llama-0.8b --out /tmp/z3/new$i --launches ddp:2 zero3:2)
done
