"""The Accelerator for this launch, and the one place that knows about machines without a GPU.

`accelerate launch --config_file accelerate_configs/<strategy>.yaml` describes a GPU cluster.
On a machine with no GPU the same command should still exercise the same strategy, so a user
can try a config on a laptop and the tests can run everywhere. Stock accelerate does not do
that by itself (see `enable_fsdp_on_cpu`), so this module adapts the launch on CPU only;
on GPUs it builds a plain `Accelerator`, or under FSDP where each process reads its shards from the
model's files, an Accelerator whose `prepare` reads them (`ShardReadingAccelerator`).
"""

from __future__ import annotations

import os
import signal
import sys
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration, DeepSpeedPlugin
from accelerate.utils import (DistributedDataParallelKwargs, DistributedType, FullyShardedDataParallelPlugin,
                               GradientAccumulationPlugin, InitProcessGroupKwargs)

from ..data.batches import SequenceSlice, target_tokens
from ..launching import deepspeed_config
from ..launching.args import PREFERENCE_RECIPES
from ..launching.launch import DEEPSPEED, FSDP, TENSOR_PARALLEL, Launch
from ..model.shard_loading import read_shards
from ..quiet import printed_notices_dropped

# A rank that dies must not leave the others waiting forever in a collective.
COLLECTIVE_TIMEOUT = timedelta(minutes=int(os.environ.get("RECIPES_COLLECTIVE_TIMEOUT_MIN", "30")))


def make_accelerator(args, launch: Launch) -> Accelerator:
    """An Accelerator set up for `args` and for what `accelerate launch` asked for (`launch`)."""
    on_cpu = not launch.on_gpu
    stop_quietly_on_ctrl_c()
    if on_cpu:
        share_cpu_cores()
    kwargs = dict(
        # The recipes hand the loop exactly `grad_accum` micro-batches per optimizer step, so
        # the end of an epoch never forces an early, partial step.
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=args.grad_accum, sync_with_dataloader=False
        ),
        # One scheduler step per optimizer step, whatever the number of processes.
        step_scheduler_with_optimizer=False,
        # The data order depends on the seed and epoch only, so a resumed run sees the same batches.
        # Copies to the GPU from pinned memory need not wait for the GPU to finish its work.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, non_blocking=not on_cpu),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=COLLECTIVE_TIMEOUT, **cpu_process_group(launch),
                                                **restart_rendezvous(args.output_dir)),
                         # DDP would broadcast rank 0's buffers before every forward: a hidden collective
                         # each step that moves nothing, since a causal LM's buffers (rotary frequencies)
                         # are the same constants on every rank. A trained vision side gets no gradient from a
                         # micro-batch without images: DDP must then look for the parameters a step left unused.
                         DistributedDataParallelKwargs(broadcast_buffers=False, find_unused_parameters=bool(
                             getattr(args, "train_vision_tower", False) or getattr(args, "train_projector", False)))],
    )
    tracker = chosen_tracker(args.report_to)
    if tracker is not None:
        kwargs.update(log_with=tracker, project_dir=args.output_dir)
    # DeepSpeed discovers its own CPU accelerator; every other strategy must be told it runs on CPU.
    if on_cpu and launch.kind != DEEPSPEED:
        kwargs["cpu"] = True
    if launch.kind == DEEPSPEED:
        source, config, renamed = deepspeed_config.deepspeed_source(os.environ)
        if renamed:  # accelerate reads the file as written: it gets the settings under their current names
            kwargs["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config=config)
    with printed_notices_dropped():  # DeepSpeed's set-up prints a notice on every rank
        if on_cpu and launch.kind == TENSOR_PARALLEL:
            with parallelism_config_hidden():  # accelerate refuses it on CPU processes: added after
                accelerator = Accelerator(**kwargs)
            enable_tensor_parallel_on_cpu(accelerator)
        elif launch.sequence_parallel > 1:
            accelerator = SequenceParallelAccelerator(launch.sequence_parallel, launch.zero_stage,
                                                      rows_per_example=2 if args.recipe in PREFERENCE_RECIPES else 1,
                                                      **kwargs)
        elif launch.reads_shards:
            if not on_cpu:
                kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(cpu_ram_efficient_loading=False)
            accelerator = ShardReadingAccelerator(args.model, args.trust_remote_code, **kwargs)
        else:
            accelerator = Accelerator(**kwargs)
    if on_cpu and launch.kind == FSDP:
        enable_fsdp_on_cpu(accelerator, main_process_sends=launch.main_process_loads)
    if launch.kind == DEEPSPEED:
        align_deepspeed_with_recipe(accelerator, args, launch, Path(source).name)
    return accelerator


@contextmanager
def same_random_state():
    """torch's random state (the CPU's and this process's GPU's) put back afterwards: what runs inside (a baseline
    evaluation: a data loader draws its seed) leaves the steps' dropout and shuffling as they would be without it."""
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
        yield


def scoring_accelerator(launch: Launch, batch_size: int) -> Accelerator:
    """An Accelerator for a model that is only scored (scripts/evaluate.py): the launch's strategy, on CPU
    processes too, without a loader for DeepSpeed to size its batch from."""
    on_cpu = not launch.on_gpu
    if on_cpu:
        share_cpu_cores()
    kwargs = dict(kwargs_handlers=[InitProcessGroupKwargs(timeout=COLLECTIVE_TIMEOUT, **cpu_process_group(launch))])
    if on_cpu and launch.kind != DEEPSPEED:
        kwargs["cpu"] = True
    accelerator = Accelerator(**kwargs)
    if on_cpu and launch.kind == FSDP:
        enable_fsdp_on_cpu(accelerator, main_process_sends=False)
    if launch.kind == DEEPSPEED:  # its `auto` sizes come from a training loader, and there is none
        config = accelerator.state.deepspeed_plugin.deepspeed_config
        config.update(train_micro_batch_size_per_gpu=batch_size, gradient_accumulation_steps=1,
                      train_batch_size=batch_size * accelerator.num_processes)
    return accelerator


def share_cpu_cores() -> None:
    """One slice of the cores per local process: oversubscribed OpenMP threads spin and run ~100x slower."""
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_processes))


def chosen_tracker(report_to: str) -> str | None:
    """`auto` means TensorBoard when it is installed; W&B and trackio only when asked for."""
    if report_to == "none":
        return None
    if report_to == "auto":
        from importlib.util import find_spec

        return "tensorboard" if find_spec("tensorboard") is not None else None
    return report_to


def restart_rendezvous(output_dir) -> dict:
    """Where the ranks of an elastic restart (`accelerate launch --max_restarts N`) meet.

    torch hands restarted ranks the launcher's store with the dead ranks' addresses still in it, and
    they try to connect to a process that is gone (seen with gloo). A fresh file store per attempt,
    in the output folder (shared by all machines in a multi-machine job), avoids it.
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if not attempt:
        return {}
    store = Path(output_dir).resolve() / f".rendezvous-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}-{attempt}"
    store.parent.mkdir(parents=True, exist_ok=True)
    return {"init_method": f"file://{store}"}  # accelerate adds rank and world size


def cpu_process_group(launch: Launch) -> dict:
    # Without GPUs the collectives go through gloo; DeepSpeed would otherwise look for oneCCL.
    return {"backend": "gloo"} if not launch.on_gpu and launch.kind == DEEPSPEED else {}


class ShardReadingAccelerator(Accelerator):
    """accelerate's Accelerator whose `prepare` fills each FSDP shard of model `model_name`, built with unread
    weights (`modeling.shape_only`), from the model's files, each process its own rows
    (`shard_loading.read_shards`): the loading `fsdp_cpu_ram_efficient_loading` asks for, without a whole
    copy in the main process or the weights sent between processes. Its FSDP plugin has that switch off
    (nothing to send)."""

    def __init__(self, model_name: str, trust_remote_code: bool, **kwargs):
        super().__init__(**kwargs)
        self.model_name, self.trust_remote_code = model_name, trust_remote_code

    def prepare(self, *objects, **kwargs):
        prepared = super().prepare(*objects, **kwargs)
        for thing in prepared if len(objects) > 1 else (prepared,):
            if isinstance(thing, torch.nn.Module):
                read_shards(thing, self.model_name, self.trust_remote_code)
        return prepared


class SequenceParallelAccelerator(Accelerator):
    """accelerate's Accelerator under DeepSpeed's sequence parallel (sp.yaml): `prepare` sets Ulysses up as
    accelerate does (the model's attention all-to-all over each group of `size` consecutive ranks, DeepSpeed's
    groups), but hands out the loaders itself. A training loader (full micro-batches only, `drop_last`: Ulysses
    runs a fixed number of rows) goes to each group whole, split over the groups as data parallel, and each
    rank keeps its slice of every sequence (`SequenceSlice`): every rank of the step sees its slice of the same
    rows, so the loop, its token count and resume are those of every other strategy. (accelerate's own adapter
    gathers the group's batches and takes them in turn, several forwards per micro-batch.) An evaluation loader
    is split over all ranks: in eval mode Ulysses steps aside (accelerate registers it so) and each rank runs
    its sequences whole, without gradients.

    Each rank's loss is its slice's own, and the gradient is their sum over all ranks; the recipes scale it
    as if the all-reduce took the mean over all ranks. ZeRO-3 does; ZeRO-1 and 2 divide by the data-parallel
    groups only (they expect every rank of a group to hold the whole sequence's loss), so `backward` divides
    by the group's size there.

    Ulysses checks that every training forward has the rows it was registered with: a micro-batch's examples x
    `rows_per_example` (a preference pair is two rows), which DeepSpeed takes as its micro-batch size."""

    def __init__(self, size: int, zero_stage: int, rows_per_example: int = 1, **kwargs):
        super().__init__(**kwargs)
        self.sequence_parallel = size
        self.gradient_excess = size if zero_stage < 3 else 1
        self.rows_per_example = rows_per_example

    def backward(self, loss, **kwargs):
        super().backward(loss / self.gradient_excess if self.gradient_excess > 1 else loss, **kwargs)

    def prepare(self, *objects, **kwargs):
        others = [thing for thing in objects if not isinstance(thing, torch.utils.data.DataLoader)]
        config = self.state.deepspeed_plugin.deepspeed_config
        for loader in objects:  # what accelerate reads from the loaders it is no longer given (Ulysses' rows too)
            if isinstance(loader, torch.utils.data.DataLoader) and loader.drop_last:
                # a file's own value is --batch-size already (settle_deepspeed), counted in examples
                config["train_micro_batch_size_per_gpu"] = loader.batch_size * self.rows_per_example
                if "train_batch_size" in config:  # (checked against the recipe's batch, in examples)
                    config["train_batch_size"] = "auto"
        prepared = super().prepare(*others, **kwargs) if others else ()
        prepared = iter(prepared if len(others) > 1 else (prepared,))
        result = [self.sequence_loader(thing) if isinstance(thing, torch.utils.data.DataLoader) else next(prepared)
                  for thing in objects]
        return result[0] if len(result) == 1 else tuple(result)

    def sequence_loader(self, loader):
        """A training loader (`drop_last`) for this rank's group, each batch sliced to this rank's positions;
        any other loader split over all the ranks, whole sequences."""
        if not loader.drop_last:
            return self.prepare_data_loader(loader)
        from accelerate.data_loader import prepare_data_loader

        size = self.sequence_parallel
        loader.collate_fn = SequenceSlice(loader.collate_fn, self.process_index % size, size)
        prepared = prepare_data_loader(loader, self.device, num_processes=self.num_processes // size,
                                       process_index=self.process_index // size, put_on_device=True,
                                       rng_types=self.rng_types.copy(), use_seedable_sampler=True,
                                       data_seed=self.dataloader_config.data_seed, non_blocking=self.non_blocking)
        self._dataloaders.append(prepared)
        return prepared


def whole_row_sums(accelerator: Accelerator, model: torch.nn.Module, sums: torch.Tensor) -> torch.Tensor:
    """`sums` (one figure a row: its log-probability, its target tokens) over the whole rows. Under sequence
    parallel a training forward gives each rank of a group a slice of every row, so the group's slices are
    summed, differentiably: every rank of the group then computes the same pair losses, and the backward's
    all-reduce hands each rank the group's gradient for its slice (the recipes count each pair once a rank,
    as tensor parallel's groups do, which that factor cancels). Elsewhere, and in eval mode (Ulysses runs each
    row whole on one rank), `sums` as they are."""
    # (the model's own mode: DeepSpeed's engine keeps `training` True through eval())
    if not isinstance(accelerator, SequenceParallelAccelerator) or not accelerator.unwrap_model(model).training:
        return sums
    from deepspeed.utils import groups

    return GroupSum.apply(sums, groups._get_sequence_parallel_group())


class GroupSum(torch.autograd.Function):
    """The sum of a tensor over a process group, whose backward sums the gradients over it too: each rank's
    loss reads the total, so each rank's part gets the group's gradient. (torch's own differentiable all-reduce
    moves between modules across the versions the recipes support.)"""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        total = tensor.clone()
        torch.distributed.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, gradient):
        total = gradient.clone()
        torch.distributed.all_reduce(total, group=ctx.group)
        return total, None


def enable_fsdp_on_cpu(accelerator: Accelerator, main_process_sends: bool) -> None:
    """Turn the CPU process group into a real FSDP run.

    accelerate only selects FSDP for GPU-like devices and falls back to plain DDP on CPU
    (silently). torch's FSDP2 itself shards on CPU with gloo, so hand it the plugin that the
    launcher's environment describes (`main_process_sends`: its fsdp_cpu_ram_efficient_loading, off
    where each process reads its shards).
    """
    from accelerate.state import AcceleratorState, PartialState

    # FSDP2: launch_config translates FSDP1 files
    plugin = FullyShardedDataParallelPlugin(cpu_ram_efficient_loading=main_process_sends)
    from torch.distributed.fsdp import CPUOffloadPolicy

    if isinstance(plugin.cpu_offload, CPUOffloadPolicy):
        # Pinned memory needs a GPU.
        plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    state = AcceleratorState()
    state.fsdp_plugin = plugin
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


@contextmanager
def parallelism_config_hidden():
    hidden = {name: os.environ.pop(name) for name in list(os.environ)
              if name.startswith("PARALLELISM_CONFIG_") or name == "ACCELERATE_USE_PARALLELISM_CONFIG"}
    try:
        yield
    finally:
        os.environ.update(hidden)


def enable_tensor_parallel_on_cpu(accelerator: Accelerator) -> None:
    """Give the CPU process group the device mesh of the launch's parallelism_config.

    accelerate accepts a parallelism_config only on GPU-like devices, though torch's tensor parallel
    runs on CPU with gloo. As on GPUs (where `hand_tensor_parallel_to_transformers` leaves the launch
    MULTI_GPU), the model is left as transformers split it: no DDP wrapper, and each tensor parallel
    group of ranks is handed the same batches.
    """
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.state import AcceleratorState, PartialState

    config = ParallelismConfig()  # the sizes the launcher put in the environment
    state = AcceleratorState()
    state.parallelism_config = config
    state.device_mesh = config.get_device_mesh("cpu")
    state.distributed_type = DistributedType.MULTI_GPU
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU


def align_deepspeed_with_recipe(accelerator: Accelerator, args, launch: Launch, source: str) -> None:
    """Make DeepSpeed accumulate and clip like every other strategy and keep the full weights savable;
    then check the result as DeepSpeed will read it (`source`: the file's name, for the refusal)."""
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    deepspeed_config.edit_deepspeed(config, args)
    if not launch.on_gpu and launch.offload_optimizer:
        # DeepSpeed's CPU Adam needs a compiled extension; on a CPU-only machine torch's AdamW
        # runs the same update without the build.
        config["zero_force_ds_cpu_optimizer"] = False
    deepspeed_config.check_engine_config(config, args, launch.precision, source)


def exit_after_a_finished_run() -> None:
    """Everything is written and the process group is closed: skip the interpreter's teardown. Now
    and then a native thread of the collective stack (seen with DeepSpeed ZeRO-3 and with TRL) is
    destroyed there while still joinable, and the C++ runtime aborts the rank with "terminate called
    without an active exception" after a good run, turning it into a failed job."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class StepSync:
    """The loop's collectives: one all-reduce per step, and the stop signals it carries.

    A step divides its loss by the target tokens of the whole global batch, so every rank must know
    that count before its first backward. Instead of an all-reduce for the count, one for the loss and
    one for the stop flag, `end_of_step` sums in one all-reduce the step's loss, the next step's token
    count (the loop fetches the next micro-batches first) and the signals received.

    SIGTERM (how SLURM pre-empts a job) or Ctrl-C asks the run to checkpoint and stop at the end of
    the step. The signal may reach one rank before another; the sum tells every rank at the same step.
    (On Ctrl-C the launcher passes SIGINT on to each rank and kills those that have not finished 30 s
    later; a second Ctrl-C makes it send SIGTERM as well. SIGINT on any rank is therefore a Ctrl-C,
    whatever came after it: a scheduler's stop sends SIGTERM alone.)
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, accelerator, counts_tokens: bool = True):
        self.accelerator = accelerator
        self.counts_tokens = counts_tokens  # False: a rank whose batches another rank counts (pipeline stages)
        self.received = set()  # every stop signal this rank got
        self.signal_name = None
        for signum in self.SIGNALS:
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.received.add(signum)

    def local_tokens(self, micro_batches) -> torch.Tensor:
        zero = torch.zeros((), dtype=torch.int64, device=self.accelerator.device)
        return sum((target_tokens(b).to(zero.device) for b in micro_batches if self.counts_tokens), zero)

    def count_tokens(self, micro_batches) -> torch.Tensor:
        """The target tokens of these micro-batches on all ranks (an all-reduce: every rank calls it)."""
        return self.accelerator.reduce(self.local_tokens(micro_batches), "sum")

    def end_of_step(self, loss_sum, next_micro_batches, other_sums=()) -> tuple[float, torch.Tensor, bool, list]:
        """One all-reduce (every rank calls it): the step's loss summed over all ranks, the target tokens
        of the next step on all ranks, whether any rank was asked to stop, and `other_sums` summed over all
        ranks (a mixture of experts' router losses; a preference step's rewards and log-probabilities)."""
        device = self.accelerator.device
        signals = [float(signum in self.received) for signum in self.SIGNALS]
        others = [torch.as_tensor(value, device=device, dtype=torch.float64).reshape(1) for value in other_sums]
        local = torch.cat([torch.as_tensor(loss_sum, device=device, dtype=torch.float64).reshape(1),
                           self.local_tokens(next_micro_batches).to(device, torch.float64).reshape(1),
                           *others, torch.tensor(signals, device=device, dtype=torch.float64)])
        total = self.accelerator.reduce(local, "sum")
        values = total.tolist()  # the step's one wait for the device
        stops = values[2 + len(others):]
        if any(stops):
            self.signal_name = "Ctrl-C" if stops[1] else "SIGTERM"
        return values[0], total[1].round().long(), any(stops), values[2:2 + len(others)]


def say_once(message: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(message, file=sys.stderr, flush=True)


def stop_quietly_on_ctrl_c() -> None:
    """Ctrl-C before training starts: one line and exit, instead of a traceback from every rank.
    (From the first step on, `StepSync` saves a checkpoint first.)"""
    def interrupted(signum, frame):
        say_once("interrupted before training started; nothing to save")
        os._exit(130)

    signal.signal(signal.SIGINT, interrupted)
