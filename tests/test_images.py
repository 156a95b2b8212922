"""Images in the rows: vision-language models trained by the supervised recipes (recipes/common/data/images.py).

Tiny random families built offline (scripts/build_tiny_model.py --family): Qwen2-VL (dynamic resolution: an image's
tokens follow its size) and LLaVA (a fixed number of tokens an image) in every run, and Qwen3-VL, LLaVA-NeXT (tiles),
Gemma 3 (token types), SmolVLM (tiles named by tokens), Llama 3.2 Vision (cross-attention) and PaliGemma (a
prefix-LM its processor lays out) beside them, on the bundled vision task (data/vision: one shape, its colour or its
kind the answer)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import (REPO, TINY_MODEL, VISION, assert_the_refusal_ends_the_output, launch, long_test,  # noqa: F401
                      merged_beside_adapter, same_curve, vision_rows)

sys.path.insert(0, str(REPO / "recipes"))
from common.data import formats, images, targets, tokens  # noqa: E402
from common.data.formats import IGNORE  # noqa: E402
from common.launching.preflight import Refusal  # noqa: E402
from common.model import processors  # noqa: E402

FAMILIES = ("qwen2-vl", "llava")
MORE_FAMILIES = ("qwen3-vl", "llava-next", "gemma3", "smolvlm", "mllama")


def processing(model: Path):
    from common.model import modeling

    tokenizer = modeling.load_tokenizer(str(model))
    return tokenizer, processors.load(str(model), tokenizer)


# ---------------------------------------------------------------- what a row trains on


def test_image_placeholders_in_text_become_image_parts():
    assert formats.text_parts("<image>\nWhat is it?") == [{"type": "image"}, {"type": "text", "text": "\nWhat is it?"}]
    assert formats.text_parts("a <image> b <image>") == [{"type": "text", "text": "a "}, {"type": "image"},
                                                         {"type": "text", "text": " b "}, {"type": "image"}]
    assert formats.places([{"role": "user", "content": "<image><image> two"}]) == 2


def test_labels_follow_their_tokens_through_the_expansion():
    ids, labels = [5, 9, 7, 8, 2], [IGNORE, IGNORE, IGNORE, 8, 2]  # 9: an image's one placeholder
    expanded = [5, 9, 9, 9, 7, 8, 2]
    assert images.carried_labels(ids, labels, expanded).tolist() == [IGNORE] * 5 + [8, 2]
    with pytest.raises(ValueError, match="differ from its training tokens around a target"):
        images.carried_labels(ids, labels, [5, 9, 9, 7, 8, 3])


@pytest.mark.parametrize("family", FAMILIES + MORE_FAMILIES)
def test_a_collated_row_is_what_the_processor_gives_at_inference(family, vlm, tmp_path):
    """The batch's tokens are the processor's for the row's rendering and images; the targets are the reply and
    its end-of-turn token only (no image, prompt or padding token); rows of two image sizes in one batch."""
    import datasets
    import torch
    from PIL import Image

    tokenizer, processor = processing(vlm(family))
    wide = tmp_path / "wide.png"
    Image.open(VISION / "images" / "train_00001.png").resize((56, 28)).save(wide)
    rows = [{"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "red"}]}],
             "images": [str(path)]} for path in (VISION / "images" / "train_00002.png", wide)]
    table = datasets.Dataset.from_list(rows)
    tokenised, fmt = tokens.tokenize_counted(table, tokenizer, 512, images.ImageRows(processor, str(tmp_path)))
    kept = tokens.kept_rows(tokenised)
    batch = images.PadImageRows(processor)([kept[0], kept[1]])
    for i, row in enumerate(rows):
        text = tokenizer.apply_chat_template([formats.with_parts(turn) for turn in
                                             [{"role": t["role"], "content": "", "parts": t["content"]} for t in row["messages"]]],
                                            tokenize=False)
        alone = processor(text=[text], images=[Image.open(row["images"][0]).convert("RGB")], add_special_tokens=False,
                          return_tensors="pt")
        length = alone["input_ids"].shape[1]
        assert batch["input_ids"][i, :length].tolist() == alone["input_ids"][0].tolist()
        trained = batch["labels"][i][batch["labels"][i] != IGNORE].tolist()
        assert tokenizer.decode(trained).strip() == "red" + targets.ChatTemplate(tokenizer).end_marker(text, text.rindex("red")).group()
        assert (batch["labels"][i, length:] == IGNORE).all()
    assert batch["pixel_values"].shape[0] > 0 and torch.is_tensor(batch["attention_mask"])
    # A row's length as collated is what tokenising counted from the images' headers (its length check's figure).
    added = images.ImageRows(processor, str(tmp_path)).tokens([(56, 56), (28, 56)])
    assert batch["attention_mask"].sum(1).tolist() == [len(kept[i]["input_ids"]) + added[i] for i in range(2)]
    if family in ("qwen2-vl", "qwen3-vl", "llava-next", "smolvlm"):  # an image's tokens follow its size
        assert added[1] < added[0]


def test_a_row_too_long_with_its_images_is_dropped_and_counted(vlm, tmp_path):
    import datasets

    tokenizer, processor = processing(vlm("qwen2-vl"))
    rows = [json.loads(line) for line in vision_rows(tmp_path / "rows.jsonl", 4).read_text().splitlines()]
    tokenised, _ = tokens.tokenize_counted(datasets.Dataset.from_list(rows), tokenizer, 20,
                                           images.ImageRows(processor, str(tmp_path)))
    line = tokens.counted(tokenised)
    assert "4 dropped (too long for --max-length 20 with its images: 4)" in line
    assert "pass --max-length" in tokens.fixes(tokenised)[0]


def test_a_row_that_places_images_without_listing_any_is_dropped_and_counted(vlm, tmp_path):
    import datasets

    tokenizer, processor = processing(vlm("llava"))
    rows = [{"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "red"}]}
            for text in ("<image> What colour?", "No image here?")]
    tokenised, _ = tokens.tokenize_counted(datasets.Dataset.from_list(rows), tokenizer, 512,
                                           images.ImageRows(processor, str(tmp_path)))
    assert "1 used, 1 dropped (its turns place images but it lists none (an `images` column): 1)" in tokens.counted(tokenised)


@pytest.mark.parametrize("family, kept", [("qwen2-vl", ["model.visual", "lm_head"]),
                                          ("llava", ["model.vision_tower", "model.multi_modal_projector", "lm_head"])])
def test_qlora_keeps_the_vision_tower_and_projector_in_16_bits(family, kept, vlm):
    import torch
    from transformers import AutoModelForImageTextToText

    from common.model.model_config import bits_config, unquantized_modules

    assert unquantized_modules(str(vlm(family))) == kept
    model = AutoModelForImageTextToText.from_pretrained(vlm(family), device_map={"": "cpu"},
                                                        quantization_config=bits_config(4, torch.float32, keep=kept))
    linears = {name: type(module).__name__ for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    vision = [kind for name, kind in linears.items() if name.startswith(tuple(kept))]
    assert vision and set(vision) == {"Linear"}
    assert {kind for name, kind in linears.items() if not name.startswith(tuple(kept))} == {"Linear4bit"}


# ---------------------------------------------------------------- refused before the model loads


def image_row(image: str, text: str = "<image> What colour?") -> dict:
    return {"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "red"}], "images": [image]}


@pytest.mark.parametrize("row, refusal", [
    (image_row("missing.png"), "row 2: image missing.png does not exist (relative paths start at"),
    (image_row("images/train_00001.png", "<image><image> two?"),
     "row 2: its turns place 2 image(s) ({\"type\": \"image\"} parts or `<image>`) but `images` lists 1"),
    (image_row("https://example.com/a.png"), "row 2: image https://example.com/a.png is a URL, which the run does not download"),
    (image_row("not-an-image.txt"), "row 2: image not-an-image.txt cannot be read (UnidentifiedImageError"),
])
def test_unreadable_or_misplaced_images_are_refused_naming_the_row(row, refusal, vlm, tmp_path):
    """Found while rank 0 tokenises (each image's header read once, cached with the tokens); refused on every rank
    as it reads the tokenised rows, naming the row in the file, whichever split it fell in."""
    from common.data.checked_rows import load_sources

    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "train_00001.png").write_bytes((VISION / "images" / "train_00001.png").read_bytes())
    (tmp_path / "not-an-image.txt").write_text("text")
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(image_row("images/train_00001.png")) + "\n" + json.dumps(row) + "\n")
    (part,), _ = load_sources(str(data), 0, eval_spec=str(data))
    tokenizer, processor = processing(vlm("llava"))
    with pytest.raises(Refusal) as refused:
        tokens.tokenize_counted(part.rows, tokenizer, 512, images.ImageRows(processor, part.name))
    assert refusal in str(refused.value) and f"--dataset {data}, " in str(refused.value)


@pytest.mark.parametrize("model, packing, refusal", [
    ("text", False, "reads text only; give an image-text-to-text model (Qwen2-VL, LLaVA, ...: its config names a vision "
                    "part), or drop the images column"),
    ("qwen2-vl", True, "--packing does not keep a row's images with it; leave --packing out for rows with images"),
])
def test_image_rows_a_run_cannot_take_are_refused_before_tokenising(model, packing, refusal, vlm, tmp_path):
    from types import SimpleNamespace

    from common.data import preparation
    from common.model import modeling

    folder = str(TINY_MODEL) if model == "text" else str(vlm(model))
    tokenizer = modeling.load_tokenizer(folder)
    processor = None if model == "text" else processors.load(folder, tokenizer)
    data = str(vision_rows(tmp_path / "rows.jsonl", 8))
    args = SimpleNamespace(dataset=[data], eval_dataset=None, seed=0, columns=None, model=folder, packing=packing,
                           max_length=512)
    with pytest.raises(Refusal, match=re.escape(refusal)):
        preparation.prepare(None, tokenizer, args, None, processor)


@long_test  # ~10 s: the refusal above, through a launch
def test_image_rows_given_to_a_text_model_are_refused_in_one_line(tmp_path):
    done = launch("lora", tmp_path / "out", "--dataset", str(vision_rows(tmp_path / "rows.jsonl", 8)), "--max-steps", "1",
                  config="ddp")
    assert done.returncode != 0
    assert_the_refusal_ends_the_output(done.output, f"error: --dataset holds images, but --model {TINY_MODEL} reads text "
                                       "only; give an image-text-to-text model (Qwen2-VL, LLaVA, ...: its config names a "
                                       "vision part), or drop the images column")


@pytest.mark.parametrize("recipe, config, flags, refusal", [
    pytest.param("kto", "ddp", (), "which kto.py does not train yet; recipes/lora.py, qlora.py, full.py, dpo.py and "
                 "dpo_full.py do (docs/data.md#images)", marks=long_test),
    pytest.param("dpo", "ddp", ("--loss", "orpo"), "", marks=long_test),
    pytest.param("lora", "pipeline", ("--pipeline-stages", "2"), "which 2-stage pipeline x 1 replica(s) does not run yet; use "
     "accelerate_configs/ddp.yaml, fsdp.yaml or zero3.yaml (docs/data.md#images)", marks=long_test),
])
def test_what_images_cannot_run_yet_is_refused_before_loading(recipe, config, flags, refusal, vlm, tmp_path):
    model = vlm("qwen2-vl")
    data = REPO / "data" / "preferences" if recipe in ("dpo", "kto") else vision_rows(tmp_path / "rows.jsonl", 8)
    done = launch(recipe, tmp_path / "out", "--model", str(model), "--dataset", str(data), "--max-steps", "1",
                  *flags, config=config)
    assert done.returncode != 0
    if not refusal:  # ORPO
        refusal = (f"error: --loss orpo with a vision-language model ({model}) is not trained yet (its SFT term would "
                   "score the image tokens); use --loss sigmoid, ipo or simpo, or SFT first with recipes/lora.py")
        assert_the_refusal_ends_the_output(done.output, refusal)
        return
    assert_the_refusal_ends_the_output(done.output, f"error: --model {model} is a vision-language model, {refusal}")


def test_paligemma_preference_pairs_are_refused_naming_what_trains(vlm):
    """PaliGemma's prefix-LM layout trains with the supervised recipes; its pairs are refused from the config alone."""
    from types import SimpleNamespace

    from common.launching import preflight
    from common.launching.launch import DDP, Launch

    args = dict(model=str(vlm("paligemma")), trust_remote_code=False, train_vision_tower=False, train_projector=False)
    ddp = Launch(DDP, 2, False, 0, "no")
    preflight.check_vision_language(SimpleNamespace(recipe="lora", **args), ddp)
    with pytest.raises(Refusal, match="is PaliGemma, whose preference pairs dpo.py does not train yet .* SFT PaliGemma"):
        preflight.check_vision_language(SimpleNamespace(recipe="dpo", loss="sigmoid", **args), ddp)


# ---------------------------------------------------------------- PaliGemma: a prefix-LM, laid out by its processor


def paligemma_call(processor, row: dict, answer: bool = True):
    """PaliGemma's own fine-tuning (and inference) call on a row of the vision task, read from its turns: the image's
    token and the question as `text`, the answer as `suffix`."""
    from PIL import Image

    question = row["messages"][0]["content"][1]["text"]
    with Image.open(row["images"][0]) as image:
        return processor(text=[processor.image_token + question], images=[[image.convert("RGB")]],
                         suffix=[row["messages"][1]["content"][0]["text"]] if answer else None, return_tensors="pt")


def test_paligemma_rows_are_laid_out_as_its_processor_lays_them(vlm, tmp_path):
    """A collated PaliGemma row is what its processor's `suffix` path gives for the row's question and answer (the
    image's tokens, BOS, the question and "\\n", the answer and EOS): the same tokens, `token_type_ids` 1 on the
    answer alone (causal) and 0 on the image and question (attended both ways) and the padding, the answer and EOS
    the only targets; its length the one counted from the image's header. A prompt to generate from is the
    processor's own prompt, all 0."""
    import datasets

    tokenizer, processor = processing(vlm("paligemma"))
    rows = [json.loads(line) for line in vision_rows(tmp_path / "rows.jsonl", 2).read_text().splitlines()]
    rows[1]["messages"][0]["content"][1]["text"] = "What shape\nis it? Answer in one word."  # rows of two lengths
    tokenised, _ = tokens.tokenize_counted(datasets.Dataset.from_list(rows), tokenizer, 512,
                                           images.ImageRows(processor, str(tmp_path)))
    kept = tokens.kept_rows(tokenised)
    batch = images.PadImageRows(processor)([kept[0], kept[1]])
    lengths = batch["attention_mask"].sum(1).tolist()
    assert lengths[0] != lengths[1]
    for i, row in enumerate(rows):
        own = paligemma_call(processor, row)
        length = own["input_ids"].shape[1]
        assert lengths[i] == length == len(kept[i]["input_ids"]) + images.ImageRows(processor, "").tokens([(56, 56)])[0]
        for key in ("input_ids", "token_type_ids", "labels"):
            assert batch[key][i, :length].tolist() == own[key][0].tolist(), key
        assert (batch["labels"][i, length:] == IGNORE).all() and (batch["token_type_ids"][i, length:] == 0).all()
        assert tokenizer.decode(batch["labels"][i][batch["token_type_ids"][i] == 1]) == (
            row["messages"][1]["content"][0]["text"] + tokenizer.eos_token)
        first = kept[i]["labels"].index(next(label for label in kept[i]["labels"] if label != IGNORE))
        prompt = images.prompt_inputs(processor, tokenizer.decode(kept[i]["input_ids"][:first]), kept[i]["images"])
        asked = paligemma_call(processor, row, answer=False)
        assert "labels" not in prompt and not prompt["token_type_ids"].any()
        assert prompt["input_ids"].tolist() == asked["input_ids"].tolist()
    # a row without an image (PaliGemma's processor takes none): dropped, and counted with its reason
    question = rows[0]["messages"][0]["content"][1]
    text_only = {**rows[0], "images": [], "messages": [{"role": "user", "content": [question]}, rows[0]["messages"][1]]}
    both, _ = tokens.tokenize_counted(datasets.Dataset.from_list([rows[0], text_only]), tokenizer, 512,
                                      images.ImageRows(processor, str(tmp_path)))
    assert both[0]["dropped"] == "" and "an image in every prompt" in both[1]["dropped"], both[1]["dropped"]


@long_test  # ~15 s; every run keeps the rows' layout (above), equal to its processor's own
def test_paligemma_trains_under_ddp(vlm, tmp_path):
    """lora.py on PaliGemma rows under DDP: it trains, and its sample lines show the prompt in PaliGemma's layout."""
    data = vision_rows(tmp_path / "rows.jsonl", 8)
    done = launch("lora", tmp_path / "out", "--model", str(vlm("paligemma")), "--dataset", str(data),
                  "--eval-dataset", str(data), "--max-steps", "1", "--batch-size", "2", config="ddp")
    assert done.returncode == 0, done.output[-3000:]
    assert "replies end with </s>" in done.output
    assert "sample: '<image><s>What shape is it?\\n' [images: train_00001.png]" in done.output
    assert [m["step"] for m in done.metrics()] == [1]


# ---------------------------------------------------------------- the same numbers as TRL and as one process


STEPS = ["--max-steps", "3", "--grad-accum", "2", "--lr", "5e-3"]
NO_DROPOUT = {"lora": ["--lora-dropout", "0"], "qlora": ["--lora-dropout", "0"], "full": []}  # each rank its own masks


@pytest.fixture(scope="module")
def one_process(vlm, tmp_path_factory):
    """(family, recipe) -> (the one-process run, its rows): 3 steps of 16 rows (8 x 2 micro-batches), every step the
    whole dataset (--eval-dataset the same rows: none held out), so that any order of the rows gives its numbers."""
    runs = {}

    def run(family: str, recipe: str = "lora"):
        if (family, recipe) not in runs:
            folder = tmp_path_factory.mktemp(f"one-{family}-{recipe}")
            data = vision_rows(folder / "rows.jsonl", 16)
            done = launch(recipe, folder / "out", "--model", str(vlm(family)), "--dataset", str(data), "--eval-dataset",
                          str(data), *STEPS, *NO_DROPOUT[recipe], "--batch-size", "8", processes=1)
            assert done.returncode == 0, done.output[-3000:]
            runs[family, recipe] = (done, data)
        return runs[family, recipe]

    return run


# Not mllama: TRL's collator builds its cross_attention_mask from the prompt alone and the model refuses the longer
# prompt + completion (its runs are checked against one process below).
@pytest.mark.parametrize("family", [FAMILIES[0], *[pytest.param(family, marks=long_test)
                                                    for family in FAMILIES[1:] + MORE_FAMILIES[:-1] + ("paligemma",)]])
def test_lora_equals_trls_sft_trainer_on_image_rows(family, one_process, vlm, tmp_path):
    """The loss and gradient norm of 3 steps equal TRL's SFTTrainer on the same rows, model and adapter (float32,
    one process, accumulation 2)."""
    ours, data = one_process(family)
    # transformers marks Qwen3-VL's class accepts_loss_kwargs=False: TRL's Trainer then averages the micro-batches'
    # means, not the mean over the global batch's targets, so its side takes the 16 rows as one micro-batch.
    shape = ["--batch-size", "16", "--grad-accum", "1"] if family == "qwen3-vl" else ["--batch-size", "8"]
    flags = ["--model", str(vlm(family)), "--dataset", str(data), *STEPS, *NO_DROPOUT["lora"], *shape]
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "measure" / "trl_vlm_worker.py"), "--output-dir",
                           str(tmp_path / "trl"), *flags], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    same_curve(ours.metrics(), [json.loads(line) for line in (tmp_path / "trl" / "metrics.jsonl").read_text().splitlines()])


@pytest.mark.parametrize("family, recipe, config", [
    ("qwen2-vl", "lora", "ddp"),
    pytest.param("llava", "lora", "zero3", marks=long_test),
    pytest.param("qwen2-vl", "lora", "fsdp", marks=long_test),
    pytest.param("qwen2-vl", "lora", "zero3", marks=long_test),
    pytest.param("llava", "lora", "ddp", marks=long_test),
    pytest.param("llava", "lora", "fsdp", marks=long_test),
    pytest.param("qwen2-vl", "full", "fsdp", marks=long_test),
    pytest.param("qwen2-vl", "full", "zero3", marks=long_test),
    pytest.param("qwen2-vl", "qlora", "ddp", marks=long_test),
    pytest.param("llava", "lora", "zero3_offload", marks=long_test),
    pytest.param("gemma3", "lora", "zero3", marks=long_test),
    pytest.param("smolvlm", "lora", "fsdp", marks=long_test),
    pytest.param("mllama", "lora", "ddp", marks=long_test),
    pytest.param("llava-next", "full", "zero3", marks=long_test),
    pytest.param("qwen3-vl", "lora", "fsdp", marks=long_test),
    pytest.param("paligemma", "lora", "ddp", marks=long_test),
    pytest.param("paligemma", "lora", "zero3", marks=long_test),
    pytest.param("paligemma", "full", "ddp", marks=long_test),
    pytest.param("paligemma", "qlora", "ddp", marks=long_test),
    pytest.param("paligemma", "full", "fsdp", marks=long_test),  # (ZeRO-3's norm: 1.05e-5 of it apart, measured)
])
def test_every_strategy_trains_the_one_process_curve(family, recipe, config, one_process, vlm, tmp_path):
    """2 processes x 4 rows x 2 micro-batches: the same loss and gradient norm as one process, step by step."""
    single, data = one_process(family, recipe)
    done = launch(recipe, tmp_path / "out", "--model", str(vlm(family)), "--dataset", str(data), "--eval-dataset",
                  str(data), *STEPS, *NO_DROPOUT[recipe], "--batch-size", "4", config=config)
    assert done.returncode == 0, done.output[-3000:]
    assert done.run_json()["num_processes"] == 2
    # every weight sharded: PaliGemma's norm (~2.5) sums its shards in another order (7e-6 of it, measured)
    same_curve(done.metrics(), single.metrics(), relative_norm=(family, recipe) == ("paligemma", "full"))


@pytest.mark.parametrize("config, processes, batch", [pytest.param("zero3", 2, "4", marks=long_test),
                                                      pytest.param(None, 1, "8", marks=long_test)])
def test_a_checkpoint_of_image_rows_continues_under_another_strategy(config, processes, batch, vlm, tmp_path):
    """4 steps under DDP (2 processes x 4 rows x 2 micro-batches), a checkpoint at step 2; continued from it under
    ZeRO-3, or by one process taking 8 rows a micro-batch (the same global batch), steps 3 and 4 are the
    uninterrupted run's (the loader skips the batches already seen, images and all)."""
    import shutil

    model, data = str(vlm("qwen2-vl")), vision_rows(tmp_path / "rows.jsonl", 64)
    flags = ["--model", model, "--dataset", str(data), "--max-steps", "4", "--save-every", "2", "--grad-accum", "2",
             "--lr", "5e-3", "--lora-dropout", "0"]
    whole = launch("lora", tmp_path / "whole", *flags, "--batch-size", "4", config="ddp")
    assert whole.returncode == 0, whole.output[-3000:]
    shutil.copytree(tmp_path / "whole" / "checkpoints" / "step-2", tmp_path / "resumed" / "checkpoints" / "step-2")
    resumed = launch("lora", tmp_path / "resumed", *flags, "--batch-size", batch, "--resume", "auto", config=config,
                     processes=processes)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert [m["step"] for m in resumed.metrics()] == [3, 4]
    for mine, uninterrupted in zip(resumed.metrics(), whole.metrics()[2:]):
        assert mine["loss"] == pytest.approx(uninterrupted["loss"], abs=1e-5), (mine, uninterrupted)
        assert mine["grad_norm"] == pytest.approx(uninterrupted["grad_norm"], abs=1e-5), (mine, uninterrupted)


# ---------------------------------------------------------------- what a run leaves


@long_test  # ~20 s: a launch and three loads
def test_merged_model_and_adapter_load_as_image_text_to_text_and_answer_as_trained(vlm, tmp_path):
    """lora.py --merge on LLaVA under DDP: merged/ loads with AutoModelForImageTextToText and AutoProcessor, its
    logits on image rows equal the adapter on its base (PeftModel), which the run trained; the sample lines name
    the rows' images; the vision tower is untouched."""
    import torch
    from transformers import AutoModelForImageTextToText

    model = vlm("llava")
    data = vision_rows(tmp_path / "rows.jsonl", 64)
    done = launch("lora", tmp_path / "out", "--model", str(model), "--dataset", str(data), "--max-steps", "4",
                  "--batch-size", "4", "--lr", "5e-2", "--merge", config="ddp")
    assert done.returncode == 0, done.output[-3000:]
    assert "[images: train_000" in done.output
    merged, adapted, inputs = merged_beside_adapter(model, tmp_path / "out", data)
    untrained = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(**inputs).logits, adapted(**inputs).logits, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(merged(**inputs).logits, untrained(**inputs).logits, atol=1e-4)
    before = dict(untrained.named_parameters())
    vision = [(name, tensor) for name, tensor in merged.named_parameters() if "vision_tower" in name]
    assert vision and all(torch.equal(tensor, before[name]) for name, tensor in vision)


@long_test  # ~40 s: a launch, generate.py and three loads
def test_paligemma_merged_answers_as_trained_with_its_own_processor(vlm, tmp_path):
    """lora.py --merge on PaliGemma under DDP: merged/ loads with AutoModelForImageTextToText and AutoProcessor
    (PaliGemma's), and on the inputs its processor makes for a row (`suffix`: `token_type_ids` marking the answer)
    its logits equal the adapter on its base, which the run trained; asked the row's question the way PaliGemma
    is asked (`token_type_ids` 0 on the whole prompt), the adapter answers what the run's sample line answered, and
    merged/ what scripts/generate.py --image answers with it."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = vlm("paligemma")
    data = vision_rows(tmp_path / "rows.jsonl", 64)
    done = launch("lora", tmp_path / "out", "--model", str(model), "--dataset", str(data), "--eval-dataset",
                  str(data), "--max-steps", "4", "--batch-size", "4", "--lr", "5e-2", "--merge", config="ddp")
    assert done.returncode == 0, done.output[-3000:]
    merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "out" / "merged", dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(tmp_path / "out" / "merged")
    adapted = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32),
                                        tmp_path / "out" / "adapter").eval()
    untrained = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32).eval()
    row = json.loads(data.read_text().splitlines()[0])
    trained = {key: value for key, value in paligemma_call(processor, row).items() if key != "labels"}
    asked = {key: value for key, value in paligemma_call(processor, row, answer=False).items() if key != "labels"}
    sample = json.loads((tmp_path / "out" / "samples.jsonl").read_text().splitlines()[0])
    with torch.no_grad():
        torch.testing.assert_close(merged(**trained).logits, adapted(**trained).logits, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(merged(**trained).logits, untrained(**trained).logits, atol=1e-4)
        answers = {name: processor.decode(generator.generate(**asked, max_new_tokens=32, do_sample=False)[
            0, asked["input_ids"].shape[1]:], skip_special_tokens=True) for name, generator in
            (("adapter", adapted), ("merged", merged))}
    assert answers["adapter"] == sample["generated"]
    question = row["messages"][0]["content"][1]["text"]
    generated = subprocess.run([sys.executable, str(REPO / "scripts" / "generate.py"), str(tmp_path / "out"),
                                "--artifact", "merged", "--prompt", question, "--image", row["images"][0],
                                "--max-new-tokens", "32"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert generated.returncode == 0, generated.stderr[-3000:]
    assert generated.stdout.strip() == f"{question!r} -> {answers['merged']!r}"


# ---------------------------------------------------------------- preference pairs with images (recipes/dpo.py)

PAIRS = REPO / "data" / "vision-pairs"
DPO_STEPS = ["--max-steps", "3", "--grad-accum", "2", "--lr", "5e-3", "--lora-dropout", "0"]


def vision_pairs(path: Path, count: int) -> Path:
    """The first `count` bundled vision pairs, their images by absolute path, written to `path`."""
    rows = [json.loads(line) for line in (PAIRS / "train.jsonl").read_text().splitlines()[:count]]
    for row in rows:
        row["images"] = [str((PAIRS / name).resolve()) for name in row["images"]]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_pair_with_images_collates_both_sides_with_its_images(vlm, tmp_path):
    """Each side of a pair is its rendering with the pair's images, expanded by the processor: the chosen sides, then
    the rejected sides, each trained on its reply alone; pairs whose replies place images are dropped and counted."""
    import datasets

    from common.data import batches, preferences
    from common.data.formats import PAIRS_CONVERSATIONAL

    tokenizer, processor = processing(vlm("qwen2-vl"))
    rows = [json.loads(line) for line in vision_pairs(tmp_path / "pairs.jsonl", 2).read_text().splitlines()]
    placing = dict(rows[0], rejected=[{"role": "assistant", "content": [{"type": "image"}, {"type": "text", "text": "red"}]}])
    pairs = preferences.tokenize_pairs(datasets.Dataset.from_list(rows + [placing]), PAIRS_CONVERSATIONAL, tokenizer,
                                       512, images.ImageRows(processor, str(tmp_path)))
    assert pairs["dropped"][2].startswith("its chosen and rejected replies place different images")
    kept = pairs.select([0, 1])
    batch = batches.PadPairs(tokenizer.pad_token_id, pad_rows=images.PadImageRows(processor))([kept[0], kept[1]])
    assert batch["input_ids"].shape[0] == 4 and batch["image_grid_thw"].shape[0] == 4  # each pair's image, twice
    replies = [tokenizer.decode(labels[labels != IGNORE]) for labels in batch["labels"]]
    expected = [row[side][0]["content"][0]["text"] + "<|im_end|>" for side in ("chosen", "rejected") for row in rows]
    assert replies == expected
    assert set(images.model_inputs(batch)) == {"pixel_values", "image_grid_thw", "mm_token_type_ids"}


@pytest.mark.parametrize("family", [pytest.param("qwen2-vl", marks=long_test), pytest.param("gemma3", marks=long_test)])
def test_dpo_on_pairs_with_images_equals_trls_dpo_trainer(family, vlm, tmp_path):
    """recipes/dpo.py (8 pairs x 2 micro-batches) and TRL 1.16's DPOTrainer (the 16 pairs at once) on the same pairs,
    model and adapter: the loss, log-probabilities and rewards of 3 steps (1e-5)."""
    model, data = str(vlm(family)), vision_pairs(tmp_path / "pairs.jsonl", 16)
    ours = launch("dpo", tmp_path / "ours", "--model", model, "--dataset", str(data), "--eval-dataset", str(data),
                  *DPO_STEPS, "--batch-size", "8", processes=1)
    assert ours.returncode == 0, ours.output[-3000:]
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "measure" / "trl_dpo_worker.py"), "--model", model,
                           "--dataset", str(data), "--output-dir", str(tmp_path / "trl"), *DPO_STEPS, "--batch-size",
                           "16", "--grad-accum", "1"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    theirs = [json.loads(line) for line in (tmp_path / "trl" / "metrics.jsonl").read_text().splitlines()]
    assert len(ours.metrics()) == len(theirs) == 3
    for mine, other in zip(ours.metrics(), theirs):
        for name in ("loss", "logps/chosen", "logps/rejected", "rewards/margins"):
            assert mine[name] == pytest.approx(other[name], abs=1e-5), (name, mine, other)
    assert ours.metrics()[-1]["rewards/margins"] > 0


@pytest.mark.parametrize("recipe, family, config", [pytest.param("dpo", "qwen2-vl", "ddp", marks=long_test),
                                                    pytest.param("dpo", "qwen2-vl", "zero3", marks=long_test),
                                                    pytest.param("dpo_full", "gemma3", "fsdp", marks=long_test)])
def test_dpo_on_pairs_with_images_trains_the_one_process_curve(recipe, family, config, vlm, tmp_path):
    """2 processes x 4 pairs x 2 micro-batches give the one-process loss and gradient norm, step by step."""
    model, data = str(vlm(family)), vision_pairs(tmp_path / "pairs.jsonl", 16)
    flags = ["--model", model, "--dataset", str(data), "--eval-dataset", str(data), *DPO_STEPS[:-2]]
    flags += ["--lora-dropout", "0"] if recipe == "dpo" else ["--lr", "1e-3"]
    single = launch(recipe, tmp_path / "one", *flags, "--batch-size", "8", processes=1)
    assert single.returncode == 0, single.output[-3000:]
    done = launch(recipe, tmp_path / "two", *flags, "--batch-size", "4", config=config)
    assert done.returncode == 0, done.output[-3000:]
    same_curve(done.metrics(), single.metrics())


@long_test  # ~25 s: a launch
def test_a_projector_trained_whole_is_read_from_the_files_shard_by_shard(vlm, tmp_path):
    """fsdp.yaml with SmolVLM (whose files each process reads its shards from) and --train-projector: both copies
    of the projector peft keeps (the original, the trained one) are filled from the files, and the run trains."""
    model, data = str(vlm("smolvlm")), vision_rows(tmp_path / "rows.jsonl", 8)
    done = launch("lora", tmp_path / "out", "--model", model, "--dataset", str(data), "--eval-dataset", str(data),
                  "--max-steps", "2", "--batch-size", "2", "--train-projector", config="fsdp")
    assert done.returncode == 0, done.output[-3000:]
    assert "each process reads its shards from the files" in done.output
    assert [m["step"] for m in done.metrics()] == [1, 2]
