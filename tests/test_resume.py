"""A run resumed from its checkpoint continues the uninterrupted run's loss curve exactly."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from conftest import REPO, free_port, launch, long_test
from strategies import CPU_STRATEGIES, GLOBAL_BATCH, GRAD_ACCUM, SAVE_EVERY, STEPS, matrix_args

sys.path.insert(0, str(REPO / "recipes"))

# FSDP2's and ZeRO-3's sharded checkpoints in every run, the other strategies as long tests. DDP with
# dropout and DataLoader workers: tests/test_interruptions.py resumes it past a damaged checkpoint.
@pytest.mark.parametrize("config", [pytest.param(config, marks=() if config in ("fsdp", "zero3") else long_test)
                                    for config in CPU_STRATEGIES])
def test_resume_continues_the_same_loss_curve(config, trained, tmp_path):
    whole = trained("lora", config)  # the matrix launch: 8 steps, a checkpoint every SAVE_EVERY
    assert whole.returncode == 0, whole.output[-3000:]

    # The same run, stopped after the first save: only that checkpoint survives.
    resumed_dir = tmp_path / "resumed"
    checkpoint = f"step-{SAVE_EVERY}"
    shutil.copytree(whole.output_dir / "checkpoints" / checkpoint, resumed_dir / "checkpoints" / checkpoint)
    resumed = launch("lora", resumed_dir, *matrix_args("lora", config), "--resume", "auto", config=config,
                     processes=CPU_STRATEGIES[config][1])
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert f"resumed from {resumed_dir / 'checkpoints' / checkpoint} at step {SAVE_EVERY}" in resumed.output

    steps = [record["step"] for record in resumed.metrics()]
    assert steps == list(range(SAVE_EVERY + 1, STEPS + 1))
    assert resumed.losses() == whole.losses()[SAVE_EVERY:]


def test_a_fresh_run_does_not_mix_into_an_older_metrics_file(tmp_path):
    """A fresh run starts metrics.jsonl anew; a resumed one keeps the lines up to its checkpoint's step."""
    from types import SimpleNamespace

    from common.outputs.runlog import RunLog

    older = "".join(json.dumps({"type": "train", "step": step, "loss": 1.0}) + "\n" for step in range(1, 6))
    for first_step, kept in ((0, []), (3, [1, 2, 3])):
        (tmp_path / "metrics.jsonl").write_text(older)
        log = RunLog(SimpleNamespace(is_main_process=True), SimpleNamespace(output_dir=tmp_path, log_every=None), "lora", None)
        log.start(first_step=first_step, total_steps=8)
        log.metrics.close()
        lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == kept


@pytest.mark.parametrize("config", ["ddp", pytest.param("fsdp", marks=long_test)])
def test_a_checkpoint_continues_on_fewer_processes_on_the_same_curve(config, trained, tmp_path):
    """DDP's and FSDP2's checkpoints load as written at another process count; with the same global batch each
    step takes the rows it took before (the shuffle is over the global batch), so the curve continues, the
    gradient norm too, where the accumulation changes (2 -> 16 here; the checkpoint's micro-batch counter,
    4 steps x 2, is no multiple of 16: a counter carried over syncs and steps at the wrong micro-batch)."""
    whole = trained("lora", config)
    assert whole.returncode == 0, whole.output[-3000:]
    checkpoint = f"step-{SAVE_EVERY}"
    shutil.copytree(whole.output_dir / "checkpoints" / checkpoint, tmp_path / "checkpoints" / checkpoint)
    resumed = launch("lora", tmp_path, *same_global_batch("lora", config, 1, micro_batch=1), "--resume", "auto",
                     config=config, processes=1)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert f"was written by 2 processes and resumes on 1" in resumed.output
    assert "read parameter by parameter" not in resumed.output  # read as written
    assert resumed.run_json()["batch"]["grad_accum"] == GLOBAL_BATCH
    assert_same_curve(resumed, whole, SAVE_EVERY)


def same_global_batch(recipe: str, config: str, processes: int, micro_batch: int = 4) -> list[str]:
    """The matrix launch's flags for `config` on `processes` processes, each step the same 16 rows in micro-batches
    of `micro_batch` (the matrix's on 2 processes): the accumulation is 16 / micro_batch / processes where the
    matrix launches accumulate 2."""
    args = matrix_args(recipe, config)
    del args[args.index("--grad-accum"):args.index("--grad-accum") + 2]
    args[args.index("--batch-size") + 1] = str(micro_batch)
    return args + ["--global-batch-size", str(GLOBAL_BATCH)]


def assert_same_curve(resumed, whole, first_step: int, tolerance: float = 1e-5) -> None:
    """Every resumed step's loss and gradient norm are the uninterrupted run's, within `tolerance` (relative)."""
    after = [record for record in whole.metrics() if record["step"] > first_step]
    assert [record["step"] for record in resumed.metrics()] == [record["step"] for record in after]
    assert len(after) >= 3
    for name in ("loss", "grad_norm"):
        assert [record[name] for record in resumed.metrics()] == pytest.approx([record[name] for record in after],
                                                                                 rel=tolerance), name


# (recipe, the strategy that wrote the checkpoint, the one that continues it, on how many processes): DDP, FSDP2
# and ZeRO-3 into each other both ways, ZeRO-1 into ZeRO-2, full and LoRA, counts down (2 -> 1) and up (1 -> 4,
# 2 -> 4). Two in every run; RECIPES_LONG_TESTS=1 all of them (the preference recipes: tests/test_dpo.py).
CROSSINGS = [("lora", "zero3", "fsdp", 2), ("full", "fsdp", "zero3", 1), ("lora", "ddp", "fsdp", 2),
             ("lora", "fsdp", "ddp", 2), ("full", "zero3", "ddp", 2), ("full", "ddp", "zero3", 2),
             ("lora", "zero3", "zero3", 1), ("lora", "zero1", "zero2", 4), ("full", "model_parallel", "zero3", 4),
             ("full", "zero3", "fsdp", 4), ("qlora", "ddp", "zero3_offload", 2)]
EVERY_RUN_CROSSINGS = CROSSINGS[:2]


@pytest.mark.parametrize("recipe, written, config, processes", [
    pytest.param(*crossing, marks=() if crossing in EVERY_RUN_CROSSINGS else long_test) for crossing in CROSSINGS])
def test_a_checkpoint_continues_under_another_strategy_on_the_same_curve(recipe, written, config, processes,
                                                                        trained, tmp_path):
    """Another strategy, or DeepSpeed on another process count: the trained state is read by parameter name and
    the run goes on as the uninterrupted one did, within float round-off (each was a traceback or a refusal)."""
    whole = trained(recipe, written)
    assert whole.returncode == 0, whole.output[-3000:]
    checkpoint = tmp_path / "checkpoints" / f"step-{SAVE_EVERY}"
    shutil.copytree(whole.output_dir / "checkpoints" / checkpoint.name, checkpoint)
    resumed = launch(recipe, tmp_path, *same_global_batch(recipe, config, processes), "--resume", "auto",
                     config=config, processes=processes)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert f"note: {checkpoint} holds " in resumed.output
    assert "its trained state is read parameter by parameter into this launch" in resumed.output
    assert "torch.distributed is disabled" not in resumed.output  # torch's note on a checkpoint read in one process
    assert_same_curve(resumed, whole, SAVE_EVERY)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [f"step-{SAVE_EVERY}", f"step-{STEPS}"]


@pytest.mark.parametrize("files, written, read_as_written_by", [
    (["model.safetensors", "optimizer.bin"], "whole", "whole"),
    (["pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata"], "fsdp", "fsdp"),
    (["pytorch_model_fsdp.bin", "optimizer.bin"], "fsdp_full", "fsdp_full"),  # fsdp_state_dict_type FULL_STATE_DICT
    (["split_model_and_optimizer/.metadata"], "split", "split"),
    (["pipeline_stages/stage-0.pt", "pipeline_stages/stage-1.pt"], "pipeline", None),  # always by name
    (["pytorch_model/mp_rank_00_model_states.pt", "pytorch_model/zero_pp_rank_0_mp_rank_00_optim_states.pt",
      "pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt"], "zero", "zero"),
])
def test_a_checkpoint_is_read_as_written_only_by_its_own_layout(files, written, read_as_written_by, tmp_path):
    """The layout comes from the files; every other launch reads the checkpoint by name."""
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    from common.outputs import checkpoint

    assert checkpoint.written_as(tmp_path)[0] == written
    for layout in ("whole", "fsdp", "fsdp_full", "split", "pipeline", "zero", "zero3"):
        assert checkpoint.read_by_name(*checkpoint.written_as(tmp_path), layout, 2) == (layout != read_as_written_by)


def test_the_restart_line_names_the_launcher_that_restarts():
    from common.outputs.checkpoint import restarting_launcher

    assert restarting_launcher([sys.executable, "-m", "accelerate.commands.launch", "--max_restarts", "2"]) == (
        "accelerate launch --max_restarts")
    assert restarting_launcher(["/usr/bin/python3", "/usr/local/bin/accelerate", "launch"]) == (
        "accelerate launch --max_restarts")
    for torchrun in (["/usr/bin/python3", "/usr/local/bin/torchrun", "--nnodes", "1:2"],
                     [sys.executable, "-m", "torch.distributed.run", "--max-restarts", "2"]):
        assert restarting_launcher(torchrun) == "torchrun --max-restarts"


def test_deepspeed_reads_its_own_files_at_the_same_count_only(tmp_path):
    for rank in range(2):
        folder = tmp_path / "pytorch_model"
        folder.mkdir(exist_ok=True)
        (folder / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"")
        (folder / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt").write_bytes(b"")
    from common.outputs import checkpoint

    assert checkpoint.written_as(tmp_path) == ("zero3", 2)
    assert not checkpoint.read_by_name(*checkpoint.written_as(tmp_path), "zero3", 2)
    assert checkpoint.read_by_name(*checkpoint.written_as(tmp_path), "zero3", 4)
    assert checkpoint.read_by_name(*checkpoint.written_as(tmp_path), "zero", 2)


# A checkpoint at step 3 of steps of 8 rows, micro-batches of 2: the accumulation is 4 / processes, so every count
# change below changes it, and the micro-batches the checkpoint counted (3 x its accumulation) are no multiple of
# the new accumulation going down. (recipe, writer, its processes, the launch that continues, its processes); None
# is one process; the user's own FSDP file with FULL_STATE_DICT (TRL's) both ways. The matrix launches above cover
# the every-run case (DDP 2 -> 1).
USER_FSDP_FULL = str(REPO / "tests" / "fixtures" / "user_configs" / "trl__fsdp2.yaml")
COUNT_CHANGES = [
    ("lora", "ddp", 2, None, 1), ("lora", "zero3", 2, "zero3", 1), ("lora", "zero1", 2, "zero2", 1),
    ("full", "fsdp", 2, "fsdp", 1), ("full", "zero2", 2, None, 1), ("full", "ddp", 4, "zero3", 2),
    ("lora", "fsdp", 4, "ddp", 1),
    ("lora", None, 1, "fsdp", 2), ("full", None, 1, "zero3", 2), ("lora", "zero3", 1, "zero3", 2),
    ("full", "fsdp", 1, "zero1", 4),
    ("lora", USER_FSDP_FULL, 2, "ddp", 1), ("full", USER_FSDP_FULL, 2, USER_FSDP_FULL, 1),
    ("full", "zero3", 2, USER_FSDP_FULL, 1), ("lora", "fsdp", 2, USER_FSDP_FULL, 4),
    ("dpo", "ddp", 2, None, 1), ("dpo", "zero3", 2, "fsdp", 1), ("dpo", None, 1, "zero3", 2),
    ("dpo_full", "fsdp", 2, "zero3", 1), ("dpo_full", "zero2", 2, "ddp", 4),
]


def count_change_args(recipe: str) -> list[str]:
    args = ["--batch-size", "2", "--global-batch-size", "8", "--max-steps", "6", "--save-every", "3",
            "--eval-every", "0", "--lr", "1e-3"]
    return args + (["--lora-dropout", "0"] if recipe in ("lora", "dpo") else [])


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    runs = {}

    def run(recipe: str, config: str | None, processes: int):
        if (recipe, config, processes) not in runs:
            output_dir = tmp_path_factory.mktemp(f"{recipe}-{processes}") / "out"
            runs[recipe, config, processes] = launch(recipe, output_dir, *count_change_args(recipe), config=config,
                                                     processes=processes)
        return runs[recipe, config, processes]

    return run


@long_test
@pytest.mark.parametrize("recipe, writer, written_on, config, processes", COUNT_CHANGES)
def test_a_checkpoint_continues_where_the_count_and_the_accumulation_change(recipe, writer, written_on, config,
                                                                            processes, written, tmp_path):
    whole = written(recipe, writer, written_on)
    assert whole.returncode == 0, whole.output[-3000:]
    resumed = launch(recipe, tmp_path, *count_change_args(recipe), "--resume",
                     str(whole.output_dir / "checkpoints" / "step-3"), config=config, processes=processes)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert resumed.run_json()["batch"]["grad_accum"] == 4 // processes != whole.run_json()["batch"]["grad_accum"]
    assert_same_curve(resumed, whole, 3)


def test_a_read_by_name_keeps_the_loss_scale_where_the_checkpoint_has_one(tmp_path):
    """fp16's loss scale (accelerate's scaler.pt) does not depend on the layout: it is restored by name too, so
    the resumed steps are not skipped again while the scale comes down from its start."""
    from types import SimpleNamespace

    from common.outputs.checkpoint import trained_state_apart

    scaler = object()
    accelerator = SimpleNamespace(_models=["m"], _optimizers=["o"], _schedulers=["s"], scaler=scaler)
    with trained_state_apart(accelerator, tmp_path):
        assert (accelerator._models, accelerator._optimizers, accelerator._schedulers) == ([], [], [])
        assert accelerator.scaler is None  # written without one (bf16, DeepSpeed): nothing to read
    (tmp_path / "scaler.pt").write_bytes(b"")
    with trained_state_apart(accelerator, tmp_path):
        assert accelerator.scaler is scaler
    assert (accelerator._models, accelerator._optimizers, accelerator._schedulers, accelerator.scaler) == (
        ["m"], ["o"], ["s"], scaler)


READS_ITS_SHARD = """
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, {recipes!r})
from pathlib import Path
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from common.outputs import reshard

dist.init_process_group("gloo")
rank, folder = dist.get_rank(), Path({folder!r})
whole = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3)
moments = {{"exp_avg": whole + 100, "exp_avg_sq": whole + 200}}
if rank == 0:  # a gathered FSDP checkpoint and one process's files, as accelerate writes them
    torch.save({{"w": whole}}, folder / "pytorch_model_fsdp.bin")
    torch.save({{"state": {{"w": {{"step": torch.tensor(3.0), **moments}}}}, "param_groups": []}}, folder / "optimizer.bin")
    (folder / "whole").mkdir()
    save_file({{"w": whole}}, str(folder / "whole" / "model.safetensors"))
    torch.save({{"state": {{0: {{"step": torch.tensor(3.0), **moments}}}}, "param_groups": [{{"params": [0]}}]}},
               folder / "whole" / "optimizer.bin")
dist.barrier()
like = distribute_tensor(torch.zeros(7, 3), init_device_mesh("cpu", (2,)), [Shard(0)])
rows = slice(0, 4) if rank == 0 else slice(4, 7)  # torch's even split of 7 rows over 2 ranks
for read, step in (reshard.read_gathered(folder), reshard.read_whole(folder / "whole", ["w"])):
    mine = read("w", like)
    assert step == 3.0
    assert torch.equal(mine["param"], whole[rows]), (rank, mine["param"])
    for key, value in moments.items():
        assert torch.equal(mine[key], value[rows])
    whole_read = read("w")
    assert torch.equal(whole_read["param"], whole)
# a mapped file: this rank's rows are a view of the mapping, nothing else is read
mapped = torch.load(folder / "pytorch_model_fsdp.bin", mmap=True, weights_only=True)["w"]
part = reshard.part(mapped, like)
assert part.untyped_storage().data_ptr() == mapped.untyped_storage().data_ptr() and part.shape == whole[rows].shape
print("ok", rank)
"""


def test_each_rank_reads_only_its_shard_of_a_parameter_read_by_name(tmp_path):
    """Into a sharded parameter (FSDP2, tensor parallel), a checkpoint's weights and moments are read as the rank's
    rows: from a gathered FSDP checkpoint (mapped) and from one process's files (safetensors' slice, the mapped
    optimizer file); the mapped rows are a view, not a copy of the whole."""
    import subprocess

    script = tmp_path / "reads.py"
    script.write_text(READS_ITS_SHARD.format(recipes=str(REPO / "recipes"), folder=str(tmp_path)))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(free_port()), str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert sorted(line for line in done.stdout.splitlines() if line.startswith("ok")) == ["ok 0", "ok 1"]
