"""--eval-tasks: lm-evaluation-harness tasks scored inside the launch, on the model as each strategy holds it,
equal to lm-eval's own command on the merged model; and the one-line refusals before the model loads."""

from __future__ import annotations

import json
import subprocess
import sys
from unittest import mock

import pytest

from conftest import LONG_TESTS, REPO, launch, launch_env, long_test

sys.path.insert(0, str(REPO / "recipes"))
from common.launching import eval_tasks  # noqa: E402
from common.launching.args import parse_args, recipe_flags  # noqa: E402
from common.launching.launch import Launch  # noqa: E402
from common.refusal import Refusal  # noqa: E402
from common.training.benchmarks import scores_of  # noqa: E402

BUNDLED = REPO / "data" / "eval_tasks"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
# enough steps for the greedy answers to be right some of the time (~0.17 exact match): generation is then tested
TRAINING = ["--max-steps", "120", "--lr", "3e-3", "--batch-size", "16", "--max-length", "64"]


def lm_eval_command(model, output_dir, batch_size: int = 16, system: str | None = None) -> dict:
    """`lm_eval run --model hf` on a saved model, the bundled tasks, one CPU process: its scores; with `system`,
    through the model's chat template after that system turn (`--apply_chat_template --system_instruction`)."""
    chat = ["--apply_chat_template", "--system_instruction", system] if system else []
    done = subprocess.run(
        [sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--model_args", f"pretrained={model},dtype=float32",
         "--tasks", "recipes_choice,recipes_answer", "--include_path", str(BUNDLED), "--batch_size", str(batch_size),
         "--device", "cpu", "--output_path", str(output_dir), *chat],
        cwd=REPO, capture_output=True, text=True, timeout=600, env=launch_env(OFFLINE))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [written] = output_dir.rglob("results_*.json")
    return scores_of(json.loads(written.read_text()))


SYSTEM = "Answer with the list only."


def chat_rows(tmp_path) -> str:
    """The bundled rows as chat rows after one system turn, each user turn the text the tasks prompt with."""
    rows = tmp_path / "chat.jsonl"
    with open(REPO / "data" / "train.jsonl") as source, open(rows, "w") as out:
        for line in source:
            row = json.loads(line)
            turns = [{"role": "system", "content": SYSTEM},
                     {"role": "user", "content": f"### Instruction:\n{row['instruction']}\n\n### Response:\n"},
                     {"role": "assistant", "content": row["response"]}]
            out.write(json.dumps({"messages": turns}) + "\n")
    return str(rows)


# (~50 s each: long tests; --eval-tasks in a launch, through a chat template, runs every time in tests/test_grpo.py)
@pytest.mark.parametrize("config", [pytest.param(config, marks=long_test) for config in ("ddp", "fsdp", "zero3")])
def test_scores_in_the_launch_equal_lm_evals_own_command_on_the_merged_model(config, tmp_path):
    """Two processes, each scoring half the requests of a multiple-choice and a generation task, LoRA unmerged
    (sharded under FSDP2 and ZeRO-3); lm-eval's command on the merged folder in one process gets the same
    scores: accuracy exactly, the greedy answers' exact match too (float32, the same batch size). Under DDP the
    run trains on chat rows with a system turn and is scored as it trained, as `lm_eval --apply_chat_template
    --system_instruction` scores it; the others on the bundled instruction rows, raw."""
    chat = config == "ddp"
    # the turns take room; 40 steps: the tiny model does not answer chat rows in 120 either, and equality is the test
    data = ["--dataset", chat_rows(tmp_path), "--max-length", "128", "--max-steps", "40"] if chat else []
    run = launch("lora", tmp_path / "out", *TRAINING, *data, "--eval-tasks", "data/eval_tasks", "--merge", config=config)
    assert run.returncode == 0, run.output[-3000:]
    [record] = run.metrics("benchmarks")
    scores = {task: record[task] for task in ("recipes_choice", "recipes_answer")}
    assert scores == lm_eval_command(tmp_path / "out" / "merged", tmp_path / "lm_eval", system=SYSTEM if chat else None)
    # (the tiny model learns the raw rows' answers in these steps, ~0.17 exact match; the chat rows' longer turns not yet)
    assert chat or scores["recipes_answer"]["exact_match"] > 0
    assert set(scores["recipes_choice"]) == {"acc", "acc_norm"}
    prompts = f"chat template, system prompt {SYSTEM!r}" if chat else "raw prompts"
    assert record["prompts"] == prompts and record["seconds"] > 0
    steps = 40 if chat else 120
    assert f"benchmarks at step {steps}: recipes_answer exact_match" in run.output and f"({prompts}; " in run.output
    assert run.output.count("Tokenizing inputs: 100%") == 1  # lm-eval's bars from the main process alone
    card = (tmp_path / "out" / "README.md").read_text()
    assert f"| recipes_choice | acc | {scores['recipes_choice']['acc']:.4f} |" in card
    # scripts/evaluate.py under the same launch: the run's adapter loaded again on its base, unmerged
    done = subprocess.run(launch_command_of_evaluate(config, tmp_path / "out"), cwd=REPO, capture_output=True,
                          text=True, timeout=600, env=launch_env(OFFLINE))
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    written = json.loads((tmp_path / "out" / "benchmarks.json").read_text())
    assert written["scores"] == scores and written["prompts"] == prompts
    if chat:  # --raw-prompts: the tasks' text as it is, as lm_eval scores it without the template
        raw = tmp_path / "raw.json"
        done = subprocess.run(launch_command_of_evaluate(config, tmp_path / "out", "--raw-prompts", "--output", str(raw)),
                              cwd=REPO, capture_output=True, text=True, timeout=600, env=launch_env(OFFLINE))
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        unwrapped = json.loads(raw.read_text())
        assert unwrapped["prompts"] == "raw prompts"
        assert unwrapped["scores"] == lm_eval_command(tmp_path / "out" / "merged", tmp_path / "lm_eval_raw")


def launch_command_of_evaluate(config: str, run_dir, *extra: str) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"accelerate_configs/{config}.yaml",
            "--num_processes", "2", "--mixed_precision", "no", "scripts/evaluate.py", str(run_dir), "--artifact",
            "adapter", "--tasks", "data/eval_tasks", "--batch-size", "16", *extra]


@long_test
def test_qlora_is_scored_on_its_4bit_base_as_trained_and_evaluate_agrees(tmp_path):
    """QLoRA: the adapter on the quantized base it trained against, in the launch and again from its files."""
    run = launch("qlora", tmp_path / "out", "--max-steps", "20", "--lr", "3e-3", "--batch-size", "16", "--max-length",
                 "64", "--eval-tasks", "data/eval_tasks", "--eval-limit", "32", config="ddp")
    assert run.returncode == 0, run.output[-3000:]
    [record] = run.metrics("benchmarks")
    done = subprocess.run(launch_command_of_evaluate("ddp", tmp_path / "out", "--limit", "32"), cwd=REPO,
                          capture_output=True, text=True, timeout=600, env=launch_env(OFFLINE))
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    scores = json.loads((tmp_path / "out" / "benchmarks.json").read_text())["scores"]
    assert scores == {task: record[task] for task in scores} and set(scores) == {"recipes_answer", "recipes_choice"}


def test_a_folder_of_task_files_gives_its_tasks_and_itself_as_the_include_path():
    tasks = eval_tasks.parse(f"{BUNDLED},arc_easy,{BUNDLED / 'recipes_answer.yaml'}")
    assert tasks.names == ("recipes_answer", "recipes_choice", "arc_easy")
    assert tasks.include_path == (str(BUNDLED),)


def refusal(flags, kind="ddp", **launch_fields) -> str:
    run = parse_args(recipe_flags("lora"), flags)
    with pytest.raises(Refusal) as refused:
        eval_tasks.check(run, Launch(kind=kind, processes=2, on_gpu=False, visible_gpus=0, precision="no",
                                     **launch_fields))
    assert "\n" not in str(refused.value)
    return str(refused.value)


def test_tasks_that_cannot_be_scored_are_refused_in_one_line_naming_the_fix(tmp_path):
    assert "no such file or folder" in refusal(["--eval-tasks", str(tmp_path / "mine.yaml")])
    assert "lm-eval has no task or group named no_such_task" in refusal(["--eval-tasks", "no_such_task"])
    assert "under tensor, pipeline or sequence parallel" in refusal(["--eval-tasks", "arc_easy"], kind="tensor_parallel")
    assert "under tensor" in refusal(["--eval-tasks", "arc_easy"], pipeline_stages=2)
    assert "--eval-limit 0" in refusal(["--eval-tasks", "arc_easy", "--eval-limit", "0"])
    (tmp_path / "untitled.yaml").write_text("dataset_path: json\n")
    assert "no `task:`" in refusal(["--eval-tasks", str(tmp_path / "untitled.yaml")])
    with mock.patch("importlib.util.find_spec", return_value=None):
        assert "pip install lm-eval==0.4.13" in refusal(["--eval-tasks", "arc_easy"])


def test_a_task_whose_data_is_not_on_the_machine_is_refused_with_the_download_command(tmp_path):
    """A hub dataset not in the cache: refused offline (no request leaves the machine), naming it."""
    (tmp_path / "remote.yaml").write_text(
        "task: remote_task\ndataset_path: nobody-here/no-such-dataset\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: '{{q}}'\ndoc_to_choice: ['a', 'b']\ndoc_to_target: 0\n")
    line = refusal(["--eval-tasks", str(tmp_path / "remote.yaml")])
    assert "--eval-tasks remote_task: its data (nobody-here/no-such-dataset) is not on this machine" in line
    assert "lm_eval --model dummy --tasks remote_task --limit 1" in line


def test_the_scores_keep_lm_evals_metric_names_without_stderr():
    results = {"results": {"gsm8k": {"alias": "gsm8k", "exact_match,strict-match": 0.25,
                                     "exact_match_stderr,strict-match": "N/A", "exact_match,none": 0.5},
                           "arc_easy": {"acc,none": 0.75, "acc_stderr,none": 0.01}}}
    assert scores_of(results) == {"gsm8k": {"exact_match,strict-match": 0.25, "exact_match": 0.5},
                                  "arc_easy": {"acc": 0.75}}


def test_scoring_puts_back_the_random_states_lm_eval_seeds(tmp_path):
    """lm-eval seeds Python's, NumPy's and torch's generators: after a scoring in the middle of a run (--eval-every)
    the run draws what it would have drawn without it."""
    import random

    import numpy
    import torch
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.training.benchmarks import Prompts, score
    from conftest import TINY_MODEL

    model, tokenizer = AutoModelForCausalLM.from_pretrained(TINY_MODEL), AutoTokenizer.from_pretrained(TINY_MODEL)
    one_process = Launch(kind="single", processes=1, on_gpu=False, visible_gpus=0, precision="no")

    def draws():
        return random.random(), float(numpy.random.rand()), torch.rand(2).tolist()

    random.seed(7), numpy.random.seed(7), torch.manual_seed(7)
    expected = draws()
    random.seed(7), numpy.random.seed(7), torch.manual_seed(7)
    scores = score(Accelerator(cpu=True), one_process, model, tokenizer, eval_tasks.parse(str(BUNDLED)), 4, 4, None,
                   Prompts(False))
    assert draws() == expected and set(scores) == {"recipes_answer", "recipes_choice"}


def test_a_run_is_scored_as_it_trained_unless_raw_prompts_are_asked():
    from common.training.benchmarks import Prompts, run_prompts

    assert run_prompts("messages", "Be brief.", raw=False) == Prompts(True, "Be brief.")
    assert run_prompts("messages", None, raw=False).describe() == "chat template"
    assert run_prompts("instruction+messages", None, raw=False).chat  # a mixture with chat rows
    assert run_prompts("preference pairs, conversational", "Be brief.", raw=False) == Prompts(True, "Be brief.")
    assert run_prompts("messages", "Be brief.", raw=True) == Prompts(False) == run_prompts("instruction", None, False)
    assert run_prompts("preference pairs, text, implicit prompt", None, raw=False).describe() == "raw prompts"
