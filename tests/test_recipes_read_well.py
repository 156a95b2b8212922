"""The recipes stay what users copy: documented flags match the real ones, the loop is
written out in each, and a copied recipe still runs."""

from __future__ import annotations

import argparse
import ast
import hashlib
import re
import sys
from pathlib import Path

import pytest

from conftest import REPO, launch, long_test
from strategies import CPU_STRATEGIES, STEPS, matrix_args

sys.path.insert(0, str(REPO / "recipes"))
from common.launching.args import recipe_flags  # noqa: E402

RECIPES = ["full", "lora", "qlora"]
ALL_RECIPES = [*RECIPES, "dpo", "dpo_full", "kto", "kto_full", "reward", "reward_full", "grpo", "grpo_full"]


def help_flags(recipe: str) -> set[str]:
    """The flags of the parser the recipe builds (`parse_args` in each recipe), in-process: running
    `--help` costs a start-up per recipe (the copied-recipe test below runs it once)."""
    source = (REPO / "recipes" / f"{recipe}.py").read_text()
    assert f'cli.recipe_flags("{recipe}", __doc__)' in source
    usage = recipe_flags(recipe, ast.get_docstring(ast.parse(source), clean=False)).format_usage()
    return set(re.findall(r"--[a-z][a-z0-9-]+", usage))


def docstring_flags(recipe: str) -> set[str]:
    source = (REPO / "recipes" / f"{recipe}.py").read_text()
    doc = source.split('"""')[1]
    listed = doc[doc.index("Flags:"):]
    return set(re.findall(r"--[a-z][a-z0-9-]+", listed))


@pytest.mark.parametrize("recipe", ALL_RECIPES)
def test_docstring_lists_exactly_the_real_flags(recipe):
    assert docstring_flags(recipe) == help_flags(recipe) - {"--help"}


@pytest.mark.parametrize("recipe", ALL_RECIPES)
def test_every_recipe_reads_in_at_most_300_lines(recipe):
    """A recipe is read top to bottom and copied whole: what nobody edits lives in recipes/common/."""
    assert len((REPO / "recipes" / f"{recipe}.py").read_text().splitlines()) <= 300


@pytest.mark.parametrize("recipe", ["grpo", "grpo_full"])
def test_the_grpo_loss_is_written_out_in_each_recipe(recipe):
    """What a copy of an online recipe edits stays in it, not in common/: the advantages, the per-token ratio and its
    clipping, the KL term, each --loss's normalisation, the reference's log-probabilities, and the loop."""
    source = (REPO / "recipes" / f"{recipe}.py").read_text()
    for piece in ("def advantages_of(", "def completion_losses(", "def share_of_step_loss(", "def completion_logps(",
                  "ratio = torch.exp(logps - old_logps)", "ratio.clamp(low, high)",
                  "kl = torch.exp(reference_logps - logps) - (reference_logps - logps) - 1",
                  'if run.loss == "grpo":', 'if run.loss == "dr_grpo":', 'if run.loss == "bnpo":',
                  'b["reference_logps"] = completion_logps(', "advantages = advantages_of(",
                  "accelerator.accumulate(model)", "completion_losses(logps, old_logps,", "share_of_step_loss(losses,",
                  "accelerator.backward(", "clip_grad_norm_(", "optimizer.step()", "scheduler.step()"):
        assert piece in source, f"{recipe}.py lost `{piece}`"


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_loop_is_written_out_in_each_recipe(recipe):
    source = (REPO / "recipes" / f"{recipe}.py").read_text()
    for piece in ("accelerator.accumulate(model)", "accelerator.backward(", "clip_grad_norm(",
                  "optimizer.step()", "scheduler.step()", "optimizer.zero_grad()", "evaluate(",
                  "save_checkpoint(", "resume_from(", "def token_losses(", "torch.nn.functional.cross_entropy(",
                  "token_loss = head.apply(token_losses,", "evaluate(accelerator, model, eval_loader, token_losses, head, stages)",
                  "loss_sum / step_tokens"):
        assert piece in source, f"{recipe}.py lost `{piece}`"
    assert len(source.splitlines()) <= 300


def test_lora_differs_from_full_by_the_lora_lines_only():
    full = (REPO / "recipes" / "full.py").read_text().splitlines()
    lora = (REPO / "recipes" / "lora.py").read_text().splitlines()
    import difflib

    changed = [line for line in difflib.unified_diff(full, lora, lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert len(changed) <= 60, "\n".join(changed)


def launch_edited_copy(edits: list[tuple[str, str]], output_dir, steps: int, config: str = "model_parallel",
                       recipe: str = "lora", flags: list[str] | None = None, processes: int | None = None):
    """Copy `recipe` with `edits` (old, new) applied to the copy alone, and launch it with `flags` on `processes`
    (default: lora.py as the matrix launches it; `config` "pipeline": the one-process batch through 2 stages)."""
    source = (REPO / "recipes" / f"{recipe}.py").read_text()
    for old, new in edits:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    copy = REPO / "recipes" / f"my_edited_{recipe}_{output_dir.parent.name}.py"
    copy.write_text(source)
    try:
        if flags is None:
            flags = (matrix_args("lora", "model_parallel") + ["--pipeline-stages", "2"] if config == "pipeline"
                     else matrix_args("lora", config))
        if processes is None:
            processes = 2 if config == "pipeline" else CPU_STRATEGIES[config][1]
        run = launch(copy.stem, output_dir, *flags, "--max-steps", str(steps), config=config, processes=processes)
    finally:
        copy.unlink()
    assert run.returncode == 0, run.output[-3000:]
    # run.json and the model card name the copy, not the recipe it was copied from
    program = run.run_json()["program"]
    assert program["path"] == str(copy) and program["sha256"] == hashlib.sha256(source.encode()).hexdigest()
    assert program["git"] is None or program["git"]["program"] == "untracked"
    assert f"fine-tuned with {copy.name}" in (Path(output_dir) / "README.md").read_text()
    # and the start-up line says it is a copy, edited (the shipped recipe's own run says neither)
    assert (program["copy_of"], program["edited"]) == (f"recipes/{recipe}.py", bool(edits))
    assert f"{recipe} ({copy.name}, {'an edited' if edits else 'a'} copy of recipes/{recipe}.py): " in run.output
    return run


def test_a_copied_recipe_edited_in_its_loss_and_schedule_trains_on_the_edits(trained, tmp_path):
    """Weight every target token by 2 and hold the learning rate constant, in the copy alone: the
    first step's loss (before any update) is twice the untouched recipe's on the same batch, and
    the learning rate no longer follows the cosine."""
    run = launch_edited_copy([
        ("    return losses if weights is None else losses * weights",
         "    return 2.0 * (losses if weights is None else losses * weights)  # every target token counts twice"),
        ("from transformers import get_cosine_schedule_with_warmup", "from transformers import get_constant_schedule"),
        ("get_cosine_schedule_with_warmup(optimizer, int(run.warmup_ratio * total_steps), total_steps)",
         "get_constant_schedule(optimizer)"),
    ], tmp_path / "out", steps=3)
    reference = trained("lora", "model_parallel")
    assert "copy_of" not in reference.run_json()["program"]  # the shipped recipe is no copy
    assert run.losses()[0] == pytest.approx(2 * reference.losses()[0], rel=1e-6)
    flags = matrix_args("lora", "model_parallel")
    lr = float(flags[flags.index("--lr") + 1])
    assert [record["lr"] for record in run.metrics()] == [lr] * 3
    assert [record["lr"] for record in reference.metrics()[:3]] != [lr] * 3


DOUBLED_LOSS = ("    return losses if weights is None else losses * weights",
                "    return 2.0 * (losses if weights is None else losses * weights)  # every token twice")


@pytest.mark.parametrize("config", ["ddp", "zero3", *(pytest.param(config, marks=long_test) for config in ("fsdp", "pipeline", "sp"))])
def test_an_edited_loss_trains_under_every_strategy(config, trained, tmp_path):
    """The loss is written once, in the recipe's token_losses, and every path that trains uses it (the
    plain loop, ZeRO's engine, pipeline parallel's schedule, each rank's slice under sequence parallel):
    doubled in a copy, the first step's loss (before any update) is twice the one-process recipe's on the
    same global batch."""
    run = launch_edited_copy([DOUBLED_LOSS], tmp_path / "out", steps=1, config=config)
    assert run.losses()[0] == pytest.approx(2 * trained("lora", "model_parallel").losses()[0], rel=1e-5)


def test_evaluation_scores_with_the_recipes_loss():
    """eval_loss is the same quantity as the training loss: the recipe's token_losses, handed in."""
    import torch
    from common.training.evaluation import batch_figures
    from lora import token_losses

    torch.manual_seed(0)
    logits, labels = torch.randn(2, 5, 11), torch.tensor([[3, 1, -100, 4], [-100, -100, 2, 9]])
    plain = batch_figures(logits, labels, token_losses)
    doubled = batch_figures(logits, labels, lambda lg, tg: 2.0 * token_losses(lg, tg))
    assert doubled[0] == pytest.approx(2 * plain[0]) and plain[0] > 0
    assert doubled[1:].tolist() == plain[1:].tolist() == [5.0, plain[2].item(), 2.0]


def test_logits_chunked_at_target_positions_give_the_textbook_loss(trained, tmp_path):
    """The recipe's LM head runs only where some row has a target, a chunk of positions at a time over the
    last hidden states; a copy that computes every position's logits at once and the textbook shifted
    cross-entropy follows the same loss curve."""
    run = launch_edited_copy([
        ("outputs = model(**batch, use_cache=False, **head.forward_arguments(positions))",
         "outputs = model(**batch, use_cache=False)"),
        ("token_loss = head.apply(token_losses, outputs, targets, positions, weights)",
         "token_loss = token_losses(outputs.logits[:, :-1], labels[:, 1:])"),
    ], tmp_path / "out", steps=STEPS)
    assert run.losses() == pytest.approx(trained("lora", "model_parallel").losses(), rel=1e-5)
    assert trained("lora", "model_parallel").run_json()["loss_path"] == "chunked over the last hidden states"


def test_a_copied_recipe_edited_in_its_collator_trains_on_the_edit(trained, tmp_path):
    """A collator that also trains on the prompt, in the copy alone: step 1 scores more target
    tokens than the untouched recipe on the same rows, and its loss differs."""
    run = launch_edited_copy([(
        "    collate = batches.PadToLongest(tokenizer.pad_token_id)\n",
        "    pad = batches.PadToLongest(tokenizer.pad_token_id)\n\n"
        "    def collate(rows):  # train on the prompt too: every real token is a target\n"
        "        batch = pad(rows)\n"
        "        batch[\"labels\"] = batch[\"input_ids\"].masked_fill(batch[\"attention_mask\"] == 0, batches.IGNORE)\n"
        "        return batch\n",
    )], tmp_path / "out", steps=1)
    reference = trained("lora", "model_parallel").metrics()[0]
    edited = run.metrics()[0]
    assert edited["tokens"] > reference["tokens"]
    assert edited["loss"] != pytest.approx(reference["loss"], rel=1e-3)


@pytest.mark.parametrize("recipe", RECIPES)
def test_help_shows_every_default(recipe):
    parser = recipe_flags(recipe, "recipe\n")
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if action.option_strings and action.default not in (argparse.SUPPRESS, False, None):
            assert f"(default: {action.default})" in text or "default: " in (action.help or ""), action.option_strings
    assert "(default: 2e-05)" in text if recipe == "full" else "(default: 0.0002)" in text
