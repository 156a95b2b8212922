#!/usr/bin/env bash
# Wheels for a GPU box without network (Python 3.12, x86-64 Linux, torch / transformers / accelerate /
# peft already there), made here where pip reaches the package registries:
#
#     bash scripts/measure/gpu_wheels.sh [.whl]        # then, on the box: python scripts/measure/gpu_check.py --wheels .whl
#
# What such a box lacks: datasets (+ dill, multiprocess), bitsandbytes (the CUDA wheel, ~43 MB), trl,
# liger-kernel, and DeepSpeed (a source archive, built there without its ops) with hjson and pydantic; and
# peft, in case the box's own is older than the recipes support (gpu_check.py installs a carried wheel only
# when the box lacks its library or has it below recipes/common/launching/versions.py's lowest version).
# The same versions as this machine's, so the box runs what the CPU suite ran. ~51 MB in all: with the
# repository (~2 MB) under the 64 MiB one device call can carry.
set -euo pipefail
dest=${1:-.whl}
mkdir -p "$dest"
platform=(--only-binary=:all: --python-version 3.12 --implementation cp
          --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
installed() { python3 -c "from importlib.metadata import version; print(version('$1'))"; }
for name in datasets dill multiprocess bitsandbytes trl peft hjson pydantic pydantic-core annotated-types typing-inspection; do
    python3 -m pip download -q --no-deps "${platform[@]}" -d "$dest" "$name==$(installed "$name")"
done
python3 -m pip download -q --no-deps "${platform[@]}" -d "$dest" "liger-kernel==0.8.5"
python3 -m pip download -q --no-deps --no-binary=:all: -d "$dest" "deepspeed==$(installed deepspeed)"
git rev-parse --short HEAD > "$dest/COMMIT"  # the box may get the tree without .git, or with a stale one: gpu_check.py reads the commit here
du -sh "$dest"
ls "$dest"
size=$(du -sb "$dest" | cut -f1)
[ "$size" -lt $((60 * 1024 * 1024)) ] || { echo "error: $dest holds $size bytes; a device call carries 64 MiB with the repository" >&2; exit 1; }
