#!/usr/bin/env python
"""What autograd keeps for one decoder layer, against the planner's per-token figure, on CPU.

    python scripts/measure/measure_activations.py                      # TinyLlama-1.1B's layer, LoRA r16, 1024 tokens
    python scripts/measure/measure_activations.py --model codellama-34b --seq-len 512

One layer = a 2-layer model minus a 1-layer model of the shape (random weights, the frozen base in
bf16 under CPU bf16 autocast, as DDP runs it; LoRA on all linear layers), measured with
torch.autograd.graph.saved_tensors_hooks (unique storages that are not parameters). The difference
also holds autocast's bf16 copies of the layer's fp32 adapters, which the planner counts apart:
they are added to the planner's column here.

With LoRA dropout the two differ by design: CPU's dropout keeps a 4-byte float mask per element,
CUDA's a 1-byte bool, which the planner uses (the GPU is what it plans for). The last column
gives the planner's figure with CPU's masks.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "recipes"))
import planner  # noqa: E402


def saved_by_autograd(model, batch: int, seq_len: int, bf16: bool) -> int:
    """Bytes of the unique storages autograd keeps from one training forward of `model`, parameters
    excluded: random tokens, the last 5 of the first row padded (the masked attention path, as in
    training), under CPU bf16 autocast when `bf16`."""
    import contextlib

    import torch

    ids = torch.randint(4, 300, (batch, seq_len))
    mask = torch.ones(batch, seq_len, dtype=torch.long)
    mask[0, -5:] = 0
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept, held = {}, []

    def pack(tensor):
        held.append(tensor)  # alive until the end: a storage let go of could return at its address as another
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), autocast:
        model(input_ids=ids, attention_mask=mask, labels=ids)
    return sum(kept.values())


def kept_bytes(config: dict, layers: int, seq_len: int, rank: int, dropout: float) -> int:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    llama = LlamaConfig.from_dict({**config, "num_hidden_layers": layers})
    llama._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(llama).to(torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=rank, target_modules="all-linear", lora_dropout=dropout,
                                             task_type="CAUSAL_LM"))
    model.train()
    return saved_by_autograd(model, 1, seq_len, bf16=True)


def main(argv=None) -> int:
    summary, _, details = __doc__.partition("\n")
    parser = argparse.ArgumentParser(description=summary, epilog=details,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tinyllama-1.1b", help="a planner alias or a config.json")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--lora-r", type=int, default=16)
    args = parser.parse_args(argv)
    shape = planner.load_shape(args.model)
    config = json.loads(Path(planner.ALIASES.get(args.model, args.model)).read_text())
    adapters_bf16 = 2 * planner.lora_parameters_per_layer(shape, args.lora_r) / args.seq_len
    print(f"{shape.name or args.model}: one layer, LoRA r{args.lora_r} on all linear layers, {args.seq_len} tokens, "
          "bf16 autocast on CPU; KiB per token")
    print("| lora dropout | measured | planner (+ autocast copies) | planner with CPU's 4-byte masks |")
    print("|---|---|---|---|")
    for dropout in (0.0, 0.05):
        measured = (kept_bytes(config, 2, args.seq_len, args.lora_r, dropout)
                    - kept_bytes(config, 1, args.seq_len, args.lora_r, dropout)) / args.seq_len
        planned = planner.layer_activation_bytes_per_token(shape, "lora", "ddp", args.seq_len, lora_rank=args.lora_r,
                                                           precision="bf16", lora_dropout=dropout) + adapters_bf16
        cpu_masks = planned + 3 * _mask_elements(shape, dropout)
        print(f"| {dropout} | {measured / 1024:.2f} | {planned / 1024:.2f} | {cpu_masks / 1024:.2f} |")
    return 0


def _mask_elements(shape, dropout: float) -> int:
    """Dropout mask elements per token: the inputs of the adapted linears (all of them)."""
    if dropout == 0:
        return 0
    h, f, q = shape.hidden, shape.ffn, shape.heads * shape.head_dim
    return 5 * h + q + f  # q, k, v, gate, up read h; o reads q; down reads f


if __name__ == "__main__":
    sys.exit(main())
