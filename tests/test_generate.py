"""scripts/generate.py answers prompts with what a run saved, wrapped as the run's rows were: a chat prompt after
the system turn the training rows opened with (run.json's system_prompt) or --system's, in the tokens the
training rendering gave the same conversation."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, TINY_MODEL, launch

sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "recipes"))
import chat_fixtures as fixtures  # noqa: E402
import generate  # noqa: E402
from common.data import formats, pairs, preparation, tokens  # noqa: E402
from common.data.checked_rows import SourceRows  # noqa: E402
from common.model import modeling  # noqa: E402

SYSTEM = fixtures.SYSTEM_PROMPTS[0]


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


def test_a_folder_without_a_model_is_one_line(tmp_path, capsys):
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "generate.py"), str(tmp_path), "--prompt", "x"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.strip() == (
        f"error: {tmp_path} holds no run.json, config.json or adapter_config.json; pass a run's --output-dir, a model "
        "folder or a hub id")
    assert generate.main([str(tmp_path / "gone"), "--prompt", "x"]) == 2
    assert capsys.readouterr().err.strip() == (f"error: {tmp_path / 'gone'} does not exist; pass a run's --output-dir, "
                                               "a model folder or a hub id")
    assert generate.main([str(TINY_MODEL), "--artifact", "merged", "--prompt", "x"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: --artifact picks what to load from a run's folder")
    (tmp_path / "run.json").write_text("{}")
    assert generate.main([str(tmp_path), "--artifact", "merged", "--prompt", "x"]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path} has no merged/; train first, or pick another with --artifact"


@pytest.mark.parametrize("script", ["generate.py", "merge.py"])
def test_help_answers_before_torch_loads(script):
    """--help reads the flags alone: torch, transformers and peft (seconds to import) are not loaded."""
    ask = ("import runpy, sys\n"
           f"sys.argv = [{str(REPO / 'scripts' / script)!r}, '--help']\n"
           "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
           "except SystemExit as stop:\n    assert stop.code in (0, None)\n"
           "print(sorted(name for name in ('torch', 'transformers', 'peft', 'datasets') if name in sys.modules))")
    done = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


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


def chat_row(system: str | None, user: str = "Sort: 3 1 2", reply: str = "The answer is 1 2 3.") -> dict:
    turns = [{"role": "system", "content": system}] if system is not None else []
    return {"messages": turns + [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]}


@pytest.mark.parametrize("family", [None, *fixtures.FAMILIES])
def test_a_chat_prompt_after_a_system_turn_is_what_training_rendered(family, tokenizer, tmp_path):
    """The prompt tokens generate.py builds for a system turn and a user message are the tokens training gave
    the same conversation before its reply: the bundled tiny model's tokenizer as a run saves it (the plain
    default template) and as it is bundled (no template), and the real families' templates."""
    if family is None:
        tokenizer.save_pretrained(tmp_path)  # what the run saves beside its model or adapter
        from transformers import AutoTokenizer

        cases = [(tokenizer, AutoTokenizer.from_pretrained(tmp_path)), (tokenizer, AutoTokenizer.from_pretrained(TINY_MODEL))]
    else:
        tok = fixtures.with_template("byte_level", family)
        cases = [(tok, tok)]
    for trained_with, saved in cases:
        try:
            trained = tokens.tokenize_row(chat_row(SYSTEM), trained_with, "messages")
        except formats.RowProblem:  # Mixtral's template takes no system turn: neither training nor generate.py
            assert family == "mistral_instruct"
            with pytest.raises(formats.RowProblem):
                generate.prompt_ids("Sort: 3 1 2", saved, "messages", raw=False, system=SYSTEM)
        else:
            assert generate.prompt_ids("Sort: 3 1 2", saved, "messages", raw=False, system=SYSTEM) == prompt_part(trained)
        without = tokens.tokenize_row(chat_row(None), trained_with, "messages")
        assert generate.prompt_ids("Sort: 3 1 2", saved, "messages", raw=False) == prompt_part(without)
        assert family == "mistral_instruct" or prompt_part(trained) != prompt_part(without)  # the system turn counts


def test_the_runs_system_prompt_is_the_one_every_chat_row_opened_with():
    """What run.json records (preparation.prepare's format carries it): the one system text every chat row of
    the training sources opens with, read from the split's rows (not the table beneath); none when a row opens
    without one or the texts differ. ShareGPT's from / value, capitals and JSON text cells read as training
    reads them."""
    import datasets

    def parts(*sources) -> list:
        return [SourceRows("data", "messages", datasets.Dataset.from_list(rows), None) for rows in sources]

    same = [chat_row(SYSTEM, user=f"Sort: {i} 1") for i in range(20)]
    assert preparation.shared_system_prompt(parts(same)) == SYSTEM
    assert preparation.shared_system_prompt(parts(same, same[:3])) == SYSTEM  # a mixture's chat sources
    assert preparation.shared_system_prompt(parts(same + [chat_row(None)])) is None
    assert preparation.shared_system_prompt(parts(same + [chat_row("Another.")])) is None
    assert preparation.shared_system_prompt(parts([chat_row(None)] * 3)) is None
    assert preparation.shared_system_prompt([SourceRows("data", "instruction", None, None)]) is None
    table = datasets.Dataset.from_list(same[:10] + [chat_row("Another.")] + same[10:])
    kept = table.select([i for i in range(len(table)) if i != 10])  # a split: rows picked from the table beneath
    assert kept._indices is not None and preparation.shared_system_prompt(parts(table.to_list())) is None
    assert preparation.shared_system_prompt([SourceRows("data", "messages", kept, None)]) == SYSTEM
    sharegpt = [{"messages": [{"from": "System", "value": SYSTEM}, {"from": "human", "value": "hi"},
                              {"from": "gpt", "value": "yo"}]}] * 3
    assert preparation.shared_system_prompt(parts(sharegpt)) == SYSTEM
    as_text = [{"messages": json.dumps(row["messages"])} for row in same]
    assert preparation.shared_system_prompt(parts(as_text)) == SYSTEM
    recorded = preparation.DataFormat("messages", SYSTEM)
    assert recorded == "messages" and json.loads(json.dumps({"data_format": recorded})) == {"data_format": "messages"}


@pytest.mark.parametrize("fmt", [formats.PAIRS_CONVERSATIONAL, formats.PAIRS_IMPLICIT_CONVERSATIONAL,
                                 f"{formats.PAIRS_CONVERSATIONAL}+{formats.PAIRS_TEXT}"])
def test_a_chat_pair_prompt_is_what_training_rendered_for_the_pair(fmt, tokenizer):
    """A preference run on chat pairs is a chat run: the prompt (after the system turn) in the tokens training
    gave a pair's chosen side before its reply, its prompt turns as context."""
    turns = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Sort: 3 1 2"}]
    chosen, rejected = [{"role": "assistant", "content": "1 2 3"}], [{"role": "assistant", "content": "3 1 2"}]
    pair = {"prompt": turns, "chosen": chosen, "rejected": rejected}
    if formats.PAIRS_IMPLICIT_CONVERSATIONAL in fmt:
        pair = {"chosen": turns + chosen, "rejected": turns + rejected}
    side, _ = pairs.pair_sides(pair, fmt.split("+")[0])
    (trained,) = tokens.tokenize_rows([side], tokenizer, "messages")
    assert generate.is_chat(fmt, raw=False)
    assert generate.prompt_ids("Sort: 3 1 2", tokenizer, fmt, raw=False, system=SYSTEM) == prompt_part(
        {"input_ids": trained["input_ids"].tolist(), "labels": trained["labels"].tolist()})
    # text pairs are prompt / completion rows: the prompt as typed
    assert not generate.is_chat(formats.PAIRS_TEXT, raw=False)
    assert generate.prompt_ids("Sort: 3 1 2", tokenizer, formats.PAIRS_TEXT, raw=False) == tokenizer("Sort: 3 1 2")["input_ids"]


def said(err: str) -> str:
    """generate.py's one line on how it wraps the prompts of a model without a run."""
    [line] = [line for line in err.splitlines() if line.startswith("prompts:")]
    return line


def test_a_model_without_a_run_is_asked_through_its_chat_template_or_as_typed(trained, tmp_path, monkeypatch, capsys):
    """A merged folder copied out of its run (what is served), and a transformers folder: prompts go through the
    folder's chat template when its tokenizer has one, else as typed, said in one line; the merged model answers.
    A merged folder inside its run is asked as the run's rows were: its own sample answers."""
    import shutil

    from transformers import AutoTokenizer

    run = trained("lora", "ddp")
    assert run.returncode == 0, run.output[-3000:]
    served = tmp_path / "served"
    shutil.copytree(run.output_dir / "merged", served)
    saved = AutoTokenizer.from_pretrained(served)
    assert generate.main([str(served), "--prompt", "Sort: 3 1 2", "--max-new-tokens", "8"]) == 0
    captured = capsys.readouterr()
    assert said(captured.err) == (f"prompts: through the chat template of {served} (no run.json to say how it was "
                                  "trained; --raw gives them as typed)")
    assert captured.out.startswith("'Sort: 3 1 2' -> ")
    code, asked = asked_ids(monkeypatch, [str(served), "--prompt", "Sort: 3 1 2"])
    assert code == 0 and asked == [generate.prompt_ids("Sort: 3 1 2", saved, "messages", False)]
    assert asked[0] != saved("Sort: 3 1 2")["input_ids"]  # wrapped, not as typed
    code, asked = asked_ids(monkeypatch, [str(served), "--prompt", "Sort: 3 1 2", "--system", "Be brief."])
    assert code == 0 and asked == [generate.prompt_ids("Sort: 3 1 2", saved, "messages", False, "Be brief.")]
    capsys.readouterr()

    code, asked = asked_ids(monkeypatch, [str(TINY_MODEL), "--prompt", "Sort: 3 1 2"])  # no chat template
    assert code == 0 and asked == [AutoTokenizer.from_pretrained(TINY_MODEL)("Sort: 3 1 2")["input_ids"]]
    assert said(capsys.readouterr().err) == f"prompts: as typed ({TINY_MODEL} has no run.json, and its tokenizer no chat template)"
    monkeypatch.undo()

    samples = [json.loads(line) for line in (run.output_dir / "samples.jsonl").read_text().splitlines()]
    instructions = [s["prompt"].split("### Instruction:\n")[1].split("\n\n### Response:")[0] for s in samples]
    argv = [str(run.output_dir / "merged"), "--max-new-tokens", "32"]
    assert generate.main(argv + [arg for i in instructions for arg in ("--prompt", i)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if " -> " in line]
    assert lines == [f"{i!r} -> {s['generated']!r}" for i, s in zip(instructions, samples)]


@pytest.fixture
def chat_run(tmp_path, tokenizer):
    """An output folder as a chat run leaves it: run.json recording the rows' system prompt, model/ with the
    tokenizer the run saved (the bundled tiny model's weights)."""
    import shutil

    output = tmp_path / "out"
    shutil.copytree(TINY_MODEL, output / "model")
    tokenizer.save_pretrained(output / "model")
    record = {"recipe": "full", "base_model": str(TINY_MODEL), "data_format": "messages", "system_prompt": SYSTEM,
              "arguments": {}}
    (output / "run.json").write_text(json.dumps(record))
    return output


def asked_ids(monkeypatch, argv: list[str]) -> tuple[int, list[list[int]]]:
    """(exit code, the prompt ids generate.py gives the model) of one call, no decoding."""
    asked = []
    monkeypatch.setattr(generate, "answer", lambda model, tokenizer, ids, *rest: asked.append(ids) or "")
    return generate.main(argv), asked


def test_the_runs_system_prompt_is_used_by_default_and_said(chat_run, tokenizer, monkeypatch, capsys):
    code, asked = asked_ids(monkeypatch, [str(chat_run), "--prompt", "Sort: 3 1 2"])
    assert code == 0 and asked == [generate.prompt_ids("Sort: 3 1 2", tokenizer, "messages", False, SYSTEM)]
    [said] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("system prompt:")]
    assert said.startswith(f"system prompt: the training rows' own, from run.json ({SYSTEM!r}); --system TEXT")
    code, asked = asked_ids(monkeypatch, [str(chat_run), "--prompt", "Sort: 3 1 2", "--system", ""])
    assert code == 0 and asked == [generate.prompt_ids("Sort: 3 1 2", tokenizer, "messages", False)]
    code, asked = asked_ids(monkeypatch, [str(chat_run), "--prompt", "Sort: 3 1 2", "--system", "Be brief."])
    assert code == 0 and asked == [generate.prompt_ids("Sort: 3 1 2", tokenizer, "messages", False, "Be brief.")]
    assert "system prompt:" not in capsys.readouterr().err  # said only when it comes from run.json


def test_a_system_prompt_for_a_run_that_is_not_chat_is_one_line(chat_run, monkeypatch, capsys):
    record = json.loads((chat_run / "run.json").read_text())
    (chat_run / "run.json").write_text(json.dumps({**record, "data_format": "instruction", "system_prompt": None}))
    code, asked = asked_ids(monkeypatch, [str(chat_run), "--prompt", "x", "--system", "Be brief."])
    assert code == 2 and not asked
    assert capsys.readouterr().err.strip() == ("error: --system applies to chat runs (their rows are `messages`); this "
                                               "run trained on instruction rows: drop --system")
    (chat_run / "run.json").write_text(json.dumps(record))
    code, asked = asked_ids(monkeypatch, [str(chat_run), "--prompt", "x", "--raw"])  # as typed: no system turn
    assert code == 0 and "system prompt:" not in capsys.readouterr().err


def test_a_chat_run_records_its_rows_system_prompt_and_is_asked_with_it(tmp_path, monkeypatch, capsys):
    """A LoRA run on chat rows that all open with one system turn: run.json records it, and generate.py asks the
    saved adapter with it, in the tokens training gave that conversation, without --raw or a hand-written
    template."""
    dataset = tmp_path / "chat.jsonl"
    rows = [chat_row(SYSTEM, user=f"Sort: {i} {i + 2} {i + 1}", reply=f"The answer is {i} {i + 1} {i + 2}.")
            for i in range(40)]
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run = launch("lora", tmp_path / "out", "--dataset", str(dataset), "--max-steps", "1", "--batch-size", "2",
                 "--max-length", "96")
    assert run.returncode == 0, run.output[-3000:]
    assert run.run_json()["data_format"] == "messages" and run.run_json()["system_prompt"] == SYSTEM
    code, asked = asked_ids(monkeypatch, [str(run.output_dir), "--prompt", "Sort: 3 5 4"])
    assert code == 0 and "system prompt: the training rows' own, from run.json" in capsys.readouterr().err
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(run.output_dir / "adapter")
    trained = tokens.tokenize_row(chat_row(SYSTEM, user="Sort: 3 5 4"), saved, "messages")
    assert asked == [prompt_part(trained)]
