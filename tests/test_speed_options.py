"""The speed options change how fast a step runs, never what it computes; and the script that
measures them reports what it ran."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, TINY_MODEL, launch, launch_env, long_test
from strategies import matrix_args

sys.path.insert(0, str(REPO / "recipes"))
sys.path.insert(0, str(REPO / "scripts" / "measure"))
import planner  # noqa: E402
from common.launching.args import recipe_parser  # noqa: E402


def max_relative_difference(losses, reference) -> float:
    assert len(losses) == len(reference) > 0
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))


# The matrix's DDP LoRA launch (no dropout) is the reference; each option runs the same steps.
@pytest.mark.parametrize("flags, tolerance", [
    # the same batches, collated elsewhere: also proves that a second run of one seed repeats the first exactly
    pytest.param(["--dataloader-workers", "2"], 0.0, marks=long_test),  # ~20 s; resume tests show repeats too
    # recomputing repeats the same forward; eager attention is the same softmax in another kernel
    (["--gradient-checkpointing", "2", "--attention", "eager"], 1e-5),
    pytest.param(["--compile"], 1e-5, marks=long_test),  # inductor's fused kernels round differently (~90 s on CPU)
], ids=lambda value: " ".join(value) if isinstance(value, list) else None)
def test_a_speed_option_keeps_the_loss_curve(trained, tmp_path, flags, tolerance):
    reference = trained("lora", "ddp")
    assert reference.returncode == 0, reference.output[-3000:]
    run = launch("lora", tmp_path / "out", *matrix_args("lora", "ddp"), *flags, config="ddp")
    assert run.returncode == 0, run.output[-3000:]
    arguments = run.run_json()["arguments"]
    for flag in (flag for flag in flags if flag.startswith("--")):
        assert arguments[flag.lstrip("-").replace("-", "_")] not in (None, False, 0, "sdpa"), flag
    assert max_relative_difference(run.losses(), reference.losses()) <= tolerance


def test_compile_layers_compiles_every_decoder_layer_in_place():
    from transformers import AutoModelForCausalLM

    from common.model.modeling import compile_layers

    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL)
    names_before = [name for name, _ in model.named_parameters()]
    compile_layers(model)
    layers = model.model.layers
    assert len(layers) == 2 and all(layer._compiled_call_impl is not None for layer in layers)
    assert model._compiled_call_impl is None  # only the repeated blocks
    assert [name for name, _ in model.named_parameters()] == names_before  # checkpoints keep their keys


def test_a_model_without_decoder_layers_is_compiled_whole_and_says_so(capsys):
    import torch

    from common.model.modeling import compile_layers

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    compile_layers(model)
    assert model._compiled_call_impl is not None
    assert capsys.readouterr().out.startswith("compile: Sequential has no transformers decoder-layer class; compiling")


def test_gradient_checkpointing_takes_every_n():
    parser = recipe_parser("recipe\n")
    assert parser.parse_args([]).gradient_checkpointing == 0
    assert parser.parse_args(["--gradient-checkpointing"]).gradient_checkpointing == 1
    assert parser.parse_args(["--gradient-checkpointing", "3", "--lr", "1"]).gradient_checkpointing == 3


def test_the_planner_puts_selective_checkpointing_between_none_and_all():
    shape = planner.load_shape(str(REPO / "data" / "model_configs" / "tinyllama-1.1b.json"))

    def activations(every):
        return planner.activation_bytes(shape, "lora", "ddp", 4, 1024, gradient_checkpointing=every)

    none, every_layer, every_second, every_fourth = activations(0), activations(1), activations(2), activations(4)
    assert none > every_fourth > every_second > every_layer
    assert activations(True) == every_layer


def test_steady_state_leaves_the_warmup_out():
    from speed_options import steady_state

    lines = [{"type": "train", "step": step, "elapsed_s": elapsed, "tokens": 100, "loss": 1.0}
             for step, elapsed in enumerate([30.0, 31.0, 32.0, 32.5, 33.0, 33.5], start=1)]
    result = steady_state(lines + [{"type": "eval", "step": 6}], warmup_steps=2)
    # Steps 4-6 took 0.5 s each: the 30 s compile and the 1 s steps are warm-up.
    assert result["step_s"] == pytest.approx(0.5)
    assert result["epoch_s"] == pytest.approx(3.0)
    assert result["tokens_per_s"] == pytest.approx(200.0)
    with pytest.raises(ValueError, match="too few"):
        steady_state(lines[:3], warmup_steps=2)


@long_test  # ~35 s: the script end to end; each option's launch above runs in every run
def test_speed_options_script_measures_and_writes_its_table(tmp_path):
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "measure" / "speed_options.py"), "--cpu", "--variants", "packing,liger",
         "--rounds", "1", "--max-steps", "8", "--warmup-steps", "2", "--output-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=600, env=launch_env(),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [document_path] = tmp_path.glob("*_speed_options/speed_options.json")
    document = json.loads(document_path.read_text())
    packing = document["variants"]["packing"]  # one launch; the defaults are the same launch without the flag
    assert packing["status"] == "ok" and packing["tokens_per_s"] > 0 and packing["final_loss"] > 0
    assert "--packing" in packing["command"] and "defaults" not in document["variants"]
    assert document["variants"]["liger"] == {"status": "skipped", "reason": "needs a CUDA GPU", "flags": ["--liger"]}
    assert [row["parameters"] for row in document["adamw"]] == ["LoRA r=16, all-linear", "full fine-tuning"]
    assert all(row["fused_ms"] > 0 and row["foreach_ms"] > 0 for row in document["adamw"])
    table = document_path.with_suffix(".md").read_text()
    assert "| packing | `--packing` |" in table and "needs a CUDA GPU" in table
    assert table.split("| packing | `--packing` |")[1].split("|")[3].strip() == "-"  # no defaults to compare with


PLANNED = 1000  # steps the run plans: enough to repay compiling where it is on by default


@pytest.mark.parametrize("recipe, kind, on_gpu, flags, planned, compiled", [
    ("lora", "ddp", True, [], PLANNED, True),  # measured: 38.7% MFU against 26.0% on one H200
    ("full", "fsdp", True, [], PLANNED, True),
    ("dpo", "single", True, [], PLANNED, True),
    ("lora", "ddp", False, [], PLANNED, False),  # a CPU: it lost there (0.68x)
    ("qlora", "ddp", True, [], PLANNED, False),  # 4-bit layers compiled: never measured
    ("lora", "deepspeed", True, [], PLANNED, False),
    ("lora", "model_parallel", True, [], PLANNED, False),
    ("lora", "ddp", True, ["--liger"], PLANNED, False),  # compile with Liger ran slower than compile alone
    ("lora", "ddp", True, ["--no-compile"], PLANNED, False),
    ("lora", "ddp", True, [], 99, False),  # compiling (~25 s on the H200) would not be repaid
    ("lora", "ddp", True, [], 32, False),  # the reference epoch: 32 steps, eager's end to end was shorter
    ("lora", "ddp", True, [], 100, True),
    ("lora", "ddp", True, ["--compile"], 32, True),  # asked: always
    ("lora", "deepspeed", False, ["--compile"], 1, True),
], ids=lambda value: " ".join(value) if isinstance(value, list) else str(value))
def test_compile_is_on_by_default_only_where_it_was_measured_to_win(recipe, kind, on_gpu, flags, planned, compiled,
                                                                    capsys, monkeypatch):
    from common.launching.args import parse_args, recipe_flags
    from common.launching.launch import Launch
    from common.launching.settle import settle_compile, settle_compile_steps

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/cache/inductor")
    launch = Launch(kind=kind, processes=2, on_gpu=on_gpu, visible_gpus=1, precision="bf16")
    run = settle_compile_steps(settle_compile(parse_args(recipe_flags(recipe), flags), recipe, launch), planned)
    assert run.compile is compiled
    assert ("compile" in run.settled_from) == (not any("compile" in flag for flag in flags))
    said = capsys.readouterr().out
    decided_by_steps = on_gpu and kind in ("ddp", "fsdp", "single") and recipe != "qlora" and not flags
    assert bool(said) == decided_by_steps  # one speed: line where the steps decided, none where a rule or flag did
    if decided_by_steps and compiled:
        assert said == (f"speed: --compile on ({planned} planned steps repay compiling each decoder layer, the first "
                        "step ~25 s slower; kernels cached in /cache/inductor for the next launch; --no-compile turns "
                        "it off)\n")
    elif decided_by_steps:
        assert said == (f"speed: --compile off ({planned} planned steps would not repay compiling: ~25 s, repaid after "
                        "~100 steps; --compile forces it)\n")


def test_compiled_kernels_are_cached_where_launches_find_them_again(monkeypatch):
    from common.model.modeling import compile_cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("TORCH_HOME", "/home/me/.cache/torch")
    assert compile_cache_dir() == "/home/me/.cache/torch/inductor"  # not torch's default under /tmp
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/scratch/inductor")
    assert compile_cache_dir() == "/scratch/inductor"  # the user's own wins


def test_compile_under_a_pipeline_or_sequence_parallel_stays_off_by_default():
    from common.launching.args import parse_args, recipe_flags
    from common.launching.launch import Launch
    from common.launching.settle import settle_compile

    for extra in ({"pipeline_stages": 2}, {"sequence_parallel": 2}):
        launch = Launch(kind="ddp", processes=2, on_gpu=True, visible_gpus=1, precision="bf16", **extra)
        assert settle_compile(parse_args(recipe_flags("lora"), []), "lora", launch).compile is False
