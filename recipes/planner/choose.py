"""Per GPU, and the plan: the busiest GPU's total (`per_gpu_bytes`), what a GPU may hold (`usable_bytes`,
`fits`), the largest micro-batch that fits (`max_micro_batch`), and `plan()`, which evaluates every
strategy and recommends two of them.

Sizes are bytes; the tables print GiB (2**30), and `gpu_memory_gib` is one GPU's memory as CUDA gives it
(torch's `total_memory` / 2**30: 79.2 for an 80 GB H100, 47.5 for a 48 GB RTX 6000 Ada; `Gpu.memory_gib`).
"""

from __future__ import annotations

from .activations import activation_bytes
from .evidence import RAN_ON_GPU
from .generation import generation_bytes
from .host_load import load_bytes_per_machine
from .peak import gradient_bytes, optimizer_bytes, weight_bytes
from .resident import Stage, model_parallel_stages
from .shapes import ModelShape
from .strategies import (
    SPEED_ORDER,
    STRATEGIES,
    _check,
    check_pipeline_layout,
    impossible,
    offered_strategies,
    pipeline_layouts,
    sequence_layouts,
    uneven_global_batch,
)
from .timing import Machine, data_parallel_size, epoch_time, reference_pass_time, step_time
from .vision import VisionShape, vision_bytes

# Keep 10% of every GPU free: the CUDA context (~0.5-1 GiB), NCCL buffers, the caching
# allocator's fragmentation and the short-lived temporaries this model does not itemise.
HEADROOM = 0.9
GiB = 2**30
MAX_MICRO_BATCH = 256
# A run above 90% of the usable memory is tight (a longer row, a fragmented cache): not recommended
# while another fits with margin.
MARGIN = 0.9
# Estimates closer than 3% are a tie: an estimate does not split such hairs.
TIE = 0.03
# A config no GPU has run in this project is launched before the fastest one that has run only when its estimate
# is this many times faster: where measured, the estimate's ratios came within 30% of the measured ones, so a
# smaller lead could be the error of the two estimates (and an unrun config's own is unchecked).
CLEARLY_FASTER = 2.0


def per_gpu_bytes(shape: ModelShape, method: str, strategy: str, gpus: int, batch_size: int = 8,
                  seq_len: int = 512, gradient_checkpointing: int = 0, lora_rank: int = 16,
                  lora_targets="all-linear", precision: str = "bf16", attention: str = "sdpa",
                  lora_dropout: float = 0.0, grad_accum: int = 1, pipeline_stages: int | None = None,
                  pipeline_chunks: int = 1, pairs: bool = False, dora: bool = False,
                  sequence_parallel: int | None = None, generation_rows: int = 0, starting_copy: bool = False,
                  compiled: bool = False, padded: bool = True, vision: VisionShape | None = None,
                  train_vision_tower: bool = False, train_projector: bool = False,
                  image_tokens: int | None = None) -> dict:
    """Memory of the busiest GPU: {"weights", "gradients", "optimizer", "activations", "total"} in
    bytes; the total is their sum, except for full fine-tuning without a gradient wrapper (one process,
    model parallel), where gradients replace activations in the backward. `batch_size` is the micro-batch per GPU (the recipes' --batch-size), `seq_len` the
    padded length (--max-length is the worst case). Model parallel and pipeline: the heavier of the
    GPUs. A pipeline has `pipeline_stages` stages (default: one per GPU; fewer are replicated over the
    rest, each replica the same) of `pipeline_chunks` parts each: under 1F1B stage k of p holds the
    activations of up to min(p - k, grad_accum) micro-batches at once (a micro-batch's backward starts
    once it has passed every later stage); under the interleaved schedule up to min(v m, (v - 1) p +
    2 (p - 1 - k) + 1) parts of 1/v of its layers each, torch's warm-up plus one. With `pairs`, `batch_size`
    counts preference pairs: two rows each in one forward (a LoRA reference's forward, without gradients,
    keeps less than the training forward does). Sequence parallel (sp) holds zero3's state and the activations
    of its slice, `seq_len / sequence_parallel` positions (a group of 2 by default, sp.yaml's): its attention
    runs the whole sequence on 1/group of the heads, the same bytes. With `generation_rows` (grpo.py: the
    completions a rank samples at once), "generation" is the peak while it samples (`generation.py`), and the total
    the larger of that and the training step's. With `starting_copy` (grpo_full.py --beta: the weights as loaded
    kept as the reference, `training.reference.StartingWeights`), "reference": one more copy of what the GPU holds
    of the weights, through the step and the sampling (none under offload: the copy stays in host RAM).
    `compiled`: each block compiled (--compile), which keeps less of a LoRA block; `padded=False`: rows all of the
    micro-batch's length, no padding mask (activations.py). `vision`: a vision-language model's vision tower and
    projector (vision.py), trained as `train_vision_tower` and `train_projector` say, added to each part on the GPU
    that runs them (the first under model parallel); "vision" then says what they added in all. `image_tokens`: the
    image tokens of a row (None: every position of `seq_len`, the worst it allows)."""
    _check(method, strategy, precision, attention)
    if gpus < 1 or batch_size < 1 or seq_len < 1:
        raise ValueError("gpus, batch_size and seq_len must be >= 1")
    why_not = impossible(method, strategy, gpus, shape, lora_targets)
    if why_not:
        raise ValueError(f"{method} with {strategy} on {gpus} GPU(s) does not run: {why_not}")
    staged = strategy in ("model_parallel", "pipeline")
    p, v = (pipeline_stages or gpus, pipeline_chunks) if strategy == "pipeline" else (gpus, 1)
    if strategy == "pipeline":
        check_pipeline_layout(gpus, p, v, shape.layers)
    if strategy == "sp":
        group = sequence_parallel or 2
        if group not in sequence_layouts(gpus, shape):
            raise ValueError(f"a sequence parallel group of {group} does not run on {gpus} GPUs and "
                             f"{shape.heads} / {shape.kv_heads} heads")
        seq_len = -(-seq_len // group)
    stages = model_parallel_stages(shape, p) if staged else [Stage(shape.layers)]
    best = None
    for index, stage in enumerate(stages):
        in_flight = 1
        if strategy == "pipeline":
            in_flight = (min(p - index, grad_accum) if v == 1 else
                         min(v * grad_accum, (v - 1) * p + 2 * (p - 1 - index) + 1) / v)
        common = dict(lora_rank=lora_rank, lora_targets=lora_targets, precision=precision, stage=stage)
        result = {
            "weights": weight_bytes(shape, method, strategy, gpus, **common),
            "gradients": gradient_bytes(shape, method, strategy, gpus, **common),
            "optimizer": optimizer_bytes(shape, method, strategy, gpus, **common),
            "activations": activation_bytes(shape, method, strategy, batch_size * (2 if pairs else 1) * in_flight, seq_len,
                                            gradient_checkpointing,
                                            attention=attention, lora_dropout=lora_dropout, gpus=gpus, dora=dora,
                                            compiled=compiled, padded=padded, **common),
        }
        added = {}
        if vision is not None and stage.embedding:
            added = vision_bytes(vision, method, strategy, gpus, batch_size * (2 if pairs else 1),
                                 min(image_tokens or seq_len, seq_len), lora_rank, precision, train_vision_tower,
                                 train_projector)
            for part, value in added.items():
                result[part] += value
        if starting_copy:  # kept where the shards are: in host RAM under the offload strategies
            result["reference"] = 0 if "offload" in strategy else result["weights"]
        result["total"] = sum(result.values())
        if method == "full" and (strategy == "model_parallel" or (strategy == "ddp" and gpus == 1)):
            # No wrapper holds gradient buckets: the backward frees each layer's activations as it writes its
            # gradients, so the peak is the larger of the two, the LM head's gradient (written first) beside
            # every activation (one H100 and one H200, TinyLlama-1.1B full at micro-batch 2: 19.5 GiB measured
            # where the sum planned 24.0; results/2026-11-27_h200_call1)
            head = min(result["gradients"], shape.vocab * shape.hidden * 4 if stage.head else 0)
            result["total"] = (result["weights"] + result["optimizer"] + result.get("reference", 0)
                               + max(result["activations"] + head, result["gradients"]))
        if generation_rows:
            sampling = generation_bytes(shape, method, strategy, generation_rows, seq_len, lora_rank, lora_targets,
                                        precision)
            result["generation"] = (result["gradients"] + result["optimizer"] + result.get("reference", 0)
                                    + sum(sampling.values()))
            result["total"] = max(result["total"], result["generation"])
        if added:
            result["vision"] = sum(added.values())
        if best is None or result["total"] > best["total"]:
            best = result
    return best


def usable_bytes(gpu_memory_gib: float) -> float:
    """What a plan may use of a GPU: `HEADROOM` (90%) of its memory, GiB-sized."""
    return gpu_memory_gib * GiB * HEADROOM


def fits(total_bytes: int, gpu_memory_gib: float) -> bool:
    """total <= 0.9 * GPU memory: 10% stays free for the CUDA context, NCCL and fragmentation."""
    return total_bytes <= usable_bytes(gpu_memory_gib)


def max_micro_batch(shape: ModelShape, method: str, strategy: str, gpus: int, gpu_memory_gib: float,
                    seq_len: int = 512, gradient_checkpointing: int = 0, lora_rank: int = 16,
                    lora_targets="all-linear", precision: str = "bf16", attention: str = "sdpa",
                    lora_dropout: float = 0.0, grad_accum: int = 1, pairs: bool = False, dora: bool = False,
                    compiled: bool = False, vision: VisionShape | None = None, train_vision_tower: bool = False,
                    train_projector: bool = False, image_tokens: int | None = None, **pipeline_layout) -> int:
    """The largest micro-batch (1..256) that fits, by bisection (memory grows with the batch);
    0 when not even one sequence fits. `pipeline_layout`: `per_gpu_bytes`'s pipeline_stages and
    pipeline_chunks, or sequence_parallel; `vision` and the rest: its vision side's."""
    def ok(batch: int) -> bool:
        total = per_gpu_bytes(shape, method, strategy, gpus, batch, seq_len, gradient_checkpointing, lora_rank,
                              lora_targets, precision, attention, lora_dropout, grad_accum,
                              **pipeline_layout, pairs=pairs, dora=dora, compiled=compiled, vision=vision,
                              train_vision_tower=train_vision_tower, train_projector=train_projector,
                              image_tokens=image_tokens)["total"]
        return fits(total, gpu_memory_gib)

    if not ok(1):
        return 0
    low, high = 1, MAX_MICRO_BATCH
    if ok(high):
        return high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if ok(middle) else (low, middle)
    return low


def _divisors_descending(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def best_run(shape: ModelShape, method: str, strategy: str, gpus: int, gpu_memory_gib: float, machine: Machine,
             batch_size: int = 8, grad_accum: int = 1, seq_len: int = 512, gradient_checkpointing: int = 0,
             global_batch: int | None = None, **settings) -> dict | None:
    """The fastest way `strategy` runs the asked step on `gpus` GPUs, or None when nothing fits.

    The rows per process stay as asked (batch_size x grad_accum), or with `global_batch` (the recipes'
    --global-batch-size) the rows per step: each data-parallel process takes global_batch / their number,
    in micro-batches of at most batch_size (`global_batch_refusal` says when that cannot be). A micro-batch
    that does not fit becomes a smaller divisor of the rows per process with more accumulation, and when
    the launch asks for no gradient checkpointing, checkpointing every layer is tried as well (it costs a
    forward, and can buy a micro-batch large enough to hide a sharded strategy's gathers). A run above
    `MARGIN` of the usable memory is `tight`: any run with margin ranks before it (`rank_key`).

    A pipeline also tries its layouts (`pipeline_layouts`: fewer stages replicated, the interleaved
    schedule's 2 parts per stage), each with the micro-batches its schedule takes (1F1B: at least one
    per stage; interleaved: a multiple of the stages); the run names its `pipeline_stages` and
    `pipeline_chunks`, and a layout within `TIE` of the fastest gives way to a simpler one (one pipeline
    over all the GPUs, 1F1B). Sequence parallel tries its groups (`sequence_layouts`), the smallest the
    simplest; the run names its `sequence_parallel`."""
    runs = []
    gradient_checkpointing = int(gradient_checkpointing)
    for order, layout in enumerate(layouts_of(strategy, gpus, shape)):
        stages, chunks = layout.get("pipeline_stages"), layout.get("pipeline_chunks", 1)
        ranks = data_parallel_size(strategy, gpus, stages, layout.get("sequence_parallel"))
        if global_batch and global_batch % ranks:  # as the recipes refuse
            continue
        per_rank = global_batch // ranks if global_batch else batch_size * grad_accum
        micros = [micro for micro in _divisors_descending(per_rank) if micro <= batch_size]
        for every in ([gradient_checkpointing] if gradient_checkpointing else [0, 1]):
            for micro in micros:
                accum = per_rank // micro
                if stages and (accum < stages if chunks == 1 else accum % stages):  # as the recipes refuse
                    continue
                total = per_gpu_bytes(shape, method, strategy, gpus, micro, seq_len, every, **settings,
                                      grad_accum=accum, **layout)["total"]
                if not fits(total, gpu_memory_gib):
                    continue
                time = step_time(shape, method, strategy, gpus, machine, micro, accum, seq_len, every,
                                 settings.get("lora_rank", 16), settings.get("lora_targets", "all-linear"),
                                 settings.get("precision", "bf16"), **layout, pairs=settings.get("pairs", False))
                runs.append((order, {"micro_batch": micro, "grad_accum": accum, "gradient_checkpointing": every,
                                     "global_batch": time["global_batch"], "total_bytes": total,
                                     "tight": total > MARGIN * usable_bytes(gpu_memory_gib), "time": time,
                                     **layout}))
    return simplest_of_the_fastest(runs)[1] if runs else None


def global_batch_refusal(strategy: str, gpus: int, global_batch: int, shape: ModelShape | None = None) -> str | None:
    """Why `strategy` on `gpus` GPUs cannot run `global_batch` rows per step, in one line naming the fix,
    as the recipes would refuse it (None: it can). The rows must split evenly over the data-parallel
    processes (a pipeline's replicas, sequence parallel's groups), and a pipeline needs a micro-batch per
    stage at least (`shape`: the model, whose layers and heads bound the layouts)."""
    layouts = layouts_of(strategy, gpus, shape)
    reasons = []
    for layout in layouts:
        stages = layout.get("pipeline_stages")
        ranks = data_parallel_size(strategy, gpus, stages, layout.get("sequence_parallel"))
        uneven = uneven_global_batch(global_batch, ranks)
        if uneven:
            reasons.append(uneven)
        elif stages and global_batch // ranks < stages:
            reasons.append(f"--global-batch-size {global_batch} gives each pipeline of {stages} stages "
                           f"{global_batch // ranks} rows a step, fewer than its stages; use {stages * ranks} or more")
        else:
            return None
    return reasons[0] if reasons else None


def layouts_of(strategy: str, gpus: int, shape: ModelShape | None = None) -> list[dict]:
    """The layouts `strategy` is tried in on `gpus` GPUs, simplest first, as `per_gpu_bytes` takes them: a
    pipeline's (`pipeline_layouts`), sequence parallel's groups (`sequence_layouts`), {} for the others."""
    if strategy == "pipeline":
        return [dict(pipeline_stages=stages, pipeline_chunks=chunks)
                for stages, chunks in pipeline_layouts(gpus, shape.layers if shape else None)]
    if strategy == "sp":
        return [dict(sequence_parallel=group) for group in sequence_layouts(gpus, shape)]
    return [{}]


def layout_of(run: dict) -> dict:
    """A run's layout as `per_gpu_bytes` takes it: a pipeline's stages and parts, sequence parallel's group
    ({} for the other strategies)."""
    return {key: run[key] for key in ("pipeline_stages", "pipeline_chunks", "sequence_parallel") if key in run}


def rank_key(run: dict) -> tuple:
    """Runs with memory margin first, then the most tokens per second."""
    return run["tight"], -run["time"]["tokens_per_s"]


def fastest_of(runs: list[tuple[str, dict]]) -> tuple[str, dict]:
    """The fastest (strategy, run): the first by `rank_key`, except that estimates within `TIE` of it are a
    tie, which goes to a config that has run on a GPU in this project (`RAN_ON_GPU`), then to the simpler
    (the earlier in `SPEED_ORDER`)."""
    order, run = simplest_of_the_fastest([((strategy not in RAN_ON_GPU, SPEED_ORDER.index(strategy)), run)
                                          for strategy, run in runs])
    return SPEED_ORDER[order[1]], run


def tested_beside(runs: list[tuple[str, dict]]) -> tuple[tuple[str, dict] | None, bool]:
    """(the fastest run of a strategy that has run on a GPU here (`RAN_ON_GPU`), or None when the fastest of
    `runs` is one itself or none of them is; whether to launch it first). It is launched first unless the
    fastest, which has not run on a GPU, is `CLEARLY_FASTER` by the estimate; a tested run is weighed only
    with as much memory margin as the fastest has."""
    fastest = fastest_of(runs)
    if fastest[0] in RAN_ON_GPU:
        return None, False
    tested = [(strategy, run) for strategy, run in runs if strategy in RAN_ON_GPU and run["tight"] <= fastest[1]["tight"]]
    if not tested:
        return None, False
    pick = fastest_of(tested)
    lead = fastest[1]["time"]["tokens_per_s"] / pick[1]["time"]["tokens_per_s"]
    return pick, lead < CLEARLY_FASTER


def simplest_of_the_fastest(candidates: list[tuple]) -> tuple:
    """Of (simplicity order, run) pairs, the one to pick: the first run by `rank_key`, except that runs within
    `TIE` of it (with as much margin) are a tie, which goes to the lowest order, the simpler one."""
    best = min((run for _, run in candidates), key=rank_key)
    close = [(order, run) for order, run in candidates if run["tight"] == best["tight"]
             and run["time"]["tokens_per_s"] >= (1 - TIE) * best["time"]["tokens_per_s"]]
    return min(close, key=lambda pair: (pair[0], rank_key(pair[1])))


def plan(shape: ModelShape, method: str, gpus: int, gpu_memory_gib: float, batch_size: int = 8,
         seq_len: int = 512, gradient_checkpointing: int = 0, lora_rank: int = 16,
         lora_targets="all-linear", precision: str = "bf16", attention: str = "sdpa",
         lora_dropout: float = 0.0, grad_accum: int = 1, machine: Machine | None = None, rows: int = 1024,
         global_batch: int | None = None, host_ram_gb: float | None = None, pairs: bool = False,
         dora: bool = False, vision: VisionShape | None = None, train_vision_tower: bool = False,
         train_projector: bool = False, image_tokens: int | None = None) -> dict:
    """Every strategy on `gpus` GPUs of `gpu_memory_gib`, its time on `machine` (default: H100s over
    NVLink), and the two recommendations.

    Each strategy's entry has its memory at the asked micro-batch (`per_gpu_bytes`, `fits`), the largest
    micro-batch that fits (`max_micro_batch`), both with the `gradient_checkpointing` its run uses (none asked
    and no run: every layer's, the least memory tried), and `run`: the fastest way it runs the asked step
    (`best_run`: batch_size x grad_accum rows per process, or `global_batch` rows per step on every
    strategy alike), with its estimated seconds per step and per epoch of `rows` sequences (None when
    nothing fits, or when `refusal` says why the global batch cannot run on it).
    - fastest: the run with the most tokens per second on all `gpus` GPUs, one with memory margin
      before any tight one;
    - tested: when the fastest is a strategy no GPU has run in this project (`RAN_ON_GPU`), the fastest of those
      that have run (None otherwise); `first` says which to launch: "tested" unless the fastest's estimate is
      `CLEARLY_FASTER` (`tested_beside`);
    - fewest_gpus: the smallest n in 1..gpus on which some strategy runs, and the run launched first there (by
      the same rule).
    Only the strategies the recipes run for this method, on one GPU only a single process or an offload
    config (`offered_strategies`). With `host_ram_gb` (each machine's RAM), neither is a config whose
    weights outgrow it while they load (`load_bytes_per_machine`; `cannot_load`: {strategy: bytes per machine}).
    When nothing runs, both are None and `recommendation["reason"]` says what came closest and what to change.
    With `pairs` (the preference recipes) batches and `rows` count pairs (`per_gpu_bytes`, `step_time`), pipeline
    parallel is left out (they do not run it), and under full fine-tuning each recommendation has
    `reference_pass_seconds`: the reference's scoring of the `rows` pairs before training.
    A vision-language model (`shape.reads_images`): its `vision` side (`per_gpu_bytes`), trained as
    `train_vision_tower` and `train_projector` say, on `image_tokens` a row, in every memory and in the host RAM at
    load; the time counts the language model's only.
    """
    machine = machine or Machine.of()
    gradient_checkpointing = int(gradient_checkpointing)
    memory = dict(lora_rank=lora_rank, lora_targets=lora_targets, precision=precision, attention=attention,
                  lora_dropout=lora_dropout, pairs=pairs, dora=dora, vision=vision,
                  train_vision_tower=train_vision_tower, train_projector=train_projector, image_tokens=image_tokens)
    settings = dict(batch_size=batch_size, seq_len=seq_len, gradient_checkpointing=gradient_checkpointing, **memory)
    asked = dict(settings, grad_accum=grad_accum, global_batch=global_batch)

    def recommend(strategy: str, run: dict, n: int) -> dict:
        layout = layout_of(run)
        batch = max_micro_batch(shape, method, strategy, n, gpu_memory_gib, seq_len, run["gradient_checkpointing"],
                                **memory, grad_accum=run["grad_accum"], **layout)
        reference = ({"reference_pass_seconds": reference_pass_time(shape, strategy, n, machine, rows, seq_len, precision)}
                     if pairs and method == "full" else {})
        return {"strategy": strategy, "config": STRATEGIES[strategy], "gpus": n, "max_micro_batch": batch,
                **{k: run[k] for k in ("micro_batch", "grad_accum", "gradient_checkpointing", "global_batch", "tight")},
                **layout, "seconds_per_step": run["time"]["step"], "seconds_per_epoch": epoch_time(run["time"], rows),
                **reference}

    def runnable(n: int) -> tuple[str, ...]:  # model parallel is one process: its GPUs are one machine's
        return tuple(s for s in offered_strategies(method, n, shape, lora_targets, pairs)
                     if (s != "model_parallel" or n <= machine.gpus_per_machine)
                     and not (dora and s in ("tp", "fsdp_tp")))  # the recipes refuse DoRA under tensor parallel

    def host_bytes(strategy: str, n: int) -> int:
        return load_bytes_per_machine(shape, method, strategy, n, machine.gpus_per_machine, precision,
                                      vision=vision)["bytes"]

    def loads(strategy: str, n: int) -> bool:  # its weights fit the machine's RAM while they load
        return host_ram_gb is None or host_bytes(strategy, n) <= host_ram_gb * GiB

    strategies, runs_on_all = [], {}
    for strategy in runnable(gpus):
        run = runs_on_all[strategy] = best_run(shape, method, strategy, gpus, gpu_memory_gib, machine, **asked)
        # at the asked micro-batch; a pipeline or sequence parallel in the layout its run chose (default: the
        # simplest that runs on these GPUs and this model)
        layout = layout_of(run) if run else layouts_of(strategy, gpus, shape)[0]
        accum = grad_accum
        if global_batch:  # the accumulation that makes the global batch at the asked micro-batch
            ranks = data_parallel_size(strategy, gpus, layout.get("pipeline_stages"), layout.get("sequence_parallel"))
            accum = max(1, global_batch // ranks // batch_size)
        # One decision feeds the memory and the time: the checkpointing the run is planned with (none asked and
        # no run: checkpointing every layer, the least memory tried), so a config is never judged without
        # checkpointing beside a time planned with it.
        every = run["gradient_checkpointing"] if run else gradient_checkpointing or 1
        usage = per_gpu_bytes(shape, method, strategy, gpus, **dict(settings, gradient_checkpointing=every),
                              grad_accum=accum, **layout)
        largest = max_micro_batch(shape, method, strategy, gpus, gpu_memory_gib, seq_len, every,
                                  **memory, grad_accum=accum, **layout)
        if run:
            run = dict(run, seconds_per_epoch=epoch_time(run["time"], rows))
        refusal = global_batch and global_batch_refusal(strategy, gpus, global_batch, shape)
        strategies.append({"strategy": strategy, "config": STRATEGIES[strategy], "gradient_checkpointing": every,
                           "per_gpu_bytes": usage, "fits": fits(usage["total"], gpu_memory_gib),
                           "max_micro_batch": largest, "run": run, "refusal": refusal or None})

    running = [(entry["strategy"], entry["run"]) for entry in strategies if entry["run"]]
    cannot_load = {strategy: host_bytes(strategy, gpus) for strategy, _ in running if not loads(strategy, gpus)}
    running = [(strategy, run) for strategy, run in running if strategy not in cannot_load]
    fastest = recommend(*fastest_of(running), gpus) if running else None
    tested, tested_first = tested_beside(running) if running else (None, False)

    fewest = None
    for n in range(1, gpus + 1):
        runs = [(s, runs_on_all[s] if n == gpus else best_run(shape, method, s, n, gpu_memory_gib, machine, **asked))
                for s in runnable(n)]
        runs = [(s, run) for s, run in runs if run and loads(s, n)]
        if runs:
            beside, first = tested_beside(runs)  # the same rule as on all the GPUs
            fewest = recommend(*(beside if first else fastest_of(runs)), n)
            break

    recommendation = {"fewest_gpus": fewest, "fastest": fastest, "tested": tested and recommend(*tested, gpus),
                      "first": "tested" if tested_first else "fastest"}
    refused = [entry["refusal"] for entry in strategies if entry["refusal"]]
    if fastest is None and refused and len(refused) == len(strategies):
        recommendation["reason"] = refused[0]
    elif fastest is None and cannot_load:
        least = min(cannot_load, key=cannot_load.get)
        recommendation["reason"] = (
            f"every config that fits needs more than {host_ram_gb:g} GiB of host RAM per machine to load the "
            f"weights: the least, {least}, {cannot_load[least] / GiB:.1f} GiB; use machines with more RAM, or a "
            "smaller model")
    elif fewest is None or fastest is None:
        smallest = min(strategies, key=lambda entry: entry["per_gpu_bytes"]["total"])
        recommendation["reason"] = (
            f"nothing fits {gpus} x {round(gpu_memory_gib, 1):g} GiB at micro-batch {batch_size}{' pairs' if pairs else ''} x {seq_len} tokens: the "
            f"smallest need is {smallest['per_gpu_bytes']['total'] / GiB:.1f} GiB per GPU ({smallest['strategy']}) "
            f"for {usable_bytes(gpu_memory_gib) / GiB:.1f} GiB usable, and no smaller micro-batch"
            + ("" if gradient_checkpointing else " or gradient checkpointing") + " fits either; try "
            + "a shorter sequence length, "
            + ("qlora, " if method != "qlora" else "")
            + "or more GPUs"
        )
    return {"model": shape.name, "method": method, "gpus": gpus, "gpu_memory_gib": gpu_memory_gib,
            "global_batch_size": global_batch, "pairs": pairs,
            "machine": {"gpu": machine.gpu.name, "link": machine.link, "bandwidth_gb_s": machine.bandwidth_gb_s,
                        "peak_tflops": machine.peak_flops(precision) / 1e12, "mfu": machine.mfu, "rows": rows,
                        "gpus_per_machine": machine.gpus_per_machine, "network_gb_s": machine.network_gb_s},
            "strategies": strategies, "recommendation": recommendation, "cannot_load": cannot_load}
