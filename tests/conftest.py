"""Launch helpers: every test runs the real `accelerate launch` on CPU, as a user would."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

# Nothing is downloaded at test time: every model and dataset is local.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "accelerate_configs"
TINY_MODEL = REPO / "models" / "tiny-llama"

# The suite keeps to ~15 minutes on two cores; RECIPES_LONG_TESTS=1 adds the launches it leaves out
# (every recipe x config, every user config file, every bad-input case, --compile): about an hour more.
LONG_TESTS = os.environ.get("RECIPES_LONG_TESTS") == "1"
long_test = pytest.mark.skipif(not LONG_TESTS, reason="a long test: set RECIPES_LONG_TESTS=1 to run it")


@dataclass
class Launch:
    returncode: int
    output: str
    output_dir: Path
    seconds: float = 0.0  # wall time of the whole launch, start-up included

    def run_json(self) -> dict:
        return json.loads((self.output_dir / "run.json").read_text())

    def metrics(self, kind: str = "train") -> list[dict]:
        lines = (self.output_dir / "metrics.jsonl").read_text().splitlines()
        return [record for record in map(json.loads, lines) if record["type"] == kind]

    def losses(self) -> list[float]:
        return [record["loss"] for record in self.metrics()]


def launch_command(recipe: str, output_dir: Path, *recipe_args: str, config: str | None = None,
                   processes: int = 2, launcher_args: tuple = (), mixed_precision: str | None = "no") -> list[str]:
    """`accelerate launch --config_file accelerate_configs/<config>.yaml --num_processes N recipes/<recipe>.py ...`

    `config` is a name in accelerate_configs/, a path to a .yaml file, or a DeepSpeed .json (launched
    with `--use_deepspeed --deepspeed_config_file`); None runs one CPU process. `mixed_precision`
    None keeps the config file's own.
    """
    command = [sys.executable, "-m", "accelerate.commands.launch"]
    if config is None:
        command += ["--cpu", "--num_processes", "1", "--num_machines", "1", "--dynamo_backend", "no"]
    elif config.endswith(".json"):
        command += ["--use_deepspeed", "--deepspeed_config_file", config, "--num_processes", str(processes)]
    else:
        config_file = config if config.endswith((".yaml", ".yml")) else str(CONFIGS / f"{config}.yaml")
        command += ["--config_file", config_file, "--num_processes", str(processes)]
    command += [*launcher_args, *(["--mixed_precision", mixed_precision] if mixed_precision else []),
                str(REPO / "recipes" / f"{recipe}.py"), "--output-dir", str(output_dir)]
    # The evaluation before step 1 (on by default) has its own tests (test_eval_on_start.py); the other launches
    # leave it out, a few seconds each. A test that gives --eval-on-start has it (the last flag given wins).
    return command + ["--no-eval-on-start", *recipe_args]


def free_port() -> int:
    """A TCP port nobody listens on now, for a launch's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_env(env: dict | None = None) -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}


def launch(recipe: str, output_dir: Path, *recipe_args: str, config: str | None = None,
           processes: int = 2, timeout: int = 600, env: dict | None = None, mixed_precision: str | None = "no",
           launcher_args: tuple = ()) -> Launch:
    """Run a launch (see `launch_command`) to its end."""
    command = launch_command(recipe, output_dir, *recipe_args, config=config, processes=processes,
                             launcher_args=launcher_args, mixed_precision=mixed_precision)
    started = time.monotonic()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=launch_env(env))
    return Launch(done.returncode, done.stdout + done.stderr, Path(output_dir), time.monotonic() - started)


def start(recipe: str, output_dir: Path, *recipe_args: str, config: str | None = None, processes: int = 2,
          launcher_args: tuple = (), env: dict | None = None, terminal: bool = False) -> subprocess.Popen:
    """Start a launch in the background (its output merged into `stdout`). With `terminal`, the launch
    gets a process group of its own, as a shell's foreground job has: Ctrl-C is `os.killpg(pid, SIGINT)`."""
    command = launch_command(recipe, output_dir, *recipe_args, config=config, processes=processes,
                             launcher_args=launcher_args)
    return subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=launch_env(env), start_new_session=terminal)


@pytest.fixture(scope="session", autouse=True)
def tiny_model():
    """The bundled tiny Llama, built once (the recipes would build it on first use too)."""
    sys.path.insert(0, str(REPO / "recipes"))
    from common.model.model_config import default_model_needs_building

    if default_model_needs_building():
        subprocess.run([sys.executable, str(REPO / "scripts" / "build_tiny_model.py")], check=True, cwd=REPO)
    return TINY_MODEL


@pytest.fixture(scope="session")
def tinyllama():
    """The planner's shape of TinyLlama-1.1B (from data/model_configs/)."""
    sys.path.insert(0, str(REPO / "recipes"))
    import planner

    return planner.load_shape("tinyllama-1.1b")


@pytest.fixture(scope="session")
def codellama():
    """The planner's shape of CodeLlama-34B (from data/model_configs/)."""
    sys.path.insert(0, str(REPO / "recipes"))
    import planner

    return planner.load_shape("codellama-34b")


def assert_no_traceback_of_ours(output: str) -> None:
    """A refusal is one line: no frame of the recipes (the launcher may still report the exit code)."""
    assert "recipes/" not in "\n".join(line for line in output.splitlines() if line.strip().startswith("File ")), output[-3000:]


def assert_the_refusal_ends_the_output(output: str, refusal: str) -> None:
    """The launcher's own report of the failed ranks (~35 lines) comes last: its final words must be
    the refusal's line, so that it is still on screen when the run has stopped."""
    last = [line for line in output.strip().splitlines() if line.strip("=- ")][-1]
    assert last.strip() == f"traceback : {refusal}", output[-3000:]


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """`trained(recipe, config)`: the matrix launch of strategies.py, run once per session."""
    from strategies import CPU_STRATEGIES, MERGED_IN, matrix_args

    runs = {}

    def run(recipe: str, config: str) -> Launch:
        if (recipe, config) not in runs:
            output_dir = tmp_path_factory.mktemp(f"{recipe}-{config}") / "out"
            merge = ["--merge"] if recipe != "full" and config == MERGED_IN else []
            runs[recipe, config] = launch(recipe, output_dir, *matrix_args(recipe, config), *merge,
                                          config=config, processes=CPU_STRATEGIES[config][1])
        return runs[recipe, config]

    return run


# ---------------------------------------------------------------- vision-language models (test_images, test_vision_training)

VISION = REPO / "data" / "vision"
LLAVA_1_5 = "llava-1.5-layout"  # the tiny LLaVA with LLaVA-1.5's vision_feature_layer -2: its last block unread


@pytest.fixture(scope="session")
def vlm(tmp_path_factory):
    """family -> the folder of its tiny random model (scripts/build_tiny_model.py --family), built once a session."""
    import shutil

    sys.path.insert(0, str(REPO / "scripts"))
    from build_tiny_model import build_tiny_vlm

    built = {}

    def build(family: str) -> Path:
        if family not in built and family == LLAVA_1_5:  # LLaVA reading its tower's last-but-one hidden state
            folder = tmp_path_factory.mktemp(family) / "model"
            shutil.copytree(build("llava"), folder)
            config = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps({**config, "vision_feature_layer": -2}))
            built[family] = folder
        if family not in built:
            built[family] = build_tiny_vlm(family, tmp_path_factory.mktemp(family) / "model")
        return built[family]

    return build


def vision_rows(path: Path, count: int, start: int = 0) -> Path:
    """`count` rows of the bundled vision task, their images by absolute path, written to `path`."""
    lines = (VISION / "train.jsonl").read_text().splitlines()[start:start + count]
    rows = [json.loads(line) for line in lines]
    for row in rows:
        row["images"] = [str((VISION / name).resolve()) for name in row["images"]]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def same_curve(mine: list[dict], theirs: list[dict], relative_norm: bool = False) -> None:
    """The same loss and gradient norm at every step (1e-5; the norm relative to its size with `relative_norm`:
    every weight's gradient, summed over shards in another order), and a loss that fell: both trained."""
    assert len(mine) == len(theirs) == 3
    for ours, other in zip(mine, theirs):
        assert ours["loss"] == pytest.approx(other["loss"], abs=1e-5), (ours, other)
        norm = pytest.approx(other["grad_norm"], **({"rel": 1e-5} if relative_norm else {"abs": 1e-5}))
        assert ours["grad_norm"] == norm, (ours, other)
    assert mine[-1]["loss"] < mine[0]["loss"]


def merged_beside_adapter(model: Path, output_dir: Path, rows: Path):
    """(merged/ as AutoModelForImageTextToText, adapter/ on `model` through PeftModel, the first row of `rows` as the
    merged folder's AutoProcessor makes it): a vision-language run's exports, to compare on an image row."""
    import torch
    from peft import PeftModel
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    merged = AutoModelForImageTextToText.from_pretrained(output_dir / "merged", dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(output_dir / "merged")
    base = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, output_dir / "adapter").eval()
    row = json.loads(rows.read_text().splitlines()[0])
    text = processor.apply_chat_template(row["messages"], tokenize=False)
    with Image.open(row["images"][0]) as image:
        inputs = processor(text=[text], images=[image.convert("RGB")], add_special_tokens=False, return_tensors="pt")
    return merged, adapted, inputs
