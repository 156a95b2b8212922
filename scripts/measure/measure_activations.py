#!/usr/bin/env python
"""What autograd keeps for one decoder layer, against the planner's per-token figure, on CPU.

    python scripts/measure/measure_activations.py                      # TinyLlama-1.1B's layer, LoRA r16, 1024 tokens
    python scripts/measure/measure_activations.py --model codellama-34b --seq-len 512
    python scripts/measure/measure_activations.py --seq-len 256 --compile        # each block compiled too (~5 min)
    python scripts/measure/measure_activations.py --seq-len 256 --no-padding     # no padding mask (rows of one length)

One layer = a 2-layer model minus a 1-layer model of the shape (random weights, the frozen base in
bf16 under CPU bf16 autocast, as DDP runs it; LoRA on all linear layers, its inputs kept in bf16 as the
recipes keep them: modeling.keep_adapter_inputs_in_compute_dtype), measured with
torch.autograd.graph.saved_tensors_hooks (unique storages that are not parameters). The difference
also holds autocast's bf16 copies of the layer's fp32 adapters, which the planner counts apart:
they are added to the planner's column here.

With LoRA dropout the two differ by design: CPU's dropout keeps a mask in its input's dtype (2 bytes for the
bf16 inputs here), CUDA's a 1-byte bool, which the planner uses (the GPU is what it plans for). The third column
gives the planner's figure with CPU's masks.

--compile adds the same measurement with each decoder layer compiled (torch.compile, as --compile does in the
recipes) beside the planner's `compiled=True` figure; --no-padding feeds rows with no padding (no mask: sdpa reads
the key / value heads unrepeated) beside the planner's `padded=False`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "recipes"))
import planner  # noqa: E402


def saved_by_autograd(model, batch: int, seq_len: int, bf16: bool, padded: bool = True) -> int:
    """Bytes of the unique storages autograd keeps from one training forward of `model`, parameters
    excluded: random tokens, the last 5 of the first row padded when `padded` (the masked attention path, as in
    training), under CPU bf16 autocast when `bf16`."""
    import contextlib

    import torch

    ids = torch.randint(4, 300, (batch, seq_len))
    mask = torch.ones(batch, seq_len, dtype=torch.long)
    if padded:
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


def kept_bytes(config: dict, layers: int, seq_len: int, rank: int, dropout: float, compiled: bool = False,
               padded: bool = True) -> int:
    import torch
    from common.model.modeling import compile_layers, keep_adapter_inputs_in_compute_dtype
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    llama = LlamaConfig.from_dict({**config, "num_hidden_layers": layers})
    llama._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(llama).to(torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=rank, target_modules="all-linear", lora_dropout=dropout,
                                             task_type="CAUSAL_LM"))
    keep_adapter_inputs_in_compute_dtype(model, SimpleNamespace(autocasts=True))  # as the recipes run DDP in bf16
    model.train()
    if compiled:
        compile_layers(model)  # as --compile does
    return saved_by_autograd(model, 1, seq_len, bf16=True, padded=padded)


def main(argv=None) -> int:
    summary, _, details = __doc__.partition("\n")
    parser = argparse.ArgumentParser(description=summary, epilog=details,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tinyllama-1.1b", help="a planner alias or a config.json")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--compile", action="store_true", help="also measure each block compiled")
    parser.add_argument("--no-padding", action="store_true", help="rows with no padding: no attention mask")
    args = parser.parse_args(argv)
    shape = planner.load_shape(args.model)
    config = json.loads(Path(planner.ALIASES.get(args.model, args.model)).read_text())
    adapters_bf16 = 2 * planner.lora_parameters_per_layer(shape, args.lora_r) / args.seq_len
    padded = not args.no_padding
    print(f"{shape.name or args.model}: one layer, LoRA r{args.lora_r} on all linear layers, {args.seq_len} tokens, "
          f"bf16 autocast on CPU, {'a padded row' if padded else 'no padding'}; KiB per token")
    columns = ["lora dropout", "measured", "planner (+ autocast copies)", "planner with CPU's 2-byte masks"]
    if args.compile:
        columns += ["compiled: measured", "compiled: planner (+ autocast copies)"]
    print("| " + " | ".join(columns) + " |")
    print("|---" * len(columns) + "|")
    for dropout in (0.0, 0.05):
        def measured(compiled: bool) -> float:
            return (kept_bytes(config, 2, args.seq_len, args.lora_r, dropout, compiled, padded)
                    - kept_bytes(config, 1, args.seq_len, args.lora_r, dropout, compiled, padded)) / args.seq_len

        def planned(compiled: bool) -> float:
            return planner.layer_activation_bytes_per_token(
                shape, "lora", "ddp", args.seq_len, lora_rank=args.lora_r, precision="bf16", lora_dropout=dropout,
                compiled=compiled, padded=padded) + adapters_bf16

        # CPU's dropout mask is in its input's dtype (bf16 here: 2 bytes), CUDA's a 1-byte bool
        cells = [measured(False), planned(False), planned(False) + _mask_elements(shape, dropout)]
        if args.compile:  # inductor keeps CUDA's 1-byte bool masks on CPU too
            cells += [measured(True), planned(True)]
        print(f"| {dropout} | " + " | ".join(f"{cell / 1024:.2f}" for cell in cells) + " |")
    return 0


def _mask_elements(shape, dropout: float) -> int:
    """Dropout mask elements per token: the inputs of the adapted linears (all of them)."""
    if dropout == 0:
        return 0
    h, f, q = shape.hidden, shape.ffn, shape.heads * shape.head_dim
    return 5 * h + q + f  # q, k, v, gate, up read h; o reads q; down reads f


if __name__ == "__main__":
    sys.exit(main())
