for i in 1 2; do
  for w in v1 v3 a; do
    (cd /tmp/wt-$w && python3 scripts/load_memory.py --model /tmp/llama-0.8b --out /tmp/thp/d3-$w-$i --launches zero3:2)
  done
done
