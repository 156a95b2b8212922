#!/usr/bin/env python
"""Measure each speed option of the recipes on and off: the same work, timed through the real launch.

    python scripts/measure/speed_options.py          # GPU box: TinyLlama-1.1B shape + LoRA, 1 GPU, 1024 rows x 1024 tokens
    python scripts/measure/speed_options.py --cpu    # any machine: the bundled tiny model and data, 2 CPU processes, fp32

Each variant is `accelerate launch --config_file accelerate_configs/ddp.yaml recipes/lora.py` with the
recipe's defaults plus the variant's flags (below), one epoch of the same data (two on CPU), and the variants take
turns for --rounds rounds so that a slow minute of the machine does not land on one variant only.

Per variant: the steady-state epoch time (the mean step time after the first --warmup-steps steps, which
hold compilation and allocator warm-up, times the steps of the epoch), target tokens/s over those steady
steps, the speed-up against the defaults, and on GPUs the peak memory. Packing changes the number of steps
(several rows per sequence), so the epoch time is the figure to compare; the tokens are the same.

AdamW's fused kernel is not a flag (the recipes always use it); it is timed apart, in this process: one
optimizer step over the model's trainable parameters (LoRA, and every weight for full fine-tuning),
fused vs foreach (a loop of multi-tensor kernels) vs for-loop (one kernel per tensor).

Writes <output-dir>/<date>_<device>_speed_options/speed_options.md and .json (default output-dir:
results/); each launch's files are in runs/ beside them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The benchmark's pieces (scripts/measure/bench/): its offline model and data builders, launch helpers and timing rule.
from bench.environment import library_versions  # noqa: E402
from bench.formatting import slug  # noqa: E402
from bench.launching import free_port, shell_line  # noqa: E402
from bench.paths import CONFIGS, REPO  # noqa: E402
from bench.random_data import ensure_data  # noqa: E402
from bench.random_model import ensure_model  # noqa: E402
from bench.timing import steady_state  # noqa: E402
from bench.workloads import WORKLOADS  # noqa: E402

# name -> (recipe flags, why it might win)
VARIANTS = {
    "defaults": ([], "fused AdamW, SDPA, padding to the longest row, DataLoader workers on GPUs"),
    "packing": (["--packing"], "several rows per sequence: no padding"),
    "compile": (None, "the other --compile setting than the default (on with a CUDA GPU for LoRA under DDP)"),
    "workers": (None, "the other DataLoader worker setting than the default"),
    "eager": (["--attention", "eager"], "the plain attention instead of SDPA"),
    "checkpointing": (["--gradient-checkpointing"], "recompute every layer: less memory, more compute"),
    "selective": (["--gradient-checkpointing", "2"], "recompute every 2nd layer only"),
    "liger": (["--liger"], "Liger's fused Triton kernels (GPU, liger-kernel installed)"),
}


def variant_flags(name: str, on_gpu: bool) -> list[str]:
    if name == "workers":  # the default is 2 on GPUs and 0 on CPU; measure the other one
        return ["--dataloader-workers", "0" if on_gpu else "2"]
    if name == "compile":  # on by default with a CUDA GPU (launching/settle.py), off on CPU; measure the other one
        return ["--no-compile" if on_gpu else "--compile"]
    return list(VARIANTS[name][0])


def unavailable(name: str, on_gpu: bool) -> str | None:
    from importlib.util import find_spec

    if name == "liger" and not on_gpu:
        return "needs a CUDA GPU"
    if name == "liger" and find_spec("liger_kernel") is None:
        return "liger-kernel is not installed"
    return None


def launch(name: str, flags: list[str], settings: dict, round_index: int) -> dict:
    output = settings["runs"] / f"{name}-round{round_index}"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "ddp.yaml"),
               "--num_processes", str(settings["processes"])]
    if settings["cpu"]:
        command += ["--mixed_precision", "no"]
    command += [str(REPO / "recipes" / "lora.py"), "--model", str(settings["model"]), "--dataset", str(settings["data"]),
                "--output-dir", str(output), "--max-length", str(settings["max_length"]),
                "--batch-size", str(settings["batch_size"]), "--grad-accum", str(settings["grad_accum"]),
                "--report-to", "none", "--log-every", "0", *settings["length"], *flags]
    output.mkdir(parents=True, exist_ok=True)
    shown = shell_line(command)
    port = ["--main_process_port", str(free_port())]  # a free one per launch; not part of what is shown
    with open(output / "launch.log", "w") as log:
        done = subprocess.run(command[:3] + port + command[3:], cwd=REPO, env=settings["env"], stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = (output / "launch.log").read_text(errors="replace").strip().splitlines()[-3:]
        return {"status": "failed", "error": " | ".join(tail)[-300:], "command": shown}
    lines = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines() if line.strip()]
    try:
        return {"status": "ok", "command": shown, **steady_state(lines, settings["warmup_steps"])}
    except ValueError as error:
        return {"status": "failed", "error": f"{error}; lower --warmup-steps or give more data", "command": shown}


def time_adamw(model_dir: Path, device: str, repeats: int = 20) -> list[dict]:
    """Milliseconds per AdamW step, fused / foreach / for-loop, over LoRA's and over all parameters."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    full = [p for p in model.parameters()]
    lora = [p for p in get_peft_model(model, LoraConfig(r=16, target_modules="all-linear")).parameters()
            if p.requires_grad]
    rows = []
    for label, params in (("LoRA r=16, all-linear", lora), ("full fine-tuning", full)):
        for param in params:
            param.grad = torch.randn_like(param)
        row = {"parameters": label, "tensors": len(params), "elements": sum(p.numel() for p in params)}
        for kind, options in (("fused", {"fused": True}), ("foreach", {"foreach": True}),
                              ("for-loop", {"foreach": False})):
            optimizer = torch.optim.AdamW(params, lr=1e-5, **options)
            optimizer.step()  # allocates the moments
            if device == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(repeats):
                optimizer.step()
            if device == "cuda":
                torch.cuda.synchronize()
            row[f"{kind}_ms"] = (time.perf_counter() - started) / repeats * 1000
            optimizer.zero_grad(set_to_none=False)
            del optimizer
        rows.append(row)
    return rows


def markdown(document: dict) -> str:
    base = document["variants"].get("defaults", {}).get("epoch_s")
    lines = [f"# Speed options: {document['workload']}", "",
             f"{document['date']}, {document['device']}, {document['rounds']} round(s) per variant (median shown); "
             f"torch {document['versions'].get('torch')}, transformers {document['versions'].get('transformers')}.",
             f"Steady state: steps after the first {document['warmup_steps']} (warm-up, compilation).", "",
             "| variant | flags | training time (steady) | target tokens/s | vs defaults | peak GiB | final loss |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for name, result in document["variants"].items():
        if result.get("status") != "ok":
            lines.append(f"| {name} | `{' '.join(result.get('flags', []))}` | {result.get('status')}: "
                         f"{result.get('reason') or result.get('error', '')} | | | | |")
            continue
        speedup = f"{base / result['epoch_s']:.2f}x" if base else "-"
        peak = f"{result['peak_allocated_gib']:.1f}" if result.get("peak_allocated_gib") else "-"
        lines.append(f"| {name} | `{' '.join(result['flags']) or '(none)'}` | {result['epoch_s']:.2f} s | "
                     f"{result['tokens_per_s']:,.0f} | {speedup} | {peak} | {result['final_loss']:.4f} |")
    lines += ["", "AdamW step (ms; the recipes use fused):", "",
              "| parameters | tensors | elements | fused | foreach | for-loop |", "|---|---:|---:|---:|---:|---:|"]
    for row in document["adamw"]:
        lines.append(f"| {row['parameters']} | {row['tensors']} | {row['elements']:,} | {row['fused_ms']:.2f} | "
                     f"{row['foreach_ms']:.2f} | {row['for-loop_ms']:.2f} |")
    lines += ["", "Commands (round 1):", ""]
    lines += [f"- {name}: `{result['command']}`" for name, result in document["variants"].items() if "command" in result]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    summary, _, details = __doc__.partition("\n")
    parser = argparse.ArgumentParser(description=summary, epilog=details,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--cpu", action="store_true", help="bundled tiny model and data on 2 CPU processes, fp32 (also on a GPU box)")
    add("--variants", default=",".join(VARIANTS), help=f"comma-separated among {', '.join(VARIANTS)}")
    add("--rounds", type=int, default=3, help="times each variant runs, in turns (median reported)")
    add("--max-steps", type=int, default=0, help="stop each run after N steps (default: one epoch; CPU: two)")
    add("--warmup-steps", type=int, default=5, help="first steps left out of the steady state")
    add("--batch-size", type=int, default=None, help="micro-batch per process (default: 4 on CPU, 16 on a GPU)")
    add("--output-dir", default=str(REPO / "results"))
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    names = [name.strip() for name in args.variants.split(",") if name.strip()]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown:
        sys.exit(f"error: unknown variants {unknown}; choose among {', '.join(VARIANTS)}")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}
    import torch

    on_gpu = torch.cuda.is_available() and not args.cpu
    if args.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif not on_gpu:
        sys.exit("error: no GPU visible; run with --cpu for the bundled tiny model on CPU")
    output_root = Path(args.output_dir).resolve()
    date = datetime.date.today().isoformat()
    if on_gpu:
        workload = WORKLOADS["tinyllama"]
        model = ensure_model(workload, 22, output_root / "models")
        data = ensure_data(output_root / "data" / f"text-{workload.rows}x{workload.max_length}",
                           workload.rows, workload.max_length)
        device = torch.cuda.get_device_name(0)
        settings = dict(processes=1, max_length=workload.max_length, batch_size=args.batch_size or 16, grad_accum=2,
                        epochs=1, label="TinyLlama-1.1B shape + LoRA, 1024 rows x 1024 tokens, 1 GPU, bf16")
    else:
        model = ensure_model(WORKLOADS["smoke"], 2, output_root / "models")
        data = REPO / "data"
        device = "2 CPU processes"
        # The bundled rows are short (~15 tokens): at --max-length 128 packing puts ~8 in a sequence and
        # still leaves enough steps to time; two epochs give every variant a few hundred steps.
        settings = dict(processes=2, max_length=128, batch_size=args.batch_size or 4, grad_accum=1, epochs=2,
                        label="bundled tiny Llama + LoRA, bundled data (1920 short rows x 2 epochs), "
                              "--max-length 128, 2 CPU processes, fp32")
    folder_name = f"{date}_{slug(device.replace('NVIDIA ', ''))}_speed_options"
    settings.update(cpu=not on_gpu, model=model, data=data, env=env, warmup_steps=args.warmup_steps,
                    runs=output_root / folder_name / "runs",
                    length=["--max-steps", str(args.max_steps)] if args.max_steps else ["--epochs", str(settings["epochs"])])
    print(f"speed options: {settings['label']}; {args.rounds} round(s) of {', '.join(names)}", flush=True)

    results = {name: [] for name in names}
    for round_index in range(1, args.rounds + 1):
        for name in names:
            reason = unavailable(name, on_gpu)
            if reason:
                continue
            flags = variant_flags(name, on_gpu)
            result = launch(name, flags, settings, round_index)
            results[name].append(result)
            shown = (f"{result['epoch_s']:.2f} s/epoch, {result['tokens_per_s']:,.0f} target tokens/s"
                     if result["status"] == "ok" else f"FAILED: {result['error']}")
            print(f"round {round_index} {name:>13}: {shown}", flush=True)

    variants = {}
    for name in names:
        flags = variant_flags(name, on_gpu)
        reason = unavailable(name, on_gpu)
        good = [r for r in results[name] if r["status"] == "ok"]
        if reason:
            variants[name] = {"status": "skipped", "reason": reason, "flags": flags}
        elif not good:
            variants[name] = {**results[name][0], "flags": flags}
        else:
            middle = sorted(good, key=lambda r: r["epoch_s"])[len(good) // 2]
            variants[name] = {**middle, "flags": flags, "command": good[0]["command"],
                              "epoch_s_all": [round(r["epoch_s"], 3) for r in good]}
    document = {"date": date, "device": device, "workload": settings["label"], "rounds": args.rounds,
                "warmup_steps": args.warmup_steps, "versions": library_versions(), "variants": variants,
                "adamw": time_adamw(model, "cuda" if on_gpu else "cpu")}
    text = markdown(document)
    folder = output_root / folder_name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "speed_options.md").write_text(text)
    (folder / "speed_options.json").write_text(json.dumps(document, indent=2) + "\n")
    print("\n" + text)
    print(f"written: {folder / 'speed_options.md'}")
    return 1 if any(v.get("status") == "failed" for v in variants.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
