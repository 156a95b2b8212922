#!/usr/bin/env bash
# patched.sh REV: probe REV with today's opening_system_prompts patched in
set -euo pipefail
S=${S:-/tmp/pk-run}; rev=$1
REPO=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
rm -rf "$S/src-p$rev"; mkdir -p "$S/src-p$rev"; git -C "$REPO" archive "$rev" | tar -x -C "$S/src-p$rev"
python3 - "$S/src-p$rev/recipes/common/data/preparation.py" "$REPO/recipes/common/data/preparation.py" <<'PY'
import sys
p=sys.argv[1]; s=open(p).read(); new=open(sys.argv[2]).read()
a=new.index('def opening_system_prompts('); b=new.index('def text_turn_keys(')
i=s.index('def opening_system_prompts('); j=s.index('def text_turn_keys(')
open(p,'w').write(s[:i]+new[a:b]+s[j:])
PY
bash "$(dirname "$0")/probe.sh" p$rev
