"""A vision-language model's vision side: its vision tower and projector (`VisionShape`, counted from the model the
run loads: memory_plan.vision_shape) and what they add to a GPU (`vision_bytes`), beside the language model the rest
of the planner plans.

- weights: the tower and projector in the dtype they are stored in (LoRA / QLoRA: the frozen base's, 16 bits, never
  quantized; full fine-tuning: the trained weights', frozen or not), split as the strategy splits the model's
  weights; the projector twice where LoRA trains it (peft trains a copy: modules_to_save);
- gradients and optimizer state of what trains (--train-vision-tower: the tower's LoRA adapters, or every tower
  weight under full.py; --train-projector: the projector), split as for the language model, with DDP's bucket copy
  and ZeRO-1's whole gradients of the backward;
- activations of the tower on a micro-batch's images. A row's image tokens are part of its --max-length (the
  language model's activations count them already); the tower runs `patches_per_token` patches for each (Qwen2-VL's
  merger: 4), and the plan takes every position an image token, the worst --max-length allows (a cross-attention
  model, mllama, reads its images beside the row: one image a row at its most tiles). A frozen tower keeps nothing
  for the backward; one that trains keeps, per patch and block, about c * (11 h + 2 f) bytes (c: the compute dtype's
  bytes; a ViT block's norms, linear inputs, attention and MLP), plus LoRA's outputs, and the patches' pixels under
  full fine-tuning; a trained projector (or one the tower's gradient passes through) about c * 4 h a patch. On top,
  one block's working tensors while it runs, c * (4 h + f) a patch. An estimate: within 15% of what autograd keeps
  in the tiny Qwen2-VL and LLaVA towers (tests/test_vision_training.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from .dtypes import compute_dtypes, state_bytes_per_parameter
from .resident import _divisors, _share


@dataclass(frozen=True)
class VisionShape:
    """The vision side of a vision-language model, as the planner needs it."""

    tower: int  # parameters of the vision tower, its projector left out
    projector: int  # parameters of the projector (LLaVA's multi_modal_projector, Qwen2-VL's merger)
    hidden: int  # the tower's width
    ffn: int  # the width of its blocks' MLP
    layers: int  # its blocks
    patch_values: int  # the values of one patch its patch embedding reads (channels x patch area, x frames)
    patches_per_token: float  # patches the tower encodes for each image token of a row
    patches_per_row: int = 0  # a model that reads its images beside the row (mllama): the patches of one image
    adapted: tuple = ()  # (in, out) of each tower linear --lora-targets picks (LoRA with --train-vision-tower)
    unread: int = 0  # parameters of the tower the model never reads (LLaVA's last block): held, never trained

    def patches(self, batch_size: int, seq_len: int) -> int:
        """The patches the tower encodes for a micro-batch of `batch_size` rows of `seq_len` tokens, at most."""
        return batch_size * (self.patches_per_row or int(seq_len * self.patches_per_token))


def vision_parameters(vision: VisionShape, method: str, lora_rank: int, train_tower: bool,
                      train_projector: bool) -> dict:
    """{"trained", "frozen"} parameters of the vision side."""
    full = method == "full"
    trained, frozen = 0, vision.unread
    if train_tower and full:
        trained += vision.tower
    else:
        frozen += vision.tower
        trained += lora_rank * sum(i + o for i, o in vision.adapted) if train_tower else 0
    if train_projector:
        trained += vision.projector
        frozen += 0 if full else vision.projector  # peft trains a copy; the loaded projector stays
    else:
        frozen += vision.projector
    return {"trained": trained, "frozen": frozen}


def vision_kept_bytes(vision: VisionShape, method: str, strategy: str, patches: int, lora_rank: int = 16,
                      precision: str = "bf16", train_tower: bool = False, train_projector: bool = False) -> int:
    """What the tower and projector keep for the backward on `patches` patches (the module docstring's estimate)."""
    c = compute_dtypes(method, strategy, precision)["compute"]
    h, f = vision.hidden, vision.ffn
    kept = 0.0
    if train_tower:
        kept += vision.layers * c * (11 * h + 2 * f)
        kept += c * vision.patch_values if method == "full" else c * lora_rank * len(vision.adapted)
    if train_tower or train_projector:
        kept += c * 4 * h
    return int(patches * kept)


def vision_activation_bytes(vision: VisionShape, method: str, strategy: str, batch_size: int, seq_len: int,
                            lora_rank: int = 16, precision: str = "bf16", train_tower: bool = False,
                            train_projector: bool = False) -> int:
    """The tower's activations on a micro-batch's images: what it keeps for the backward (`vision_kept_bytes`), and
    one block's working tensors while it runs."""
    c = compute_dtypes(method, strategy, precision)["compute"]
    patches = vision.patches(batch_size, seq_len)
    kept = vision_kept_bytes(vision, method, strategy, patches, lora_rank, precision, train_tower, train_projector)
    return int(kept + patches * c * (4 * vision.hidden + vision.ffn))


def vision_bytes(vision: VisionShape, method: str, strategy: str, gpus: int, batch_size: int, seq_len: int,
                 lora_rank: int = 16, precision: str = "bf16", train_tower: bool = False,
                 train_projector: bool = False) -> dict:
    """{"weights", "gradients", "optimizer", "activations"}: what the vision side adds to the busiest GPU."""
    per = state_bytes_per_parameter(method, strategy, precision)
    dt = compute_dtypes(method, strategy, precision)
    params = vision_parameters(vision, method, lora_rank, train_tower, train_projector)
    trained, frozen = params["trained"], params["frozen"]
    frozen_bytes = per["trained_weight"] if method == "full" else per["frozen"]  # full.py loads every weight alike
    weight_split, gradient_split, optimizer_split = _divisors(strategy, gpus)
    gradients = _share(trained * per["trained_grad"], gradient_split)
    if strategy == "ddp" and gpus > 1:  # the reducer's buckets beside param.grad
        gradients += trained * per["trained_grad"]
    if strategy == "zero1":  # the whole gradient of the backward
        gradients = trained * per["trained_grad"]
    activations = vision_activation_bytes(vision, method, strategy, batch_size, seq_len, lora_rank, precision,
                                          train_tower, train_projector)
    if dt["autocast_copies"]:  # autocast's 16-bit copies of the trained float32 weights, kept by the backward
        activations += 2 * trained
    return {"weights": int(_share(trained * per["trained_weight"] + frozen * frozen_bytes, weight_split)),
            "gradients": int(gradients),
            "optimizer": int(_share(trained * per["trained_optimizer"], optimizer_split)),
            "activations": int(activations)}
