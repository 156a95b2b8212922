"""The path after LoRA SFT: the adapter folder it saved is the --model of preference tuning (its base with the
adapter merged in, so the reference is the SFT model); the preference run's folder stands alone (no cache, moved
elsewhere: merge.py, generate.py and plain peft load the model it trained); a run on chat pairs is asked as a chat
run; and scripts/merge.py merges an adapter saved without --merge any time after."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, TINY_MODEL, launch, long_test

sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "recipes"))
import generate  # noqa: E402
from common.data import pairs, targets  # noqa: E402
from common.data.formats import IGNORE, PAIRS_CONVERSATIONAL  # noqa: E402

SYSTEM = "You sort numbers. Answer with the numbers only."


def sort_task(rng: random.Random) -> tuple[str, str, str]:
    """(question, right answer, a wrong one): a few digits to sort, never already sorted."""
    while True:
        digits = [rng.randint(0, 9) for _ in range(4)]
        if digits != sorted(digits):
            return f"Sort: {' '.join(map(str, digits))}", " ".join(map(str, sorted(digits))), " ".join(map(str, digits))


def chat_files(folder) -> tuple:
    """(chat rows, chat pairs): every conversation opens with the same system turn."""
    rng = random.Random(0)
    rows, pair_rows = [], []
    for _ in range(48):
        question, right, wrong = sort_task(rng)
        prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        rows.append({"messages": prompt + [{"role": "assistant", "content": right}]})
        pair_rows.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": right}],
                          "rejected": [{"role": "assistant", "content": wrong}]})
    written = []
    for name, records in (("chat.jsonl", rows), ("pairs.jsonl", pair_rows)):
        (folder / name).write_text("".join(json.dumps(record) + "\n" for record in records))
        written.append(folder / name)
    return tuple(written)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return chat_files(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def sft(data, tmp_path_factory):
    """lora.py on chat rows, adapter/ and (--merge) merged/ saved."""
    out = tmp_path_factory.mktemp("sft") / "out"
    run = launch("lora", out, "--dataset", str(data[0]), "--max-steps", "6", "--batch-size", "4", "--lr", "5e-3",
                 "--merge")
    assert run.returncode == 0, run.output[-3000:]
    return out


def dpo(model: str, out, cache, *flags: str, processes: int = 2, steps: int = 2):
    run = launch("dpo", out, "--model", model, "--max-steps", str(steps), "--batch-size", "2", "--log-every", "1",
                 *flags, config="ddp", processes=processes, env={"RECIPES_CACHE": str(cache)})
    assert run.returncode == 0, run.output[-3000:]
    return run


@long_test  # four launches (~50 s); every run keeps a DPO run from the SFT adapter (chat_dpo, below)
def test_dpo_from_the_sft_adapter_starts_from_the_sft_model_and_answers(sft, tmp_path):
    cache = tmp_path / "cache"
    from_adapter = dpo(str(sft / "adapter"), tmp_path / "from-adapter", cache)
    assert "is a LoRA adapter; training its base" in from_adapter.output
    from_merged = dpo(str(sft / "merged"), tmp_path / "from-merged", cache)  # what --merge wrote
    from_base = dpo(str(TINY_MODEL), tmp_path / "from-base", cache, steps=1)
    # the same model as the SFT run's merged/: the same log-probabilities (policy and reference), step by step
    for mine, merged in zip(from_adapter.metrics(), from_merged.metrics()):
        for key in ("loss", "logps/chosen", "logps/rejected", "rewards/margins"):
            assert mine[key] == pytest.approx(merged[key], rel=1e-5, abs=1e-6), key
    assert from_adapter.metrics()[0]["logps/chosen"] != pytest.approx(from_base.metrics()[0]["logps/chosen"], rel=1e-3)
    settled = from_adapter.run_json()["arguments"]["settled_from"]
    assert "merged onto its base" in settled["model"] and str(sft / "adapter") in settled["model"]
    # what the run started from, by the names a user gave: never the cache's copy
    ran = from_adapter.run_json()
    assert (ran["base_model"], ran["start_adapter"]) == (str(TINY_MODEL), str(sft / "adapter"))
    assert from_merged.run_json()["start_adapter"] is None
    card = (tmp_path / "from-adapter" / "README.md").read_text()  # the model card says where the model came from
    assert f"started from the LoRA adapter `{sft / 'adapter'}` merged onto it" in card and str(cache) not in card
    assert ("checkpoints/" in card) == (tmp_path / "from-adapter" / "checkpoints").is_dir()

    again = dpo(str(sft / "adapter"), tmp_path / "again", cache, processes=1, steps=1)  # a second run finds the merge
    assert "merged by an earlier run" in again.output
    answered = subprocess.run([sys.executable, str(REPO / "scripts" / "generate.py"), str(tmp_path / "from-adapter"),
                               "--prompt", "Sort: 3 1 2", "--max-new-tokens", "8"], capture_output=True, text=True)
    assert answered.returncode == 0 and answered.stdout.strip(), answered.stderr[-2000:]


def probe_logits(model, probe: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"]).logits.float()


def loaded_three_ways(run_dir, base, tmp_path, auto_peft: bool) -> dict:
    """The run's model loaded by scripts/merge.py (then transformers), scripts/generate.py and plain peft (the
    adapter on `base`; with `auto_peft`, also on the base it names itself: AutoPeftModelForCausalLM), as
    {how: logits on the run's probe batch}."""
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM

    probe = load_file(str(run_dir / "probe_logits.safetensors"))
    merged = tmp_path / "merged-after"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "merge.py"), str(run_dir / "adapter"), str(merged)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    run, found = generate.find_model(str(run_dir), "adapter")
    models = {"merge.py": AutoModelForCausalLM.from_pretrained(merged), "generate.py": generate.load(found, run, "cpu"),
              "PeftModel": PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), run_dir / "adapter")}
    if auto_peft:
        models["AutoPeftModelForCausalLM"] = AutoPeftModelForCausalLM.from_pretrained(run_dir / "adapter")
    return {name: probe_logits(model.eval(), probe) for name, model in models.items()}


@pytest.fixture(scope="module")
def chat_dpo(sft, data, tmp_path_factory):
    """dpo.py on chat pairs from the SFT adapter, with a learning rate whose update shows in the logits."""
    folder = tmp_path_factory.mktemp("chat-dpo")
    run = dpo(str(sft / "adapter"), folder / "out", folder / "cache", "--dataset", str(data[1]), "--lr", "5e-3",
              steps=3)
    return run, folder / "cache"


def test_a_dpo_run_from_an_adapter_stands_alone_without_the_cache_and_moved(sft, chat_dpo, tmp_path):
    """Its adapter folds the SFT adapter's update into its own, on the original base: with the cache deleted and
    the run's folder moved, merge.py, generate.py and plain peft load the model it trained (its probe logits)."""
    from transformers import AutoModelForCausalLM

    run, cache = chat_dpo
    assert "folded in (rank 32)" in run.output  # --lora-r 16, twice
    shutil.rmtree(cache)
    moved = tmp_path / "elsewhere"
    run.output_dir.rename(moved)  # moved to the machine that serves it (and back after, for the other tests)
    try:
        config = json.loads((moved / "adapter" / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str(TINY_MODEL) and config["r"] == 32
        assert not (moved / "base").exists()
        trained = load_file(str(moved / "probe_logits.safetensors"))["logits"]
        for name, logits in loaded_three_ways(moved, TINY_MODEL, tmp_path, auto_peft=True).items():
            assert torch.allclose(logits, trained, atol=1e-4), (name, (logits - trained).abs().max())
    finally:
        moved.rename(run.output_dir)
    # what the logits would be with either update missing: far from the trained ones
    probe = load_file(str(run.output_dir / "probe_logits.safetensors"))
    for other in (sft / "merged", TINY_MODEL):
        assert (probe_logits(AutoModelForCausalLM.from_pretrained(other), probe) - trained).abs().max() > 1e-2


@long_test  # (the every-run suite keeps the folded case; this is the base/ one)
def test_a_run_that_cannot_fold_keeps_the_model_it_trained_on(sft, data, tmp_path):
    """DoRA's magnitudes do not add: the merged SFT model is saved beside the adapter as base/, which the adapter
    names and which merge.py, generate.py and peft find there after the cache is deleted and the folder moved."""
    cache = tmp_path / "cache"
    run = dpo(str(sft / "adapter"), tmp_path / "dora", cache, "--dataset", str(data[1]), "--use-dora", "--lr", "5e-3")
    assert "this run's adapter is DoRA" in run.output
    assert json.loads((run.output_dir / "adapter" / "adapter_config.json").read_text())[
        "base_model_name_or_path"] == str(run.output_dir / "base")
    shutil.rmtree(cache)
    moved = tmp_path / "elsewhere" / "dora"
    moved.parent.mkdir()
    run.output_dir.rename(moved)
    trained = load_file(str(moved / "probe_logits.safetensors"))["logits"]
    found = loaded_three_ways(moved, moved / "base", tmp_path, auto_peft=False)  # AutoPeft: the old path
    for name, logits in found.items():
        assert torch.allclose(logits, trained, atol=1e-4), (name, (logits - trained).abs().max())


def test_a_dpo_run_on_chat_pairs_is_asked_as_it_was_trained(chat_dpo, monkeypatch, capsys):
    """run.json records the system turn every pair opened with, and generate.py puts a prompt after it in the
    tokens training gave a pair's prompt; --system gives another."""
    from transformers import AutoTokenizer

    run, _ = chat_dpo
    assert run.run_json()["system_prompt"] == SYSTEM
    saved = AutoTokenizer.from_pretrained(run.output_dir / "adapter")

    def training_prompt(system: str) -> list[int]:
        pair = {"prompt": [{"role": "system", "content": system}, {"role": "user", "content": "Sort: 3 5 4"}],
                "chosen": [{"role": "assistant", "content": "3 4 5"}], "rejected": [{"role": "assistant", "content": "x"}]}
        chosen, _ = pairs.pair_sides(pair, PAIRS_CONVERSATIONAL)
        (row,) = targets.tokenize_rows([chosen], saved, "messages")
        return row["input_ids"][:next(i for i, label in enumerate(row["labels"]) if label != IGNORE)].tolist()

    asked = []
    monkeypatch.setattr(generate, "answer", lambda model, tokenizer, ids, *rest: asked.append(ids) or "")
    assert generate.main([str(run.output_dir), "--prompt", "Sort: 3 5 4"]) == 0
    assert "system prompt: the training rows' own, from run.json" in capsys.readouterr().err
    assert generate.main([str(run.output_dir), "--prompt", "Sort: 3 5 4", "--system", "Be brief."]) == 0
    assert asked == [training_prompt(SYSTEM), training_prompt("Be brief.")]


def test_merge_writes_what_the_merge_flag_wrote(sft, tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "merge.py"), str(sft / "adapter"),
                           str(tmp_path / "merged")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    ours, flags = load_file(str(tmp_path / "merged" / "model.safetensors")), load_file(str(sft / "merged" / "model.safetensors"))
    assert ours.keys() == flags.keys() and all((ours[k] == flags[k]).all() for k in ours)
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    refused = subprocess.run([sys.executable, str(REPO / "scripts" / "merge.py"), str(sft / "merged"), str(tmp_path / "x")],
                             capture_output=True, text=True)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        f"error: {sft / 'merged'} is not a LoRA adapter folder (no adapter_config.json naming its base); give the "
        "adapter/ folder a recipe saved"]
