"""Rows per second of the recipes' data preparation (read rows -> tokens and targets), this checkout
beside another revision, on the same generated chat file and tokenizers, run alternately.

    python scripts/measure/prepare_speed.py --baseline 13b2f67 --rows 10000 --repeats 3 --out results/<dir>

Each measurement is a fresh process (its peak resident memory is reported) that imports the revision's `recipes/common` and times
`tokenize_counted` (tokens.py; data.py before the stages were split) on the file (datasets' cache off, so every run tokenises). Tokenizers: the
bundled character-level one with the recipes' default template, and the sentencepiece-style and
byte-level BPE fixtures of tests/chat_fixtures.py with Llama-3.1's template (a template both data
paths keep every row under). Rows: multi-turn chat, 1-3 turns, about half with a system prompt,
replies of a few sentences (longer than the tests' rows). Prints a table; with --out writes
results.md and results.json there.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

TOKENIZERS = {"bundled": None, "sentencepiece": "llama3_1", "byte_level": "llama3_1"}
WORDS = ("the of and to in is that for it with as was on be by this are from at or an have not which one you "
         "had were but their all there can has more when will would been them if so some what about into than "
         "its only other time could then these two may first like any over new also after most made").split()

TIMED = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
import datasets
from transformers import AutoTokenizer
try:
    from common.data import tokens as data_path  # since recipes/common/ has packages
except ImportError:
    try:
        from common import tokens as data_path  # since the data path was split into stages
    except ImportError:
        from common import data as data_path
datasets.disable_caching()
datasets.disable_progress_bars()
rows = datasets.load_dataset("json", data_files=sys.argv[2], split="train")
tokenizer = AutoTokenizer.from_pretrained(sys.argv[3])
started = time.perf_counter()
tokenized, fmt = data_path.tokenize_counted(rows, tokenizer, 1 << 16)
seconds = time.perf_counter() - started
kept = sum(1 for why in tokenized["dropped"] if not why)
tokens = sum(len(ids) for ids in tokenized["input_ids"])
import resource
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB (Linux reports KiB)
print(json.dumps({"rows": len(rows), "kept": kept, "tokens": tokens, "seconds": seconds, "peak_mib": round(peak)}))
"""


def sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(6, 18))]
    return " ".join(words).capitalize() + "."


def chat_file(path: Path, count: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with path.open("w") as out:
        for _ in range(count):
            messages = [{"role": "system", "content": sentence(rng)}] if rng.random() < 0.5 else []
            for _ in range(rng.randint(1, 3)):
                messages.append({"role": "user", "content": " ".join(sentence(rng) for _ in range(rng.randint(1, 3)))})
                messages.append({"role": "assistant",
                                 "content": " ".join(sentence(rng) for _ in range(rng.randint(2, 8)))})
            out.write(json.dumps({"messages": messages}) + "\n")
    return path


def tokenizer_folders(root: Path) -> dict[str, Path]:
    import chat_fixtures as fixtures

    sys.path.insert(0, str(REPO / "recipes"))
    from common.data.formats import DEFAULT_CHAT_TEMPLATE

    folders = {}
    for name, family in TOKENIZERS.items():
        tok = fixtures.with_template(name, family) if family else fixtures.tokenizer(name)
        if not family:
            tok.chat_template = DEFAULT_CHAT_TEMPLATE
        folders[name] = root / name
        tok.save_pretrained(folders[name])
    return folders


def checkout(revision: str, root: Path) -> Path:
    """The revision's recipes/ folder, exported with `git archive`."""
    target = root / f"rev-{revision}"
    target.mkdir()
    archive = subprocess.run(["git", "archive", revision, "recipes"], cwd=REPO, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    return target / "recipes"


def measure(recipes: Path, file: Path, tokenizer: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", TIMED, str(recipes), str(file), str(tokenizer)],
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"a measurement failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="a git revision to compare with")
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "recipes"], cwd=REPO, capture_output=True,
                                text=True).stdout.strip())
    sides = {f"{head}{'+changes' if dirty else ''} (this checkout)": REPO / "recipes"}
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        sides[f"{args.baseline} (baseline)"] = checkout(args.baseline, root)
        file = chat_file(root / "chats.jsonl", args.rows)
        folders = tokenizer_folders(root)
        for name, folder in folders.items():
            runs = {side: [] for side in sides}
            for repeat in range(args.repeats):
                for side, recipes in sides.items():  # alternately, so that a noisy minute hits both
                    runs[side].append(measure(recipes, file, folder))
                    print(f"{name} {side} run {repeat + 1}: {runs[side][-1]}", file=sys.stderr, flush=True)
            for side, measured in runs.items():
                seconds = statistics.median(run["seconds"] for run in measured)
                results.append({"tokenizer": name, "template": TOKENIZERS[name] or "recipes' default", "side": side,
                                "rows": measured[0]["rows"], "kept": measured[0]["kept"],
                                "tokens": measured[0]["tokens"], "median_seconds": round(seconds, 2),
                                "rows_per_second": round(measured[0]["rows"] / seconds),
                                "peak_mib": max(run["peak_mib"] for run in measured),
                                "seconds": [round(run["seconds"], 2) for run in measured]})
    lines = ["| tokenizer (template) | revision | rows kept | tokens | median s | rows/s | peak RSS (MiB) | runs (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['tokenizer']} ({r['template']}) | {r['side']} | {r['kept']:,} of {r['rows']:,} | "
                     f"{r['tokens']:,} | {r['median_seconds']} | {r['rows_per_second']:,} | {r['peak_mib']:,} | {r['seconds']} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        command = "python scripts/measure/prepare_speed.py " + " ".join(argv if argv is not None else sys.argv[1:])
        (args.out / "results.json").write_text(json.dumps({"command": command, "date": time.strftime("%Y-%m-%d"),
                                                           "results": results}, indent=1) + "\n")
        (args.out / "results.md").write_text(f"# Data preparation, rows/s ({time.strftime('%Y-%m-%d')}, CPU, "
                                             f"{__import__('os').cpu_count()} cores)\n\n`{command}`\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
