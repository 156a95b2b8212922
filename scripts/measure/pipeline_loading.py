"""Peak memory of loading one pipeline stage: the whole model loaded then cut (every other strategy's
load) against the stage's weights alone read from the files (`common.model.stage_loading`), each in a fresh
process, for every stage.

    python scripts/measure/pipeline_loading.py --build /tmp/llama-0.8b --layers 16 --hidden 2048 --stages 4
    python scripts/measure/pipeline_loading.py --model PATH --stages 4 [--dtype float32]

--build writes a random Llama of that shape (bfloat16, sharded safetensors) first; --model reads any
local model folder. The figures are each process's peak resident memory (ru_maxrss),
after reading every weight it kept once (a file mapped in memory is read lazily). Run it from a small
process: a process started by a large one inherits its peak.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

MEASURE = """
import json, resource, sys, torch
sys.path.insert(0, {recipes!r})
from transformers import AutoConfig, AutoModelForCausalLM
from common.model.pipeline_layout import PipelineLayout, keep_stage
from common.model.model_config import empty_model
from common.model.stage_loading import load_stage
config = AutoConfig.from_pretrained({model!r})
layout = PipelineLayout({stages}, 1, {stage}, config.num_hidden_layers)
if {whole}:
    model = AutoModelForCausalLM.from_pretrained({model!r}, dtype=torch.{dtype}, use_safetensors=True)
    keep_stage(model, layout)
else:
    model, why = load_stage({model!r}, empty_model(config), layout, torch.{dtype})
    assert why is None, why
held = sum(p.numel() * p.element_size() for p in model.parameters())
with torch.no_grad():  # read every weight kept, as training does (a file mapped in memory is read lazily)
    touched = sum(float(p.float().sum()) for p in model.parameters())
print(json.dumps({{"peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "held": held,
                  "layers": [layout.layer_range(layout.stage).start, layout.layer_range(layout.stage).stop - 1]}}))
"""


def build(folder: Path, layers: int, hidden: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 256,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="500MB")
    print(f"built {folder}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters, bfloat16")


def built_with_tokenizer(folder: Path) -> str:
    """The random Llama of about 0.78B parameters (written once) with the bundled tokenizer (301 tokens of its
    32,000) beside it: the model the host-memory and resume measurements use."""
    import shutil

    if not (folder / "config.json").exists():
        build(folder, layers=27, hidden=1536)
    for file in (REPO / "data" / "tokenizer").iterdir():
        shutil.copy(file, folder / file.name)
    return str(folder)


def short_rows(folder: Path) -> Path:
    """64 one-word instruction rows: a step of the measured launches costs as little data as it can."""
    dataset = folder / "rows.jsonl"
    dataset.write_text("".join(json.dumps({"instruction": f"Say {i}", "response": str(i)}) + "\n" for i in range(64)))
    return dataset


def measure(model: str, stages: int, stage: int, whole: bool, dtype: str) -> dict:
    code = MEASURE.format(recipes=str(REPO / "recipes"), model=model, stages=stages, stage=stage, whole=whole,
                          dtype=dtype)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local model folder (safetensors)")
    parser.add_argument("--build", help="write a random Llama here first, and measure it")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="the dtype the weights load in (float32: full fine-tuning's)")
    args = parser.parse_args()
    if args.build:
        if not (Path(args.build) / "config.json").exists():
            build(Path(args.build), args.layers, args.hidden)
        args.model = args.build
    gib = 2**30
    print(f"{args.model} (bfloat16 files), {args.stages} stages, loaded in {args.dtype}; peak resident memory "
          "of one process (GiB), every weight kept read once")
    print("stage  layers   weights held   whole model loaded, then cut   its stage alone")
    for stage in range(args.stages):
        whole = measure(args.model, args.stages, stage, True, args.dtype)
        alone = measure(args.model, args.stages, stage, False, args.dtype)
        assert whole["held"] == alone["held"]
        first, last = alone["layers"]
        print(f"{stage:>5}  {first:>2}-{last:<3}  {alone['held'] / gib:>12.2f}   {whole['peak'] / gib:>28.2f}   "
              f"{alone['peak'] / gib:>15.2f}")


if __name__ == "__main__":
    main()
