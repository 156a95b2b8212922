for i in 1 2 3 4; do
  (cd /tmp/wt-old && python3 scripts/load_memory.py --model /tmp/llama-0.8b --out /tmp/thp/old$i --launches ddp:2 zero3:2)
  (cd /tmp/wt-a && python3 scripts/load_memory.py --model /tmp/llama-0.8b --out /tmp/thp/new$i --launches ddp:2 zero3:2)
done
