"""recipes/kto.py and kto_full.py (KTO on judged replies): equal to TRL's KTOTrainer step by step; the same seed and
global batch give the same curve (loss, KL estimate, gradient norm, rewards) on one process and every strategy;
a checkpoint continues on another strategy and process count; the judged replies are read, unpaired and paired
with their mismatched rows as TRL does; bad files are refused in one line before the model loads."""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
import sys
from contextlib import nullcontext
from types import SimpleNamespace

import pytest

import chat_fixtures as fixtures
from conftest import CONFIGS, REPO, launch, long_test
from test_equivalence import max_relative_difference
from test_preflight import launched_with  # (puts recipes/ on sys.path)
from test_recipes_read_well import launch_edited_copy

from common.data import checked_rows, feedback, formats, preferences  # noqa: E402
from common.launching import settle  # noqa: E402
from common.launching.args import parse_args, recipe_flags  # noqa: E402
from common.refusal import Refusal  # noqa: E402

IGNORE = formats.IGNORE
STEPS = 6
ROWS_PER_STEP = 8
PROCESSES = {"model_parallel": 1, "ddp": 2, "fsdp": 2, "fsdp_offload": 2, "zero1": 2, "zero2": 2, "zero3": 2,
             "zero3_offload": 2, "tp": 2}
# (recipe, config, flags): each suite run launches these; RECIPES_LONG_TESTS=1 the rest
# (every run: kto.py's TRL equality on one process and kto_full.py under FSDP2 without its one-process partner; the
# strategies' curves in the long tests, beside dpo.py's every-run ones)
EVERY_RUN = set()
DISTRIBUTED = [config for config in PROCESSES if config not in ("model_parallel", "tp")]
CASES = [*(("kto", config, ()) for config in DISTRIBUTED), *(("kto_full", config, ()) for config in DISTRIBUTED),
         ("kto", "ddp", ("--bits", "4")), ("kto", "zero3_offload", ("--bits", "4")),
         ("kto", "fsdp", ("--desirable-weight", "1.5", "--undesirable-weight", "0.5"))]
FIGURES = ("loss", "logps/chosen", "logps/rejected")  # (and the KL estimate: 0 where clamped, compared by `same_kl`)


def same_kl(one: list[float], other: list[float]) -> bool:
    """The KL estimates agree: relatively, or absolutely near 0 (an estimate clamped there, or a difference of
    log-probabilities of ~-25 whose float noise is ~1e-6 x 25)."""
    return one == pytest.approx(other, rel=1e-5, abs=1e-5)


PAIRS = REPO / "tests" / "fixtures" / "preferences" / "bundled_head.jsonl"  # (kto_full's reference scores them all)


def run_args(recipe: str, processes: int, *extra: str) -> list[str]:
    """The same rows a step on `processes` processes, two micro-batches each; a checkpoint at step 3. The bundled
    pairs' first 64 (128 judged replies, 16 of them held out), so that kto_full's reference pass is short."""
    args = ["--dataset", str(PAIRS), "--max-steps", str(STEPS), "--grad-accum", "2",
            "--batch-size", str(ROWS_PER_STEP // 2 // processes), "--log-every", "3", "--save-every", "3", *extra]
    # dropout draws differ between one process and several; without it the curves must agree
    return args + (["--lr", "1e-3"] if recipe == "kto_full" else ["--lr", "5e-3", "--lora-dropout", "0"])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    runs = {}

    def run(recipe: str, config: str, *flags: str):
        if (recipe, config, flags) not in runs:
            processes = PROCESSES[config]
            output_dir = tmp_path_factory.mktemp(f"{recipe}-{config}") / "out"
            runs[recipe, config, flags] = launch(recipe, output_dir, *run_args(recipe, processes, *flags),
                                                 config=config, processes=processes)
        return runs[recipe, config, flags]

    return run


def curve(run, name: str) -> list[float]:
    return [record.get(name) for record in run.metrics()]


def judged_rows(path, count: int = 8) -> None:
    """Prompt / completion / label text rows of the bundled toy task: the sorted digits (desirable) or a wrong
    order (undesirable), both labels in every batch."""
    draw = random.Random(0)
    with open(path, "w") as file:
        for i in range(count):
            digits = sorted(draw.sample("0123456789", 3 + draw.randint(0, 1)), key=lambda _: draw.random())
            good = i % 3 != 1
            reply = sorted(digits) if good else sorted(digits, reverse=True)
            file.write(json.dumps({"prompt": f"Sort: {' '.join(digits)}\nAnswer:", "completion": " " + " ".join(reply),
                                   "label": good}) + "\n")


@pytest.mark.parametrize("source", ["judged", pytest.param("pairs", marks=long_test)])
def test_the_first_steps_equal_trls(tmp_path, source):
    """Three steps, each's batch all the rows (TRL pairs each prompt with the previous reply of its batch, the recipe
    with the previous row: the same pairs when the batch is the whole file): loss, gradient norm, KL estimate,
    rewards and log-probabilities equal KTOTrainer's. Pairs: unpaired on both sides (chosen desirable, rejected
    undesirable), with unequal weights."""
    if source == "judged":
        rows, extra = tmp_path / "rows.jsonl", []
        judged_rows(rows)
    else:
        rows, extra = tmp_path / "pairs.jsonl", ["--desirable-weight", "1.3", "--undesirable-weight", "0.8"]
        rows.write_text("".join((REPO / "data" / "preferences" / "train.jsonl").read_text().splitlines(True)[:4]))
    flags = ["--dataset", str(rows), "--max-steps", "3", "--batch-size", "8", "--grad-accum", "1", "--lr", "5e-3",
             "--lora-dropout", "0", "--warmup-ratio", "0", *extra]
    ours = launch("kto", tmp_path / "ours", *flags, "--eval-dataset", str(rows), processes=1)
    assert ours.returncode == 0, ours.output[-3000:]
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "measure" / "trl_kto_worker.py"), "--output-dir",
                           str(tmp_path / "trl"), *flags], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    theirs = [json.loads(line) for line in (tmp_path / "trl" / "metrics.jsonl").read_text().splitlines()]
    assert len(theirs) == len(ours.metrics()) == 3
    for step, (mine, trl) in enumerate(zip(ours.metrics(), theirs), 1):
        for name in ("loss", "grad_norm"):
            assert mine[name] == pytest.approx(trl[name], rel=1e-5, abs=1e-7), (step, name, mine, trl)
        # differences of two log-probabilities of ~-25 in float32: compared absolutely
        for name in ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
            assert mine[name] == pytest.approx(trl[name], abs=1e-4, rel=1e-5), (step, name, mine, trl)
    assert theirs[-1]["loss"] < theirs[0]["loss"] and theirs[-1]["kl"] > 0  # both trained, the KL term in play


@pytest.mark.parametrize("recipe, config, flags", [
    pytest.param(*case, marks=() if case in EVERY_RUN else long_test,
                 id="-".join([case[0], case[1], *(flag.lstrip("-") for flag in case[2])])) for case in CASES])
def test_same_curve_as_one_process(trained, recipe, config, flags):
    """KTO's KL estimate is taken over the whole step (every rank's mismatched rows) before its first backward, so
    a step's loss does not depend on how it is split: one process with 4 rows x 2 micro-batches and 2 processes
    with 2 x 2 give the same loss, KL, gradient norm and rewards."""
    reference, other = trained(recipe, "model_parallel", *flags), trained(recipe, config, *flags)
    assert reference.returncode == other.returncode == 0, reference.output[-3000:] + other.output[-3000:]
    for name in FIGURES:
        assert max_relative_difference(curve(reference, name)[1:], curve(other, name)[1:]) <= 1e-5, name
    assert same_kl(curve(reference, "kl"), curve(other, "kl"))
    assert max_relative_difference(curve(reference, "grad_norm"), curve(other, "grad_norm")) <= 1e-4
    for name in ("rewards/chosen", "rewards/rejected"):  # near 0 themselves: compared absolutely
        assert curve(reference, name) == pytest.approx(curve(other, name), abs=1e-6, rel=0), name
    assert max(curve(other, "kl")) > 0  # the policy moved from the reference: the estimate is in play


@pytest.mark.parametrize("recipe", [pytest.param("kto", marks=long_test), "kto_full"])
def test_it_trains_and_says_what_it_read(trained, recipe):
    run = trained(recipe, "zero3" if recipe == "kto" else "fsdp")
    assert run.returncode == 0, run.output[-3000:]
    records = run.metrics()
    assert len(records) == STEPS
    # The first step's policy is the reference: every reward 0, the KL estimate 0 and the loss 1 - sigmoid(0)
    assert records[0]["loss"] == pytest.approx(0.5, abs=1e-6) and records[0]["kl"] == pytest.approx(0, abs=1e-6)
    assert all(record["kl"] >= 0 for record in records) and records[-1]["logps/chosen"] < 0
    # the estimate as clamped, and beside it as measured
    assert all(record["kl"] == pytest.approx(max(record["kl_unclamped"], 0), abs=1e-6) for record in records)
    (evaluation,) = run.metrics("eval")
    assert {"eval_loss", "eval_kl", "eval_rewards/chosen", "eval_rewards/rejected"} <= set(evaluation)
    # the bundled pairs, each two judged replies
    # the 64 pairs less the 3 held out, each two judged replies
    assert "data: 61 desirable and 61 undesirable replies to train on (each preference pair gives one of each)" \
        in run.output
    assert f"{recipe}: " in run.output and "bundled_head.jsonl" in (run.output_dir / "README.md").read_text()
    assert ("adapters switched off" in run.output if recipe == "kto"
            else re.search(r"^reference: [\d,]+ rows", run.output, re.MULTILINE)), run.output[-3000:]


@pytest.mark.parametrize("recipe, written, config, processes", [
    # (every run: dpo_full.py's resume, the same checkpoint and reference-cache code)
    pytest.param("kto_full", "fsdp", "model_parallel", 1, marks=long_test),
    pytest.param("kto", "zero3", "fsdp", 2, marks=long_test),
    pytest.param("kto", "ddp", "ddp", 2, marks=long_test)])
def test_a_checkpoint_continues_the_same_curve(trained, tmp_path, recipe, written, config, processes):
    """From step 3's checkpoint (another strategy and process count where they differ): the same steps 4-6 as
    the run that went through (kto_full's reference scores read back, not recomputed by the model that moved)."""
    first, whole = trained(recipe, written), trained(recipe, "model_parallel")
    assert first.returncode == whole.returncode == 0, first.output[-3000:]
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(first.output_dir, resumed_dir)
    shutil.rmtree(resumed_dir / "checkpoints" / f"step-{STEPS}")
    resumed = launch(recipe, resumed_dir, *run_args(recipe, processes, "--resume", "auto"), config=config,
                     processes=processes)
    assert resumed.returncode == 0, resumed.output[-3000:]
    after = [[record for record in run.metrics() if record["step"] > 3] for run in (whole, resumed)]
    assert [record["step"] for record in after[1]] == [4, 5, 6]
    for name in (*FIGURES, "grad_norm"):
        assert max_relative_difference(*([record[name] for record in records] for records in after)) <= 1e-5, name
    assert same_kl(*([record["kl"] for record in records] for records in after))
    if recipe == "kto_full":
        assert "rows' scores read from" in resumed.output


# doubled in a copy of the recipe, the loss of every row (the line both recipes share)
DOUBLED_LOSS = ("    return losses, run.beta * ratios.detach()", "    return 2.0 * losses, run.beta * ratios.detach()")


@long_test
@pytest.mark.parametrize("recipe, config", [("kto", "ddp"), ("kto", "zero3"), ("kto_full", "fsdp"),
                                            ("kto_full", "zero3")])
def test_an_edited_loss_trains_under_every_strategy(trained, tmp_path, recipe, config):
    """Doubled in a copy of kto_losses, step 1 logs twice the loss and twice the gradient norm on the same rows."""
    edited = launch_edited_copy([DOUBLED_LOSS], tmp_path / "out", steps=1, config=config, recipe=recipe,
                                flags=run_args(recipe, PROCESSES[config]), processes=PROCESSES[config])
    untouched = trained(recipe, config)
    assert untouched.returncode == 0, untouched.output[-3000:]
    (first,) = edited.metrics()
    assert first["loss"] == pytest.approx(2 * untouched.metrics()[0]["loss"], rel=1e-6)
    assert first["grad_norm"] == pytest.approx(2 * untouched.metrics()[0]["grad_norm"], rel=1e-4)


@long_test
def test_tensor_parallel_gives_the_one_process_curve(tmp_path):
    """tp.yaml on 2 processes (one tensor-parallel group: the whole batch on each) against one process."""
    flags = ["--max-steps", "3", "--grad-accum", "1", "--batch-size", "4", "--lr", "1e-3"]
    split = launch("kto_full", tmp_path / "tp", *flags, config="tp", processes=2,
                   launcher_args=("--parallelism_config_tp_size", "2"))
    one = launch("kto_full", tmp_path / "one", *flags, processes=1)
    assert split.returncode == one.returncode == 0, split.output[-3000:]
    for name in ("loss", "grad_norm"):
        assert max_relative_difference(curve(one, name), curve(split, name)) <= 1e-5, name
    assert same_kl(curve(one, "kl"), curve(split, "kl"))


@long_test
def test_chat_replies_train_and_are_scored_as_they_trained(tmp_path):
    """Judged chat replies with a system turn: rendered by the chat template, the system prompt recorded, and
    --eval-tasks asks lm-eval's prompts through the template and that system turn."""
    rows = [{"prompt": [{"role": "system", "content": "Answer with digits."},
                        {"role": "user", "content": f"Sort: {i} {i + 2} {i + 1}"}],
             "completion": [{"role": "assistant", "content": f"{i} {i + 1} {i + 2}" if i % 2 else f"{i + 2} {i}"}],
             "label": bool(i % 2)} for i in range(16)]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    run = launch("kto", tmp_path / "out", "--dataset", str(data), "--eval-dataset", str(data), "--batch-size", "4",
                 "--max-steps", "2", "--eval-tasks", str(REPO / "data" / "eval_tasks" / "recipes_answer.yaml"),
                 "--eval-limit", "4", processes=1)
    assert run.returncode == 0, run.output[-3000:]
    (scored,) = run.metrics("benchmarks")
    assert "recipes_answer" in scored and scored["prompts"].startswith("chat template"), scored
    record = run.run_json()
    assert record["data_format"] == formats.FEEDBACK_CONVERSATIONAL and record["system_prompt"] == "Answer with digits."
    assert "data: 8 desirable and 8 undesirable replies to train on" in run.output
    assert "data: chat rows rendered with the plain default" in run.output


# The data: read, unpaired, tokenised and paired with the mismatched rows as TRL does


@pytest.fixture(scope="module")
def tok():
    return fixtures.tokenizer("bundled")


def write_jsonl(path, rows: list[dict]):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def tokenised(rows: list[dict], tok, max_length: int = 1 << 16):
    import datasets

    datasets.disable_progress_bars()
    dataset = datasets.Dataset.from_list(rows)
    fmt = feedback.feedback_format_of(dataset, "rows")
    return fmt, list(preferences.tokenize_feedback(dataset, fmt, tok, max_length))


def trained_text(tok, ids, labels) -> str:
    return tok.decode([t for t, label in zip(ids, labels) if label != IGNORE])


def test_judged_replies_are_the_supervised_rows_with_their_labels(tok):
    rows = [{"prompt": "Q: sky?\nA:", "completion": " blue", "label": True},
            {"prompt": "Q: grass?\nA:", "completion": " red", "label": False},
            {"prompt": "Q: sea?\nA:", "completion": " ", "label": True}, {"prompt": "Q\n", "completion": "x", "label": None}]
    fmt, out = tokenised(rows, tok)
    assert fmt == formats.FEEDBACK_TEXT
    assert [row["dropped"] for row in out] == ["", "", "empty completion", "no label"]
    assert [row["label"] for row in out[:2]] == [True, False]
    for row, out_row in zip(rows[:2], out):  # tokenised exactly as SFT's prompt / completion rows
        sft = preferences.tokenize_rows([{"prompt": row["prompt"], "completion": row["completion"]}], tok,
                                        "prompt_completion")[0]
        assert list(out_row["input_ids"]) == list(sft["input_ids"]) and list(out_row["labels"]) == list(sft["labels"])
        assert trained_text(tok, out_row["input_ids"], out_row["labels"]) == row["completion"] + tok.eos_token


def test_chat_replies_train_the_completion_turns_only(tok, tmp_path):
    """TRL's conversational judged replies (prompt and completion message lists), read from a file: the prompt's
    turns are context (an assistant turn in it too), the completion's reply is trained."""
    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sky?"}],
             "completion": [{"role": "assistant", "content": "Blue."}], "label": True},
            {"prompt": [{"role": "user", "content": "Sky?"}, {"role": "assistant", "content": "Hm?"},
                        {"role": "user", "content": "Colour?"}],
             "completion": [{"role": "assistant", "content": "Green."}], "label": False}]
    (part,), _ = checked_rows.load_sources(str(write_jsonl(tmp_path / "chat.jsonl", rows)), 0,
                                           eval_spec=str(write_jsonl(tmp_path / "eval.jsonl", rows)),
                                           found_format=feedback.feedback_format_of, problem=feedback.feedback_problem)
    assert part.fmt == formats.FEEDBACK_CONVERSATIONAL
    out = list(preferences.tokenize_feedback(part.rows, part.fmt, tok, 1 << 16))
    assert [row["dropped"] for row in out] == ["", ""] and [row["label"] for row in out] == [True, False]
    assert trained_text(tok, out[0]["input_ids"], out[0]["labels"]).startswith("Blue.")
    assert trained_text(tok, out[1]["input_ids"], out[1]["labels"]).startswith("Green.")  # not the prompt's "Hm?"


def test_pairs_give_their_chosen_replies_then_their_rejected_ones(tok):
    """TRL's unpair_preference_dataset order: a batch's chosen replies, then its rejected ones (so a reply's
    neighbour, whose reply its mismatched row borrows, answers another prompt)."""
    pairs = [{"prompt": f"Sort: {i} 1\n", "chosen": f"1 {i}", "rejected": f"{i} 1"} for i in range(2, 5)]
    _, out = tokenised(pairs, tok)
    assert [row["label"] for row in out] == [True] * 3 + [False] * 3
    replies = [trained_text(tok, row["input_ids"], row["labels"]) for row in out]
    assert replies == [f"{pair[side]}{tok.eos_token}" for side in ("chosen", "rejected") for pair in pairs]


def test_a_mismatched_row_is_its_prompt_before_the_previous_rows_reply(tok):
    import datasets

    rows = [{"prompt": f"Question {i}?\n", "completion": f"answer {i}", "label": i % 2 == 0} for i in range(3)]
    _, out = tokenised(rows, tok)
    table = datasets.Dataset.from_list([{key: row[key] for key in ("input_ids", "labels", "label")} for row in out])
    items = preferences.WithMismatched(table, max_length=512)
    for index in range(3):
        item, previous = items[index], out[index - 1]  # the first row borrows the last one's reply
        start = preferences.first_target(item["labels"])
        assert tok.decode(item["kl_input_ids"][:start]) == tok.decode(item["input_ids"][:start])  # its own prompt
        assert trained_text(tok, item["kl_input_ids"], item["kl_labels"]) == \
            trained_text(tok, previous["input_ids"], previous["labels"])  # the previous row's reply, trained alike
        assert item["pair_index"] == index
    assert len(preferences.WithMismatched(table, max_length=6)[1]["kl_input_ids"]) == 6  # cut to --max-length
    batch = preferences.batches.PadFeedback(0)([items[0], items[1]])
    assert batch["input_ids"].shape[0] == 4 and batch["desirable"].tolist() == [True, False]


def refusal(tmp_path, rows_or_file, **options) -> str:
    path = rows_or_file if not isinstance(rows_or_file, list) else write_jsonl(tmp_path / "rows.jsonl", rows_or_file)
    with pytest.raises(Refusal) as refused:
        checked_rows.load_sources(str(path), 0, found_format=feedback.feedback_format_of,
                                  problem=feedback.feedback_problem, **options)
    assert "\n" not in str(refused.value)
    return str(refused.value)


def test_files_that_are_not_judged_replies_are_refused_naming_the_fix(tmp_path):
    line = refusal(tmp_path, REPO / "data" / "train.jsonl")  # supervised rows
    assert "holds no judged replies: no `prompt` or `completion` or `label` column" in line
    assert "--columns completion=response,label=thumbs_up" in line
    line = refusal(tmp_path, [{"prompt": "p", "completion": "c"}] * 4)  # no labels
    assert "no `label` column" in line
    line = refusal(tmp_path, [{"prompt": "p", "completion": "c", "label": 1}] * 4)
    assert "column `label` holds int64 values, not true / false" in line
    line = refusal(tmp_path, [{"prompt": "p", "completion": [{"role": "assistant", "content": "c"}], "label": True}] * 4)
    assert "`prompt` holds text and `completion` messages" in line


class OneProcess:
    is_main_process = True
    num_processes = 1

    def main_process_first(self):
        return nullcontext()


def run_of(dataset, **more):
    return SimpleNamespace(dataset=[dataset], seed=0, columns=None, eval_dataset=None, max_length=512, batch_size=1,
                           grad_accum=1, max_steps=1, epochs=1, model="tiny", chat_template=None, desirable_weight=1.0,
                           undesirable_weight=1.0, **more)


def test_training_rows_of_one_label_are_refused_and_an_imbalance_gets_advice(tok, tmp_path, capsys):
    rows = [{"prompt": f"Q {i}?\n", "completion": f"a {i}", "label": True} for i in range(40)]
    with pytest.raises(Refusal, match="labelled true; KTO needs replies to learn from"):
        preferences.prepare_feedback(OneProcess(), tok, run_of(str(write_jsonl(tmp_path / "one.jsonl", rows))),
                                     SimpleNamespace(data_parallel_size=1))
    for row in rows[:5]:
        row["label"] = False
    train, evaluation, fmt = preferences.prepare_feedback(
        OneProcess(), tok, run_of(str(write_jsonl(tmp_path / "few.jsonl", rows))), SimpleNamespace(data_parallel_size=1))
    (line,) = [line for line in capsys.readouterr().out.splitlines() if "desirable and" in line]
    desirable = sum(train.rows["label"])
    # the KTO paper's range (TRL warns the same): the desirable rows' weighted count 1 to 4/3 the undesirable's
    low = (len(train) - desirable) / desirable
    assert line.startswith(f"data: {desirable} desirable and {len(train) - desirable} undesirable replies")
    assert f"advises --desirable-weight {low:.2f} to {low * 4 / 3:.2f}" in line
    assert fmt == formats.FEEDBACK_TEXT and len(evaluation) == 2 and isinstance(train, preferences.WithMismatched)


@pytest.mark.parametrize("flags, refusal", [
    (["--packing"], "KTO scores each reply as a whole row"),
    (["--batch-size", "auto"], "KTO scores each row with a mismatched one"),
])
def test_what_it_cannot_run_is_refused_before_loading(tmp_path, flags, refusal):
    args = parse_args(recipe_flags("kto"), ["--max-steps", "1", "--output-dir", str(tmp_path / "out"), *flags])
    with launched_with("ddp", 2), pytest.raises(Refusal, match=re.escape(refusal)):
        settle.settle_launch(args, "lora")


def test_check_config_answers_for_the_kto_recipes():
    sys.path.insert(0, str(REPO / "scripts"))
    import check_config

    assert check_config.check(CONFIGS / "zero3.yaml", "kto", ["--bits", "4"], num_processes=2,
                              on_gpu=False)[-1].startswith("ok: kto runs as zero3")
    assert check_config.check(CONFIGS / "fsdp.yaml", "kto_full", num_processes=2,
                              on_gpu=False)[-1].startswith("ok: kto_full runs as fsdp")
    with pytest.raises(Refusal, match="kto_full.py does not run sequence parallel yet"):
        check_config.check(CONFIGS / "sp.yaml", "kto_full", num_processes=4, on_gpu=True)
