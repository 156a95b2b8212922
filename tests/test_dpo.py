"""recipes/dpo.py and dpo_full.py through the real `accelerate launch`: they train (the held-out chosen replies
gain on the rejected ones), the same seed and global batch of pairs give the same curve on one process and
every strategy, accumulation leaves the updates alone, a resume continues exactly (full tuning's reference
read back from the cache), the adapter / model reloads with plain peft / transformers, and what they cannot
run is refused in one line before the model loads."""

from __future__ import annotations

import math
import re
import shutil
import sys

import pytest
import torch

from conftest import (CONFIGS, REPO, TINY_MODEL, assert_no_traceback_of_ours, assert_the_refusal_ends_the_output, launch,
                      long_test)
from strategies import SEQUENCE_PARALLEL
from test_equivalence import max_relative_difference
from test_preflight import launched_with  # (puts recipes/ on sys.path)
from test_recipes_read_well import launch_edited_copy

from common.launching import settle  # noqa: E402
from common.launching.args import parse_args, recipe_flags  # noqa: E402
from common.launching.preflight import Refusal  # noqa: E402

STEPS = 8
PAIRS_PER_STEP = 8
# config -> processes; the one-process launch is the reference every other must match
PROCESSES = {"model_parallel": 1, "ddp": 2, "fsdp": 2, "fsdp_grad_op": 2, "fsdp_offload": 2, "zero1": 2, "zero2": 2,
             "zero3": 2, "zero3_offload": 2, "sp": 2}
# (recipe, config, flags): each suite run launches these; RECIPES_LONG_TESTS=1 the rest
ORPO = ("--loss", "orpo")
# (sequence parallel: lora's every run, tests/test_equivalence.py; the preference recipes' in the long tests)
EVERY_RUN = {("dpo", "ddp", ()), ("dpo", "fsdp", ()), ("dpo_full", "zero3", ()), ("dpo_full", "fsdp", ORPO)}
DISTRIBUTED = [config for config in PROCESSES if config != "model_parallel"]
CASES = [*(("dpo", config, ()) for config in DISTRIBUTED), *(("dpo_full", config, ()) for config in DISTRIBUTED),
         ("dpo", "ddp", ("--bits", "4")), ("dpo", "fsdp_offload", ("--bits", "4")), ("dpo", "zero3_offload", ("--bits", "4")),
         # ORPO: no reference; its SFT term a mean over the step's chosen tokens (the prompts' too), on every rank
         *(("dpo", config, ORPO) for config in ("ddp", "fsdp", "zero3", "sp")),
         *(("dpo_full", config, ORPO) for config in ("ddp", "fsdp", "zero3", "sp"))]


def run_args(recipe: str, processes: int, *extra: str, sequence_parallel: int = 1) -> list[str]:
    """The same pairs a step on `processes` processes (`sequence_parallel` of them sharing each micro-batch)."""
    data_parallel = processes // sequence_parallel
    args = ["--max-steps", str(STEPS), "--grad-accum", "2", "--batch-size", str(PAIRS_PER_STEP // 2 // data_parallel),
            "--log-every", "4", "--save-every", "4", *extra]
    # dropout draws differ between one process and several; without it the curves must agree
    return args + (["--lr", "1e-3"] if recipe == "dpo_full" else ["--lr", "5e-3", "--lora-dropout", "0"])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    runs = {}

    def run(recipe: str, config: str, *flags: str):
        if (recipe, config, flags) not in runs:
            processes = PROCESSES[config]
            output_dir = tmp_path_factory.mktemp(f"{recipe}-{config}") / "out"
            runs[recipe, config, flags] = launch(recipe, output_dir, *run_args(recipe, processes, *flags,
                                                                              sequence_parallel=SEQUENCE_PARALLEL.get(config, 1)),
                                                 config=config, processes=processes)
        return runs[recipe, config, flags]

    return run


def curve(run, name: str) -> list[float]:
    return [record[name] for record in run.metrics()]


@pytest.mark.parametrize("recipe", ["dpo", "dpo_full"])
def test_it_trains_the_chosen_reply_above_the_rejected_one(trained, recipe):
    run = trained(recipe, "ddp" if recipe == "dpo" else "zero3")
    assert run.returncode == 0, run.output[-3000:]
    records = run.metrics()
    assert len(records) == STEPS
    # The first step's policy is the reference (adapters start at zero; full tuning's reference is the model
    # as loaded): every reward 0 and the loss log 2.
    assert records[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert records[0]["rewards/chosen"] == pytest.approx(0, abs=1e-5) and records[0]["rewards/margins"] == pytest.approx(0, abs=1e-5)
    assert all(record["rewards/margins"] != 0 for record in records[1:])  # it moved (a step's 8 pairs are noisy)
    assert records[-1]["rewards/margins"] == pytest.approx(records[-1]["rewards/chosen"]
                                                           - records[-1]["rewards/rejected"], abs=1e-9)
    assert 0 <= records[-1]["rewards/accuracies"] <= 1 and records[-1]["logps/chosen"] < 0
    (evaluation,) = run.metrics("eval")
    # the 128 held-out pairs: the chosen answers gained on the rejected ones
    assert evaluation["eval_rewards/margins"] > 0 and evaluation["eval_loss"] < math.log(2)
    assert evaluation["eval_rewards/accuracies"] >= 0.5
    assert f"{recipe}: " in run.output and "(two rows a pair)" in run.output
    assert "- data: `bundled data/preferences/`" in (run.output_dir / "README.md").read_text()  # the model card
    # full tuning's reference: scored here, or by an earlier launch on the same pairs and model (the cache)
    assert ("adapters switched off" in run.output if recipe == "dpo"
            else re.search(r"^reference: [\d,]+ pairs", run.output, re.MULTILINE)), run.output[-3000:]


@pytest.mark.parametrize("recipe, config, flags", [
    pytest.param(*case, marks=() if case in EVERY_RUN else long_test,
                 id="-".join([case[0], case[1], *(flag.lstrip("-") for flag in case[2])])) for case in CASES])
def test_same_curve_as_one_process(trained, recipe, config, flags):
    reference, other = trained(recipe, "model_parallel", *flags), trained(recipe, config, *flags)
    assert reference.returncode == other.returncode == 0, other.output[-3000:]
    for name in ("loss", "logps/chosen", "logps/rejected", *(("nll_loss", "log_odds_ratio") if flags == ORPO else ())):
        assert max_relative_difference(curve(reference, name)[1:], curve(other, name)[1:]) <= 1e-5, name
    assert max_relative_difference(curve(reference, "grad_norm"), curve(other, "grad_norm")) <= 1e-4
    # a reward is a difference of two log-probabilities of ~-20 (in float32), near 0 itself: compared absolutely
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert curve(reference, name) == pytest.approx(curve(other, name), abs=1e-6, rel=0), name
    # (the first step's rewards are 0 up to float noise, whose signs decide its accuracies)
    assert curve(reference, "rewards/accuracies")[1:] == curve(other, "rewards/accuracies")[1:]


@pytest.mark.parametrize("recipe", [pytest.param("dpo", marks=long_test), pytest.param("dpo_full", marks=long_test)])
def test_a_sequence_parallel_group_gives_the_gradient_of_one_process(trained, recipe):
    """sp.yaml: each rank holds a slice of every row, the group sums the rows' log-probabilities, and each rank's
    backward takes the group's gradient for its slice: the gradient norm is one process's too."""
    reference, split = trained(recipe, "model_parallel"), trained(recipe, "sp")
    assert split.returncode == 0, split.output[-3000:]
    assert "2-way sequence parallel" in split.output
    assert max_relative_difference(curve(reference, "grad_norm"), curve(split, "grad_norm")) <= 1e-5
    # evaluation: each rank scores whole rows (Ulysses steps aside in eval mode), every held-out pair once
    (one_eval,), (split_eval,) = reference.metrics("eval"), split.metrics("eval")
    assert split_eval["eval_loss"] == pytest.approx(one_eval["eval_loss"], rel=1e-5)
    assert split_eval["eval_rewards/margins"] == pytest.approx(one_eval["eval_rewards/margins"], abs=1e-6)


@long_test
@pytest.mark.parametrize("zero_stage, processes", [(1, 2), (2, 2), (3, 4)])
def test_sequence_parallel_under_zero_1_and_2_and_with_two_groups(trained, tmp_path, zero_stage, processes):
    """ZeRO-1 and 2 divide the gradients by the data-parallel groups only (the accelerator divides by the group's
    size); 4 processes make 2 groups of 2, each its own pairs: the curve and gradient norm of one process."""
    from test_sequence_parallel import sp_config

    run = launch("dpo", tmp_path / "out", *run_args("dpo", processes, sequence_parallel=2),
                 config=sp_config(tmp_path, zero_stage), processes=processes, timeout=900)
    reference = trained("dpo", "model_parallel")
    assert run.returncode == 0, run.output[-3000:]
    assert f"zero{zero_stage} x 2-way sequence parallel" in run.output
    for name in ("loss", "grad_norm", "logps/chosen"):
        assert max_relative_difference(curve(reference, name), curve(run, name)) <= 1e-5, name


@long_test
@pytest.mark.parametrize("recipe", ["dpo", "dpo_full"])
def test_pairs_of_fourteen_thousand_tokens_split_over_a_group(recipe, tmp_path):
    """The case sequence parallel is for: pairs whose rows are ~14,000 tokens (a long shared prompt, replies of a
    few hundred), each split over a group of 2, give one process's curve and gradient norm."""
    import json
    import random

    words = ["sort", "copy", "reverse", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    generator = random.Random(0)

    def text(tokens: int) -> str:  # ~4.75 tokens a word with the bundled tokenizer
        return " ".join(generator.choice(words) for _ in range(tokens * 4 // 19))

    data = tmp_path / "long-pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": text(13_500), "chosen": text(400), "rejected": text(300)}) + "\n"
                            for _ in range(4)))
    common = ["--dataset", str(data), "--eval-dataset", str(data), "--max-length", "16384", "--batch-size", "1",
              "--grad-accum", "2", "--max-steps", "2", "--eval-every", "0",
              *(["--lr", "1e-3"] if recipe == "dpo_full" else ["--lr", "5e-3", "--lora-dropout", "0"])]
    one = launch(recipe, tmp_path / "one", *common, config="model_parallel", processes=1, timeout=900)
    split = launch(recipe, tmp_path / "sp", *common, config="sp", processes=2, timeout=900)
    assert one.returncode == split.returncode == 0, split.output[-3000:]
    # two pairs a step, their replies whole (~700 target tokens a pair): no row was cut or dropped
    assert min(record["tokens"] for record in split.metrics()) > 2 * 600
    for name in ("loss", "grad_norm", "logps/chosen", "logps/rejected"):
        assert max_relative_difference(curve(one, name), curve(split, name)) <= 1e-5, name


@long_test
@pytest.mark.parametrize("loss", ["ipo", "simpo"])
def test_other_losses_train_alike_on_one_process_and_two(trained, loss):
    one, two = trained("dpo", "model_parallel", "--loss", loss), trained("dpo", "ddp", "--loss", loss)
    assert one.returncode == two.returncode == 0, two.output[-3000:]
    assert max_relative_difference(curve(one, "loss"), curve(two, "loss")) <= 1e-5
    assert two.metrics("eval")[-1]["eval_rewards/margins"] > 0  # the held-out chosen replies gained


# doubled in a copy of the recipe, the loss of every pair (the DPO line both recipes share)
DOUBLED_PAIR_LOSS = ("    return losses, run.beta * chosen_ratio.detach(), run.beta * rejected_ratio.detach()",
                     "    return 2.0 * losses, run.beta * chosen_ratio.detach(), run.beta * rejected_ratio.detach()")


@pytest.mark.parametrize("recipe, config", [
    ("dpo", "ddp"), *(pytest.param("dpo", config, marks=long_test) for config in ("fsdp", "zero3", "fsdp_offload", "sp")),
    *(pytest.param("dpo_full", config, marks=long_test) for config in ("ddp", "fsdp", "zero3", "sp"))])
def test_an_edited_pair_loss_trains_under_every_strategy(trained, tmp_path, recipe, config):
    """The loss is written once, in the recipe's pair_losses, and both the logged loss and the backward use
    it under every strategy: doubled in a copy, step 1 (before any update) logs twice the recipe's loss and
    twice its gradient norm on the same pairs."""
    edited = launch_edited_copy([DOUBLED_PAIR_LOSS], tmp_path / "out", steps=1, config=config, recipe=recipe,
                                flags=run_args(recipe, PROCESSES[config], sequence_parallel=SEQUENCE_PARALLEL.get(config, 1)),
                                processes=PROCESSES[config])
    untouched = trained(recipe, config)
    assert untouched.returncode == 0, untouched.output[-3000:]
    (first,) = edited.metrics()
    assert first["loss"] == pytest.approx(2 * untouched.metrics()[0]["loss"], rel=1e-6)
    assert first["grad_norm"] == pytest.approx(2 * untouched.metrics()[0]["grad_norm"], rel=1e-4)


@long_test
def test_accumulation_does_not_change_the_updates(tmp_path):
    """8 pairs a step as 1 x 4 micro-batches x 2 processes and as 8 x 1 on one process."""
    common = ["--max-steps", "4", "--lr", "5e-3", "--lora-dropout", "0"]
    accumulated = launch("dpo", tmp_path / "accumulated", *common, "--batch-size", "1", "--grad-accum", "4",
                         config="ddp")
    whole = launch("dpo", tmp_path / "whole", *common, "--batch-size", "8", "--grad-accum", "1", processes=1)
    assert accumulated.returncode == whole.returncode == 0, accumulated.output[-2000:] + whole.output[-2000:]
    assert max_relative_difference(curve(whole, "loss")[1:], curve(accumulated, "loss")[1:]) <= 1e-5
    assert max_relative_difference(curve(whole, "grad_norm"), curve(accumulated, "grad_norm")) <= 1e-4


@pytest.mark.parametrize("recipe, config", [pytest.param("dpo", "ddp", marks=long_test), ("dpo_full", "zero3"),
                                            pytest.param("dpo", "sp", marks=long_test)])
def test_a_resumed_run_continues_the_same_curve(trained, tmp_path, recipe, config):
    """From step 4's checkpoint to step 8: the same losses as the run that went through (full tuning's
    reference scores are read back, not recomputed by the model that has already moved)."""
    first = trained(recipe, config)
    assert first.returncode == 0
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(first.output_dir, resumed_dir)
    shutil.rmtree(resumed_dir / "checkpoints" / "step-8")
    resumed = launch(recipe, resumed_dir, *run_args(recipe, 2, "--resume", "auto",
                                                    sequence_parallel=SEQUENCE_PARALLEL.get(config, 1)), config=config)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert curve(resumed, "loss") == curve(first, "loss")


@pytest.mark.parametrize("recipe, written, config, processes", [
    pytest.param("dpo", "fsdp", "zero3", 1, marks=long_test), pytest.param("dpo", "zero3", "fsdp", 1, marks=long_test),
    pytest.param("dpo_full", "zero3", "ddp", 1, marks=long_test),
    pytest.param("dpo_full", "fsdp", "zero3", 4, marks=long_test)])
def test_a_checkpoint_continues_under_another_strategy(trained, tmp_path, recipe, written, config, processes):
    """The preference recipes' checkpoints continue under another strategy and process count on the same curve
    (the trained state read by parameter name: tests/test_resume.py), the micro-batch kept and the accumulation
    following the count (2 pairs x 2 x 2 processes -> 2 x 4 x 1)."""
    first = trained(recipe, written)
    assert first.returncode == 0
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(first.output_dir, resumed_dir)
    shutil.rmtree(resumed_dir / "checkpoints" / "step-8")
    args = run_args(recipe, 2, "--resume", "auto", "--global-batch-size", str(PAIRS_PER_STEP))
    del args[args.index("--grad-accum"):args.index("--grad-accum") + 2]
    resumed = launch(recipe, resumed_dir, *args, config=config, processes=processes)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert "its trained state is read parameter by parameter into this launch" in resumed.output
    assert resumed.run_json()["batch"]["grad_accum"] == PAIRS_PER_STEP // 2 // processes
    after = [[record for record in run.metrics() if record["step"] > 4] for run in (first, resumed)]
    assert [record["step"] for record in after[1]] == [5, 6, 7, 8]
    for name in ("loss", "grad_norm"):
        assert max_relative_difference(*([record[name] for record in records] for records in after)) <= 1e-5


def test_the_adapter_reloads_with_plain_peft(trained):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run = trained("dpo", "fsdp")
    assert run.returncode == 0, run.output[-3000:]
    probe = load_file(str(run.output_dir / "probe_logits.safetensors"))
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(TINY_MODEL), run.output_dir / "adapter")
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"]).logits
    mask = probe["attention_mask"].bool()
    assert torch.allclose(logits[mask], probe["logits"][mask], atol=1e-4)


def test_what_it_cannot_run_is_refused_before_loading(tmp_path):
    run = launch("dpo", tmp_path / "out", "--max-steps", "1", "--packing", config="ddp")
    errors = [line for line in run.output.splitlines() if line.startswith("error: ")]
    assert run.returncode != 0 and len(errors) == 1 and "--packing joins rows into one sequence" in errors[0], \
        run.output[-3000:]
    assert "model: loading the weights" not in run.output and not (tmp_path / "out" / "run.json").exists()
    assert_no_traceback_of_ours(run.output)
    assert_the_refusal_ends_the_output(run.output, errors[0])


@pytest.mark.parametrize("flags, refusal", [
    (["--batch-size", "auto"], "--batch-size auto is planned for rows"),
    (["--beta", "0"], "--beta must be > 0"),
])
def test_the_same_checks_refuse_the_other_flags(tmp_path, flags, refusal):
    """The launch above shows a refusal reaching the end of the launcher's output; these are the same checks,
    run as the recipe runs them (dpo.py settles as LoRA)."""
    args = parse_args(recipe_flags("dpo"), ["--max-steps", "1", "--output-dir", str(tmp_path / "out"), *flags])
    with launched_with("ddp", 2), pytest.raises(Refusal, match=re.escape(refusal)):
        settle.settle_launch(args, "lora")


def test_check_config_answers_for_the_preference_recipes():
    """scripts/check_config.py --recipe dpo / dpo_full: the checks those recipes run, under the settings they
    settle as (LoRA, QLoRA with --bits, full tuning), and the refusals of pairs."""
    sys.path.insert(0, str(REPO / "scripts"))
    import check_config

    verdict = check_config.check(CONFIGS / "sp.yaml", "dpo_full", num_processes=4, on_gpu=True)[-1]
    assert verdict.startswith("ok: dpo_full runs as zero3 x 2-way sequence parallel on 4 process(es)"), verdict
    assert check_config.check(CONFIGS / "zero3.yaml", "dpo", ["--bits", "4"], num_processes=2,
                              on_gpu=False)[-1].startswith("ok: dpo runs as zero3")
    with pytest.raises(Refusal, match="a preference pair is scored as two whole rows"):
        check_config.check(CONFIGS / "fsdp.yaml", "dpo", ["--packing"], num_processes=2, on_gpu=False)
    with pytest.raises(Refusal, match="dpo_full.py does not run pipeline stages"):
        check_config.check(CONFIGS / "pipeline.yaml", "dpo_full", ["--pipeline-stages", "2"], on_gpu=True)


def test_full_tuning_reads_its_reference_scores_back_on_a_rerun(trained, tmp_path):
    first = trained("dpo_full", "zero3")
    assert first.returncode == 0, first.output[-3000:]
    again = launch("dpo_full", tmp_path / "again", *run_args("dpo_full", 2), config="zero3")
    assert again.returncode == 0, again.output[-3000:]
    assert "pairs' scores read from" in again.output and "scored by the model as loaded, before training" not in again.output
    assert curve(again, "loss") == curve(first, "loss")


def test_the_fully_tuned_model_reloads_with_plain_transformers(trained):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run = trained("dpo_full", "zero3")
    assert run.returncode == 0, run.output[-3000:]
    probe = load_file(str(run.output_dir / "probe_logits.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(run.output_dir / "model")
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"]).logits
    mask = probe["attention_mask"].bool()
    assert torch.allclose(logits[mask], probe["logits"][mask], atol=1e-4)


@long_test
@pytest.mark.parametrize("recipe, config", [("dpo", "tp"), ("dpo_full", "tp"), ("dpo_full", "fsdp_tp")])
def test_tensor_parallel_gives_the_one_process_curve(recipe, config, tmp_path):
    """tp.yaml on 2 processes (one tensor-parallel group: the whole batch on each), and fsdp_tp.yaml on 4 (2 FSDP
    shards x 2-way tensor parallel: 2 pairs a group), against one process with 4 pairs a step."""
    flags = ["--max-steps", "3", "--grad-accum", "1"]
    flags += ["--lr", "1e-3"] if recipe == "dpo_full" else ["--lr", "5e-3", "--lora-dropout", "0", "--lora-targets",
                                                           "q_proj,k_proj,v_proj,gate_proj,up_proj"]
    mesh = (("--parallelism_config_tp_size", "2") if config == "tp" else
            ("--parallelism_config_tp_size", "2", "--parallelism_config_dp_shard_size", "2"))
    split = launch(recipe, tmp_path / config, *flags, "--batch-size", "4" if config == "tp" else "2", config=config,
                   processes=2 if config == "tp" else 4, launcher_args=mesh)
    one = launch(recipe, tmp_path / "one", *flags, "--batch-size", "4", processes=1)
    assert split.returncode == one.returncode == 0, split.output[-3000:]
    assert max_relative_difference(curve(one, "loss"), curve(split, "loss")) <= 1e-5
