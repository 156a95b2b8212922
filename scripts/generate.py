"""Answer prompts with a trained run: its model/, merged/, or adapter/ on its base model.

    python scripts/generate.py outputs/quickstart --prompt "Sort: 3 1 2"
    printf 'Sort: 3 1 2\\nReverse: 1 2 3\\n' | python scripts/generate.py outputs/quickstart

    python scripts/generate.py outputs/chat --prompt "Sort: 3 1 2" --system "Answer in one line."

Each prompt is wrapped the way the run's training rows were (run.json's data_format): an
instruction in the "### Instruction: ... ### Response:" template, a chat message through the
saved tokenizer's chat template as training rendered its rows (so is a mixture of formats with chat in
it: `instruction+messages`), a prompt/completion or text prompt as it is (--raw: always as it is).
A chat message follows a system turn when --system gives one, or by default when every training row
opened with the same one (run.json's system_prompt; --system '' leaves it out). Greedy decoding by
default; --temperature T > 0 samples (with --top-p, and --seed for answers that repeat). On a GPU when
there is one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "recipes"))

import common.quiet  # noqa: E402,F401  (first: the recipes' filter of library notices)
import torch  # noqa: E402

from common.data.formats import IGNORE, PROMPT_TEMPLATE, RowProblem  # noqa: E402
from common.data.tokens import tokenize_row  # noqa: E402

# Stands for the reply when a chat prompt is rendered as a training row: a word, as replies usually open, so
# that the prompt's last tokens split as they did before the replies training saw ("\n\n" before a word is
# two byte-level tokens, alone at the end one).
REPLY = "Answer"


def pick_artifact(output_dir: Path, wanted: str) -> Path:
    """model/ (full), merged/ or adapter/: the one asked for, or the first of them the run wrote."""
    names = ("model", "merged", "adapter") if wanted == "auto" else (wanted,)
    for name in names:
        if (output_dir / name / "config.json").is_file() or (output_dir / name / "adapter_config.json").is_file():
            return output_dir / name
    raise SystemExit(f"error: {output_dir} has no {' or '.join(f'{n}/' for n in names)}; "
                     "train first, or pick another with --artifact")


def load(output_dir: Path, artifact: Path, device: str):
    """(model, tokenizer) of the artifact; an adapter goes on its base as the run trained it (4-bit for QLoRA)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = json.loads((output_dir / "run.json").read_text())
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(artifact)
    if artifact.name != "adapter":
        return AutoModelForCausalLM.from_pretrained(artifact, dtype=dtype).to(device), tokenizer, run
    from peft import PeftModel

    from common.model.modeling import bits_config, keep_4bit_weights_unpacked_on_cpu

    bits = run["arguments"].get("bits") if run["recipe"] == "qlora" else None
    kwargs = dict(quantization_config=bits_config(bits, dtype), device_map={"": device}) if bits else {}
    base = AutoModelForCausalLM.from_pretrained(run["base_model"], dtype=dtype, **kwargs)
    if bits and device == "cpu":
        keep_4bit_weights_unpacked_on_cpu(base)  # as the recipes do on CPU
    model = PeftModel.from_pretrained(base, artifact)
    return (model if bits else model.to(device)), tokenizer, run


def is_chat(data_format: str, raw: bool) -> bool:
    """Whether prompts go through the chat template: a chat run's (or a mixture's with chat in it), unless --raw."""
    return "messages" in data_format.split("+") and not raw


def prompt_ids(prompt: str, tokenizer, data_format: str, raw: bool, system: str | None = None) -> list[int]:
    """The prompt's tokens as training tokenised such prompts. A chat message (after the system turn `system`
    when there is one) is rendered and tokenised as a training row by the training code, with a reply, and
    its tokens before the reply's first trained one are the prompt: the saved template (the plain default
    where there is none), the template's text before a reply as training saw it (not a generation prompt
    that differs, as DeepSeek-R1's `<think>`), its own BOS. Plain text with the tokenizer's own special
    tokens. RowProblem when the template refuses the conversation."""
    if is_chat(data_format, raw):
        turns = [{"role": "system", "content": system}] if system else []
        turns += [{"role": "user", "content": prompt}, {"role": "assistant", "content": REPLY}]
        row = tokenize_row({"messages": turns}, tokenizer, "messages")
        return row["input_ids"][:next(i for i, label in enumerate(row["labels"]) if label != IGNORE)]
    formats = data_format.split("+")
    text = PROMPT_TEMPLATE.format(instruction=prompt) if formats == ["instruction"] and not raw else prompt
    return tokenizer(text)["input_ids"]


@torch.no_grad()
def answer(model, tokenizer, ids: list[int], max_new_tokens: int, device: str, temperature: float = 0.0,
           top_p: float = 1.0) -> str:
    """The model's continuation of `ids`: greedy at temperature 0, else sampled (nucleus `top_p`)."""
    prompt = torch.tensor([ids], device=device)
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p) if temperature > 0 else dict(do_sample=False)
    output = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                            pad_token_id=tokenizer.pad_token_id, **sampling)
    return tokenizer.decode(output[0, len(ids):], skip_special_tokens=True)


def system_prompt(asked: str | None, run: dict, data_format: str, raw: bool) -> str | None:
    """The system turn before each prompt: --system's (its '' none), else the one run.json recorded as every
    training row's, said in one line on stderr. ValueError when --system is given to a run that is not chat."""
    if not is_chat(data_format, raw):
        if asked:
            how = "--raw gives the prompts as typed" if raw else f"this run trained on {data_format} rows"
            raise ValueError(f"--system applies to chat runs (their rows are `messages`); {how}: drop --system")
        return None
    if asked is not None:
        return asked or None
    recorded = run.get("system_prompt")
    if recorded:
        shown = recorded if len(recorded) <= 60 else recorded[:57] + "..."
        print(f"system prompt: the training rows' own, from run.json ({shown!r}); --system TEXT replaces it, "
              "--system '' leaves it out", file=sys.stderr, flush=True)
    return recorded or None


def main(argv=None) -> int:
    summary, _, details = __doc__.partition("\n")
    parser = argparse.ArgumentParser(description=summary, epilog=details,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output_dir", type=Path, help="a recipe's --output-dir (with run.json)")
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable); default: one per line of stdin")
    parser.add_argument("--artifact", choices=("auto", "model", "merged", "adapter"), default="auto",
                        help="what to load (default: auto, the first of model/, merged/, adapter/ the run wrote)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="(default: 64)")
    parser.add_argument("--raw", action="store_true", help="give the prompts to the model exactly as typed")
    parser.add_argument("--system", default=None, metavar="TEXT",
                        help="a chat run: the system turn before each prompt (default: the one every training row "
                             "opened with, when run.json recorded one; '': none)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy (default); above 0: sample at this temperature")
    parser.add_argument("--top-p", type=float, default=1.0, help="sampling: keep the smallest set of tokens whose "
                        "probabilities add up to P (default: 1.0, all)")
    parser.add_argument("--seed", type=int, default=None, help="sampling: the same seed gives the same answers")
    args = parser.parse_args(argv)
    problem = ("--max-new-tokens must be >= 1" if args.max_new_tokens < 1 else
               "--temperature must be >= 0 (0: greedy)" if args.temperature < 0 else
               "--top-p must be in (0, 1]" if not 0 < args.top_p <= 1 else
               "--top-p and --seed apply to sampling: add --temperature T > 0" if args.temperature == 0 and (
                   args.top_p != 1.0 or args.seed is not None) else None)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if not (args.output_dir / "run.json").is_file():
        print(f"error: {args.output_dir} holds no run.json; pass the --output-dir of a finished run", file=sys.stderr)
        return 2
    try:
        artifact = pick_artifact(args.output_dir, args.artifact)
    except SystemExit as refusal:
        print(refusal, file=sys.stderr)
        return 2
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print("error: no prompt; pass --prompt TEXT, or give prompts on standard input, one per line", file=sys.stderr)
        return 2
    run = json.loads((args.output_dir / "run.json").read_text())
    data_format = run.get("data_format", "text")
    try:  # before the model loads
        system = system_prompt(args.system, run, data_format, args.raw)
    except ValueError as problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer, run = load(args.output_dir, artifact, device)
    model.eval()
    if args.seed is not None:
        torch.manual_seed(args.seed)  # and CUDA's generators: the sampled answers repeat
    for prompt in prompts:
        try:
            ids = prompt_ids(prompt, tokenizer, data_format, args.raw, system)
        except RowProblem as problem:  # a template that takes no system turn, ...
            fix = "; leave the system turn out with --system ''" if system else ""
            print(f"error: {problem}{fix}", file=sys.stderr)
            return 2
        reply = answer(model, tokenizer, ids, args.max_new_tokens, device, args.temperature, args.top_p)
        print(f"{prompt!r} -> {reply!r}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
