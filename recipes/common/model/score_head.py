"""A reward model made of a causal language model: its LM head swapped for a score head (one output: a reward at
every position), so every strategy's loading, sharding, checkpointing and saving of the causal model serve it
unchanged. What it computes is the model family's AutoModelForSequenceClassification with one label: the backbone,
then the score head, read at the last token that is not padding (transformers' rule). Saved, it is converted
into that class's files (`as_sequence_classifier`), which any transformers program loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def put_score_head(model, seed: int, dtype: torch.dtype) -> torch.nn.Linear:
    """`model`'s LM head replaced by a score head of one output (float `dtype`), drawn as transformers initialises
    a new head (normal, the config's initializer_range) from `seed`: the same on every process, strategy and run
    of that seed. Untied from the embedding a tied head shares."""
    config = model.config
    head = model.get_output_embeddings().weight
    hidden = getattr(head, "ds_shape", head.shape)[1]  # (ZeRO-3 keeps a partitioned weight's shape apart)
    score = torch.nn.Linear(hidden, 1, bias=False, dtype=dtype)
    with torch.no_grad():
        score.weight.copy_(initial_score(hidden, getattr(config, "initializer_range", 0.02), seed))
    config.tie_word_embeddings = False  # a later tie_weights() would put the embedding back in its place
    if hasattr(config, "get_text_config"):
        config.get_text_config().tie_word_embeddings = False
    model.set_output_embeddings(score)
    return score


def initial_score(hidden: int, std: float, seed: int) -> torch.Tensor:
    """The score head's first weight (1 x hidden, float32): TRL's side of the equality test draws the same."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, hidden, generator=generator) * std


def head_name(model) -> str:
    """The LM head's module name (`lm_head` in most families): the files' key of the score head is this + .weight."""
    head = model.get_output_embeddings()
    return next(name for name, module in model.named_modules() if module is head)


def rewards_at_last_token(logits: torch.Tensor, input_ids: torch.Tensor, pad_token_id: int | None) -> torch.Tensor:
    """Each row's reward: the score at its last token that is not padding (transformers' sequence classifiers
    read it there, so a saved reward model scores as the recipe trained it). `logits`: rows x positions x 1."""
    if pad_token_id is None:
        last = torch.full((input_ids.shape[0],), input_ids.shape[1] - 1, device=input_ids.device)
    else:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        last = (positions * (input_ids != pad_token_id)).argmax(-1)
    return logits[torch.arange(logits.shape[0], device=logits.device), last.to(logits.device), 0]


def why_not_a_reward_model(config: dict | None) -> str | None:
    """None where the model's family has a sequence classifier that reads like its causal model with a score
    head (transformers' AutoModelForSequenceClassification, its head `score`, nothing after the head); else
    why not, for a refusal. `config`: the model's config as a dict (None: not readable here; then the model cannot
    load either)."""
    if config is None:
        return None
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES as CLASSES

    family = config.get("model_type")
    if family not in CLASSES:
        return f"transformers has no sequence classifier for {family} models"
    text = {**config.get("text_config", {}), **config}
    if text.get("final_logit_softcapping") or text.get("logit_scale"):
        return f"{family} scales its logits after the head, which its sequence classifier does not"
    return None


def as_sequence_classifier(folder: Path, head_key: str, pad_token_id: int | None) -> None:
    """A causal model saved with a score head (`folder`: config.json and safetensors files; `head_key`: the head's
    weight in them, `head_name` + ".weight") rewritten in place as its family's AutoModelForSequenceClassification
    with one label: the head's weight renamed `score.weight`, the config naming the class, one label and the
    padding token the reward is read before. Builds no model (under ZeRO-3 building one is a collective)."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES as CLASSES

    folder = Path(folder)
    written = json.loads((folder / "config.json").read_text())
    index_file = folder / "model.safetensors.index.json"
    index = json.loads(index_file.read_text()) if index_file.exists() else None
    file = folder / (index["weight_map"][head_key] if index else "model.safetensors")
    with safe_open(str(file), framework="pt") as handle:
        tensors = {("score.weight" if name == head_key else name): handle.get_tensor(name) for name in handle.keys()}
        metadata = handle.metadata()
    save_file(tensors, str(file), metadata=metadata or {"format": "pt"})
    if index:
        index["weight_map"]["score.weight"] = index["weight_map"].pop(head_key)
        index_file.write_text(json.dumps(index, indent=2))
    written.update(architectures=[CLASSES[written["model_type"]]], num_labels=1, id2label={"0": "LABEL_0"},
                   label2id={"LABEL_0": 0}, pad_token_id=pad_token_id, tie_word_embeddings=False)
    (folder / "config.json").write_text(json.dumps(written, indent=2))
