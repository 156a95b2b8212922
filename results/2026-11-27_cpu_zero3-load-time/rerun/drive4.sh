while pgrep -f drive3.sh > /dev/null; do sleep 2; done
for i in 1 2 3; do
  (cd /tmp/wt-a && GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python3 scripts/load_memory.py --model /tmp/llama-0.8b --out /tmp/thp/d4-huge-$i --launches zero3:2)
  (cd /tmp/wt-a && python3 scripts/load_memory.py --model /tmp/llama-0.8b --out /tmp/thp/d4-a-$i --launches zero3:2)
done
