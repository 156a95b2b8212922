"""What a training step needs to know of its batch comes from the collator, on the CPU: the positions with a
target (from the labels the collator gave, an edited collator's too), and, where no row is padded, no
attention mask (the model's plain causal attention, the same logits as an all-ones mask)."""

from __future__ import annotations

import sys

import torch

from conftest import REPO, launch

sys.path.insert(0, str(REPO / "recipes"))

from common.data.batches import IGNORE, PadToLongest, WithTargetPositions, make_loaders  # noqa: E402


def rows(lengths, prompt: int = 3):
    return [{"input_ids": list(range(4, 4 + n)), "labels": [IGNORE] * prompt + list(range(4 + prompt, 4 + n))}
            for n in lengths]


def test_target_positions_come_from_the_labels_the_collator_gave():
    pad = PadToLongest(pad_token_id=3)
    batch = WithTargetPositions(pad)(rows([6, 9]))
    # targets are labels shifted by one: position t predicts token t + 1; prompt (3) and padding carry none
    assert batch["target_positions"].tolist() == list(range(2, 8))

    def prompt_too(batch_rows):  # an edited collator that also trains on the prompt
        batch = pad(batch_rows)
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE)
        return batch

    assert WithTargetPositions(prompt_too)(rows([6, 9]))["target_positions"].tolist() == list(range(0, 8))


def test_an_unpadded_training_batch_comes_without_a_mask_and_the_model_computes_the_same():
    from transformers import LlamaConfig, LlamaForCausalLM

    train, evaluation = make_loaders(rows([8, 8, 8, 8]), rows([8, 8]), PadToLongest(3), batch_size=2, workers=0)
    unpadded = next(iter(train))
    assert "attention_mask" not in unpadded and "target_positions" in unpadded
    assert "attention_mask" in next(iter(evaluation))  # evaluation's batches keep theirs (the probe is saved with it)
    padded = next(iter(make_loaders(rows([5, 8]), rows([8]), PadToLongest(3), batch_size=2, workers=0)[0]))
    assert padded["attention_mask"].tolist()[0] in ([1] * 5 + [0] * 3, [1] * 8)
    assert "attention_mask" in padded

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    ids = unpadded["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits,
                                   model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits)


def test_the_steps_line_says_how_epochs_and_the_batch_give_the_step_count(tmp_path):
    """38 training rows (40, 2 held out), 8 a process on 2 processes: 2 steps an epoch, 6 rows left out of
    each; --epochs 3 gives 6 steps, and the run says so before it trains, as it then runs."""
    rows = (REPO / "data" / "train.jsonl").read_text().splitlines()[:40]
    (tmp_path / "rows.jsonl").write_text("\n".join(rows) + "\n")
    run = launch("lora", tmp_path / "out", "--dataset", str(tmp_path / "rows.jsonl"), "--epochs", "3",
                 "--batch-size", "8", "--eval-every", "0", config="ddp")
    assert run.returncode == 0, run.output[-3000:]
    lines = [line for line in run.output.splitlines() if line.startswith("steps: ")]
    assert lines == ["steps: 6 = --epochs 3 x 2 steps of 16 rows (--batch-size 8 x --grad-accum 1 x 2 processes) "
                     "over 38 training rows; the 6 that do not fill a step sit out each epoch (each shuffles anew)"]
    assert [record["step"] for record in run.metrics()] == list(range(1, 7))
    assert run.run_json()["total_steps"] == 6
