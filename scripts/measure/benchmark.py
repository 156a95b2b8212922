#!/usr/bin/env python
"""Benchmark the recipes' strategies on a GPU box: wall time, tokens/s per GPU, MFU, GPU utilisation, memory.

Each strategy is the real recipe through `accelerate launch --config_file accelerate_configs/<config>.yaml
--num_processes <GPUs>` (model parallel: 1 process that spreads the layers over the GPUs), on one epoch of
locally generated data, with the reference workloads of ../shared/notes/performance.md:

  tinyllama     TinyLlama-1.1B shape + LoRA, 1024 rows x 1024 tokens, --batch-size 16 --grad-accum 2;
                strategies model_parallel, ddp, zero2, zero3, qlora_ddp (recipes/qlora.py under ddp.yaml)
  codellama34b  CodeLlama-34B shape + LoRA, 1024 rows x 1024 tokens, --batch-size 4 --grad-accum 4;
                strategies model_parallel, fsdp, zero3; --layers N builds fewer layers when the GPUs (or
                the disk: 63 GiB of bf16 weights) cannot hold all 48

Everything is offline. Models are built from data/model_configs/*.json with random weights (speed does
not depend on their values) as bf16 safetensors, with the bundled tokenizer (data/tokenizer) beside
them, into --model-cache (default results/models/<name>-<layers>L), and reused when present. The data
is 1024 rows of random words, each checked with the tokenizer to be cut by --max-length to exactly that
many tokens (a `text` column: every token but the BOS is a target), in <output-dir>/data/.

What is reported per strategy (results.md, results.json and chart.png in
<output-dir>/<YYYY-MM-DD>_<device>_torch<ver>_transformers<ver>/; each launch's own files are in runs/):

- wall time: the training loop, model loading and compile warm-up apart. metrics.jsonl's clock starts
  after the model is loaded; wall = last step's elapsed_s - first step's elapsed_s + the median step
  duration, i.e. the first step (which includes warm-up / compilation) is replaced by the median step.
- tokens/s per GPU: real tokens (metrics.jsonl's `tokens`, the target tokens of the `text` format, i.e.
  every token but one BOS per row) / wall / GPUs.
- MFU = tokens/s x FLOP/token / (GPUs x peak). LoRA: FLOP/token = 4N + 12 L h s (N: the parameters of
  every matmul, lm_head included, embeddings excluded; L layers, h hidden, s sequence length); with
  --gradient-checkpointing the work done is 6N + 16 L h s, reported separately as "utilisation"
  (recompute included; equal to MFU without checkpointing).
- peak: dense bf16 TFLOP/s per GPU from a table matched on the GPU's name (H100 SXM 989, H100 NVL 835,
  H100 PCIe 756, H200 989, A100 312, RTX 6000 Ada 364, L40S 362), or --peak-tflops, or measured with
  --measure-peak (a large bf16 matmul; used when the GPU is not in the table, otherwise reported beside).
- GPU util: NVML utilisation of the GPUs (pynvml / nvidia-ml-py, else `nvidia-smi`, else n/a),
  sampled every 0.5 s during the launch and averaged over the training steps. NVML counts
  communication kernels as busy: a secondary figure.
- peak memory: the maximum over metrics.jsonl of peak_allocated_gib / peak_reserved_gib (rank 0 / the
  first GPU).

--smoke runs the same path on CPU (2 processes, fp32) with the bundled tiny model, 64 rows x 64 tokens,
strategies ddp,zero2 by default, in well under a minute per strategy. Its peak is a nominal CPU figure
(CPU_NOMINAL_PEAK_TFLOPS per process: one core, 2 AVX2 FMA units x 8 fp32 lanes x 2 FLOP x ~3 GHz),
not a measurement: it only exercises the MFU arithmetic.

Examples:
  python scripts/measure/benchmark.py --workload tinyllama
  python scripts/measure/benchmark.py --workload codellama34b --layers 12 --strategies model_parallel,fsdp
  python scripts/measure/benchmark.py --smoke
"""

from __future__ import annotations

import argparse
import sys

from bench.devices import choose_devices, probe_devices
from bench.environment import environment_record, launch_environment, library_versions
from bench.flops import CPU_NOMINAL_PEAK_TFLOPS
from bench.launching import dry_run_commands, run_strategy
from bench.paths import REPO
from bench.random_data import ensure_data
from bench.report import markdown_table, write_results
from bench.settings import choose_workload, run_settings
from bench.workloads import STRATEGIES


def parse_args(argv=None):
    summary, _, details = __doc__.partition("\n")
    parser = argparse.ArgumentParser(description=summary, epilog=details,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--workload", choices=("tinyllama", "codellama34b"), default="tinyllama",
        help="reference workload to run (default: tinyllama); ignored with --smoke")
    add("--strategies", default=None,
        help=f"comma-separated, among {', '.join(STRATEGIES)} (default: the workload's reference set; "
             "smoke: ddp,zero2)")
    add("--layers", type=int, default=None,
        help="build the model with this many layers (default: all); results then also show a per-layer-scaled "
             "estimate for the full depth, labelled as such")
    add("--smoke", action="store_true",
        help="the same path on CPU with the bundled tiny model: 64 rows x 64 tokens, 2 processes, fp32")
    add("--output-dir", default=str(REPO / "results"),
        help="results root (default: results/); the run writes <output-dir>/<date>_<device>_torch<v>_transformers<v>/")
    add("--model-cache", default=None, help="where built models live (default: <output-dir>/models)")
    add("--gpus", type=int, default=None,
        help="GPUs to use (default: all visible; fewer: the first N of them, via CUDA_VISIBLE_DEVICES)")
    add("--batch-size", type=int, default=None, help="override the workload's micro-batch per process")
    add("--grad-accum", type=int, default=None, help="override the workload's gradient accumulation")
    add("--gradient-checkpointing", action="store_true",
        help="pass --gradient-checkpointing to the recipe; utilisation then counts the recompute (6N + 16 L h s)")
    add("--recipe-args", default="",
        help='more flags for every recipe launch, e.g. "--compile --packing" (scripts/measure/speed_options.py measures them)')
    add("--peak-tflops", type=float, default=None,
        help="dense bf16 peak per GPU in TFLOP/s for MFU (default: the table by GPU name; smoke: "
             f"{CPU_NOMINAL_PEAK_TFLOPS} per CPU process, nominal)")
    add("--measure-peak", action="store_true",
        help="time a large bf16 matmul on the first GPU; used as the peak when the GPU is not in the table")
    add("--timeout", type=float, default=0, help="seconds after which a launch is stopped (default: none)")
    add("--dry-run", action="store_true", help="print the launch commands and exit (builds and runs nothing)")
    return parser.parse_args(argv)


def log(message: str) -> None:
    print(message, flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    workload, names = choose_workload(args.smoke, args.workload, args.strategies)
    env = launch_environment(args.smoke)
    probe = ({"cuda": False, "count": 0} if args.dry_run and args.gpus else probe_devices(args.measure_peak, env))
    versions = library_versions()
    devices = choose_devices(probe, env, smoke=args.smoke, gpus=args.gpus, peak_tflops=args.peak_tflops,
                             dry_run=args.dry_run)
    settings = run_settings(args, workload, devices, versions)  # builds the model when absent
    if args.dry_run:
        for line in dry_run_commands(names, settings):
            print(line)
        return 0

    ensure_data(settings["data"], workload.rows, workload.max_length)
    environment = environment_record(settings["date"], devices, probe, versions, args.smoke)
    folder = settings["folder"]
    print(f"benchmark: {workload.label}; {devices.label}; model {settings['model']} ({settings['layers']} layers); "
          f"data {settings['data']}; peak {devices.peak_tflops:g} TFLOP/s per device ({devices.peak_source}); "
          f"results in {folder}", flush=True)
    rows = [run_strategy(STRATEGIES[name], settings, env, devices.sampler_ids, log) for name in names]
    all_rows = write_results(folder, environment, rows)
    print()
    print(markdown_table(all_rows))
    print(f"\nwritten: {folder / 'results.md'}, {folder / 'results.json'}, {folder / 'chart.png'}")
    return 1 if any(row.get("status") != "ok" for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
