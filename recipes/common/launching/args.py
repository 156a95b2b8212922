"""The command-line flags every recipe shares, so `--help` reads the same on all three."""

from __future__ import annotations

import argparse
import sys

from ..paths import DEFAULT_MODEL
from ..refusal import refuse
from ..strict_reading import DuplicateKey, StrictLoader
from .settled import Run

AUTO = "auto"


class IntOrAuto:
    """The type of --batch-size: an integer (its range is checked with the other flags'), or `auto`."""

    __name__ = "number or `auto`"  # argparse and --config name the type by it: "not a valid number or `auto`"

    def __call__(self, value):
        return AUTO if str(value).strip().lower() == AUTO else int(value)


int_or_auto = IntOrAuto()


class HelpWithDefaults(argparse.RawDescriptionHelpFormatter):
    """The recipe's docstring as written, and every flag's default after its help (unless the help
    already says it, the flag is a switch that is off unless given, or it has none)."""

    def _get_help_string(self, action) -> str:
        help_text = action.help or ""
        if "default" in help_text or action.default in (argparse.SUPPRESS, None) or action.default is False:
            return help_text
        return f"{help_text} (default: %(default)s)".lstrip()


class OneLineErrors(argparse.ArgumentParser):
    """A mistyped flag is one `error:` line naming the fix, with the closest flags (argparse would print the
    whole usage block, once per rank)."""

    def error(self, message: str):
        if message.startswith("unrecognized arguments: "):
            flags = {action.dest: action for action in self._actions if action.option_strings and action.dest != "help"}
            for arg in message.split(": ", 1)[1].split():
                name = arg.split("=", 1)[0]
                if name.startswith("-") and (hint := closest_flag(name, flags, "--")):
                    message += f"; {name}: {hint}"
        refuse(f"{message}; see --help")


def closest_flag(name: str, flags: dict, prefix: str = "") -> str:
    """For a name that is no flag of the recipe: what the recipe calls it (another project's name for it), or
    the closest flag; "" when nothing is close. `prefix` is how the answer is written (`--lr` or `lr`)."""
    import difflib

    dest = name.lstrip("-").replace("-", "_")
    if dest in VISION_FLAGS:
        return "only recipes/lora.py, qlora.py and full.py train a vision tower or projector (docs/data.md#images)"
    ours = OTHER_NAMES.get(dest)
    if ours in flags:
        return (f"this recipe calls it `{prefix}{ours.replace('_', '-')}`"
                + (" (a fraction of the steps)" if dest == "warmup_steps" else ""))
    close = [f"`{prefix}{flag.replace('_', '-')}`" for flag in difflib.get_close_matches(dest, sorted(flags), n=2,
                                                                                         cutoff=0.6)]
    return f"did you mean {' or '.join(close)}?" if close else ""


SAVE_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # --save-dtype -> torch's name


def recipe_parser(doc: str) -> argparse.ArgumentParser:
    summary, _, details = doc.partition("\n")
    parser = OneLineErrors(
        # no abbreviations: which flags were typed must be known exactly (see `parse_args`)
        description=summary, epilog=details, formatter_class=HelpWithDefaults, allow_abbrev=False
    )
    add = parser.add_argument
    add("--model", default=str(DEFAULT_MODEL),
        help="hub id or local folder (default: the bundled tiny Llama, built on first use)")
    add("--dataset", action="append", default=None, metavar="DATASET[:WEIGHT]",
        help="hub id, local folder, or .jsonl/.json/.parquet/.txt/.csv/.tsv file (also gzipped); give it several "
             "times to train on a mixture, each with an optional weight: the share of its rows used (0.3: a random "
             "30%%, 2: each row twice) (default: the bundled data/)")
    add("--eval-dataset", default=None,
        help="the evaluation rows, from a file, folder or hub id as --dataset takes them; all of --dataset's "
             "training rows then train (default: --dataset's eval/validation/test split, else 5%% of it held out)")
    add("--columns", default=None,
        help="rename dataset columns to a known format, e.g. instruction=question,response=answer "
             "(default: the columns as they are)")
    add("--chat-template", default=None, metavar="FILE",
        help="a Jinja chat template for chat rows, saved with the tokenizer (default: the model's own; a plain "
             "one for a model without)")
    add("--packing", action="store_true",
        help="pack several rows into each --max-length sequence (attention stays within each row)")
    add("--output-dir", default="outputs/run", help="where run.json, metrics, checkpoints and the result go")
    add("--epochs", type=float, default=1, help="passes over the training data (ignored when --max-steps > 0)")
    add("--max-steps", type=int, default=0, help="optimizer steps to run; 0 = use --epochs")
    add("--batch-size", type=int_or_auto, default=8,
        help="micro-batch size per process, or `auto`: the largest the memory plan says fits")
    add("--grad-accum", type=int, default=1, help="micro-batches accumulated per optimizer step")
    add("--global-batch-size", type=int, default=None,
        help="sequences per optimizer step over all processes; sets --grad-accum to keep it "
             "(default: --batch-size x --grad-accum x processes)")
    add("--lr", type=float, default=2e-4, help="peak learning rate (linear warm-up, cosine decay)")
    add("--warmup-ratio", type=float, default=0.03, help="fraction of the steps spent warming up")
    add("--weight-decay", type=float, default=0.0, help="AdamW's decoupled weight decay")
    add("--max-grad-norm", type=float, default=1.0, help="gradient clipping, the same on every strategy")
    add("--max-length", type=int, default=512,
        help="tokens per example; a longer row trains on its first --max-length tokens, and one with no "
             "target left is dropped (both counted at start-up)")
    add("--seed", type=int, default=42, help="model init of new weights, dropout, data order")
    add("--eval-every", type=int, default=0, help="evaluate every N steps (0: only at the end)")
    add("--eval-on-start", action=argparse.BooleanOptionalAction, default=True,
        help="evaluate the model as loaded before the first step (step 0 in metrics.jsonl, --eval-tasks too), so "
             "the run shows what it changed; --no-eval-on-start skips it")
    add("--eval-tasks", default=None, metavar="TASKS",
        help="lm-evaluation-harness tasks scored with the eval rows: task or group names (arc_easy,hellaswag), task "
             "YAML files or folders of them (data/eval_tasks), comma-separated; needs `pip install lm-eval==0.4.13`")
    add("--eval-limit", type=int, default=None, metavar="N",
        help="score only the first N rows of each --eval-tasks task (default: all)")
    add("--eval-raw-prompts", action="store_true",
        help="score --eval-tasks on the tasks' raw text (default: as the run trained: a run on chat rows through "
             "its chat template and system prompt)")
    add("--save-every", type=int, default=0,
        help="checkpoint every N steps (0: none, except when SIGTERM or Ctrl-C stops the run)")
    add("--save-total-limit", type=int, default=0, help="keep only the newest N checkpoints (0: keep all)")
    add("--resume", default=None, help="a checkpoint folder to resume from, or `auto` for the newest "
        "(default: a fresh run; an elastic restart resumes by itself)")
    add("--gradient-checkpointing", nargs="?", type=int, const=1, default=0, metavar="EVERY_N",
        help="recompute activations in the backward to save memory; bare: every layer, N: every Nth layer "
             "only (selective: less recompute, more memory)")
    # Pipeline parallel is a flag: accelerate's config files have no pipeline size (accelerate_configs/pipeline.yaml).
    add("--pipeline-stages", type=int, default=1,
        help="split the decoder layers into N stages, one per process, and replicate the pipeline over the "
             "other processes (1: no pipeline)")
    add("--pipeline-schedule", default="1f1b", choices=("1f1b", "gpipe", "interleaved"),
        help="how the step's micro-batches (--grad-accum) flow through the stages (default: 1f1b; interleaved: "
             "interleaved 1F1B, each process running --pipeline-chunks parts of the layers)")
    add("--pipeline-chunks", type=int, default=2,
        help="under --pipeline-schedule interleaved: parts of the layers per process (default: 2)")
    # Speed: the defaults are the measured winners (docs/speed-options.md); these switch extras on.
    add("--compile", action=argparse.BooleanOptionalAction, default=None,
        help="torch.compile each decoder layer (regional compilation); default: on with a CUDA GPU for one process, "
             "DDP and FSDP where the run plans 100 steps or more (not QLoRA or --liger), off elsewhere; --no-compile "
             "turns it off")
    add("--liger", action="store_true", help="Liger's Triton kernels for RMSNorm, RoPE and SwiGLU (the loss is "
        "the recipe's own either way); needs `pip install liger-kernel` and a CUDA GPU")
    add("--attention", default=None, choices=("sdpa", "eager", "flash_attention_2", "flex_attention"),
        help="attention implementation (default: transformers' choice, SDPA)")
    add("--dataloader-workers", type=int, default=None,
        help="processes that collate batches beside each rank (default: 2 with a GPU, 0 without)")
    add("--log-every", type=int, default=None,
        help="print a line every N steps (default: every step when no progress bar is shown, else none)")
    add("--report-to", default="auto", choices=("auto", "none", "tensorboard", "wandb", "trackio"),
        help="accelerate tracker that receives the metrics too (auto: TensorBoard when installed)")
    add("--save-dtype", default="auto", choices=("auto", *SAVE_DTYPES),
        help="dtype of the exported model/ (full.py) and merged/ (--merge) (auto: full.py keeps the trained "
             "weights' dtype, merged/ the base's)")
    add("--trust-remote-code", action="store_true",
        help="run the model repository's own Python code (off: only transformers' built-in models)")
    add("--config", default=None, metavar="RUN_YAML",
        help="a YAML file of flags, keyed by flag name (`lr: 1.0e-4`, `max-steps: 300`); flags typed on the "
             "command line override it (default: none)")
    return parser


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--lora-r", type=int, default=16, help="adapter rank")
    add("--lora-alpha", type=float, default=32, help="adapter scale numerator (scale = alpha / r)")
    # 0 as peft's own default: dropout keeps a copy of each adapted layer's input and a mask for the backward, 26%
    # of the TinyLlama-1.1B LoRA step's planned memory at 16 x 1,024 tokens (44.5 GiB against 33.0 without)
    add("--lora-dropout", type=float, default=0.0, help="dropout on the adapter's input (a regulariser; each "
        "adapted layer then keeps a copy of its input for the backward)")
    add("--lora-targets", default="all-linear",
        help="comma-separated module names to adapt, or `all-linear`")
    add("--use-dora", action="store_true",
        help="DoRA (peft's use_dora): each adapted weight's magnitude trained apart from its direction; slower, "
             "every forward recomputes each adapted weight's norm")
    add("--use-rslora", action="store_true",
        help="rank-stabilised LoRA (peft's use_rslora): scale = alpha / sqrt(r) instead of alpha / r")
    add("--merge", action="store_true", help="also write merged/ : the adapter merged into the base weights")


def add_qlora_args(parser: argparse.ArgumentParser) -> None:
    add_lora_args(parser)
    parser.add_argument("--bits", type=int, choices=(4, 8), default=4, help="4 = NF4 (QLoRA), 8 = LLM.int8()")


def add_vision_args(parser: argparse.ArgumentParser, lora: bool) -> None:
    """What trains of a vision-language model besides its language model (docs/data.md#images)."""
    add = parser.add_argument
    how = "LoRA on its linear layers, as --lora-targets picks them in the language model" if lora else "every weight"
    add("--train-vision-tower", action="store_true",
        help=f"a vision-language model: train its vision tower too ({how}; default: frozen)")
    add("--train-projector", action="store_true",
        help="a vision-language model: train its projector (the layers between the vision tower and the language "
             "model) too, every weight of it (default: frozen)")


VISION_FLAGS = ("train_vision_tower", "train_projector")
VISION_RECIPES = ("lora", "qlora", "full")  # the recipes that train on rows with images


PREFERENCE_RECIPES = ("dpo", "dpo_full")  # recipes that train on pairs: two rows in one forward
FEEDBACK_RECIPES = ("kto", "kto_full")  # recipes that train on replies judged one at a time (KTO)
REWARD_RECIPES = ("reward", "reward_full")  # recipes that train a reward model (a score a row) on pairs
ONLINE_RECIPES = ("grpo", "grpo_full")  # recipes that train on completions they sample: prompts in, rewards from Python
PREFERENCE_LOSSES = ("sigmoid", "ipo", "simpo", "orpo")
REFERENCE_FREE_LOSSES = ("simpo", "orpo")  # the preference losses that score the policy alone


def add_preference_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--loss", choices=PREFERENCE_LOSSES, default="sigmoid",
        help="sigmoid: DPO; ipo: IPO (per-token log-ratios, squared); simpo: SimPO (no reference model); orpo: "
             "ORPO (no reference model; the odds ratio plus the chosen rows' SFT loss)")
    add("--beta", type=float, default=0.1,
        help="how far from the reference the policy may move: the scale of the log-ratios in the loss")
    add("--simpo-gamma", type=float, default=0.5, help="SimPO's target margin between chosen and rejected")


def add_kto_args(parser: argparse.ArgumentParser) -> None:
    """KTO's flags, with TRL 1.16's names and defaults (KTOConfig)."""
    add = parser.add_argument
    add("--beta", type=float, default=0.1,
        help="how far from the reference the policy may move: the scale of the log-ratios in the loss")
    add("--desirable-weight", type=float, default=1.0,
        help="weight of the desirable replies' losses (raise it when they are the fewer: the data line advises)")
    add("--undesirable-weight", type=float, default=1.0, help="weight of the undesirable replies' losses")


def add_reward_args(parser: argparse.ArgumentParser) -> None:
    """The reward model's flags, with TRL 1.16's names (RewardConfig)."""
    parser.add_argument("--center-rewards-coefficient", type=float, default=0.0,
                        help="weight of a penalty on (chosen + rejected reward)^2, which keeps the rewards centred "
                             "on 0 (TRL's center_rewards_coefficient; 0: none)")


GRPO_LOSSES = ("dapo", "grpo", "dr_grpo", "bnpo", "rloo")


def add_grpo_args(parser: argparse.ArgumentParser) -> None:
    """GRPO's flags, with TRL 1.16's names and defaults (GRPOConfig; RLOOConfig for --loss rloo)."""
    add = parser.add_argument
    add("--reward", action="append", default=None, metavar="FILE.py:NAME",
        help="a reward function in your Python file, fn(prompts, completions, **columns) -> list[float | None] "
             "(TRL's signature; None: does not apply to this completion); give it several times to sum several "
             "(default: recipes/rewards.py:exact_answer on the bundled prompts; required with --dataset)")
    add("--reward-weights", default=None, metavar="W1,W2,...",
        help="one weight per --reward, comma-separated: the reward is their weighted sum (default: 1 each)")
    add("--num-generations", type=int, default=8,
        help="completions sampled per prompt: a group, whose rewards are each other's baseline; the global batch "
             "(--batch-size x --grad-accum x processes completions) must hold whole groups")
    add("--max-completion-length", type=int, default=256,
        help="tokens a completion may have; one that reaches it without its stop token is truncated")
    add("--mask-truncated-completions", action="store_true",
        help="train on no token of a truncated completion (default: truncated ones train like the others)")
    add("--temperature", type=float, default=1.0, help="sampling temperature (the log-probabilities use it too)")
    add("--top-p", type=float, default=1.0, help="sample from the smallest set of tokens holding this probability")
    add("--top-k", type=int, default=0, help="sample from the k likeliest tokens only (0: all)")
    add("--loss", choices=GRPO_LOSSES, default="dapo",
        help="dapo: token mean over the global batch (TRL's default); grpo: each completion's token mean, then "
             "their mean; dr_grpo: token sum / (completions x --max-completion-length); bnpo: token mean of each "
             "micro-batch; rloo: TRL's RLOOTrainer (leave-one-out baseline, whole-completion ratio, KL in the reward)")
    add("--scale-rewards", choices=("group", "batch", "none"), default="group",
        help="divide each advantage by the reward spread of its group, of the whole batch, or not at all "
             "(not with --loss rloo)")
    add("--normalize-advantages", action="store_true",
        help="--loss rloo: scale the advantages to mean 0 and spread 1 over the batch (RLOOConfig's option)")
    add("--beta", type=float, default=None,
        help="weight of the KL penalty to the reference (the base: adapters off, no copy); default 0 (no "
             "reference forward), 0.05 with --loss rloo, as TRL")
    add("--epsilon", type=float, default=0.2, help="the ratio's clipping range below 1 (and above, unless "
                                                   "--epsilon-high)")
    add("--epsilon-high", type=float, default=None, help="the clipping range above 1 (DAPO's clip-higher: 0.28)")
    add("--num-iterations", type=int, default=1,
        help="optimizer steps on each batch of completions (μ): more than 1 reuses them, the ratio to the "
             "sampling policy clipped")
    add("--samples-every", type=int, default=10,
        help="write the step's prompts, completions and rewards to samples.jsonl every N steps (0: never)")


def recipe_flags(recipe: str, doc: str = "recipe\n") -> argparse.ArgumentParser:
    """The flags of `recipes/<recipe>.py` (`doc` is its --help text); tools that check a launch
    without running it use the same parser."""
    parser = recipe_parser(doc)
    parser.set_defaults(recipe=recipe)  # not a flag: what checkpoints and run.json record
    if recipe in VISION_RECIPES:
        add_vision_args(parser, lora=recipe != "full")
    if recipe == "full":
        parser.set_defaults(lr=2e-5)  # every weight moves: a LoRA-sized step would wreck the model
    elif recipe == "lora":
        add_lora_args(parser)
    elif recipe == "dpo_full":  # preference tuning of every weight
        add_preference_args(parser)
        parser.set_defaults(lr=1e-6)  # every weight moves, and the policy must stay near its reference
    elif recipe == "dpo":  # preference tuning of LoRA adapters on a frozen base, 16-bit or quantized
        add_lora_args(parser)
        add_preference_args(parser)
        parser.add_argument("--bits", type=int, choices=(4, 8), default=None,
                            help="quantize the frozen base: 4 = NF4 (QLoRA), 8 = LLM.int8() (default: not quantized)")
        parser.set_defaults(lr=5e-5)
    elif recipe == "kto_full":  # KTO on every weight
        add_kto_args(parser)
        parser.set_defaults(lr=1e-6)  # TRL's KTO default: every weight moves, and the policy stays near its reference
    elif recipe == "kto":  # KTO of LoRA adapters on a frozen base, 16-bit or quantized
        add_lora_args(parser)
        add_kto_args(parser)
        parser.add_argument("--bits", type=int, choices=(4, 8), default=None,
                            help="quantize the frozen base: 4 = NF4 (QLoRA), 8 = LLM.int8() (default: not quantized)")
        parser.set_defaults(lr=5e-5)
    elif recipe == "reward_full":  # a reward model of every weight
        add_reward_args(parser)
        parser.set_defaults(lr=1e-5)
    elif recipe == "reward":  # a reward model: LoRA adapters and the score head on a frozen base, 16-bit or quantized
        add_lora_args(parser)
        add_reward_args(parser)
        parser.add_argument("--bits", type=int, choices=(4, 8), default=None,
                            help="quantize the frozen base: 4 = NF4 (QLoRA), 8 = LLM.int8() (default: not quantized)")
        parser.set_defaults(lr=1e-4)  # TRL's RewardConfig default
    elif recipe == "grpo":  # online RL of LoRA adapters on a frozen base, 16-bit or quantized
        add_lora_args(parser)
        add_grpo_args(parser)
        parser.add_argument("--bits", type=int, choices=(4, 8), default=None,
                            help="quantize the frozen base: 4 = NF4 (QLoRA), 8 = LLM.int8() (default: not quantized)")
        # LoRA's step ~10x full training's (TRL's GRPO default 1e-6); prompt + completion under --max-length
        parser.set_defaults(lr=1e-5, max_length=1024)
    elif recipe == "grpo_full":  # online RL of every weight
        add_grpo_args(parser)
        parser.set_defaults(lr=1e-6, max_length=1024)  # TRL's GRPO default
    else:
        add_qlora_args(parser)
    return parser


def answer_help(recipe: str, doc: str, argv: list[str] | None = None) -> None:
    """`--help` printed (and the process ended) before the recipe imports torch, transformers and peft,
    which take seconds to load; any other command line goes on to the recipe's own parse_args."""
    answer_help_with(lambda: recipe_flags(recipe, doc), argv)


def answer_help_with(make_parser, argv: list[str] | None = None) -> None:
    """The same for a script: `make_parser()` builds its flags (and imports nothing heavy)."""
    argv = sys.argv[1:] if argv is None else argv
    argv = argv[:argv.index("--")] if "--" in argv else argv  # what follows `--` is another program's
    if "-h" in argv or "--help" in argv:
        make_parser().parse_args(["--help"])


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> Run:
    """The parsed flags as a read-only run, with `given_flags`: the ones typed on the command line or
    set in the --config file (which `settled_from` names for each value it set). A setting in the user's
    DeepSpeed config may fill a flag left at its default, but never override a given one
    (settle.settle_launch settles the rest)."""
    argv = sys.argv[1:] if argv is None else argv
    from_file, path = flags_from_config_file(parser, argv)
    typed = {action.dest for action in parser._actions for option in action.option_strings
             if any(arg == option or arg.startswith(option + "=") for arg in argv)}
    appended = {action.dest for action in parser._actions if isinstance(action, argparse._AppendAction)}
    # defaults, so that a typed flag still wins; a typed --dataset replaces the file's list, not adds to it
    parser.set_defaults(**{dest: value for dest, value in from_file.items() if not (dest in appended and dest in typed)})
    from_the_file = {dest: f"--config {path}" for dest in from_file if dest not in typed}
    return Run(**vars(parser.parse_args(argv)), given_flags=sorted(typed | set(from_file)), settled_from=from_the_file)


# Other projects' names for the recipes' flags (transformers' Trainer, TRL, peft), said in the refusal of one
OTHER_NAMES = {"learning_rate": "lr", "per_device_train_batch_size": "batch_size", "train_batch_size": "batch_size",
               "micro_batch_size": "batch_size", "gradient_accumulation_steps": "grad_accum",
               "num_train_epochs": "epochs", "num_epochs": "epochs", "max_seq_length": "max_length",
               "sequence_len": "max_length", "logging_steps": "log_every", "eval_steps": "eval_every",
               "save_steps": "save_every", "model_name_or_path": "model", "base_model": "model",
               "dataset_name": "dataset", "datasets": "dataset", "r": "lora_r", "lora_rank": "lora_r",
               "target_modules": "lora_targets", "lora_target_modules": "lora_targets", "warmup_steps": "warmup_ratio",
               "use_liger_kernel": "liger", "attn_implementation": "attention",
               "resume_from_checkpoint": "resume", "loss_type": "loss", "reward_funcs": "reward"}


def flags_from_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[dict, str | None]:
    """({dest: value} from the file after --config, checked like typed flags; the file), an unknown key or a
    value outside a flag's choices stopping the run in one line naming the fix."""
    paths = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--config"]
    paths += [arg.split("=", 1)[1] for arg in argv if arg.startswith("--config=")]
    if not paths:
        return {}, None
    if len(paths) > 1:
        refuse(f"--config is given {len(paths)} times; give one run file (merge the others into it)")
    path = paths[0]
    if not path.strip():
        refuse("--config is empty (an unset shell variable?); give a run.yaml or leave the flag out")
    import yaml

    try:
        settings = yaml.load(open(path), Loader=StrictLoader) or {}  # a flag set twice is refused, not the last kept
    except DuplicateKey as twice:
        refuse(f"--config {path} cannot be read: `{twice}` is set twice; keep one")
    except (OSError, yaml.YAMLError) as error:
        refuse(f"--config {path} cannot be read: {str(error).splitlines()[0]}")
    if not isinstance(settings, dict):
        refuse(f"--config {path} must map flag names to values (e.g. `lr: 1.0e-4`)")
    actions = {action.dest: action for action in parser._actions if action.option_strings and action.dest != "help"}
    flags = {}
    for key, value in settings.items():
        dest = str(key).lstrip("-").replace("-", "_")
        action = actions.get(dest)
        if action is None or dest == "config":
            hint = closest_flag(str(key), {name: a for name, a in actions.items() if name != "config"})
            refuse(f"--config {path}: `{key}` is not a flag of this recipe{f'; {hint}' if hint else ''}")
        if value is None and action.default is not None and not isinstance(action, argparse._StoreTrueAction):
            refuse(f"--config {path}: `{key}` has no value; give one, or delete the line to keep the default")
        if isinstance(value, bool) and action.nargs == "?":  # a flag that can be given bare: true is bare
            value = action.const if value else action.default
        if isinstance(action, argparse._AppendAction) and value is not None:  # `dataset: a.jsonl`, or a list
            value = [typed_value(action, item, f"--config {path}: `{key}: {item}`")
                     for item in (value if isinstance(value, list) else [value])]
        elif value is not None and not isinstance(action, argparse._StoreTrueAction):
            value = typed_value(action, value, f"--config {path}: `{key}: {value}`")
        if action.choices is not None and value not in action.choices:
            refuse(f"--config {path}: `{key}: {value}` is not one of {', '.join(map(str, action.choices))}")
        if isinstance(action, argparse._StoreTrueAction) and not isinstance(value, bool):
            refuse(f"--config {path}: `{key}` is a switch; write `{key}: true` or `{key}: false`")
        flags[dest] = value
    return flags, path


def typed_value(action, value, where: str):
    """A run file's value as the flag would take it typed: YAML's own types are not trusted (1.9 is
    no step count, `true` no number, a list no model name)."""
    kind = action.type or str
    if isinstance(value, (bool, list, dict)) or (isinstance(value, float) and kind is not float
                                                   and not value.is_integer()):
        name = {str: "text", int: "a whole number", float: "a number"}.get(kind, f"a {kind.__name__}")
        refuse(f"{where} must be {name}; write it as you would type the flag")
    try:
        return kind(value.strip() if isinstance(value, str) else int(value) if isinstance(value, float)
                    and kind is not float else value)
    except (TypeError, ValueError):
        refuse(f"{where} is not a valid {kind.__name__}")


def lora_targets(value: str):
    return value if value == "all-linear" else [name.strip() for name in value.split(",") if name.strip()]
