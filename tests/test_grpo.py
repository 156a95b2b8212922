"""recipes/grpo.py: equal to TRL's GRPOTrainer and RLOOTrainer given the same completions; every strategy equal
to one process, the same completions sampled on any process count; a checkpoint that continues the curve, also on
another strategy and count; rewards from the user's file, each failure one line; the sampler draws from the
distribution it is given."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from collections import Counter

import pytest

from conftest import LONG_TESTS, REPO, TINY_MODEL, assert_the_refusal_ends_the_output, launch, long_test

sys.path.insert(0, str(REPO / "recipes"))

from common import rewards  # noqa: E402
from common.launching import preflight, settle  # noqa: E402
from common.launching.args import parse_args, recipe_flags  # noqa: E402
from common.launching.launch import DDP, DEEPSPEED, TENSOR_PARALLEL, Launch  # noqa: E402
from common.training.online import evaluation_chunk  # noqa: E402
from common.refusal import Refusal  # noqa: E402

PROMPTS = 4
SIMILARITY = f"{REPO / 'recipes' / 'rewards.py'}:answer_similarity"  # partial credit: the tiny model earns some


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    """Four sort prompts of the bundled task with their answers (a step's batch holds all of them)."""
    import random

    draw = random.Random(0)
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    with open(path, "w") as file:
        for _ in range(PROMPTS):
            digits = draw.sample("0123456789", 3)
            file.write(json.dumps({"prompt": f"### Instruction:\nSort: {' '.join(digits)}\n\n### Response:\n",
                                   "answer": " ".join(sorted(digits))}) + "\n")
    return path


def flags(prompts, *more: str) -> list[str]:
    return ["--dataset", str(prompts), "--eval-dataset", str(prompts), "--reward", SIMILARITY, "--num-generations", "4",
            "--max-completion-length", "8", "--lr", "5e-3", "--warmup-ratio", "0", *more]


def train_records(output_dir) -> list[dict]:
    return [record for record in map(json.loads, (output_dir / "metrics.jsonl").read_text().splitlines())
            if record["type"] == "train"]


# --- TRL's trainers on the same completions -------------------------------------------------------------------------

TRL_CASES = [
    # every run: DAPO (TRL's default loss) with the KL term, two steps per batch and DAPO's clip-higher, GA 2
    pytest.param("dapo", ["--batch-size", "8", "--grad-accum", "2", "--beta", "0.1", "--num-iterations", "2",
                          "--epsilon-high", "0.28", "--max-steps", "4"], id="dapo-beta-iterations"),
    pytest.param("rloo", ["--batch-size", "8", "--grad-accum", "2", "--max-steps", "3"], id="rloo", marks=long_test),
    pytest.param("grpo", ["--batch-size", "8", "--grad-accum", "2", "--max-steps", "3", "--mask-truncated-completions"],
                 id="grpo-masked", marks=long_test),
    pytest.param("dr_grpo", ["--batch-size", "8", "--grad-accum", "2", "--max-steps", "3", "--scale-rewards", "batch"],
                 id="dr_grpo", marks=long_test),
    # a mean per micro-batch: the same micro-batches on both sides only when one holds the whole batch
    pytest.param("bnpo", ["--batch-size", "16", "--max-steps", "3", "--scale-rewards", "none"], id="bnpo",
                 marks=long_test),
    pytest.param("rloo", ["--batch-size", "16", "--max-steps", "4", "--normalize-advantages", "--num-iterations", "2"],
                 id="rloo-normalized", marks=long_test),
    pytest.param("rloo", ["--batch-size", "8", "--grad-accum", "2", "--max-steps", "3", "--mask-truncated-completions"],
                 id="rloo-masked", marks=long_test),
]


TRL_CASES += [  # every weight (grpo_full.py): the reference is the weights as loaded (TRL: a second model)
    pytest.param("dapo", ["--batch-size", "8", "--grad-accum", "2", "--num-iterations", "2", "--max-steps", "4",
                          "--lr", "1e-3", "--beta", "0.1", "--full"], id="full-dapo-beta-iterations", marks=long_test),
    pytest.param("rloo", ["--batch-size", "8", "--grad-accum", "2", "--max-steps", "3", "--lr", "1e-3", "--full"],
                 id="full-rloo", marks=long_test),
    pytest.param("grpo", ["--batch-size", "8", "--grad-accum", "2", "--max-steps", "3", "--lr", "1e-3", "--full"],
                 id="full-grpo", marks=long_test),
]


@pytest.mark.parametrize("loss, more", TRL_CASES)
def test_the_steps_equal_trls_on_the_same_completions(prompts, tmp_path, loss, more):
    """Loss, gradient norm and reward of each step equal TRL's (fp32, CPU, one process): the same prompts, the
    completions the recipe's sampler draws (the worker hands TRL the same ones), the same rewards. Several steps:
    after the first, both sample from their own updated model."""
    full = "--full" in more
    given = flags(prompts, "--loss", loss, "--samples-every", "0", *[flag for flag in more if flag != "--full"])
    ours = launch("grpo_full" if full else "grpo", tmp_path / "ours", *given, processes=1)
    assert ours.returncode == 0, ours.output[-3000:]
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "measure" / "trl_grpo_worker.py"), "--output-dir",
                           str(tmp_path / "trl"), *given, *(["--full"] if full else [])], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    theirs = [json.loads(line) for line in (tmp_path / "trl" / "metrics.jsonl").read_text().splitlines()]
    mine = train_records(tmp_path / "ours")
    assert len(mine) == len(theirs) == int(more[more.index("--max-steps") + 1])
    for step, (a, b) in enumerate(zip(mine, theirs), 1):
        # (TRL counts a group as tied from the spread it divides by: RLOO's after its KL penalty, the batch's under
        # --scale-rewards batch; here always from the group's rewards)
        tied = ("frac_reward_zero_std",) if loss != "rloo" and "batch" not in more else ()
        kl = ("kl",) if "--beta" in more and loss != "rloo" else ()  # (the KL term's mean, where it is in the loss)
        for name in ("loss", "grad_norm", "reward", "reward_std", *tied, "completions/mean_length", *kl):
            if name in b or name == "kl":  # (TRL logs the reward only at the steps that sample)
                # (the KL figure: here its mean over the step's tokens, TRL's the mean of each micro-batch's mean)
                close = dict(abs=1e-5, rel=1e-4) if name != "kl" else dict(rel=2e-2)
                assert a[name] == pytest.approx(b[name], **close), (step, name, a, b)
    assert any(record["grad_norm"] > 0 for record in mine)  # the rewards differed: something trained


# --- every strategy against one process -----------------------------------------------------------------------------

# two steps on each batch of completions; the checkpoint at step 3 is taken inside the second batch
STEPS, SAVE_EVERY, GLOBAL, ITERATIONS = 6, 3, 16, 2
STRATEGIES = {"one": 1, "ddp": 2, "fsdp": 2, "zero3": 2, "zero2": 2, "fsdp_offload": 2, "model_parallel": 1}
EVERY_RUN = ("one", "fsdp", "zero3")


def strategy_args(prompts, processes: int, full: bool = False) -> list[str]:
    return flags(prompts, "--batch-size", "4", "--grad-accum", str(GLOBAL // 4 // processes),
                 *(["--lr", "1e-3"] if full else []), "--beta", "0.1", "--max-steps", str(STEPS), "--save-every",
                 str(SAVE_EVERY), "--samples-every", "1", "--num-iterations", str(ITERATIONS))


@pytest.fixture(scope="module")
def grpo_run(prompts, tmp_path_factory):
    """One launch per strategy, made once (6 steps on 3 batches of completions, checkpoints at 3 and 6)."""
    done = {}

    def get(config: str):
        if config not in done:
            processes = STRATEGIES[config]
            output_dir = tmp_path_factory.mktemp(f"grpo-{config}")
            done[config] = launch("grpo", output_dir, *strategy_args(prompts, processes),
                                  config=None if config == "one" else config, processes=processes)
        return done[config]

    return get


def completions_of(output_dir) -> list:
    lines = map(json.loads, (output_dir / "samples.jsonl").read_text().splitlines())
    return sorted((line["step"], line["prompt"], line["completion"]) for line in lines)


@pytest.mark.parametrize("config", [pytest.param(config, marks=() if config in EVERY_RUN else long_test)
                                    for config in STRATEGIES if config != "one"])
def test_every_strategy_samples_and_trains_as_one_process(grpo_run, config):
    """The same completions (the sampler's seeds do not depend on the rank or the batch), and the same loss,
    gradient norm, reward and KL at every step; under FSDP2 and ZeRO-3 the weights are gathered once per batch."""
    one, other = grpo_run("one"), grpo_run(config)
    assert one.returncode == 0, one.output[-3000:]
    assert other.returncode == 0, other.output[-3000:]
    assert completions_of(other.output_dir) == completions_of(one.output_dir)
    assert len(completions_of(one.output_dir)) == STEPS // ITERATIONS * GLOBAL
    for a, b in zip(train_records(other.output_dir), train_records(one.output_dir), strict=True):
        for name in ("loss", "grad_norm", "reward", "kl"):
            assert a[name] == pytest.approx(b[name], abs=1e-5, rel=1e-4), (a["step"], name, a, b)
    assert (other.output_dir / "adapter" / "adapter_model.safetensors").exists()


@pytest.mark.parametrize("config", ["zero3", pytest.param("fsdp", marks=long_test), pytest.param("ddp", marks=long_test)])
def test_every_weight_trains_as_one_process_under_each_strategy(prompts, tmp_path, config):
    """grpo_full.py: the same completions, loss, gradient norm, reward and KL to the weights as loaded on one
    process and under `config`; the saved model loads in transformers. ZeRO-3's checkpoint inside a batch continues
    on one process with the same curve: the reference is still the weights as loaded, not the checkpoint's."""
    runs = {}
    for name, processes in (("one", 1), (config, 2)):
        runs[name] = launch("grpo_full", tmp_path / name, *strategy_args(prompts, processes, full=True),
                            config=None if name == "one" else config, processes=processes)
        assert runs[name].returncode == 0, runs[name].output[-3000:]
    assert completions_of(runs[config].output_dir) == completions_of(runs["one"].output_dir)
    for a, b in zip(train_records(runs[config].output_dir), train_records(runs["one"].output_dir), strict=True):
        for key in ("loss", "grad_norm", "reward", "kl"):
            assert a[key] == pytest.approx(b[key], abs=1e-5, rel=1e-4), (a["step"], key, a, b)
    assert train_records(runs["one"].output_dir)[-1]["kl"] > 1e-4  # the model moved away from its reference
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(runs[config].output_dir / "model")
    if config == "zero3" and LONG_TESTS:  # (a third launch: in the long tests)
        checkpoint = f"step-{SAVE_EVERY}"
        shutil.copytree(runs[config].output_dir / "checkpoints" / checkpoint, tmp_path / "resumed" / "checkpoints" /
                        checkpoint)
        continued = launch("grpo_full", tmp_path / "resumed", *strategy_args(prompts, 1, full=True), "--resume", "auto",
                           processes=1)
        assert continued.returncode == 0, continued.output[-3000:]
        for a, b in zip(train_records(tmp_path / "resumed"), train_records(runs["one"].output_dir)[SAVE_EVERY:],
                        strict=True):
            for key in ("loss", "grad_norm", "kl"):
                assert a[key] == pytest.approx(b[key], abs=1e-5, rel=1e-4), (a["step"], key, a, b)


@pytest.mark.parametrize("written, resumed, processes", [
    ("fsdp", None, 1),  # FSDP2's sharded checkpoint, continued by one process: another strategy and count
    pytest.param("zero3", "ddp", 2, marks=long_test),
    pytest.param("one", "zero3", 2, marks=long_test),
])
def test_a_checkpoint_continues_the_curve_on_another_strategy(grpo_run, prompts, tmp_path, written, resumed, processes):
    """The checkpoint at step 3 is inside a batch of completions: it keeps the batch, and step 4 trains on the same
    completions with the log-probabilities they were sampled with, on any strategy and process count."""
    whole = grpo_run(written)
    assert whole.returncode == 0, whole.output[-3000:]
    checkpoint = f"step-{SAVE_EVERY}"
    kept = json.loads((whole.output_dir / "checkpoints" / checkpoint / "rollout.json").read_text())
    assert len(kept["completions"]) == GLOBAL and all(len(c["old_logps"]) == len(c["completion_ids"]) > 0
                                                      for c in kept["completions"])
    shutil.copytree(whole.output_dir / "checkpoints" / checkpoint, tmp_path / "checkpoints" / checkpoint)
    continued = launch("grpo", tmp_path, *strategy_args(prompts, processes), "--resume", "auto", config=resumed,
                       processes=processes)
    assert continued.returncode == 0, continued.output[-3000:]
    mine, theirs = train_records(tmp_path), train_records(whole.output_dir)[SAVE_EVERY:]
    assert [record["step"] for record in mine] == list(range(SAVE_EVERY + 1, STEPS + 1))
    for a, b in zip(mine, theirs, strict=True):
        for name in ("loss", "grad_norm", "reward", "kl", "clip_ratio/region_mean"):
            assert a[name] == pytest.approx(b[name], abs=1e-5, rel=1e-4), (a["step"], name, a, b)
    # the batch sampled after the resume is the unbroken run's (and the kept one is not written again)
    assert completions_of(tmp_path) == [line for line in completions_of(whole.output_dir) if line[0] > SAVE_EVERY]


def test_an_edited_loss_trains_under_a_sharded_strategy(grpo_run, prompts, tmp_path):
    """A copy of grpo.py whose completion loss is doubled, under ZeRO-3: its first step's loss and gradient norm
    (before any update, the same completions) are twice the recipe's; run.json names the copy."""
    from test_recipes_read_well import launch_edited_copy

    whole = grpo_run("zero3")
    assert whole.returncode == 0, whole.output[-3000:]
    edited = launch_edited_copy([("    losses = -torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages)",
                                  "    losses = -2 * torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages)")],
                                tmp_path / "out", 1, config="zero3", recipe="grpo", processes=2,
                                flags=strategy_args(prompts, 2))  # (its --max-steps 1 comes after, and wins)
    first, theirs = train_records(tmp_path / "out")[0], train_records(whole.output_dir)[0]
    assert first["grad_norm"] == pytest.approx(2 * theirs["grad_norm"], rel=1e-4)
    assert first["loss"] == pytest.approx(2 * theirs["loss"], rel=1e-4, abs=1e-6)


# --- rewards and refusals -------------------------------------------------------------------------------------------

def write(path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_a_reward_file_is_read_and_its_mistakes_named(tmp_path):
    good = write(tmp_path / "mine.py", "def ones(prompts, completions, **kw):\n    return [1.0 for _ in completions]\n"
                                       "def half(prompts, completions, **kw):\n    return [None, 0.5]\n"
                                       "NOT_A_FUNCTION = 3\n")
    loaded = rewards.load_rewards([f"{good}:ones", f"{good}:half", f"{good}:ones"])
    assert [reward.name for reward in loaded] == ["ones", "half", "ones_2"]
    table = rewards.score(loaded[:2], ["p", "q"], ["a", "b"], {})
    assert table[0] == [1.0, pytest.approx(math.nan, nan_ok=True)] and table[1] == [1.0, 0.5]
    for spec, message in ((f"{tmp_path}/absent.py:ones", "absent.py does not exist"),
                          (f"{good}:twos", "defines no `twos` \\(its functions: half, ones\\)"),
                          (f"{good}:NOT_A_FUNCTION", "is not a function"), (good, "give FILE.py:NAME")):
        with pytest.raises(Refusal, match=message):
            rewards.load_rewards([spec])
    broken = write(tmp_path / "broken.py", "import nonexistent_module_here\n")
    with pytest.raises(Refusal, match=r"importing .*broken.py failed: ModuleNotFoundError.*\(.*broken.py:1\)"):
        rewards.load_rewards([f"{broken}:f"])


@pytest.mark.parametrize("body, message", [
    ("raise KeyError('answer')", r"raised KeyError: 'answer' \(.*bad.py:2\)"),
    ("return [1.0]", "returned 1 values for 2 completions"),
    ("return [1.0, 'yes']", "returned 'yes' for completion 1; return a finite number"),
    ("return [1.0, float('nan')]", "returned nan for completion 1"),
    ("return 1.0", "returned float; return a list"),
])
def test_a_reward_that_fails_is_named_with_its_file(tmp_path, body, message):
    bad = write(tmp_path / "bad.py", f"def f(prompts, completions, **kw):\n    {body}\n")
    with pytest.raises(rewards.RewardProblem, match=message):
        rewards.score(rewards.load_rewards([f"{bad}:f"]), ["p", "q"], ["a", "b"], {})


def args_of(*argv: str):
    return parse_args(recipe_flags("grpo"), list(argv))


@pytest.mark.parametrize("argv, processes, message", [
    (["--batch-size", "3", "--num-generations", "4"], 1,
     r"the global batch of 3 completions .* does not hold whole groups of --num-generations 4; use --num-generations 3"),
    (["--batch-size", "3", "--grad-accum", "1", "--num-generations", "4"], 2,
     r"the global batch of 6 completions \(--batch-size 3 x --grad-accum 1 x 2 process\(es\)\) .* use "
     r"--num-generations 2 or 3 or 6, or .* \(--global-batch-size 4\)"),
    (["--max-completion-length", "600", "--max-length", "512"], 1, "leaves no room for a prompt"),
    (["--packing"], 1, "drop --packing"),
    (["--batch-size", "auto"], 1, "give --batch-size N"),
    (["--loss", "rloo", "--scale-rewards", "batch"], 1, "--scale-rewards is GRPO's"),
    (["--normalize-advantages"], 1, "--normalize-advantages is RLOO's"),
])
def test_a_batch_or_flag_grpo_cannot_run_is_refused(argv, processes, message):
    launch_of = Launch(DDP, processes=processes, on_gpu=False, visible_gpus=0, precision="no")
    with pytest.raises(Refusal, match=message):
        preflight.check_online_run(args_of("--batch-size", "8", *argv), launch_of)


@pytest.mark.parametrize("launched, what", [
    (dict(kind=TENSOR_PARALLEL, tensor_parallel=2), "tensor parallel"),
    (dict(kind=DDP, pipeline_stages=2), "pipeline stages"),
    (dict(kind=DEEPSPEED, zero_stage=3, sequence_parallel=2), "sequence parallel"),
])
def test_a_strategy_that_cannot_generate_is_refused_naming_one_that_can(launched, what):
    launch_of = Launch(processes=2, on_gpu=False, visible_gpus=0, precision="no", **launched)
    with pytest.raises(Refusal, match=f"grpo.py does not run {what}: .* launch with accelerate_configs/fsdp.yaml or "
                                      "zero3.yaml"):
        preflight.check_online_strategy(args_of("--batch-size", "8"), launch_of)


def test_the_defaults_follow_trl_and_a_dataset_needs_a_reward(tmp_path):
    run, _ = settle.settle_launch(args_of("--output-dir", str(tmp_path / "a")), "lora")
    assert run.reward == [rewards.BUNDLED_REWARD] and run.beta == 0.0 and run.loss == "dapo"
    run, _ = settle.settle_launch(args_of("--output-dir", str(tmp_path / "b"), "--loss", "rloo"), "lora")
    assert run.beta == 0.05
    with pytest.raises(Refusal, match="needs a reward for your prompts: give --reward FILE.py:NAME"):
        settle.settle_launch(args_of("--output-dir", str(tmp_path / "c"), "--dataset", str(tmp_path)), "lora")
    with pytest.raises(Refusal, match=r"--beta must be >= 0"):
        settle.settle_launch(args_of("--output-dir", str(tmp_path / "d"), "--beta", "-1"), "lora")
    full = parse_args(recipe_flags("grpo_full"), ["--output-dir", str(tmp_path / "e"), "--loss", "rloo"])
    run, _ = settle.settle_launch(full, "full")
    assert run.beta == 0.05 and run.lr == 1e-6  # (its reference: the weights as loaded, kept)


def test_a_reward_that_raises_mid_run_stops_every_rank_with_one_line_and_keeps_the_steps(prompts, tmp_path):
    """Step 3's reward raises on one rank only: both ranks stop with its line, after saving step 2."""
    flaky = write(tmp_path / "flaky.py", "import os\nCALLS = []\ndef f(prompts, completions, **columns):\n"
                  "    CALLS.append(1)\n    if os.environ['RANK'] == '1' and len(CALLS) == 3:\n"
                  "        raise ValueError('no answer column')\n    return [float(len(c)) for c in completions]\n")
    run = launch("grpo", tmp_path / "out", "--dataset", str(prompts), "--eval-dataset", str(prompts),
                 "--reward", f"{flaky}:f", "--batch-size", "4", "--num-generations", "4", "--max-completion-length",
                 "6", "--max-steps", "5", config="ddp")
    assert run.returncode != 0
    errors = [line for line in run.output.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: --reward {flaky}:f raised ValueError: no answer column ({flaky}:6) (at step 3; fix it, "
                      "then continue with --resume auto)"], run.output[-3000:]
    assert_the_refusal_ends_the_output(run.output, f"error: --reward {flaky}:f raised ValueError: no answer column "
                                                   f"({flaky}:6) (at step 3; fix it, then continue with --resume auto)")
    assert (tmp_path / "out" / "checkpoints" / "step-2").is_dir()


@pytest.mark.parametrize("tasks", [False, pytest.param(True, marks=long_test)], ids=["", "eval-tasks"])
def test_chat_prompts_keep_their_system_turn_and_the_rewards_get_messages(tmp_path, tasks):
    """Chat prompts go through the chat template with the assistant's turn opened; the reward functions receive
    the prompts and completions as message lists, the other columns as lists; run.json records the system turn;
    --eval-tasks (long: lm-eval loads in ~15 s) asks lm-eval's prompts through the chat template and that system
    turn."""
    data = tmp_path / "chat.jsonl"
    with open(data, "w") as file:
        for digits in ("3 1 2", "9 4 7", "5 0 8", "2 2 1"):
            file.write(json.dumps({"prompt": [{"role": "system", "content": "Answer with digits."},
                                              {"role": "user", "content": f"Sort: {digits}"}],
                                   "answer": " ".join(sorted(digits.split())), "level": len(digits)}) + "\n")
    checked = write(tmp_path / "checked.py", "def f(prompts, completions, answer, level, completion_ids, **kw):\n"
                    "    assert all(p[0]['role'] == 'system' and p[-1]['role'] == 'user' for p in prompts)\n"
                    "    assert all(c[0]['role'] == 'assistant' and isinstance(c[0]['content'], str) for c in completions)\n"
                    "    assert all(isinstance(n, int) for n in level) and len(completion_ids) == len(completions)\n"
                    "    return [float(len(c[0]['content'])) for c in completions]\n")
    run = launch("grpo", tmp_path / "out", "--dataset", str(data), "--eval-dataset", str(data), "--reward",
                 f"{checked}:f", "--batch-size", "8", "--num-generations", "4", "--max-completion-length", "6",
                 "--max-steps", "2", "--samples-every", "1",
                 *(["--eval-tasks", str(REPO / "data" / "eval_tasks" / "recipes_answer.yaml"), "--eval-limit", "4"]
                   if tasks else []), processes=1)
    assert run.returncode == 0, run.output[-3000:]
    if tasks:
        (scored,) = run.metrics("benchmarks")  # lm-eval's task, asked as the run trained: through the chat template
        assert "recipes_answer" in scored and scored["prompts"].startswith("chat template"), scored
    record = run.run_json()
    assert record["data_format"] == "chat prompts" and record["system_prompt"] == "Answer with digits."
    assert "data: chat rows rendered with the plain default" in run.output
    sample = json.loads((tmp_path / "out" / "samples.jsonl").read_text().splitlines()[0])
    assert sample["prompt"][0]["content"] == "Answer with digits." and sample["completion"][0]["role"] == "assistant"


# --- the sampler ----------------------------------------------------------------------------------------------------

def test_the_sampler_draws_from_the_tempered_cut_distribution():
    """KeyedSampling's argmax over many seeds follows softmax(logits / T) cut to top-k / top-p."""
    import torch

    from common.training.rollouts import KeyedSampling

    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    draws = 4000

    def frequencies(temperature, top_k, top_p):
        counts = Counter()
        for seed in range(draws):
            sampler = KeyedSampling([torch.Generator().manual_seed(seed)], temperature, top_k, top_p)
            counts[int(sampler(None, logits.clone()).argmax())] += 1
        return torch.tensor([counts[i] / draws for i in range(4)])

    expected = (logits[0] / 0.7).softmax(0)
    assert torch.allclose(frequencies(0.7, 0, 1.0), expected, atol=0.03)
    top2 = logits[0, :2].softmax(0)
    assert torch.allclose(frequencies(1.0, 2, 1.0), torch.cat([top2, torch.zeros(2)]), atol=0.03)
    # top-p 0.8 of softmax(logits) = [0.61, 0.22, 0.14, 0.03]: the first two hold 0.83, the rest are cut
    assert torch.allclose(frequencies(1.0, 0, 0.8), torch.cat([top2, torch.zeros(2)]), atol=0.03)


def test_a_completion_depends_on_its_seed_not_its_batch(tmp_path):
    """The same prompt and seed give the same completion alone or beside others, and the model's own generation
    config (sampling with another temperature) changes nothing."""
    import torch
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.training.rollouts import sample

    model = AutoModelForCausalLM.from_pretrained(REPO / "models" / "tiny-llama")
    model.generation_config.do_sample, model.generation_config.temperature = True, 0.3
    tokenizer = AutoTokenizer.from_pretrained(REPO / "models" / "tiny-llama")
    prompts = [tokenizer("### Instruction:\nSort: 3 1 2\n\n### Response:\n")["input_ids"],
               tokenizer("### Instruction:\nCopy: 9\n\n### Response:\n")["input_ids"]]
    from accelerate.state import AcceleratorState

    accelerator = Accelerator(cpu=True)
    try:  # (the process's accelerate state is put back after: other tests make their own)
        settings = dict(max_new_tokens=12, stop_ids=[tokenizer.eos_token_id], pad_id=tokenizer.pad_token_id)
        together = sample(accelerator, model, prompts, [11, 12], **settings)
        alone = [sample(accelerator, model, [prompt], [seed], **settings)[0] for prompt, seed in zip(prompts, [11, 12])]
        torch.manual_seed(0)
        again = sample(accelerator, model, prompts, [11, 12], **settings)
        other = sample(accelerator, model, prompts, [13, 14], **settings)
    finally:
        AcceleratorState._reset_state(True)
    assert together == alone
    assert again == together  # the global RNG plays no part
    assert other != together


def test_held_out_prompts_are_generated_in_the_kv_cache_a_rollout_is_planned_with():
    """A rollout of --batch-size x --grad-accum completions is planned --max-length positions each: the held-out
    prompts, shorter, go as many at once as that cache holds at their length, never fewer than a rollout."""
    run = parse_args(recipe_flags("grpo"), ["--batch-size", "8", "--max-length", "1024", "--max-completion-length", "64"])
    assert evaluation_chunk(run, 20) == 8 * 1024 // 84 == 97
    assert evaluation_chunk(run, 1000) == 8  # a long prompt: a rollout's rows
    assert evaluation_chunk(parse_args(recipe_flags("grpo"), ["--batch-size", "4", "--grad-accum", "2"]), 0) >= 8


def test_the_plan_counts_what_sampling_holds():
    """While a rank samples it holds the whole model (FSDP2 / ZeRO-3 gather it), its training state and the KV
    cache of every completion: the plan's total is the larger of that and the training step."""
    import planner

    shape = planner.load_shape("tinyllama-1.1b")
    # TinyLlama: 22 layers, 4 key-value heads of 64: 2 x 22 x 4 x 64 x 2 bytes = 22,528 bytes a token in bf16
    assert planner.kv_cache_bytes(shape, rows=16, seq_len=1024, compute=2) == 22_528 * 16 * 1024
    plain = planner.per_gpu_bytes(shape, "lora", "fsdp_full_shard", 4, batch_size=8, seq_len=1024)
    few = planner.per_gpu_bytes(shape, "lora", "fsdp_full_shard", 4, batch_size=8, seq_len=1024, generation_rows=16)
    whole = planner.weight_bytes(shape, "lora", "ddp", 1)
    assert few["generation"] >= whole + 22_528 * 16 * 1024 > plain["weights"]  # the gathered model, the cache
    assert few["total"] == plain["total"] > few["generation"]  # the training step's activations still decide
    many = planner.per_gpu_bytes(shape, "lora", "fsdp_full_shard", 4, batch_size=1, seq_len=1024,
                                 generation_rows=1024)
    assert many["total"] == many["generation"] > 22_528 * 1024 * 1024  # 1,024 completions at once: the cache decides
    # grpo_full.py --beta: the weights as loaded, one more copy of a GPU's shard, through the step and the sampling
    full = planner.per_gpu_bytes(shape, "full", "fsdp_full_shard", 4, batch_size=8, seq_len=1024, generation_rows=16)
    kept = planner.per_gpu_bytes(shape, "full", "fsdp_full_shard", 4, batch_size=8, seq_len=1024, generation_rows=16,
                                 starting_copy=True)
    assert kept["reference"] == full["weights"] > 0
    assert kept["total"] == full["total"] + full["weights"] and kept["generation"] == full["generation"] + full["weights"]


@long_test  # ~2 min: README's quickstart SFT, then 1,000 GRPO steps from its adapter
def test_grpo_after_sft_raises_the_held_out_exact_match(tmp_path):
    """The user's path on the bundled task (scripts/measure/grpo_path.py): GRPO with the exact-answer reward, from
    the SFT adapter, answers more held-out prompts exactly (greedy) than the SFT model did."""
    done = subprocess.run([sys.executable, "scripts/measure/grpo_path.py", "--output-dir", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["grpo_greedy_exact_match"] > summary["sft_greedy_exact_match"], summary


def test_prompts_that_cannot_be_asked_are_refused_naming_the_fix():
    from datasets import Dataset

    from common.data import prompts

    with pytest.raises(Refusal, match=r"has no `prompt` column \(it has question, answer\).* --columns question=prompt"):
        prompts.prompt_format(Dataset.from_list([{"question": "q", "answer": "a"}]), "qa.jsonl")
    with pytest.raises(Refusal, match=r"row 2's `prompt` is ''"):
        prompts.prompt_format(Dataset.from_list([{"prompt": "Sort: 1"}, {"prompt": ""}]), "p.jsonl")
    assert prompts.prompt_format(Dataset.from_list([{"prompt": [{"role": "user", "content": "hi"}]}]), "c") == \
        prompts.CHAT_PROMPTS


def test_the_room_a_prompt_needs_is_checked_with_the_length_that_fits(prompts, tmp_path):
    """In-process, every run: the prompts, tokenised as asked, against --max-length less the completion's room."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from common.data import prompts as prompt_data
    from common.model import modeling

    ranks = SimpleNamespace(main_process_first=nullcontext, is_main_process=True)
    tokenizer = modeling.load_tokenizer(str(TINY_MODEL))
    too_short = args_of(*flags(prompts, "--max-length", "20"))  # (--max-completion-length 8)
    with pytest.raises(Refusal, match=r"4 of 4 prompts in --dataset rows are longer than the 12 tokens --max-length 20 "
                                      r"leaves beside --max-completion-length 8 .* raise --max-length to 24"):
        prompt_data.prepare_prompts(ranks, tokenizer, too_short)
    train, _, _ = prompt_data.prepare_prompts(ranks, tokenizer, args_of(*flags(prompts, "--max-length", "24")))
    assert len(train) == PROMPTS and max(len(ids) for ids in train["prompt_ids"]) == 16


@long_test  # (the same refusal through the launcher: the line, and no run.json)
def test_a_prompt_longer_than_the_room_left_is_refused_with_the_length_that_fits(prompts, tmp_path):
    run = launch("grpo", tmp_path / "out", *flags(prompts, "--batch-size", "8", "--max-length", "20",
                                                  "--max-completion-length", "8"), processes=1)
    assert run.returncode != 0, run.output[-3000:]
    errors = [line for line in run.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "4 of 4 prompts in --dataset rows are longer than the 12 tokens --max-length 20 " \
                                "leaves beside --max-completion-length 8" in errors[0], run.output[-2000:]
    assert "raise --max-length to 24" in errors[0] and not (tmp_path / "out" / "run.json").exists()


@long_test
def test_a_4_bit_base_trains_its_adapters(prompts, tmp_path):
    """--bits 4: QLoRA's GRPO, the base quantized as it loads (bitsandbytes' CPU kernels here)."""
    run = launch("grpo", tmp_path / "out", *flags(prompts, "--batch-size", "8", "--max-steps", "2", "--bits", "4"),
                 processes=1)
    assert run.returncode == 0, run.output[-3000:]
    assert run.run_json()["parameters"]["quantized"] > 0
    assert any(record["grad_norm"] > 0 for record in train_records(tmp_path / "out"))


@pytest.mark.parametrize("config, argv, what", [
    ("tp.yaml", [], "tensor parallel"), ("sp.yaml", [], "sequence parallel"),
    ("pipeline.yaml", ["--pipeline-stages", "2"], "pipeline stages"),
])
def test_check_config_says_what_grpo_cannot_run_before_its_other_checks(config, argv, what):
    """scripts/check_config.py --recipe grpo answers as the launch does: the strategy's refusal comes first (not,
    under tp.yaml, LoRA's row-split layers)."""
    sys.path.insert(0, str(REPO / "scripts"))
    import check_config

    with pytest.raises(Refusal, match=f"grpo.py does not run {what}"):
        check_config.check(REPO / "accelerate_configs" / config, "grpo", argv, num_processes=4, on_gpu=False)
    assert check_config.check(REPO / "accelerate_configs" / "fsdp.yaml", "grpo", [], num_processes=2,
                              on_gpu=False)[-1].startswith("ok: grpo runs as fsdp_full_shard on 2 process(es)")
