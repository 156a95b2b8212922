"""Will it fit, and which config? The memory arithmetic behind `scripts/plan.py`.

Pure Python: no torch, no GPU. Everything is computed from the model's shape (a config.json)
and counts what the recipes in this folder really allocate on the busiest GPU, in four parts:

- weights: the parameters held on the GPU (stored shards plus the unsharded copies in flight);
- gradients: the gradients of the trained parameters (plus the communication buffers that
  mirror them);
- optimizer: AdamW's two moments (plus DeepSpeed's fp32 master copy);
- activations: what autograd keeps from the forward for the backward, the logits and the loss.

The first three build on `resident_bytes()`: what each rank keeps at rest, i.e. the local part
of every parameter, its gradient and its optimizer state as they stand when the optimizer steps.
That is what every launch measures into run.json's `memory_by_rank` (`runlog.held_bytes`), and
tests/test_plan_vs_ranks.py checks the two against each other on every strategy. The per-GPU
numbers add what is only transient: gathered layers in flight, DDP's bucket copy, DeepSpeed's
reduce bucket, ZeRO-1's unpartitioned gradients of the backward, and the NF4 constants (which
are not parameters).

`plan()` evaluates every strategy of `accelerate_configs/` and recommends two of them:
the one that needs the fewest GPUs and the fastest one that fits on all of them.

Bytes per parameter (they follow `modeling.float_dtype` and each strategy's own rules):

| precision bf16                | trained parameter                    | frozen float | NF4 base linear |
|-------------------------------|--------------------------------------|--------------|-----------------|
| DDP / FSDP / model parallel   | weight 4 + grad 4 + AdamW 8 = 16     | 2 (*)        | 0.5 + 0.0159    |
| DeepSpeed ZeRO-1/2/3          | weight 2 + grad 2 + master 4 + AdamW 8 = 16 | 2     | 0.5 + 0.0159    |

(*) QLoRA's embedding, lm_head and norms are 4 on DDP / model parallel: the QLoRA recipe runs
peft's `prepare_model_for_kbit_training` there, which upcasts them to fp32.
With `precision="fp32"` (what the CPU tests run) every float is 4 bytes and nothing is cast, but
DeepSpeed still trains flat fp32 master partitions of its own, copies of the (already fp32)
weights: a trained parameter costs weight 4 + grad 4 + master 4 + AdamW 8 = 20 B there, against
16 B on DDP / FSDP (measured: 6 B per parameter of optimizer state on each of 2 ZeRO ranks).

Sizes are bytes; the tables print GiB (2**30), and `gpu_memory_gb` is the size a GPU is sold
as ("a 48 GB L40S", "an 80 GB H100"), which is GiB in practice.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

# Offline aliases: the shipped configs, so the planner works without the hub.
ALIASES = {
    "tinyllama-1.1b": REPO_ROOT / "data" / "model_configs" / "tinyllama-1.1b.json",
    "codellama-34b": REPO_ROOT / "data" / "model_configs" / "codellama-34b.json",
    "tiny-llama": REPO_ROOT / "data" / "tiny-llama-config.json",
}

# Strategy -> its config file, in the order of expected speed (fastest first); see `SPEED_ORDER`.
STRATEGIES = {
    "ddp": "accelerate_configs/ddp.yaml",
    "zero1": "accelerate_configs/zero1.yaml",
    "zero2": "accelerate_configs/zero2.yaml",
    "fsdp_grad_op": "accelerate_configs/fsdp_grad_op.yaml",
    "fsdp_hybrid": "accelerate_configs/fsdp_hybrid.yaml",
    "fsdp_full_shard": "accelerate_configs/fsdp.yaml",
    "zero3": "accelerate_configs/zero3.yaml",
    "fsdp_offload": "accelerate_configs/fsdp_offload.yaml",
    "zero3_offload": "accelerate_configs/zero3_offload.yaml",
    "model_parallel": "accelerate_configs/model_parallel.yaml",
}

# Expected speed, fastest first. Traffic per optimizer step and GPU, P = bytes of the parameters
# (frozen ones included where they are sharded) and G = bytes of the trained gradients:
# - ddp: one all-reduce of G (~2G), overlapped with the backward; nothing else.
# - zero1: reduce-scatter G + all-gather of the updated weights: also ~2G, plus bookkeeping.
# - zero2: the same, the gradients reduce-scattered bucket by bucket during the backward.
# - fsdp_grad_op: all-gather P once (forward) + reduce-scatter G; the weights stay gathered
#   until the backward, so it skips full shard's second all-gather.
# - fsdp_hybrid: full-shard traffic inside a shard group only, plus a gradient all-reduce across
#   the groups: cheaper than full shard (most on the fast links).
# - fsdp_full_shard ~ zero3: all-gather P in the forward, again in the backward, reduce-scatter
#   G: ~2P + G, every layer waiting on its all-gather. For LoRA, P is the whole frozen base
#   while G is only the adapters: sharding costs far more than it does for full fine-tuning.
# - fsdp_offload ~ zero3_offload: the same plus every parameter and gradient over PCIe and the
#   optimizer step on the CPU: several times slower.
# - model_parallel: little traffic, but the layers run one GPU after the other, so only ~1/N of
#   the GPUs compute at any time.
SPEED_ORDER = tuple(STRATEGIES)
DEEPSPEED = ("zero1", "zero2", "zero3", "zero3_offload")
FSDP = ("fsdp_full_shard", "fsdp_grad_op", "fsdp_hybrid", "fsdp_offload")
METHODS = ("full", "lora", "qlora")
ATTENTIONS = ("sdpa", "flash", "eager")
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# Keep 10% of every GPU free: the CUDA context (~0.5-1 GiB), NCCL buffers, the caching
# allocator's fragmentation and the short-lived temporaries this model does not itemise.
HEADROOM = 0.9
GiB = 2**30
MAX_MICRO_BATCH = 256

# NF4 with double quantisation (bitsandbytes, blocksize 64): 4 bits per weight, one 8-bit absmax
# per 64 weights, and one fp32 scale per 256 absmax blocks.
NF4_BITS_PER_WEIGHT = 4 + 8 / 64 + 32 / (64 * 256)
# DeepSpeed's gradient reduce bucket: accelerate's generated DeepSpeed config leaves
# `reduce_bucket_size` unset, so DeepSpeed's default of 5e8 elements applies.
DEEPSPEED_REDUCE_BUCKET = 500_000_000
# Transformer layers whose unsharded weights are alive at once under FSDP / ZeRO-3: the one
# computing and the one being prefetched.
LAYERS_IN_FLIGHT = 2


# --------------------------------------------------------------------------------------------
# The model's shape and its parameters
# --------------------------------------------------------------------------------------------

@dataclass
class ModelShape:
    """A Llama-style decoder (Llama, Mistral, Qwen2, CodeLlama, ...): embedding, `layers` blocks of
    (RMSNorm, attention with q/k/v/o, RMSNorm, SwiGLU gate/up/down), a final norm and an lm_head."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied_embeddings: bool = False
    head_dim: int | None = None  # None: hidden // heads
    attention_bias: bool = False
    mlp_bias: bool = False
    name: str = ""

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden // self.heads

    @classmethod
    def from_config(cls, config, name: str = "") -> "ModelShape":
        """From a transformers config object or a config.json dict (a multimodal config's text part)."""
        if not isinstance(config, dict):
            config = config.to_dict() if hasattr(config, "to_dict") else vars(config)
        if "hidden_size" not in config and isinstance(config.get("text_config"), dict):
            config = config["text_config"]
        try:
            heads = int(config["num_attention_heads"])
            return cls(
                hidden=int(config["hidden_size"]),
                layers=int(config["num_hidden_layers"]),
                heads=heads,
                kv_heads=int(config.get("num_key_value_heads") or heads),
                ffn=int(config["intermediate_size"]),
                vocab=int(config["vocab_size"]),
                tied_embeddings=bool(config.get("tie_word_embeddings", False)),
                head_dim=config.get("head_dim") or None,
                attention_bias=bool(config.get("attention_bias", False)),
                mlp_bias=bool(config.get("mlp_bias", False)),
                name=name or str(config.get("_name_or_path") or ""),
            )
        except KeyError as missing:
            raise ValueError(f"not a Llama-style decoder config: {missing} is missing") from None

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of the seven linears of one block."""
        h, q, kv, f = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.ffn
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}

    def linear_parameters_per_layer(self) -> dict[str, int]:
        """in * out (+ out for a bias) for each linear of one block."""
        biased = {"q_proj": self.attention_bias, "k_proj": self.attention_bias, "v_proj": self.attention_bias,
                  "o_proj": self.attention_bias, "gate_proj": self.mlp_bias, "up_proj": self.mlp_bias,
                  "down_proj": self.mlp_bias}
        return {name: i * o + (o if biased[name] else 0) for name, (i, o) in self.linear_shapes().items()}

    def parameter_counts(self) -> dict:
        """The parameters split by kind:

        - embedding = vocab * hidden; lm_head = vocab * hidden, or 0 when tied to the embedding;
        - linear_per_layer: q = h*(a*d), k = v = h*(kv*d), o = (a*d)*h, gate = up = h*f, down = f*h;
          linear = their sum * layers;
        - norms = (2 * layers + 1) * hidden (two RMSNorm weights per block and the final norm).
        """
        per_layer = self.linear_parameters_per_layer()
        counts = {
            "embedding": self.vocab * self.hidden,
            "lm_head": 0 if self.tied_embeddings else self.vocab * self.hidden,
            "linear_per_layer": per_layer,
            "linear": sum(per_layer.values()) * self.layers,
            "norms": (2 * self.layers + 1) * self.hidden,
        }
        counts["total"] = counts["embedding"] + counts["lm_head"] + counts["linear"] + counts["norms"]
        return counts

    @property
    def parameters(self) -> int:
        """All parameters (a tied lm_head counted once)."""
        return self.parameter_counts()["total"]


def load_shape(model: str) -> ModelShape:
    """The shape of `model`: an offline alias (`tinyllama-1.1b`, `codellama-34b`, `tiny-llama`), a
    config .json, a local model folder (its config.json), or a hub id (needs the network or the
    hub cache: `transformers.AutoConfig.from_pretrained`)."""
    key = model.strip()
    path = ALIASES.get(key.lower(), Path(key).expanduser())
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return ModelShape.from_config(json.loads(path.read_text()), name=key)
    if key.endswith(".json") or key.startswith(("/", "./", "../", "~")):
        raise ValueError(f"no config at {key!r}; use an offline alias ({', '.join(ALIASES)}), a config .json, "
                         "a local model folder or a hub id")
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(key)
    except Exception as error:  # offline, unknown id, gated repo, ...
        raise ValueError(
            f"cannot read the config of {key!r} ({type(error).__name__}: {_first_line(error)}); without the "
            f"network use an "
            f"offline alias ({', '.join(ALIASES)}), a config .json or a local model folder"
        ) from None
    return ModelShape.from_config(config, name=key)


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return text[0][:160] if text else "no message"


def lora_target_names(targets) -> list[str]:
    """`all-linear` (peft: every linear of the blocks, never lm_head), a comma-separated string
    or a list of module names (`q_proj` or a longer path ending in it; `lm_head` allowed)."""
    if targets is None or targets == "all-linear":
        return list(LINEAR_NAMES)
    if isinstance(targets, str):
        targets = targets.split(",")
    names = [str(name).strip().rsplit(".", 1)[-1] for name in targets if str(name).strip()]
    unknown = sorted(set(names) - set(LINEAR_NAMES) - {"lm_head"})
    if unknown or not names:
        raise ValueError(f"unknown LoRA target(s) {unknown or targets}: use all-linear or names among "
                         f"{', '.join(LINEAR_NAMES)}, lm_head")
    return list(dict.fromkeys(names))


def lora_parameters_per_layer(shape: ModelShape, rank: int, targets="all-linear") -> int:
    """LoRA parameters of one block: rank * (in + out) for each adapted linear (A is rank x in,
    B is out x rank)."""
    wanted = lora_target_names(targets)
    return sum(rank * (i + o) for name, (i, o) in shape.linear_shapes().items() if name in wanted)


def lora_parameters(shape: ModelShape, rank: int, targets="all-linear") -> int:
    """Trainable adapter parameters: rank * (in + out) per adapted linear, over all layers
    (+ rank * (hidden + vocab) when `lm_head` is a target)."""
    head = rank * (shape.hidden + shape.vocab) if "lm_head" in lora_target_names(targets) else 0
    return lora_parameters_per_layer(shape, rank, targets) * shape.layers + head


def quantized_bytes_per_weight() -> float:
    """NF4 storage per base weight: (4 + 8/64 + 32/(64*256)) / 8 = 0.5159 bytes.

    The packed weights are 4 bits each whatever the storage dtype: bitsandbytes allocates
    (n + 1) // (2 * itemsize) elements of `bnb_4bit_quant_storage` (uint8 on DDP, the float dtype
    under FSDP / ZeRO-3), i.e. n / 2 bytes either way. The constants (8-bit absmax per 64
    weights, fp32 per 256 blocks) are not parameters: FSDP / ZeRO-3 do not shard them.
    """
    return NF4_BITS_PER_WEIGHT / 8


# --------------------------------------------------------------------------------------------
# Bytes per parameter
# --------------------------------------------------------------------------------------------

def _check(method: str, strategy: str, precision: str, attention: str = "sdpa") -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, not {method!r}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {tuple(STRATEGIES)}, not {strategy!r}")
    if precision not in ("bf16", "fp32"):
        raise ValueError(f"precision must be bf16 or fp32, not {precision!r}")
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, not {attention!r}")


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
    if method == "qlora" and precision == "bf16" and strategy in ("ddp", "model_parallel"):
        frozen = 4
    return {
        "trained_weight": 2 if deepspeed_bf16 else 4,
        "trained_grad": 2 if deepspeed_bf16 else 4,
        "trained_optimizer": 12 if strategy in DEEPSPEED else 8,  # DeepSpeed: + its fp32 master, in any precision
        "frozen": frozen,
        "quantized": quantized_bytes_per_weight(),
    }


def compute_dtypes(method: str, strategy: str, precision: str = "bf16") -> dict:
    """The dtypes (bytes) the forward runs in, which decide the size of the saved activations.

    - `compute` c: what matmuls produce: 2 in bf16 (autocast on DDP / model parallel, FSDP2's
      param_dtype, DeepSpeed's bf16 module), 4 in fp32.
    - `residual` r: the residual stream, i.e. the embedding's dtype: fp32 when the embedding is
      stored in fp32 under autocast (full fine-tuning on DDP / model parallel, QLoRA there after
      the upcast), otherwise c.
    - `linear_out` m: the outputs of the block linears: c, except QLoRA on DDP / model parallel,
      whose 4-bit linears return their input's dtype (fp32).
    - `adapter_cast`: the LoRA adapters compute in fp32 while their input is bf16 (DDP / model
      parallel with a bf16 base), so peft casts each adapted module's input: one copy per module.
    - `autocast_copies`: autocast's bf16 copies of the fp32 trained weights (DDP / model parallel),
      saved for the backward.
    - `logits`: dtype of the logits the step keeps in `outputs` (accelerate converts the outputs of
      an autocast forward to fp32; DeepSpeed's stay bf16).
    """
    _check(method, strategy, precision)
    if precision == "fp32":
        return dict(compute=4, residual=4, linear_out=4, adapter_cast=False, autocast_copies=False, logits=4)
    autocast = strategy in ("ddp", "model_parallel")
    fp32_embedding = autocast and method in ("full", "qlora")
    return dict(
        compute=2,
        residual=4 if fp32_embedding else 2,
        linear_out=4 if autocast and method == "qlora" else 2,
        adapter_cast=autocast and method == "lora",
        autocast_copies=autocast,
        logits=2 if strategy in DEEPSPEED else 4,
    )


# --------------------------------------------------------------------------------------------
# Where the parameters live
# --------------------------------------------------------------------------------------------

@dataclass
class Stage:
    """The part of the model one GPU runs: `layers` blocks, and whether it holds the embedding
    (first GPU) and the final norm + lm_head (last GPU). Every strategy but model parallel runs
    the whole model on every GPU."""

    layers: int
    embedding: bool = True
    head: bool = True


def model_parallel_stages(shape: ModelShape, gpus: int) -> list[Stage]:
    """`device_map="auto"` balances the blocks over the GPUs: the first `layers % gpus` GPUs get
    ceil(layers / gpus) blocks, the others floor; the embedding sits on the first GPU, the final
    norm and lm_head on the last (so the busiest GPU is one of those two)."""
    base, extra = divmod(shape.layers, gpus)
    return [Stage(base + (1 if k < extra else 0), embedding=k == 0, head=k == gpus - 1) for k in range(gpus)]


def hybrid_shard_size(gpus: int) -> int:
    """FSDP hybrid shard group size: the largest divisor of N that is <= sqrt(N) (2 on 4 GPUs, the
    2 x 2 mesh of fsdp_hybrid.yaml; 2 on 8; 4 on 16; 1 on 1 or 2 GPUs, i.e. replication only).

    Hybrid sharding pays off when the shard group sits on fast links (one machine) and only the
    replicas talk over the slow ones; on a single machine there is no such boundary, so the
    planner takes the balanced mesh the shipped config uses. Set `dp_shard_size` in the config
    to your GPUs per machine on a cluster, and divide by that instead.
    """
    return max(d for d in range(1, int(math.isqrt(gpus)) + 1) if gpus % d == 0)


def _counts(shape: ModelShape, method: str, lora_rank: int, lora_targets) -> dict:
    """Parameter counts per group: one block's linears / norms / adapters, and the model's edges."""
    counts = shape.parameter_counts()
    lora_layer = lora_parameters_per_layer(shape, lora_rank, lora_targets) if method != "full" else 0
    lora_head = lora_parameters(shape, lora_rank, lora_targets) - lora_layer * shape.layers if method != "full" else 0
    return {
        "layer_linear": sum(counts["linear_per_layer"].values()),
        "layer_norm": 2 * shape.hidden,
        "layer_lora": lora_layer,
        "embedding": counts["embedding"],
        "head": counts["lm_head"] + shape.hidden,  # lm_head + final norm
        "head_lora": lora_head,
    }


def _stage_parameters(shape: ModelShape, method: str, stage: Stage, lora_rank: int, lora_targets) -> dict:
    """Parameters of a stage in three groups: `trained`, `frozen` (stored as floats) and `quantized`."""
    n = _counts(shape, method, lora_rank, lora_targets)
    linear = n["layer_linear"] * stage.layers
    floats = (n["layer_norm"] * stage.layers + (n["embedding"] if stage.embedding else 0)
              + (n["head"] if stage.head else 0))
    lora = n["layer_lora"] * stage.layers + (n["head_lora"] if stage.head else 0)
    if method == "full":
        return {"trained": linear + floats, "frozen": 0, "quantized": 0}
    if method == "lora":
        return {"trained": lora, "frozen": linear + floats, "quantized": 0}
    return {"trained": lora, "frozen": floats, "quantized": linear}


def _unsharded_bytes(shape: ModelShape, method: str, precision: str, layers: int, embedding: bool, head: bool,
                     lora_rank: int, lora_targets) -> float:
    """Bytes of parameters gathered for compute: floats in the compute dtype (FSDP2's param_dtype,
    DeepSpeed's bf16), 4-bit weights as their packed n/2 bytes."""
    params = _stage_parameters(shape, method, Stage(layers, embedding, head), lora_rank, lora_targets)
    c = 4 if precision == "fp32" else 2
    return (params["trained"] + params["frozen"]) * c + params["quantized"] * 0.5


def in_flight_weight_bytes(shape: ModelShape, method: str, strategy: str, precision: str = "bf16",
                           lora_rank: int = 16, lora_targets="all-linear") -> int:
    """Unsharded parameters alive on a GPU on top of its shard.

    - fsdp_full_shard / fsdp_hybrid / fsdp_offload: the root unit (embedding, final norm, lm_head:
      accelerate wraps only the decoder layers, the rest belongs to the root, gathered for the
      whole forward and again for the whole backward) + `LAYERS_IN_FLIGHT` = 2 blocks (the one
      computing, the one prefetched).
    - zero3 / zero3_offload: DeepSpeed gathers module by module: 2 blocks + the larger of the
      embedding and lm_head (gathered while the logits are computed).
    - fsdp_grad_op: reshard-after-forward off: every unit stays gathered from its forward to its
      backward, so at the start of the backward the whole model is unsharded.
    - ddp / zero1 / zero2 / model_parallel: nothing (the weights are already whole).
    QLoRA adds one dequantised linear (the largest, in the compute dtype) on every strategy:
    bitsandbytes dequantises the weight of the linear it runs.
    """
    _check(method, strategy, precision)
    layers = min(LAYERS_IN_FLIGHT, shape.layers)
    if strategy in ("fsdp_full_shard", "fsdp_hybrid", "fsdp_offload"):
        flight = _unsharded_bytes(shape, method, precision, layers, True, True, lora_rank, lora_targets)
    elif strategy in ("zero3", "zero3_offload"):
        blocks = _unsharded_bytes(shape, method, precision, layers, False, False, lora_rank, lora_targets)
        edges = max(_unsharded_bytes(shape, method, precision, 0, True, False, lora_rank, lora_targets),
                    _unsharded_bytes(shape, method, precision, 0, False, True, lora_rank, lora_targets))
        flight = blocks + edges
    elif strategy == "fsdp_grad_op":
        flight = _unsharded_bytes(shape, method, precision, shape.layers, True, True, lora_rank, lora_targets)
    else:
        flight = 0
    if method == "qlora":
        flight += max(i * o for i, o in shape.linear_shapes().values()) * (4 if precision == "fp32" else 2)
    return int(flight)


WHERE = ("gpu", "anywhere")
# The offload configs and the config that holds the same shards when nothing is offloaded.
OFFLOADED = {"fsdp_offload": "fsdp_full_shard", "zero3_offload": "zero3"}


def _divisors(strategy: str, gpus: int, where: str = "gpu") -> tuple[int, int, int]:
    """How many ways (weights, gradients, optimizer) are split at rest; 0 = none of it is there.

    ddp: 1, 1, 1 (all replicated); zero1 and zero2: 1, N, N (ZeRO-1 too holds only its gradient
    partition once the step has reduced the gradients; its unpartitioned gradients of the backward
    are transient, see `gradient_bytes`); zero3 / fsdp_full_shard / fsdp_grad_op: N, N, N (grad-op's
    weights are sharded at rest, its gathered copy is in flight); fsdp_hybrid: G, G, G with
    G = `hybrid_shard_size(N)`; model_parallel: its stage holds everything of its own layers.
    Offload (fsdp_offload, zero3_offload): where="gpu": 0, 0, 0 (in CPU RAM); where="anywhere":
    N, N, N, the shards of their twins fsdp_full_shard / zero3, held in the rank's CPU RAM.
    """
    if where not in WHERE:
        raise ValueError(f"where must be one of {WHERE}, not {where!r}")
    if strategy in OFFLOADED:
        return (0, 0, 0) if where == "gpu" else _divisors(OFFLOADED[strategy], gpus)
    if strategy in ("ddp", "model_parallel"):
        return 1, 1, 1
    if strategy in ("zero1", "zero2"):
        return 1, gpus, gpus
    if strategy == "fsdp_hybrid":
        g = hybrid_shard_size(gpus)
        return g, g, g
    return gpus, gpus, gpus


def _share(value: float, divisor: int) -> float:
    return 0 if divisor == 0 else value / divisor


def _unsharded_state_bytes(shape: ModelShape, method: str, strategy: str, stage: Stage, lora_rank: int,
                           lora_targets, precision: str) -> dict:
    """{"weights", "gradients", "optimizer"} of a stage before any sharding (all ranks' shares together).

    weights = trained * trained_weight + frozen * frozen bytes + quantized * 0.5 (the packed NF4
    weights: n/2 bytes in any storage dtype); gradients = trained * trained_grad; optimizer =
    trained * trained_optimizer (`state_bytes_per_parameter`).
    """
    per = state_bytes_per_parameter(method, strategy, precision)
    params = _stage_parameters(shape, method, stage, lora_rank, lora_targets)
    return {
        "weights": params["trained"] * per["trained_weight"] + params["frozen"] * per["frozen"]
        + params["quantized"] * 0.5,
        "gradients": params["trained"] * per["trained_grad"],
        "optimizer": params["trained"] * per["trained_optimizer"],
    }


def resident_bytes(shape: ModelShape, method: str, strategy: str, gpus: int, lora_rank: int = 16,
                   lora_targets="all-linear", precision: str = "bf16", stage: Stage | None = None,
                   where: str = "gpu") -> dict:
    """What one rank keeps at rest: {"weights", "gradients", "optimizer"} in bytes, as they stand
    when its optimizer steps (the moment run.json's `memory_by_rank` is measured).

    - weights: this rank's part of every model parameter (its ZeRO-3 partition, its FSDP shard or
      the whole tensor): trained * trained_weight + frozen * frozen bytes + quantized * 0.5, / the
      weight divisor. The NF4 constants are not parameters and not in it (`weight_bytes` adds them).
    - gradients: trained * trained_grad / the gradient divisor: DDP's and FSDP's `param.grad` (the
      FSDP shard), DeepSpeed's gradient of its fp32 partition (ZeRO-1 and ZeRO-2: by the step the
      other ranks' parts are freed).
    - optimizer: trained * trained_optimizer / the optimizer divisor: AdamW's m and v, plus
      DeepSpeed's flat fp32 master partitions.

    `where="gpu"` (what the per-GPU plan adds up): the offload configs keep none of it on the GPU.
    `where="anywhere"`: in any memory of the rank (GPU or its CPU RAM): the offload configs hold
    the shards their twins (fsdp_full_shard, zero3) hold on the GPU, in CPU RAM; this is what a
    CPU run measures, where everything is in RAM.

    Not in it, because it comes and goes within a step (`weight_bytes` and `gradient_bytes` add it):
    unsharded layers in flight, DDP's bucket copy, DeepSpeed's reduce bucket, ZeRO-1's
    unpartitioned gradients of the backward; nor the activations.

    The shares are exact fractions, total / divisor, as the ranks hold them when every split
    divides. Where a size does not, the ranks' shares differ by a few elements per parameter (FSDP2
    chunks every parameter's dim 0, so a rank holds up to one row more or less of it; ZeRO-3 pads
    each parameter's partition, ZeRO-1/2 their flat group, to a multiple of the ranks), which the
    planner leaves out.
    """
    _check(method, strategy, precision)
    stage = stage or Stage(shape.layers)
    state = _unsharded_state_bytes(shape, method, strategy, stage, lora_rank, lora_targets, precision)
    divisors = _divisors(strategy, gpus, where)
    return {kind: int(_share(state[kind], divisor)) for kind, divisor in zip(state, divisors)}


def quantization_constant_bytes(shape: ModelShape, method: str, stage: Stage | None = None) -> int:
    """The NF4 constants of QLoRA's 4-bit linears: quantized * (0.5159 - 0.5) bytes, replicated on
    every GPU that computes: they are attributes of the 4-bit weights, not parameters, so FSDP /
    ZeRO-3 do not shard them (with offload they stay on the GPU too). 0 for full and LoRA."""
    if method != "qlora":
        return 0
    stage = stage or Stage(shape.layers)
    quantized = sum(shape.linear_parameters_per_layer().values()) * stage.layers
    return int(quantized * (quantized_bytes_per_weight() - 0.5))


def weight_bytes(shape: ModelShape, method: str, strategy: str, gpus: int, lora_rank: int = 16,
                 lora_targets="all-linear", precision: str = "bf16", stage: Stage | None = None) -> int:
    """Weights on the busiest GPU = resident (`resident_bytes`: the stored parameters / the weight
    divisor) + the NF4 constants (`quantization_constant_bytes`) + the unsharded copies in flight
    (`in_flight_weight_bytes`)."""
    stage = stage or Stage(shape.layers)
    resident = resident_bytes(shape, method, strategy, gpus, lora_rank, lora_targets, precision, stage)["weights"]
    flight = in_flight_weight_bytes(shape, method, strategy, precision, lora_rank, lora_targets)
    return int(resident + quantization_constant_bytes(shape, method, stage) + flight)


def gradient_bytes(shape: ModelShape, method: str, strategy: str, gpus: int, lora_rank: int = 16,
                   lora_targets="all-linear", precision: str = "bf16", stage: Stage | None = None) -> int:
    """Gradients of the trained parameters on the busiest GPU = resident (`resident_bytes`:
    trained * grad bytes / the gradient divisor) + what only lives within a step:

    - DDP (gpus > 1): its reducer keeps the gradients in flat buckets *besides* `param.grad`
      (accelerate's default `gradient_as_bucket_view=False`): one more copy, + trained * grad bytes.
    - ZeRO-1: the backward accumulates whole gradients in `param.grad`; only the step reduces
      them to this rank's partition and frees the rest: the peak is the whole gradient,
      + trained * grad bytes * (1 - 1/N) on top of the partition.
    - DeepSpeed: the reduce bucket, min(trained, 5e8) elements * grad bytes (its default
      `reduce_bucket_size`), also with offload (the gradients are reduced on the GPU).
    - FSDP: nothing extra (the reduce-scatter output is the sharded gradient); offload: none on GPU.
    """
    stage = stage or Stage(shape.layers)
    per = state_bytes_per_parameter(method, strategy, precision)
    trained = _stage_parameters(shape, method, stage, lora_rank, lora_targets)["trained"]
    whole = trained * per["trained_grad"]
    grads = resident_bytes(shape, method, strategy, gpus, lora_rank, lora_targets, precision, stage)["gradients"]
    if strategy == "ddp" and gpus > 1:
        grads += whole
    if strategy == "zero1":  # the whole gradient of the backward, which the partition is cut from
        grads = whole
    if strategy in DEEPSPEED:
        grads += min(trained, DEEPSPEED_REDUCE_BUCKET) * per["trained_grad"]
    return int(grads)


def optimizer_bytes(shape: ModelShape, method: str, strategy: str, gpus: int, lora_rank: int = 16,
                    lora_targets="all-linear", precision: str = "bf16", stage: Stage | None = None) -> int:
    """AdamW state on the busiest GPU, all of it resident (`resident_bytes`): trained * (8, or 12
    with DeepSpeed's fp32 master partitions) / divisor (N for ZeRO-1/2/3 and FSDP, the shard group
    for hybrid, 0 with offload)."""
    return resident_bytes(shape, method, strategy, gpus, lora_rank, lora_targets, precision, stage)["optimizer"]


def cpu_offload_bytes(shape: ModelShape, method: str, strategy: str, gpus: int, lora_rank: int = 16,
                      lora_targets="all-linear", precision: str = "bf16") -> int:
    """CPU RAM the offload variants need for the training state, all processes of a machine
    together: what `resident_bytes` holds anywhere but not on the GPU, i.e. the stored weights, the
    gradients and the optimizer state, unsharded (0 for the strategies that keep everything on the
    GPUs)."""
    if strategy not in OFFLOADED:
        return 0
    state = _unsharded_state_bytes(shape, method, strategy, Stage(shape.layers), lora_rank, lora_targets, precision)
    return int(sum(state.values()))


# --------------------------------------------------------------------------------------------
# Activations
# --------------------------------------------------------------------------------------------

def layer_activation_bytes_per_token(shape: ModelShape, method: str, strategy: str, seq_len: int,
                                     lora_rank: int = 16, lora_targets="all-linear", precision: str = "bf16",
                                     attention: str = "sdpa", lora_dropout: float = 0.05) -> float:
    """Bytes autograd keeps for one Llama block, per token of the micro-batch (no checkpointing).

    Notation: h hidden, f ffn, a heads, d head dim, q = a*d, kv = kv_heads*d, s sequence length,
    R LoRA rank; c, r, m the compute / residual / linear-output bytes of `compute_dtypes`.
    An op keeps only what its backward needs for the inputs that require grad; so a *frozen*
    linear keeps nothing (its input gradient needs only its weight), a trained one keeps its input.

    1. two RMSNorms, each: its input upcast to fp32, 4h (the input itself when r = 4), and
       rsqrt(variance), 4; + the normalised tensor, r*h, when the norm weight is trained (full).
    2. inputs saved by the linears, in c bytes. The norm output (r bytes) feeds q, k, v (and later
       gate, up): one shared copy when it is already in c bytes, else one cast copy per consumer
       (autocast casts at each call). Full fine-tuning: q/k/v input, gate/up input, down input
       (c*f), and for eager attention the o input (c*q; with sdpa / flash the o input is the
       attention kernel's output, already kept in 3.). LoRA, per adapted module with input width
       i: its input once more in c bytes, c*i (peft casts the input to the adapters' dtype and
       autocast casts it back, or dropout produces a new tensor), + the bool dropout mask i when
       lora_dropout > 0 (no copy at all when neither casts nor dropout apply: lora_A then keeps
       the tensor the others keep); + lora_A's output, c*R, kept by lora_B.
    3. attention: sdpa: q after RoPE, k and v repeated to a heads (transformers repeats them when
       a padding mask is passed, as in training), the output: 4*c*q; the log-sum-exp, 4a; and the
       boolean padding mask converted to the compute dtype, c*s (b*s^2 per layer: the one s^2
       term sdpa keeps, small next to eager's). flash (flash_attention_2): q, out c*q each, k, v
       c*kv each, log-sum-exp 4a, no mask (the batch is unpadded). eager: q, k, v (repeated): 3*c*q,
       the fp32 softmax output 4*a*s and its c-byte copy multiplied with v, c*a*s (one tensor in
       fp32).
    4. SwiGLU: gate output (kept by SiLU), SiLU output and up output (kept by their product):
       3*m*f (the down input is counted in 2.).
    The residual additions keep nothing.

    Checked against `torch.autograd.graph.saved_tensors_hooks` on the tiny Llama (fp32 and bf16
    autocast; full, LoRA and QLoRA; sdpa and eager): equal to the byte, with the CPU's dropout
    mask being a float tensor (4 B) where CUDA's is a bool (1 B, used here).
    """
    _check(method, strategy, precision, attention)
    h, f, a, d = shape.hidden, shape.ffn, shape.heads, shape.head_dim
    q, kv = a * d, shape.kv_heads * d
    dt = compute_dtypes(method, strategy, precision)
    c, r, m = dt["compute"], dt["residual"], dt["linear_out"]
    full = method == "full"
    adapted = set(lora_target_names(lora_targets)) if method != "full" else set()
    dropout = lora_dropout > 0

    def saved_input(consumers: list[str], width: int, x_bytes: int, kept_already: bool = False) -> float:
        if full:
            if kept_already:
                return 0
            return (len(consumers) if x_bytes != c else 1) * c * width
        lora = [name for name in consumers if name in adapted]
        if not lora:
            return 0
        if dropout or dt["adapter_cast"] or x_bytes != c:
            return len(lora) * (c + (1 if dropout else 0)) * width
        return 0 if kept_already else c * width

    norms = 2 * (4 * h + 4 + (r * h if full else 0))
    kernel_keeps_output = attention != "eager"
    inputs = (saved_input(["q_proj", "k_proj", "v_proj"], h, r)
              + saved_input(["o_proj"], q, c, kept_already=kernel_keeps_output)
              + saved_input(["gate_proj", "up_proj"], h, r)
              + saved_input(["down_proj"], f, m))
    lora_outputs = c * lora_rank * len(adapted & set(LINEAR_NAMES))
    if attention == "sdpa":
        core = 4 * c * q + 4 * a + c * seq_len
    elif attention == "flash":
        core = 2 * c * q + 2 * c * kv + 4 * a
    else:
        core = 3 * c * q + 4 * a * seq_len + (c * a * seq_len if c != 4 else 0)
    mlp = 3 * m * f
    return float(norms + inputs + lora_outputs + core + mlp)


def activation_bytes(shape: ModelShape, method: str, strategy: str, batch_size: int, seq_len: int,
                     gradient_checkpointing: int = 0, lora_rank: int = 16, lora_targets="all-linear",
                     precision: str = "bf16", attention: str = "sdpa", lora_dropout: float = 0.05,
                     stage: Stage | None = None) -> int:
    """Activation memory of one micro-batch (b sequences of s tokens, T = b*s) on a GPU running
    `stage` (the whole model unless model parallel). Not sharded by FSDP / ZeRO: every GPU runs its
    own micro-batch.

    - blocks: T * layers * `layer_activation_bytes_per_token`; with gradient checkpointing a
      recomputed block keeps only its input, T * r*h (2*b*s*h in bf16), plus one block's full
      activations while it is recomputed in the backward. `gradient_checkpointing` = N recomputes
      every Nth layer (1 or True: all; 0 or False: none), as transformers' `every_n_layers`.
    - per token, once: input ids and labels 16; RoPE cos/sin 2*r*d; the boolean 4D padding mask
      s (sdpa / eager); the final RMSNorm 4h + 4 (+ r*h trained); lm_head's input c*h when it is
      trained (or LoRA-adapted).
    - logits: T * vocab * (logits dtype + 4 + 4): the logits the step's `outputs` holds, the fp32
      log-softmax output the loss keeps, and its fp32 gradient at the start of the backward.
    - autocast copies (DDP / model parallel in bf16): autocast's bf16 copy of every fp32 trained
      linear weight (lm_head included) is kept by the backward: 2 bytes per such parameter,
      whatever the batch.
    """
    stage = stage or Stage(shape.layers)
    tokens = batch_size * seq_len
    dt = compute_dtypes(method, strategy, precision)
    c, r = dt["compute"], dt["residual"]
    h, d = shape.hidden, shape.head_dim
    per_layer = layer_activation_bytes_per_token(shape, method, strategy, seq_len, lora_rank, lora_targets,
                                                 precision, attention, lora_dropout)
    if gradient_checkpointing:
        recomputed = math.ceil(stage.layers / int(gradient_checkpointing))
        kept = stage.layers - recomputed
        blocks = recomputed * r * h + kept * per_layer + (per_layer if recomputed else 0)
    else:
        blocks = stage.layers * per_layer
    once = 16 + 2 * r * d + (seq_len if attention != "flash" else 0)
    logits = 0
    if stage.head:
        full = method == "full"
        head_adapted = method != "full" and "lm_head" in lora_target_names(lora_targets)
        once += 4 * h + 4 + (r * h if full else 0)
        once += c * h if full else ((c + (1 if lora_dropout > 0 else 0)) * h + c * lora_rank if head_adapted else 0)
        logits = shape.vocab * (dt["logits"] + 4 + 4)
    copies = 0
    if dt["autocast_copies"]:
        if method == "full":
            linear = sum(shape.linear_parameters_per_layer().values()) * stage.layers
            copies = 2 * (linear + (shape.vocab * h if stage.head else 0))
        else:
            copies = 2 * _stage_parameters(shape, method, stage, lora_rank, lora_targets)["trained"]
    return int(tokens * (blocks + once + logits) + copies)


# --------------------------------------------------------------------------------------------
# Per GPU, and the plan
# --------------------------------------------------------------------------------------------

def per_gpu_bytes(shape: ModelShape, method: str, strategy: str, gpus: int, batch_size: int = 8,
                  seq_len: int = 512, gradient_checkpointing: int = 0, lora_rank: int = 16,
                  lora_targets="all-linear", precision: str = "bf16", attention: str = "sdpa",
                  lora_dropout: float = 0.05) -> dict:
    """Memory of the busiest GPU: {"weights", "gradients", "optimizer", "activations", "total"} in
    bytes. `batch_size` is the micro-batch per GPU (the recipes' --batch-size), `seq_len` the
    padded length (--max-length is the worst case). Model parallel: the heavier of the GPUs."""
    _check(method, strategy, precision, attention)
    if gpus < 1 or batch_size < 1 or seq_len < 1:
        raise ValueError("gpus, batch_size and seq_len must be >= 1")
    stages = model_parallel_stages(shape, gpus) if strategy == "model_parallel" else [Stage(shape.layers)]
    best = None
    for stage in stages:
        common = dict(lora_rank=lora_rank, lora_targets=lora_targets, precision=precision, stage=stage)
        result = {
            "weights": weight_bytes(shape, method, strategy, gpus, **common),
            "gradients": gradient_bytes(shape, method, strategy, gpus, **common),
            "optimizer": optimizer_bytes(shape, method, strategy, gpus, **common),
            "activations": activation_bytes(shape, method, strategy, batch_size, seq_len, gradient_checkpointing,
                                            attention=attention, lora_dropout=lora_dropout, **common),
        }
        result["total"] = sum(result.values())
        if best is None or result["total"] > best["total"]:
            best = result
    return best


def usable_bytes(gpu_memory_gb: float) -> float:
    """What a plan may use of a GPU: `HEADROOM` (90%) of its memory, GiB-sized."""
    return gpu_memory_gb * GiB * HEADROOM


def fits(total_bytes: int, gpu_memory_gb: float) -> bool:
    """total <= 0.9 * GPU memory: 10% stays free for the CUDA context, NCCL and fragmentation."""
    return total_bytes <= usable_bytes(gpu_memory_gb)


def max_micro_batch(shape: ModelShape, method: str, strategy: str, gpus: int, gpu_memory_gb: float,
                    seq_len: int = 512, gradient_checkpointing: int = 0, lora_rank: int = 16,
                    lora_targets="all-linear", precision: str = "bf16", attention: str = "sdpa",
                    lora_dropout: float = 0.05) -> int:
    """The largest micro-batch (1..256) that fits, by bisection (memory grows with the batch);
    0 when not even one sequence fits."""
    def ok(batch: int) -> bool:
        total = per_gpu_bytes(shape, method, strategy, gpus, batch, seq_len, gradient_checkpointing, lora_rank,
                              lora_targets, precision, attention, lora_dropout)["total"]
        return fits(total, gpu_memory_gb)

    if not ok(1):
        return 0
    low, high = 1, MAX_MICRO_BATCH
    if ok(high):
        return high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if ok(middle) else (low, middle)
    return low


def plan(shape: ModelShape, method: str, gpus: int, gpu_memory_gb: float, batch_size: int = 8,
         seq_len: int = 512, gradient_checkpointing: int = 0, lora_rank: int = 16,
         lora_targets="all-linear", precision: str = "bf16", attention: str = "sdpa",
         lora_dropout: float = 0.05) -> dict:
    """Every strategy on `gpus` GPUs of `gpu_memory_gb`, and the two recommendations.

    - fewest_gpus: the smallest n in 1..gpus on which some strategy fits at this micro-batch;
      among those that fit on n, the fastest (`SPEED_ORDER`: DDP first, then sharding).
    - fastest: the first strategy in `SPEED_ORDER` that fits on all `gpus` GPUs.
    Each names its config file and the largest micro-batch that fits. When nothing fits, both are
    None and `recommendation["reason"]` says what came closest and what to change.
    """
    settings = dict(batch_size=batch_size, seq_len=seq_len, gradient_checkpointing=gradient_checkpointing,
                    lora_rank=lora_rank, lora_targets=lora_targets, precision=precision, attention=attention,
                    lora_dropout=lora_dropout)
    batch_free = {k: v for k, v in settings.items() if k != "batch_size"}

    def evaluate(strategy: str, n: int) -> dict:
        return per_gpu_bytes(shape, method, strategy, n, **settings)

    strategies = []
    for strategy in SPEED_ORDER:
        usage = evaluate(strategy, gpus)
        strategies.append({"strategy": strategy, "config": STRATEGIES[strategy], "per_gpu_bytes": usage,
                           "fits": fits(usage["total"], gpu_memory_gb)})

    fastest = None
    for entry in strategies:
        if entry["fits"]:
            batch = max_micro_batch(shape, method, entry["strategy"], gpus, gpu_memory_gb, **batch_free)
            fastest = {"strategy": entry["strategy"], "config": entry["config"], "max_micro_batch": batch}
            break

    fewest = None
    for n in range(1, gpus + 1):
        for strategy in SPEED_ORDER:
            if fits(evaluate(strategy, n)["total"], gpu_memory_gb):
                batch = max_micro_batch(shape, method, strategy, n, gpu_memory_gb, **batch_free)
                fewest = {"strategy": strategy, "config": STRATEGIES[strategy], "gpus": n, "max_micro_batch": batch}
                break
        if fewest:
            break

    recommendation = {"fewest_gpus": fewest, "fastest": fastest}
    if fewest is None or fastest is None:
        smallest = min(strategies, key=lambda entry: entry["per_gpu_bytes"]["total"])
        recommendation["reason"] = (
            f"nothing fits {gpus} x {gpu_memory_gb:g} GiB at micro-batch {batch_size} x {seq_len} tokens: the "
            f"smallest need is {smallest['per_gpu_bytes']['total'] / GiB:.1f} GiB per GPU ({smallest['strategy']}) "
            f"for {usable_bytes(gpu_memory_gb) / GiB:.1f} GiB usable; try "
            + ("" if gradient_checkpointing else "--gradient-checkpointing, ")
            + "a smaller micro-batch or sequence length, "
            + ("qlora, " if method != "qlora" else "")
            + "or more GPUs"
        )
    return {"model": shape.name, "method": method, "gpus": gpus, "gpu_memory_gb": gpu_memory_gb,
            "strategies": strategies, "recommendation": recommendation}
