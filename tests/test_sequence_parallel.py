"""Sequence parallel (accelerate_configs/sp.yaml: DeepSpeed's ALST / Ulysses through accelerate's
ParallelismConfig): each sequence split over the ranks of a group trains the curve of one process, loss and
gradient norm, under ZeRO-1, 2 and 3; what it cannot split is refused in one line before the model loads.

The matrix (tests/strategies.py) launches sp.yaml with every recipe: its loss curve against one process
(test_equivalence), its resume (test_resume), its artifacts (test_matrix). Here: the gradient norms, the
ZeRO stages that divide the gradients differently, the data-parallel groups, rows of 15,000 tokens,
and the refusals."""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
from unittest import mock

import pytest
import torch
import yaml

from conftest import CONFIGS, REPO, TINY_MODEL, assert_the_refusal_ends_the_output, launch, long_test
from strategies import matrix_args
from test_preflight import launched_with

sys.path.insert(0, str(REPO / "recipes"))
sys.path.insert(0, str(REPO / "scripts"))

import check_config  # noqa: E402
from common.data.batches import IGNORE, PadToLongest, SequenceSlice, WithTargetPositions, target_tokens  # noqa: E402
from common.launching import settle  # noqa: E402
from common.launching.args import parse_args, recipe_flags  # noqa: E402
from common.launching.preflight import Refusal  # noqa: E402


def figures(run) -> list[tuple[float, float]]:
    return [(record["loss"], record["grad_norm"]) for record in run.metrics()]


def assert_same_curve(reference, other) -> None:
    assert reference.returncode == other.returncode == 0, other.output[-3000:]
    for (loss_a, norm_a), (loss_b, norm_b) in zip(figures(reference), figures(other), strict=True):
        assert abs(loss_a - loss_b) <= 1e-5 * abs(loss_a), (figures(reference), figures(other))
        assert abs(norm_a - norm_b) <= 1e-5 * abs(norm_a), (figures(reference), figures(other))


def sp_config(tmp_path, zero_stage: int = 3, **parallelism) -> str:
    """sp.yaml with another ZeRO stage or parallelism_config."""
    config = yaml.safe_load((CONFIGS / "sp.yaml").read_text())
    config["deepspeed_config"]["zero_stage"] = zero_stage
    if zero_stage != 3:
        del config["deepspeed_config"]["zero3_init_flag"]
    config["parallelism_config"].update(parallelism)
    path = tmp_path / f"sp_zero{zero_stage}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


# --- the slices ---------------------------------------------------------------------------------


def random_rows(count: int, seed: int, packed: bool = False) -> list[dict]:
    generator = random.Random(seed)
    rows = []
    for _ in range(count):
        length = generator.randint(1, 23)
        labels = [IGNORE if generator.random() < 0.3 else generator.randint(4, 300) for _ in range(length)]
        row = {"input_ids": [generator.randint(4, 300) for _ in range(length)], "labels": labels}
        if packed:
            cut = generator.randint(0, length)
            row["position_ids"] = list(range(cut)) + list(range(length - cut))
        rows.append(row)
    return rows


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("packed", [False, True])
def test_the_slices_of_a_batch_are_the_batch(size, packed):
    """Side by side, the ranks' slices hold the batch's tokens, its positions and every target once, each
    target at the position that predicts it; the padding added to divide the length is no target."""
    collate = WithTargetPositions(PadToLongest(pad_token_id=3))
    for seed in range(20):
        rows = random_rows(5, seed, packed)
        whole = collate(rows)
        slices = [SequenceSlice(collate, rank, size)(rows) for rank in range(size)]
        length = whole["input_ids"].shape[1]
        assert len({piece["input_ids"].shape[1] for piece in slices}) == 1
        ids = torch.cat([piece["input_ids"] for piece in slices], 1)
        assert ids.shape[1] % size == 0 and ids.shape[1] - length < size
        assert torch.equal(ids[:, :length], whole["input_ids"])
        positions = torch.cat([piece["position_ids"] for piece in slices], 1)
        expected = whole["position_ids"] if packed else torch.arange(length).expand(len(rows), length)
        assert torch.equal(positions[:, :length], expected)
        assert (positions[:, length:] > positions[:, length - 1:length]).all()  # the padding counts on
        targets = torch.cat([piece["labels"][:, 1:] for piece in slices], 1)
        assert torch.equal(targets[:, :length - 1], whole["labels"][:, 1:]) and (targets[:, length - 1:] == IGNORE).all()
        assert sum(int(target_tokens(piece)) for piece in slices) == int(target_tokens(whole))
        for piece in slices:
            assert "attention_mask" not in piece
            expected_positions = (piece["labels"][:, 1:] != IGNORE).any(0).nonzero().squeeze(1)
            assert torch.equal(piece["target_positions"], expected_positions)


@pytest.mark.parametrize("size", [2, 3])
def test_orpos_pair_batches_slice_their_sft_targets_as_labels(size):
    """ORPO's pairs (PadPairs with whole_chosen): the chosen rows' every token but the first is an SFT target, the
    rejected rows' none; the slices hold each of those targets once, at the position that predicts it, and the
    step counts the SFT targets."""
    from common.data.batches import PadPairs

    collate = WithTargetPositions(PadPairs(pad_token_id=3, whole_chosen=True))
    for seed in range(10):
        sides = random_rows(6, seed, packed=False)
        pairs = [{"chosen_input_ids": a["input_ids"], "chosen_labels": a["labels"], "rejected_input_ids": b["input_ids"],
                  "rejected_labels": b["labels"]} for a, b in zip(sides[:3], sides[3:])]
        whole = collate(pairs)
        for row, pair in enumerate(pairs):
            length = len(pair["chosen_input_ids"])
            assert whole["sft_labels"][row, :length].tolist() == pair["chosen_input_ids"]
            assert (whole["sft_labels"][row, length:] == IGNORE).all() and (whole["sft_labels"][3 + row] == IGNORE).all()
        assert int(target_tokens(whole)) == sum(len(pair["chosen_input_ids"]) - 1 for pair in pairs)
        slices = [SequenceSlice(collate, rank, size)(pairs) for rank in range(size)]
        length = whole["input_ids"].shape[1]
        sft = torch.cat([piece["sft_labels"][:, 1:] for piece in slices], 1)
        assert torch.equal(sft[:, :length - 1], whole["sft_labels"][:, 1:]) and (sft[:, length - 1:] == IGNORE).all()
        assert sum(int(target_tokens(piece)) for piece in slices) == int(target_tokens(whole))
        for piece in slices:  # the logits the loss needs: where a reply or an SFT target is
            wanted = ((piece["labels"][:, 1:] != IGNORE) | (piece["sft_labels"][:, 1:] != IGNORE)).any(0)
            assert torch.equal(piece["target_positions"], wanted.nonzero().squeeze(1))


# --- launches -----------------------------------------------------------------------------------


def test_sequence_parallel_keeps_the_gradient_norm(trained):
    """sp.yaml (ZeRO-3) against one process, with gradient accumulation: the gradient norms agree too."""
    assert_same_curve(trained("lora", "model_parallel"), trained("lora", "sp"))


@pytest.mark.parametrize("zero_stage", [pytest.param(1, marks=long_test), pytest.param(2, marks=long_test)])
def test_zero_1_and_2_give_the_gradient_of_one_process(zero_stage, trained, tmp_path):
    """ZeRO-1 and 2 divide the summed gradients by the data-parallel groups, not by every rank: without
    the accelerator's correction the gradient norm comes out twice one process's (Adam hides it in the loss)."""
    run = launch("lora", tmp_path / "out", *matrix_args("lora", "sp"), config=sp_config(tmp_path, zero_stage))
    assert f"zero{zero_stage} x 2-way sequence parallel" in run.output
    assert_same_curve(trained("lora", "model_parallel"), run)


@long_test
@pytest.mark.parametrize("zero_stage", [1, 3])
def test_two_groups_of_two(zero_stage, trained, tmp_path):
    """4 processes: 2 data-parallel groups x 2-way sequence parallel, the same global batch."""
    args = matrix_args("lora", "sp")
    args[args.index("--batch-size") + 1] = str(int(args[args.index("--batch-size") + 1]) // 2)
    run = launch("lora", tmp_path / "out", *args, config=sp_config(tmp_path, zero_stage), processes=4, timeout=900)
    assert "2 data-parallel group(s)" in run.output
    assert_same_curve(trained("lora", "model_parallel"), run)


@long_test
@pytest.mark.parametrize("flag", ["--gradient-checkpointing", "--use-dora"])
def test_recomputed_layers_and_dora_split_too(flag, tmp_path):
    """Checkpointed layers recompute their all-to-alls in the backward; DoRA's magnitudes see every rank's
    slice: both train the curve of one process."""
    common = ["--max-steps", "3", "--lora-dropout", "0", flag]
    one = launch("lora", tmp_path / "one", *common, config=None)
    split = launch("lora", tmp_path / "sp", *common, config="sp")
    assert_same_curve(one, split)


def long_rows(tmp_path, tokens_per_row: int = 15_000):
    """The bundled model (a context of 32,768) and plain-text rows of about `tokens_per_row` tokens."""
    words = ["sort", "copy", "reverse", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    generator = random.Random(0)
    data = tmp_path / "long.jsonl"
    with open(data, "w") as file:  # ~4.75 tokens a word with the bundled tokenizer
        for _ in range(6):
            file.write(json.dumps({"text": " ".join(generator.choice(words) for _ in range(tokens_per_row * 4 // 19))})
                       + "\n")
    return data


@long_test
def test_rows_of_sixteen_thousand_tokens(tmp_path):
    """README's command: --max-length 16384 under sp.yaml on 2 processes trains the curve of one process."""
    data = long_rows(tmp_path)
    common = ["--dataset", str(data), "--eval-dataset", str(data), "--max-length", "16384",
              "--batch-size", "1", "--grad-accum", "2", "--max-steps", "2", "--lora-dropout", "0"]
    one = launch("lora", tmp_path / "one", *common, timeout=900)
    split = launch("lora", tmp_path / "sp", *common, config="sp", timeout=900)
    assert_same_curve(one, split)
    assert min(record["tokens"] for record in split.metrics()) > 2 * 12_000


@long_test  # (tests/test_bad_input.py checks the refusal's place through the launcher in every run)
def test_a_refusal_ends_the_launch_output(tmp_path):
    run = launch("lora", tmp_path / "out", "--packing", config="sp")
    assert run.returncode != 0
    assert_the_refusal_ends_the_output(run.output, "error: --packing under sequence parallel needs flash_attention_2: "
                                       "sdpa runs the gathered sequence without a mask, so packed rows would attend "
                                       "to each other; drop --packing, or on GPUs set "
                                       "parallelism_config_sp_attn_implementation: flash_attention_2")


# --- refusals, in-process -------------------------------------------------------------------------


def settle_under(config: str, processes: int, recipe: str = "lora", argv=(), env=None):
    args = parse_args(recipe_flags(recipe), [*argv, "--output-dir", "/tmp/never-written"])
    with launched_with(config, processes), mock.patch.dict(os.environ, env or {}):
        return settle.settle_launch(args, recipe)


def test_sp_yaml_settles_as_zero3_with_two_groups():
    run, launch_ = settle_under("sp", 4)
    assert (launch_.sequence_parallel, launch_.data_parallel_size, launch_.zero_stage) == (2, 2, 3)
    assert launch_.name == "zero3 x 2-way sequence parallel" and run.attention == "sdpa"


def test_a_global_batch_splits_over_the_groups(capsys):
    """--global-batch-size counts the groups as the data-parallel processes: 4 processes in groups of 2 take
    8 rows a step as 2 groups x micro-batch 2 x accumulation 2, and the batch line says so."""
    run, _ = settle_under("sp", 4, argv=["--global-batch-size", "8", "--batch-size", "2"])
    assert run.grad_accum == 2
    assert ("batch: 2 per group of 2 processes x --grad-accum 2 x 2 group(s) = 8 sequences per step"
            in capsys.readouterr().out)


def test_the_files_attention_is_the_models():
    """The file's attention settles the run's; a file naming none gets the run's (accelerate cannot start
    without one)."""
    from common.launching.launch_config import settle_sequence_parallel
    from common.launching.settled import Run

    def settled(named: str, *argv: str):
        env = {"WORLD_SIZE": "2", "ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_SP_SIZE": "2",
               "PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION": named}
        run, _ = settle_sequence_parallel(env, Run.of(parse_args(recipe_flags("lora"), list(argv))))
        return run, env["PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION"]

    run, handed = settled("None", "--attention", "flash_attention_2")
    assert run.attention == handed == "flash_attention_2"
    run, handed = settled("flash_attention_2")
    assert run.attention == handed == "flash_attention_2" and "sp_attn_implementation" in run.settled_from["attention"]
    run, handed = settled("None")
    assert run.attention == handed == "sdpa"


@pytest.mark.parametrize("recipe, processes, argv, env, message", [
    ("lora", 2, ["--packing"], {}, "--packing under sequence parallel needs flash_attention_2"),
    ("lora", 2, ["--attention", "eager"], {}, "--attention eager but parallelism_config_sp_attn_implementation sdpa"),
    ("lora", 2, [], {"PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION": "eager"}, "sequence parallel cannot split eager"),
    ("lora", 3, [], {}, "parallelism_config_sp_size 2 does not divide the 3 processes"),
    ("lora", 4, [], {"PARALLELISM_CONFIG_DP_SHARD_SIZE": "4"}, "dp_shard_size 4 x sp_size 2 is not the 4 processes"),
    ("lora", 2, [], {"PARALLELISM_CONFIG_SP_BACKEND": "ring"}, "parallelism_config_sp_backend 'ring'"),
    ("lora", 2, ["--pipeline-stages", "2"], {}, "--pipeline-stages runs on a plain multi-process launch"),
])
def test_what_sequence_parallel_cannot_split_is_refused(recipe, processes, argv, env, message):
    with pytest.raises(Refusal) as refusal:
        settle_under("sp", processes, recipe, argv, env)
    assert message in str(refusal.value), refusal.value


@pytest.mark.parametrize("size, message", [(4, "has 6; set parallelism_config_sp_size to 3 or 6"),
                                           (2, "splits the key-value heads, but")])
def test_heads_that_do_not_divide_are_refused(size, message, tmp_path):
    model = tmp_path / "six-heads"
    shutil.copytree(TINY_MODEL, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_attention_heads": 6, "num_key_value_heads": 3,
                                                   "head_dim": 16}))
    with pytest.raises(Refusal, match=message):
        settle_under("sp", 4, argv=["--model", str(model)], env={"PARALLELISM_CONFIG_SP_SIZE": str(size)})


def test_sequence_parallel_outside_deepspeed_is_refused():
    with pytest.raises(Refusal, match="runs under DeepSpeed .* use accelerate_configs/sp.yaml"):
        settle_under("fsdp", 2, env={"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_SP_SIZE": "2"})


def test_check_config_names_the_split():
    verdict = check_config.check(CONFIGS / "sp.yaml", "lora", num_processes=4, on_gpu=True)[-1]
    assert verdict.startswith("ok: lora runs as zero3 x 2-way sequence parallel on 4 process(es)"), verdict


# --- the planner ----------------------------------------------------------------------------------


def test_the_planner_names_sequence_parallel_where_only_it_fits_without_recomputing():
    """`plan.py --seq-len 65536` for an 8B model on 8 x 80 GB: every other config runs only with gradient
    checkpointing (or not at all); sp.yaml splits each row over a group and is the fastest. At 1,024 tokens
    it is never the pick (its all-to-alls and its gathers serve 1/group of the tokens)."""
    import planner

    shape = planner.load_shape("llama-3.1-8b")
    long = planner.plan(shape, "lora", 8, 80, batch_size=1, seq_len=65536, global_batch=8)
    pick = long["recommendation"]["fastest"]
    assert pick["strategy"] == "sp" and pick["config"] == "accelerate_configs/sp.yaml"
    assert pick["sequence_parallel"] in planner.sequence_layouts(8, shape) and not pick["gradient_checkpointing"]
    others = [entry["run"] for entry in long["strategies"] if entry["strategy"] != "sp" and entry["run"]]
    assert others and all(run["gradient_checkpointing"] for run in others)
    short = planner.plan(shape, "lora", 8, 80, batch_size=1, seq_len=1024, global_batch=8)
    assert short["recommendation"]["fastest"]["strategy"] != "sp"
    # preference pairs: two rows in each forward, the same split; dpo_full's reference pass scores whole rows on
    # every GPU, as zero3's does
    pairs = planner.plan(shape, "lora", 8, 80, batch_size=1, seq_len=32768, global_batch=4, pairs=True)
    assert pairs["recommendation"]["fastest"]["strategy"] == "sp"
    machine = planner.Machine.of("h100")
    assert (planner.reference_pass_time(shape, "sp", 8, machine, 1000, 4096)
            == planner.reference_pass_time(shape, "zero3", 8, machine, 1000, 4096))


def test_a_rank_of_a_group_plans_a_slice_of_the_rows():
    """sp's memory is zero3's at seq / group: the weights, gradients and optimizer sharded over all the GPUs,
    the activations of each rank's slice; the groups are its data-parallel processes."""
    import planner

    shape = planner.load_shape("llama-3.1-8b")
    for group in (2, 4, 8):
        split = planner.per_gpu_bytes(shape, "lora", "sp", 8, 1, 32768, sequence_parallel=group)
        assert split == planner.per_gpu_bytes(shape, "lora", "zero3", 8, 1, 32768 // group)
        assert planner.data_parallel_size("sp", 8, sequence_parallel=group) == 8 // group
    assert planner.sequence_layouts(8, shape) == [2, 4, 8]  # 32 heads, 8 key-value heads
    assert planner.sequence_layouts(16, planner.load_shape("tiny-llama")) == [2, 4]  # 4 heads
    assert planner.impossible("lora", "sp", 1, shape)
    assert "sp" in planner.offered_strategies("lora", 8, shape, pairs=True)  # (the preference recipes split rows too)


def test_plan_py_launches_the_group_it_planned():
    import subprocess

    done = subprocess.run([sys.executable, str(REPO / "scripts" / "plan.py"), "--model", "llama-3.1-8b", "--gpus",
                           "8", "--gpu", "h100", "--seq-len", "65536", "--batch-size", "1", "--global-batch-size",
                           "8"], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    # sp is faster by the estimate but has not run on a GPU: named beside the tested first pick, with its own line
    sp_line = next(line for line in done.stdout.splitlines()
                   if line.strip().startswith(("Launch: ", "or: ")) and "sp.yaml" in line)
    assert "--config_file accelerate_configs/sp.yaml --num_processes 8 --parallelism_config_sp_size 8" in sp_line
    assert "sp (accelerate_configs/sp.yaml)" in done.stdout and "it has not run on a GPU" in done.stdout
