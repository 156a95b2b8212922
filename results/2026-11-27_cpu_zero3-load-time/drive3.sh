for i in 1 2 3; do
  (cd /tmp/wt-nothr && python3 scripts/load_memory.py --model /tmp/llama-0.8b --out /tmp/z3/others$i --launches zero3:2)
  (cd /tmp/wt-old && python3 scripts/load_memory.py --model /tmp/llama-0.8b --out /tmp/z3/before$i --launches ddp:2 zero3:2)
done
