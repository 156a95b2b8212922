"""The memory of sampling completions (grpo.py): what a GPU holds while it generates, beside what it keeps for
training.

While a rank generates its completions it holds: its training state at rest (the trained parameters' gradients
and optimizer state: they live through the step), the whole model's weights (FSDP2 and ZeRO-3 gather every shard
once for the batch: `rollouts.whole_weights`; the other strategies hold them whole already), the KV cache of
every completion it samples in one batch (keys and values of every layer at every position up to --max-length,
in the compute dtype), and the last position's logits of each row in float32 (the sampler's scores). No
activations are kept for a backward. The step's peak is the larger of this and the training step's.
"""

from __future__ import annotations

from .dtypes import compute_dtypes
from .peak import weight_bytes
from .shapes import ModelShape


def kv_cache_bytes(shape: ModelShape, rows: int, seq_len: int, compute: int) -> int:
    """Keys and values of every layer for `rows` sequences of `seq_len` positions, `compute` bytes each."""
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * rows * seq_len * compute


def generation_bytes(shape: ModelShape, method: str, strategy: str, rows: int, seq_len: int, lora_rank: int = 16,
                     lora_targets="all-linear", precision: str = "bf16") -> dict:
    """{"weights": the whole model as one process holds it, "kv_cache", "logits"} in bytes, for a rank sampling
    `rows` completions at once (--batch-size x --grad-accum) up to `seq_len` positions (prompt + completion)."""
    compute = compute_dtypes(method, strategy, precision)["compute"]
    whole = weight_bytes(shape, method, "ddp", 1, lora_rank, lora_targets, precision)  # every weight, unsharded
    return {"weights": whole, "kv_cache": kv_cache_bytes(shape, rows, seq_len, compute),
            "logits": rows * shape.vocab * 4}
