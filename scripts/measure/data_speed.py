#!/usr/bin/env python
"""The recipes' data preparation beside the limit and beside TRL, on the same generated rows.

    python scripts/measure/data_speed.py --rows 20000 --launch --out results/<dir>   # every side, then the launches
    python scripts/measure/data_speed.py --rows 2000                                  # a quick look at every side
    python scripts/measure/data_speed.py --rows 300 --sides limit,recipes-1           # the test's run
    python scripts/measure/data_speed.py --sides limit --tokenizers bundled --formats chat --launch  # the goals alone

Data: a chat file (1-3 turns, about half with a system prompt; scripts/measure/prepare_speed.py's rows) and
an instruction file (instruction, an input in about half of them, response) of similar length,
--rows each. Tokenizers: the bundled character-level one (data/tokenizer) with the recipes' default
chat template, and a sentencepiece-style BPE of Llama-2 / Mistral-7B's vocabulary size (32,000:
byte fallback, Metaspace pre-tokenizer, <s> </s> <unk>), trained here on the text of installed
packages and generated rows, and given Llama-3.1's chat template and special tokens
(tests/fixtures/chat_templates). It is built once (~15 s) and kept under
~/.cache/recipes/data_speed (--tokenizer-cache). The vocabulary sizes are in the table.

Sides (scripts/measure/bench/data_sides.py runs each; each run is a fresh process, its peak resident
memory per rank and the largest of its tokenising workers' read from /proc while it runs):
  limit              every row rendered once, then one batched call of the fast tokenizer over all
                     texts with offsets (all cores: TOKENIZERS_PARALLELISM=true; a call per 20,000
                     rows past that, or 200,000 character-level rows would take ~30 GB). The floor.
  recipes-1          recipes/lora.py's data stage (preparation.prepare) in one process: `cold` with an
                     empty datasets cache (it tokenises), then `cached` with that cache (a rerun).
  recipes-2          the same under `accelerate launch --num_processes 2` (ddp.yaml, gloo on CPU).
  packed             recipes-2 with --packing (on recipes-2's cache when it ran: it packs, the
                     tokens are reused); the fill ratio from the recipes' packing line.
  trl                SFTTrainer built on the same rows (chat rows as `messages`, instruction rows as
                     prompt/completion), max_length the same, no training; cold datasets cache. With
                     TRL's defaults a chat row trains on every token (its assistant-only loss needs
                     a template with generation marks): it finds no replies, less work than ours.
Per side: rows, rows kept, seconds (median of --repeats; the recipes' sides time preparation.prepare
between two barriers, the others from reading the file to the prepared set), rows/s, x the limit,
peak RSS (MiB) per rank, and the datasets cache files the run wrote (a cached run writes none).

--launch adds the end-to-end goals: `accelerate launch --config_file accelerate_configs/ddp.yaml
--num_processes 2 recipes/lora.py --dataset <chat file> --max-steps 1 --max-length 1024
--output-dir <tmp>` with an empty datasets cache, the same again (cached), and with --packing (on
CPU with --mixed_precision no, as the tests launch): each launch's wall time, its peak RSS per rank,
the packing line's fill, against the goals printed beside them.

Prints the tables; --out DIR writes DIR/results.md and DIR/results.json (command, date, CPU count,
library versions, every run).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts" / "measure"))
from bench.environment import library_versions  # noqa: E402
from bench.launching import free_port, shell_line  # noqa: E402
from prepare_speed import chat_file, sentence, tokenizer_folders  # noqa: E402  (also puts tests/ on sys.path)

SIDES_PROGRAM = REPO / "scripts" / "measure" / "bench" / "data_sides.py"
DDP_CONFIG = REPO / "accelerate_configs" / "ddp.yaml"
SIDE_GROUPS = ("limit", "recipes-1", "recipes-2", "packed", "trl")
TOKENIZERS = ("bundled", "sentencepiece-32k")
FORMATS = ("chat", "instruction")
LABELS = {"limit": "limit (render once + one batched call)", "recipes-1-cold": "recipes, 1 process, cold",
          "recipes-1-cached": "recipes, 1 process, cached", "recipes-2-cold": "recipes, 2 processes, cold",
          "recipes-2-cached": "recipes, 2 processes, cached", "packed": "recipes, 2 processes, packed",
          "trl": "TRL SFTTrainer, cold"}
SP_VOCAB = 32_000
SP_CORPUS_BYTES = 16_000_000  # of installed packages' text: ~15 s to train, and enough words for 32k pieces
SP_TEMPLATE = "llama3_1"  # a real template that keeps every generated row
LAUNCH_GOALS = {"cold": "<= limit + 30 s", "rerun": "<= 15 s", "packed": "<= 2 GB per rank, fill >= 98%"}
GB = 1e9 / 2**20  # MiB


# ------------------------------------------------------------------------------------------------
# Rows

def paragraph(rng: random.Random, fewest: int, most: int) -> str:
    return " ".join(sentence(rng) for _ in range(rng.randint(fewest, most)))


def instruction_file(path: Path, count: int, seed: int = 0) -> Path:
    """Instruction rows about as long as chat_file's conversations; the prompt always fits 1,024 tokens."""
    rng = random.Random(seed)
    with path.open("w") as out:
        for _ in range(count):
            given = paragraph(rng, 1, 4) if rng.random() < 0.5 else ""
            out.write(json.dumps({"instruction": paragraph(rng, 1, 3), "input": given,
                                  "response": paragraph(rng, 4, 16)}) + "\n")
    return path


def prompt_completion_file(instructions: Path, path: Path) -> Path:
    """The instruction rows as TRL's prompt/completion rows: the prompt as the recipes render it."""
    from common.data.formats import split_prompt

    with path.open("w") as out:
        for line in instructions.read_text().splitlines():
            prompt, completion = split_prompt(json.loads(line), "instruction")
            out.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
    return path


def texts_of(path: Path) -> list[str]:
    """The text a row holds (its turns' or columns'), without the JSON around it."""
    texts = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        texts.append("\n".join(turn["content"] for turn in row["messages"]) if "messages" in row
                     else "\n".join(value for value in row.values() if value))
    return texts


# ------------------------------------------------------------------------------------------------
# Tokenizers

def package_texts(budget: int):
    """About `budget` bytes of .py / .md / .txt files from the installed packages: every Nth file in
    path order, so that the sample spans all of them."""
    root = Path(sysconfig.get_paths()["purelib"])
    files = sorted(p for p in root.rglob("*") if p.suffix in (".py", ".md", ".txt") and p.is_file())
    sizes = [p.stat().st_size for p in files]
    for path in files[::max(1, sum(sizes) // budget)]:
        yield path.read_text(errors="ignore")


def sentencepiece_32k(cache_root: Path) -> Path:
    """The folder of a sentencepiece-style tokenizer of 32,000 pieces with Llama-3.1's chat template;
    trained the first time, then read from `cache_root`."""
    folder = cache_root / f"sentencepiece-{SP_VOCAB}-{SP_CORPUS_BYTES // 10**6}mb-{SP_TEMPLATE}"
    if (folder / "tokenizer.json").is_file():
        return folder
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    print(f"building the {SP_VOCAB:,}-piece tokenizer once (into {folder})", file=sys.stderr, flush=True)
    byte_pieces = [f"<0x{byte:02X}>" for byte in range(256)]  # Llama-2's byte fallback pieces, ids 3-258
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    # as chat_fixtures' sentencepiece: "▁" marks word starts, a newline is a piece of its own
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split("\n", behavior="isolated"),
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=SP_VOCAB, special_tokens=["<unk>", "<s>", "</s>", *byte_pieces],
                                  limit_alphabet=1000, show_progress=False)
    with tempfile.TemporaryDirectory() as scratch:
        generated = texts_of(chat_file(Path(scratch) / "chat.jsonl", 2000, seed=1))
        generated += texts_of(instruction_file(Path(scratch) / "instruction.jsonl", 2000, seed=1))
    tokenizer.train_from_iterator([*package_texts(SP_CORPUS_BYTES), *generated], trainer)
    # the byte pieces are ordinary pieces of the vocabulary (only the byte fallback writes them), not added tokens
    serialised = json.loads(tokenizer.to_str())
    serialised["added_tokens"] = [added for added in serialised["added_tokens"] if added["content"] not in byte_pieces]
    wrapped = with_chat_template(Tokenizer.from_str(json.dumps(serialised)), SP_TEMPLATE)
    partial = folder.with_name(f"{folder.name}.{os.getpid()}.partial")
    wrapped.save_pretrained(partial)
    os.replace(partial, folder)  # whole or absent: an interrupted build is not reused
    return folder


def with_chat_template(tokenizer, family: str):
    """`tokenizer` as transformers wraps it, holding the family's chat template and special tokens."""
    import chat_fixtures
    from transformers import PreTrainedTokenizerFast

    spec = chat_fixtures.index()[family]
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                                      eos_token="</s>", clean_up_tokenization_spaces=False, model_max_length=1 << 30)
    wrapped.add_special_tokens({"additional_special_tokens": spec["special_tokens"], "eos_token": spec["eos_token"],
                                **({"bos_token": spec["bos_token"]} if spec["bos_token"] else {})})
    wrapped.chat_template = chat_fixtures.template(family)
    return wrapped


def tokenizer_info(folder: Path, template: str) -> dict:
    from transformers import AutoTokenizer

    return {"folder": str(folder), "vocab_size": len(AutoTokenizer.from_pretrained(folder)), "template": template}


# ------------------------------------------------------------------------------------------------
# Running a side: a process tree, its output and its peak memory

class TreePeaks:
    """Peak resident memory (VmHWM, MiB) of every process below `root`, read from /proc every 0.1 s:
    each rank's (a process with RANK in its environment whose parent has none; the root itself when
    no process has one) and the largest of the processes those start (datasets' tokenising workers)."""

    def __init__(self, root: int):
        self.root = root
        self.processes: dict[int, dict] = {}  # pid -> {parent, program, rank, peak}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self):
        while not self.done.is_set():
            self._sample()
            self.done.wait(0.1)

    def _sample(self):
        parents = {}
        for entry in os.scandir("/proc"):
            try:  # the process may have ended since the listing
                parents[int(entry.name)] = int(Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (ValueError, OSError, IndexError):
                continue
        tree, frontier = {self.root}, [self.root]
        while frontier:
            frontier = [pid for pid, parent in parents.items() if parent in frontier and pid not in tree]
            tree.update(frontier)
        for pid in tree:
            try:
                program = Path(f"/proc/{pid}/cmdline").read_bytes()
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            if not program:  # a process that has ended (a zombie) keeps no memory and no command line
                continue
            known = self.processes.get(pid)
            # A process seen between fork and exec still holds its parent's pages and environment: once it
            # runs its own program, it is counted anew.
            if known is None or known["program"] != program:
                known = self.processes[pid] = {"parent": parents.get(pid), "program": program, "rank": rank_of(pid),
                                               "peak": 0}
            peak = re.search(r"VmHWM:\s+(\d+)", status)
            known["peak"] = max(known["peak"], int(peak.group(1)) // 1024 if peak else 0)

    def stop(self) -> dict:
        """{"ranks": {rank: MiB}, "workers": the largest worker's MiB, or None}."""
        self.done.set()
        self.thread.join()
        known = self.processes
        ranks = {p["rank"]: p["peak"] for p in known.values()
                 if p["rank"] is not None and known.get(p["parent"], {}).get("rank") != p["rank"]}
        if ranks:  # a launch: a rank's workers carry its RANK
            workers = [p["peak"] for p in known.values()
                       if p["rank"] is not None and known.get(p["parent"], {}).get("rank") == p["rank"]]
        else:  # one process: it is rank 0, and what it starts are its workers
            ranks = {0: known.get(self.root, {}).get("peak", 0)}
            workers = [p["peak"] for pid, p in known.items() if pid != self.root]
        return {"ranks": dict(sorted(ranks.items())), "workers": max(workers, default=None)}


def rank_of(pid: int) -> int | None:
    try:
        environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    rank = next((item[5:] for item in environment if item.startswith(b"RANK=")), None)
    return int(rank) if rank is not None else None


def arrow_files(cache: Path) -> set:
    return {(str(path), path.stat().st_mtime_ns) for path in cache.rglob("*.arrow")} if cache.exists() else set()


def run(command: list[str], env: dict, cache: Path | None = None, timeout: float = 3600) -> dict:
    """Run one side's process to its end: its `side:` records, its output, wall time, peak memory and
    the datasets cache files it wrote. A failure stops the benchmark with the output's tail."""
    before = arrow_files(cache) if cache else set()
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks = TreePeaks(process.pid)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
    wall = time.perf_counter() - started
    memory = peaks.stop()
    if process.returncode:
        raise SystemExit(f"failed (exit {process.returncode}): {shell_line(command)}\n{output[-4000:]}")
    decoder = json.JSONDecoder()  # the ranks' lines may share a line of the launcher's output
    records = [decoder.raw_decode(output, found.end())[0] for found in re.finditer(r"side: (?=\{)", output)]
    return {"records": records, "output": output, "wall_seconds": wall, "memory": memory,
            "new_cache_files": len(arrow_files(cache) - before) if cache else None}


def environment(cache: Path | None = None, parallel_tokenizer: bool | None = None) -> dict:
    """Offline and unbuffered; the datasets cache given; TOKENIZERS_PARALLELISM as a user leaves it
    (unset) unless asked."""
    env = {key: value for key, value in os.environ.items() if key != "TOKENIZERS_PARALLELISM"}
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if cache is not None:
        env["HF_DATASETS_CACHE"] = str(cache)
    if parallel_tokenizer is not None:
        env["TOKENIZERS_PARALLELISM"] = "true" if parallel_tokenizer else "false"
    return env


def launcher(processes: int) -> list[str]:
    """`accelerate launch` of ddp.yaml on `processes` processes (a port of its own: other launches may run);
    without a GPU in full precision, as the tests launch."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(DDP_CONFIG),
               "--num_processes", str(processes), "--main_process_port", str(free_port())]
    return command + ([] if has_gpu() else ["--mixed_precision", "no"])


@functools.lru_cache(maxsize=None)
def has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def recipes_lines(output: str) -> dict:
    """What the recipes' data line (rows used) and packing line (sequences, fill) say."""
    found = {}
    data = re.search(r"data \(\w+\): training ([\d,]+) rows: ([\d,]+) used.*?; evaluation ([\d,]+) rows: ([\d,]+) used",
                     output)
    if data:
        train, train_used, evaluation, eval_used = (int(group.replace(",", "")) for group in data.groups())
        found.update(rows=train + evaluation, kept=train_used + eval_used)
    packing = re.search(r"packing: ([\d,]+) training rows into ([\d,]+) sequences .*?, ([\d.]+)% full", output)
    if packing:
        found.update(packed_rows=int(packing.group(1).replace(",", "")),
                     sequences=int(packing.group(2).replace(",", "")), fill=float(packing.group(3)) / 100)
    return found


# ------------------------------------------------------------------------------------------------
# The sides

class Bench:
    """The settings every side shares, a fresh folder (datasets cache, output) for each run, and one run
    of each kind of side."""

    def __init__(self, args, scratch: Path):
        self.args, self.scratch, self.count = args, scratch, 0

    def fresh(self, name: str) -> Path:
        self.count += 1
        return self.scratch / f"{self.count:03d}-{name}"

    def limit(self, file: Path, tokenizer: Path) -> dict:
        command = [sys.executable, str(SIDES_PROGRAM), "limit", "--file", str(file), "--tokenizer", str(tokenizer)]
        return side_run(run(command, environment(parallel_tokenizer=True)))

    def recipes(self, file: Path, tokenizer: Path, processes: int, cache: Path, packing: bool = False) -> dict:
        if packing:  # a packing plan left by an earlier run would be reused, not packed
            for packed in cache.rglob("packed-*"):
                packed.unlink()
        command = [*launcher(processes), str(SIDES_PROGRAM)] if processes > 1 else [sys.executable, str(SIDES_PROGRAM)]
        command += ["recipes", "--tokenizer", str(tokenizer), "--", "--dataset", str(file), "--max-length",
                    str(self.args.max_length), "--max-steps", "1", "--report-to", "none",
                    "--output-dir", str(self.fresh("output")), *(["--packing"] if packing else [])]
        done = run(command, environment(cache), cache)
        # the stage ends when its slowest rank is through (the ranks leave it at one barrier: nearly the same)
        return side_run(done, seconds=max(record["seconds"] for record in done["records"]),
                        **recipes_lines(done["output"]))

    def trl(self, file: Path, tokenizer: Path) -> dict:
        cache = self.fresh("trl-cache")
        command = [sys.executable, str(SIDES_PROGRAM), "trl", "--file", str(file), "--tokenizer", str(tokenizer),
                   "--max-length", str(self.args.max_length), "--output-dir", str(self.fresh("trl-output"))]
        done = side_run(run(command, environment(cache), cache))
        shutil.rmtree(cache, ignore_errors=True)
        return done

    def cold_then_cached(self, file: Path, tokenizer: Path, processes: int) -> tuple[list, list, Path]:
        """Runs on an empty cache each, then runs on the last one's cache (kept for more runs)."""
        cold = []
        for _ in range(self.args.repeats):
            cache = self.fresh("cache")
            cold.append(self.recipes(file, tokenizer, processes, cache))
        cached = [self.recipes(file, tokenizer, processes, cache) for _ in range(self.args.repeats)]
        return cold, cached, cache


def side_run(done: dict, **measured) -> dict:
    """One run's figures: its side: record (the first rank's), what the caller measured, memory, wall."""
    return {**done["records"][0], **measured, "memory": done["memory"], "wall_seconds": done["wall_seconds"],
            "new_cache_files": done["new_cache_files"]}


def measure_pair(bench: Bench, sides: list[str], file: Path, trl_file: Path, tokenizer: Path) -> dict:
    """side -> its runs, for one tokenizer and one data file. Each cache is removed once used: at
    200,000 rows one holds gigabytes."""
    repeats = range(bench.args.repeats)
    runs = {}
    if "limit" in sides:
        runs["limit"] = [bench.limit(file, tokenizer) for _ in repeats]
    if "recipes-1" in sides:
        runs["recipes-1-cold"], runs["recipes-1-cached"], cache = bench.cold_then_cached(file, tokenizer, 1)
        shutil.rmtree(cache, ignore_errors=True)
    cache = bench.fresh("cache")  # packing's, when recipes-2 leaves none
    if "recipes-2" in sides:
        runs["recipes-2-cold"], runs["recipes-2-cached"], cache = bench.cold_then_cached(file, tokenizer, 2)
    if "packed" in sides:
        runs["packed"] = [bench.recipes(file, tokenizer, 2, cache, packing=True) for _ in repeats]
    shutil.rmtree(cache, ignore_errors=True)
    if "trl" in sides:
        runs["trl"] = [bench.trl(trl_file, tokenizer) for _ in repeats]
    return runs


def summary(tokenizer: str, vocab: int, data: str, side: str, runs: list[dict], limit_seconds: float | None) -> dict:
    """One row of the table: the median time, the first run's counts, the highest peak of each rank."""
    seconds = statistics.median(run["seconds"] for run in runs)
    ranks = {rank: max(run["memory"]["ranks"].get(rank, 0) for run in runs) for rank in runs[0]["memory"]["ranks"]}
    workers = [run["memory"]["workers"] for run in runs if run["memory"]["workers"] is not None]
    first = runs[0]
    return {"tokenizer": tokenizer, "vocab_size": vocab, "data": data, "side": side, "label": LABELS[side],
            "rows": first["rows"], "kept": first.get("kept"), "seconds": round(seconds, 3),
            "rows_per_second": round(first["rows"] / seconds) if seconds else None,
            "vs_limit": round(seconds / limit_seconds, 2) if limit_seconds else None,
            "peak_mib_per_rank": ranks, "workers_peak_mib": max(workers, default=None),
            "new_cache_files": [run["new_cache_files"] for run in runs], "fill": first.get("fill"),
            "sequences": first.get("sequences"), "tokens": first.get("tokens"), "runs": runs}


# ------------------------------------------------------------------------------------------------
# The launch goals

def launch_goals(bench: Bench, chat: Path, limit_seconds: float) -> list[dict]:
    """recipes/lora.py launched as a user would on the chat file: cold, rerun (cached), packed."""
    cache = bench.fresh("launch-cache")
    rows = []
    for name, extra in (("cold", []), ("rerun", []), ("packed", ["--packing"])):
        command = [*launcher(2), str(REPO / "recipes" / "lora.py"), "--dataset", str(chat), "--max-steps", "1",
                   "--max-length", "1024", "--output-dir", str(bench.fresh("launch-output")), *extra]
        done = run(command, environment(cache), cache)
        found = recipes_lines(done["output"])
        peaks = done["memory"]["ranks"]
        met = {"cold": done["wall_seconds"] <= limit_seconds + 30, "rerun": done["wall_seconds"] <= 15,
               "packed": max(peaks.values()) <= 2 * GB and found.get("fill", 0) >= 0.98}[name]
        rows.append({"launch": name, "command": shell_line(command), "wall_seconds": round(done["wall_seconds"], 1),
                     "goal": LAUNCH_GOALS[name], "met": met, "rows": found.get("rows"), "kept": found.get("kept"),
                     "fill": found.get("fill"), "peak_mib_per_rank": peaks, "workers_peak_mib": done["memory"]["workers"],
                     "new_cache_files": done["new_cache_files"]})
        print(f"launch {name}: {rows[-1]['wall_seconds']} s, peak {peaks} MiB", file=sys.stderr, flush=True)
    shutil.rmtree(cache, ignore_errors=True)
    return rows


# ------------------------------------------------------------------------------------------------
# The report

def memory_cell(ranks: dict, workers: int | None) -> str:
    cell = " / ".join(f"{mib:,}" for mib in ranks.values())
    return cell + (f" (+ workers {workers:,})" if workers else "")


def notes_cell(row: dict) -> str:
    first = row["runs"][0]
    if row["side"] == "limit":
        calls = f" in {first['calls']} calls" if first["calls"] > 1 else ""
        return (f"read {first['read_seconds']:.2f} s, render {first['render_seconds']:.2f} s, "
                f"tokenise {first['tokenize_seconds']:.2f} s{calls}")
    written = row["new_cache_files"]
    most = max(written)
    cache = "cache reused (0 files written)" if not most else f"{most} cache file{'s' if most > 1 else ''} written"
    if row["side"] == "packed":
        return f"fill {row['fill']:.1%} in {row['sequences']:,} sequences; {cache}"
    return cache


def side_table(rows: list[dict]) -> str:
    lines = ["| tokenizer (vocabulary) | data | side | rows | kept | seconds | rows/s | x limit | "
             "peak RSS MiB per rank | notes |", "|---|---|---|---:|---:|---:|---:|---:|---|---|"]
    for row in rows:
        kept = f"{row['kept']:,}" if row["kept"] is not None else "?"
        ratio = f"{row['vs_limit']:.2f}" if row["vs_limit"] is not None else ""
        lines.append(f"| {row['tokenizer']} ({row['vocab_size']:,}) | {row['data']} | {row['label']} | "
                     f"{row['rows']:,} | {kept} | {row['seconds']:.2f} | {row['rows_per_second']:,} | {ratio} | "
                     f"{memory_cell(row['peak_mib_per_rank'], row['workers_peak_mib'])} | {notes_cell(row)} |")
    return "\n".join(lines)


def launch_table(rows: list[dict], limit_seconds: float) -> str:
    lines = [f"| launch (limit: {limit_seconds:.1f} s) | wall s | goal | met | kept | fill | "
             "peak RSS MiB per rank | cache files written |", "|---|---:|---|---|---:|---:|---|---:|"]
    for row in rows:
        fill = f"{row['fill']:.1%}" if row["fill"] is not None else ""
        lines.append(f"| {row['launch']} | {row['wall_seconds']} | {row['goal']} | {'yes' if row['met'] else 'NO'} | "
                     f"{row['kept'] or 0:,} | {fill} | {memory_cell(row['peak_mib_per_rank'], row['workers_peak_mib'])} "
                     f"| {row['new_cache_files']} |")
    return "\n".join(lines)


def write_results(folder: Path, record: dict, tables: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps(record, indent=1) + "\n")
    tokenizers = "; ".join(f"{name}: a vocabulary of {info['vocab_size']:,}, the {info['template']} chat template"
                           for name, info in record["tokenizers"].items())
    (folder / "results.md").write_text(
        f"# Data preparation: the recipes beside the limit and TRL ({record['date']}, CPU, {record['cpu_count']} "
        f"cores)\n\n`{record['command']}`\n\n{record['rows']:,} rows per file, --max-length {record['max_length']}, "
        f"median of {record['repeats']} run(s). Tokenizers: {tokenizers}. Versions: "
        f"{', '.join(f'{k} {v}' for k, v in record['versions'].items())}.\n\n{tables}\n")


# ------------------------------------------------------------------------------------------------

def choices(allowed: tuple):
    def parse(text: str) -> list[str]:
        chosen = [item.strip() for item in text.split(",") if item.strip()]
        unknown = [item for item in chosen if item not in allowed]
        if unknown or not chosen:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(allowed)} (comma-separated)")
        return chosen
    return parse


def parse_args(argv=None):
    summary_line, _, details = __doc__.partition("\n")
    parser = argparse.ArgumentParser(description=summary_line, epilog=details,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--rows", type=int, default=20_000, help="rows in each generated file (default: 20,000)")
    add("--repeats", type=int, default=1, help="runs of each side; the table shows the median (default: 1)")
    add("--max-length", type=int, default=1024, help="--max-length of the recipes and TRL's max_length (default: 1024)")
    add("--sides", type=choices(SIDE_GROUPS), default=list(SIDE_GROUPS), help=f"of {', '.join(SIDE_GROUPS)} (default: all)")
    add("--tokenizers", type=choices(TOKENIZERS), default=list(TOKENIZERS), help=f"of {', '.join(TOKENIZERS)} (default: both)")
    add("--formats", type=choices(FORMATS), default=list(FORMATS), help=f"of {', '.join(FORMATS)} (default: both)")
    add("--launch", action="store_true", help="also the end-to-end launches of recipes/lora.py and their goals")
    add("--tokenizer-cache", type=Path,
        default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "recipes" / "data_speed",
        help="where the 32,000-piece tokenizer is kept once built (default: ~/.cache/recipes/data_speed)")
    add("--out", type=Path, default=None, help="write results.md and results.json there")
    return parser.parse_args(argv)


def ensure_tiny_model() -> None:
    """The bundled tiny Llama, built as the recipes build it on first use: the recipes' launch checks read it."""
    from common.model.model_config import default_model_needs_building

    if default_model_needs_building():
        subprocess.run([sys.executable, str(REPO / "scripts" / "build_tiny_model.py")], cwd=REPO, check=True)


def inputs(args, root: Path) -> tuple[dict, dict, dict]:
    """The generated files (the recipes' and TRL's) and the tokenizer folders the run needs."""
    files = {"chat": chat_file(root / "chat.jsonl", args.rows),
             "instruction": instruction_file(root / "instruction.jsonl", args.rows)}
    trl_files = {"chat": files["chat"],
                 "instruction": prompt_completion_file(files["instruction"], root / "prompt_completion.jsonl")}
    folders = {}
    if "bundled" in args.tokenizers or args.launch:
        folders["bundled"] = tokenizer_folders(root / "tokenizers")["bundled"]
    if "sentencepiece-32k" in args.tokenizers:
        folders["sentencepiece-32k"] = sentencepiece_32k(args.tokenizer_cache)
    return files, trl_files, folders


def main(argv=None) -> int:
    args = parse_args(argv)
    ensure_tiny_model()
    command = "python scripts/measure/data_speed.py " + " ".join(sys.argv[1:] if argv is None else argv)
    rows, launches, limits = [], [], {}
    with tempfile.TemporaryDirectory(prefix="data_speed-") as scratch:
        files, trl_files, folders = inputs(args, Path(scratch))
        infos = {name: tokenizer_info(folder, "recipes' default" if name == "bundled" else SP_TEMPLATE)
                 for name, folder in folders.items()}
        bench = Bench(args, Path(scratch) / "runs")
        for name in args.tokenizers:
            for data in args.formats:
                print(f"{name} / {data}: {', '.join(args.sides)}", file=sys.stderr, flush=True)
                runs = measure_pair(bench, args.sides, files[data], trl_files[data], folders[name])
                limits[name, data] = statistics.median(run["seconds"] for run in runs["limit"]) if "limit" in runs else None
                rows += [summary(name, infos[name]["vocab_size"], data, side, side_runs, limits[name, data])
                         for side, side_runs in runs.items()]
        if args.launch:
            if limits.get(("bundled", "chat")) is None:  # the cold launch's goal is relative to it
                limit_runs = [bench.limit(files["chat"], folders["bundled"]) for _ in range(args.repeats)]
                limits["bundled", "chat"] = statistics.median(run["seconds"] for run in limit_runs)
                rows.append(summary("bundled", infos["bundled"]["vocab_size"], "chat", "limit", limit_runs,
                                    limits["bundled", "chat"]))
            launches = launch_goals(bench, files["chat"], limits["bundled", "chat"])
    tables = side_table(rows)
    if launches:
        tables += ("\n\nEnd to end: recipes/lora.py on the chat file (the bundled tokenizer), 2 processes, each launch "
                   f"`{launches[0]['command']}` (+ --packing for the last)\n\n"
                   f"{launch_table(launches, limits['bundled', 'chat'])}")
    print(tables)
    if args.out:
        record = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M"), "cpu_count": os.cpu_count(),
                  "rows": args.rows, "repeats": args.repeats, "max_length": args.max_length,
                  "versions": versions(), "tokenizers": infos, "results": rows, "launches": launches}
        write_results(args.out, record, tables)
    return 0


def versions() -> dict:
    from importlib.metadata import version

    return {**library_versions(), "trl": version("trl"), "tokenizers": version("tokenizers")}


if __name__ == "__main__":
    sys.exit(main())
