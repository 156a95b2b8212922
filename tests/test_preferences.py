"""Preference pairs (DPO's data): every layout users have found and tokenised; a pair's sides are the
tokens the supervised path gives the same rows (targets.tokenize_row), the prompt untrained and the
reply with its stop signal trained; bad files refused in one line, bad pairs dropped and counted."""

from __future__ import annotations

import importlib.util
import json
import sys
from contextlib import nullcontext
from types import SimpleNamespace

import pytest

import chat_fixtures as fixtures
from conftest import REPO

sys.path.insert(0, str(REPO / "recipes"))
from common.data import checked_rows, formats, pairs, preferences, targets  # noqa: E402
from common.refusal import Refusal  # noqa: E402

FIXTURES = REPO / "tests" / "fixtures" / "preferences"
IGNORE = formats.IGNORE
READ_PAIRS = {"found_format": pairs.pair_format_of, "problem": pairs.pair_problem}  # load_sources reading pairs


@pytest.fixture(scope="module")
def tok():
    return fixtures.tokenizer("bundled")


def tokenised(rows: list[dict], tok, max_length: int = 1 << 16):
    """(format, tokenised pairs) of rows as a file would hold them."""
    import datasets

    datasets.disable_progress_bars()
    dataset = datasets.Dataset.from_list(rows)
    fmt = pairs.pair_format_of(dataset, "rows")
    return fmt, list(preferences.tokenize_pairs(dataset, fmt, tok, max_length))


def side(pair: dict, name: str) -> dict:
    return {"input_ids": pair[f"{name}_input_ids"], "labels": pair[f"{name}_labels"]}


def trained_text(tok, row: dict) -> str:
    return tok.decode([t for t, label in zip(row["input_ids"], row["labels"]) if label != IGNORE])


def write_jsonl(path, rows: list[dict]):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


TEXT_PAIRS = [{"prompt": "### Instruction:\nSort: 3 9 1\n\n### Response:\n", "chosen": "1 3 9", "rejected": "9 1 3"},
              {"prompt": "Question: two plus two?\nAnswer:", "chosen": " 4", "rejected": " 5, I think"}]


def test_text_pairs_are_the_supervised_prompt_completion_rows(tok):
    fmt, out = tokenised(TEXT_PAIRS, tok)
    assert fmt == formats.PAIRS_TEXT
    for row, pair in zip(TEXT_PAIRS, out):
        assert pair["dropped"] == ""
        for name in pairs.SIDES:
            supervised = targets.tokenize_row({"prompt": row["prompt"], "completion": row[name]}, tok, "prompt_completion")
            assert side(pair, name) == supervised
            # the whole text as the tokenizer writes it, then EOS; the prompt untrained, the reply and EOS trained
            ids = tok(row["prompt"] + row[name])["input_ids"] + [tok.eos_token_id]
            assert pair[f"{name}_input_ids"] == ids
            assert trained_text(tok, side(pair, name)) == row[name] + tok.eos_token
            assert set(pair[f"{name}_labels"][:len(tok(row["prompt"])["input_ids"]) - 1]) == {IGNORE}


@pytest.mark.parametrize("family", ["llama3_1", "qwen3"])
def test_conversational_pairs_under_a_real_template_are_the_supervised_chat_rows(family):
    tok = fixtures.with_template("byte_level", family)
    prompt = [{"role": "system", "content": "Keep every answer short and exact."},
              {"role": "user", "content": "Please sort these numbers: 5 3 8"},
              {"role": "assistant", "content": "Do you want them ascending?"},
              {"role": "user", "content": "Could you reverse this sequence: 1 2"}]
    chosen, rejected = [{"role": "assistant", "content": "The answer is 2 1."}], [{"role": "assistant", "content": "1 2"}]
    fmt, (pair,) = tokenised([{"prompt": prompt, "chosen": chosen, "rejected": rejected}], tok)
    assert fmt == formats.PAIRS_CONVERSATIONAL and pair["dropped"] == ""
    (stop,) = fixtures.stop_ids(tok, family) - {tok.eos_token_id} or {tok.eos_token_id}
    for name, reply in (("chosen", chosen), ("rejected", rejected)):
        got = side(pair, name)
        messages = prompt + reply
        # what inference sees: the whole conversation rendered once by the template
        assert got["input_ids"] == tok.apply_chat_template(messages, tokenize=True)["input_ids"]
        # what SFT trains on that conversation when the prompt's assistant turn is context
        context = [dict(turn, weight=0) for turn in prompt]
        assert got == targets.tokenize_row({"messages": context + reply}, tok, "messages")
        trained = trained_text(tok, got)
        assert reply[0]["content"] in trained
        assert "ascending" not in trained and "sort" not in trained.lower()  # the prompt's turns are not trained
        assert [t for t, label in zip(got["input_ids"], got["labels"]) if label != IGNORE][-1] == stop


def test_implicit_prompt_is_the_turns_both_conversations_open_with(tok):
    opening = [{"role": "user", "content": "Sort: 3 1 2"}, {"role": "assistant", "content": "1 2 3"},
               {"role": "user", "content": "Now reverse it"}]
    good, bad = {"role": "assistant", "content": "3 2 1"}, {"role": "assistant", "content": "no"}
    fmt, (implicit,) = tokenised([{"chosen": opening + [good], "rejected": opening + [bad]}], tok)
    assert fmt == formats.PAIRS_IMPLICIT_CONVERSATIONAL
    _, (explicit,) = tokenised([{"prompt": opening, "chosen": [good], "rejected": [bad]}], tok)
    assert implicit == explicit  # the same pair written with its prompt apart
    assert trained_text(tok, side(implicit, "chosen")) == "3 2 1" + tok.eos_token  # "1 2 3" is prompt
    assert pairs.shared_turns([1, 2, 3], [1, 2, 4]) == ([1, 2], [3], [4])


def test_ultrafeedback_reads_the_conversations_not_the_prompt_or_the_scores(tok, tmp_path):
    train, evaluation = checked_rows.load_sources(str(FIXTURES / "ultrafeedback_binarized.jsonl"), 0, **READ_PAIRS)
    assert train[0].fmt == formats.PAIRS_IMPLICIT_CONVERSATIONAL
    # the SFT recipes still read the same file as chat rows, from its `messages`
    assert checked_rows.load_sources(str(FIXTURES / "ultrafeedback_binarized.jsonl"), 0)[0][0].fmt == "messages"
    rows = [json.loads(line) for line in (FIXTURES / "ultrafeedback_binarized.jsonl").read_text().splitlines()]
    _, out = tokenised(rows, tok)
    for row, pair in zip(rows, out):
        assert pair["dropped"] == ""
        for name in pairs.SIDES:
            reply = row[name][-1]["content"]
            assert trained_text(tok, side(pair, name)) == reply + tok.eos_token
            assert side(pair, name) == targets.tokenize_row({"messages": [dict(row[name][0], weight=0), row[name][1]]},
                                                           tok, "messages")
    line = formats.unread_columns(rows[0], train[0].fmt)
    assert line == "; columns not read: messages, prompt, prompt_id, score_chosen, score_rejected"


def test_hh_text_trains_the_last_reply_after_the_last_shared_assistant_mark(tok):
    rows = [json.loads(line) for line in (FIXTURES / "hh_rlhf.jsonl").read_text().splitlines()]
    fmt, out = tokenised(rows, tok)
    assert fmt == formats.PAIRS_IMPLICIT_TEXT
    for row, pair in zip(rows, out):
        cut = row["chosen"].rindex("\n\nAssistant:") + len("\n\nAssistant:")
        for name in pairs.SIDES:
            assert trained_text(tok, side(pair, name)).strip() == row[name][cut:].strip() + tok.eos_token
            assert side(pair, name) == targets.tokenize_row(
                {"prompt": row[name][:cut], "completion": row[name][cut:]}, tok, "prompt_completion")
    assert "1 2 3" not in trained_text(tok, side(out[0], "chosen"))  # the earlier reply is prompt


def test_text_pairs_part_at_the_word_where_they_differ():
    assert pairs.shared_text("Q: sky? A: blue", "Q: sky? A: black") == ("Q: sky? A:", " blue", " black")
    assert pairs.shared_text("Q? yes", "Q? yes sir") == ("Q?", " yes", " yes sir")
    assert pairs.shared_text("yes", "no") == ("", "yes", "no")


def test_bad_pairs_are_dropped_with_their_reason(tok):
    rows = [{"prompt": "p: ", "chosen": "same", "rejected": "same"},
            {"prompt": "p: ", "chosen": "   ", "rejected": "fine"},
            {"prompt": None, "chosen": "a", "rejected": "b"},
            {"prompt": "p: ", "chosen": "a", "rejected": "b"}]
    # a null prompt in a file of prompts is a second layout: refused (below); here the rows come one by one
    fmt = formats.PAIRS_TEXT
    reasons = [pairs.pair_problem(row, fmt) for row in rows]
    assert reasons == ["chosen and rejected are the same", "empty chosen reply", "no prompt", None]
    conversations = [{"chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}],
                      "rejected": [{"role": "user", "content": "yo"}, {"role": "assistant", "content": "b"}]},
                     {"chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}],
                      "rejected": [{"role": "user", "content": "hi"}]},
                     {"chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a" * 300}],
                      "rejected": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "b"}]}]
    _, out = tokenised(conversations, tok, max_length=40)
    assert [pair["dropped"] for pair in out] == ["no shared prompt", "rejected: no assistant reply", ""]
    assert len(out[2]["chosen_input_ids"]) == 40 and out[2]["cut"]  # each side cut to --max-length like SFT rows
    _, (long,) = tokenised(conversations[2:], tok, max_length=8)
    assert long["dropped"] == "too long for --max-length 8" and long["chosen_input_ids"] == []
    chosen = targets.tokenize_row({"messages": [dict(conversations[2]["chosen"][0], weight=0),
                                                conversations[2]["chosen"][1]]}, tok, "messages")
    first_target = next(i for i, label in enumerate(chosen["labels"]) if label != IGNORE)
    assert long["needs"] == first_target + 1  # as SFT counts it: the tokens that keep one target


def refusal(tmp_path, rows_or_file, **options) -> str:
    path = rows_or_file if not isinstance(rows_or_file, list) else write_jsonl(tmp_path / "pairs.jsonl", rows_or_file)
    with pytest.raises(Refusal) as refused:
        checked_rows.load_sources(str(path), 0, **READ_PAIRS, **options)
    assert "\n" not in str(refused.value)
    return str(refused.value)


def test_supervised_rows_are_refused_naming_what_pairs_need(tmp_path):
    line = refusal(tmp_path, REPO / "data" / "train.jsonl")
    assert "no `chosen` or `rejected` column" in line and "--columns chosen=good,rejected=bad" in line
    renamed = write_jsonl(tmp_path / "renamed.jsonl", [{"q": "a", "good": "x", "bad": "y"}] * 4)
    assert checked_rows.load_sources(str(renamed), 0, "prompt=q,chosen=good,rejected=bad", **READ_PAIRS)[0][0].fmt \
        == formats.PAIRS_TEXT


def test_a_column_of_the_wrong_kind_is_refused_naming_file_and_column(tmp_path):
    line = refusal(tmp_path, [{"prompt": "p", "chosen": 3, "rejected": 4}] * 4)
    assert "pairs.jsonl" in line and "column `chosen` holds int64 values" in line
    line = refusal(tmp_path, [{"prompt": "p", "chosen": "a", "rejected": [{"role": "assistant", "content": "b"}]}] * 4)
    assert "`chosen` holds text and `rejected` messages" in line


def test_mixed_layouts_are_refused_naming_the_row(tmp_path):
    rows = [{"prompt": "p", "chosen": "a", "rejected": "b"}] * 3
    line = refusal(tmp_path, rows + [{"messages": [{"role": "user", "content": "hi"}]}])
    assert "mixes formats" in line and "row 4 has `messages` and no `chosen`" in line
    line = refusal(tmp_path, rows[:2] + [{"chosen": "a", "rejected": "b"}] + rows)
    assert "mixes formats" in line and "row 3 has none" in line


class OneProcess:
    is_main_process = True
    num_processes = 1

    def main_process_first(self):
        return nullcontext()


def run_of(dataset, max_length=512, **more):
    return SimpleNamespace(dataset=dataset, seed=0, columns=None, eval_dataset=None, max_length=max_length,
                           batch_size=1, grad_accum=1, max_steps=1, epochs=1, model="tiny", chat_template=None, **more)


def test_prepare_pairs_counts_what_it_drops_in_the_data_line(tok, tmp_path, capsys):
    good = [{"prompt": f"Sort: {i} {i + 1}\n", "chosen": f"{i} {i + 1}", "rejected": f"{i + 1} {i}"} for i in range(40)]
    bad = [{"prompt": "x\n", "chosen": "same", "rejected": "same"}] * 3 + [{"prompt": "x\n", "chosen": "", "rejected": "b"}]
    path = write_jsonl(tmp_path / "pairs.jsonl", good + bad)
    train, evaluation, fmt = preferences.prepare_pairs(OneProcess(), tok, run_of(str(path)), SimpleNamespace(data_parallel_size=1))
    assert fmt == formats.PAIRS_TEXT
    assert train.column_names == ["chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels"]
    assert str(train.features["chosen_labels"].feature) == "Value('int32')"
    held = max(1, len(good + bad) // 20)  # held out among the pairs that can train, as for SFT rows
    assert len(evaluation) == held and len(train) == len(good) - held
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("data (")]
    assert line == (f"data ({formats.PAIRS_TEXT}): training {len(good + bad) - held} pairs: {len(good) - held} used, "
                    "4 dropped (chosen and rejected are the same: 3, empty chosen reply: 1); "
                    f"evaluation {held} pairs: {held} used")


def test_the_pairs_system_prompt_is_the_one_every_conversational_pair_opened_with(tok, tmp_path):
    """What run.json records for a preference run (prepare_pairs' format carries it), as for chat rows: the one
    system text every conversational pair opens with (its prompt's first turn; an implicit prompt's, the chosen
    conversation's); none when a pair opens without one, the texts differ, or the pairs are text."""
    import datasets

    system = fixtures.SYSTEM_PROMPTS[0]

    def pair(opening: str | None, i: int, explicit: bool = True) -> dict:
        prompt = ([{"role": "system", "content": opening}] if opening else []) + [{"role": "user", "content": f"Sort: {i} 1"}]
        chosen, rejected = [{"role": "assistant", "content": f"1 {i}"}], [{"role": "assistant", "content": f"{i} 1"}]
        return {"prompt": prompt, "chosen": chosen, "rejected": rejected} if explicit else \
            {"chosen": prompt + chosen, "rejected": prompt + rejected}

    def shared(*sources) -> str | None:
        parts = []
        for rows in sources:
            dataset = datasets.Dataset.from_list(rows)
            parts.append(checked_rows.SourceRows("data", pairs.pair_format_of(dataset, "rows"), dataset, None))
        return preferences.shared_system_prompt(parts)

    same = [pair(system, i) for i in range(20)]
    text = [{"prompt": f"Sort: {i} 1\n", "chosen": f"1 {i}", "rejected": f"{i} 1"} for i in range(5)]
    assert shared(same) == system
    assert shared([pair(system, i, explicit=False) for i in range(5)]) == system
    assert shared(same, text) == system  # a mixture's conversational sources
    assert shared(same + [pair(None, 99)]) is None
    assert shared(same + [pair("Another.", 99)]) is None
    assert shared(text) is None
    path = write_jsonl(tmp_path / "pairs.jsonl", same * 2)
    *_, fmt = preferences.prepare_pairs(OneProcess(), tok, run_of(str(path)), SimpleNamespace(data_parallel_size=1))
    assert (fmt, fmt.system_prompt) == (formats.PAIRS_CONVERSATIONAL, system)
    assert json.loads(json.dumps({"data_format": fmt})) == {"data_format": formats.PAIRS_CONVERSATIONAL}


def test_no_pair_left_is_one_line_naming_the_fix(tok, tmp_path):
    rows = [{"chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a" * 200}],
             "rejected": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "b" * 200}]}] * 4
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    with pytest.raises(Refusal) as refused:
        preferences.prepare_pairs(OneProcess(), tok, run_of(str(path), max_length=4), SimpleNamespace(data_parallel_size=1))
    line = str(refused.value)
    assert line.startswith("no training pair can be used: 3 pairs: 0 used, 3 dropped (too long for --max-length 4: 3)")
    assert "pass --max-length" in line and "\n" not in line


def test_the_bundled_pairs_train_the_toy_task(tok):
    train, evaluation = checked_rows.load_sources(str(REPO / "data" / "preferences"), 0, **READ_PAIRS)
    assert train[0].fmt == formats.PAIRS_TEXT and (len(train[0].rows), len(evaluation[0].rows)) == (2048, 128)
    supervised = [json.loads(line) for line in (REPO / "data" / "train.jsonl").read_text().splitlines()]
    for row, pair in zip(supervised, train[0].rows):
        assert pair["prompt"] == formats.PROMPT_TEMPLATE.format(instruction=row["instruction"])
        assert pair["chosen"] == row["response"] and pair["rejected"] != row["response"]
    out = preferences.tokenize_pairs(train[0].rows, train[0].fmt, tok, 64)
    assert not [pair["dropped"] for pair in out if pair["dropped"]]
    first = next(iter(out))
    assert side(first, "chosen") == targets.tokenize_row(
        {"instruction": supervised[0]["instruction"], "response": supervised[0]["response"]}, tok, "instruction")


def test_inspect_data_shows_both_sides_of_each_pair(tok, capsys):
    spec = importlib.util.spec_from_file_location("inspect_data", REPO / "scripts" / "inspect_data.py")
    inspect_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(inspect_data)
    hh = FIXTURES / "hh_rlhf.jsonl"
    assert inspect_data.main(["--model", str(REPO / "data" / "tokenizer"), "--dataset", str(hh), "--json"]) == 0
    out = capsys.readouterr()
    shown = [json.loads(line) for line in out.out.splitlines()]
    rows = [json.loads(line) for line in hh.read_text().splitlines()]
    assert shown == [{**{column: pair[column] for column in preferences.PAIR_COLUMNS}, "dropped": ""}
                     for pair in tokenised(rows, tok)[1]]
    assert out.err.strip().splitlines()[-1].startswith(f"data ({formats.PAIRS_IMPLICIT_TEXT}): train 2 pairs")
    assert inspect_data.main(["--model", str(REPO / "data" / "tokenizer"), "--dataset", str(hh)]) == 0
    printed = capsys.readouterr().out
    assert "row 1, chosen:" in printed and "row 1, rejected:" in printed and printed.count("[[") == 4


def test_a_margin_won_by_pushing_both_replies_down_is_said_once():
    """Reward accuracy at 1 while the chosen replies' log-probability falls with the rejected ones': one warning
    line naming the settings, once; a run whose chosen replies hold, or whose accuracy is not saturated, none."""
    from common.outputs.drift import LikelihoodDrift

    def run(chosen, rejected, accuracy, steps=40):
        drift = LikelihoodDrift(window=5)
        return [(step, line) for step in range(1, steps + 1)
                if (line := drift.check(step, chosen(step), rejected(step), accuracy(step)))]

    falling = run(lambda s: -50 - s, lambda s: -50 - 3 * s, lambda s: min(1.0, 0.5 + s / 10))
    assert len(falling) == 1
    step, line = falling[0]
    assert 6 <= step <= 20 and line.startswith(f"warning: step {step}: reward accuracy 0.98, but the chosen replies'")
    assert "raise --beta, lower --lr, train fewer steps, or add an SFT term" in line
    assert run(lambda s: -50 + s / 10, lambda s: -50 - 3 * s, lambda s: 1.0) == []  # the chosen replies gain
    assert run(lambda s: -50 - s, lambda s: -50 - 3 * s, lambda s: 0.8) == []  # not saturated
    assert run(lambda s: -50 - 0.01 * s, lambda s: -50 - 3 * s, lambda s: 1.0) == []  # within noise


def test_a_margin_column_in_some_sources_only_is_refused_before_tokenising(tok, tmp_path):
    """A reward model's per-pair `margin`: every source has one or none (the joined pairs share their columns)."""
    with_margin = write_jsonl(tmp_path / "with.jsonl", [dict(TEXT_PAIRS[0], margin=1.0)] * 4)
    without = write_jsonl(tmp_path / "without.jsonl", [TEXT_PAIRS[0]] * 4)
    with pytest.raises(Refusal, match="some --dataset / --eval-dataset sources have a `margin` column"):
        preferences.prepare_pairs(OneProcess(), tok, run_of([str(with_margin), str(without)]),
                                  SimpleNamespace(data_parallel_size=1))
