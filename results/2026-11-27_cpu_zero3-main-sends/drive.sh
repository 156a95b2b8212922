for i in 1 2; do
  (cd /tmp/wt-old && python3 scripts/load_memory.py --model /tmp/llama-0.8b --out /tmp/prof/m/old$i --launches ddp:2 zero3:2)
  (cd /tmp/wt-main && python3 scripts/load_memory.py --model /tmp/llama-0.8b --out /tmp/prof/m/main$i --launches ddp:2 zero3:2)
  (cd /tmp/wt-z3 && python3 scripts/load_memory.py --model /tmp/llama-0.8b --out /tmp/prof/m/new$i --launches ddp:2 zero3:2)
done
(cd /tmp/wt-z3 && python3 scripts/load_memory.py --model /tmp/llama-0.8b --out /tmp/prof/m/new4 --launches ddp:2 zero3:4 zero3_offload:2)
