#!/usr/bin/env python
"""How busy pipeline stages are: each stage's compute time over the step's time, for 1, 2, 4 and 8
micro-batches, beside the bubble formula m / (m + p - 1) (interleaved over v parts per process:
v m / (v m + p - 1)) and beside one process running every layer
(model_parallel.yaml's schedule: one device busy at a time, 1 / p of the devices' time).

Runs the recipes' own pipeline (recipes/common/training/pipeline.py: the stage split, torch's schedules) on CPU
processes (gloo), one core each, over a Llama built from a config (random weights: only time is
measured). A stage's busy time is what its `forward_one_chunk` and `backward_one_chunk` take (the
schedule receives before it computes, so waiting is outside); the step's time is the schedule's
`step` on that rank.

    python scripts/measure/pipeline_bubble.py --stages 2 --micro-batches 1 2 4 8 --out results/<folder>
    python scripts/measure/pipeline_bubble.py --stages 2 --micro-batches 2 4 8 --schedule interleaved --chunks 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "recipes"))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--stages", type=int, default=2, help="stages = processes (default: 2, one per core here)")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=2, help="rows per micro-batch")
    parser.add_argument("--schedule", choices=("1f1b", "gpipe", "interleaved"), default="1f1b")
    parser.add_argument("--chunks", type=int, default=2, help="parts of the layers per process (interleaved)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument("--out", default=None, help="folder for results.json and table.md")
    return parser.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help answered before the recipe below loads torch and transformers (seconds)
from lora import token_losses  # noqa: E402  (the recipes' loss: the schedule times what they run)


def build_model(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8,
                         max_position_embeddings=args.seq_len)
    return LlamaForCausalLM(config)


def micro_batches(args, count: int):
    import torch

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 1024, (count, args.batch_size, args.seq_len), generator=generator)
    return [{"input_ids": ids[i], "labels": ids[i].clone(), "attention_mask": torch.ones_like(ids[i])}
            for i in range(count)]


def one_process(args) -> dict:
    """Every layer in one process, micro-batch after micro-batch (what model parallel runs)."""
    import torch

    torch.set_num_threads(1)
    model = build_model(args)
    out = {}
    for count in args.micro_batches:
        batches = micro_batches(args, count)
        times = []
        for step in range(args.steps + 1):
            started = time.perf_counter()
            for batch in batches:
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten()).backward()
            if step:
                times.append(time.perf_counter() - started)
        out[count] = sorted(times)[len(times) // 2]
    return out


def stage_worker(rank: int, args, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    from common.model import pipeline_layout
    from common.training import pipeline

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.stages)
    busy = [0.0]
    base = pipeline._stage_class()

    def timed(method):
        def run(*a, **k):
            started = time.perf_counter()
            try:
                return method(*a, **k)
            finally:
                busy[0] += time.perf_counter() - started
        return run

    class Timed(base):  # the stage's compute, without the waits the schedule does before it
        forward_one_chunk = timed(base.forward_one_chunk)
        backward_one_chunk = timed(base.backward_one_chunk)

    pipeline._stage_class = lambda: Timed
    results = {}
    for count in args.micro_batches:
        model = build_model(args)
        layout = pipeline_layout.PipelineLayout(args.stages, 1, rank, args.layers, chunks_of(args))
        pipe = pipeline.Pipeline(model, layout, torch.device("cpu"), args.schedule, count, pad_token_id=0)
        batches = micro_batches(args, count)
        tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
        steps, shares = [], []
        for step in range(args.steps + 1):
            dist.barrier()
            busy[0] = 0.0
            started = time.perf_counter()
            pipe.train_step(batches, tokens, token_losses)
            elapsed = time.perf_counter() - started
            if step:
                steps.append(elapsed)
                shares.append(busy[0] / elapsed)
        results[count] = {"step_s": sorted(steps)[len(steps) // 2], "busy_share": sorted(shares)[len(shares) // 2]}
        dist.barrier()
    queue.put((rank, results))
    dist.destroy_process_group()


def chunks_of(args) -> int:
    return args.chunks if args.schedule == "interleaved" else 1


def main(argv=None) -> int:
    import socket

    import torch.multiprocessing as mp

    args = parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    workers = [context.Process(target=stage_worker, args=(rank, args, port, queue)) for rank in range(args.stages)]
    for worker in workers:
        worker.start()
    by_rank = dict(queue.get() for _ in workers)
    for worker in workers:
        worker.join()
    alone = one_process(args)
    p, v = args.stages, chunks_of(args)
    rows = []
    for m in args.micro_batches:
        step = max(by_rank[r][m]["step_s"] for r in by_rank)
        rows.append({"micro_batches": m, "formula_busy_share": v * m / (v * m + p - 1),
                     "busy_share_by_stage": [round(by_rank[r][m]["busy_share"], 3) for r in sorted(by_rank)],
                     "pipeline_step_s": round(step, 3), "one_process_step_s": round(alone[m], 3),
                     "one_process_busy_share_of_p_devices": round(1 / p, 3),
                     "speedup_over_one_process": round(alone[m] / step, 2),
                     "formula_speedup": round(p * v * m / (v * m + p - 1), 2)})
    formula = "v m / (v m + p - 1)" if v > 1 else "m / (m + p - 1)"
    header = (f"| micro-batches | busy share by stage (measured) | {formula} | pipeline step | one process | "
              f"speed-up (measured) | p {formula} |\n|---|---|---|---|---|---|---|")
    lines = [header] + [
        f"| {r['micro_batches']} | {', '.join(f'{x:.0%}' for x in r['busy_share_by_stage'])} | "
        f"{r['formula_busy_share']:.0%} | {r['pipeline_step_s']:.2f} s | {r['one_process_step_s']:.2f} s | "
        f"{r['speedup_over_one_process']:.2f}x | {r['formula_speedup']:.2f}x |" for r in rows]
    table = "\n".join(lines)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"arguments": vars(args), "rows": rows}, indent=2) + "\n")
        (out / "table.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
