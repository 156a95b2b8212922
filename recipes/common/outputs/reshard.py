"""A checkpoint continued under another strategy or process count: its trained state read by parameter name.

Each strategy writes its checkpoint in its own layout, as fast as it can (checkpoint.py), and reads it back
where the layout is the same. Where the launch differs, the trained parameters and their AdamW moments are
read one parameter at a time by name, whatever wrote them, and put into the launch's own layout:

- one process / DDP / model parallel: accelerate's model.safetensors and optimizer.bin (the optimizer's
  entries in the order of the model's trained parameters, which the same recipe and flags make the same);
- FSDP2 and tensor parallel: torch.distributed.checkpoint folders, keyed by parameter name (FSDP's
  FULL_STATE_DICT: its gathered files, keyed by name too);
- pipeline parallel: each stage's file, its weights by name and its optimizer's entries in their order;
- DeepSpeed ZeRO-1/2/3: DeepSpeed's own converter (`ds_to_universal`) joins the ranks' partitions into
  one folder per parameter, in a scratch folder beside the checkpoint, removed after the load.

Files are mapped, not read whole, so each rank reads what it keeps: a DTensor's shard (FSDP2, tensor parallel:
sliced from the mapped tensor, or the overlapping pieces of a distributed checkpoint), DeepSpeed's partition of
the master weights and moments (`safe_set_full_fp32_param` / `safe_set_full_optimizer_state` cut them), every
byte only where every rank holds everything (one process, DDP, a pipeline stage's own layers). One parameter's
state is in memory at a time. The schedule is fitted to the launch's parameter groups; random states and the
data position are accelerate's files as before (world-size free; a rank that did not exist has no random state
to restore).
"""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")


def trained_names(model) -> dict:
    """{name: parameter} of the trained parameters, in the order the recipes give them to the optimizer."""
    return {name: param for name, param in model.named_parameters() if param.requires_grad}


def full_shape(param) -> torch.Size:
    return param.ds_shape if hasattr(param, "ds_shape") else param.shape  # ZeRO-3 keeps the whole shape aside


@contextmanager
def open_written(path: Path, layout: str, names: list[str], is_main: bool, barrier):
    """`read(name) -> {"param", "exp_avg", "exp_avg_sq"}` (whole float32 tensors of the parameter's flat or
    whole shape) and the optimizer's step count, for the checkpoint at `path` written in `layout`."""
    if layout == "whole":
        yield read_whole(path, names)
    elif layout == "fsdp":
        yield read_distributed(path / "pytorch_model_fsdp_0", "model.", path / "optimizer_0", "optimizer.state.")
    elif layout == "fsdp_full":
        yield read_gathered(path)
    elif layout == "split":  # tensor parallel's: model and optimizer in one folder
        yield read_distributed(path / "split_model_and_optimizer", "model.", path / "split_model_and_optimizer",
                               "optimizer.state.")
    elif layout == "pipeline":
        yield read_stages(path / "pipeline_stages")
    elif layout in ("zero", "zero3"):
        scratch = path.parent / f".{path.name}.by-name"
        if is_main:  # DeepSpeed's converter, run once: every rank then reads what it needs
            shutil.rmtree(scratch, ignore_errors=True)
            to_universal(path / "pytorch_model", scratch / "universal")  # (it notes its name in scratch/)
        barrier()
        try:
            yield read_universal(scratch / "universal" / "zero")
        finally:
            barrier()
            if is_main:
                shutil.rmtree(scratch, ignore_errors=True)
    else:
        raise ValueError(f"no reader for a checkpoint written as {layout}")


def read_whole(path: Path, names: list[str]):
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"  # a large model's weights come in several files
    files = (json.loads(index.read_text())["weight_map"] if index.is_file()
             else {name: "model.safetensors" for name in names})
    optimizer = torch.load(path / "optimizer.bin", map_location="cpu", weights_only=True, mmap=True)
    entries = [optimizer["state"][index] for group in optimizer["param_groups"] for index in group["params"]]
    if len(entries) != len(names):
        raise ValueError(f"{path}: its optimizer holds {len(entries)} parameters' state and does not name them (a "
                         f"checkpoint of an earlier version); continue it on one process or DDP")
    by_name = dict(zip(names, entries))

    def read(name: str, like=None) -> dict:
        with safe_open(str(path / files[name]), "pt") as weights:
            param = weights.get_tensor(name) if like is None else local_part(weights.get_slice(name), like)
        return {"param": param, **{key: part(by_name[name][key], like) for key in MOMENTS}}

    return read, float(entries[0]["step"])


def read_gathered(path: Path):
    """FSDP's FULL_STATE_DICT files: the gathered weights and an optimizer state keyed by parameter name (mapped,
    not read whole: a parameter's bytes are read when it is)."""
    weights = torch.load(path / "pytorch_model_fsdp.bin", map_location="cpu", weights_only=True, mmap=True)
    state = torch.load(path / "optimizer.bin", map_location="cpu", weights_only=True, mmap=True)["state"]

    def read(name: str, like=None) -> dict:
        return {"param": part(weights[name], like), **{key: part(state[name][key], like) for key in MOMENTS}}

    return read, float(next(iter(state.values()))["step"])


def read_stages(folder: Path):
    """A pipeline's files: each stage's trained weights by name, and its optimizer's state in their order."""
    by_name, step = {}, None
    for file in sorted(folder.glob("stage-*.pt")):
        stage = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        optimizer = stage["optimizer"]
        entries = [optimizer["state"][index] for group in optimizer["param_groups"] for index in group["params"]]
        for (name, param), entry in zip(stage["model"].items(), entries, strict=True):
            by_name[name] = {"param": param, **{key: entry[key] for key in MOMENTS}}
            step = entry["step"]

    def read(name: str, like=None) -> dict:
        return {key: part(value, like) for key, value in by_name[name].items()}

    return read, float(step)


def read_distributed(model_folder: Path, model_prefix: str, optimizer_folder: Path, state_prefix: str):
    """torch.distributed.checkpoint folders, read in this process alone, a parameter's keys at a time."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    stored = FileSystemReader(str(model_folder)).read_metadata().state_dict_metadata
    moments = FileSystemReader(str(optimizer_folder)).read_metadata().state_dict_metadata

    def empty(entry, like=None):
        if like is None:
            return torch.empty(entry.size, dtype=entry.properties.dtype)
        # a DTensor target: the reader takes only the stored pieces that overlap this rank's shard
        return torch.distributed.tensor.empty(entry.size, dtype=entry.properties.dtype,
                                              device_mesh=like.device_mesh, placements=like.placements)

    def load(folder, wanted: dict) -> dict:
        dcp.load(wanted, checkpoint_id=str(folder), no_dist=True)
        return {key: value.to_local() if hasattr(value, "to_local") else value for key, value in wanted.items()}

    def read(name: str, like=None) -> dict:
        key = model_prefix + name
        param = load(model_folder, {key: empty(stored[key], like)})[key]
        keys = {key: f"{state_prefix}{name}.{key}" for key in MOMENTS}
        found = load(optimizer_folder, {flat: empty(moments[flat], like) for flat in keys.values()})
        return {"param": param, **{key: found[flat] for key, flat in keys.items()}}

    steps = [key for key in moments if key.startswith(state_prefix) and key.endswith(".step")]
    step = load(optimizer_folder, {steps[0]: empty(moments[steps[0]])})[steps[0]]
    return read, float(step)


def to_universal(folder: Path, output: Path) -> None:
    """DeepSpeed's own converter: one folder per parameter with its whole fp32 value and moments."""
    from types import SimpleNamespace

    from deepspeed.checkpoint import ds_to_universal

    ds_to_universal.main(SimpleNamespace(input_folder=str(folder), output_folder=str(output), num_extract_workers=1,
                                         num_merge_workers=1, keep_temp_folder=False, strict=True,
                                         inject_missing_state=True))


def read_universal(folder: Path):
    def tensor(file: Path) -> torch.Tensor:
        value = torch.load(file, map_location="cpu", weights_only=False, mmap=True)
        return (value["param"] if isinstance(value, dict) else value).detach()  # ZeRO-1/2 wrap it, ZeRO-3 not

    def read(name: str, like=None) -> dict:
        return {"param": part(tensor(folder / name / "fp32.pt"), like),
                **{key: part(tensor(folder / name / f"{key}.pt"), like) for key in MOMENTS}}

    steps = list(folder.glob("*/step.pt"))
    if steps:  # ZeRO-1/2 keep it by parameter, ZeRO-3 with the optimizer's common state
        step = tensor(steps[0])
    else:
        state = torch.load(folder / "optimizer_state.pt", map_location="cpu", weights_only=False)
        step = next(iter(state["optimizer_state_dict"]["state"].values()))["step"]
    return read, float(step)


def part(whole: torch.Tensor, like) -> torch.Tensor:
    """`whole` (a tensor mapped from its file: nothing read yet), or this rank's part of it where the parameter
    laid out `like` is a DTensor: only the pages of that part are read."""
    return whole if like is None else local_part(whole.reshape(like.shape), like)


def local_part(whole, like) -> torch.Tensor:
    """The block of `whole` (a tensor, or a safetensors slice: both cut alike) that this rank holds of the DTensor
    `like`."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    return whole[tuple(slice(start, start + size) for start, size in zip(offset, shape))]


def load_trained_state(model, optimizer, read, step: float) -> None:
    """Set every trained parameter of `model` and its AdamW state from `read` (by name), in this launch's own
    layout. `optimizer` is the prepared one (accelerate's wrapper). What each rank reads: its shard of a DTensor
    (FSDP2, tensor parallel); its partition of the weights and moments under DeepSpeed (all of the 16-bit weights
    under ZeRO-1/2, which every rank holds; the first rank sets ZeRO-3's); all of them where every rank holds all
    (one process, DDP)."""
    from torch.distributed.tensor import DTensor

    inner = optimizer.optimizer  # torch's AdamW, or DeepSpeed's ZeRO optimizer around it
    deepspeed = hasattr(inner, "optimizer") and not isinstance(inner, torch.optim.Optimizer)
    if deepspeed:
        make_zero_state(inner)
    for name, param in trained_names(model).items():
        split = isinstance(param, DTensor)
        state = read(name, param if split else None)
        if deepspeed:
            set_in_deepspeed(param, {key: value.reshape(full_shape(param)) for key, value in state.items()})
            continue
        state = {key: value.to(param.device, torch.float32, copy=True).reshape(
            param.to_local().shape if split else param.shape) for key, value in state.items()}
        if split:  # this rank's shard, as the DTensor of the parameter's layout
            state = {key: DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                             shape=param.shape, stride=param.stride()) for key, value in state.items()}
        with torch.no_grad():
            param.copy_(state["param"].to(param.dtype))
        inner.state[param] = {"step": torch.tensor(step, dtype=torch.float32, device=param.device),
                              **{key: state[key] for key in MOMENTS}}
    if deepspeed:  # ZeRO's optimizer holds a state per flat group: the step count is the same for all
        for entry in inner.optimizer.state.values():
            entry["step"] = torch.full_like(entry["step"], step) if torch.is_tensor(entry["step"]) else int(step)


def make_zero_state(zero) -> None:
    """ZeRO's optimizer creates its moments at the first step: one step at learning rate 0 on zero gradients
    creates them, in the optimizer's own format, without moving a weight (DeepSpeed's ZeRO-1/2 then links
    each parameter to its part of them, as after a first step)."""
    groups = zero.optimizer.param_groups
    rates, members = [group["lr"] for group in groups], [group["params"] for group in groups]
    partitions = getattr(zero, "fp32_partitioned_groups_flat", None)  # ZeRO-3 hands them over one at a time
    if partitions is not None:
        for group in groups:
            group["params"] = []
        for index, partition in enumerate(partitions):
            groups[zero.sub_group_to_group_id[index]]["params"].append(partition)
    flat = [param for group in groups for param in group["params"]]
    grads = [param.grad for param in flat]
    for group in groups:
        group["lr"] = 0.0
    for param in flat:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    zero.optimizer.step()
    for group, rate, params in zip(groups, rates, members):
        group["lr"], group["params"] = rate, params
    for param, grad in zip(flat, grads):
        param.grad = grad
    link = getattr(zero, "_lazy_init_hp_params_optimizer_state", None)  # ZeRO-1/2
    if link is not None:
        link()


def set_in_deepspeed(param, state: dict) -> None:
    """DeepSpeed keeps a 16-bit (or fp32) copy the forward uses and the fp32 master the optimizer updates. The
    master and the moments take this rank's partition of the (mapped) whole tensors; ZeRO-3's 16-bit copy is
    gathered, set by the first rank of its group and partitioned from there."""
    import deepspeed
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    partitioned = hasattr(param, "ds_id")
    with deepspeed.zero.GatheredParameters([param], modifier_rank=0, enabled=partitioned), torch.no_grad():
        if not partitioned or torch.distributed.get_rank(param.ds_process_group) == 0:
            param.copy_(state["param"].to(param.dtype))
    safe_set_full_fp32_param(param, state["param"].float())
    for key in MOMENTS:
        safe_set_full_optimizer_state(param, state[key].float(), key)


def load_schedule(scheduler, saved: dict) -> None:
    """A learning-rate schedule's state, written with as many parameter groups as that launch had (tensor
    parallel keeps its split weights in a group of their own; the recipes give every group one rate): fitted to
    this launch's groups, and the rate it had set put back into them (the optimizer's state held it)."""
    groups = len(scheduler.optimizer.param_groups)
    scheduler.load_state_dict({key: [value[0]] * groups if isinstance(value, list) and value else value
                               for key, value in saved.items()})
    for group, rate in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = rate
