for i in 1 2; do
  (cd /tmp/wt-nothr && python3 scripts/load_memory.py --model /tmp/llama-0.8b --out /tmp/z3/nothr$i --launches ddp:2 zero3:2)
  (cd /tmp/wt-measure && python3 scripts/load_memory.py --model /tmp/llama-0.8b --out /tmp/z3/thr$i --launches ddp:2 zero3:2)
done
