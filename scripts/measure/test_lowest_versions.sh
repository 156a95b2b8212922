#!/usr/bin/env bash
# The recipes on the lowest library versions they support (recipes/common/launching/versions.py): a virtual
# environment from requirements-lowest.txt, then the launches that matter most on them, each through the
# real `accelerate launch`:
#
#     bash scripts/measure/test_lowest_versions.sh [results/<date>_cpu_lowest-versions] [torch wheel or pin]
#
#   - the launch matrix's every-run subset (tests/test_matrix.py) and the per-launch checks that share its
#     launches (tests/test_plan_vs_ranks.py);
#   - the GPU suite's CPU stand-in (RECIPES_GPU_SUITE_ON_CPU=1 tests/gpu: every recipe x config a CPU runs);
#   - the speed options' launches, the long ones too (tests/test_speed_options.py: --gradient-checkpointing N,
#     --compile, loader workers, scripts/measure/speed_options.py);
#   - gpu_check.py's first call (headline,core) on the CPU stand-in.
#
# torch: on a machine without GPUs the default is the CPU build of torch 2.13.0 (the one this machine's pip
# has on disk); the GPU box has 2.11. A second argument installs another torch first: `torch==2.11.0` takes
# PyPI's build, with CUDA's libraries (~3 GB; it runs on a CPU). Writes each part's pytest output and junit
# XML, pip's freeze and summary.txt (this script's output) into the results folder. 18 to 26 minutes on 2
# cores; not part of CI (20-minute budget).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:-results/$(date +%F)_cpu_lowest-versions}
torch_spec=${2:-}
venv=$(realpath -m "${LOWEST_VENV:-.venv-lowest}")
mkdir -p "$out"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv" || exit 1
fi
py="$venv/bin/python"
if [ -n "$torch_spec" ]; then
    "$py" -m pip install -q "$torch_spec" || exit 1
    # keep the torch just installed: the file's torch line is left out
    grep -v '^torch==' requirements-lowest.txt | grep -v '^setuptools==' > "$out/.requirements" || exit 1
else
    cp requirements-lowest.txt "$out/.requirements"
fi
"$py" -m pip install -q -r "$out/.requirements" 2>&1 | grep -v "^WARNING: Location" || true
rm -f "$out/.requirements"
"$py" -m pip freeze > "$out/pip-freeze.txt"
export PATH="$venv/bin:$PATH"   # `accelerate launch` and every python the tests start: the venv's

status=0
part() {  # name, then the pytest arguments
    local name=$1; shift
    local started=$SECONDS
    "$py" -m pytest -q -rs -p no:cacheprovider -o junit_family=legacy --junitxml "$out/junit-$name.xml" "$@" > "$out/$name.txt" 2>&1
    local code=$?
    echo "$name: exit $code after $((SECONDS - started)) s: $(tail -1 "$out/$name.txt")"
    [ $code -eq 0 ] || status=1
}
exec > >(tee "$out/summary.txt") 2>&1
echo "python: $("$py" --version 2>&1)"
"$py" -c "from importlib.metadata import version as v; print(', '.join(f'{n} {v(n)}' for n in
    ('torch', 'transformers', 'accelerate', 'huggingface_hub', 'peft', 'datasets', 'trl', 'deepspeed', 'bitsandbytes')))"
part matrix tests/test_matrix.py tests/test_plan_vs_ranks.py
RECIPES_GPU_SUITE_ON_CPU=1 part gpu-suite-on-cpu tests/gpu
RECIPES_LONG_TESTS=1 part speed-options tests/test_speed_options.py  # with the long ones: --compile, loader workers
started=$SECONDS
RECIPES_GPU_SUITE_ON_CPU=1 "$py" scripts/measure/gpu_check.py --cpu-stand-in --parts headline,core \
    --results "$out/gpu-check" > "$out/gpu-check.txt" 2>&1
code=$?
echo "gpu-check (headline,core, CPU stand-in): exit $code after $((SECONDS - started)) s"
[ $code -eq 0 ] || status=1
exit $status
