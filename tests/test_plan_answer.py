"""scripts/plan.py's answer, read as a user pastes it: each `Launch:` and `or:` line parses with accelerate's
launcher and the recipe's own flags and trains the named model on the user's data with the plan's micro-batch,
accumulation and layout, and holds nothing the shell would read as its own (the data is one plain word to
replace); the Fastest line names the global batch of its row; each recommendation says whether it has run on a
GPU in this project, and the answer what the ranking holds for; a card the planner does not know, or a memory
without its card, is refused in one line; --global-batch-size plans every config at it, as the recipes settle
it; one GPU is never given a config that only shards. No training runs.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from accelerate.commands.launch import launch_command_parser

from conftest import REPO

sys.path.insert(0, str(REPO / "recipes"))
sys.path.insert(0, str(REPO / "scripts"))
import plan as plan_cli  # noqa: E402  (scripts/plan.py)
import planner  # noqa: E402
from common.launching import batch_size  # noqa: E402
from common.launching.args import parse_args, recipe_flags  # noqa: E402
from common.launching.launch import Launch  # noqa: E402
from common.model.model_config import DEFAULT_MODEL  # noqa: E402
from common.refusal import Refusal  # noqa: E402

PLAN = REPO / "scripts" / "plan.py"
USER_DATA = "my_data.jsonl"  # what a user puts in place of the --dataset placeholder
SHELL_SPECIAL = re.compile(r"[<>|&;()$`\\\"'*?\[\]#~{}!]")  # what bash would read as redirection, glob, ...

# The reference workloads, as a new user would try them, and the variants around them.
WORKLOADS = {
    "defaults": [],
    "codellama-34b on 4 GPUs": ["--model", "codellama-34b", "--gpus", "4", "--batch-size", "4", "--grad-accum", "4"],
    "tinyllama-1.1b on 4 GPUs": ["--model", "tinyllama-1.1b", "--gpus", "4", "--batch-size", "16", "--grad-accum",
                                 "2", "--rows", "1024", "--seq-len", "1024"],
    "codellama-34b on 1 GPU": ["--model", "codellama-34b", "--gpus", "1", "--batch-size", "4", "--grad-accum", "4"],
    "codellama-34b pipeline over PCIe": ["--model", "codellama-34b", "--gpu", "rtx6000-ada", "--batch-size", "4",
                                         "--grad-accum", "4", "--seq-len", "1024", "--gradient-checkpointing"],
    "codellama-34b global batch 64": ["--model", "codellama-34b", "--gpus", "4", "--batch-size", "4",
                                      "--global-batch-size", "64"],
    "tinyllama-1.1b full on 1 GPU": ["--model", "tinyllama-1.1b", "--method", "full", "--gpus", "1"],
    "phi-3-mini full on 1 GPU": ["--model", "phi-3-mini", "--method", "full", "--gpus", "1"],
    "codellama-34b qlora on 1 GPU": ["--model", "codellama-34b", "--method", "qlora", "--gpus", "1"],
    "llama-3.1-8b full, fp32, eager, on 8 GPUs": ["--model", "llama-3.1-8b", "--method", "full", "--gpus", "8",
                                                  "--precision", "fp32", "--attention", "eager"],
    "mistral-7b lora r8 on two targets": ["--model", "mistral-7b", "--lora-r", "8", "--lora-targets", "q_proj,v_proj",
                                          "--lora-dropout", "0", "--attention", "flash", "--seq-len", "2048"],
}


def run_plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PLAN), *args], capture_output=True, text=True, timeout=60)


def answer(argv: list[str]) -> tuple[dict, str]:
    """(the --json plan, the table's text) of one workload."""
    as_json, as_text = run_plan("--json", *argv), run_plan(*argv)
    assert as_json.returncode == 0 and as_text.returncode == 0, as_json.stderr + as_text.stderr
    return json.loads(as_json.stdout), as_text.stdout


def recommendations(plan: dict) -> list[dict]:
    """The recommended runs that print a launch line: the one launched first, the other of the fastest and the
    fastest tested when they differ, and the fewest GPUs' when fewer."""
    rec = plan["recommendation"]
    pair = [rec["fastest"]] + ([rec["tested"]] if rec["tested"] else [])
    fewer = rec["fewest_gpus"] and rec["fewest_gpus"]["gpus"] < rec["fastest"]["gpus"]
    return (pair[::-1] if rec["first"] == "tested" else pair) + ([rec["fewest_gpus"]] if fewer else [])


def pasted(line: str):
    """A launch line as the user runs it, data filled in: accelerate's arguments and the recipe's run."""
    assert plan_cli.DATASET_PLACEHOLDER in line  # the recipes' default data is the bundled toy task
    words = shlex.split(line.replace(plan_cli.DATASET_PLACEHOLDER, USER_DATA))
    assert words[:2] == ["accelerate", "launch"]
    launcher = launch_command_parser().parse_args(words[2:])
    recipe = Path(launcher.training_script).stem
    assert (REPO / launcher.training_script).is_file() and recipe in (*planner.METHODS, "dpo", "dpo_full")
    return launcher, recipe, parse_args(recipe_flags(recipe), launcher.training_script_args)


def recipe_launch(launcher, run) -> Launch:
    """The recipes' view of the pasted launch: what they count data-parallel processes from."""
    return Launch("ddp", processes=launcher.num_processes or 1, on_gpu=False, visible_gpus=0, precision="no",
                  tensor_parallel=launcher.parallelism_config_tp_size or 1, pipeline_stages=run.pipeline_stages)


def plan_args(argv: list[str]):
    return plan_cli.parse_args(argv)


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_each_launch_line_parses_and_runs_the_plan(workload):
    """Every flag of the printed launch is one the launcher or the recipe takes (a misspelt one is refused by
    their parsers), and the recipe would run what the plan planned: the model, the user's data, the
    micro-batch, the accumulation (or the global batch it settles to the same), the layout, the precision."""
    argv = WORKLOADS[workload]
    asked = plan_args(argv)
    plan, text = answer(argv)
    printed = [line.split(": ", 1)[1] for line in text.splitlines() if line.startswith(("Launch: ", "    or: "))]
    runs = recommendations(plan)
    assert printed == [rec["launch"] for rec in runs]  # the table and --json say the same
    for rec in runs:
        assert not SHELL_SPECIAL.search(rec["launch"]), rec["launch"]  # bash runs it as printed, data unreplaced
        launcher, recipe, run = pasted(rec["launch"])
        assert recipe == asked.method and Path(launcher.config_file) == Path(rec["config"])
        assert run.model == planner.launch_model(asked.model) and run.dataset == [USER_DATA]
        if rec["strategy"] == "model_parallel":  # one process, as the config file says
            assert launcher.num_processes is None
        else:
            assert launcher.num_processes == rec["gpus"]
        assert launcher.mixed_precision == ("no" if asked.precision == "fp32" else None)  # else the file's bf16
        assert (run.batch_size, run.max_length, run.gradient_checkpointing) == (
            rec["micro_batch"], asked.seq_len, rec["gradient_checkpointing"])
        assert run.pipeline_stages == rec.get("pipeline_stages", 1)
        assert (run.pipeline_schedule == "interleaved") == (rec.get("pipeline_chunks", 1) > 1)
        settled, _ = batch_size.settle(run, recipe, recipe_launch(launcher, run))
        assert settled.grad_accum == rec["grad_accum"]
        ranks = recipe_launch(launcher, run).data_parallel_size
        assert settled.batch_size * settled.grad_accum * ranks == rec["global_batch"]
        if recipe != "full":
            assert (run.lora_r, run.lora_dropout) == (asked.lora_r, asked.lora_dropout)
            assert run.lora_targets == asked.lora_targets
        assert run.attention == plan_cli.RECIPE_ATTENTION.get(asked.attention)


@pytest.mark.parametrize("method, recipe", [("lora", "dpo"), ("qlora", "dpo"), ("full", "dpo_full")])
def test_a_preference_plan_launches_the_preference_recipe_in_pairs(method, recipe):
    """--pairs: the launch lines run dpo.py (--bits 4 for QLoRA) or dpo_full.py with the plan's micro-batch of
    pairs, the global batch counts pairs as the recipes settle it, no pipeline is offered (the preference
    recipes refuse it), and full tuning's answer says what its reference's pass before training costs."""
    argv = ["--pairs", "--method", method, "--model", "llama-3.1-8b", "--gpus", "4", "--batch-size", "4",
            "--global-batch-size", "32", "--rows", "50000"]
    plan, text = answer(argv)
    assert plan["pairs"] and "pipeline" not in {entry["strategy"] for entry in plan["strategies"]}
    for rec in recommendations(plan):
        launcher, script, run = pasted(rec["launch"])
        assert script == recipe and getattr(run, "bits", None) == (4 if method == "qlora" else None)
        assert run.batch_size == rec["micro_batch"] and run.global_batch_size == 32
        settled, _ = batch_size.settle(run, recipe, recipe_launch(launcher, run))
        assert settled.batch_size * settled.grad_accum * recipe_launch(launcher, run).data_parallel_size == 32
        assert ("reference_pass_seconds" in rec) == (method == "full")
    assert "global batch 32 pairs a step" in text and "Time per optimizer step and per epoch of 50,000 pairs" in text
    assert ("scores the 50,000 pairs with the model as loaded" in text) == (method == "full")


@pytest.mark.parametrize("strategy", planner.SPEED_ORDER)
def test_every_strategys_launch_line_parses(strategy):
    """Each config's launch flags (tensor parallel's mesh, a pipeline's stages and schedule, fp32, LoRA's
    settings, a global batch) are spelt as accelerate and the recipes take them."""
    method = "lora" if strategy != "fsdp_tp" else "full"
    args = plan_args(["--method", method, "--gpus", "4", "--precision", "fp32", "--lora-r", "8",
                      "--lora-targets", "q_proj,k_proj", "--global-batch-size", "32", "--attention", "flash"])
    rec = {"strategy": strategy, "config": planner.STRATEGIES[strategy], "gpus": 4, "micro_batch": 2,
           "grad_accum": 4, "gradient_checkpointing": 2, "global_batch": 32}
    if strategy == "pipeline":
        rec.update(pipeline_stages=2, pipeline_chunks=2)
    if strategy == "sp":
        rec.update(sequence_parallel=4)
    launcher, recipe, run = pasted(plan_cli.recommended_launch(rec, args))
    assert recipe == method and run.global_batch_size == 32 and run.gradient_checkpointing == 2
    assert launcher.mixed_precision == "no" and run.attention == "flash_attention_2"
    if strategy in planner.TENSOR_PARALLEL:
        tp = planner.tensor_parallel_size(strategy, 4)
        assert launcher.parallelism_config_tp_size == tp
        assert (launcher.parallelism_config_dp_shard_size or 1) * tp == 4
    if strategy == "sp":  # the group the plan chose, over the file's 2
        assert launcher.parallelism_config_sp_size == 4
    if method == "lora":
        assert (run.lora_r, run.lora_targets) == (8, "q_proj,k_proj")


def test_the_launch_spells_out_only_what_differs_from_the_recipes_defaults():
    """plan.py's defaults are the recipes' own, so a Launch line without --lora-r runs r=16, and the plan's
    attention names are ones the recipes' --attention takes."""
    parser = recipe_flags("lora")
    for name, value in plan_cli.RECIPE_DEFAULTS.items():
        assert parser.get_default(name) == value, name
    choices = next(action.choices for action in parser._actions if action.dest == "attention")
    assert set(plan_cli.RECIPE_ATTENTION.values()) <= set(choices)
    assert set(plan_cli.RECIPE_ATTENTION) | {"sdpa"} == set(planner.ATTENTIONS)
    default_line = plan_cli.recommended_launch(
        {"strategy": "ddp", "config": planner.STRATEGIES["ddp"], "gpus": 2, "micro_batch": 8, "grad_accum": 1,
         "gradient_checkpointing": 0, "global_batch": 16}, plan_args([]))
    assert not re.search("--(lora|attention|grad-accum|global-batch-size|mixed_precision)", default_line)


def test_an_alias_launches_its_hub_id_and_a_path_as_given(tmp_path):
    assert set(planner.HUB_IDS) == set(planner.ALIASES)
    for alias, hub_id in planner.HUB_IDS.items():
        if alias == "tiny-llama":  # the bundled model the recipes build and load by default
            assert (REPO / hub_id).resolve() == DEFAULT_MODEL.resolve()
            continue
        organisation, name = hub_id.split("/")
        assert organisation and alias in name.lower(), (alias, hub_id)  # the model the alias names
        assert planner.launch_model(alias.upper()) == hub_id
        assert planner.launch_model(str(planner.ALIASES[alias])) == hub_id  # the alias's own config file
    folder = tmp_path / "my model"
    folder.mkdir()
    (folder / "config.json").write_text(planner.ALIASES["tinyllama-1.1b"].read_text())
    assert planner.launch_model(str(folder)) == str(folder)
    assert planner.launch_model(str(folder / "config.json")) == str(folder)
    (tmp_path / "sizes.json").write_text("{}")
    assert planner.launch_model(str(tmp_path / "sizes.json")) == planner.MODEL_PLACEHOLDER  # no weights there
    assert planner.launch_model("some-org/some-model") == "some-org/some-model"
    done = run_plan("--model", str(folder))
    launch = next(line for line in done.stdout.splitlines() if line.startswith("Launch: "))
    assert pasted(launch.split(": ", 1)[1])[2].model == str(folder)  # quoted for the shell


def test_the_fastest_line_names_the_global_batch_of_its_row():
    """CodeLlama-34B on 4 GPUs: the pipeline, model parallel and the data-parallel configs run different global
    batches; the Fastest and Fewest lines name the one of the plan they recommend."""
    plan, text = answer(WORKLOADS["codellama-34b on 4 GPUs"])
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("strategy") and "global batch" in line)
    column = lines[start].index("global batch") + len("global batch")
    table = {}
    for line in lines[start + 1:lines.index("", start)]:
        if "does not fit" not in line:
            table[line.split()[0]] = int(line[:column].split()[-1])
    assert len(set(table.values())) > 1  # the strategies' global batches do differ here
    fastest = re.search(r"^Fastest (?:tested )?that fits on 4 GPUs: (\S+) .*?, global batch (\d+) rows a step,", text,
                        re.M)
    assert fastest and int(fastest[2]) == table[fastest[1]] == recommendations(plan)[0]["global_batch"]
    fewest = re.search(r"^Fewest GPUs: .*: global batch (\d+) rows a step ", text, re.M)
    assert int(fewest[1]) == plan["recommendation"]["fewest_gpus"]["global_batch"]
    asked = 4 * 4 * 4  # --batch-size x --grad-accum on each of 4 GPUs
    assert f"--global-batch-size {asked} plans them all" in text


def test_a_global_batch_plans_every_config_at_it():
    plan, text = answer(WORKLOADS["codellama-34b global batch 64"])
    assert plan["global_batch_size"] == 64
    running = [entry for entry in plan["strategies"] if entry["run"]]
    assert len(running) >= 5 and all(entry["refusal"] is None for entry in plan["strategies"])
    for entry in running:
        run = entry["run"]
        ranks = planner.data_parallel_size(entry["strategy"], 4, run.get("pipeline_stages"))
        assert run["global_batch"] == run["micro_batch"] * run["grad_accum"] * ranks == 64, entry["strategy"]
        assert run["micro_batch"] <= 4  # --batch-size stays the largest micro-batch tried
    rows = [line.split() for line in text.split("Time per optimizer step")[1].split("\n\n")[0].splitlines()[2:]]
    assert {row[0] for row in rows if "does not fit" not in " ".join(row)} == {e["strategy"] for e in running}
    for rec in recommendations(plan):
        assert rec["global_batch"] == 64
        assert "--global-batch-size 64" in rec["launch"] and "--grad-accum" not in rec["launch"]
    assert "global batches differ" not in text
    # the asked per-GPU batch alone gives the pipeline and model parallel other global batches
    without = answer(WORKLOADS["codellama-34b on 4 GPUs"])[0]
    assert len({e["run"]["global_batch"] for e in without["strategies"] if e["run"]}) > 1


def test_a_global_batch_a_config_cannot_split_marks_its_row_as_the_recipes_refuse():
    plan, text = answer(["--model", "codellama-34b", "--gpus", "4", "--batch-size", "4", "--global-batch-size", "6"])
    refused = {entry["strategy"]: entry["refusal"] for entry in plan["strategies"] if entry["refusal"]}
    assert "ddp" in refused and "model_parallel" not in refused
    with pytest.raises(Refusal) as recipes_refusal:  # the recipe's own verdict on 4 data-parallel processes
        batch_size.settle(parse_args(recipe_flags("lora"), ["--global-batch-size", "6"]), "lora",
                          Launch("ddp", processes=4, on_gpu=False, visible_gpus=0, precision="no"))
    assert refused["ddp"] == recipes_refusal.value.message == planner.uneven_global_batch(6, 4)
    assert "use 8 or 4" in refused["ddp"]
    for strategy, reason in refused.items():
        assert re.search(rf"^{strategy} +cannot run it +{re.escape(reason)}$", text, re.M)
        assert next(e for e in plan["strategies"] if e["strategy"] == strategy)["run"] is None
    for entry in plan["strategies"]:
        if entry["run"]:
            assert entry["run"]["global_batch"] == 6
    assert "--global-batch-size 6" in plan["recommendation"]["fastest"]["launch"]


def test_a_global_batch_no_config_can_run_is_one_line():
    # (the bundled model's 4 heads: sequence parallel's groups of 2 or 4 leave 8 or 4 data-parallel processes;
    # a model whose heads a group of all 16 GPUs divides runs any global batch that way)
    done = run_plan("--model", "tiny-llama", "--gpus", "16", "--global-batch-size", "6")
    assert done.returncode == 2 and not done.stdout
    assert done.stderr.strip() == f"plan.py: {planner.uneven_global_batch(6, 16)}"
    both = run_plan("--global-batch-size", "64", "--grad-accum", "2")
    assert both.returncode == 2 and "drop --grad-accum" in both.stderr.strip().splitlines()[-1]


ONLY_SHARDING = [planner.STRATEGIES[s] for s in planner.SPEED_ORDER if s not in planner.ONE_GPU]


@pytest.mark.parametrize("workload", [w for w in sorted(WORKLOADS) if "1 GPU" in w])
def test_one_gpu_is_never_given_a_config_that_only_shards(workload):
    plan, text = answer(WORKLOADS[workload])
    for config in ONLY_SHARDING:
        assert config not in text and config not in json.dumps(plan), config
    assert {entry["strategy"] for entry in plan["strategies"]} <= set(planner.ONE_GPU)
    fastest = plan["recommendation"]["fastest"]
    assert fastest["strategy"] in planner.ONE_GPU and "--num_processes 1 " in fastest["launch"]


def test_the_one_gpu_answers_that_used_to_name_zero1():
    """Phi-3-mini full and CodeLlama-34B QLoRA on one H100: among all the configs the recipes run, ZeRO-1 on one
    process planned fastest (DeepSpeed's bf16 weights leave more room for activations; with the loss chunked
    DDP may match it); the answer is ddp.yaml as a single process, and the fewest-GPU answer of a larger ask is
    one too."""
    for model, method in (("phi-3-mini", "full"), ("codellama-34b", "qlora")):
        shape = planner.load_shape(model)
        machine = planner.Machine.of()
        runs = [(s, planner.best_run(shape, method, s, 1, 80, machine))
                for s in planner.possible_strategies(method, 1, shape)]
        assert min((run for _, run in runs if run), key=planner.rank_key) in [run for s, run in runs
                                                                              if s in ("zero1", "ddp")]
        plan = planner.plan(shape, method, 1, 80)
        assert plan["recommendation"]["fastest"]["strategy"] == "ddp"
        wider = planner.plan(shape, method, 4, 80)["recommendation"]["fewest_gpus"]
        assert wider["gpus"] > 1 or wider["strategy"] in planner.ONE_GPU


def test_the_placeholder_is_said_beside_the_launch_and_refused_by_the_recipes_unreplaced():
    """The one word to replace is named on the line under the Launch line; pasted as printed, it reaches the
    recipe whole (no redirection), which refuses it in one line naming what to give."""
    lines = run_plan(*WORKLOADS["codellama-34b pipeline over PCIe"]).stdout.splitlines()
    launch = next(i for i, line in enumerate(lines) if line.startswith("Launch: "))
    assert lines[launch + 1] == f"    (replace {plan_cli.DATASET_PLACEHOLDER} with your data file, folder or hub id)"
    launcher = launch_command_parser().parse_args(shlex.split(lines[launch].split(": ", 1)[1])[2:])
    run = parse_args(recipe_flags("lora"), launcher.training_script_args)
    assert run.dataset == [plan_cli.DATASET_PLACEHOLDER]
    from common.data.data_files import read_splits

    with pytest.raises(Refusal, match=f"^--dataset {plan_cli.DATASET_PLACEHOLDER} ") as refusal:  # (offline: not cached)
        read_splits(plan_cli.DATASET_PLACEHOLDER)
    assert "\n" not in refusal.value.message


def test_a_config_json_asks_for_its_model_in_a_plain_word(tmp_path):
    config = tmp_path / "sizes.json"
    config.write_text(planner.ALIASES["mistral-7b"].read_text())
    lines = run_plan("--model", str(config)).stdout.splitlines()
    launch = next(i for i, line in enumerate(lines) if line.startswith("Launch: "))
    assert f"--model {planner.MODEL_PLACEHOLDER} --dataset {plan_cli.DATASET_PLACEHOLDER} " in lines[launch]
    assert not SHELL_SPECIAL.search(lines[launch])
    assert lines[launch + 1] == (f"    (replace {plan_cli.DATASET_PLACEHOLDER} with your data file, folder or hub id, "
                                 f"and {planner.MODEL_PLACEHOLDER} with the hub id or folder of this model's weights)")


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_each_recommendation_says_whether_it_ran_on_a_gpu_and_what_it_is_ranked_for(workload):
    """The Fastest and Fewest lines end with what their strategy rests on: run on a GPU in this project (on how
    many), or an estimate only; the line after Fastest names the sequence length and batch the ranking holds for."""
    argv = WORKLOADS[workload]
    asked = plan_args(argv)
    plan, text = answer(argv)
    rec = plan["recommendation"]
    first = recommendations(plan)[0]
    lines = text.splitlines()
    fastest = next(i for i, line in enumerate(lines) if line.startswith("Fastest "))
    assert lines[fastest].endswith(" " + planner.gpu_evidence(first["strategy"], first["gpus"]))
    fewest = next(line for line in lines if line.startswith("Fewest GPUs: "))
    assert fewest.endswith(" " + planner.gpu_evidence(rec["fewest_gpus"]["strategy"], rec["fewest_gpus"]["gpus"]))
    batch = (f"--global-batch-size {asked.global_batch_size}" if asked.global_batch_size else
             f"--batch-size {asked.batch_size} x --grad-accum {asked.grad_accum} per data-parallel process")
    assert lines[fastest + 1].startswith(f"Ranked for --seq-len {asked.seq_len} and {batch}: ")
    for kind in ("fastest", "tested", "fewest_gpus"):
        if rec[kind]:
            ran = planner.RAN_ON_GPU.get(rec[kind]["strategy"])
            assert rec[kind]["ran_on_gpu"] == (ran and {"gpus": ran.gpus, "results": ran.results})


def answer_lines(argv: list[str]) -> tuple[dict, list[str]]:
    plan, text = answer(argv)
    return plan, text.splitlines()


# The question of issue 63: CodeLlama-34B LoRA on 4 x 48 GB, with plan.py's defaults but the card
USERS_QUESTION = ["--model", "codellama-34b", "--method", "lora", "--gpus", "4", "--gpu", "rtx6000-ada"]


@pytest.mark.parametrize("argv", [USERS_QUESTION, WORKLOADS["codellama-34b pipeline over PCIe"],
                                  ["--model", "llama-3.1-8b", "--gpus", "8", "--batch-size", "1", "--seq-len", "65536",
                                   "--global-batch-size", "8"],
                                  ["--model", "codellama-34b", "--gpus", "4", "--gpu", "l40s", "--batch-size", "4"],
                                  ["--model", "llama-3.1-8b", "--method", "full", "--gpus", "4", "--gpu", "rtx6000-ada",
                                   "--batch-size", "4"]])
def test_a_config_no_gpu_has_run_is_launched_first_only_when_clearly_faster(argv):
    """Where the fastest config has not run on a GPU here, the fastest that has is launched first unless the
    other's estimate is CLEARLY_FASTER; either way both are said, each with its launch line, and why."""
    plan, lines = answer_lines(argv)
    rec = plan["recommendation"]
    fastest, tested = rec["fastest"], rec["tested"]
    assert fastest["strategy"] not in planner.RAN_ON_GPU and tested["strategy"] in planner.RAN_ON_GPU
    tested_entry = next(e for e in plan["strategies"] if e["strategy"] == tested["strategy"])
    assert tested_entry["run"]["time"]["step"] == tested["seconds_per_step"]  # its row of the time table
    lead = tested["seconds_per_epoch"] / fastest["seconds_per_epoch"]
    assert lead > 1 + planner.TIE  # (a tie goes to the tested one: then it is the fastest, and nothing is said)
    first, other = (fastest, tested) if lead >= planner.CLEARLY_FASTER else (tested, fastest)
    assert rec["first"] == ("fastest" if first is fastest else "tested")
    assert lines[[i for i, line in enumerate(lines) if line.startswith("Launch: ")][0]] == f"Launch: {first['launch']}"
    said = next(i for i, line in enumerate(lines) if line.startswith(("Tested instead: ", "Faster by the estimate: ")))
    assert lines[said + 1] == f"    or: {other['launch']}"
    if first is fastest:
        assert lines[said].startswith(f"Tested instead: {tested['strategy']} ({tested['config']}), ")
        assert f"({lead:.2f}x slower by the estimate)" in lines[said]
        assert f", {fastest['strategy']} never: " in lines[said]
    else:
        assert lines[said].startswith(f"Faster by the estimate: {fastest['strategy']} ({fastest['config']}), ")
        assert f"({lead:.2f}x faster)" in lines[said] and "it has not run on a GPU in this project" in lines[said]
    assert f"only when its estimate is {planner.CLEARLY_FASTER:g}x the speed" in lines[said]


def test_the_users_question_says_the_tested_fsdp_beside_the_pipeline():
    """Issue 63: the answer launched pipeline.yaml, which has not run on a GPU here, and said nothing of FSDP, the
    README's measured reference for this model; it now names FSDP, which has run on a GPU, with its launch line."""
    plan, lines = answer_lines(USERS_QUESTION)
    rec = plan["recommendation"]
    assert rec["tested"]["strategy"] == "fsdp_full_shard" and "--config_file accelerate_configs/fsdp.yaml " in \
        rec["tested"]["launch"]
    assert f"    or: {rec['tested']['launch']}" in lines


def test_a_tie_goes_to_the_config_that_has_run_on_a_gpu():
    runs = [(strategy, {"tight": False, "time": {"tokens_per_s": speed}})
            for strategy, speed in (("pipeline", 1000), ("tp", 990), ("fsdp_full_shard", 980), ("zero1", 1100))]
    assert planner.fastest_of(runs)[0] == "zero1"  # beyond the tie: the fastest
    assert planner.fastest_of(runs[:3])[0] == "fsdp_full_shard"  # within 3%: the tested one
    assert planner.tested_beside(runs[:3]) == (None, False)
    assert planner.tested_beside(runs) == (runs[2], True)  # 1100 / 980 < 2
    quick = [("pipeline", {"tight": False, "time": {"tokens_per_s": 2000}}), runs[2]]
    assert planner.tested_beside(quick) == (runs[2], False)  # 2000 / 980 >= 2: the pipeline first


def test_the_gpus_said_to_have_run_are_in_the_results():
    """RAN_ON_GPU is the one place that says what ran on a GPU: each entry's results README names its config and
    a GPU; the pipeline, model parallel and tensor parallel have run on CPU processes only."""
    for strategy, ran in planner.RAN_ON_GPU.items():
        readme = (REPO / ran.results / "README.md").read_text()
        assert Path(planner.STRATEGIES[strategy]).name in readme and re.search(r"NVIDIA H\d00", readme), strategy
        assert ran.gpus >= 1
    assert not {"pipeline", "model_parallel", "tp", "fsdp_tp"} & set(planner.RAN_ON_GPU)
    assert planner.gpu_evidence("ddp", 1).startswith("Tested on a GPU: ddp has run on 1 GPU")
    assert planner.gpu_evidence("ddp", 4).startswith("Estimate only on 4 GPUs: ddp has run on 1 GPU")
    assert planner.gpu_evidence("pipeline", 4) == "Estimate only: pipeline has not run on a GPU in this project."


@pytest.mark.parametrize("name, closest", [("v100", ["h100"]), ("rtx6000", ["a6000", "rtx6000-ada"]),
                                           ("A100-80GB", ["a100"]), ("L40", ["l40s"]), ("mi300x", [])])
def test_an_unknown_gpu_is_one_line_naming_the_closest_and_every_known_one(name, closest):
    done = run_plan("--gpu", name)
    assert done.returncode == 2 and not done.stdout
    [line] = done.stderr.strip().splitlines()  # no usage above it
    hint = f" (closest: {' or '.join(closest)})" if closest else ""
    assert line.startswith(f"plan.py: error: unknown GPU {name!r}{hint}; --gpu takes {', '.join(planner.GPUS)} ")


@pytest.mark.parametrize("spelling", ["RTX 6000 Ada", "rtx6000_ada", "RTX6000-ADA", "rtx6000-ada"])
def test_a_gpu_is_known_by_its_key_or_its_own_name(spelling):
    assert planner.gpu_key(spelling) == "rtx6000-ada"


def test_a_gpu_memory_without_its_card_is_refused_in_one_line():
    """--gpu-memory 48 alone used to keep the H100's peak and NVLink with 48 GB: no card has both. No memory names
    one card (48 GB: an A6000, an RTX 6000 Ada, an L40S, and cards the planner does not know), so the answer asks
    for --gpu; with it, --gpu-memory changes only the memory."""
    done = run_plan("--model", "codellama-34b", "--gpu-memory", "48")
    assert done.returncode == 2 and not done.stdout
    [line] = done.stderr.strip().splitlines()
    assert line == ("plan.py: error: --gpu-memory 48 without --gpu would plan the default H100 SXM's peak and link: "
                    f"name the card with --gpu (48 GB: a6000, rtx6000-ada, l40s; all: {', '.join(planner.GPUS)}); "
                    "--gpu-memory then changes only its memory")
    assert "(all: " in run_plan("--gpu-memory", "32").stderr  # no known card of 32 GB
    plan, _ = answer(["--model", "codellama-34b", "--gpu", "rtx6000-ada", "--gpu-memory", "40"])
    assert plan["gpu_memory_gb"] == 40 and plan["machine"]["gpu"] == "RTX 6000 Ada"


@pytest.mark.parametrize("card", sorted(planner.GPUS))
def test_a_card_is_printed_as_sold_and_planned_as_cuda_gives_it(card):
    """A 48 GB card is "48 GB" (it was "48 GiB"), and the plan divides what CUDA gives of it (47.50 GiB of an RTX
    6000 Ada, 44.4 of an L40S with its ECC on), 90% of it usable; --gpu-memory is GB as sold, planned at the card's
    own ratio."""
    sold = planner.GPUS[card]
    plan, text = answer(["--gpu", card, "--gpus", "2"])
    assert plan["gpu_memory_gb"] == sold.memory_gb and plan["gpu_memory_gib"] == sold.cuda_gib < sold.memory_gb
    usable = planner.usable_bytes(sold.cuda_gib) / planner.GiB
    assert (f"GPUs: 2 x {sold.name}, {sold.memory_gb:g} GB each ({sold.cuda_gib:.2f} GiB as CUDA gives it); a plan "
            f"may use {usable:.2f} GiB of each ") in text
    assert not re.search(rf"(?<![\d.]){sold.memory_gb:g} GiB", text)  # the size sold is never GiB
    for entry in plan["strategies"]:  # each verdict against what CUDA gives, not the size sold
        assert entry["fits"] == (entry["per_gpu_bytes"]["total"] <= usable * planner.GiB)
    smaller, _ = answer(["--gpu", card, "--gpus", "2", "--gpu-memory", f"{sold.memory_gb / 2:g}"])
    assert smaller["gpu_memory_gib"] == pytest.approx(sold.cuda_gib / 2)


def test_the_memory_cuda_gave_the_lent_gpus_is_what_the_planner_plans():
    """The H100 and H200 this project ran on: CUDA gave 79.2 and 139.8 GiB of 80 and 141 GB."""
    for card, results in (("h100", "results/2026-11-26_h100_call1"), ("h200", "results/2026-11-27_h200_call1")):
        measured = json.loads((REPO / results / "results.json").read_text())
        found = re.findall(r'"gpu_memory_gib": ([0-9.]+)', json.dumps(measured))
        assert found and planner.GPUS[card].cuda_gib == float(found[0]), card


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_the_tables_show_the_checkpointing_each_config_is_planned_with(workload):
    """The memory table's checkpointing column is the time table's: a config never shows a memory without
    checkpointing beside a time planned with it (issue 63: FSDP 'no' beside 'checkpointing')."""
    plan, text = answer(WORKLOADS[workload])
    memory, timing = text.split("\n\nTime per optimizer step")
    rows = {line.split()[0]: line.split()[2] for line in memory.splitlines()[2:] if line.split()}
    for entry in plan["strategies"]:
        assert rows[entry["strategy"]] == plan_cli.checkpointing(entry["gradient_checkpointing"])
        if entry["run"]:
            timed = next(line for line in timing.splitlines() if line.startswith(entry["strategy"] + " "))
            assert (", checkpointing" in timed) == bool(entry["gradient_checkpointing"]), timed


def test_the_users_fsdp_row_fits_as_its_time_is_planned():
    plan, text = answer(USERS_QUESTION)
    row = next(line for line in text.splitlines() if line.startswith("fsdp_full_shard "))
    cells = row.split()
    assert cells[2] == "yes" and cells[-2] == "yes", row  # with checkpointing, as the time table plans it: it fits


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_the_fewest_gpus_line_says_its_batch_as_the_tables_plan_it(workload):
    """The Fewest GPUs line said 'micro-batch up to 70' (the largest that fits, at the checkpointing its run added)
    beside a 4-GPU row allowing 5 (the same config judged without). It now says the micro-batch, accumulation and
    processes that make its global batch, its checkpointing, and the largest micro-batch on its own GPUs at that
    checkpointing (a run on fewer GPUs may be planned otherwise than the table's row: the line says how)."""
    plan, text = answer(WORKLOADS[workload])
    fewest = plan["recommendation"]["fewest_gpus"]
    line = next(line for line in text.splitlines() if line.startswith("Fewest GPUs: "))
    ranks = planner.data_parallel_size(fewest["strategy"], fewest["gpus"], fewest.get("pipeline_stages"),
                                       fewest.get("sequence_parallel"))
    assert fewest["micro_batch"] * fewest["grad_accum"] * ranks == fewest["global_batch"]
    unit = "rows" if "--pairs" not in WORKLOADS[workload] else "pairs"
    assert re.search(rf"micro-batch {fewest['micro_batch']}( pairs?)? x {fewest['grad_accum']} accumulation x {ranks} "
                     rf"data-parallel process(es)?(, gradient checkpointing[^:]*)?: global batch {fewest['global_batch']} "
                     rf"{unit} a step \(a micro-batch of up to {fewest['max_micro_batch']} fits ", line), line
    assert (", gradient checkpointing" in line) == bool(fewest["gradient_checkpointing"])


def test_the_users_fewest_gpus_line_agrees_with_its_row():
    """An offload config keeps its training state in CPU RAM: one GPU holds the micro-batch four do."""
    plan, text = answer(USERS_QUESTION)
    fewest = plan["recommendation"]["fewest_gpus"]
    row = next(e for e in plan["strategies"] if e["strategy"] == fewest["strategy"])
    assert fewest["gpus"] == 1 and fewest["strategy"] in planner.OFFLOADED
    assert row["max_micro_batch"] == fewest["max_micro_batch"] >= fewest["micro_batch"]
