"""Bytes per parameter at rest (`state_bytes_per_parameter`, `quantized_bytes_per_weight`) and the
dtypes the forward computes in (`compute_dtypes`), which size the saved activations.

Bytes per parameter (they follow `Launch.float_dtype` in recipes/common/launch.py and each strategy's own rules):

| precision bf16                | trained parameter                    | frozen float | NF4 base linear |
|-------------------------------|--------------------------------------|--------------|-----------------|
| DDP / FSDP / model parallel   | weight 4 + grad 4 + AdamW 8 = 16     | 2 (*)        | 0.5 + 0.0159    |
| DeepSpeed ZeRO-1/2            | weight 2 + grad 2 + master 4 + AdamW 8 = 16 | 2     | 0.5 + 0.0159    |
| DeepSpeed ZeRO-3              | weight 2 (LoRA: 4) + grad 4 + master 4 + AdamW 8 | 2 | 0.5 + 0.0159 |

(*) QLoRA's embedding, lm_head and norms are 4 on DDP / model parallel: the QLoRA recipe runs
peft's `prepare_model_for_kbit_training` there, which upcasts them to fp32.
With `precision="fp32"` (what the CPU tests run) every float is 4 bytes and nothing is cast, but
DeepSpeed still trains flat fp32 master partitions of its own, copies of the (already fp32)
weights: a trained parameter costs weight 4 + grad 4 + master 4 + AdamW 8 = 20 B there, against
16 B on DDP / FSDP (measured: 6 B per parameter of optimizer state on each of 2 ZeRO ranks).
"""

from __future__ import annotations

from .strategies import DEEPSPEED, ZERO3, _check

# NF4 with double quantisation (bitsandbytes, blocksize 64): 4 bits per weight, one 8-bit absmax
# per 64 weights, and one fp32 scale per 256 absmax blocks.
NF4_BITS_PER_WEIGHT = 4 + 8 / 64 + 32 / (64 * 256)


def quantized_bytes_per_weight() -> float:
    """NF4 storage per base weight: (4 + 8/64 + 32/(64*256)) / 8 = 0.5159 bytes.

    The packed weights are 4 bits each whatever the storage dtype: bitsandbytes allocates
    (n + 1) // (2 * itemsize) elements of `bnb_4bit_quant_storage` (uint8 on DDP, the float dtype
    under FSDP / ZeRO-3), i.e. n / 2 bytes either way. The constants (8-bit absmax per 64
    weights, fp32 per 256 blocks) are not parameters: FSDP / ZeRO-3 do not shard them.
    """
    return NF4_BITS_PER_WEIGHT / 8


def state_bytes_per_parameter(method: str, strategy: str, precision: str = "bf16") -> dict:
    """Bytes per parameter at rest, before any sharding.

    - trained parameters (everything for `full`, the adapters for LoRA / QLoRA):
      bf16 on DDP / FSDP / model parallel: fp32 weight 4 (autocast or FSDP's param_dtype computes
      in bf16), fp32 grad 4, AdamW m + v 8 = 16 B.
      bf16 on DeepSpeed: DeepSpeed casts the module to bf16 and keeps an fp32 master copy in its
      optimizer: weight 2, grad 2, optimizer 4 + 8 = 12 -> 16 B as well, split differently.
      fp32: 4 + 4 + 8 = 16, except on DeepSpeed: 4 + 4 + 12 = 20, since its ZeRO optimizer keeps
      the flat fp32 master partitions whatever the module's dtype (a copy of fp32 weights in fp32).
    - `frozen`: LoRA's base (bf16: 2, fp32: 4); QLoRA's non-quantised parts (embedding, lm_head,
      norms): 4 on DDP / model parallel in bf16 because peft's `prepare_model_for_kbit_training`
      (which the QLoRA recipe runs there) upcasts them, 2 under FSDP / DeepSpeed (which keep one
      dtype), 4 in fp32.
    - `quantized`: QLoRA's block linears, `quantized_bytes_per_weight()`.
    """
    _check(method, strategy, precision)
    deepspeed_bf16 = precision == "bf16" and strategy in DEEPSPEED
    frozen = 4 if precision == "fp32" else 2
    if method == "qlora" and precision == "bf16" and strategy in ("ddp", "model_parallel", "pipeline"):
        frozen = 4
    # ZeRO-3 in bf16, measured (deepspeed 0.19.8, scripts/measure/plan_at_scale.py): the gradient the step sees
    # is the fp32 copy DeepSpeed casts its reduced bf16 partition into. peft's adapters, created after zero.Init,
    # are cast to bf16 by the recipes as DeepSpeed casts every other weight
    # (modeling.keep_adapter_inputs_in_compute_dtype).
    zero3_bf16 = precision == "bf16" and strategy in ZERO3
    return {
        "trained_weight": 2 if deepspeed_bf16 else 4,
        "trained_grad": 2 if deepspeed_bf16 and not zero3_bf16 else 4,
        "trained_optimizer": 12 if strategy in DEEPSPEED else 8,  # DeepSpeed: + its fp32 master, in any precision
        "frozen": frozen,
        "quantized": quantized_bytes_per_weight(),
    }


def compute_dtypes(method: str, strategy: str, precision: str = "bf16") -> dict:
    """The dtypes (bytes) the forward runs in, which decide the size of the saved activations.

    - `compute` c: what matmuls produce: 2 in bf16 (autocast on DDP / model parallel / pipeline / tp, FSDP2's
      param_dtype, DeepSpeed's bf16 module), 4 in fp32.
    - `residual` r: the residual stream, i.e. the embedding's dtype: fp32 when the embedding is
      stored in fp32 under autocast (full fine-tuning on DDP / model parallel, QLoRA there after
      the upcast), otherwise c.
    - `linear_out` m: the outputs of the block linears: c, except QLoRA on DDP / model parallel,
      whose 4-bit linears return their input's dtype (fp32).
    - `autocast_copies`: autocast's bf16 copies of the fp32 trained weights (DDP / model parallel;
      tp / fsdp_tp: of each rank's tensor parallel part), saved for the backward.
    - `logits`: dtype of the logits the step keeps in `outputs` (accelerate converts the outputs of
      an autocast forward to fp32; DeepSpeed's stay bf16).
    """
    _check(method, strategy, precision)
    if precision == "fp32":
        return dict(compute=4, residual=4, linear_out=4, autocast_copies=False, logits=4)
    autocast = strategy in ("ddp", "model_parallel", "pipeline", "tp", "fsdp_tp")  # accelerate's autocast over fp32 weights
    fp32_embedding = autocast and method in ("full", "qlora")
    return dict(
        compute=2,
        residual=4 if fp32_embedding else 2,
        linear_out=4 if autocast and method == "qlora" else 2,
        autocast_copies=autocast,
        logits=2 if strategy in DEEPSPEED else 4,
    )
