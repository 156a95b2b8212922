"""recipes/reward.py and reward_full.py (reward models on preference pairs): equal to TRL's RewardTrainer step by
step; the same seed and global batch give the same curve on one process and every strategy; what they save loads
with AutoModelForSequenceClassification and scores as the run trained; a checkpoint continues on another strategy;
what they cannot run is refused in one line before the model loads; recipes/rewards.py's `reward_model` hands a
saved one to GRPO as a reward function."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import CONFIGS, REPO, launch, long_test
from test_equivalence import max_relative_difference
from test_preflight import launched_with  # (puts recipes/ on sys.path)
from test_recipes_read_well import launch_edited_copy

from common.launching import settle  # noqa: E402
from common.launching.args import parse_args, recipe_flags  # noqa: E402
from common.model import score_head  # noqa: E402
from common.refusal import Refusal  # noqa: E402

STEPS = 6
PAIRS_PER_STEP = 8
PROCESSES = {"model_parallel": 1, "ddp": 2, "fsdp": 2, "fsdp_offload": 2, "zero1": 2, "zero2": 2, "zero3": 2,
             "zero3_offload": 2}
# (recipe, config, flags): each suite run launches these; RECIPES_LONG_TESTS=1 the rest (every run: reward.py's TRL
# equality on one process, and reward_full.py under FSDP2, reloaded and scored, without its one-process partner)
EVERY_RUN = set()
DISTRIBUTED = [config for config in PROCESSES if config != "model_parallel"]
CENTRED = ("--center-rewards-coefficient", "0.01")
CASES = [*(("reward", config, ()) for config in DISTRIBUTED), *(("reward_full", config, ()) for config in DISTRIBUTED),
         ("reward", "ddp", ("--bits", "4")), ("reward", "zero3_offload", ("--bits", "4")), ("reward", "fsdp", CENTRED)]
TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def run_args(recipe: str, processes: int, *extra: str) -> list[str]:
    """The same pairs a step on `processes` processes, two micro-batches each; a checkpoint at step 3."""
    args = ["--max-steps", str(STEPS), "--grad-accum", "2", "--batch-size", str(PAIRS_PER_STEP // 2 // processes),
            "--log-every", "3", "--save-every", "3", *extra]
    # dropout draws differ between one process and several; without it the curves must agree
    return args + (["--lr", "1e-3"] if recipe == "reward_full" else ["--lr", "5e-3", "--lora-dropout", "0"])


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
    return [record[name] for record in run.metrics()]


@pytest.mark.parametrize("flags, margins", [((), False), pytest.param(CENTRED, False, marks=long_test),
                                           pytest.param((), True, marks=long_test)], ids=["plain", "centred", "margins"])
def test_the_first_steps_equal_trls(tmp_path, flags, margins):
    """Three steps, each's batch all the pairs: loss, gradient norm, accuracy, margin and mean reward equal
    RewardTrainer's (its sequence classifier with one label, the score head drawn as the recipe draws it); with a
    `margin` column, each pair's margin in the loss on both sides."""
    pairs = tmp_path / "pairs.jsonl"
    rows = [json.loads(line) for line in (REPO / "data" / "preferences" / "train.jsonl").read_text().splitlines()[:8]]
    pairs.write_text("".join(json.dumps({**row, **({"margin": 0.25 * i} if margins else {})}) + "\n"
                             for i, row in enumerate(rows)))
    args = ["--dataset", str(pairs), "--max-steps", "3", "--batch-size", "8", "--grad-accum", "1", "--lr", "5e-3",
            "--lora-dropout", "0", "--warmup-ratio", "0", "--lora-targets", TARGETS, *flags]
    ours = launch("reward", tmp_path / "ours", *args, "--eval-dataset", str(pairs), processes=1)
    assert ours.returncode == 0, ours.output[-3000:]
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "measure" / "trl_reward_worker.py"), "--output-dir",
                           str(tmp_path / "trl"), *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    theirs = [json.loads(line) for line in (tmp_path / "trl" / "metrics.jsonl").read_text().splitlines()]
    assert len(theirs) == len(ours.metrics()) == 3
    for step, (mine, trl) in enumerate(zip(ours.metrics(), theirs), 1):
        for name in ("loss", "grad_norm", "accuracy", "margin", "mean_reward"):
            assert mine[name] == pytest.approx(trl[name], rel=1e-5, abs=1e-6), (step, name, mine, trl)
    assert theirs[-1]["loss"] < theirs[0]["loss"]  # both trained
    assert_it_scores_as_trained(ours, ours.output_dir / "merged")  # LoRA's merged/: the adapter and the score head


def assert_it_scores_as_trained(run, folder):
    """`folder` loads as a one-label AutoModelForSequenceClassification whose score of each probe row (the first
    evaluation batch) is the trained model's score at the row's last token."""
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    probe = load_file(str(run.output_dir / "probe_logits.safetensors"))
    model = AutoModelForSequenceClassification.from_pretrained(folder)
    assert type(model).__name__ == "LlamaForSequenceClassification" and model.config.num_labels == 1
    with torch.no_grad():
        scores = model(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"]).logits[:, 0]
    trained_scores = score_head.rewards_at_last_token(probe["logits"], probe["input_ids"], model.config.pad_token_id)
    assert torch.allclose(scores, trained_scores, atol=1e-5), (scores, trained_scores)


@pytest.mark.parametrize("recipe, config, flags", [
    pytest.param(*case, marks=() if case in EVERY_RUN else long_test,
                 id="-".join([case[0], case[1], *(flag.lstrip("-") for flag in case[2])])) for case in CASES])
def test_same_curve_as_one_process(trained, recipe, config, flags):
    reference, other = trained(recipe, "model_parallel", *flags), trained(recipe, config, *flags)
    assert reference.returncode == other.returncode == 0, reference.output[-3000:] + other.output[-3000:]
    assert max_relative_difference(curve(reference, "loss"), curve(other, "loss")) <= 1e-5
    assert max_relative_difference(curve(reference, "grad_norm"), curve(other, "grad_norm")) <= 1e-4
    # rewards of ~1 (4-bit bases: their float noise too); the mean reward has no force holding it (the loss sees
    # differences only), so it keeps the noise of every step
    for name in ("margin", "mean_reward"):
        assert curve(reference, name) == pytest.approx(curve(other, name), abs=1e-4, rel=2e-4), name
    assert curve(reference, "accuracy") == curve(other, "accuracy")


@pytest.mark.parametrize("recipe, config", [pytest.param("reward", "ddp", marks=long_test), ("reward_full", "fsdp")])
def test_the_saved_reward_model_loads_as_a_sequence_classifier_and_scores_as_trained(trained, recipe, config):
    """merged/ (LoRA) or model/ (every weight): AutoModelForSequenceClassification with one label, whose score of
    each probe row is the trained model's score at the row's last token."""
    run = trained(recipe, config)
    assert run.returncode == 0, run.output[-3000:]
    assert_it_scores_as_trained(run, run.output_dir / ("merged" if recipe == "reward" else "model"))
    assert all(0 <= record["accuracy"] <= 1 for record in run.metrics()) and len(run.metrics()) == STEPS
    assert "AutoModelForSequenceClassification.from_pretrained" in (run.output_dir / "README.md").read_text()
    (evaluation,) = run.metrics("eval")
    assert {"eval_loss", "eval_rewards/accuracies", "eval_rewards/margins"} <= set(evaluation)
    if config == "fsdp":  # the score head is in no file: the main process loads and sends the shards
        assert "since a reward model's score head is not in the model's files" in run.output


@long_test
@pytest.mark.parametrize("recipe, written, config, processes", [("reward_full", "fsdp", "model_parallel", 1),
                                                                ("reward", "zero3", "ddp", 2)])
def test_a_checkpoint_continues_the_same_curve(trained, tmp_path, recipe, written, config, processes):
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
    for name in ("loss", "grad_norm"):
        assert max_relative_difference(*([record[name] for record in records] for records in after)) <= 1e-5, name


DOUBLED_LOSS = ("    return losses, chosen.detach(), rejected.detach()",
                "    return 2.0 * losses, chosen.detach(), rejected.detach()")


@long_test
@pytest.mark.parametrize("recipe, config", [("reward", "zero3"), ("reward_full", "fsdp")])
def test_an_edited_loss_trains_under_every_strategy(trained, tmp_path, recipe, config):
    edited = launch_edited_copy([DOUBLED_LOSS], tmp_path / "out", steps=1, config=config, recipe=recipe,
                                flags=run_args(recipe, PROCESSES[config]), processes=PROCESSES[config])
    untouched = trained(recipe, config)
    assert untouched.returncode == 0, untouched.output[-3000:]
    (first,) = edited.metrics()
    assert first["loss"] == pytest.approx(2 * untouched.metrics()[0]["loss"], rel=1e-6)
    assert first["grad_norm"] == pytest.approx(2 * untouched.metrics()[0]["grad_norm"], rel=1e-4)


@pytest.mark.parametrize("flags, launched, refusal", [
    (["--eval-tasks", "arc_easy"], ("ddp", 2), "a reward model writes none; drop --eval-tasks"),
    (["--packing"], ("ddp", 2), "a preference pair is scored as two whole rows"),
    (["--batch-size", "auto"], ("ddp", 2), "--batch-size auto is planned for rows"),
    ([], ("tp", 4), "reward.py does not run tensor parallel"),
])
def test_what_it_cannot_run_is_refused_before_loading(tmp_path, flags, launched, refusal):
    args = parse_args(recipe_flags("reward"), ["--max-steps", "1", "--output-dir", str(tmp_path / "out"), *flags])
    with launched_with(*launched), pytest.raises(Refusal, match=re.escape(refusal)):
        settle.settle_launch(args, "lora")


def test_a_family_whose_classifier_reads_otherwise_is_refused():
    assert score_head.why_not_a_reward_model({"model_type": "llama"}) is None
    assert "scales its logits after the head" in score_head.why_not_a_reward_model(
        {"model_type": "gemma2", "final_logit_softcapping": 30.0})
    assert "no sequence classifier" in score_head.why_not_a_reward_model({"model_type": "no-such-family"})


def test_check_config_answers_for_the_reward_recipes():
    sys.path.insert(0, str(REPO / "scripts"))
    import check_config

    assert check_config.check(CONFIGS / "zero3.yaml", "reward", ["--bits", "4"], num_processes=2,
                              on_gpu=False)[-1].startswith("ok: reward runs as zero3")
    with pytest.raises(Refusal, match="reward_full.py does not run sequence parallel"):
        check_config.check(CONFIGS / "sp.yaml", "reward_full", num_processes=4, on_gpu=True)


def test_reward_model_scores_grpo_completions_as_the_reward_model_trained(trained):
    """recipes/rewards.py's reward_model: a saved reward model as a GRPO reward function; its score of the first
    held-out pair's two sides is the trained model's (the probe: the first evaluation batch, chosen sides first)."""
    from safetensors.torch import load_file

    import rewards

    run = trained("reward_full", "fsdp")
    assert run.returncode == 0, run.output[-3000:]
    pair = json.loads((REPO / "data" / "preferences" / "eval.jsonl").read_text().splitlines()[0])
    scored = rewards.reward_model(str(run.output_dir / "model"))([pair["prompt"]] * 2, [pair["chosen"], pair["rejected"]])
    probe = load_file(str(run.output_dir / "probe_logits.safetensors"))
    trained_scores = score_head.rewards_at_last_token(probe["logits"], probe["input_ids"], 3)
    half = len(trained_scores) // 2
    assert scored == pytest.approx([trained_scores[0].item(), trained_scores[half].item()], abs=1e-5)


@long_test
def test_grpo_trains_on_a_saved_reward_model(trained, tmp_path):
    run = trained("reward", "ddp")
    assert run.returncode == 0, run.output[-3000:]
    (tmp_path / "my_rewards.py").write_text("from rewards import reward_model\n\n"
                                           f"learned = reward_model({str(run.output_dir / 'merged')!r})\n")
    grpo = launch("grpo", tmp_path / "grpo", "--reward", f"{tmp_path / 'my_rewards.py'}:learned", "--batch-size", "8",
                  "--num-generations", "4", "--max-completion-length", "8", "--max-steps", "2", processes=1)
    assert grpo.returncode == 0, grpo.output[-3000:]
    assert all(record["reward_std"] > 0 for record in grpo.metrics())  # a score per completion, not a constant
