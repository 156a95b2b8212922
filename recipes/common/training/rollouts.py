"""Sampling completions for online training (GRPO): batched generation with the KV cache on the model as it
trains, the sharded weights gathered once for the whole batch, and each completion drawn from its own seed.

Each completion's tokens are drawn with its own random stream, seeded by the run's seed, the generation batch,
its prompt's tokens and which of the prompt's completions it is (`completion_seed`): a completion does not
depend on which rank samples it or what else is in its batch, so the same seed samples the same completions on
any number of processes. The draw is the Gumbel-max form of sampling (argmax of the log-probabilities plus
Gumbel noise draws from exactly the softmax), taken by transformers' greedy search over the scores
`KeyedSampling` returns: temperature, top-k and top-p as transformers applies them, then the noise.

Under FSDP2 and ZeRO-3 each process holds a shard of every weight: a forward per generated token would gather
them all again, per token. Here they are gathered once before the batch and released after it
(`whole_weights`), so each process generates on its own, as fast as one process, with the memory of the whole
model for that time (as TRL's `ds3_gather_for_generation`).
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from ..data.batches import PadToLongest
from ..data.formats import IGNORE, reward_columns
from ..launching.launch import FSDP


def completion_seed(seed: int, batch: int, prompt_ids: list[int], occurrence: int, generation: int) -> int:
    """The seed of one completion's draws: the run's seed, the generation batch, the prompt's tokens, which
    repeat of this prompt in the batch it is (`occurrence`) and which of its completions (`generation`)."""
    text = f"{seed}:{batch}:{occurrence}:{generation}:" + ",".join(map(str, prompt_ids))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


class KeyedSampling(LogitsProcessor):
    """Scores whose argmax is a sample of the next token: the logits over the temperature, cut to the top-k and
    top-p tokens (as transformers' warpers cut them), as log-probabilities, plus Gumbel noise from each row's own
    generator (`generators`, one per row, advancing one draw per generated position)."""

    def __init__(self, generators: list[torch.Generator], temperature: float, top_k: int, top_p: float):
        self.generators, self.temperature, self.top_k, self.top_p = generators, temperature, top_k, top_p

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.float() / self.temperature
        if 0 < self.top_k < scores.shape[-1]:
            kth = torch.topk(scores, self.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, -float("inf"))
        if self.top_p < 1.0:
            ascending, order = torch.sort(scores, dim=-1)
            cumulative = ascending.softmax(-1).cumsum(-1)
            drop = cumulative <= 1 - self.top_p
            drop[..., -1] = False  # the likeliest token always stays
            scores = scores.masked_fill(drop.scatter(-1, order, drop), -float("inf"))
        noise = torch.stack([torch.rand(scores.shape[-1], generator=generator, device=scores.device)
                             for generator in self.generators])
        return scores.log_softmax(-1) - torch.log(-torch.log(noise))


@dataclass
class Completions:
    """This rank's completions of a generation batch, with what the rewards read: `prompts` and `texts` as the
    reward functions take them (strings, or chat messages), `columns` the dataset's other columns, aligned."""

    first: int  # where this rank's completions start in the batch's list (prompt-major, --num-generations each)
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    truncated: list[bool]  # reached --max-completion-length without a stop token
    prompts: list
    texts: list
    columns: dict[str, list]


def sample_completions(accelerator, model, rows, batch_rows: list[int], batch: int, run, tokenizer,
                       share: tuple[int, int], chat: bool) -> Completions:
    """This rank's `share` (first, count) of the batch's completions: --num-generations of each prompt of
    `batch_rows` (rows of the dataset `rows`, in order), each drawn from its own seed. The caller holds the
    weights whole (`whole_weights`)."""
    first, count = share
    generations = run.num_generations
    table = rows.select(batch_rows).to_list()  # the batch's prompts, in order (a few rows: the step's prompts)
    batch_ids = [row["prompt_ids"] for row in table]
    seen, occurrence = {}, []  # a prompt met again in the batch (the same text in two rows) is another draw
    for ids in batch_ids:
        occurrence.append(seen.get(tuple(ids), 0))
        seen[tuple(ids)] = occurrence[-1] + 1
    picked = [(i // generations, i % generations) for i in range(first, first + count)]  # (prompt, generation)
    prompt_ids = [batch_ids[prompt] for prompt, _ in picked]
    seeds = [completion_seed(run.seed, batch, batch_ids[prompt], occurrence[prompt], generation)
             for prompt, generation in picked]
    stop_ids = stop_tokens(tokenizer, accelerator.unwrap_model(model))
    completion_ids = sample(accelerator, model, prompt_ids, seeds, max_new_tokens=run.max_completion_length,
                            temperature=run.temperature, top_k=run.top_k, top_p=run.top_p, stop_ids=stop_ids,
                            pad_id=tokenizer.pad_token_id)
    truncated = [not ids or ids[-1] not in stop_ids for ids in completion_ids]
    columns = {name: [table[prompt][name] for prompt, _ in picked] for name in reward_columns(rows)}
    return Completions(first, prompt_ids, completion_ids, truncated, [table[prompt]["prompt"] for prompt, _ in picked],
                       as_rewards_take_them(tokenizer, completion_ids, chat), columns)


def as_rewards_take_them(tokenizer, completion_ids: list[list[int]], chat: bool) -> list:
    """Completions as the reward functions take them: their text, or for chat prompts one assistant message."""
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    return [[{"role": "assistant", "content": text}] for text in texts] if chat else texts


@torch.no_grad()
def sample(accelerator, model, prompts: list[list[int]], seeds: list[int] | None, *, max_new_tokens: int,
           temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, stop_ids: list[int], pad_id: int
           ) -> list[list[int]]:
    """One completion of each prompt (token ids, through the first stop token when it came), each drawn from
    its seed (`seeds` None: greedy). The caller holds the weights whole (`whole_weights`): the generation is
    each rank's own."""
    if not prompts:
        return []
    generator = accelerator.unwrap_model(model)
    longest = max(map(len, prompts))
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):  # left-padded: every row's next token is at the same position
        ids[row, longest - len(prompt):] = torch.tensor(prompt)
        mask[row, longest - len(prompt):] = 1
    device = accelerator.device
    processors = LogitsProcessorList()
    if seeds is not None:
        generators = [torch.Generator(device=device).manual_seed(seed) for seed in seeds]
        processors.append(KeyedSampling(generators, temperature, top_k, top_p))
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, eos_token_id=stop_ids,
                              pad_token_id=pad_id, use_cache=True)
    was_training = generator.training
    generator.eval()
    try:
        # Eager even under --compile: each new cache length would be another graph (report.sample_generations)
        with torch.compiler.set_stance("force_eager"), accelerator.autocast():
            output = generator.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                        generation_config=config, logits_processor=processors)
    finally:
        generator.train(was_training)
    completions = []
    for row in output[:, longest:].tolist():
        end = next((i + 1 for i, token in enumerate(row) if token in stop_ids), len(row))
        completions.append(row[:end])
    return completions


def probe_batch(prompts: list[list[int]], pad_id: int) -> dict:
    """The prompts right-padded, with their attention mask (the collator's padding): the batch whose logits the
    export keeps (save_probe), so that a reload of the adapter can be compared with the trained model."""
    batch = PadToLongest(pad_id)([{"input_ids": prompt, "labels": prompt} for prompt in prompts])
    return {key: batch[key] for key in ("input_ids", "attention_mask")}


def stop_tokens(tokenizer, model) -> list[int]:
    """The tokens that end a completion: the model's generation config's, else the tokenizer's end of text."""
    stop = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    stops = stop if isinstance(stop, list) else [stop] if stop is not None else []
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in stops:
        stops.append(tokenizer.eos_token_id)
    return stops


def training_batch(completions: Completions, rows: slice, mask_truncated: bool) -> dict:
    """The micro-batch of completions `rows`: each prompt left-padded and its completion right-padded, so
    that completion token j of every row sits at one position (`target_positions`: the positions that predict
    them, in order); labels on the completion tokens only; `completion_mask` [rows, tokens]: the tokens that
    train (none of a truncated completion under --mask-truncated-completions); positions counted from each
    row's first token, as generation counted them."""
    prompts, answers = completions.prompt_ids[rows], completions.completion_ids[rows]
    truncated = completions.truncated[rows]
    prompt_length, length = max(map(len, prompts)), max(1, max(map(len, answers)))
    count = len(prompts)
    ids = torch.zeros(count, prompt_length + length, dtype=torch.long)
    labels = torch.full_like(ids, IGNORE)
    attention = torch.zeros_like(ids)
    completion_mask = torch.zeros(count, length)
    for row, (prompt, answer) in enumerate(zip(prompts, answers)):
        start = prompt_length - len(prompt)
        ids[row, start:prompt_length + len(answer)] = torch.tensor(prompt + answer)
        attention[row, start:prompt_length + len(answer)] = 1
        labels[row, prompt_length:prompt_length + len(answer)] = torch.tensor(answer, dtype=torch.long)
        if not (mask_truncated and truncated[row]):
            completion_mask[row, :len(answer)] = 1
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": attention, "position_ids": positions, "labels": labels,
            "target_positions": torch.arange(prompt_length - 1, prompt_length + length - 1),
            "completion_mask": completion_mask}


@contextmanager
def whole_weights(model, launch):
    """Every weight whole on every process for the duration, gathered once: FSDP2's modules unsharded and kept
    so through each forward; ZeRO-3's parameters gathered with its forward hooks lifted (each would partition
    its layer's weights again after the layer ran). Elsewhere the weights are whole already."""
    if launch.kind == FSDP:
        with fsdp_unsharded(model):
            yield
    elif launch.zero_stage == 3:
        with zero3_gathered(model):
            yield
    else:
        yield


@contextmanager
def fsdp_unsharded(model):
    """FSDP2: unshard every module once; no module reshards after its forward until the end (each parameter
    group's post-forward mesh, FSDP2's own record of that setting, is kept and put back: the configs' layers,
    the root and the head each have their own). FSDP2's private state is read here (torch 2.11 to 2.13)."""
    from torch.distributed.fsdp import FSDPModule

    # FSDP2 takes the first module to run a forward as its root: generation enters below the root (the causal
    # LM inside the peft wrapper), so the root settles first, as its own first forward would settle it.
    model._get_fsdp_state()._lazy_init()
    modules = [module for module in model.modules() if isinstance(module, FSDPModule)]
    groups = [group for module in modules for group in parameter_groups(module)]
    kept = [group.post_forward_mesh_info for group in groups]
    for module in modules:
        module.unshard()
    for group in groups:
        group.post_forward_mesh_info = None  # what set_reshard_after_forward(False) sets
    try:
        yield
    finally:
        for group, mesh in zip(groups, kept):
            group.post_forward_mesh_info = mesh
        for module in modules:
            module.reshard()


def parameter_groups(module) -> list:
    """An FSDP2 module's parameter groups (a list from torch 2.10 on, one group before)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


@contextmanager
def zero3_gathered(engine):
    """ZeRO-3: all parameters gathered (DeepSpeed's GatheredParameters) and the engine's per-module hooks
    removed for the duration, then registered again as DeepSpeed registers them."""
    import deepspeed

    offload = getattr(engine.optimizer, "parameter_offload", engine.optimizer)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        for parameter in engine.module.parameters():
            parameter.ds_active_sub_modules.clear()
        for hook in [*offload.forward_hooks, *offload.backward_hooks]:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield
        finally:
            offload._register_deepspeed_module(offload.module)
