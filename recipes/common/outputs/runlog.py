"""What a run leaves behind about itself: run.json, metrics.jsonl and the progress bar.

Only the main process writes or prints. One method gathers from every rank, `record_ranks`, which
every rank must call at the same step; the rest is local.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import torch

from ..launching.batch_size import rows_per_step
from ..launching.deepspeed_config import schedule_settings
from ..model.adapters import merged_start
from ..model.modeling import parameter_counts
from ..paths import REPO_ROOT
from .drift import LikelihoodDrift

LIBRARIES = ("torch", "transformers", "accelerate", "peft", "datasets", "bitsandbytes", "deepspeed")


def library_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in LIBRARIES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    return found


def program_record(program: str | None = None, recipe: str | None = None) -> dict:
    """The program that ran (default: this process's script): its path and SHA-256; where it is not the shipped
    recipes/<recipe>.py, `copy_of` names that one and `edited` says whether the copy differs from it; inside a git
    work tree, the commit, whether the tree had changes, and the program's own state there ("committed",
    "changed" or "untracked")."""
    import hashlib
    import subprocess

    path = Path(sys.argv[0] if program is None else program).resolve()
    record = {"path": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "git": None}
    shipped = REPO_ROOT / "recipes" / f"{recipe}.py"
    if recipe and path != shipped.resolve():
        record["copy_of"] = f"recipes/{recipe}.py"
        record["edited"] = not shipped.is_file() or hashlib.sha256(shipped.read_bytes()).hexdigest() != record["sha256"]

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(path.parent), *args], capture_output=True, text=True, timeout=30)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode == 0:
            own = git("status", "--porcelain", "--", path.name).stdout[:2]
            record["git"] = {"commit": head.stdout.strip(), "dirty": bool(git("status", "--porcelain").stdout.strip()),
                             "program": "committed" if not own.strip() else "untracked" if own == "??" else "changed"}
    except (OSError, subprocess.TimeoutExpired):  # no git, or a tree too slow to ask: the hash says what ran
        pass
    return record


def what_ran(accelerator, model) -> dict:
    """Precision, sharding and offload as the prepared objects report them, not as the config
    file says: DeepSpeed's engine, the FSDP plugin accelerate sharded with, the parameters' shards."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    shards = [local_tensor(p) for p in params]
    ran = {
        "precision": accelerator.mixed_precision,  # the autocast accelerate runs the forward in
        "parameter_dtypes": {
            "trained": sorted({str(t.dtype).removeprefix("torch.") for p, t in zip(params, shards) if p.requires_grad}),
            "frozen": sorted({str(t.dtype).removeprefix("torch.") for p, t in zip(params, shards)
                              if not p.requires_grad}),
        },
        "parameter_devices": sorted({t.device.type for t in shards}),
    }
    if accelerator.distributed_type.value == "DEEPSPEED":
        engine = model
        ran["precision"] = "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "no"
        ran["deepspeed"] = {
            "zero_stage": engine.zero_optimization_stage(),
            "offload_optimizer": getattr(engine.zero_offload_optimizer(), "device", "none"),
            "offload_param": getattr(engine.zero_offload_param(), "device", "none"),
            "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
            "gradient_clipping": engine.gradient_clipping(),
        }
        ran["deepspeed"] = {key: getattr(value, "value", value) for key, value in ran["deepspeed"].items()}
    if accelerator.distributed_type.value == "FSDP":
        plugin = accelerator.state.fsdp_plugin
        mesh = next((p.device_mesh for p in params if isinstance(p, DTensor)), None)
        policy = plugin.mixed_precision_policy
        ran["fsdp"] = {
            "version": plugin.fsdp_version,
            "reshard_after_forward": plugin.reshard_after_forward,
            "cpu_offload": type(plugin.cpu_offload).__name__,
            "state_dict_type": getattr(plugin.state_dict_type, "name", str(plugin.state_dict_type)),
            "mesh": None if mesh is None else dict(zip(mesh.mesh_dim_names or ("shard",), mesh.mesh.shape)),
            "param_dtype": None if policy is None else str(policy.param_dtype).removeprefix("torch."),
        }
    parallelism = accelerator.parallelism_config
    if parallelism is not None and parallelism.tp_enabled:  # transformers split the weights as they loaded
        mesh = accelerator.torch_device_mesh
        split_over = {tuple(zip(p.device_mesh.mesh_dim_names, p.device_mesh.mesh.shape))
                      for p in params if isinstance(p, DTensor)}
        ran["tensor_parallel"] = {
            "mesh": dict(zip(mesh.mesh_dim_names, mesh.mesh.shape)),  # the ranks: data x tensor parallel
            "weights_split_over": [dict(m) for m in sorted(split_over)],  # the meshes of the split weights
            "whole_parameters": sum(1 for p in params if not isinstance(p, DTensor)),  # e.g. the norms under tp
        }
    if accelerator.device.type == "cpu":
        ran["note"] = "CPU-only run: offload to CPU moves nothing here"
    return ran


MEMORY_KINDS = ("weights", "gradients", "optimizer")


def local_tensor(tensor):
    """The part of `tensor` this rank stores: ZeRO-3 partition, FSDP2 shard, or the tensor itself."""
    from torch.distributed.tensor import DTensor

    if hasattr(tensor, "ds_tensor"):
        return tensor.ds_tensor
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def held_bytes(model, optimizer) -> dict:
    """Bytes this rank holds as model weights, gradients and optimizer state.

    DeepSpeed trains flat fp32 partitions of its own (the optimizer's parameters are not the
    model's): they count as optimizer state, and their gradients as gradients.
    """
    def nbytes(tensor):
        tensor = local_tensor(tensor)
        return tensor.numel() * tensor.element_size()

    model_params = list(model.parameters())
    own = {id(p) for p in model_params}
    extra = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in own]
    grads = [p.grad for p in model_params + extra if p.grad is not None]
    states = [t for state in optimizer.state.values() for t in state.values()
              if torch.is_tensor(t) and t.numel() > 1]  # the step counters are scalars
    return {
        "weights": sum(nbytes(p) for p in model_params),
        "gradients": sum(nbytes(g) for g in grads),
        "optimizer": sum(nbytes(t) for t in states) + sum(nbytes(p) for p in extra),
    }


def host_peak_bytes() -> int:
    """This process's peak resident host memory so far (loading included): what a machine's RAM must hold per rank."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports kibibytes


def arguments_record(run, total_steps: int) -> dict:
    """The run's settings as run.json records them; a DeepSpeed schedule with the values it runs with."""
    arguments = dict(vars(run))
    section = arguments.get("deepspeed_scheduler")
    if section:
        arguments["deepspeed_scheduler"] = {**section, "ran": schedule_settings(section, run, total_steps)}
    return arguments


class RunLog:
    def __init__(self, accelerator, args, recipe: str, launch):
        self.accelerator = accelerator
        self.launch = launch
        self.args = args
        self.recipe = recipe
        self.output_dir = Path(args.output_dir)
        self.main = accelerator.is_main_process
        self.started = time.perf_counter()
        self.tokens_seen = 0
        self.bar = None
        self.log_every = args.log_every
        self.drift = LikelihoodDrift()  # preference runs: both log-probabilities falling while accuracy saturates
        self.first_step, self.samples_opened = 0, False  # (samples.jsonl: an online run's, opened at its first lines)
        if self.main:
            self.output_dir.mkdir(parents=True, exist_ok=True)

    def say(self, message: str) -> None:
        if self.main:
            writer = self.bar.write if self.bar is not None else print
            writer(message)
            sys.stdout.flush()

    def write_run_json(self, model, stages, data_format: str, optimizer, total_steps: int,
                       loss_path: str | None = None) -> None:
        """Record what really ran: strategy, processes, precision, parameters, how the loss met the logits
        (`loss_path`: model.loss_head's description). No collective: each rank's share is gathered later,
        by `record_ranks`."""
        counts = parameter_counts(model)
        ran = what_ran(self.accelerator, model)
        self.model = model
        self.held_parameters = counts["held_by_this_rank"]
        self.host_peak_at_start = host_peak_bytes()  # loaded and prepared: what loading needed of the host's RAM
        self.held_at_first_step = None
        # An adapter as --model trains its base with it merged in, kept in a cache: recorded as what made it
        # (the exported adapter names no cache either: checkpoint.save_adapter)
        start = merged_start(self.args.model)
        self.record = {
            "recipe": self.recipe,
            "program": program_record(recipe=self.recipe) if self.main else None,  # the file that ran (a copy?)
            "arguments": arguments_record(self.args, total_steps),
            "total_steps": total_steps,
            "base_model": start["base"] if start else self.args.model,
            "start_adapter": start["adapter"] if start else None,
            "data_format": data_format,
            # the system turn every chat row (or conversational pair) opened with (shared_system_prompt in
            # data/preparation.py, data/preferences.py): generate.py's default
            "system_prompt": getattr(data_format, "system_prompt", None),
            "distributed_type": self.accelerator.distributed_type.value,
            "num_processes": self.accelerator.num_processes,
            "mixed_precision": ran["precision"],
            "device": str(self.accelerator.device.type),
            "launch": self.launch.as_record(),  # what accelerate launch asked for; `strategy`: what ran
            "batch": {"batch_size": self.args.batch_size, "grad_accum": self.args.grad_accum,
                      "global_batch_size": rows_per_step(self.args, self.launch),
                      **getattr(self.args, "batch_plan", {})},
            "parameters": {"total": counts["total"], "trainable": counts["trainable"], "held_by_rank": None,
                           "quantized": counts["quantized"]},  # weights in bitsandbytes layers (qlora.py)
            "strategy": ran,
            "loss_path": loss_path,
            "versions": library_versions(),
        }
        if stages:  # the counts above are this rank's stage; the layout says which layers each rank holds
            self.record["pipeline"] = stages.record()
        if self.accelerator.log_with:
            # Trackers get the same numbers as metrics.jsonl; their config only takes plain values.
            config = {key: value for key, value in vars(self.args).items()
                      if isinstance(value, (int, float, str, bool))}
            self.accelerator.init_trackers(self.output_dir.name or "run", config=config)
        self.measure_first_step(optimizer)
        if self.main:
            self.save_record()
            share = self.held_parameters / max(counts["total"], 1)
            program = self.record["program"]
            copy = (f" ({Path(program['path']).name}, {'an edited' if program['edited'] else 'a'} copy of "
                    f"{program['copy_of']})" if "copy_of" in program else "")
            self.say(
                f"{self.recipe}{copy}: {self.accelerator.distributed_type.value} x {self.accelerator.num_processes} "
                f"process(es){f' ({self.launch.name})' if self.launch.name != self.launch.planner_strategy else ''}, "
                f"{ran['precision']} precision, {counts['total']:,} parameters "
                f"({counts['trainable']:,} trainable, rank 0 holds {share:.0%}), data format: {data_format}"
            )

    def save_record(self) -> None:
        (self.output_dir / "run.json").write_text(json.dumps(self.record, indent=2, default=str) + "\n")

    def measure_first_step(self, optimizer) -> None:
        """Measure, once, what this rank holds at the end of its first optimizer step (inside it:
        DeepSpeed frees its gradients before the loop sees them). Local only: no collective."""
        inner = optimizer
        while not isinstance(inner, torch.optim.Optimizer) or hasattr(inner, "accelerator_state"):
            inner = inner.optimizer  # accelerate's wrapper, DeepSpeed's ZeRO optimizer, ... -> torch's

        def measure(opt, args, kwargs):
            handle.remove()
            self.held_at_first_step = held_bytes(self.model, opt)

        self.inner_optimizer = inner
        handle = inner.register_step_post_hook(measure)

    def record_ranks(self) -> None:
        """Gather what each rank holds (parameters; bytes of weights, gradients, optimizer state at the
        first optimizer step) into run.json. A collective: every rank must call it, at the same step."""
        held = self.held_at_first_step or held_bytes(self.model, self.inner_optimizer)  # fp16 can skip one
        local = torch.tensor([[self.held_parameters] + [held[k] for k in MEMORY_KINDS]
                              + [self.host_peak_at_start, host_peak_bytes()]],
                             dtype=torch.float64, device=self.accelerator.device)
        rows = self.accelerator.gather(local).tolist()
        self.record["parameters"]["held_by_rank"] = [int(row[0]) for row in rows]
        self.record["memory_by_rank"] = [dict(zip(MEMORY_KINDS, map(int, row[1:-2]))) for row in rows]
        self.record["host_peak_at_start_gib_by_rank"] = [round(row[-2] / 2**30, 3) for row in rows]  # loading
        self.record["host_peak_gib_by_rank"] = [round(row[-1] / 2**30, 3) for row in rows]  # and the first step
        if self.main:
            self.save_record()

    def start(self, first_step: int, total_steps: int) -> None:
        """Open metrics.jsonl and the progress bar for steps `first_step + 1` on."""
        self.first_step = first_step
        if not self.main:
            return
        from tqdm.auto import tqdm

        path = self.output_dir / "metrics.jsonl"
        # A resumed run continues its curve from the checkpoint's step: lines the interrupted run wrote
        # after it are dropped (they are run again). A fresh run must not mix into an older run's file.
        kept = [line for line in (path.read_text().splitlines() if first_step and path.exists() else [])
                if json.loads(line)["step"] <= first_step]
        path.write_text("".join(line + "\n" for line in kept))
        self.metrics = open(path, "a", buffering=1)
        # A bar where a terminal shows it; in a log file, a line per step instead (unless --log-every says)
        self.bar = tqdm(total=total_steps, initial=first_step, desc="training", unit="step",
                        dynamic_ncols=True, mininterval=1.0, disable=None)
        if self.log_every is None:
            self.log_every = 0 if not self.bar.disable else 1

    def log_step(self, step: int, epoch: int, loss: float, lr: float, grad_norm, tokens: int,
                 router_loss: float | None = None, figures: dict | None = None, shown: tuple | None = None) -> None:
        """One metrics.jsonl line; `figures`: the recipe's own, under the names it gives them (a preference
        recipe's rewards and log-probabilities); `shown`: those of them the console line prints (default all)."""
        self.tokens_seen += tokens
        elapsed = time.perf_counter() - self.started
        record = {
            "type": "train", "step": step, "epoch": epoch, "loss": loss, "lr": lr,
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "tokens": tokens, "tokens_seen": self.tokens_seen, "elapsed_s": round(elapsed, 3),
            "tokens_per_s": round(self.tokens_seen / max(elapsed, 1e-9), 1),
        }
        if router_loss is not None:  # a mixture of experts' load-balancing loss (mean over micro-batches)
            record["router_loss"] = router_loss
        record.update(figures or {})
        if torch.cuda.is_available():  # this rank's peak since the start, for benchmarks and the planner
            record["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
            record["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 3)
        self.track(record, step)
        if not self.main:
            return
        self.metrics.write(json.dumps(record) + "\n")
        if figures and "rewards/accuracies" in figures:  # (pairs: a preference recipe's)
            warning = self.drift.check(step, figures["logps/chosen"], figures["logps/rejected"],
                                       figures["rewards/accuracies"])
            if warning:
                self.say(warning)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
            if self.log_every and step % self.log_every == 0:
                router = f"  router_loss {router_loss:.4f}" if router_loss is not None else ""
                own = "".join(f"  {key} {value:.4f}" for key, value in (figures or {}).items()  # rewards/*, logps/*
                              if shown is None or key in shown)
                self.bar.write(f"step {step}: loss {loss:.4f}  lr {lr:.2e}  grad_norm {record['grad_norm'] or 0:.3f}"
                               f"{router}{own}")

    def write_samples(self, step: int, samples: list[dict]) -> None:
        """Lines of samples.jsonl (main process): an online run's prompts, completions and rewards at `step`. A
        resumed run drops the lines the interrupted run wrote after its checkpoint, as metrics.jsonl does."""
        path = self.output_dir / "samples.jsonl"
        if not self.samples_opened:
            kept = [line for line in (path.read_text().splitlines() if self.first_step and path.exists() else [])
                    if json.loads(line)["step"] <= self.first_step]
            path.write_text("".join(line + "\n" for line in kept))
            self.samples_opened = True
        with open(path, "a") as file:
            for sample in samples:
                file.write(json.dumps({"step": step, **sample}, default=str) + "\n")

    def track(self, record: dict, step: int) -> None:
        """Send the numbers of a metrics.jsonl line to the accelerate trackers (main process only)."""
        if self.accelerator.log_with:
            prefix = f"{record['type']}/"
            values = {prefix + key: value for key, value in record.items()
                      if key not in ("type", "step") and isinstance(value, (int, float))}
            self.accelerator.log(values, step=step)

    def log_eval(self, step: int, metrics: dict) -> None:
        self.track({"type": "eval", **metrics}, step)
        if self.main:
            self.metrics.write(json.dumps({"type": "eval", "step": step, **metrics}) + "\n")
            shown = "  ".join(f"{key} {value:.4f}" for key, value in metrics.items())
            self.say(f"eval at step {step}: {shown}")

    def log_benchmarks(self, step: int, scored: dict) -> None:
        """--eval-tasks' scores (training.benchmarks.score_run): one metrics.jsonl line {"type": "benchmarks",
        "step", "seconds", "prompts", task: {metric: value}}, the same numbers to the trackers and the console."""
        scores = scored["scores"]
        self.track({"type": "benchmarks", **{f"{task}/{metric}": value for task, metrics in scores.items()
                                              for metric, value in metrics.items()}}, step)
        if self.main:
            self.metrics.write(json.dumps({"type": "benchmarks", "step": step, "seconds": scored["seconds"],
                                           "prompts": scored["prompts"], **scores}) + "\n")
            shown = "  ".join(f"{task} {metric} {value:.4f}" for task, metrics in scores.items()
                              for metric, value in metrics.items())
            self.say(f"benchmarks at step {step}: {shown} ({scored['prompts']}; {scored['seconds']:.1f} s)")

    def close(self, message: str) -> None:
        if self.main:
            if self.bar is not None:
                self.bar.close()
                self.bar = None
            self.metrics.close()
            self.say(message)
