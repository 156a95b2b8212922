"""The launch object (recipes/common/launching/launch.py) and the loop's one collective per step
(runtime.StepSync), in-process.

Every shipped config goes through accelerate's own launcher code (as scripts/check_config.py does)
and must describe itself as the planner's name for that file.
"""

from __future__ import annotations

import signal
import sys
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch

from conftest import REPO

sys.path.insert(0, str(REPO / "recipes"))
sys.path.insert(0, str(REPO / "scripts"))
import check_config  # noqa: E402
import planner  # noqa: E402
from common.launching import launch as launch_module  # noqa: E402
from common.launching import preflight  # noqa: E402
from common.launching.args import parse_args, recipe_flags  # noqa: E402
from common.data.formats import IGNORE  # noqa: E402
from common.launching.launch_config import adapt_launch  # noqa: E402
from common.training.runtime import StepSync  # noqa: E402

CONFIG_OF = {Path(file).name: strategy for strategy, file in planner.STRATEGIES.items()}  # file -> name


def described(config_name: str, on_gpu: bool, processes: int | None = None, visible_gpus: int = 0, **changed_env):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the launcher's notes about ports in use
        env = check_config.launcher_environment(REPO / "accelerate_configs" / config_name, processes)
    env = {key: value for key, value in {**env, **changed_env}.items() if value is not None}
    args = parse_args(recipe_flags("lora"), [])
    with mock.patch.dict("os.environ", env, clear=True), mock.patch("torch.cuda.device_count",
                                                                    return_value=visible_gpus):
        adapt_launch(args, config_file=REPO / "accelerate_configs" / config_name, on_gpu=on_gpu)
        return launch_module.describe(on_gpu=on_gpu)


@pytest.mark.parametrize("config_name", sorted(CONFIG_OF))
def test_every_shipped_config_describes_itself_as_the_planner_names_it(config_name):
    on_gpu = config_name in ("fsdp_hybrid.yaml", "model_parallel.yaml")  # hybrid shard is refused on CPU
    launch = described(config_name, on_gpu=on_gpu, processes=None if config_name != "fsdp_hybrid.yaml" else 4,
                       visible_gpus=4 if on_gpu else 0)
    if config_name == "pipeline.yaml":  # a plain multi-process file: the recipe's --pipeline-stages makes the stages
        assert launch.planner_strategy == "ddp"
        launch = preflight.check_pipeline(parse_args(recipe_flags("lora"), ["--pipeline-stages", "2"]), "lora", launch)
    assert launch.planner_strategy == CONFIG_OF[config_name]
    assert launch.shards_parameters == (launch.kind in ("fsdp", "tensor_parallel") or launch.zero_stage == 3)
    if config_name in ("tp.yaml", "fsdp_tp.yaml"):  # the ranks of a tensor parallel group share their batches
        mesh = {"tp.yaml": (4, 1), "fsdp_tp.yaml": (2, 2)}[config_name]
        assert (launch.kind, launch.tensor_parallel, launch.data_parallel_size) == ("tensor_parallel", *mesh)
    if config_name == "model_parallel.yaml":
        assert (launch.kind, launch.processes, launch.gpus) == ("model_parallel", 1, 4)


@pytest.mark.parametrize("zero3_init, loading", [
    ("true", launch_module.MAIN_PROCESS_SENDS), (None, launch_module.MAIN_PROCESS_SENDS),  # absent: on, as accelerate has it
    ("on", launch_module.MAIN_PROCESS_SENDS), ("false", launch_module.EVERY_PROCESS_READS),
    ("0", launch_module.EVERY_PROCESS_READS)])
def test_zero3_init_flag_is_read_as_accelerate_reads_it(zero3_init, loading):
    launch = described("zero3.yaml", on_gpu=False, ACCELERATE_DEEPSPEED_ZERO3_INIT=zero3_init)
    assert (launch.zero_stage, launch.loading) == (3, loading)
    assert described("zero2.yaml", on_gpu=False).loading is None


def test_one_process_on_one_device_is_not_model_parallel():
    launch = described("model_parallel.yaml", on_gpu=False)
    assert (launch.kind, launch.gpus, launch.planner_strategy) == ("single", 1, "ddp")


@pytest.mark.parametrize("precision, frozen, trained", [
    ("no", torch.float32, torch.float32), ("bf16", torch.bfloat16, torch.float32),
    ("fp16", torch.float16, torch.float32)])
def test_frozen_weights_follow_the_precision_and_trained_ones_stay_fp32(precision, frozen, trained):
    launch = launch_module.describe({"WORLD_SIZE": "2", "ACCELERATE_MIXED_PRECISION": precision}, on_gpu=True)
    assert (launch.kind, launch.float_dtype(frozen=True), launch.float_dtype(frozen=False)) == ("ddp", frozen, trained)


def test_under_deepspeeds_mixed_precision_every_weight_is_16_bit():
    """DeepSpeed keeps the float32 masters in its optimizer; ZeRO-3's zero.Init keeps the dtype the model is built
    in, so trained weights built in float32 would run the forward in float32."""
    launch = launch_module.describe({"WORLD_SIZE": "2", "ACCELERATE_MIXED_PRECISION": "bf16",
                                     "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"},
                                    on_gpu=True)
    assert (launch.kind, launch.float_dtype(frozen=True), launch.float_dtype(frozen=False)) == (
        "deepspeed", torch.bfloat16, torch.bfloat16)


class TwoRanks:
    """An accelerator whose reduce adds what a second rank would contribute, and counts the calls."""

    device = torch.device("cpu")

    def __init__(self, other_rank: list[float]):
        self.other_rank = torch.tensor(other_rank, dtype=torch.float64)
        self.reduces = 0

    def reduce(self, tensor, reduction):
        assert reduction == "sum"
        self.reduces += 1
        return tensor + self.other_rank.to(tensor.dtype).reshape(tensor.shape)


def batch_with_targets(targets: int, length: int = 10) -> dict:
    labels = torch.full((1, length), IGNORE)
    labels[0, length - targets:] = 7  # the first position is never a target (labels shift by one)
    return {"labels": labels}


@pytest.fixture
def handlers_restored():
    saved = {signum: signal.getsignal(signum) for signum in StepSync.SIGNALS}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def test_a_step_ends_with_one_all_reduce_of_loss_next_tokens_and_stop(handlers_restored):
    accelerator = TwoRanks([2.5, 5, 0.25, 0, 0])  # the other rank: loss sum 2.5, 5 next tokens, router loss, no signal
    sync = StepSync(accelerator)
    summed_loss, next_tokens, stopping, router = sync.end_of_step(torch.tensor(1.5), [batch_with_targets(3),
                                                                                      batch_with_targets(4)], [0.5])
    assert accelerator.reduces == 1
    assert (summed_loss, int(next_tokens), stopping, router) == (4.0, 12, False, [0.75])
    assert next_tokens.dtype == torch.int64  # it divides the next step's loss


@pytest.mark.parametrize("here, other_rank, name", [
    ([signal.SIGTERM], [], "SIGTERM"),  # a scheduler's stop
    ([signal.SIGINT], [], "Ctrl-C"),
    ([], [signal.SIGTERM], "SIGTERM"),
    ([signal.SIGINT, signal.SIGTERM], [], "Ctrl-C"),  # a second Ctrl-C: the launcher adds SIGTERM
    ([signal.SIGTERM], [signal.SIGINT], "Ctrl-C"),  # ranks that took the two signals in another order
])
def test_a_signal_on_any_rank_stops_every_rank_at_the_same_step(handlers_restored, here, other_rank, name):
    other = [0, 0, 0, float(signal.SIGTERM in other_rank), float(signal.SIGINT in other_rank)]
    sync = StepSync(TwoRanks(other))
    for signum in here:
        signal.raise_signal(signum)  # the handler StepSync installed takes it
    assert sync.end_of_step(torch.tensor(0.0), [], [0.0])[2] is True
    assert sync.signal_name == name


def test_the_first_step_counts_its_tokens_over_all_ranks(handlers_restored):
    accelerator = TwoRanks([6])
    assert int(StepSync(accelerator).count_tokens([batch_with_targets(2)])) == 8 and accelerator.reduces == 1


def test_every_recipe_loop_names_its_collectives():
    """The loop's collectives are visible calls: one end_of_step per step (and the first step's
    count before the loop), run.json's gather at one point; no reduce or gather hides in the loop."""
    for recipe in ("full", "lora", "qlora"):
        source = (REPO / "recipes" / f"{recipe}.py").read_text()
        loop = source[source.index("    for step in range("):source.index("    # Export")]
        assert loop.count("sync.end_of_step(") == 1 and loop.count("log.record_ranks()") == 1, recipe
        assert "accelerator.reduce(" not in loop and "accelerator.gather(" not in loop, recipe
        assert "bool(" not in loop, recipe
