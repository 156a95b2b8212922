"""Answer prompts with a trained run (its model/, merged/, or adapter/ on its base model), or with any model.

    python scripts/generate.py outputs/quickstart --prompt "Sort: 3 1 2"
    printf 'Sort: 3 1 2\\nReverse: 1 2 3\\n' | python scripts/generate.py outputs/quickstart

    python scripts/generate.py outputs/chat --prompt "Sort: 3 1 2" --system "Answer in one line."
    python scripts/generate.py outputs/dpo/merged --prompt "Sort: 3 1 2"
    python scripts/generate.py outputs/vision --prompt "What colour is the shape?" --image photo.png

Each prompt is wrapped the way the run's training rows were (run.json's data_format): an
instruction in the "### Instruction: ... ### Response:" template, a chat message through the
saved tokenizer's chat template as training rendered its rows (so is a mixture of formats with chat in
it: `instruction+messages`, and preference pairs of chat messages), a prompt/completion or text prompt as it
is (--raw: always as it is). A folder inside a run's folder (merged/, a merge written there) is that run's.
A chat message follows a system turn when --system gives one, or by default when every training row
opened with the same one (run.json's system_prompt; --system '' leaves it out). A model without a run
(a transformers folder, a merge written elsewhere, a hub id) takes each prompt through its tokenizer's chat
template when it has one, else as typed, and says which. Greedy decoding by default; --temperature T > 0
samples (with --top-p, and --seed for answers that repeat). On a GPU when there is one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "recipes"))

import common.quiet  # noqa: E402,F401  (first: the recipes' filter of library notices)
from common.outputs.script_flags import generate_flags, generate_problem  # noqa: E402  (no torch)

if __name__ == "__main__":  # the flags read (--help, a mistyped one) before torch and transformers load: seconds
    generate_flags(__doc__).parse_args()

import torch  # noqa: E402

from common.data.formats import IGNORE, PROMPT_TEMPLATE, RowProblem  # noqa: E402
from common.data.images import prompt_inputs  # noqa: E402
from common.data.pairs import renders_chat, row_formats  # noqa: E402
from common.data.tokens import tokenize_row  # noqa: E402
from common.model import adapters  # noqa: E402

# Stands for the reply when a chat prompt is rendered as a training row: a word, as replies usually open, so
# that the prompt's last tokens split as they did before the replies training saw ("\n\n" before a word is
# two byte-level tokens, alone at the end one).
REPLY = "Answer"


def pick_artifact(output_dir: Path, wanted: str) -> Path:
    """model/ (full), merged/ or adapter/: the one asked for, or the first of them the run wrote."""
    names = ("model", "merged", "adapter") if wanted == "auto" else (wanted,)
    for name in names:
        if is_model_folder(output_dir / name):
            return output_dir / name
    raise ValueError(f"{output_dir} has no {' or '.join(f'{n}/' for n in names)}; train first, or pick another "
                     "with --artifact")


def is_model_folder(path: Path) -> bool:
    return (path / "config.json").is_file() or (path / adapters.ADAPTER_CONFIG).is_file()


def find_model(target: str, wanted: str) -> tuple[dict | None, str]:
    """(run.json of the run the model comes from, or None; the model: a folder, or a hub id). A run's folder
    gives its artifact (`wanted`); a model folder inside a run's folder is that run's."""
    path = Path(target).expanduser()
    if (path / "run.json").is_file():
        return json.loads((path / "run.json").read_text()), str(pick_artifact(path, wanted))
    if wanted != "auto":
        raise ValueError(f"--artifact picks what to load from a run's folder, and {target} holds no run.json: drop "
                         "--artifact, or pass the run's --output-dir")
    if is_model_folder(path):
        beside = path.parent / "run.json"
        return (json.loads(beside.read_text()) if beside.is_file() else None), str(path)
    if path.exists():
        raise ValueError(f"{target} holds no run.json, config.json or adapter_config.json; pass a run's --output-dir, "
                         "a model folder or a hub id")
    if target.startswith((".", "/", "~")) or target.count("/") > 1:  # a path, not a hub id's owner/name
        raise ValueError(f"{target} does not exist; pass a run's --output-dir, a model folder or a hub id")
    return None, target


def load_tokenizer(model: str):
    """The tokenizer saved with the model (an adapter's, else its base's)."""
    from transformers import AutoTokenizer

    base = adapters.adapter_base(model)
    own = base is None or (Path(model) / "tokenizer_config.json").is_file()
    return AutoTokenizer.from_pretrained(model if own else base)


def load(model: str, run: dict | None, device: str):
    """A model folder or hub id, loaded (a vision-language model's image-text-to-text class); an adapter goes on the
    base it names (found again beside it when the two were moved together), quantized as its run trained it
    (qlora.py's and dpo.py's --bits)."""
    from common.model.model_config import model_class, model_config_object, unquantized_modules

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    base = adapters.adapter_base(model)
    if base is None:
        return model_class(model_config_object(model)).from_pretrained(model, dtype=dtype).to(device)
    from peft import PeftModel

    from common.model.modeling import bits_config, keep_4bit_weights_unpacked_on_cpu

    bits = run["arguments"].get("bits") if run else None
    kwargs = dict(quantization_config=bits_config(bits, dtype, keep=unquantized_modules(base)),
                  device_map={"": device}) if bits else {}
    base_model = model_class(model_config_object(base)).from_pretrained(base, dtype=dtype, **kwargs)
    if bits and device == "cpu":
        keep_4bit_weights_unpacked_on_cpu(base_model)  # as the recipes do on CPU
    adapted = PeftModel.from_pretrained(base_model, model)
    return adapted if bits else adapted.to(device)


def wrapping(model: str, tokenizer, raw: bool) -> tuple[str, str]:
    """(the format prompts are taken as, a line saying so) for a model without a run: chat through the
    tokenizer's chat template when it has one, else text as typed."""
    if raw:
        return "text", "prompts: as typed (--raw)"
    if tokenizer.chat_template:
        return "messages", (f"prompts: through the chat template of {model} (no run.json to say how it was trained; "
                            "--raw gives them as typed)")
    return "text", f"prompts: as typed ({model} has no run.json, and its tokenizer no chat template)"


def is_chat(data_format: str, raw: bool) -> bool:
    """Whether prompts go through the chat template: a chat run's (or a mixture's with chat in it, or chat pairs'),
    unless --raw."""
    return renders_chat(data_format) and not raw


def prompt_ids(prompt: str, tokenizer, data_format: str, raw: bool, system: str | None = None,
               image_count: int = 0) -> list[int]:
    """The prompt's tokens as training tokenised such prompts. A chat message (after the system turn `system`
    when there is one) is rendered and tokenised as a training row by the training code, with a reply, and
    its tokens before the reply's first trained one are the prompt: the saved template (the plain default
    where there is none), the template's text before a reply as training saw it (not a generation prompt
    that differs, as DeepSeek-R1's `<think>`), its own BOS; `image_count` images' places before the message's
    text. Plain text with the tokenizer's own special tokens. RowProblem when the template refuses the
    conversation."""
    if is_chat(data_format, raw):
        turns = [{"role": "system", "content": system}] if system else []
        text = [{"type": "text", "text": prompt}]
        turns += [{"role": "user", "content": [{"type": "image"}] * image_count + text if image_count else prompt},
                  {"role": "assistant", "content": REPLY}]
        row = tokenize_row({"messages": turns}, tokenizer, "messages", images=bool(image_count))
        return row["input_ids"][:next(i for i, label in enumerate(row["labels"]) if label != IGNORE)]
    formats = row_formats(data_format)
    text = PROMPT_TEMPLATE.format(instruction=prompt) if formats == ["instruction"] and not raw else prompt
    return tokenizer(text)["input_ids"]


@torch.no_grad()
def answer(model, tokenizer, ids: list[int], max_new_tokens: int, device: str, temperature: float = 0.0,
           top_p: float = 1.0, processor=None, image_files=()) -> str:
    """The model's continuation of `ids`: greedy at temperature 0, else sampled (nucleus `top_p`). With a
    vision-language model's `processor`, `image_files` go with the prompt, their placeholders expanded."""
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p) if temperature > 0 else dict(do_sample=False)
    if processor is not None:
        inputs = prompt_inputs(processor, tokenizer.decode(ids), image_files).to(device)
    else:
        prompt = torch.tensor([ids], device=device)
        inputs = {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)}
    output = model.generate(**inputs, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, **sampling)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def system_prompt(asked: str | None, run: dict | None, data_format: str, raw: bool) -> str | None:
    """The system turn before each prompt: --system's (its '' none), else the one run.json recorded as every
    training row's, said in one line on stderr. ValueError when --system is given to prompts that are not chat."""
    if not is_chat(data_format, raw):
        if asked:
            how = ("--raw gives the prompts as typed" if raw else f"this run trained on {data_format} rows" if run
                   else "this model's tokenizer has no chat template")
            raise ValueError(f"--system applies to chat runs (their rows are `messages`); {how}: drop --system")
        return None
    if asked is not None:
        return asked or None
    recorded = (run or {}).get("system_prompt")
    if recorded:
        shown = recorded if len(recorded) <= 60 else recorded[:57] + "..."
        print(f"system prompt: the training rows' own, from run.json ({shown!r}); --system TEXT replaces it, "
              "--system '' leaves it out", file=sys.stderr, flush=True)
    return recorded or None


def main(argv=None) -> int:
    args = generate_flags(__doc__).parse_args(argv)
    problem = generate_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        run, model = find_model(args.model, args.artifact)
    except ValueError as refusal:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print("error: no prompt; pass --prompt TEXT, or give prompts on standard input, one per line", file=sys.stderr)
        return 2
    try:
        tokenizer = load_tokenizer(model)
    except OSError as failure:  # a hub id that is not there (or no network), a folder that is no model
        print(f"error: {model} does not load ({str(failure).splitlines()[0]}); pass a run's --output-dir, a model "
              "folder or a hub id", file=sys.stderr)
        return 2
    if run:
        data_format = run.get("data_format", "text")
    else:
        data_format, said = wrapping(model, tokenizer, args.raw)
        print(said, file=sys.stderr, flush=True)
    try:  # before the model loads
        system = system_prompt(args.system, run, data_format, args.raw)
    except ValueError as problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    from common.model.processors import load as load_processor

    processor = load_processor(model, tokenizer, config_from=adapters.adapter_base(model) or model)
    images = [str(Path(path).expanduser()) for path in args.image or ()]
    if images and (processor is None or not is_chat(data_format, args.raw)):
        why = f"{model} reads text only" if processor is None else "the prompts are not chat messages"
        print(f"error: --image needs a vision-language model's chat prompts; {why}: drop --image", file=sys.stderr)
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loaded = load(model, run, device)
    loaded.eval()
    if args.seed is not None:
        torch.manual_seed(args.seed)  # and CUDA's generators: the sampled answers repeat
    for prompt in prompts:
        try:
            ids = prompt_ids(prompt, tokenizer, data_format, args.raw, system, len(images))
        except RowProblem as problem:  # a template that takes no system turn, ...
            fix = "; leave the system turn out with --system ''" if system else ""
            print(f"error: {problem}{fix}", file=sys.stderr)
            return 2
        reply = answer(loaded, tokenizer, ids, args.max_new_tokens, device, args.temperature, args.top_p,
                       processor if images else None, images)
        print(f"{prompt!r} -> {reply!r}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
