"""A DeepSpeed config (its JSON, or the inline keys of an accelerate config) and the recipe agree.

A DeepSpeed JSON written for another project asks for its own batch sizes, accumulation, clipping,
precision, optimizer or schedule, and DeepSpeed reads several of its mistakes without a word (a
misspelt top-level key, a ZeRO key outside `zero_optimization`) or only after the model loaded.
`settle_deepspeed` takes over the values the recipe can honour as its flags and refuses the rest in
one line; `edit_deepspeed` aligns the config accelerate starts the engine with.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path

from ..refusal import refuse
from ..strict_reading import DuplicateKey, mapping_without_repeats
from .settled import Run

# accelerate ignores these beside a `deepspeed_config_file` (and refuses with a long message).
DEEPSPEED_FILE_CONFLICTS = ("gradient_accumulation_steps", "gradient_clipping", "zero_stage",
                            "offload_optimizer_device", "offload_param_device", "offload_param_nvme_path",
                            "offload_optimizer_nvme_path", "zero3_save_16bit_model", "mixed_precision")
# DeepSpeed key -> (recipe flag, argument name)
SETTLED_BY_FLAGS = {
    "gradient_accumulation_steps": ("--grad-accum", "grad_accum"),
    "gradient_clipping": ("--max-grad-norm", "max_grad_norm"),
    "train_micro_batch_size_per_gpu": ("--batch-size", "batch_size"),
    "optimizer.params.lr": ("--lr", "lr"),
    "optimizer.params.weight_decay": ("--weight-decay", "weight_decay"),
}
ADAMW_DEFAULTS = {"betas": [0.9, 0.999], "eps": 1e-8}


def deepspeed_source(env) -> tuple[str, dict, list[str]]:
    """(where the DeepSpeed settings come from, those settings as a DeepSpeed config dict under their
    current names, what `current_names` renamed)."""
    path = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if path != "none":
        inline = [name for name in env.get("ACCELERATE_CONFIG_DS_FIELDS", "").split(",")
                  if name in DEEPSPEED_FILE_CONFLICTS]
        if inline:
            refuse(f"the accelerate config sets {', '.join(inline)} beside deepspeed_config_file; move them into "
                   f"{path} (or drop deepspeed_config_file and keep the inline keys)")
        try:
            config = json.loads(Path(path).read_text(), object_pairs_hook=mapping_without_repeats)
        except DuplicateKey as error:
            refuse(f"{Path(path).name}: `{error}` is set twice (the last one would win without a word); keep one")
        except (OSError, ValueError) as error:
            refuse(f"deepspeed_config_file {path} cannot be read as JSON ({error}); fix the file or its path")
        if not isinstance(config, dict):
            refuse(f"deepspeed_config_file {path} holds a JSON {type(config).__name__}, not an object of "
                   "DeepSpeed settings; write it as {\"zero_optimization\": {\"stage\": ...}, ...}")
        config, renamed = current_names(config, path)
        if not isinstance(config.get("zero_optimization"), dict):
            refuse(f"{path} has no `zero_optimization` section; add one with the ZeRO \"stage\" to use")
        return path, config, renamed

    def value(name):
        raw = env.get(name, "auto")
        return "auto" if raw in ("auto", "none") else int(raw) if raw.isdigit() else float(raw)

    return "the accelerate config", {
        "gradient_accumulation_steps": value("ACCELERATE_GRADIENT_ACCUMULATION_STEPS"),
        "gradient_clipping": value("ACCELERATE_GRADIENT_CLIPPING"),
        "zero_optimization": {
            "stage": int(env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")),
            "offload_param": {"device": env.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none")},
            "offload_optimizer": {"device": env.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none")},
        },
    }, []


# A deprecated ZeRO setting DeepSpeed reads but does not move to its new place: old name -> the field it
# sets in each offload section present (DeepSpeed's `new_param` names the sections).
KEPT_IN_OFFLOAD_SECTIONS = {"cpu_offload_use_pin_memory": "pin_memory"}


def current_names(config: dict, source: str) -> tuple[dict, list[str]]:
    """The config with every ZeRO setting under the name DeepSpeed reads now, and what was renamed.

    DeepSpeed still accepts its deprecated names (the list comes from its own config class, so a newer
    DeepSpeed's are covered) but refuses one beside its new name, which a recipe's own addition can
    create (the 16-bit export's `gather_16bit_weights_on_model_save`). Renamed here once, every reader
    (the launch, the checks, accelerate, the engine) sees one name per setting. The `stage3_*` spellings
    are aliases, not deprecated names: they stay as written.
    """
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    config, renamed = dict(config), []
    zero = config.get("zero_optimization")
    if isinstance(zero, bool):  # DeepSpeed's first form: true is stage 1, with its bucket size at the top level
        zero = {"stage": 1 if zero else 0}
        if "allgather_size" in config:
            zero["allgather_bucket_size"] = config.pop("allgather_size")
        renamed.append(f"\"zero_optimization\": {str(config['zero_optimization']).lower()} -> {json.dumps(zero)}")
    if not isinstance(zero, dict):
        return config, renamed
    zero = dict(zero)
    fields = DeepSpeedZeroConfig.model_fields
    deprecated = {name: field.json_schema_extra for name, field in fields.items()
                  if isinstance(field.json_schema_extra, dict) and field.json_schema_extra.get("deprecated")}
    moved = [name for name, extra in deprecated.items() if extra.get("new_param") and extra.get("set_new_param", True)]
    for old in [name for name in moved if name in zero]:
        new = deprecated[old]["new_param"]
        value = deprecated[old].get("new_param_fn", lambda x: x)(zero.pop(old))
        if hasattr(value, "model_dump"):  # an offload section as DeepSpeed builds it
            value = value.model_dump(mode="json", exclude_unset=True)
        alias = fields[new].alias if new in fields else None
        present = next((name for name in (new, alias) if name and name in zero), None)
        if present is not None and value is not None and zero[present] != value:
            refuse(f"zero_optimization of {source} gives `{old}` (DeepSpeed's old name) and `{present}` "
                   f"with different values; keep `{present}` and delete `{old}`")
        if present is None and value is not None:
            zero[new] = value
        renamed.append(f"{old} -> {new}" if value is not None else f"{old} (false) dropped")
    for old, field in KEPT_IN_OFFLOAD_SECTIONS.items():
        if old in zero and old in deprecated:
            value = zero.pop(old)
            sections = [name for name in deprecated[old].get("new_param", "").split(" or ")
                        if isinstance(zero.get(name), dict)]
            for name in sections:
                zero[name] = {**zero[name], field: zero[name].get(field, value)}
            renamed.append(f"{old} -> {field} in {', '.join(sections)}" if sections
                           else f"{old} dropped (nothing is offloaded)")
    config["zero_optimization"] = zero
    return config, renamed


def lookup(config: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(config, dict) or part not in config:
            return None
        config = config[part]
    return config


def differs(a, b) -> bool:
    try:
        return float(a) != float(b)
    except (TypeError, ValueError):
        return True


def settle_deepspeed(config: dict, source: str, run: Run, env, on_gpu: bool) -> tuple[Run, list[str]]:
    """Make the DeepSpeed settings and the run agree, or refuse in one line.

    A value the config fixes and the command line does not mention becomes the run's (a new run is
    returned); a value both give differently is refused, and so is a section the recipe cannot
    honour. Also returns what was taken over, for the one line the recipe prints.
    """
    check_deepspeed_sections(config, source, on_gpu)
    notes = []
    given = set(run.given_flags)
    for key, (flag, dest) in SETTLED_BY_FLAGS.items():
        value = lookup(config, key)
        if value in (None, "auto") or not differs(value, getattr(run, dest)):
            continue
        if dest in given:
            refuse(f"{source} sets {key} = {value} but {flag} is {getattr(run, dest)}; pass the same value, "
                   f"or set \"{key.split('.')[-1]}\": \"auto\" there (or delete it) so that {flag} applies")
        typed = int(value) if dest == "batch_size" else type(getattr(run, dest))(value)
        run = run.settled({dest: (typed, f"{key} in {source}")}, fixes_flags=True)  # the source named by refusals
        notes.append(f"{flag} {typed} (its {key})")
    # The global batch: batch_size.settle works out the accumulation that keeps it, or refuses.
    train_batch = config.get("train_batch_size", "auto")
    fixed = [config.get(key, "auto") for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")]
    processes = int(env.get("WORLD_SIZE", "1"))
    if train_batch != "auto" and "auto" not in fixed and int(train_batch) != int(fixed[0]) * int(fixed[1]) * processes:
        refuse(f"{source} sets train_batch_size {train_batch}, but train_micro_batch_size_per_gpu {fixed[0]} x "
               f"gradient_accumulation_steps {fixed[1]} x {processes} processes = {int(fixed[0]) * int(fixed[1]) * processes}; "
               "fix one of the three, or set it to \"auto\"")
    if train_batch != "auto" and fixed[0] == "auto" and fixed[1] != "auto" and "batch_size" not in given:
        # DeepSpeed's own rule: micro-batch = train_batch_size / (accumulation x processes)
        micro, rest = divmod(int(train_batch), int(fixed[1]) * processes)
        if micro >= 1 and rest == 0 and micro != run.batch_size:
            run = run.settled({"batch_size": (micro, f"train_batch_size / gradient_accumulation_steps in {source}")},
                              fixes_flags=True)
            notes.append(f"--batch-size {micro} (its train_batch_size / gradient_accumulation_steps / {processes} "
                         "processes)")
    if train_batch != "auto" and run.global_batch_size is None:
        run = run.settled({"global_batch_size": (int(train_batch), f"train_batch_size in {source}")})
        notes.append(f"--global-batch-size {train_batch} (its train_batch_size)")
    elif train_batch != "auto" and differs(train_batch, run.global_batch_size):
        refuse(f"{source} sets train_batch_size = {train_batch} but --global-batch-size is {run.global_batch_size}; "
               "pass the same value, or set \"train_batch_size\": \"auto\" there")

    optimizer = config.get("optimizer")
    if optimizer is not None:
        if not isinstance(optimizer, dict) or "type" not in optimizer:
            refuse(f"{source} has an `optimizer` section without a \"type\"; delete the section (the recipes "
                   "train with AdamW), or give \"type\": \"AdamW\"")
        kind = str(optimizer.get("type", "")).lower()
        params = optimizer.get("params") or {}
        odd = [key for key, default in ADAMW_DEFAULTS.items() if params.get(key, "auto") not in ("auto", default)]
        if kind not in ("adam", "adamw") or str(params.get("adam_w_mode", True)).lower() == "false" or odd:
            what = f"{optimizer.get('type')} with {', '.join(odd)}" if odd else optimizer.get("type")
            refuse(f"{source} asks for a DeepSpeed {what} optimizer; the recipes train with AdamW (default betas "
                   "and eps) on every strategy: delete the `optimizer` section, or edit the recipe's optimizer")
        notes.append(f"optimizer {optimizer.get('type')} -> the recipe's AdamW")
    if config.get("scheduler") is not None:
        run, note = settle_scheduler(config["scheduler"], source, run)
        notes.append(note)

    compile_asked = torch_compile_section(config)
    if compile_asked:
        backend = config["compile"].get("backend", "inductor")
        if backend != "inductor":
            refuse(f"{source} asks torch.compile for the `{backend}` backend; the recipes' --compile uses inductor: "
                   "delete the `compile` section, or set \"backend\": \"inductor\"")
        if run.compile is None:
            run = run.settled({"compile": (True, f"the compile section of {source}")})
            notes.append("--compile (its compile section)")

    launcher = env.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    spellings = {"bf16": ("bf16", "bfloat16"), "fp16": ("fp16",)}  # DeepSpeed still reads the old "bfloat16"
    explicit = [kind for kind, names in spellings.items()
                if any(str(lookup(config, f"{name}.enabled")).lower() == "true" for name in names)]
    if len(explicit) == 2:
        refuse(f"{source} enables both bf16 and fp16; keep one of them")
    precision = explicit[0] if explicit else launcher  # "auto" follows the launcher
    if explicit and launcher not in ("no", precision):
        refuse(f"{source} enables {precision} but the launch asks for --mixed_precision {launcher}; make them "
               "agree (or set \"enabled\": \"auto\" in the file)")
    if precision == "fp16" and not on_gpu and explicit:
        refuse(f"{source} trains in fp16, which DeepSpeed cannot do on CPU; on this machine set the fp16 block's "
               "\"enabled\" to \"auto\" or false (bf16 works on CPU)")
    if precision == "fp16" and not on_gpu:
        refuse("the launch asks for --mixed_precision fp16, which DeepSpeed cannot do on CPU; set mixed_precision: "
               "'no' or bf16 in the accelerate config (or pass --mixed_precision no to accelerate launch)")
    checkpointing = config.get("activation_checkpointing")
    asked = isinstance(checkpointing, dict) and any(value is True or (type(value) is int and value > 0)
                                                    for value in checkpointing.values())
    if asked and not run.gradient_checkpointing:
        # DeepSpeed's section configures its own checkpointing API, which transformers' models never call
        run = run.settled({"gradient_checkpointing": (1, f"activation_checkpointing in {source}")})
        notes.append("activation_checkpointing -> --gradient-checkpointing (transformers checkpoints each layer; "
                     "the section's own options are not used)")
    if precision != launcher:
        env["ACCELERATE_MIXED_PRECISION"] = precision  # what the plan and the model's dtypes follow
        notes.append(f"precision {precision} (its {precision}.enabled)")
    zero = config["zero_optimization"]
    gather = [key for key in ("gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save")
              if str(zero.get(key, "")).lower() == "false"]
    if str(zero.get("stage")) == "3" and gather:  # edit_deepspeed turns it on: the export needs whole weights
        notes.append(f"{gather[0]} -> true (the final save gathers the full weights)")
    check_zero_section(zero, source)
    return run, notes


# DeepSpeed's schedules the recipes run -> their parameters. The ones the recipe has a setting for are
# "auto" when absent: the recipe's own value fills them, as HF Trainer fills "auto".
DEEPSPEED_SCHEDULES = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"),
    "WarmupDecayLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps"),
    "WarmupCosineLR": ("warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type", "total_num_steps"),
}
FILLED_BY_RECIPE = {"warmup_min_lr": "0", "warmup_max_lr": "--lr",
                    "warmup_num_steps": "--warmup-ratio x the run's steps", "total_num_steps": "the run's steps"}


def settle_scheduler(section, source: str, run: Run) -> tuple[Run, str]:
    """A DeepSpeed `scheduler` section the recipe runs as the file asks (`deepspeed_schedule`), or a refusal
    in one line. Returns the run that records it (`deepspeed_scheduler`) and the note for the config line."""
    kind = section.get("type") if isinstance(section, dict) else None
    if kind not in DEEPSPEED_SCHEDULES:
        refuse(f"{source} asks for a DeepSpeed {str(kind) + ' ' if kind else ''}scheduler; the recipes run "
               f"{', '.join(DEEPSPEED_SCHEDULES)} sections (and their own warm-up + cosine schedule without one): "
               "use one of those types, or delete the `scheduler` section")
    params = section.get("params") or {}
    accepted = DEEPSPEED_SCHEDULES[kind]
    for key, value in params.items():
        if key not in accepted:
            close = difflib.get_close_matches(key, accepted, n=1, cutoff=0.6)
            refuse(f"`{key}` in the {kind} scheduler of {source} is not a {kind} setting "
                   f"({'did you mean `' + close[0] + '`? ' if close else ''}it takes {', '.join(accepted)}); fix or delete it")
        if value == "auto":
            if key not in FILLED_BY_RECIPE:
                refuse(f"{key} in the {kind} scheduler of {source} is \"auto\", but the recipe has no setting for it; "
                       "give a value, or delete it for DeepSpeed's default")
        elif key == "warmup_type":
            if value not in ("log", "linear"):
                refuse(f"warmup_type in the {kind} scheduler of {source} is {value!r}; give \"log\" or \"linear\"")
        elif key in ("warmup_num_steps", "total_num_steps") and not is_count(value):
            refuse(f"{key} in the {kind} scheduler of {source} is {value!r}; give a whole number >= 1 (or \"auto\")")
        elif key not in ("warmup_num_steps", "total_num_steps") and not is_number(value):
            refuse(f"{key} in the {kind} scheduler of {source} is {value!r}; give a number (or \"auto\")")
    given = set(run.given_flags)
    if params.get("warmup_max_lr", "auto") != "auto" and differs(params["warmup_max_lr"], run.lr):
        if "lr" in given:
            refuse(f"{source} sets warmup_max_lr = {params['warmup_max_lr']} but --lr is {run.lr}; pass the same "
                   "value, or set \"warmup_max_lr\": \"auto\" there (or delete it) so that --lr applies")
        run = run.settled({"lr": (float(params["warmup_max_lr"]), f"warmup_max_lr in {source}")}, fixes_flags=True)
    if params.get("warmup_num_steps", "auto") != "auto" and "warmup_ratio" in given:
        refuse(f"{source} sets warmup_num_steps = {params['warmup_num_steps']} and --warmup-ratio is given too; "
               "drop --warmup-ratio, or set \"warmup_num_steps\": \"auto\" there so that --warmup-ratio applies")
    run = run.recorded(deepspeed_scheduler={"type": kind, "params": dict(params)})
    filled = [f"{key} {FILLED_BY_RECIPE[key]}" for key in accepted
              if key in FILLED_BY_RECIPE and params.get(key, "auto") == "auto"]
    fixed = [f"{key} {value}" for key, value in params.items() if value != "auto"]
    said = [", ".join(fixed), f"from the recipe: {', '.join(filled)}" if filled else ""]
    return run, f"scheduler {kind} runs as the file asks ({'; '.join(part for part in said if part)})"


def schedule_settings(section: dict, args, total_steps: int) -> dict:
    """The parameters a DeepSpeed `scheduler` section runs with: its own, and the recipe's values for
    its "auto" and absent ones (run.json records them)."""
    params = {key: value for key, value in section["params"].items() if value != "auto"}
    recipe_values = {"warmup_min_lr": 0.0, "warmup_max_lr": args.lr, "total_num_steps": total_steps,
                     "warmup_num_steps": max(1, int(args.warmup_ratio * total_steps))}
    for key in DEEPSPEED_SCHEDULES[section["type"]]:
        if key in recipe_values and key not in params:
            params[key] = recipe_values[key]
    for key in ("warmup_num_steps", "total_num_steps"):
        if key in params:
            params[key] = int(float(params[key]))
    return params


def deepspeed_schedule(optimizer, section: dict, args, total_steps: int):
    """The learning-rate schedule of a DeepSpeed `scheduler` section, "auto" filled from the recipe.

    DeepSpeed's own class computes each step's rate (on a stand-in optimizer); the recipe's optimizer
    follows it through a LambdaLR. Handed a DeepSpeed scheduler object, accelerate would give it to the
    engine, which (with the optimizer offloaded on a GPU) steps another optimizer than the one it holds.
    """
    import torch
    from deepspeed.runtime import lr_schedules

    params = schedule_settings(section, args, total_steps)
    stand_in = torch.optim.SGD([torch.zeros(1)], lr=args.lr)
    # from iteration 0: started at -1, DeepSpeed warns on every rank that no step was taken yet
    deepspeed_own = getattr(lr_schedules, section["type"])(stand_in, **params, last_batch_iteration=0)

    def factor(step: int) -> float:
        # DeepSpeed's first optimizer step runs before its first iteration (the warm-up's lowest rate; 0 for
        # the cosine schedule), the next ones at its iterations 0, 1, 2, ...
        if step == 0:
            return getattr(deepspeed_own, "min_lrs", [0.0])[0] / args.lr
        deepspeed_own.step(step - 1)
        return deepspeed_own.get_last_lr()[0] / args.lr

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def is_number(value) -> bool:
    try:
        return not isinstance(value, bool) and float(value) == float(value)
    except (TypeError, ValueError):
        return False


def check_deepspeed_sections(config: dict, source: str, on_gpu: bool) -> None:
    """What DeepSpeed itself would only reject after the model loaded, or fail on deep inside."""
    zero = config["zero_optimization"]
    stage = str(zero.get("stage", 0))
    if stage not in ("0", "1", "2", "3"):
        refuse(f"zero_optimization.stage in {source} is {zero.get('stage')!r}; give the ZeRO stage as 0, 1, 2 or 3 "
               "(\"auto\" is not a stage)")
    misplaced_or_misspelt_key(config, source)
    autotp = lookup(config, "tensor_parallel.autotp_size") or lookup(config, "tensor_parallel.tensor_parallel.tp_size")
    if autotp not in (None, "auto") and is_number(autotp) and float(autotp) > 1:
        # DeepSpeed's AutoTP training splits the layers at deepspeed.initialize, which accelerate's prepare does
        # not arrange: ZeRO then fails on every rank with a KeyError after the model loaded
        refuse(f"{source} asks for DeepSpeed AutoTP (tensor_parallel.autotp_size {autotp}), which the recipes do not "
               "run; for tensor parallel launch with accelerate_configs/tp.yaml (or fsdp_tp.yaml to shard as well), "
               "or delete the tensor_parallel section")
    for name in ("fp16", "bf16", "bfloat16"):
        if name in config and config[name] is not None and not isinstance(config[name], dict):
            refuse(f"\"{name}\" in {source} is {json.dumps(config[name])}; DeepSpeed reads a block: write "
                   f"\"{name}\": {{\"enabled\": {json.dumps(config[name])}}}")
    for key in ("train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps"):
        if not is_count(config.get(key, "auto")):
            refuse(f"{key} in {source} is {config[key]!r}; give a whole number >= 1 (or \"auto\")")
    if isinstance(config.get("amp"), dict) and str(config["amp"].get("enabled", False)).lower() == "true":
        refuse(f"{source} enables DeepSpeed's `amp` (NVIDIA Apex), which DeepSpeed has removed; delete the `amp` "
               "section and use a \"bf16\": {\"enabled\": true} block")
    for part in ("offload_param", "offload_optimizer"):
        device = str(lookup(zero, f"{part}.device") or "none").lower()
        if part == "offload_param" and device != "none" and stage != "3":
            refuse(f"zero_optimization.offload_param in {source} needs ZeRO stage 3 (stage {stage} keeps whole "
                   "parameters on each GPU); set \"stage\": 3, or offload only the optimizer (offload_optimizer)")
        if device == "nvme" and not (on_gpu and async_io_available()):
            refuse(f"zero_optimization.{part} in {source} offloads to NVMe, which needs DeepSpeed's async_io op "
                   f"(libaio) {'and a GPU ' if not on_gpu else ''}that this machine lacks; offload to \"cpu\" instead")


# Top-level DeepSpeed keys the recipe reads: a misspelt one is ignored by DeepSpeed without a word.
READ_BY_RECIPE = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                  "gradient_clipping", "optimizer", "scheduler", "bf16", "bfloat16", "fp16", "zero_optimization")


def misplaced_or_misspelt_key(config: dict, source: str) -> None:
    """DeepSpeed ignores top-level keys it does not know: a near-miss of a key the recipe reads, or a
    zero_optimization setting written outside that section, would change the run without a word."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    zero_fields = set(DeepSpeedZeroConfig.model_fields) | {
        field.alias for field in DeepSpeedZeroConfig.model_fields.values() if field.alias}
    for key in config:
        if key in READ_BY_RECIPE:
            continue
        close = difflib.get_close_matches(key, READ_BY_RECIPE, n=1, cutoff=0.85)
        if close and not deepspeed_mentions(key):
            refuse(f"`{key}` in {source} is not a DeepSpeed setting (DeepSpeed would ignore it); did you mean "
                   f"`{close[0]}`? fix or delete it")
        if key in zero_fields and not deepspeed_mentions(key, top_level_only=True):
            refuse(f"`{key}` at the top level of {source} is a zero_optimization setting, which DeepSpeed ignores "
                   "there; move it into the \"zero_optimization\" section")


def deepspeed_mentions(key: str, top_level_only: bool = False) -> bool:
    """Whether DeepSpeed's source names `key` as a string: a real setting of some part of DeepSpeed, not
    a typo. `top_level_only`: only where DeepSpeed reads the top level of its config."""
    import importlib.util

    root = Path(importlib.util.find_spec("deepspeed").origin).parent
    files = [root / "runtime" / "config.py", root / "runtime" / "constants.py"] if top_level_only else root.rglob("*.py")
    return any(f'"{key}"' in text or f"'{key}'" in text for text in (path.read_text(errors="ignore") for path in files))


def is_count(value) -> bool:
    """A whole number >= 1 (as DeepSpeed takes batch sizes and steps: 4, 4.0, "4"), or "auto"."""
    if value == "auto":
        return True
    try:
        return not isinstance(value, bool) and float(value).is_integer() and float(value) >= 1
    except (TypeError, ValueError):
        return False


def async_io_available() -> bool:
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        return bool(AsyncIOBuilder().is_compatible(verbose=False))
    except Exception:  # an unbuilt or broken DeepSpeed says the same: no NVMe offload here
        return False


def torch_compile_section(config: dict) -> bool | None:
    """A `compile` section in the form HF Trainer and axolotl read (torch.compile's `disable` and
    `backend`), which DeepSpeed's own, differently shaped section refuses: compile asked or not;
    None when there is no such section (DeepSpeed's own form is left to DeepSpeed)."""
    section = config.get("compile")
    if not isinstance(section, dict) or not set(section) <= {"disable", "backend"}:
        return None
    return str(section.get("disable", False)).lower() != "true"


def edit_deepspeed(config: dict, args) -> None:
    """The DeepSpeed config accelerate will start the engine with, aligned with the recipe's loop
    (after `settle_deepspeed` has checked that nothing the user asked for is lost)."""
    # The recipe hands DeepSpeed exactly --grad-accum micro-batches per step; when the file has no
    # value accelerate puts 1 there and would silently prefer it.
    config["gradient_accumulation_steps"] = args.grad_accum
    # DeepSpeed clips inside its own step; the value must be the recipe's, as on DDP and FSDP.
    config["gradient_clipping"] = args.max_grad_norm
    config.pop("optimizer", None)  # an AdamW section: the recipe's own AdamW is the same
    config.pop("scheduler", None)  # the recipe builds it (deepspeed_schedule) and steps it in its loop
    # DeepSpeed needs a batch size; a file without one, or with "auto", takes the recipe's (what accelerate would
    # read from a training loader: grpo.py hands it none, its batches are sampled)
    if config.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        config["train_micro_batch_size_per_gpu"] = args.batch_size
    if "bfloat16" in config:  # the old name of the bf16 block (settle_deepspeed took its precision)
        config.setdefault("bf16", config.pop("bfloat16"))
    if torch_compile_section(config) is not None:
        del config["compile"]  # torch.compile's options: --compile applies them (DeepSpeed would refuse them)
    zero = config.setdefault("zero_optimization", {})
    zero.setdefault("stage", 0)  # DeepSpeed's default; accelerate reads the key when it saves
    if zero.get("stage") == 3:
        # Saving the final model needs the gathered 16-bit weights; the file may use either name.
        name = next((key for key in ("gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save")
                     if key in zero), "stage3_gather_16bit_weights_on_model_save")
        zero[name] = True


def check_engine_config(config: dict, args, precision: str, source: str) -> None:
    """The exact config the engine will start with (after `edit_deepspeed`), read by DeepSpeed's own
    config classes before the model loads: anything DeepSpeed would refuse only at `prepare` is one line
    now, on every rank alike. accelerate fills the batch sizes and the precision's "auto" at `prepare`:
    filled here the same way."""
    from deepspeed.runtime.config import DeepSpeedConfig

    trial = json.loads(json.dumps(config))  # DeepSpeed writes what it computes into the dict it reads
    trial["train_micro_batch_size_per_gpu"] = args.batch_size
    trial["gradient_accumulation_steps"] = args.grad_accum
    trial.pop("train_batch_size", None)  # the two above x the processes (settle_deepspeed checked the file's)
    for name in ("bf16", "fp16"):
        if isinstance(trial.get(name), dict) and trial[name].get("enabled") == "auto":
            trial[name]["enabled"] = precision == name
    try:
        DeepSpeedConfig(trial)
    except Exception as error:  # noqa: BLE001 - whatever DeepSpeed raises on a config is the answer, in one line
        said = " ".join(str(error).split()) or type(error).__name__
        refuse(f"DeepSpeed refuses the config it would start with ({source} with the recipe's settings): "
               f"{said[:300]}; fix that key in {source}")


def check_zero_section(zero: dict, source: str) -> None:
    """DeepSpeed validates `zero_optimization` only when the engine starts, after the model loaded."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from pydantic import ValidationError

    try:
        DeepSpeedZeroConfig(**{key: value for key, value in zero.items() if value != "auto"})
    except ValidationError as error:
        first = error.errors()[0]
        key = ".".join(str(part) for part in first["loc"])
        if first["type"] == "extra_forbidden":
            valid = set(DeepSpeedZeroConfig.model_fields) | {
                field.alias for field in DeepSpeedZeroConfig.model_fields.values() if field.alias}
            close = difflib.get_close_matches(key, sorted(valid), n=1, cutoff=0.6)
            if key in valid:  # a setting and its alias (stage3_... and the short name) given together
                refuse(f"zero_optimization of {source} gives `{key}` twice, under its two names; keep one")
            hint = f"did you mean `{close[0]}`? " if close else ""
            refuse(f"`{key}` in zero_optimization of {source} is not a DeepSpeed setting; {hint}fix or delete it")
        refuse(f"zero_optimization.{key} in {source}: {first['msg']}; fix it")
