"""The benchmark behind scripts/measure/benchmark.py, one job per module:

- paths: the repository's folders; recipes/ on sys.path (planner's model shapes, common.data.formats' tokenisation)
- shapes: a model config's shape (planner.ModelShape)
- workloads: the strategies and the reference workloads
- reference: the published reference results, as rows beside ours
- flops: FLOP per token, MFU, the peak table
- timing: the wall-time rule, steady-state speed, metrics.jsonl summaries
- formatting: durations, percentages, slugs
- random_model / random_data: the offline model (random bf16 weights) and data (random words)
- environment: the launches' environment variables, library versions, results.json's environment
- devices: the devices, probed in a child process; which GPUs and which peak a run uses
- gpu_monitor: GPU utilisation and the training window, sampled while a launch runs
- settings: the workload, its strategies and the run's settings, from the flags
- launching: the launch command, one strategy's launch and wait, its row
- row: the parts of a row of results.json
- report / chart: results.md (table, notes, commands), results.json; chart.png
"""

from bench import paths  # noqa: F401  (puts recipes/ on sys.path before any module here imports from it)
