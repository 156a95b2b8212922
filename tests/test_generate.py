"""scripts/generate.py answers prompts with what a run saved, wrapped as the run's rows were."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, TINY_MODEL

sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "recipes"))
import generate  # noqa: E402
from common.data import formats, tokens  # noqa: E402
from common.model import modeling  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    return modeling.load_tokenizer(str(TINY_MODEL))


def prompt_part(row: dict) -> list[int]:
    """The tokens before the first trained token: what training put in front of an answer."""
    first_target = next(i for i, label in enumerate(row["labels"]) if label != formats.IGNORE)
    return row["input_ids"][:first_target]


def test_prompts_are_wrapped_as_training_rows_were(tokenizer):
    instruction = tokens.tokenize_row({"instruction": "Sort: 3 1 2", "response": "1 2 3"}, tokenizer, "instruction", 512)
    assert generate.prompt_ids("Sort: 3 1 2", tokenizer, "instruction", raw=False) == prompt_part(instruction)
    chat = tokens.tokenize_row({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
                                tokenizer, "messages", 512)
    assert generate.prompt_ids("hi", tokenizer, "messages", raw=False) == prompt_part(chat)
    assert generate.prompt_ids("Sort: 3 1 2", tokenizer, "instruction", raw=True) == \
        [tokenizer.bos_token_id] + tokenizer("Sort: 3 1 2", add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("recipe, artifact", [("full", "model"), ("lora", "adapter"), ("lora", "merged"),
                                              ("qlora", "adapter")])
def test_answers_are_the_runs_own_sample_answers(recipe, artifact, trained, capsys):
    """The run printed greedy answers to its first evaluation prompts (samples.jsonl); the saved
    artifact, reloaded by the script, gives the same answers."""
    run = trained(recipe, "ddp")
    assert run.returncode == 0, run.output[-3000:]
    samples = [json.loads(line) for line in (run.output_dir / "samples.jsonl").read_text().splitlines()]
    instructions = [s["prompt"].split("### Instruction:\n")[1].split("\n\n### Response:")[0] for s in samples]
    argv = [str(run.output_dir), "--artifact", artifact, "--max-new-tokens", "32"]
    assert generate.main(argv + [arg for i in instructions for arg in ("--prompt", i)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if " -> " in line]
    assert lines == [f"{i!r} -> {s['generated']!r}" for i, s in zip(instructions, samples)]


def test_a_folder_without_a_run_is_one_line(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "generate.py"), str(tmp_path), "--prompt", "x"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.strip() == \
        f"error: {tmp_path} holds no run.json; pass the --output-dir of a finished run"
    (tmp_path / "run.json").write_text("{}")
    assert generate.main([str(tmp_path), "--artifact", "merged", "--prompt", "x"]) == 2


def test_sampling_repeats_with_its_seed_and_differs_from_greedy(trained, capsys):
    """--temperature samples (the same --seed, the same answers); without it the answers are greedy."""
    run = trained("lora", "ddp")
    assert run.returncode == 0, run.output[-3000:]
    base = [str(run.output_dir), "--artifact", "adapter", "--max-new-tokens", "24", "--prompt", "Sort: 3 1 2",
            "--prompt", "Reverse: 1 2 3 4"]

    def answers(*extra) -> list[str]:
        assert generate.main(base + list(extra)) == 0
        return [line for line in capsys.readouterr().out.splitlines() if " -> " in line]

    sampled = answers("--temperature", "5", "--seed", "1")
    assert answers("--temperature", "5", "--seed", "1") == sampled
    assert answers() != sampled  # greedy: at temperature 5 the tiny model's draws wander


@pytest.mark.parametrize("flags, problem", [(["--temperature", "-1"], "--temperature must be >= 0"),
                                            (["--temperature", "1", "--top-p", "0"], "--top-p must be in (0, 1]"),
                                            (["--seed", "3"], "--top-p and --seed apply to sampling")])
def test_a_sampling_flag_out_of_range_is_one_line(flags, problem, tmp_path, capsys):
    assert generate.main([str(tmp_path), "--prompt", "x", *flags]) == 2
    assert capsys.readouterr().err.strip().startswith(f"error: {problem}")
