"""The planner's time estimate (recipes/planner/timing.py, hardware.py) and the ranking it drives.

The FLOP count is checked against torch's own counter on the tiny Llama; the estimate's ratios
against the two reference measurements the project exists to reproduce (4 x RTX 6000 Ada, PCIe):
TinyLlama-1.1B LoRA model parallel / DDP = 3 min 53 s / 59 s = 3.95, CodeLlama-34B LoRA model
parallel / FSDP = 47 / 30 min = 1.57, each within 30%. No training runs.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "recipes"))
import planner  # noqa: E402
from planner.timing import active_matmul_parameters, all_reduce, gather  # noqa: E402

PLAN = REPO / "scripts" / "plan.py"
REFERENCE = planner.Machine.of("rtx6000-ada")


def epoch(shape, strategy, batch, accum, checkpointing=0, machine=REFERENCE, method="lora", gpus=4, seq_len=1024):
    step = planner.step_time(shape, method, strategy, gpus, machine, batch, accum, seq_len, checkpointing)
    return planner.epoch_time(step, 1024)


# ---------------------------------------------------------------------------- FLOPs

def counted_flops(method: str, checkpointing: int) -> int:
    """forward + backward of an 8-layer tiny Llama (2 x 64 tokens), as torch's FlopCounterMode counts the
    matmuls, with checkpointing enabled as the recipes enable it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import LlamaConfig, LlamaForCausalLM

    from common.model.modeling import checkpoint_activations

    config = json.loads((REPO / "data" / "tiny-llama-config.json").read_text())
    config["num_hidden_layers"] = 8
    config = LlamaConfig(**config)
    config._attn_implementation = "eager"  # sdpa's backward is counted as 2.5 forwards, the matmuls it runs
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if checkpointing:
        checkpoint_activations(model, checkpointing)
        model.config.use_cache = False
    if method == "lora":
        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0))
    model.train()
    ids = torch.randint(0, config.vocab_size, (2, 64))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    return counter.get_total_flops()


CASES = [(method, checkpointing) for method in ("full", "lora") for checkpointing in (0, 1, 2)]


@pytest.fixture(scope="module")
def torch_counts():
    """Counted in a fresh process: what checkpointing recomputes depends on state that other tests (FSDP on
    fake ranks) leave behind in theirs."""
    done = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return {(method, every): flops for method, every, flops in json.loads(done.stdout.strip().splitlines()[-1])}


@pytest.mark.parametrize("method, checkpointing", CASES)
def test_flops_are_what_torch_counts(method, checkpointing, torch_counts):
    """Full fine-tuning to the FLOP; LoRA within 1% (the first block's q/k/v get no input gradient when
    nothing before them is trained, which the estimate leaves out)."""
    config = json.loads((REPO / "data" / "tiny-llama-config.json").read_text())
    shape = planner.ModelShape.from_config({**config, "num_hidden_layers": 8})
    planned = planner.flops_per_token(shape, method, 64, checkpointing, 4, "all-linear")["total"] * 2 * 64
    if method == "full":
        assert planned == torch_counts[method, checkpointing]
    else:
        assert planned == pytest.approx(torch_counts[method, checkpointing], rel=0.01)


def test_lora_costs_two_thirds_of_full_and_checkpointing_a_forward(tinyllama):
    full = planner.flops_per_token(tinyllama, "full", 1024)
    lora = planner.flops_per_token(tinyllama, "lora", 1024)
    n, a = sum(active_matmul_parameters(tinyllama)), 22 * 2048 * 1024  # N and A of docs/choosing.md
    assert full["total"] == 6 * n + 12 * a
    adapters = planner.lora_parameters(tinyllama, 16)
    assert lora["total"] == 4 * n + 12 * a + 6 * adapters
    recomputed = planner.flops_per_token(tinyllama, "lora", 1024, 1)
    assert recomputed["recompute"] == 2 * (n - 32000 * 2048) + 4 * a + 2 * adapters  # the blocks, not lm_head


@pytest.mark.parametrize("alias, active", [("mixtral-8x7b", 12.9e9), ("qwen3-30b-a3b", 3.3e9)])
def test_a_mixture_of_experts_computes_through_its_active_experts(alias, active):
    shape = planner.load_shape(alias)
    blocks, head = active_matmul_parameters(shape)
    assert blocks + head + shape.vocab * shape.hidden == pytest.approx(active, rel=0.02)  # published, embedding in
    assert blocks + head < shape.parameters / 3


# ---------------------------------------------------------------------------- bytes moved

def test_fsdp_gathers_the_model_twice_per_micro_batch(codellama):
    """CodeLlama-34B LoRA under fsdp.yaml on 4 GPUs: each GPU receives 3/4 of the bf16 base twice per
    micro-batch (~101 GB), whatever the micro-batch; over a slow enough link that is the whole step."""
    slow = planner.Machine(REFERENCE.gpu, bandwidth_gb_s=1e-3)
    step = planner.step_time(codellama, "lora", "fsdp_full_shard", 4, slow, 1, 1, 1024)
    moved = step["communication"] * 1e-3 * 1e9
    assert moved == pytest.approx(0.75 * 2 * 2 * codellama.parameters, rel=0.02)
    assert 99e9 < moved < 104e9
    bigger = planner.step_time(codellama, "lora", "fsdp_full_shard", 4, slow, 4, 1, 1024)
    assert bigger["communication"] == pytest.approx(step["communication"], rel=0.01)


def test_a_pair_is_two_rows_and_a_lora_reference_one_more_forward(tinyllama, codellama):
    """The preference recipes run a micro-batch of B pairs as one forward and backward of 2B rows: the memory
    of 2B rows; the time of 2B rows, plus under LoRA the reference's forward (the base, adapters off) and,
    fully sharded, its gathers; dpo_full.py's reference is one pass before training instead."""
    assert (planner.per_gpu_bytes(tinyllama, "lora", "fsdp_full_shard", 4, 4, 1024, pairs=True)
            == planner.per_gpu_bytes(tinyllama, "lora", "fsdp_full_shard", 4, 8, 1024))
    for method in ("lora", "full"):
        pairs = planner.step_time(tinyllama, method, "ddp", 4, REFERENCE, 4, 2, 1024, pairs=True)
        rows = planner.step_time(tinyllama, method, "ddp", 4, REFERENCE, 8, 2, 1024)
        flops = planner.flops_per_token(tinyllama, method, 1024)
        reference = flops["base_forward"] if method == "lora" else 0
        assert pairs["compute"] == pytest.approx(rows["compute"] * (flops["total"] + reference) / flops["total"])
        assert (pairs["global_batch"], rows["global_batch"]) == (32, 64)  # pairs and rows: the same tokens
    lora = planner.flops_per_token(tinyllama, "lora", 1024)
    assert lora["base_forward"] < lora["forward"] and flops["base_forward"] == flops["forward"]  # adapters: none in full
    slow = planner.Machine(REFERENCE.gpu, bandwidth_gb_s=1e-3)  # communication is the whole step
    sft = planner.step_time(codellama, "lora", "fsdp_full_shard", 4, slow, 1, 1, 1024)
    dpo = planner.step_time(codellama, "lora", "fsdp_full_shard", 4, slow, 1, 1, 1024, pairs=True)
    assert dpo["communication"] == pytest.approx(1.5 * sft["communication"], rel=0.02)  # three gathers, not two
    with pytest.raises(ValueError, match="pipeline"):
        planner.step_time(tinyllama, "lora", "pipeline", 4, REFERENCE, 4, 4, 1024, pairs=True)
    one_pass = planner.reference_pass_time(tinyllama, "fsdp_full_shard", 4, REFERENCE, 1000, 1024, "bf16")
    forward = planner.flops_per_token(tinyllama, "full", 1024)["base_forward"]
    assert one_pass == pytest.approx(2 * 1000 * 1024 * forward / 4 / (REFERENCE.peak_flops("bf16") * REFERENCE.mfu))


def test_ddp_hides_lora_gradients_behind_the_backward(tinyllama):
    step = planner.step_time(tinyllama, "lora", "ddp", 4, REFERENCE, 8, 4, 1024)
    assert step["communication"] == 0 and step["step"] == pytest.approx(step["compute"], rel=0.01)
    trickle = planner.Machine(REFERENCE.gpu, bandwidth_gb_s=0.01)
    slow = planner.step_time(tinyllama, "lora", "ddp", 4, trickle, 8, 4, 1024)
    adapters = planner.lora_parameters(tinyllama, 16)
    backward_hidden = slow["communication"] - all_reduce(adapters * 4, 4) / 0.01e9
    assert -1.0 < backward_hidden < 0  # only the last micro-batch's backward hides it


@pytest.mark.parametrize("strategy", ["fsdp_full_shard", "zero3", "fsdp_grad_op", "zero2", "tp", "model_parallel"])
def test_a_faster_link_never_makes_a_step_slower(tinyllama, strategy):
    times = [planner.step_time(tinyllama, "full", strategy, 4, planner.Machine(REFERENCE.gpu, bandwidth), 2, 2,
                               2048, 1)["step"] for bandwidth in (2, 8, 25, 100, 400)]
    assert times == sorted(times, reverse=True) and times[0] > times[-1]


def test_tensor_parallel_pays_for_its_activations_not_its_weights(codellama):
    args = dict(batch_size=2, grad_accum=1, seq_len=2048)
    tp = planner.step_time(codellama, "full", "tp", 4, REFERENCE, **args)
    twice = planner.step_time(codellama, "full", "tp", 4, REFERENCE, **dict(args, batch_size=4))
    assert twice["communication"] == pytest.approx(2 * tp["communication"], rel=1e-6)  # linear in the tokens
    assert tp["compute"] == pytest.approx(
        planner.step_time(codellama, "full", "ddp", 4, REFERENCE, **args)["compute"] / 4)
    per_token = gather(codellama.vocab * 2, 4) + codellama.layers * 4 * all_reduce(codellama.hidden * 2, 4)
    assert tp["communication"] * REFERENCE.bandwidth_gb_s * 1e9 == pytest.approx(per_token * 2 * 2048, rel=1e-6)


def test_model_parallel_keeps_one_gpu_of_n_busy(tinyllama):
    mp = planner.step_time(tinyllama, "lora", "model_parallel", 4, REFERENCE, 16, 2, 1024)
    one = planner.step_time(tinyllama, "lora", "ddp", 1, REFERENCE, 16, 2, 1024)
    assert mp["idle_share"] == 0.75 and mp["global_batch"] == 32 == one["global_batch"]
    assert mp["compute"] == pytest.approx(one["compute"]) and mp["step"] > one["step"]  # + the copies between GPUs


def test_a_pipeline_stage_holds_its_micro_batches_in_flight(tinyllama):
    """1F1B: stage k of N keeps up to min(N - k, micro-batches) micro-batches' activations; the first stage,
    with the embedding, is the busiest here. A pipeline's step idles (N - 1) / (m + N - 1)."""
    for accum, in_flight in ((8, 4), (2, 2)):
        usage = planner.per_gpu_bytes(tinyllama, "lora", "pipeline", 4, 2, 1024, grad_accum=accum)
        first = planner.model_parallel_stages(tinyllama, 4)[0]
        assert usage["activations"] == planner.activation_bytes(tinyllama, "lora", "pipeline", 2 * in_flight, 1024,
                                                                stage=first)
    pipe = planner.step_time(tinyllama, "lora", "pipeline", 4, REFERENCE, 2, 8, 1024)
    mp = planner.step_time(tinyllama, "lora", "model_parallel", 4, REFERENCE, 2, 8, 1024)
    assert pipe["idle_share"] == 3 / 11 and mp["idle_share"] == 0.75
    assert mp["step"] / pipe["step"] == pytest.approx(4 * 8 / 11, rel=0.1)  # p m / (m + p - 1), less the sends
    assert "pipeline" not in planner.possible_strategies("lora", 1)
    # 22 layers: 32 GPUs run 16 stages x 2 replicas; 23 GPUs (a prime above the layers) run no pipeline
    assert planner.impossible("lora", "pipeline", 23, tinyllama) and not planner.impossible("lora", "pipeline", 32,
                                                                                             tinyllama)
    assert (16, 1) in planner.pipeline_layouts(32, 22) and (16, 2) not in planner.pipeline_layouts(32, 22)


def test_interleaved_and_replicated_pipelines(tinyllama):
    """Interleaved over v parts: the bubble (p - 1) / (v m + p - 1), stage k holding up to min(v m, (v - 1) p
    + 2 (p - 1 - k) + 1) parts of 1/v of its layers (torch's warm-up plus one). Replicated: each replica
    its own micro-batches (the global batch times the replicas), each stage's gradients summed across them."""
    first = planner.model_parallel_stages(tinyllama, 2)[0]
    for accum in (2, 8):
        # with adapter dropout the first stage, which holds the most micro-batches, is the busiest
        usage = planner.per_gpu_bytes(tinyllama, "lora", "pipeline", 4, 2, 1024, grad_accum=accum,
                                      pipeline_stages=2, pipeline_chunks=2, lora_dropout=0.05)
        parts = min(2 * accum, (2 - 1) * 2 + 2 * (2 - 1 - 0) + 1)
        assert usage["activations"] == planner.activation_bytes(tinyllama, "lora", "pipeline", 2 * parts / 2, 1024,
                                                                stage=first, lora_dropout=0.05)
    one = planner.step_time(tinyllama, "lora", "pipeline", 2, REFERENCE, 2, 8, 1024)
    interleaved = planner.step_time(tinyllama, "lora", "pipeline", 2, REFERENCE, 2, 8, 1024, pipeline_chunks=2)
    assert one["idle_share"] == 1 / 9 and interleaved["idle_share"] == 1 / 17
    assert interleaved["compute"] == one["compute"] and interleaved["communication"] > one["communication"]
    replicated = planner.step_time(tinyllama, "lora", "pipeline", 4, REFERENCE, 2, 8, 1024, pipeline_stages=2)
    assert replicated["global_batch"] == 2 * one["global_batch"] and replicated["step"] > one["step"]
    assert replicated["communication"] > one["communication"]  # the replicas' gradient sum
    with pytest.raises(ValueError, match="a pipeline of 3 stages x 1 part"):
        planner.per_gpu_bytes(tinyllama, "lora", "pipeline", 4, 2, 1024, pipeline_stages=3)


def test_the_interleaved_warm_up_is_torchs():
    """The parts in flight the planner counts are torch's interleaved 1F1B warm-up, plus the one forward
    before the first backward."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    warmup = getattr(schedules, "_get_warmup_ops", None)
    if warmup is None:
        pytest.skip("torch names its warm-up otherwise")
    for stages, chunks, micro in ((2, 2, 4), (4, 2, 8), (4, 3, 16), (8, 2, 8)):
        for rank in range(stages):
            ops = warmup(rank, chunks, stages, stages, micro, multiply_factor=2)
            assert min(ops + 1, chunks * micro) == min(chunks * micro,
                                                       (chunks - 1) * stages + 2 * (stages - 1 - rank) + 1)


# ---------------------------------------------------------------------------- the reference measurements

def test_tinyllama_model_parallel_over_ddp_is_the_measured_ratio(tinyllama):
    """3 min 53 s / 59 s = 3.95, with the reference's flags (batch 16, accumulation 2, 1024 tokens)."""
    ratio = epoch(tinyllama, "model_parallel", 16, 2) / epoch(tinyllama, "ddp", 16, 2)
    assert ratio == pytest.approx(233 / 59, rel=0.3)


@pytest.mark.parametrize("sharded", ["fsdp_full_shard", "zero3"])
def test_codellama_model_parallel_over_fsdp_is_the_measured_ratio(codellama, sharded):
    """47 / 30 min = 1.57 with batch 4, accumulation 4: on 48 GB, 4 x 1024 tokens of CodeLlama-34B fit
    under FSDP only with gradient checkpointing, so the reference must have used it."""
    assert planner.max_micro_batch(codellama, "lora", sharded, 4, 48, 1024) < 4
    assert planner.max_micro_batch(codellama, "lora", sharded, 4, 48, 1024, 1) >= 4
    ratio = epoch(codellama, "model_parallel", 4, 4, 1) / epoch(codellama, sharded, 4, 4, 1)
    assert ratio == pytest.approx(47 / 30, rel=0.3)


def test_the_reference_workloads_get_the_configs_that_won(tinyllama, codellama):
    """Among the configs the reference measured, the one that won there; over all of them, TinyLlama stays
    on DDP, while CodeLlama-34B goes to pipeline parallel, which the reference did not measure: over PCIe
    without peer-to-peer its bubble costs less than FSDP's gathers."""
    for checkpointing in (0, 1):
        tiny = planner.plan(tinyllama, "lora", 4, 48, 16, 1024, checkpointing, grad_accum=2, machine=REFERENCE)
        assert tiny["recommendation"]["fastest"]["strategy"] == "ddp"
        if not checkpointing:  # 16 x 1,024 fits each 48 GB GPU under DDP, as the reference ran it
            ddp = tiny["strategies"][0]
            assert ddp["strategy"] == "ddp" and ddp["fits"] and ddp["run"]["micro_batch"] == 16
        code = planner.plan(codellama, "lora", 4, 48, 4, 1024, checkpointing, grad_accum=4, machine=REFERENCE)
        runs = {e["strategy"]: e["run"] for e in code["strategies"] if e["run"]}
        measured = [(s, runs[s]) for s in ("fsdp_full_shard", "zero3", "model_parallel")]
        strategy, run = planner.fastest_of(measured)
        assert strategy in ("fsdp_full_shard", "zero3") and run["gradient_checkpointing"] == 1
        assert run["micro_batch"] * run["grad_accum"] == 16  # the asked global batch, kept
        fastest = code["recommendation"]["fastest"]
        assert fastest["strategy"] == "pipeline" and fastest["micro_batch"] * fastest["grad_accum"] == 16
        assert fastest["seconds_per_epoch"] < run["time"]["step"] * 1024 / run["global_batch"]


# ---------------------------------------------------------------------------- ranking

def test_a_tight_config_is_not_recommended_while_another_has_margin(tinyllama, codellama):
    """With checkpointing, fsdp_hybrid fits CodeLlama-34B's 4 x 1024 at 41.3 of 43.2 GiB (it was recommended
    so); it runs a smaller micro-batch instead, and fsdp.yaml is recommended. Over a grid of workloads,
    the recommendation has margin whenever any run has."""
    plan = planner.plan(codellama, "lora", 4, 48, 4, 1024, 1, machine=REFERENCE)
    hybrid = next(e for e in plan["strategies"] if e["strategy"] == "fsdp_hybrid")
    assert hybrid["fits"] and hybrid["per_gpu_bytes"]["total"] > planner.MARGIN * planner.usable_bytes(48)
    assert hybrid["run"]["micro_batch"] < 4 and not hybrid["run"]["tight"]
    assert plan["recommendation"]["fastest"]["strategy"] != "fsdp_hybrid"
    for shape in (tinyllama, codellama):
        for method in ("lora", "full"):
            for memory in (24, 48, 80):
                plan = planner.plan(shape, method, 4, memory, 8, 2048)
                runs = [e["run"] for e in plan["strategies"] if e["run"]]
                fastest = plan["recommendation"]["fastest"]
                if any(not run["tight"] for run in runs):
                    assert not fastest["tight"], (shape.name, method, memory)
                for run in runs:
                    assert run["total_bytes"] <= planner.usable_bytes(memory)


def test_close_estimates_go_to_the_simpler_config(tinyllama):
    """On 4 GPUs TinyLlama LoRA's adapter gradients cost DDP and ZeRO-1 about the same: DDP, the simpler. One
    GPU is not offered ZeRO-1 at all (it would shard over one process: tests/test_plan_answer.py)."""
    plan = planner.plan(tinyllama, "lora", 4, 80, 8, 1024)
    assert plan["recommendation"]["fastest"]["strategy"] == "ddp"
    runs = {e["strategy"]: e["run"] for e in plan["strategies"]}
    assert runs["zero1"]["time"]["tokens_per_s"] >= 0.97 * runs["ddp"]["time"]["tokens_per_s"]
    assert runs["zero1"]["time"]["tokens_per_s"] > runs["ddp"]["time"]["tokens_per_s"]  # ahead, within the tie
    one = planner.plan(tinyllama, "lora", 1, 80, 8, 1024)
    assert [e["strategy"] for e in one["strategies"]] == list(planner.ONE_GPU)
    assert one["recommendation"]["fastest"]["strategy"] == "ddp"


def test_collectives_beyond_one_machine_cross_the_network(codellama):
    """16 H100s are two machines of 8: full shard's gathers span both and run at the network's 10 GB/s;
    hybrid's shard groups stay within a machine; model parallel, one process, is not offered."""
    h100 = planner.Machine.of("h100")
    assert h100.bandwidth_for(8) == 360 and h100.bandwidth_for(16) == 10
    per_token = {n: planner.step_time(codellama, "full", "fsdp_full_shard", n, h100, 4, 1, 2048, 1)["tokens_per_s"] / n
                 for n in (8, 16)}
    assert per_token[16] < per_token[8] / 3
    hybrid = planner.step_time(codellama, "full", "fsdp_hybrid", 16, h100, 4, 1, 2048, 1)
    assert hybrid["tokens_per_s"] > 1.5 * per_token[16] * 16
    plan = planner.plan(codellama, "lora", 16, 80, 4, 2048, machine=h100)
    assert "model_parallel" not in [e["strategy"] for e in plan["strategies"]]
    one_machine = planner.Machine.of("h100", gpus_per_machine=16)
    assert planner.step_time(codellama, "full", "fsdp_full_shard", 16, one_machine, 4, 1, 2048, 1)["tokens_per_s"] \
        > 3 * per_token[16] * 16


def test_machines_by_name_and_their_links():
    assert planner.Machine.of("h100").bandwidth_gb_s > planner.Machine.of("a100").bandwidth_gb_s > \
        planner.Machine.of("a6000").bandwidth_gb_s > REFERENCE.bandwidth_gb_s
    assert planner.Machine.of("RTX6000_Ada") == REFERENCE
    assert planner.Machine.of("h100", "network").bandwidth_gb_s < planner.Machine.of("h100", "pcie").bandwidth_gb_s
    for card in planner.GPUS.values():
        assert card.bf16_tflops > card.fp32_tflops > 0 and card.memory_gb >= 24
    with pytest.raises(ValueError, match="no NVLink"):
        planner.Machine.of("4090", "nvlink")
    with pytest.raises(ValueError, match="unknown GPU 'v100'.*h100"):
        planner.Machine.of("v100")


# ---------------------------------------------------------------------------- command line

def run_plan(*args):
    return subprocess.run([sys.executable, str(PLAN), *args], capture_output=True, text=True, timeout=60)


def test_cli_prints_the_time_table_and_launch_first():
    done = run_plan("--model", "tinyllama-1.1b", "--gpu", "rtx6000-ada", "--batch-size", "16", "--grad-accum", "2",
                    "--seq-len", "1024")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    intro = next(i for i, line in enumerate(lines) if line.startswith("Time per optimizer step"))
    assert "an estimate: 40% of RTX 6000 Ada's 364.2 TFLOP/s" in lines[intro] and "8 GB/s" in lines[intro]
    assert lines[intro + 2].split()[0] == "ddp" and "25% of GPU time busy" in done.stdout
    advice = lines[lines.index("", intro) + 1:]
    model = planner.HUB_IDS["tinyllama-1.1b"]
    assert advice[0] == ("Launch: accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes 4 "
                         f"recipes/lora.py --model {model} --dataset YOUR_DATA "
                         "--batch-size 16 --max-length 1024 --grad-accum 2")
    assert advice[1] == "    (replace YOUR_DATA with your data file, folder or hub id)"
    assert advice[2].startswith("Fastest that fits on 4 GPUs: ddp (accelerate_configs/ddp.yaml), global batch "
                                f"{8 * 4 * 4} rows a step, an estimated")


def test_cli_launch_comes_first_when_only_levers_make_it_fit():
    """Llama-3.1-70B QLoRA on 2 x 80 GB fits nothing at the asked micro-batch: the launch line still leads."""
    done = run_plan("--model", "llama-3.1-70b", "--method", "qlora", "--gpus", "2", "--gpu", "h100",
                    "--batch-size", "8", "--seq-len", "2048")
    assert done.returncode == 0, done.stderr
    advice = done.stdout.split("\n\n")[-1].splitlines()
    assert advice[0].startswith("Launch: accelerate launch") and not any(a.startswith("Launch") for a in advice[1:])
    assert all(not line.startswith("    or:") for line in advice[:1])


def test_cli_time_flags_change_the_estimate_and_bad_ones_are_one_line():
    def fsdp_epoch(*extra):
        done = run_plan("--json", "--model", "codellama-34b", "--gpu", "rtx6000-ada", "--batch-size", "4",
                        "--seq-len", "1024", "--gradient-checkpointing", *extra)
        assert done.returncode == 0, done.stderr
        entry = next(e for e in json.loads(done.stdout)["strategies"] if e["strategy"] == "fsdp_full_shard")
        return entry["run"]["seconds_per_epoch"]

    assert fsdp_epoch("--bandwidth", "50") < fsdp_epoch() < fsdp_epoch("--bandwidth", "2")
    assert fsdp_epoch("--mfu", "0.2") > fsdp_epoch("--mfu", "0.2", "--bandwidth", "100")
    bad = run_plan("--gpu", "v100")
    assert bad.returncode == 2 and "unknown GPU 'v100'" in bad.stderr.strip().splitlines()[-1]
    assert run_plan("--mfu", "1.5").returncode == 2


@pytest.mark.parametrize("name, extra", [
    ("tinyllama-1.1b-lora", ["--model", "tinyllama-1.1b", "--batch-size", "16", "--grad-accum", "2"]),
    ("codellama-34b-lora-checkpointing", ["--model", "codellama-34b", "--batch-size", "4", "--grad-accum", "4",
                                          "--gradient-checkpointing"]),
    ("codellama-34b-lora", ["--model", "codellama-34b", "--batch-size", "4", "--grad-accum", "4"]),
])
def test_the_committed_reference_plans_are_what_the_planner_prints(name, extra):
    """README's time table quotes these files: they stay what plan.py prints (rewrite them with the
    commands in their README when the planner changes)."""
    done = run_plan("--method", "lora", "--gpus", "4", "--gpu", "rtx6000-ada", "--seq-len", "1024", *extra)
    assert done.returncode == 0, done.stderr
    committed = REPO / "results" / "2026-11-26_cpu_plan-time-reference" / f"{name}.txt"
    assert done.stdout == committed.read_text()


def test_the_plans_quoted_in_the_docs_are_what_the_planner_prints():
    import re
    import shlex

    page = (REPO / "docs" / "choosing.md").read_text()
    blocks = re.findall(r"```\n\$ python scripts/plan\.py ([^\n]*)\n(.*?)```", page, re.S)
    assert len(blocks) >= 2
    for arguments, quoted in blocks:
        done = run_plan(*shlex.split(arguments))
        assert done.returncode == 0, done.stderr
        assert done.stdout == quoted, arguments


if __name__ == "__main__":  # torch_counts' fresh process
    print(json.dumps([[method, every, counted_flops(method, every)] for method, every in CASES]))
