"""The plumbing of online training (grpo.py, grpo_full.py) that nobody edits: a step's batch of completions
sampled and scored by the reward functions on every rank, cut into micro-batches, or the one a checkpoint kept;
the figures TRL logs; the held-out prompts' evaluation (`Sampling` holds what each needs, for the recipe's
loop). What a recipe edits (the log-probabilities, the reference, the advantages, the loss) stays in the recipe."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from accelerate.utils import gather_object

from .. import rewards
from ..data import prompts
from ..data.formats import reward_columns
from ..refusal import refuse
from . import rollouts


@dataclass
class Rollout:
    """A generation batch as a step trains on it: this rank's completions and micro-batches, the whole batch's
    rewards ([completions, functions], NaN where a function returned None) and, per completion, [length,
    truncated, the sampling rank's seconds]. `problem`: a reward function's failure on some rank (else None)."""

    epoch: int
    completions: rollouts.Completions
    micro_batches: list[dict]
    rewards: torch.Tensor
    lengths: torch.Tensor
    tokens: int  # the completion tokens that train, on all ranks (the dapo loss's divisor)
    problem: str | None
    fresh: bool = True  # sampled now (else kept by a checkpoint, with the log-probabilities it was sampled with)
    figures: dict | None = None  # the batch's figures under TRL's names (`reward_figures`)


def sample_and_score(accelerator, model, launch, run, rows, tokenizer, reward_functions, batch: int,
                     prompts_per_step: int, chat: bool) -> Rollout:
    """Generation batch `batch` (0-based): its prompts (the same on every rank, for any process count), this
    rank's share of its completions sampled with the weights gathered once, scored by this rank, the rewards
    gathered to every rank, and this rank's --grad-accum micro-batches on the device."""
    epoch, batch_rows = prompts.step_prompts(len(rows), prompts_per_step, batch + 1, run.seed)
    per_rank = run.batch_size * run.grad_accum
    share = (accelerator.process_index * per_rank, per_rank)
    started = time.perf_counter()
    with rollouts.whole_weights(model, launch):  # every rank at once: a collective under FSDP / ZeRO-3
        completions = rollouts.sample_completions(accelerator, model, rows, batch_rows, batch, run, tokenizer, share,
                                                  chat)
    seconds = time.perf_counter() - started
    table, problem = scored(reward_functions, completions.prompts, completions.texts,
                            {**completions.columns, "completion_ids": completions.completion_ids})
    problems = [found for found in gather_object([problem]) if found]
    micro_batches = micro_batches_of(completions, run, accelerator.device)
    device = accelerator.device
    lengths = accelerator.gather(torch.tensor([[len(ids), int(cut), seconds] for ids, cut in zip(
        completions.completion_ids, completions.truncated)], dtype=torch.float64, device=device)).cpu()
    tokens = sum(b["completion_mask"].sum() for b in micro_batches).to(torch.int64)
    return Rollout(epoch, completions, micro_batches,
                   accelerator.gather(torch.tensor(table, dtype=torch.float64, device=device)).cpu(), lengths,
                   int(accelerator.reduce(tokens, "sum")), problems[0] if problems else None)


def micro_batches_of(completions: rollouts.Completions, run, device, logps: list[dict] | None = None) -> list[dict]:
    """This rank's --grad-accum micro-batches of its completions, on the device; with `logps` (per completion, the
    saved log-probabilities by name) laid out as the micro-batches' completion tokens."""
    batches = []
    for start in range(0, len(completions.completion_ids), run.batch_size):
        rows = slice(start, start + run.batch_size)
        batch = rollouts.training_batch(completions, rows, run.mask_truncated_completions)
        for name in (logps[0] if logps else {}):
            values = torch.zeros_like(batch["completion_mask"])
            for row, saved in enumerate(logps[rows]):
                values[row, :len(saved[name])] = torch.tensor(saved[name])
            batch[name] = values
        batches.append({key: value.to(device) for key, value in batch.items()})
    return batches


SAVED_LOGPS = ("old_logps", "reference_logps")
ROLLOUT_FILE = "rollout.json"  # in a checkpoint taken inside a batch of completions


def kept_in_checkpoint(accelerator, rollout: Rollout) -> dict:
    """The generation batch as a checkpoint taken inside it keeps it (--num-iterations > 1), whole and in the
    batch's order so that any process count continues it: each completion's tokens and text, the
    log-probabilities it was sampled with (and its reference's), the batch's rewards (the dataset's other columns
    are not kept: the rewards have read them). Every rank calls it (a gather); the main process writes it."""
    done, mine, k = rollout.completions, [], 0
    for batch in rollout.micro_batches:
        for row in range(batch["input_ids"].shape[0]):
            length = len(done.completion_ids[k])
            mine.append({"prompt_ids": done.prompt_ids[k], "completion_ids": done.completion_ids[k],
                         "truncated": done.truncated[k], "prompt": done.prompts[k], "text": done.texts[k],
                         **{name: batch[name][row, :length].tolist() for name in SAVED_LOGPS if name in batch}})
            k += 1
    return {"epoch": rollout.epoch, "tokens": rollout.tokens, "rewards": rollout.rewards.tolist(),
            "lengths": rollout.lengths.tolist(), "completions": gather_object(mine)}


def rollout_from(accelerator, run, kept: dict) -> Rollout:
    """The generation batch a checkpoint kept (`kept_in_checkpoint`), with this rank's share of it, as it was
    sampled: the steps left on it train on the same completions and log-probabilities as an unbroken run."""
    per_rank = run.batch_size * run.grad_accum
    first = accelerator.process_index * per_rank
    rows = kept["completions"][first:first + per_rank]
    completions = rollouts.Completions(first, [row["prompt_ids"] for row in rows],
                                       [row["completion_ids"] for row in rows], [row["truncated"] for row in rows],
                                       [row["prompt"] for row in rows], [row["text"] for row in rows], {})
    logps = [{name: row[name] for name in SAVED_LOGPS if name in row} for row in rows]
    table, lengths = (torch.tensor(kept[name], dtype=torch.float64) for name in ("rewards", "lengths"))
    return Rollout(kept["epoch"], completions, micro_batches_of(completions, run, accelerator.device, logps), table,
                   lengths, kept["tokens"], None, fresh=False)


def scored(reward_functions, prompt_cells: list, completions: list, columns: dict) -> tuple[list, str | None]:
    """([completion][function] rewards, None), or (NaN rows, the line saying how a function failed)."""
    try:
        return rewards.score(reward_functions, prompt_cells, completions, columns), None
    except rewards.RewardProblem as error:
        return [[math.nan] * len(reward_functions)] * len(completions), str(error)


def completion_sums(accelerator, rollout: Rollout, per_token) -> torch.Tensor:
    """Each completion's sum of `per_token(micro-batch)` ([rows, tokens]) over its tokens, every rank's, in the
    batch's order (float64, on the CPU)."""
    return accelerator.gather(torch.cat([per_token(b).sum(1) for b in rollout.micro_batches])).cpu().double()


def hand_out(advantages: torch.Tensor, rollout: Rollout, batch_size: int) -> None:
    """Each micro-batch's `advantages`: this rank's slice of the batch's (from its completions' place in it)."""
    first = rollout.completions.first
    mine = advantages[first:first + len(rollout.completions.texts)].float()
    for index, batch in enumerate(rollout.micro_batches):
        batch["advantages"] = mine[index * batch_size:(index + 1) * batch_size].to(batch["input_ids"].device)


def nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation over the values that are not NaN (with Bessel's correction, as torch.std)."""
    if dim is None:
        values, dim = values.flatten(), 0
    count = (~values.isnan()).sum(dim)
    squares = ((values - values.nanmean(dim, keepdim=True)) ** 2).nansum(dim)
    return (squares / (count - 1)).sqrt()


def weighted_total(table: torch.Tensor, weights: list[float]) -> torch.Tensor:
    """Each completion's reward: the weighted sum of the functions that apply to it (NaN where none does)."""
    total = (table * torch.tensor(weights, dtype=table.dtype)).nansum(1)
    total[table.isnan().all(1)] = math.nan
    return total


def reward_figures(rollout: Rollout, weights: list[float], names: list[str], group_size: int) -> dict:
    """The batch's figures under TRL's names (every rank computes them from the gathered rewards)."""
    table, lengths = rollout.rewards, rollout.lengths
    total = weighted_total(table, weights)
    figures = {"reward": total.nanmean().item(), "reward_std": nanstd(total).item(),
               # the share of groups whose rewards all tie: they teach nothing (near 1: nothing learns)
               "frac_reward_zero_std": (nanstd(total.view(-1, group_size), 1).nan_to_num(0.0) < 1e-8)
               .double().mean().item()}
    for index, name in enumerate(names):
        figures[f"rewards/{name}/mean"] = table[:, index].nanmean().item()
        figures[f"rewards/{name}/std"] = nanstd(table[:, index]).item()
    slowest = max(lengths[:, 2].max().item(), 1e-9)
    figures.update({"completions/mean_length": lengths[:, 0].mean().item(),
                    "completions/min_length": lengths[:, 0].min().item(),
                    "completions/max_length": lengths[:, 0].max().item(),
                    "completions/clipped_ratio": lengths[:, 1].mean().item(),
                    # the slowest rank's sampling time, and the completion tokens all ranks drew in it
                    "generation/seconds": slowest, "generation/tokens_per_s": lengths[:, 0].sum().item() / slowest})
    return figures


def sample_lines(rollout: Rollout, advantages: torch.Tensor, names: list[str]) -> list[dict]:
    """samples.jsonl's lines of the batch (all ranks' completions, gathered: every rank calls it; the lines
    are whole on every rank)."""
    gathered = [line for part in gather_object([list(zip(rollout.completions.prompts, rollout.completions.texts))])
                for line in part]
    return [{"prompt": prompt, "completion": completion, "advantage": advantages[i].item(),
             "rewards": {name: None if math.isnan(rollout.rewards[i, j]) else rollout.rewards[i, j].item()
                         for j, name in enumerate(names)}}
            for i, (prompt, completion) in enumerate(gathered)]


def evaluation_chunk(run, longest_prompt: int) -> int:
    """Held-out prompts generated at once: a step's rollout (--batch-size x --grad-accum completions) in the KV
    cache the memory plan holds for it (every row --max-length positions), as many as fit there at the held-out
    prompts' own length (the longest, and --max-completion-length after it). A generate call costs per position
    more than per row: fewer, larger calls (the same on every rank: from every row's length)."""
    rollout = run.batch_size * run.grad_accum
    return max(rollout, rollout * run.max_length // max(1, longest_prompt + run.max_completion_length))


def evaluate(accelerator, model, launch, run, rows, tokenizer, reward_functions, weights, chat: bool):
    """({"eval_reward", "eval_rewards/<function>/mean"}, the first samples, a failing reward's line or None):
    each held-out prompt's greedy completion scored by the rewards, each rank its share."""
    mine = rows.select(range(accelerator.process_index, len(rows), accelerator.num_processes)).to_list()
    stop_ids = rollouts.stop_tokens(tokenizer, accelerator.unwrap_model(model))
    chunk = evaluation_chunk(run, max(map(len, rows["prompt_ids"]), default=0))
    most = -(-len(rows) // accelerator.num_processes)  # the rank with the most rows decides the count
    chunks = -(-most // chunk)
    ids = []
    with rollouts.whole_weights(model, launch):
        for index in range(chunks):  # the same count on every rank (a rank with fewer rows samples none)
            part = mine[index * chunk:(index + 1) * chunk]
            ids += rollouts.sample(accelerator, model, [row["prompt_ids"] for row in part], None,
                                   max_new_tokens=run.max_completion_length, stop_ids=stop_ids,
                                   pad_id=tokenizer.pad_token_id)
    completions = rollouts.as_rewards_take_them(tokenizer, ids, chat)
    texts = [completion[-1]["content"] if chat else completion for completion in completions]
    columns = {name: [row[name] for row in mine] for name in reward_columns(rows)}
    table, problem = scored(reward_functions, [row["prompt"] for row in mine], completions,
                            {**columns, "completion_ids": ids})
    problems = [found for found in gather_object([problem]) if found]
    values = torch.tensor(table, dtype=torch.float64).reshape(len(mine), len(reward_functions))
    sums = torch.stack([values.nan_to_num(0.0).sum(0), (~values.isnan()).sum(0).double()], 1)
    sums = accelerator.reduce(sums.to(accelerator.device), "sum").cpu()
    means = [(sums[j, 0] / sums[j, 1].clamp(min=1)).item() for j in range(len(reward_functions))]
    metrics = {"eval_reward": sum(w * m for w, m in zip(weights, means)),
               **{f"eval_rewards/{f.name}/mean": m for f, m in zip(reward_functions, means)}}
    samples = [{"prompt": tokenizer.decode(row["prompt_ids"], skip_special_tokens=True), "generated": text,
                "reference": str(row.get("answer", ""))} for row, text in zip(mine[:3], texts[:3])]
    return metrics, samples, problems[0] if problems else None


# The figures the progress line shows at each step (all of them go to metrics.jsonl)
SHOWN_FIGURES = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "kl",
                 "generation/tokens_per_s")


def nothing_learned(recipe: str, trained: str) -> str:
    """The line a run whose groups all tied on reward at every step ends with (`trained`: "adapter" or "model")."""
    return (f"{recipe}: every group's completions tied on reward at every step, so no completion was better than "
            f"another and the {trained} did not move; start from a model that sometimes earns the reward (an SFT "
            f"{trained} as --model), or add a reward with partial credit (recipes/rewards.py:answer_similarity)")


class Sampling:
    """An online run's sampling and scoring, for the recipe's loop: each step's batch of completions (`batch`), the
    held-out prompts' evaluation (`evaluate`), samples.jsonl's lines, the probe the export keeps. Set up once the
    model is prepared; `kept`: the batch a checkpoint taken inside it kept (the first step after `start_step` trains
    on it again, as it was sampled)."""

    def __init__(self, accelerator, model, launch, run, tokenizer, reward_functions, weights: list[float],
                 data_format: str, train_set, eval_set, prompts_per_step: int, start_step: int, kept: dict | None):
        self.accelerator, self.model, self.launch, self.run, self.tokenizer = accelerator, model, launch, run, tokenizer
        self.reward_functions, self.weights = reward_functions, weights
        self.names = [function.name for function in reward_functions]
        self.chat = data_format == prompts.CHAT_PROMPTS
        self.train_set, self.eval_set, self.prompts_per_step = train_set, eval_set, prompts_per_step
        self.kept = kept if start_step % run.num_iterations else None
        self.start_step = start_step

    def batch(self, step: int) -> Rollout:
        """The batch of completions step `step` trains on, with its figures: generation batch (step - 1) //
        --num-iterations sampled and scored now, or at the first step after a checkpoint inside it, the one it kept.
        `problem`: a reward function's failure on some rank (the recipe stops every rank)."""
        run = self.run
        if self.kept and step == self.start_step + 1:
            rollout = rollout_from(self.accelerator, run, self.kept)
        else:
            rollout = sample_and_score(self.accelerator, self.model, self.launch, run, self.train_set, self.tokenizer,
                                       self.reward_functions, (step - 1) // run.num_iterations, self.prompts_per_step,
                                       self.chat)
        rollout.figures = reward_figures(rollout, self.weights, self.names, run.num_generations)
        return rollout

    def kept_files(self, rollout: Rollout, step: int) -> dict | None:
        """What a checkpoint at `step` keeps beside it (save_checkpoint's `kept`): the batch of completions where
        steps are left on it (a gather: every rank calls it), else None."""
        inside = step % self.run.num_iterations
        return {ROLLOUT_FILE: kept_in_checkpoint(self.accelerator, rollout)} if inside else None

    def sample_lines(self, rollout: Rollout, advantages: torch.Tensor) -> list[dict]:
        """samples.jsonl's lines of the batch (a gather: every rank calls it)."""
        return sample_lines(rollout, advantages, self.names)

    def evaluate(self) -> tuple[dict, list[dict]]:
        """({"eval_reward", "eval_rewards/<function>/mean"}, the first samples for the model card): each held-out
        prompt's greedy completion scored by the rewards. A reward that fails stops every rank with its line."""
        metrics, samples, problem = evaluate(self.accelerator, self.model, self.launch, self.run, self.eval_set,
                                             self.tokenizer, self.reward_functions, self.weights, self.chat)
        if problem:
            refuse(f"{problem} (scoring the held-out prompts)")
        return metrics, samples

    def probe(self) -> dict:
        """The first held-out prompts as a batch: what the export keeps the trained model's logits of (save_probe),
        for a reload to compute again."""
        first = self.eval_set.select(range(min(4, len(self.eval_set))))
        return rollouts.probe_batch([row["prompt_ids"] for row in first], self.tokenizer.pad_token_id)
