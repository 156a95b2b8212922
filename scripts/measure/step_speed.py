#!/usr/bin/env python
"""Where the LoRA training step's time goes, and what each speed lever is worth: the recipes' own step (their
loss head, adapters, collator and fused AdamW, written out as recipes/lora.py runs it) in one process on one
device, the model built once with random weights.

    python scripts/measure/step_speed.py --output results/DIR            # GPU: the TinyLlama-1.1B headline shape
    python scripts/measure/step_speed.py --cpu --output /tmp/step-speed  # any machine: the plumbing, a tiny shape
    python scripts/measure/step_speed.py --config data/model_configs/codellama-34b.json --batch-size 4 --grad-accum 4 \
        --gradient-checkpointing --variants defaults --output DIR  # the second reference workload's shape

Per variant (the recipes' defaults; each lever alone; all together), --steps optimizer steps of --grad-accum
micro-batches of --batch-size rows x --length tokens, every token a target (the headline's rows): the steady
tokens/s (after --warmup steps), MFU by the project's count (4N + 12·L·h·s per token, bench/flops.py), the
peak memory allocated, and the first and last steps' losses (the adapters start at zero, so the last one
shows what they learnt), so that levers which must not change the numbers are seen not to. Then torch.profiler over --profile-steps steps of the defaults and of the step before the levers
(whole logits, fp32 adapter inputs, dropout 0.05): kernel time by category (matmul, attention, elementwise/norm,
copies/casts, loss, optimizer, other) and the time no kernel ran.

Beside the measurement, the planner's figures for the same launch (one GPU, ddp.yaml): its peak memory and
step time at its default MFU and at the MFU measured here, and the epoch of 1,024 rows this speed gives on
one GPU (a projection, not a run of the epoch).

Not the whole recipe: no accelerate launch, data loader or logging (scripts/measure/benchmark.py times those, through
the real launch). Writes step_speed.json and step_speed.md to --output.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench.flops import CPU_NOMINAL_PEAK_TFLOPS, flop_per_token, table_peak  # noqa: E402
from bench.paths import REPO  # noqa: E402
from bench.shapes import shape_of  # noqa: E402

sys.path.insert(0, str(REPO / "recipes"))

# name -> what differs from the recipes' defaults; levers that must give the same numbers are marked same=True
VARIANTS = {
    "defaults": dict(note="the recipes' defaults: chunked loss head, adapter inputs in bf16, no dropout (eager: "
                          "--no-compile)"),
    "before": dict(whole_logits=True, cast_inputs=True, dropout=0.05,
                   note="the step before these levers: whole logits, adapter inputs cast to fp32, dropout 0.05"),
    "whole_logits": dict(whole_logits=True, same=True, note="the whole batch's logits (no chunks)"),
    "cast_inputs": dict(cast_inputs=True, same=True, note="peft casts each adapter's input to fp32"),
    "dropout": dict(dropout=0.05, note="LoRA dropout 0.05 (the recipes' default before)"),
    "compile": dict(compile=True, note="torch.compile of each decoder layer (the recipes' default with a CUDA GPU)"),
    "liger": dict(liger=True, note="Liger's RMSNorm, RoPE and SwiGLU kernels"),
    "all": dict(compile=True, liger=True, note="compile and Liger on the defaults"),
}
# patched in place and not undone: run after the others
LAST = ("compile", "liger", "all")
CATEGORIES = (  # (category, pattern over the lower-cased kernel name), the first match wins
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("attention", r"flash|fmha|attention|sdpa|softmax_warp|efficient"),
    ("loss", r"cross_entropy|log_softmax|nll_loss|logsoftmax"),
    ("matmul", r"gemm|cutlass|sm90|sm80|cublas|matmul|mm_|addmm|\bmm\b|linear|wgmma|nvjet"),
    ("copies/casts", r"copy|cast|to_copy|convert|fill"),
    ("elementwise/norm", r"elementwise|vectorized|reduce|norm|rsqrt|mul|add|silu|sigmoid|pow|mean|div|cat|index|"
                         r"dropout|bernoulli|triton"),
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the tiny model on the CPU: the plumbing, not a speed")
    parser.add_argument("--config", default=None, help="model config (default: TinyLlama-1.1B's shape; --cpu: the tiny one)")
    parser.add_argument("--batch-size", type=int, default=None, help="rows a micro-batch (default 16; --cpu 2)")
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--length", type=int, default=None, help="tokens a row (default 1024; --cpu 64)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps a variant (default 20; --cpu 4)")
    parser.add_argument("--warmup", type=int, default=None, help="steps left out of the timing (default 5; --cpu 1)")
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=None, help="keep this many of the config's layers (a "
                        "scaled-down stand-in, labelled so)")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="recompute every layer, as "
                        "--gradient-checkpointing does")
    parser.add_argument("--planner-gpu", default="h100", help="the planner's GPU for its figures (a key of "
                        "planner.GPUS; default h100)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS))
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    small = args.cpu
    args.config = Path(args.config or REPO / "data" / ("tiny-llama-config.json" if small else
                                                        "model_configs/tinyllama-1.1b.json"))
    args.batch_size = args.batch_size or (2 if small else 16)
    args.length = args.length or (64 if small else 1024)
    args.steps = args.steps or (4 if small else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if small else 5)
    unknown = [name for name in args.variants.split(",") if name not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant {unknown[0]}; choose from {', '.join(VARIANTS)}")
    return args


def unavailable(variant: dict, device) -> str | None:
    from importlib.util import find_spec

    if variant.get("liger") and (device.type != "cuda" or find_spec("liger_kernel") is None):
        return "needs a CUDA GPU and liger-kernel"
    if variant.get("compile") and device.type != "cuda":
        return "compiles for minutes on a CPU; timed on GPUs only"
    return None


def build_base(config_path: Path, device, layers: int | None = None, checkpointing: bool = False):
    """The frozen base in bf16 on `device`, random weights (the same speed and memory as trained ones)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from common.model.modeling import accept_logits_to_keep, checkpoint_activations

    config = AutoConfig.from_pretrained(config_path)
    if layers:
        config.num_hidden_layers = layers
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.requires_grad_(False)
    accept_logits_to_keep(model)
    if checkpointing:
        checkpoint_activations(model, every_n_layers=1)
    return model


def micro_batches(count: int, rows: int, length: int, vocab: int, device):
    """Rows of random tokens, every token after the first a target, collated as the recipes collate them."""
    import torch

    from common.data.batches import PadToLongest, WithTargetPositions

    collate = WithTargetPositions(PadToLongest(pad_token_id=0), unpadded_without_mask=True)
    generator = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(count):
        ids = torch.randint(3, vocab, (rows, length), generator=generator).tolist()
        batch = collate([{"input_ids": row, "labels": row} for row in ids])
        batches.append({key: value.to(device) for key, value in batch.items()})
    return batches


def adapt(base, variant: dict):
    """LoRA as recipes/lora.py adds it (r 16, alpha 32, every linear layer), adapters in fp32."""
    from peft import LoraConfig, get_peft_model

    from common.launching.launch import DDP, Launch
    from common.model import modeling

    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, lora_dropout=variant.get("dropout", 0.0),
                                            target_modules="all-linear", task_type="CAUSAL_LM"))
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.float()
    modeling.seed_adapter(model, 0)
    if not variant.get("cast_inputs"):
        modeling.keep_adapter_inputs_in_compute_dtype(model, Launch(DDP, 1, True, 1, "bf16"))  # as a bf16 launch
    if variant.get("liger"):
        from transformers.integrations.liger import apply_liger_kernel

        apply_liger_kernel(model, {"fused_linear_cross_entropy": False, "cross_entropy": False})
    if variant.get("compile"):
        modeling.compile_layers(model)
    return model


def run_variant(base, variant: dict, batches, args, device, profile: bool = False) -> dict:
    import torch

    from common.model.loss_head import LossHead
    from lora import token_losses  # the recipe's own loss

    model = adapt(base, variant)
    model.train()
    autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16)  # noqa: E731  (accelerate's bf16)
    head = (LossHead(None, "whole logits, as asked") if variant.get("whole_logits")
            else LossHead(model.get_output_embeddings(), None, autocast))
    trained = [param for param in model.parameters() if param.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-3, fused=device.type == "cuda")  # large enough to show in the loss
    tokens_per_step = sum(int(batch["target_positions"].numel()) * batch["input_ids"].shape[0]
                          for batch in batches[:args.grad_accum])

    def step(micro):
        loss_total = 0.0
        for batch in micro:
            batch = dict(batch)
            labels, positions = batch.pop("labels"), batch.pop("target_positions")
            targets = labels[:, 1:]
            with autocast():
                outputs = model(**batch, use_cache=False, **head.forward_arguments(positions))
                token_loss = head.apply(token_losses, outputs, targets, positions)
            del outputs
            loss_sum = token_loss.sum()
            (loss_sum / tokens_per_step).backward()
            loss_total += loss_sum.detach()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss_total

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize()

    groups = [batches[i:i + args.grad_accum] for i in range(0, len(batches), args.grad_accum)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    first_loss = float(step(groups[0])) / tokens_per_step
    for index in range(1, args.warmup):
        step(groups[index % len(groups)])
    synchronize()
    start = time.perf_counter()
    timed = max(args.steps - args.warmup, 1)
    for index in range(timed):
        last_loss = step(groups[index % len(groups)])
    synchronize()
    seconds = time.perf_counter() - start
    result = {"first_loss": first_loss, "last_loss": float(last_loss) / tokens_per_step, "step_s": seconds / timed, "tokens_per_s": tokens_per_step * timed / seconds,
              "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
              "loss_path": head.description}
    if profile:
        result["profile"] = profile_steps(lambda: step(groups[0]), args.profile_steps, device)
    # the base again, for the next variant (peft's layers taken out; compiled and patched layers stay: run last)
    model.unload()
    return result


def profile_steps(one_step, steps: int, device) -> dict:
    """Kernel time by category over `steps` steps (CPU: operator self time), and the wall time no kernel ran."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as profiler:
        start = time.perf_counter()
        for _ in range(steps):
            one_step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    totals: dict[str, float] = {}
    for event in profiler.key_averages():
        if device.type == "cuda":
            busy = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        else:
            busy = event.self_cpu_time_total if event.key.startswith("aten::") else 0
        if busy:
            category = category_of(event.key)
            totals[category] = totals.get(category, 0.0) + busy / 1e6
    kernels = sum(totals.values())
    return {"wall_s": wall, "kernel_s": totals, "no_kernel_s": max(wall - kernels, 0.0), "steps": steps}


def category_of(name: str) -> str:
    lowered = name.lower()
    for category, pattern in CATEGORIES:
        if re.search(pattern, lowered):
            return category
    return "other"


def main(argv=None) -> dict:
    args = parse_args(argv)  # first: --help answers before torch loads
    import torch

    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")

    built = time.perf_counter()
    base = build_base(args.config, device, args.layers, args.gradient_checkpointing)
    built = time.perf_counter() - built
    shape = shape_of(args.config, args.layers)
    flop = flop_per_token(shape, args.length, "lora", recompute=args.gradient_checkpointing)
    peak = (table_peak(torch.cuda.get_device_name())[0] if device.type == "cuda" and
            table_peak(torch.cuda.get_device_name()) else CPU_NOMINAL_PEAK_TFLOPS) * 1e12
    batches = micro_batches(args.grad_accum * 2, args.batch_size, args.length, shape.vocab, device)
    names = [name for name in args.variants.split(",") if name not in LAST] + \
            [name for name in LAST if name in args.variants.split(",")]
    results = {}
    for name in names:
        variant = VARIANTS[name]
        why_not = unavailable(variant, device)
        if why_not:
            results[name] = {"skipped": why_not, "note": variant["note"]}
            continue
        profile = name in ("defaults", "before") and args.profile_steps > 0
        result = run_variant(base, variant, batches, args, device, profile=profile)
        if device.type == "cuda":  # the variant's adapters, gradients and optimizer state, freed on its return
            torch.cuda.empty_cache()
        result["mfu"] = result["tokens_per_s"] * flop / peak
        results[name] = {**result, "note": variant["note"], "same_numbers_expected": bool(variant.get("same"))}
        print(f"{name}: {result['tokens_per_s']:,.0f} tokens/s, MFU {result['mfu']:.1%}, losses "
              f"{result['first_loss']:.5f} -> {result['last_loss']:.5f}", flush=True)
    record = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (a stand-in: says nothing of GPUs)",
        "shape": args.config.name + (f", {args.layers} of its layers (a stand-in)" if args.layers else ""),
        "batch_size": args.batch_size, "grad_accum": args.grad_accum, "length": args.length,
        "gradient_checkpointing": args.gradient_checkpointing, "steps": args.steps, "warmup": args.warmup,
        "flop_per_token": flop, "peak_tflops": peak / 1e12, "build_s": built, "torch": torch.__version__,
        "variants": results, "planner": planner_figures(shape, args, results.get("defaults", {})),
    }
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    (output / "step_speed.json").write_text(json.dumps(record, indent=2) + "\n")
    (output / "step_speed.md").write_text(markdown(record))
    return record


def planner_figures(shape, args, defaults: dict) -> dict:
    """The planner's peak and step time for this launch (one GPU, ddp.yaml, the recipes' defaults), beside
    what the defaults measured, and the 1,024-row epoch the measured speed gives on one GPU (a projection)."""
    import planner

    common = dict(gradient_checkpointing=int(args.gradient_checkpointing), precision="bf16")
    planned = planner.per_gpu_bytes(shape, "lora", "ddp", 1, batch_size=args.batch_size, seq_len=args.length,
                                    **common)["total"]
    machine = planner.Machine.of(args.planner_gpu)
    step = planner.step_time(shape, "lora", "ddp", 1, machine, args.batch_size, args.grad_accum, args.length,
                             **common)["step"]
    figures = {"gpu": args.planner_gpu, "peak_gib": planned / 2**30, "step_s": step, "mfu": machine.mfu}
    if "step_s" in defaults:
        figures["step_s_at_measured_mfu"] = step * machine.mfu / defaults["mfu"]
        steps = 1024 / (args.batch_size * args.grad_accum)
        figures["epoch_s_one_gpu_projected"] = steps * defaults["step_s"]
        if defaults.get("peak_gib"):
            figures["peak_planned_over_measured"] = figures["peak_gib"] / defaults["peak_gib"]
    return figures


def same_numbers(result: dict, defaults: dict) -> bool:
    """Both steps' losses within 2.5e-4 of the defaults', relative: bf16's round-off over a few steps (the
    tiny model on the CPU: dropout's different masks move the last loss by 6-9e-4, the fp32 cast by < 1e-4)."""
    return all(abs(result[key] - defaults[key]) <= 2.5e-4 * abs(defaults[key]) for key in ("first_loss", "last_loss"))


def markdown(record: dict) -> str:
    lines = [f"# The LoRA step, lever by lever ({record['date']}, {record['device']})", "",
             f"{record['shape']}, {record['batch_size']} rows x {record['length']} tokens, GA {record['grad_accum']}"
             f"{', every layer recomputed' if record['gradient_checkpointing'] else ''}, {record['steps']} steps "
             f"({record['warmup']} left out of the timing), bf16 autocast; the model built in {record['build_s']:.0f} s. "
             f"MFU: {record['flop_per_token'] / 1e9:.2f} GFLOP a token against {record['peak_tflops']:g} TFLOP/s.", "",
             "| variant | tokens/s | MFU | step ms | peak GiB | first loss | last loss | what differs |",
             "|---|---|---|---|---|---|---|---|"]
    defaults = record["variants"].get("defaults", {})
    for name, result in record["variants"].items():
        if "skipped" in result:
            lines.append(f"| {name} | skipped: {result['skipped']} | | | | | | {result['note']} |")
            continue
        peak = f"{result['peak_gib']:.1f}" if result["peak_gib"] is not None else "-"
        same = ""
        if result["same_numbers_expected"] and "last_loss" in defaults:
            same = " (same numbers)" if same_numbers(result, defaults) else " (DIFFERS)"
        lines.append(f"| {name} | {result['tokens_per_s']:,.0f} | {result['mfu']:.1%} | {result['step_s'] * 1e3:.0f} | "
                     f"{peak} | {result['first_loss']:.5f} | {result['last_loss']:.5f}{same} | {result['note']} |")
    plan = record["planner"]
    lines += ["", f"The planner for this launch (one {plan['gpu']}, ddp.yaml): peak {plan['peak_gib']:.1f} GiB, a step "
              f"{plan['step_s']:.2f} s at its default MFU {plan['mfu']:.0%}."]
    if "epoch_s_one_gpu_projected" in plan:
        measured_peak = defaults.get("peak_gib")
        lines.append(f"Measured (the defaults): a step {defaults['step_s']:.2f} s"
                     + (f", peak {measured_peak:.1f} GiB (planned / measured {plan['peak_planned_over_measured']:.2f})"
                        if measured_peak else "")
                     + f"; the planner's step at the measured MFU {plan['step_s_at_measured_mfu']:.2f} s. "
                     f"An epoch of 1,024 rows at this speed on one GPU: {plan['epoch_s_one_gpu_projected'] / 60:.1f} min "
                     "(a projection from the timed steps, not a run of the epoch).")
    for name in ("defaults", "before"):
        profile = record["variants"].get(name, {}).get("profile")
        if profile:
            lines += ["", f"Profile of {name}, {profile['steps']} steps, {profile['wall_s']:.2f} s wall:", "",
                      "| category | seconds | share of wall |", "|---|---|---|"]
            for category, seconds in sorted(profile["kernel_s"].items(), key=lambda item: -item[1]):
                lines.append(f"| {category} | {seconds:.3f} | {seconds / profile['wall_s']:.0%} |")
            lines.append(f"| no kernel running | {profile['no_kernel_s']:.3f} | "
                         f"{profile['no_kernel_s'] / profile['wall_s']:.0%} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
