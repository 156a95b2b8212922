"""The bundled held-out rows (data/preferences/eval.jsonl) as lm-evaluation-harness tasks: read from beside this
file, so the tasks load from any working directory and without a network."""

from pathlib import Path

ROWS = Path(__file__).resolve().parents[1] / "preferences" / "eval.jsonl"


def held_out_rows(**_):
    """lm-eval's custom_dataset: {"test": the 128 rows} (prompt, chosen: the answer, rejected: a wrong one)."""
    import datasets

    return datasets.DatasetDict({"test": datasets.load_dataset("json", data_files=str(ROWS), split="train")})
