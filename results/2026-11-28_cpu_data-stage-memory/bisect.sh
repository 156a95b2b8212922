#!/usr/bin/env bash
rev=$(git rev-parse --short HEAD)
out=$(timeout 300 bash $(dirname "$0")/probe.sh $rev | tail -1)
echo "$out" >> /tmp/pk-run/bisect.out
uss=$(echo "$out" | awk '{print $2}')
[ -z "$uss" ] && exit 125
[ "$uss" -gt 1000 ] && exit 1 || exit 0
