"""A loss edit that needs the whole row: per-token weights from the collator (`PadToLongest(..., weights=f)`,
`f` a function of a whole row), carried in the batch like the labels, and handed to `token_losses` for exactly
the targets it scores: the loss head's chunks, pipeline parallel's last stage, each rank's slice under
sequence parallel, evaluation.

The edit trained is docs/architecture.md's: the last half of each reply counts 2x. In a copied lora.py its
first step's loss (before any update) equals a plain computation here (transformers' logits of each whole row,
the rule applied to the row's labels, summed and divided by the target tokens), under one process, DDP, FSDP2,
ZeRO-3, pipeline parallel and sequence parallel; each strategy's next step and eval_loss follow one process's.
The copy also cuts the loss into chunks of a few positions (the bundled model's logits fit one chunk), so that
a reply straddles chunks as it does on a real model."""

from __future__ import annotations

import functools
import json
import sys

import pytest
import torch

import chat_fixtures
from conftest import REPO, TINY_MODEL, long_test
from strategies import CPU_STRATEGIES, matrix_args
from test_recipes_read_well import launch_edited_copy

sys.path.insert(0, str(REPO / "recipes"))

from common.data import tokens  # noqa: E402
from common.data.batches import IGNORE, PadToLongest, SequenceSlice, WithTargetPositions, target_weights  # noqa: E402
from common.model import modeling  # noqa: E402
from common.model.loss_head import LossHead  # noqa: E402
from common.training.evaluation import batch_figures, evaluate  # noqa: E402
from common.training.pipeline import pad_micro_batch  # noqa: E402

RECIPES = ("full", "lora", "qlora")

# The user's edit, as docs/architecture.md shows it: a function of the whole row, given to the collator.
LAST_HALF_TWICE = '''def last_half_twice(row):
    """One weight per label: 2 over the last half of each reply (a run of targets), 1 elsewhere."""
    weights, start = [1.0] * len(row["labels"]), None
    for i, label in enumerate([*row["labels"], batches.IGNORE]):  # (the extra IGNORE ends the last reply)
        if label != batches.IGNORE and start is None:
            start = i
        elif label == batches.IGNORE and start is not None:  # a reply ran from start to i
            middle = (start + i) // 2
            weights[middle:i] = [2.0] * (i - middle)
            start = None
    return weights
'''
WEIGHTED_COLLATOR = "    collate = batches.PadToLongest(tokenizer.pad_token_id, weights=last_half_twice)\n"

# The bundled model's logits at 8 rows of a micro-batch (4 on 2 data-parallel ranks): one or three positions a chunk
SMALL_CHUNKS = 12 * 304 * 4
SMALL_CHUNKS_EDIT = (
    "    head = loss_head.settle(accelerator, model, stages)\n",
    "    head = loss_head.settle(accelerator, model, stages)\n"
    f"    head = loss_head.LossHead(**{{**vars(head), 'chunk_bytes': {SMALL_CHUNKS}}})  # the test's small chunks\n"
    "    if stages and stages.head:\n"
    f"        stages.head = loss_head.LossHead(**{{**vars(stages.head), 'chunk_bytes': {SMALL_CHUNKS}}})\n",
)


WEIGHTED_COPY = [("def parse_args():\n", LAST_HALF_TWICE + "\n\ndef parse_args():\n"),
                 ("    collate = batches.PadToLongest(tokenizer.pad_token_id)\n", WEIGHTED_COLLATOR), SMALL_CHUNKS_EDIT]
TRAIN_ROWS, TRAIN_SEED = 16, 21  # one global batch of the matrix's flags: step 1 is every row, in any order


def reply_tail_weights(labels: torch.Tensor) -> torch.Tensor:
    """The rule computed apart, on a row's labels: in each run of targets [s, e), labels from s + (e - s) // 2 on
    weigh 2, every other label 1."""
    none = torch.zeros(1, dtype=torch.int)
    edges = torch.diff((labels != IGNORE).int(), prepend=none, append=none)  # 1 where a run starts, -1 after it ends
    weights = torch.ones(len(labels))
    for start, end in zip((edges == 1).nonzero().flatten().tolist(), (edges == -1).nonzero().flatten().tolist()):
        weights[start + (end - start) // 2:end] = 2.0
    return weights


# --- the collator, the slices, the pipeline's padding, the loss head --------------------------------


def chat_row_tokens(count: int, seed: int) -> list[dict]:
    """Multi-turn chat rows (several replies a row), tokenised as the recipes tokenise them."""
    import datasets

    tokenizer = modeling.load_tokenizer(str(TINY_MODEL))
    tokenised = tokens.tokenize_counted(datasets.Dataset.from_list(chat_fixtures.chat_rows(count, seed)), tokenizer,
                                        1 << 16)[0]
    assert not any(tokenised["dropped"])
    return [{"input_ids": row["input_ids"], "labels": row["labels"]} for row in tokenised]


def rule_weights(row):
    return reply_tail_weights(torch.tensor(row["labels"])).tolist()


def target_count(rows) -> int:
    return sum(sum(label != IGNORE for label in row["labels"][1:]) for row in rows)


def test_the_documented_edit_is_the_one_trained_here():
    """docs/architecture.md shows the function and the collator line this file's copies train."""
    text = (REPO / "docs" / "architecture.md").read_text()
    assert LAST_HALF_TWICE in text and WEIGHTED_COLLATOR.strip() in text


def test_the_collator_lays_the_weights_out_like_the_labels():
    rows = chat_row_tokens(5, seed=3)
    plain = PadToLongest(pad_token_id=3)(rows)
    weighted = PadToLongest(pad_token_id=3, weights=rule_weights)(rows)
    assert "loss_weights" not in plain  # without weights= nothing changes
    assert {key: value.tolist() for key, value in plain.items()} == \
        {key: value.tolist() for key, value in weighted.items() if key != "loss_weights"}
    assert weighted["loss_weights"].dtype == torch.float32
    for row, padded in zip(rows, weighted["loss_weights"]):
        assert padded.tolist() == rule_weights(row) + [0.0] * (len(padded) - len(row["labels"]))
    assert (weighted["loss_weights"] == 2).sum() > 0 and len({len(row["labels"]) for row in rows}) > 1
    with pytest.raises(ValueError, match="one weight per label"):
        PadToLongest(pad_token_id=3, weights=lambda row: [1.0])(rows)


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("packed", [False, True])
def test_each_slice_carries_the_weights_of_its_own_targets(size, packed):
    """Side by side, the sequence parallel slices' target weights are the whole batch's, each at its target."""
    rows = chat_row_tokens(4, seed=5)
    if packed:  # two rows end to end, position ids restarting at the second
        rows = [{"input_ids": a["input_ids"] + b["input_ids"], "labels": a["labels"] + b["labels"],
                 "position_ids": list(range(len(a["labels"]))) + list(range(len(b["labels"])))}
                for a, b in zip(rows[::2], rows[1::2])]
    collate = WithTargetPositions(PadToLongest(pad_token_id=3, weights=rule_weights))
    whole = collate(rows)
    slices = [SequenceSlice(collate, rank, size)(rows) for rank in range(size)]
    length = whole["labels"].shape[1]
    for piece in slices:
        assert piece["loss_weights"].shape == piece["labels"].shape
    weights = torch.cat([target_weights(piece["loss_weights"]) for piece in slices], 1)
    assert torch.equal(weights[:, :length - 1], target_weights(whole["loss_weights"]))
    assert (weights[:, length - 1:] == 0).all()


def test_a_pipeline_pads_the_weights_with_the_labels():
    batch = PadToLongest(pad_token_id=3, weights=rule_weights)(chat_row_tokens(3, seed=7))
    padded = pad_micro_batch(batch, batch["input_ids"].shape[1] + 5, pad_token_id=3)
    assert padded["loss_weights"].shape == padded["labels"].shape
    assert torch.equal(padded["loss_weights"][:, :-5], batch["loss_weights"])
    assert (padded["loss_weights"][:, -5:] == 0).all()


def token_losses(logits, targets, weights=None):  # the recipes' loss
    losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE,
                                               reduction="none").view_as(targets)
    return losses if weights is None else losses * weights


def tiny_llama():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(TINY_MODEL), dtype=torch.float32)


def plain_losses_and_gradients(model, rows, gradients: bool = True) -> tuple[torch.Tensor, dict]:
    """Each whole row alone: its whole logits, the rule from its labels; the weighted losses' sum and gradient."""
    model.zero_grad()
    total = torch.zeros(())
    for row in rows:
        ids, labels = torch.tensor([row["input_ids"]]), torch.tensor([row["labels"]])
        logits = model(input_ids=ids).logits[:, :-1]
        total = total + token_losses(logits, labels[:, 1:], reply_tail_weights(labels[0])[None, 1:]).sum()
    if not gradients:
        return total, {}
    total.backward()
    return total.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("gathered", [False, True])
def test_the_loss_heads_chunks_get_their_own_weights(gathered):
    """Chunks of 3 positions (and the gathered head's forward and backward passes): the weighted loss and every
    gradient equal each whole row's, computed alone."""
    from contextlib import nullcontext

    model = tiny_llama()
    model.lm_head.requires_grad_(not gathered)  # (the gathered head is a frozen one: LoRA's under ZeRO-3)
    rows = chat_row_tokens(4, seed=9)
    batch = WithTargetPositions(PadToLongest(pad_token_id=3, weights=rule_weights))(rows)
    targets, positions = batch["labels"][:, 1:], batch["target_positions"]
    head = LossHead(model.lm_head, None, gathered=nullcontext if gathered else None, chunk_bytes=3 * 4 * 304 * 4)
    model.zero_grad()
    outputs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    **head.forward_arguments(positions))
    chunked = head.apply(token_losses, outputs, targets, positions, target_weights(batch["loss_weights"])).sum()
    chunked.backward()
    chunked_gradients = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    plain, gradients = plain_losses_and_gradients(model, rows)
    torch.testing.assert_close(chunked.detach(), plain, rtol=1e-6, atol=0)
    for name, gradient in gradients.items():  # (padded rows in a batch against each row alone: ~2e-7 measured)
        assert (chunked_gradients[name] - gradient).abs().max() <= 1e-5 * gradient.abs().max(), name


def test_evaluation_scores_the_weighted_loss():
    """eval_loss: the weighted losses over the target tokens, in evaluate's chunks and in the pipeline's figures."""
    model = tiny_llama()
    rows = chat_row_tokens(6, seed=11)
    loader = [WithTargetPositions(PadToLongest(pad_token_id=3, weights=rule_weights))(rows[i:i + 3]) for i in (0, 3)]
    with torch.no_grad():
        plain, _ = plain_losses_and_gradients(model, rows, gradients=False)

    class OneProcess:
        @staticmethod
        def gather_for_metrics(tensor):
            return tensor

    head = LossHead(model.lm_head, None, chunk_bytes=3 * 3 * 304 * 4)
    figures = evaluate(OneProcess(), model, loader, token_losses, head, stages=None)
    assert figures["eval_loss"] == pytest.approx(plain.item() / target_count(rows), rel=1e-6)
    with torch.no_grad():  # the pipeline's: the last stage's logits of a batch
        sums = sum(batch_figures(model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits,
                                 b["labels"][:, 1:], token_losses, target_weights(b["loss_weights"])) for b in loader)
    assert sums[0] / sums[1] == pytest.approx(plain.item() / target_count(rows), rel=1e-6)


# --- launches: the edit in a copied recipe --------------------------------------------------------


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    """Chat rows to train (TRAIN_ROWS) and 8 to evaluate."""
    folder = tmp_path_factory.mktemp("chat")
    for name, count, seed in (("train", TRAIN_ROWS, TRAIN_SEED), ("eval", 8, TRAIN_SEED + 1)):
        with open(folder / f"{name}.jsonl", "w") as file:
            file.writelines(json.dumps(row) + "\n" for row in chat_fixtures.chat_rows(count, seed))
    return folder


@functools.lru_cache(maxsize=None)
def plain_first_loss(quantized: bool = False) -> float:
    """Step 1's loss as plain code computes it: the bundled model (LoRA starts as the base model; QLoRA as the base
    quantised as transformers quantises it), each whole row's logits, the rule on its labels, the weighted losses
    summed over the training rows and divided by their target tokens."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    rows = chat_row_tokens(TRAIN_ROWS, TRAIN_SEED)
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=torch.float32) if quantized else None
    model = AutoModelForCausalLM.from_pretrained(str(TINY_MODEL), dtype=torch.float32, quantization_config=quantization)
    with torch.no_grad():
        total, _ = plain_losses_and_gradients(model, rows, gradients=False)
    return total.item() / target_count(rows)


def weighted_launch(chat_data, tmp_path, config: str, recipe: str = "lora", steps: int = 2):
    flags = (matrix_args(recipe, "model_parallel") + ["--pipeline-stages", "2"] if config == "pipeline"
             else matrix_args(recipe, config))
    flags += ["--dataset", str(chat_data / "train.jsonl"), "--eval-dataset", str(chat_data / "eval.jsonl")]
    processes = 2 if config == "pipeline" else CPU_STRATEGIES[config][1]
    return launch_edited_copy(WEIGHTED_COPY, tmp_path / "out", steps=steps, config=config, recipe=recipe,
                              flags=flags, processes=processes)


@pytest.fixture(scope="module")
def one_process(chat_data, tmp_path_factory):
    return weighted_launch(chat_data, tmp_path_factory.mktemp("one-process"), "model_parallel")


def test_one_process_trains_the_whole_row_weights(one_process):
    assert one_process.losses()[0] == pytest.approx(plain_first_loss(), rel=1e-5)
    assert one_process.run_json()["loss_path"] == "chunked over the last hidden states"


@pytest.mark.parametrize("config", [pytest.param("ddp", marks=long_test), pytest.param("fsdp", marks=long_test),
                                    pytest.param("zero3", marks=long_test), pytest.param("pipeline", marks=long_test),
                                    pytest.param("sp", marks=long_test)])
def test_every_strategy_trains_the_whole_row_weights(config, one_process, chat_data, tmp_path):
    """Step 1's loss is the plain computation's; step 2's loss and gradient norm (after an update from the
    weighted gradient) and the final eval_loss are one process's."""
    run = weighted_launch(chat_data, tmp_path, config)
    assert run.losses()[0] == pytest.approx(plain_first_loss(), rel=1e-5)
    for mine, reference in zip(run.metrics(), one_process.metrics(), strict=True):
        assert mine["loss"] == pytest.approx(reference["loss"], rel=1e-5)
        assert mine["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
    (evaluated,), (reference,) = run.metrics("eval"), one_process.metrics("eval")
    assert evaluated["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-5)


@pytest.mark.parametrize("recipe", [pytest.param("full", marks=long_test), pytest.param("qlora", marks=long_test)])
def test_full_and_qlora_train_the_whole_row_weights(recipe, chat_data, tmp_path):
    """The same edit in full.py and qlora.py, on 2 data-parallel processes: step 1's loss is the plain computation's
    (full tuning starts from the base model, QLoRA from the base quantised to 4 bits). The recipe's 4-bit base is
    not quite transformers' own quantisation here: 6e-6 apart on these rows without weights (one process and DDP
    alike), 1.3e-5 with them, hence 1e-4 for QLoRA; sequence parallel's weights one position off at each slice's
    edge moved the loss by 7e-4."""
    run = weighted_launch(chat_data, tmp_path, "ddp", recipe=recipe, steps=1)
    bound = 1e-4 if recipe == "qlora" else 1e-5
    assert run.losses()[0] == pytest.approx(plain_first_loss(quantized=recipe == "qlora"), rel=bound)


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_recipe_passes_the_weights_the_same_way(recipe):
    source = (REPO / "recipes" / f"{recipe}.py").read_text()
    for line in ("def token_losses(logits, targets, weights=None):",
                 "    return losses if weights is None else losses * weights",
                 '                    weights = batches.target_weights(batch.pop("loss_weights", None))',
                 "                    token_loss = head.apply(token_losses, outputs, targets, positions, weights)",
                 "    collate = batches.PadToLongest(tokenizer.pad_token_id)\n"):
        assert line in source, f"{recipe}.py lost `{line}`"
