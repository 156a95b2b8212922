"""Activation memory: what autograd keeps from the forward for the backward, the logits and the
loss; per token of one block (`layer_activation_bytes_per_token`) and for one micro-batch on a GPU
(`activation_bytes`)."""

from __future__ import annotations

import math

from .dtypes import compute_dtypes
from .resident import Stage, _stage_parameters
from .shapes import LINEAR_NAMES, ModelShape, lora_target_names
from .strategies import ZERO3, _check, tensor_parallel_size


def layer_activation_bytes_per_token(shape: ModelShape, method: str, strategy: str, seq_len: int,
                                     lora_rank: int = 16, lora_targets="all-linear", precision: str = "bf16",
                                     attention: str = "sdpa", lora_dropout: float = 0.0,
                                     tensor_parallel: int = 1, dora: bool = False, compiled: bool = False,
                                     padded: bool = True) -> float:
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
    5. DoRA (`dora`): each adapted linear also keeps its base output and its adapter's output for the
       magnitude's gradient, (m + c) per output feature (q_proj q, k_proj and v_proj kv, o_proj and
       down_proj h, gate_proj and up_proj f).
    The residual additions keep nothing.

    Tensor parallel over t ranks (tp, fsdp_tp) divides by t what the split projections produce: the
    attention tensors of 3. but the padding mask (each rank runs its heads), the SwiGLU tensors of
    4., and the inputs of o_proj and down_proj (their input width is split); the norms, the
    replicated inputs of the column-split linears and the LoRA tensors stay whole. This division
    is the arithmetic of the split, not yet measured against autograd (DTensor's own copies are
    not in it).

    `padded=False` (every row of the micro-batch as long as the longest: no padding mask, as in
    benchmarks of fixed-length rows): transformers hands sdpa no mask and lets it read the key / value heads
    unrepeated, so sdpa keeps q and out c*q each, k and v c*kv each, the log-sum-exp 4a, and no mask (measured
    on CPU as below: 7.5 KiB a token less for TinyLlama at 256 positions, eager and compiled alike).

    `compiled` (LoRA with --compile: each block one torch.compile graph, whose partitioner recomputes
    pointwise ops in the backward rather than keep their outputs): each RMSNorm keeps its input as it
    comes, r*h + 4 (no fp32 upcast); SwiGLU keeps the gate and up outputs, 2*m*f (SiLU's output is
    recomputed); without dropout each adapted group's input is kept once in c bytes (o_proj's is the
    attention kernel's output, as eager). The rest as above. Measured with the
    same hooks on TinyLlama-1.1B's block on CPU (scripts/measure/measure_activations.py --compile:
    equal to the byte, dropout 0 and 0.05); the rules are the partitioner's, not CUDA's, and other
    methods are planned eager (not measured compiled).

    Checked against `torch.autograd.graph.saved_tensors_hooks` on the tiny Llama (fp32 and bf16
    autocast; full, LoRA and QLoRA; sdpa and eager): equal to the byte, with the CPU's dropout
    mask being a float tensor (4 B) where CUDA's is a bool (1 B, used here).
    """
    _check(method, strategy, precision, attention)
    h, f, a, d = shape.hidden, shape.active_ffn, shape.heads, shape.head_dim  # f: the experts a token passes
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
        if dropout or (x_bytes != c and not compiled):
            return len(lora) * (c + (1 if dropout else 0)) * width
        return 0 if kept_already else c * width

    compiled = compiled and method == "lora"
    norms = 2 * (r * h + 4) if compiled else 2 * (4 * h + 4 + (r * h if full else 0))
    kernel_keeps_output = attention != "eager"
    t = tensor_parallel
    inputs = (saved_input(["q_proj", "k_proj", "v_proj"], h, r)
              + saved_input(["o_proj"], q, c, kept_already=kernel_keeps_output) / t
              + saved_input(["gate_proj", "up_proj"], h, r)
              + saved_input(["down_proj"], f, m) / t)
    lora_outputs = c * lora_rank * len(adapted & set(LINEAR_NAMES))
    if dora:
        widths = {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": h, "gate_proj": f, "up_proj": f, "down_proj": h}
        lora_outputs += (m + c) * sum(width for name, width in widths.items() if name in adapted)
    if attention == "sdpa" and not padded:
        core = (2 * c * q + 2 * c * kv + 4 * a) / t
    elif attention == "sdpa":
        core = (4 * c * q + 4 * a) / t + c * seq_len
    elif attention == "flash":
        core = (2 * c * q + 2 * c * kv + 4 * a) / t
    else:
        core = (3 * c * q + 4 * a * seq_len + (c * a * seq_len if c != 4 else 0)) / t
    mlp = (2 if compiled else 3) * m * f / t
    return float(norms + inputs + lora_outputs + core + mlp)


def chunked_loss(shape: ModelShape, method: str, strategy: str) -> bool:
    """Whether the recipes' loss runs a chunk of positions at a time over the last hidden states
    (model/loss_head.settle; a pipeline's last stage in its schedule): not where the logits are more than the
    head's output, or for full fine-tuning under ZeRO-3 (the trained head's weight is partitioned)."""
    zero3_trained_head = method == "full" and strategy in ZERO3
    return not shape.logits_after_head and not zero3_trained_head


# the recipes' chunk of float32 logits at most (model/loss_head.py, LossHead.chunk_bytes)
CHUNK_BYTES = 256 * 2**20


def loss_bytes(shape: ModelShape, method: str, strategy: str, dt: dict, tokens: float) -> float:
    """The loss's memory for a micro-batch of `tokens` tokens.

    - chunked: the target positions' last hidden states, kept for each chunk's recomputation, c*h a token, and
      its per-token loss, 4; and one chunk's logits at a time, at most CHUNK_BYTES of float32 (all of them when
      they fit): the head's output c, its fp32 copy, the fp32 log-softmax the loss keeps and the fp32 gradient
      in the backward, (c + 12) per element.
    - whole logits: vocab * (logits dtype + 4 + 4) a token: the logits the step's `outputs` holds, the fp32
      log-softmax output the loss keeps, and its fp32 gradient at the start of the backward.
    """
    if chunked_loss(shape, method, strategy):
        chunk = min(tokens * shape.vocab, CHUNK_BYTES / 4)
        return tokens * (dt["compute"] * shape.hidden + 4) + chunk * (dt["compute"] + 12)
    return tokens * shape.vocab * (dt["logits"] + 4 + 4)


def activation_bytes(shape: ModelShape, method: str, strategy: str, batch_size: int, seq_len: int,
                     gradient_checkpointing: int = 0, lora_rank: int = 16, lora_targets="all-linear",
                     precision: str = "bf16", attention: str = "sdpa", lora_dropout: float = 0.0,
                     stage: Stage | None = None, gpus: int = 1, dora: bool = False, compiled: bool = False,
                     padded: bool = True) -> int:
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
    - the loss (`loss_bytes`): chunked over the last hidden states where the recipes' loss
      head runs so (model/loss_head.py), else the whole logits. The recipes compute logits only at
      positions where a row of the micro-batch has a target, so this is the bound that packed or
      plain-text rows reach; prompt-masked rows hold less.
    - autocast copies (DDP / model parallel / tp / fsdp_tp in bf16): autocast's bf16 copy of every
      fp32 trained linear weight (lm_head included) is kept by the backward: 2 bytes per such
      parameter (of the rank's tensor parallel part), whatever the batch.
    - `gpus`: for tp / fsdp_tp, the per-token block term divides as `layer_activation_bytes_per_token`
      says for t = `tensor_parallel_size(strategy, gpus)`; `compiled` and `padded` as it says (no mask when
      not padded).
    """
    stage = stage or Stage(shape.layers)
    tokens = batch_size * seq_len
    dt = compute_dtypes(method, strategy, precision)
    c, r = dt["compute"], dt["residual"]
    h, d = shape.hidden, shape.head_dim
    tp = tensor_parallel_size(strategy, gpus)
    per_layer = layer_activation_bytes_per_token(shape, method, strategy, seq_len, lora_rank, lora_targets,
                                                 precision, attention, lora_dropout, tp, dora, compiled, padded)
    if gradient_checkpointing:
        recomputed = math.ceil(stage.layers / int(gradient_checkpointing))
        kept = stage.layers - recomputed
        blocks = recomputed * r * h + kept * per_layer + (per_layer if recomputed else 0)
    else:
        blocks = stage.layers * per_layer
    once = 16 + 2 * r * d + (seq_len if attention != "flash" and padded else 0)
    logits = 0
    if stage.head:
        full = method == "full"
        head_adapted = method != "full" and "lm_head" in lora_target_names(lora_targets)
        once += 4 * h + 4 + (r * h if full else 0)
        once += c * h if full else ((c + (1 if lora_dropout > 0 else 0)) * h + c * lora_rank if head_adapted else 0)
        logits = loss_bytes(shape, method, strategy, dt, tokens)
    copies = 0
    if dt["autocast_copies"]:
        if method == "full":
            linear = sum(shape.linear_parameters_per_layer().values()) * stage.layers
            copies = 2 * (linear + (shape.vocab * h if stage.head else 0)) / tp
        else:
            copies = 2 * _stage_parameters(shape, method, stage, lora_rank, lora_targets)["trained"]
    return int(tokens * (blocks + once) + logits + copies + (dora_workspace(shape, lora_targets) if dora else 0))


def dora_workspace(shape: ModelShape, lora_targets="all-linear") -> int:
    """The float32 tensors DoRA builds in each adapted linear's forward to take its weight's norm (read from
    peft's code, not measured): an identity of the input width i through the adapter, i*i, and two weight-sized
    matrices, 2*i*o, for the widest adapted linear; one at a time, whatever the batch."""
    adapted = set(lora_target_names(lora_targets))
    return max((4 * (i * i + 2 * i * o) for name, (i, o) in shape.linear_shapes().items() if name in adapted),
               default=0)
