#!/usr/bin/env python
"""The GPU proof in one command: installs what the GPU box lacks, then runs on its GPUs, in order
of importance, and writes each result as soon as it has it.

    python3 scripts/measure/gpu_check.py --wheels .whl --results $OUT       # one call, 540 s (--budget-s)

A lent GPU comes for 15 minutes of device time in all (the box's start, the transfers and its idle
time included), 10 a call: one call of about 9 minutes is what it reliably gives. The default is that
call; a second (--parts vision,memory,planner,recipes,reference,options,reference34b,headline_levers,trl_liger)
runs the rest when time is left; a part cut short is rerun with --parts NAME, never by hand (the wheels are on its
PYTHONPATH only).
Each call reinstalls the wheels (skipped when the box still has them) and starts no part it has no time
left for (--budget-s).

Parts (the default call: headline, headline_compiled_cold, headline_compiled_warm, trl, speed, codellama,
preference, grpo, core; then the others in the order listed):
  speed      scripts/measure/step_speed.py: the LoRA step at the headline's shape, lever by lever (the recipes' defaults,
             the step before the chunked loss head and bf16 adapter inputs, each lever alone, dropout 0, compile,
             Liger, all together): tokens/s, MFU, peak, losses; a kernel-time profile by category
  codellama  scripts/measure/step_speed.py at CodeLlama-34B's whole shape, built on the GPU: LoRA, micro-batch 4 x GA 4,
             every layer recomputed; steady tokens/s, MFU, peak beside the planner's, a 1,024-row epoch projected
  preference tests/gpu/test_gpu_preferences.py: dpo.py (LoRA, QLoRA) and dpo_full.py under fsdp, zero3 and ddp,
             kto.py and reward.py under fsdp, kto_full.py and reward_full.py under zero3 (10 launches): the
             reference's first step, the held-out margin, the reload; never run on a GPU before
  grpo       tests/gpu/test_gpu_grpo.py: grpo.py under fsdp, zero3 and ddp (3 launches): sampling with the weights
             gathered once per batch, generation tokens/s and step time, the reload; never run on a GPU before
  headline   the TinyLlama-1.1B LoRA reference epoch under ddp.yaml (scripts/measure/benchmark.py --workload tinyllama
             --strategies ddp --measure-peak): wall time, tokens/s, MFU against the GPU's peak and a bf16
             matmul measured in the same call, peak memory beside the planner's for the same launch
  headline_compiled_cold, headline_compiled_warm  the same launch with --compile, first with the call's own empty
             kernel cache (TORCHINDUCTOR_CACHE_DIR), then again with what the first compiled there: the user's clock
             (end_to_end_s, from the launch to the adapter saved) of eager (headline, the default for its 32 steps),
             compiled cold and compiled warm; each peak beside the planner's
  headline_levers  the same launch with --liger --compile: the headline the defaults give if both levers win the
             step table (results.json only: the device tool brings back 8 files)
  core       tests/gpu/test_gpu_recipes.py for the three recipes under fsdp, zero3 and ddp (9 launches, the
             sharded ones first): the loss goes down, the saved adapter / model reloads to the same logits,
             each rank's host RAM by the first step
  vision     tests/gpu/test_gpu_vision.py: a vision-language model's LoRA step at Qwen2-VL-2B's shape, built on the GPU
             with random weights, bf16, a 448 x 448 image a row (256 image tokens), 10 steps of lora.py through the
             launch (ddp.yaml, one process): seconds a step, target and input tokens/s, peak memory beside the plan
             line's figure (and what the plan says it leaves out). The second call's first part: the first call's
             budget is spent before its own last parts (2026-11-28: preference cut short, core not started), and the
             second call's few minutes reach one part
  memory     the 4-bit path and the planner: qlora.py and full.py at TinyLlama-1.1B's full shape for 2 steps
             each, the measured peak beside the planner's, tokens/s
  planner    the rest of tests/gpu/test_gpu_planner.py (other micro-batches, gradient checkpointing)
  recipes    the rest of tests/gpu/test_gpu_recipes.py: every other config the GPUs present can run, bf16
  reference  the TinyLlama workload's other strategies (model_parallel, zero2, zero3, qlora_ddp)
  options    tests/gpu/test_gpu_speed_options.py: bitsandbytes CUDA, Liger, attention kernels, compile, workers,
             --batch-size auto's probe
  reference34b  the CodeLlama-34B LoRA workload, layer-scaled to 8 of 48 layers
  trl        scripts/measure/compare_trl.py on one GPU in bf16: the recipe against TRL's SFTTrainer, the loop's tokens/s
             and each side's end to end
  trl_liger  the same with each side's Liger (--liger: TRL's use_liger_kernel, its fused loss too)

Written to --results (default results/<date>_<gpu>/), rewritten after every part, so that a run cut
short still leaves its numbers: summary.md (tables, the benchmarks' too), results.json (the same,
machine-readable, with every test case's recorded figures and the box's package versions), log.txt
(every command and its output), and <part>.json / <part>.png for each benchmark part: 8 files for the
first call (with headline.json, headline_compiled_cold.json, headline_compiled_warm.json, speed.json and
codellama.json), 8 for the second, within the 8 the device tool brings back. No git needed there: the commit
is read from the COMMIT file scripts/measure/gpu_wheels.sh writes beside the wheels, else from git.

--cpu-stand-in runs the same parts on a machine without a GPU (RECIPES_GPU_SUITE_ON_CPU=1, the benchmark's
--smoke): it checks the plumbing before GPU time is spent, and says nothing about GPUs.

Wheels (--wheels DIR): a folder of wheels made on a connected machine by scripts/measure/gpu_wheels.sh,
installed with `pip --no-index` into /tmp/gpu-site (added to PYTHONPATH for every launch); a
DeepSpeed source archive there is built without its ops (DS_BUILD_OPS=0).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "recipes"))
from common.launching.versions import LOWEST, older_than_lowest  # noqa: E402

LIBRARIES = ("transformers", "accelerate", "huggingface_hub", "tokenizers", "peft", "datasets", "bitsandbytes",
             "deepspeed", "trl", "liger-kernel", "flash-attn", "safetensors")
SITE = Path(os.environ.get("GPU_CHECK_SITE", "/tmp/gpu-site"))  # where carried wheels go
PYTEST = ["-m", "pytest", "-q", "-o", "junit_family=legacy"]
RECIPE_TESTS = "tests/gpu/test_gpu_recipes.py"
PLANNER_TESTS = "tests/gpu/test_gpu_planner.py"
PREFERENCE_TESTS = "tests/gpu/test_gpu_preferences.py"
GRPO_TESTS = "tests/gpu/test_gpu_grpo.py"
VISION_TESTS = "tests/gpu/test_gpu_vision.py"
# The order is the order of importance: pytest runs listed cases in the order given, and a part stopped by the
# budget keeps the cases it finished. The 4-bit path first (bitsandbytes' CUDA kernels: no CPU run checks them).
MEMORY_CASES = [f"{PLANNER_TESTS}::test_planned_peak_matches_the_measured_one[{case}]"
                for case in ("batch4-qlora", "batch2-full")]  # LoRA's peak is the headline's, beside its plan
CORE_CASES = [f"{RECIPE_TESTS}::test_recipe_on_gpu[{recipe}-{config}]"
              for recipe, config in (("lora", "fsdp"), ("full", "fsdp"), ("lora", "zero3"), ("full", "zero3"),
                                     ("qlora", "fsdp"), ("qlora", "zero3"), ("lora", "ddp"), ("full", "ddp"),
                                     ("qlora", "ddp"))]
TINYLLAMA = ["scripts/measure/benchmark.py", "--workload", "tinyllama", "--measure-peak"]
# part -> (command, seconds it may take at most, seconds it needs at least to give a result: a part starts
# only when the call's budget has that much left; a test part stopped early keeps the cases it ran, a
# benchmark keeps nothing). In order of importance. Times measured on one H100 (results/2026-11-26_h100_call1):
# the headline 93 s (its epoch 29 s), a 1.1B-shaped launch 35-66 s, a 2-layer recipe case 25-50 s (imports,
# loading, saving and the reload dominate); the first call's wheels 20 s.
PARTS = {
    # call 1 (the default): the step lever by lever, the headline through the launch, the preference recipes
    # (10 launches, KTO's and the reward models' too), the core. The step table: 8 variants x 20 steps of ~0.5-0.9 s at the
    # headline's shape built once, compile's ~1 min, two 3-step profiles (scripts/measure/step_speed.py)
    "speed": (["scripts/measure/step_speed.py", "--steps", "12", "--warmup", "3"], 300, 120),
    # CodeLlama-34B's whole shape built on the GPU (no files: 63 GiB of random bf16 weights), LoRA at the reference's
    # micro-batch 4 x GA 4 with every layer recomputed (69.6 GiB planned: one H100), 8 steps of ~8-10 s each
    "codellama": (["scripts/measure/step_speed.py", "--config", "data/model_configs/codellama-34b.json", "--batch-size", "4",
                   "--grad-accum", "4", "--gradient-checkpointing", "--variants", "defaults", "--steps", "8",
                   "--warmup", "2", "--profile-steps", "0"], 360, 200),
    "preference": ([*PYTEST, PREFERENCE_TESTS], 420, 45),
    # grpo.py under fsdp, zero3, ddp (3 launches of 6 steps with 64-token completions): sampling on the GPU with the
    # weights gathered once per batch, generation tokens/s and step time; never run on a GPU before
    "grpo": ([*PYTEST, GRPO_TESTS], 240, 45),
    "headline": ([*TINYLLAMA, "--strategies", "ddp"], 300, 150),
    # the user's clock (end_to_end_s: launch to adapter saved) of the same launch compiled: first with the call's
    # fresh kernel cache (cold), then again with what the first left there (warm, as a second launch on a box)
    "headline_compiled_cold": ([*TINYLLAMA, "--strategies", "ddp", "--recipe-args", "--compile"], 300, 150),
    "headline_compiled_warm": ([*TINYLLAMA, "--strategies", "ddp", "--recipe-args", "--compile"], 300, 120),
    # the same launch with the speed levers a GPU has (Liger's layer kernels, each layer compiled): the headline the
    # defaults would give if the step table has both win
    "headline_levers": ([*TINYLLAMA, "--strategies", "ddp", "--recipe-args", "--liger --compile"], 300, 170),
    "memory": ([*PYTEST, *MEMORY_CASES], 240, 60),
    "core": ([*PYTEST, *CORE_CASES], 420, 45),
    # call 2: the rest, in order of what it proves; each part's limit from call 1's measured launches
    # images in the rows, never run on a GPU: the 2B-shaped model built on the GPU and saved (~4.4 GB), then one
    # launch of 10 steps with its start-up, data and evaluation (estimated 1-2 min, not measured yet)
    "vision": ([*PYTEST, VISION_TESTS], 300, 150),
    # the planner's other peaks: 7 launches at 1.1B x ~45 s
    "planner": ([*PYTEST, PLANNER_TESTS, *(f"--deselect={case}" for case in MEMORY_CASES)], 360, 60),
    # the other configs one GPU can run: 18 cases x ~35 s (a call's 10 minutes at most)
    "recipes": ([*PYTEST, RECIPE_TESTS, *(f"--deselect={case}" for case in CORE_CASES)], 540, 60),
    # 4 epochs of the headline's workload: ~90 s each, the 1.1B model already built on a warm box
    "reference": ([*TINYLLAMA, "--strategies", "model_parallel,zero2,zero3,qlora_ddp"], 420, 120),
    "options": ([*PYTEST, "tests/gpu/test_gpu_speed_options.py"], 360, 60),
    # CodeLlama-34B's shape cut to 8 of its 48 layers (labelled so in the table): the whole does not fit one GPU
    "reference34b": (["scripts/measure/benchmark.py", "--workload", "codellama34b", "--layers", "8",
                      "--gradient-checkpointing", "--measure-peak"], 540, 300),
    # the TinyLlama workload's model, micro-batch and accumulation through TRL's SFTTrainer beside the recipe
    # (the bundled instruction data: TRL's side needs prompt/completion rows), bf16, one GPU
    "trl": (["scripts/measure/compare_trl.py", "--processes", "1", "--mixed-precision", "bf16", "--model",
             "models/tinyllama-1.1b-22-layers", "--batch-size", "16", "--grad-accum", "2", "--max-length", "1024",
             "--steps", "40", "--rounds", "1"], 420, 300),
    # the same with each side's Liger: TRL's use_liger_kernel (its fused loss too) against the recipe's --liger
    "trl_liger": (["scripts/measure/compare_trl.py", "--processes", "1", "--mixed-precision", "bf16", "--model",
                   "models/tinyllama-1.1b-22-layers", "--batch-size", "16", "--grad-accum", "2", "--max-length",
                   "1024", "--steps", "40", "--rounds", "1", "--liger"], 420, 300),
}
# The open GPU issues' first: the step lever by lever, the second reference workload's shape, and the headline with
# the new defaults through the real launch; then what no GPU has run (the preference recipes), then the recipe cases
# (results/2026-11-27_h200_call1 did not reach their end). The budget reaches as far as it reaches, in this order.
# The clock the user sees first (issue: eager, compiled cold, compiled warm, TRL beside, each end to end; the compiled
# peaks beside the planner's), then the step lever by lever and the rest.
FIRST_CALL = ("headline", "headline_compiled_cold", "headline_compiled_warm", "trl", "speed", "codellama",
              "preference", "grpo", "core")
DEFAULT_BUDGET_S = 540  # 9 minutes: with the box's start (1-3 min) and the transfers, within 15 of device time
BENCHMARKS = ("headline", "headline_compiled_cold", "headline_compiled_warm", "headline_levers", "reference",
              "reference34b")
CHARTS = ("reference", "reference34b")  # a chart each: the device tool brings back 8 files a call
STEP_TABLES = ("speed", "codellama")  # scripts/measure/step_speed.py's parts: <part>.json and the table in the summary
# What a part runs instead on the CPU stand-in: the benchmark's smoke path (2 CPU processes, the tiny model).
CPU_STAND_IN = {"headline": ["scripts/measure/benchmark.py", "--smoke", "--strategies", "ddp"],
                "headline_compiled_cold": ["scripts/measure/benchmark.py", "--smoke", "--strategies", "ddp"],
                "headline_compiled_warm": ["scripts/measure/benchmark.py", "--smoke", "--strategies", "ddp"],
                "headline_levers": ["scripts/measure/benchmark.py", "--smoke", "--strategies", "ddp"],
                "reference": ["scripts/measure/benchmark.py", "--smoke", "--strategies", "zero2"],
                "reference34b": ["scripts/measure/benchmark.py", "--smoke", "--strategies", "ddp"],
                "trl": ["scripts/measure/compare_trl.py", "--processes", "1", "--steps", "4", "--rounds", "1"],
                "trl_liger": ["scripts/measure/compare_trl.py", "--processes", "1", "--steps", "4", "--rounds", "1"],
                "speed": ["scripts/measure/step_speed.py", "--cpu"],
                # the same path and flags on the tiny model (one of the 34B's 48 layers alone takes ~5 min on 2
                # cores: results/2026-11-27_cpu_gpu-check-rehearsal ran it once)
                "codellama": ["scripts/measure/step_speed.py", "--cpu", "--batch-size", "1", "--grad-accum", "2",
                              "--gradient-checkpointing", "--variants", "defaults", "--steps", "2", "--warmup", "1",
                              "--profile-steps", "0"]}
# the random-weight TinyLlama-1.1B-shaped model of tests/gpu (built once, also by the planner part)
# A part past its time gets Ctrl-C, then this long to write what it has before it is killed.
STOP_GRACE_S = 30
# Seconds kept at the end of a budget: a late part's grace, then writing the results.
SAVE_MARGIN_S = STOP_GRACE_S + 15
BUILD_MODEL = ["-c", "import sys; sys.path.insert(0, 'tests/gpu'); from gpu_support import shaped_model; "
                     "shaped_model(layers=22)"]


def parse_args(argv=None):
    summary, _, details = __doc__.partition("\n")
    parser = argparse.ArgumentParser(description=summary, epilog=details,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(FIRST_CALL),
                        help=f"comma-separated, among {', '.join(PARTS)} (default: the first call's, "
                             f"{','.join(FIRST_CALL)})")
    parser.add_argument("--wheels", type=Path, default=None, help="a folder of wheels to install first")
    parser.add_argument("--results", type=Path, default=None, help="where to write (default: results/<date>_<gpu>)")
    parser.add_argument("--budget-s", type=int, default=DEFAULT_BUDGET_S,
                        help="seconds this call may take in all: a part starts only if the time it needs is left, "
                             f"and is stopped before the budget ends (default: {DEFAULT_BUDGET_S}; 0: no budget)")
    parser.add_argument("--cpu-stand-in", action="store_true",
                        help="run the parts' plumbing on a machine without a GPU (fp32, the tiny model)")
    args = parser.parse_args(argv)
    args.budget_s = args.budget_s or None
    unknown = [part for part in args.parts.split(",") if part not in PARTS]
    if unknown:
        parser.error(f"unknown part {', '.join(unknown)}; choose among {', '.join(PARTS)}")
    return args


def box_has_supported(wheel: Path) -> bool:
    """Whether the box already has this wheel's library at a version the recipes support (versions.LOWEST):
    then the box's own runs, as users of such an image would run it."""
    from importlib.metadata import PackageNotFoundError, version

    name = wheel.name.split("-")[0].lower()  # a wheel's file name spells the library with underscores, as LOWEST does
    if name not in LOWEST:
        return False
    try:
        return not older_than_lowest(name, version(name))
    except PackageNotFoundError:
        return False


def install_wheels(folder: Path, log) -> dict:
    """pip --no-index from `folder` into SITE, except libraries the box has at a supported version;
    DeepSpeed from its source archive without ops."""
    SITE.mkdir(parents=True, exist_ok=True)
    wheels = sorted(str(p) for p in folder.glob("*.whl") if not box_has_supported(p))
    archives = sorted(str(p) for p in folder.glob("deepspeed-*.tar.gz"))
    names = [Path(w).name for w in wheels + archives]
    marker = SITE / "installed-wheels.json"
    if marker.exists() and json.loads(marker.read_text()) == names:  # a warm box from the previous call
        return {"wheels": names, "returncodes": [], "already_installed": True}
    commands = []
    if wheels:
        commands.append([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                         "--upgrade", "--target", str(SITE), *wheels])
    for archive in archives:
        commands.append([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                         "--no-build-isolation", "--target", str(SITE), archive])
    ran = [run(command, log, timeout=600, env={"DS_BUILD_OPS": "0"}) for command in commands]
    codes = [result["returncode"] for result in ran]
    if all(code == 0 for code in codes):
        marker.write_text(json.dumps(names))
    return {"wheels": names, "returncodes": codes, "seconds": round(sum(result["seconds"] for result in ran), 1)}


def environment() -> dict:
    """The GPU and every library version as the launches see them (the carried wheels in SITE first)."""
    code = ("import json, torch; from importlib.metadata import PackageNotFoundError, version\n"
            "def found(name):\n"
            "    try:\n"
            "        return version(name)\n"
            "    except PackageNotFoundError:\n"
            "        return None\n"
            "p = torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None\n"
            "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, "
            "'gpus': torch.cuda.device_count(), 'gpu': p.name if p else None, "
            "'gpu_memory_gib': round(p.total_memory / 2**30, 1) if p else None, "
            "'python': '.'.join(map(str, __import__('sys').version_info[:3])), "
            f"**{{name: found(name) for name in {LIBRARIES!r}}}}}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=launch_env())
    if done.returncode != 0:  # the parts still run: each says what failed in its own log
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    found = json.loads(done.stdout)
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        found["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        found["driver"] = None
    return found


def launch_env(extra: dict | None = None) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", **(extra or {})}
    if SITE.exists():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE), env.get("PYTHONPATH")]))
    return env


def run(command: list[str], log, timeout: int, env: dict | None = None) -> dict:
    """Run `command` in the repository, its output into the log; never raises. Past `timeout` it is
    interrupted (Ctrl-C: pytest still writes the junit XML of the cases it ran), then, if still running
    after STOP_GRACE_S, killed with every process it started (launched ranks would keep holding the GPU)."""
    started = time.monotonic()
    log.write(f"\n$ {' '.join(command)}\n")
    log.flush()
    process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=launch_env(env),
                               start_new_session=True)
    try:
        code = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        code = "timeout"
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
    return {"returncode": code, "seconds": round(time.monotonic() - started, 1)}


def junit_cases(path: Path) -> list[dict]:
    """Each test case of a junit XML: name, outcome, seconds and its recorded properties."""
    if not path.exists():
        return []
    cases = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            element = case.find(tag)
            if element is not None:
                outcome = f"{tag}: {(element.get('message') or '').splitlines()[0][:160] if element.get('message') else ''}"
        properties = {p.get("name"): p.get("value") for p in case.iter("property")}
        if case.get("name") is None:  # pytest's entry for the Ctrl-C that stopped a part at its time
            continue
        cases.append({"name": case.get("name"), "outcome": outcome, "seconds": float(case.get("time", 0)),
                      **properties})
    return cases


def summary_markdown(record: dict) -> str:
    env = record["environment"]
    title = ("CPU stand-in (no GPU: the plumbing only, fp32, the tiny model)" if record.get("cpu_stand_in")
             else f"{env.get('gpu')} x {env.get('gpus')}")
    flags = "".join(f" --{k.replace('_', '-')}" + ("" if v is True else f" {v}")
                    for k, v in (("cpu_stand_in", record.get("cpu_stand_in")), ("budget_s", record.get("budget_s"))) if v)
    install = record.get("install")
    installed = ([f"Wheels: {len(install['wheels'])} installed in {install.get('seconds')} s (exit codes "
                  f"{install['returncodes']})" if install.get("returncodes") else "Wheels: already installed", ""]
                 if install else [])
    lines = [f"# GPU check, {record['date']}: {title}", "",
             f"`python scripts/measure/gpu_check.py --parts {record['parts']}{flags}` at commit {record['commit']}.", "",
             *installed,
             "Versions: " + ", ".join(f"{k} {v}" for k, v in env.items() if k not in ("gpu", "gpus") and v), ""]
    for part, result in record["results"].items():
        ended = (f"not started: {result['why']}" if result["returncode"] == "not started"
                 else f"exit {result['returncode']} after {result['seconds']} s")
        lines += [f"## {part}", "", ended, ""]
        if result["returncode"] != "not started" and result.get("why"):
            lines += [f"**{result['why']}**", ""]
        cases = result.get("cases", [])
        if cases:
            keys = sorted({k for c in cases for k in c} - {"name", "outcome", "seconds"})
            columns = ["case", "outcome", "s", *keys]
            lines += ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
            lines += ["| " + " | ".join([c["name"], c["outcome"], f"{c['seconds']:.0f}",
                                         *(str(c.get(k, "")) for k in keys)]) + " |" for c in cases]
            lines.append("")
        if result.get("end_to_end_s"):
            lines += ["end to end (launch to adapter saved): " + ", ".join(f"{name} {seconds} s" for name, seconds
                                                                     in result["end_to_end_s"].items()), ""]
        if result.get("table"):
            lines += [result["table"], ""]
        if result.get("summary"):
            summary = result["summary"]
            lines += [f"median target tokens/s: {summary.get('median_tokens_per_s')}; ratio (ours / TRL): "
                      f"{summary.get('ratio')}; median end to end: {summary.get('median_end_to_end_s')} s (TRL / ours: "
                      f"{summary.get('end_to_end_ratio')})", ""]
    return "\n".join(lines) + "\n"


def copy_benchmark(part: str, folder: Path, results_dir: Path, result: dict) -> None:
    """benchmark.py's table (into the summary), numbers and chart (as <part>.json / <part>.png), from its
    newest results folder under `folder`."""
    tables = sorted(folder.rglob("results.md"), key=lambda p: p.stat().st_mtime)
    if not tables:
        return
    source = tables[-1].parent
    result["table"] = tables[-1].read_text().replace("(chart.png)", f"({part}.png)")
    rows = json.loads((source / "results.json").read_text()).get("rows", []) if (source / "results.json").exists() else []
    result["end_to_end_s"] = {row["strategy"]: row["end_to_end_s"] for row in rows if row.get("end_to_end_s")}
    copied = [("results.json", f"{part}.json")] + ([("chart.png", f"{part}.png")] if part in CHARTS else [])
    for name, target in copied:
        if (source / name).exists():
            (results_dir / target).write_bytes((source / name).read_bytes())


def commit_of(wheels: Path | None) -> str:
    """The repository's commit: from the COMMIT file scripts/measure/gpu_wheels.sh writes beside the wheels
    just before a call (a GPU box may get the tree without git, or with a .git older than the tree it
    runs: seen on the first lent H100), else from git."""
    written = wheels / "COMMIT" if wheels else None
    if written and written.exists():
        return f"{written.read_text().strip()} (from {written})"
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.strip()
    except OSError:
        pass
    return "unknown"


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    parts = args.parts.split(",")
    stand_in = {"RECIPES_GPU_SUITE_ON_CPU": "1"} if args.cpu_stand_in else None
    date = datetime.date.today().isoformat()
    results_dir = args.results
    results_dir_default = results_dir is None
    record = {"date": date, "parts": args.parts, "commit": commit_of(args.wheels), "cpu_stand_in": args.cpu_stand_in,
              "budget_s": args.budget_s, "results": {}}
    temporary = Path(f"/tmp/gpu-check-log-{os.getpid()}.txt")
    with open(temporary, "w") as log:
        if args.wheels:
            record["install"] = install_wheels(args.wheels, log)
        record["environment"] = environment()
        if results_dir_default:
            gpu = (record["environment"].get("gpu") or "no-gpu").replace(" ", "-")
            results_dir = REPO / "results" / f"{date}_{gpu}"
        results_dir.mkdir(parents=True, exist_ok=True)

        def save() -> None:
            (results_dir / "results.json").write_text(json.dumps(record, indent=2) + "\n")
            (results_dir / "summary.md").write_text(summary_markdown(record))
            log.flush()
            (results_dir / "log.txt").write_text(temporary.read_text())

        save()
        scratch = Path("/tmp/gpu-check")
        scratch.mkdir(parents=True, exist_ok=True)
        # compiled kernels in a cache of this call's own: the first compiled launch starts cold, later ones warm
        kernels = {"TORCHINDUCTOR_CACHE_DIR": str(scratch / f"inductor-{os.getpid()}")}
        record["kernel_cache"] = kernels["TORCHINDUCTOR_CACHE_DIR"]
        for part in parts:
            command, timeout, needed = PARTS[part]
            if args.cpu_stand_in and part in CPU_STAND_IN:
                command = CPU_STAND_IN[part]
            left = None if args.budget_s is None else args.budget_s - (time.monotonic() - started) - SAVE_MARGIN_S
            if left is not None and left < needed:
                record["results"][part] = {"returncode": "not started", "seconds": 0,
                                           "why": f"{left:.0f} s of the budget left, {needed} s needed"}
                save()
                print(f"{part}: not started ({left:.0f} s left of the budget, {needed} s needed)", flush=True)
                continue
            command = [sys.executable, *command]
            junit = scratch / f"junit-{part}.xml"
            junit.unlink(missing_ok=True)
            if part in BENCHMARKS:  # the built models shared between parts and, on a warm box, calls
                command += ["--output-dir", str(scratch / part), "--model-cache", str(scratch / "models")]
            elif part in STEP_TABLES:
                command += ["--output", str(scratch / part)]
            elif part in ("trl", "trl_liger"):
                if not args.cpu_stand_in:
                    run([sys.executable, *BUILD_MODEL], log, timeout=600)
                command += ["--output-dir", str(scratch / part)]
            else:
                command += [f"--junitxml={junit}"]
            result = run(command, log, timeout=timeout if left is None else int(min(timeout, left)),
                         env={**kernels, **(stand_in or {})})
            if part in ("trl", "trl_liger") and (scratch / part / "summary.json").exists():
                result["summary"] = json.loads((scratch / part / "summary.json").read_text())
            result["cases"] = junit_cases(junit)
            if command[-1] == f"--junitxml={junit}" and not result["cases"]:  # a test file missing, a collection error
                result["why"] = f"no test case ran (pytest exit {result['returncode']}): its output is in log.txt"
            if part in BENCHMARKS:
                copy_benchmark(part, scratch / part, results_dir, result)
            if part in STEP_TABLES and (scratch / part / "step_speed.md").exists():
                result["table"] = (scratch / part / "step_speed.md").read_text()
                (results_dir / f"{part}.json").write_text((scratch / part / "step_speed.json").read_text())
            record["results"][part] = result
            save()
            print(f"{part}: exit {result['returncode']} after {result['seconds']} s"
                  + (f"; {result['why']}" if result.get("why") else ""), flush=True)
    print(f"results in {results_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
