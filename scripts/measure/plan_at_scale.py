#!/usr/bin/env python
"""The memory planner against what FSDP2 ranks hold at real model sizes, on a CPU machine.

    python scripts/measure/plan_at_scale.py --out results/2026-11-24_cpu_fake-process-group-plan
    python scripts/measure/plan_at_scale.py --models tiny-llama --ranks 4 --json      # seconds

For every model x method x strategy x number of ranks, each rank is simulated in turn in this one
process: torch's fake process group (backend "fake", FakeStore) makes this process rank k of N, so
every collective returns at once without moving data. The model is built the way the recipes build
it, from its config.json on the meta device (`AutoModelForCausalLM.from_config` under
`torch.device("meta")`): full fine-tuning in fp32, LoRA (peft, r=16, all-linear, dropout 0.05) on a
frozen bf16 base, as `Launch.float_dtype` loads them with `mixed_precision: bf16`. It is sharded by
accelerate's own `fsdp2_prepare_model` (the function `accelerator.prepare` calls: fp32 upcast of the
trained parameters, `fully_shard` per decoder layer, the embedding, the final norm + lm_head, then
the root, `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)`), with the plugin fsdp.yaml
(reshard after forward) or fsdp_grad_op.yaml (not) describes. The meta shards then become fake
tensors (`to_empty` under `FakeTensorMode`): they have shapes and dtypes and no storage, so a 34B
model costs nothing. Two training steps run on them as recipes/lora.py runs a step (forward with
the padding mask and `logits_to_keep`, fp32 cross-entropy, backward, gradient clipping, fused AdamW,
`zero_grad`), so the gradients and the optimizer state are created by the real step.

Measured, per rank:
- at rest: `common.outputs.runlog.held_bytes` after the first optimizer step (what run.json's
  `memory_by_rank` records on real launches), against `planner.resident_bytes`;
- per GPU: torch's `FSDPMemTracker` over the second step (the tracker sees every tensor the
  step creates and frees, sorted into FSDP's categories), against `planner.per_gpu_bytes`:
  weights = sharded + unsharded parameters + all-gather buffers, gradients = sharded + unsharded
  gradients + reduce-scatter buffers, optimizer = AdamW's state, activations = the forward's
  tensors + the backward's temporaries + the inputs; each the largest it gets during the step,
  and the total the largest sum at any moment (the planner's total is the sum of its parts).

ZeRO-3 (`--strategies zero3`, TinyLlama-1.1B and the tiny model only): DeepSpeed allocates each rank's
partitions, fp32 master weights and AdamW state as real tensors, so the rank is built for real on the CPU
(`simulate_rank_zero3`: the recipes' `make_accelerator` with accelerate's DeepSpeed plugin as zero3.yaml
launches it, `accelerator.prepare`, zero-filled collectives), `held_bytes` after the first step, and
the most bytes of live tensors during the second (`LiveBytes`; a total, not split into kinds).

CPU fake tensors, not CUDA ones: `fully_shard` asks `torch.cuda.current_device()`, which the CPU
build of torch cannot answer. So the kernels are the CPU's (attention: CPU SDPA's flash kernel).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time
import types
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "recipes"))
import planner  # noqa: E402

KINDS = ("weights", "gradients", "optimizer")
PEAK_KINDS = KINDS + ("activations", "total")
STRATEGIES = ("fsdp_full_shard", "fsdp_grad_op", "zero3")
# ZeRO-3 allocates each rank's partitions, fp32 master weights and AdamW state as real CPU tensors.
ZERO3_MODELS = ("tiny-llama", "tinyllama-1.1b")
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0)  # the recipes' defaults (recipes/common/launching/args.py)
MASKED = 5  # the first row's last tokens are padding, so the attention runs the masked path, as in training

# FSDPMemTracker's categories summed into the planner's four parts.
GROUPS = {
    "weights": ("Sharded Param", "Unsharded Param", "All Gather"),
    "gradients": ("Sharded Grad", "Unsharded Grad", "Reduce Scatter"),
    "optimizer": ("OptState",),
    "activations": ("Activation", "Temp", "Inputs"),
}


def build_model(config_path: Path, method: str, gradient_checkpointing: int):
    """The model on the meta device, as the recipe has it just before `accelerator.prepare`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from common.model.modeling import checkpoint_activations

    config = AutoConfig.from_pretrained(config_path)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32 if method == "full" else torch.bfloat16)
    if gradient_checkpointing:
        checkpoint_activations(model, every_n_layers=gradient_checkpointing)
    if method == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(**LORA, target_modules="all-linear", task_type="CAUSAL_LM"))
    return model


def shard(model, strategy: str):
    """accelerate's FSDP2 preparation, on the model as the recipes' CPU launch hands it over
    (`runtime.enable_fsdp_on_cpu`'s plugin: rank-local loading, bf16 mixed precision)."""
    import torch
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "false"
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", cpu_ram_efficient_loading=False,
        reshard_after_forward=strategy == "fsdp_full_shard", state_dict_type="SHARDED_STATE_DICT")
    plugin.set_mixed_precision("bf16")
    accelerator = types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin), mixed_precision="bf16",
                                        is_main_process=False, device=torch.device("cpu"), parallelism_config=None,
                                        torch_device_mesh=None)
    return fsdp2_prepare_model(accelerator, model)


def category_peaks_tracker(model, optimizer):
    """FSDPMemTracker that also keeps, besides the peak of the total, the largest value each group
    of `GROUPS` reaches during the step."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    class Tracker(FSDPMemTracker):
        def _update_snap(self, *args, **kwargs):
            super()._update_snap(*args, **kwargs)
            for snap in self._curr_mem_snap.values():
                values = {str(getattr(k, "value", k)): v for k, v in snap.items()}
                for group, names in GROUPS.items():
                    self.group_peaks[group] = max(self.group_peaks.get(group, 0), sum(values[n] for n in names))

    tracker = Tracker(model, optimizer)
    tracker.group_peaks = {}
    return tracker


def simulate_rank(config_path: Path, method: str, strategy: str, ranks: int, rank: int, batch_size: int,
                  seq_len: int, gradient_checkpointing: int) -> dict:
    """Two training steps of rank `rank` of `ranks` on fake tensors: the bytes it holds after the
    first step, and the second step's peaks."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from common.model.modeling import trained_parameter_groups
    from common.outputs.runlog import held_bytes

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=ranks)
    try:
        model = shard(build_model(config_path, method, gradient_checkpointing), strategy)
        vocab = model.config.vocab_size
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        with fake:
            model.to_empty(device="cpu")  # fake shards: shapes and dtypes, no storage
        trained = [p for p in model.parameters() if p.requires_grad]
        groups = trained_parameter_groups(model)  # the recipes' optimizer groups (reads the mesh: outside fake mode)
        with fake:
            optimizer = torch.optim.AdamW(groups, lr=1e-4, weight_decay=0.0, fused=True)
            held = {}
            optimizer.register_step_post_hook(lambda opt, *_: held.update(held or held_bytes(model, opt)))
            ids = torch.randint(4, vocab, (batch_size, seq_len))
            mask = torch.ones(batch_size, seq_len, dtype=torch.long)
            mask[0, -MASKED:] = 0
            positions = torch.arange(seq_len - 1)  # every position has a target (plain-text rows)
            model.train()

            def step(tracker=None):
                logits = model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=positions).logits
                token_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                               ids[:, 1:].flatten(), reduction="none")
                del logits
                loss = token_loss.sum()
                if tracker is not None:  # what the forward leaves for the backward, before it starts
                    snap = next(iter(tracker.get_tracker_snapshot("current").values()))
                    forward_end.update(activations=sum(snap[name] for name in snap if str(getattr(name, "value", name))
                                           in GROUPS["activations"]))
                loss.backward()
                torch.nn.utils.clip_grad_norm_(trained, 1.0)
                optimizer.step()
                optimizer.zero_grad()

            step()
            tracker = category_peaks_tracker(model, optimizer)
            tracker.track_inputs((ids, mask))
            forward_end = {}  # filled by step(): {"activations": bytes}
            with tracker:
                step(tracker)
            peak = tracker.group_peaks
            total = max(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())
        return {"at_rest": {k: int(held[k]) for k in KINDS},
                "peak": {**{k: int(peak.get(k, 0)) for k in GROUPS}, "total": int(total)},
                "forward_end": {"activations": int(forward_end["activations"])}}
    finally:
        dist.destroy_process_group()


class LiveBytes:
    """The bytes of every tensor storage alive in this process, and the most they reach while it is
    entered: the storages alive at the start (found by the garbage collector: the model's partitions,
    DeepSpeed's flat buffers, the optimizer state) plus every storage an operator creates inside (a
    `TorchDispatchMode` sees them all, on CPU too), each subtracted again when it is freed."""

    def __new__(cls):
        from torch.utils._python_dispatch import TorchDispatchMode

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                import torch.utils._pytree as pytree

                out = func(*args, **(kwargs or {}))
                for t in pytree.tree_leaves(out):
                    self.add(t)
                return out

            def __enter__(self):
                import gc

                import torch

                self.live, self.current, self.peak = {}, 0, 0
                gc.collect()
                for obj in gc.get_objects():
                    if torch.is_tensor(obj) and not obj.is_meta:
                        self.add(obj)
                self.baseline = self.current
                return super().__enter__()

            def add(self, t):
                import weakref

                import torch

                if not torch.is_tensor(t) or t.is_meta:
                    return
                storage = t.untyped_storage()
                key = storage._cdata
                if key in self.live or storage.nbytes() == 0:
                    return
                self.live[key] = storage.nbytes()
                self.current += storage.nbytes()
                self.peak = max(self.peak, self.current)
                weakref.finalize(storage, self.free, key)

            def free(self, key):
                self.current -= self.live.pop(key, 0)

        return Mode()


def zero_filled_collectives():
    """The fake group's all-gathers and reduce-scatters leave their outputs uninitialised; zeros
    instead, so that the gathered weights and the reduced gradients are finite (DeepSpeed skips the
    optimizer step when the gradient norm is not)."""
    import torch.distributed as dist

    for name in ("all_gather_into_tensor", "reduce_scatter_tensor", "_all_gather_base", "_reduce_scatter_base",
                 "all_gather", "reduce_scatter"):
        original = getattr(dist, name, None)
        if original is None or getattr(original, "zero_filled", False):
            continue

        def wrapped(*args, _original=original, **kwargs):
            work = _original(*args, **kwargs)
            out = kwargs.get("output_tensor", kwargs.get("output", kwargs.get("tensor_list", args[0] if args else None)))
            for tensor in out if isinstance(out, (list, tuple)) else [out]:
                tensor.zero_()
            return work

        wrapped.zero_filled = True
        setattr(dist, name, wrapped)


LAUNCHER_ENV = {  # what `accelerate launch --config_file accelerate_configs/zero3.yaml` puts in each rank's environment
    "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "none", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "none",
    "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true", "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "true",
    "ACCELERATE_DEEPSPEED_CONFIG_FILE": "none",
}


def simulate_rank_zero3(config_path: Path, method: str, ranks: int, rank: int, batch_size: int, seq_len: int,
                        gradient_checkpointing: int) -> dict:
    """Two training steps of ZeRO-3 rank `rank` of `ranks`, through the recipes' own launch path:
    `runtime.make_accelerator` with the environment accelerate's launcher sets for zero3.yaml (DeepSpeed
    plugin, zero3_init_flag, bf16, gloo on CPU; `edit_deepspeed` aligns the generated JSON), the model
    built under the `zero.Init` that transformers opens for it, `accelerator.prepare` (which calls
    `deepspeed.initialize`), real CPU tensors. Returns `held_bytes` after the first step and the most
    bytes alive during the second (no split into kinds: DeepSpeed's buffers carry no category)."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    saved = {k: os.environ.get(k) for k in (*LAUNCHER_ENV, "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                            "MASTER_PORT")}
    os.environ.update(LAUNCHER_ENV, RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=ranks)
    zero_filled_collectives()
    import deepspeed.runtime.zero.partitioned_param_coordinator as coordinator

    # Its check that every rank traced the same module order broadcasts rank 0's list, which the fake
    # group does not deliver; every simulated rank runs the same modules.
    checked, coordinator.assert_ints_same_as_other_ranks = coordinator.assert_ints_same_as_other_ranks, lambda ints: None
    handler = __import__("signal").getsignal(__import__("signal").SIGINT)
    try:
        from accelerate.state import AcceleratorState
        from transformers import AutoConfig, AutoModelForCausalLM

        from common.training import runtime
        from common.launching.launch import DEEPSPEED, Launch
        from common.model.modeling import (checkpoint_activations, keep_adapter_inputs_in_compute_dtype,
                                           trained_parameter_groups)
        from common.outputs.runlog import held_bytes

        launch = Launch(DEEPSPEED, processes=ranks, on_gpu=False, visible_gpus=0, precision="bf16", zero_stage=3)
        AcceleratorState._reset_state(True)  # a state left by an earlier Accelerator in this process has no DeepSpeed plugin
        args = types.SimpleNamespace(grad_accum=1, max_grad_norm=1.0, batch_size=batch_size, report_to="none",
                                     output_dir=str(REPO / "outputs" / "plan_at_scale"))
        accelerator = runtime.make_accelerator(args, launch)
        config = AutoConfig.from_pretrained(config_path)
        config._attn_implementation = "sdpa"
        # Launch.float_dtype: fp32 trained weights, a bf16 frozen base; zero.Init partitions as it builds.
        model = AutoModelForCausalLM.from_config(config, dtype=launch.float_dtype(frozen=method != "full"))
        if gradient_checkpointing:
            checkpoint_activations(model, every_n_layers=gradient_checkpointing)
        if method == "lora":
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(**LORA, target_modules="all-linear", task_type="CAUSAL_LM"))
            keep_adapter_inputs_in_compute_dtype(model, launch)  # as the recipes: the adapters in DeepSpeed's bf16
        optimizer = torch.optim.AdamW(trained_parameter_groups(model), lr=1e-4, weight_decay=0.0, fused=True)
        loader = torch.utils.data.DataLoader([0] * batch_size * ranks, batch_size=batch_size)  # sizes the batch
        model, optimizer, _ = accelerator.prepare(model, optimizer, loader)
        inner = optimizer
        while not isinstance(inner, torch.optim.Optimizer) or hasattr(inner, "accelerator_state"):
            inner = inner.optimizer  # as RunLog.measure_first_step finds torch's AdamW inside DeepSpeed's
        held = {}
        inner.register_step_post_hook(lambda opt, *_: held.update(held or held_bytes(model, opt)))
        ids = torch.randint(4, config.vocab_size, (batch_size, seq_len))
        mask = torch.ones(batch_size, seq_len, dtype=torch.long)
        mask[0, -MASKED:] = 0
        positions = torch.arange(seq_len - 1)
        model.train()
        parameters = list(model.parameters())

        def step():
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=positions).logits
            token_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten(),
                                                           reduction="none")
            del logits
            accelerator.backward(token_loss.sum())
            accelerator.clip_grad_norm_(parameters, 1.0)
            optimizer.step()
            optimizer.zero_grad()

        step()
        if not held:
            raise RuntimeError("DeepSpeed skipped the optimizer step (a non-finite gradient norm?)")
        tracker = LiveBytes()
        with tracker:
            step()
        return {"at_rest": {k: int(held[k]) for k in KINDS}, "peak": {"total": int(tracker.peak)},
                "before_step": {"total": int(tracker.baseline)}}
    finally:
        coordinator.assert_ints_same_as_other_ranks = checked
        __import__("signal").signal(__import__("signal").SIGINT, handler)
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
        AcceleratorState._reset_state(True)
        import deepspeed.comm
        from deepspeed.utils import groups

        deepspeed.comm.comm.cdb = None
        for name, value in vars(groups).copy().items():  # the process groups DeepSpeed cached for this group
            if name.isupper() and name.startswith("_") and isinstance(value, dict):
                value.clear()
            elif name in ("_WORLD_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP", "mpu",
                          "mesh_device", "_MODEL_PARALLEL_GROUP", "_TENSOR_MODEL_PARALLEL_GROUP"):
                setattr(groups, name, None)
        dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def planned(shape, method: str, strategy: str, ranks: int, batch_size: int, seq_len: int,
            gradient_checkpointing: int) -> dict:
    lora = dict(lora_rank=LORA["r"], lora_dropout=LORA["lora_dropout"]) if method == "lora" else {}
    rest = planner.resident_bytes(shape, method, strategy, ranks, precision="bf16",
                                  **{k: v for k, v in lora.items() if k == "lora_rank"})
    per_gpu = planner.per_gpu_bytes(shape, method, strategy, ranks, batch_size=batch_size, seq_len=seq_len,
                                    gradient_checkpointing=gradient_checkpointing, precision="bf16",
                                    attention="sdpa", **lora)
    # At the forward's end the backward has not started: no fp32 gradient of the log-softmax yet
    # (the planner's logits term is T * vocab * (logits + 4 + 4)), and with checkpointing no block
    # is being recomputed.
    tokens = batch_size * seq_len
    forward_end = per_gpu["activations"] - tokens * shape.vocab * 4
    if gradient_checkpointing:
        forward_end -= tokens * planner.layer_activation_bytes_per_token(
            shape, method, strategy, seq_len, precision="bf16", attention="sdpa",
            **({"lora_rank": LORA["r"], "lora_dropout": LORA["lora_dropout"]} if method == "lora" else {}))
    return {"at_rest": {k: int(rest[k]) for k in KINDS}, "peak": {k: int(per_gpu[k]) for k in PEAK_KINDS},
            "forward_end": {"activations": int(forward_end)}}


def difference(measured: int, plan: int) -> float | None:
    """(planned - measured) / measured, in %; None when both are 0."""
    if measured == 0:
        return None if plan == 0 else float("inf")
    return 100.0 * (plan - measured) / measured


def _simulate(case: dict) -> dict:
    """One case in a worker process (its own fake process group)."""
    import torch
    import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    started = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):
        simulate = simulate_rank_zero3 if case["strategy"] == "zero3" else functools.partial(simulate_rank,
                                                                                            strategy=case["strategy"])
        measured = simulate(Path(case["config"]), method=case["method"], ranks=case["ranks"], rank=case["rank"],
                            batch_size=case["batch_size"], seq_len=case["seq_len"],
                            gradient_checkpointing=case["gradient_checkpointing"])
    return {"measured": measured, "seconds": round(time.perf_counter() - started, 1)}


def run(models, methods, strategies, rank_counts, batch_size, seq_len, checkpointing, ranks_simulated="first-last", jobs=1,
        progress=None):
    cases = []
    for model in models:
        config_path = planner.ALIASES.get(model, Path(model))
        for method in methods:
            for strategy in strategies:
                for ranks in rank_counts:
                    for every in checkpointing:
                        for rank in (range(ranks) if ranks_simulated == "all" else [0] if ranks_simulated == "first"
                                     else sorted({0, ranks - 1})):
                            cases.append({"model": model, "config": str(config_path), "method": method,
                                          "strategy": strategy, "ranks": ranks, "rank": rank,
                                          "batch_size": batch_size, "seq_len": seq_len,
                                          "gradient_checkpointing": every})
    if jobs > 1 or any(case["strategy"] == "zero3" for case in cases):  # DeepSpeed: a fresh process per rank
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"), max_tasks_per_child=1) as pool:
            results = list(pool.map(_simulate, cases))
    else:
        results = [_simulate(case) for case in cases]
    rows = []
    for case, result in zip(cases, results):
        shape = planner.load_shape(case["config"])
        plan = planned(shape, case["method"], case["strategy"], case["ranks"], batch_size, seq_len,
                       case["gradient_checkpointing"])
        measured = result["measured"]
        row = {k: v for k, v in case.items() if k != "config"}
        row.update(measured=measured, planned=plan, seconds=result["seconds"])
        row["difference_percent"] = {part: {k: difference(measured[part][k], plan[part][k]) for k in plan[part]
                                            if k in measured.get(part, {})}
                                     for part in ("at_rest", "peak", "forward_end")}
        rows.append(row)
        if progress:
            progress(row)
    return rows


UNIT = {"GiB": 2**30}


def gib(value: int) -> str:
    name, size = next(iter(UNIT.items()))
    return f"{value / size:.3f}"


def percent(value) -> str:
    return "-" if value is None else f"{value:+.2f}%"


def measured_cell(row, part: str, kind: str) -> str:
    """GiB, or "-" where it was not measured (ZeRO-3's peak is a total only)."""
    value = row["measured"].get(part, {}).get(kind)
    return "-" if value is None else gib(value)


def tables(rows) -> list[str]:
    """Markdown: the at-rest table (resident_bytes) and the per-GPU table (per_gpu_bytes)."""
    head = "| model | method | strategy | ranks | rank | checkpointing |"
    out = [f"At rest, after the first optimizer step: `held_bytes` measured / `planner.resident_bytes` planned, "
           "GiB (difference = planned - measured, % of measured)", "",
           head + "".join(f" {k} measured | {k} planned | {k} diff |" for k in KINDS),
           "|" + "---|" * (6 + 3 * len(KINDS))]
    key = lambda r: (r["model"], r["method"], r["strategy"], r["ranks"], r["rank"])  # noqa: E731
    seen = set()
    for r in rows:
        if key(r) in seen:  # the state at rest does not depend on checkpointing
            continue
        seen.add(key(r))
        cells = [r["model"], r["method"], r["strategy"], str(r["ranks"]), str(r["rank"]), "any"]
        for k in KINDS:
            cells += [gib(r["measured"]["at_rest"][k]), gib(r["planned"]["at_rest"][k]),
                      percent(r["difference_percent"]["at_rest"][k])]
        out.append("| " + " | ".join(cells) + " |")
    out += ["", f"Per GPU, the second step's peaks (FSDPMemTracker; zero3: the most bytes of live tensors, "
            f"`LiveBytes`, a total only) / `planner.per_gpu_bytes`, {next(iter(UNIT))}, "
            f"micro-batch {rows[0]['batch_size']} x {rows[0]['seq_len']} tokens" if rows else "", "",
            head + "".join(f" {k} measured | {k} planned | {k} diff |" for k in PEAK_KINDS)
            + " activations at the forward's end measured | planned | diff |",
            "|" + "---|" * (6 + 3 * len(PEAK_KINDS) + 3)]
    for r in rows:
        every = r["gradient_checkpointing"]
        cells = [r["model"], r["method"], r["strategy"], str(r["ranks"]), str(r["rank"]),
                 "every layer" if every == 1 else (f"1 in {every}" if every else "off")]
        for k in PEAK_KINDS:
            cells += [measured_cell(r, "peak", k), gib(r["planned"]["peak"][k]),
                      percent(r["difference_percent"]["peak"].get(k))]
        cells += [measured_cell(r, "forward_end", "activations"), gib(r["planned"]["forward_end"]["activations"]),
                  percent(r["difference_percent"]["forward_end"].get("activations"))]
        out.append("| " + " | ".join(cells) + " |")
    return out


def parse_args(argv=None):
    summary, _, details = __doc__.partition("\n")
    parser = argparse.ArgumentParser(description=summary, epilog=details,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tinyllama-1.1b", "codellama-34b"],
                        help="aliases of recipes/planner (tiny-llama, tinyllama-1.1b, codellama-34b) or config .json files")
    parser.add_argument("--methods", nargs="+", choices=("full", "lora"), default=["full", "lora"])
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    parser.add_argument("--ranks", nargs="+", type=int, default=[4, 8])
    parser.add_argument("--all-ranks", action="store_true",
                        help="simulate every rank (default: the first and the last, where uneven shards differ)")
    parser.add_argument("--first-rank-only", action="store_true",
                        help="simulate rank 0 only (every rank holds the same when all splits divide)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--gradient-checkpointing", nargs="+", type=int, default=[0, 1], metavar="EVERY_N",
                        help="values to run: 0 off, 1 every layer, N every Nth (default: 0 1)")
    parser.add_argument("--unit", choices=("GiB", "MiB"), default="GiB", help="unit of the tables (default: GiB)")
    parser.add_argument("--jobs", type=int, default=1, help="simulate this many ranks at once, one process each")
    parser.add_argument("--out", type=Path, help="write table.md and results.json into this folder")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of the tables")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if "zero3" in args.strategies:
        large = [m for m in args.models if m not in ZERO3_MODELS]
        if large:
            print(f"zero3 runs on {', '.join(ZERO3_MODELS)} only, not {', '.join(large)}: DeepSpeed allocates each "
                  "rank's partitions, fp32 master weights and AdamW state as real CPU tensors (no fake tensors), "
                  "e.g. ~68 GB per rank for CodeLlama-34B on 8 ranks", file=sys.stderr)
            return 2
    UNIT.clear()
    UNIT[args.unit] = 2**30 if args.unit == "GiB" else 2**20
    warnings.filterwarnings("ignore")
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    started = time.perf_counter()

    def progress(row):
        if not args.json:
            print(f"  {row['model']} {row['method']} {row['strategy']} {row['ranks']} ranks, rank {row['rank']}, "
                  f"checkpointing {row['gradient_checkpointing']}: {row['seconds']} s", file=sys.stderr)

    with contextlib.redirect_stdout(sys.stderr):  # library notices stay off the table
        rows = run(args.models, args.methods, args.strategies, args.ranks, args.batch_size, args.seq_len,
                   args.gradient_checkpointing,
                   "all" if args.all_ranks else "first" if args.first_rank_only else "first-last", args.jobs, progress)
    record = {"command": "python scripts/measure/plan_at_scale.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "torch": torch.__version__, "transformers": transformers.__version__,
              "accelerate": __import__("accelerate").__version__, "peft": __import__("peft").__version__,
              "seconds": round(time.perf_counter() - started, 1), "rows": rows}
    text = "\n".join(tables(rows))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(record, indent=1) + "\n")
        (args.out / "table.md").write_text(text + "\n")
    print(json.dumps(record, indent=1) if args.json else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
