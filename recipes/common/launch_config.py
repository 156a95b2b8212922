"""The user's accelerate config file, run as written or refused in one line.

`accelerate launch` reads the config file and hands its choices to the recipe as environment
variables. Three things go wrong there without a word: a misspelt key inside `fsdp_config` or
`deepspeed_config` is dropped, an FSDP1-style file runs FSDP1 (a path these recipes do not take),
and a DeepSpeed JSON written for another project asks for its own precision, batch sizes,
optimizer or schedule. Before the model loads, `adapt_launch` reads what the launcher handed over
and either translates it (FSDP1 -> FSDP2, DeepSpeed values -> the recipe's flags), printing one
line that says what it translated, or refuses with one line that names the key and the fix.

Everything here reads the environment of the launch (and the file named by the launcher), which
is the same on every rank, so every rank reaches the same verdict.
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path

from .preflight import refuse

TRUE = ("true", "1", "yes", "on", "y", "t")
FALSE = ("false", "0", "no", "off", "n", "f")

# --- the config file -------------------------------------------------------------------------


def launcher_argv() -> list[str]:
    """The command line of the `accelerate launch` that started this process (empty when unknown)."""
    try:
        return Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


def config_file_of_launcher(argv: list[str] | None = None) -> Path | None:
    """The config file `accelerate launch` read: `--config_file X`, else its default file."""
    argv = launcher_argv() if argv is None else argv
    if not any("accelerate" in arg for arg in argv[:3]):
        return None  # started by torchrun, srun or python directly: no accelerate file involved
    for i, arg in enumerate(argv):
        for flag in ("--config_file", "--config-file"):
            if arg == flag and i + 1 < len(argv):
                return Path(argv[i + 1])
            if arg.startswith(flag + "="):
                return Path(arg.split("=", 1)[1])
    if "--cpu" in argv:
        return None
    from accelerate.commands.config import default_config_file

    return Path(default_config_file) if Path(default_config_file).is_file() else None


def read_config(path: Path) -> dict:
    import yaml

    try:
        text = Path(path).read_text()
        if Path(path).suffix == ".json":
            config = json.loads(text, object_pairs_hook=mapping_without_repeats)
        else:
            config = yaml.load(text, Loader=StrictLoader)
    except DuplicateKey as error:
        refuse(f"{Path(path).name}: `{error}` is set twice (the last one would win without a word); keep one")
    except (OSError, ValueError, yaml.YAMLError) as error:
        refuse(f"the accelerate config {path} cannot be read ({str(error).splitlines()[0]}); fix the file or its path")
    return config if isinstance(config, dict) else {}


class DuplicateKey(Exception):
    """A key written twice in one mapping of a config file."""


def mapping_without_repeats(pairs) -> dict:
    keys = [key for key, _ in pairs]
    repeated = next((key for key in keys if keys.count(key) > 1), None)
    if repeated is not None:
        raise DuplicateKey(repeated)
    return dict(pairs)


def _strict_loader():
    import yaml

    class Loader(yaml.SafeLoader):
        """yaml.safe_load that refuses a key written twice in one mapping."""

    def construct_mapping(loader, node, deep=False):
        loader.flatten_mapping(node)
        return mapping_without_repeats([(loader.construct_object(key, deep=deep), loader.construct_object(value, deep=deep))
                                        for key, value in node.value])

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    return Loader


StrictLoader = _strict_loader()


def known_keys() -> dict[str, set[str]]:
    """Every key accelerate reads from a config file: at the top level, and inside each section."""
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import launch_command_parser

    parser = launch_command_parser()
    options = {action.dest for action in parser._actions}
    sections = {
        "fsdp_config": {key for key in options if key.startswith("fsdp_")} | {"fsdp_ignored_modules"},
        "deepspeed_config": {action.dest for group in parser._action_groups if group.title == "DeepSpeed Arguments"
                             for action in group._group_actions},
        "parallelism_config": {key for key in options if key.startswith("parallelism_config_")},
        "dynamo_config": {key for key in options if key.startswith("dynamo_")},
        "fp8_config": {key for key in options if key.startswith("fp8_")},
        "megatron_lm_config": {key for key in options if key.startswith("megatron_lm_")},
    }
    # Keys accelerate still converts from older files (`fp16: true`, `dynamo_backend: NO`).
    from accelerate.commands.config.config_args import SageMakerConfig

    sections[""] = (set(ClusterConfig.__dataclass_fields__) | {"fp16", "dynamo_backend"}
                    | set(SageMakerConfig.__dataclass_fields__))
    return sections


# accelerate adds these prefixes to a key written without it; the other sections want the full name
ADDED_PREFIXES = {"fsdp_config": "fsdp_", "fp8_config": "fp8_", "dynamo_config": "dynamo_"}
NAME_PREFIXES = {**ADDED_PREFIXES, "parallelism_config": "parallelism_config_", "megatron_lm_config": "megatron_lm_"}


def unknown_key(config: dict) -> str | None:
    """The first key of `config` that accelerate would not read, with the closest one it would."""
    known = known_keys()
    for key, value in config.items():
        if key not in known[""]:
            return described(key, "at the top level", known[""])
        if key in known and isinstance(value, dict):
            prefix = NAME_PREFIXES.get(key, "")
            for inner in value:
                added = ADDED_PREFIXES.get(key, "")
                if (inner if inner.startswith(added) else added + inner) not in known[key]:
                    return described(inner, f"in {key}", known[key], prefix)
    return None


def closest(key: str, valid: set[str]) -> list[str]:
    """The valid key `key` most likely misspells; a shared `_config` ending alone is no likeness."""
    close = difflib.get_close_matches(key, sorted(valid), n=1, cutoff=0.75)
    stem = key.removesuffix("_config")
    if close and difflib.SequenceMatcher(None, stem, close[0].removesuffix("_config")).ratio() < 0.5:
        return []
    return close


def described(key: str, where: str, valid: set[str], prefix: str = "") -> str:
    close = closest(key, valid)
    if not close and prefix and not key.startswith(prefix):
        close = closest(prefix + key, valid)
    hint = f"did you mean `{close[0]}`? " if close else ""
    # accelerate launch stops at an unknown top-level key; inside a section it drops the key
    effect = "accelerate launch stops at it" if where == "at the top level" else "accelerate would ignore it"
    return f"`{key}` {where} is not an accelerate setting ({effect}); {hint}fix or delete it"


# --- the launch as the launcher describes it -----------------------------------------------------

# distributed_type values the recipes run (on CUDA GPUs, or CPU processes)
SUPPORTED_TYPES = ("NO", "MULTI_GPU", "MULTI_CPU", "FSDP", "DEEPSPEED")


def refuse_unsupported_type(config: dict, name: str) -> None:
    kind = str(config.get("distributed_type", "NO")).upper()
    if kind not in SUPPORTED_TYPES:
        refuse(f"{name}: distributed_type {kind} is not one these recipes run ({', '.join(SUPPORTED_TYPES)}, on CUDA "
               "GPUs or CPU processes); use a file from accelerate_configs/ (ddp.yaml, fsdp.yaml, zero3.yaml, ...)")


def refuse_one_process_for_several(distributed_type: str, requested: int) -> None:
    """accelerate starts ONE process for `distributed_type: NO` and for MULTI_CPU without mpirun,
    whatever --num_processes says."""
    if requested <= 1:
        return
    if distributed_type == "MULTI_CPU":
        refuse(f"distributed_type MULTI_CPU starts one process unless mpirun is set up, but {requested} were asked; "
               f"for {requested} CPU processes use accelerate_configs/ddp.yaml with --num_processes {requested} "
               "--mixed_precision no (DDP over gloo)")
    refuse("model parallel runs as ONE process that spreads the layers over the GPUs, but "
           "--num_processes > 1 was asked; drop --num_processes, or use "
           "accelerate_configs/ddp.yaml (model fits one GPU) or fsdp.yaml (it does not)")


def file_distributed_type() -> str:
    """distributed_type of the config file `accelerate launch` read ("NO" when there is none)."""
    path = config_file_of_launcher()
    config = read_config(path) if path is not None and Path(path).is_file() else {}
    return str(config.get("distributed_type", "NO")).upper()


def translate_dynamo(env, args) -> list[str]:
    """A `dynamo_config` makes accelerate compile the whole model, which renames the weights a LoRA
    adapter is saved under; the recipes' --compile compiles each decoder layer in place instead."""
    backend = env.get("ACCELERATE_DYNAMO_BACKEND", "no").strip().lower()
    if backend in ("no", ""):
        return []
    if backend != "inductor":
        refuse(f"dynamo_backend {backend.upper()}: the recipes compile with inductor (--compile); set "
               "dynamo_backend: INDUCTOR, or NO")
    env["ACCELERATE_DYNAMO_BACKEND"] = "NO"
    if args.compile:
        return []
    args.compile = True
    return ["dynamo_backend INDUCTOR -> --compile (each decoder layer compiled in place)"]



def number(env, name: str, default: int = 1) -> int:
    value = env.get(name, str(default))
    if not value.lstrip("-").isdigit():
        refuse(f"{name.lower()} must be a whole number, got {value!r}; fix it in the accelerate config")
    return int(value)


def refuse_unsupported_parallelism(env, on_gpu: bool) -> None:
    """Sequence sharding needs loop changes these recipes do not make; hybrid sharding needs GPUs."""
    if env.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
        return
    fix = "delete it from parallelism_config (for long sequences use --gradient-checkpointing and fsdp.yaml)"
    for name, what in (("CP", "context parallel"), ("SP", "sequence parallel (ALST/Ulysses)")):
        size = number(env, f"PARALLELISM_CONFIG_{name}_SIZE")
        if size > 1:
            refuse(f"{what} (parallelism_config_{name.lower()}_size: {size}) is not supported by these recipes, "
                   f"which keep each sequence on one rank; {fix}")
    if number(env, "PARALLELISM_CONFIG_DP_REPLICATE_SIZE") > 1 and not on_gpu:
        refuse_hybrid_on_cpu()


def tensor_parallel_size(env) -> int:
    if env.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
        return 1
    return number(env, "PARALLELISM_CONFIG_TP_SIZE")


# transformers shards a model over FSDP and tensor parallel together from this version on
FSDP_TP_TRANSFORMERS = "5.18.0"


def hand_tensor_parallel_to_transformers(env) -> list[str]:
    """Tensor parallel (tp.yaml) and FSDP x TP (fsdp_tp.yaml): transformers splits the layers (and,
    with FSDP, shards the split weights across the groups) as the model loads, on the mesh the
    config describes; accelerate then runs the loop and the data without wrapping the model again.

    accelerate 1.15's own FSDP x TP preparation imports a transformers class that transformers 5.17
    and later no longer have, so an FSDP file is run this way, and its FSDP settings are checked here.
    """
    tp = tensor_parallel_size(env)
    shard = number(env, "PARALLELISM_CONFIG_DP_SHARD_SIZE")
    replicate = number(env, "PARALLELISM_CONFIG_DP_REPLICATE_SIZE")
    processes = number(env, "WORLD_SIZE")
    fsdp = env.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        refuse(f"tensor parallel (parallelism_config_tp_size: {tp}) with DeepSpeed is not supported by these recipes; "
               "use accelerate_configs/tp.yaml or fsdp_tp.yaml, or drop parallelism_config for ZeRO")
    if replicate > 1:
        refuse(f"parallelism_config_dp_replicate_size {replicate} with tensor parallel is not supported by these "
               "recipes; set it to 1 and shard over the groups with parallelism_config_dp_shard_size (fsdp_tp.yaml)")
    if tp * shard != processes:
        refuse(f"parallelism_config asks for tp_size {tp} x dp_shard_size {shard} = {tp * shard} processes, but "
               f"{processes} were launched; launch {tp * shard} (--num_processes {tp * shard}) or make the sizes "
               f"multiply to {processes}")
    if shard > 1 and not fsdp:
        refuse(f"parallelism_config_dp_shard_size {shard} shards with FSDP, but distributed_type is not FSDP; set "
               "`distributed_type: FSDP` with `fsdp_version: 2` (as accelerate_configs/fsdp_tp.yaml does)")
    if not fsdp:
        return [f"tensor parallel: each layer split over {tp} processes, which share each batch"]
    if shard == 1:
        refuse(f"FSDP with tp_size {tp} = all {processes} processes leaves FSDP nothing to shard; use "
               "accelerate_configs/tp.yaml, or set parallelism_config_dp_shard_size > 1")
    from importlib.metadata import version

    from packaging.version import Version

    if Version(version("transformers")) < Version(FSDP_TP_TRANSFORMERS):
        refuse(f"FSDP x TP needs transformers >= {FSDP_TP_TRANSFORMERS} (this is {version('transformers')}), which "
               "shards a model both ways as it loads; `pip install -U transformers`, or use tp.yaml or fsdp.yaml")
    for name, fix in (("FSDP_OFFLOAD_PARAMS", "use accelerate_configs/fsdp_offload.yaml without tensor parallel"),
                      ("FSDP_ACTIVATION_CHECKPOINTING", "pass --gradient-checkpointing to the recipe instead")):
        if env.get(name, "false").lower() in TRUE:
            refuse(f"{setting(name)} is not available with tensor parallel (transformers shards the model); "
                   f"set it to false and {fix}")
    if env.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower() in FALSE:
        refuse("FSDP x TP reshards after forward (transformers' FSDP plan); set fsdp_reshard_after_forward: true, "
               "or keep the weights unsharded between passes with accelerate_configs/tp.yaml")
    env["ACCELERATE_USE_FSDP"] = "false"  # transformers shards at load; accelerate must not wrap it again
    return [f"FSDP x TP: transformers shards the model as it loads: {shard} FSDP shards x {tp}-way tensor parallel"]


def refuse_hybrid_on_cpu() -> None:
    refuse("hybrid sharding needs GPUs (torch's device mesh refuses CPU process groups); on "
           "this machine try accelerate_configs/fsdp.yaml, and use fsdp_hybrid.yaml on the cluster")


# --- FSDP: every file runs as FSDP2 --------------------------------------------------------------

# FSDP1 sharding strategy (by name or by torch's number) -> (reshard after forward, hybrid)
SHARDING_STRATEGIES = {"FULL_SHARD": (True, False), "SHARD_GRAD_OP": (False, False), "NO_SHARD": None,
                       "HYBRID_SHARD": (True, True), "_HYBRID_SHARD_ZERO2": (False, True)}
SHARDING_BY_NUMBER = dict(zip("12345", SHARDING_STRATEGIES))
CHOICES = {
    "FSDP_STATE_DICT_TYPE": ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT"),
    "FSDP_AUTO_WRAP_POLICY": ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"),
    "FSDP_BACKWARD_PREFETCH": ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"),
}
SWITCHES = ("FSDP_OFFLOAD_PARAMS", "FSDP_CPU_RAM_EFFICIENT_LOADING", "FSDP_ACTIVATION_CHECKPOINTING",
            "FSDP_USE_ORIG_PARAMS", "FSDP_SYNC_MODULE_STATES", "FSDP_FORWARD_PREFETCH")


def setting(name: str) -> str:
    return "fsdp_" + name.removeprefix("FSDP_").lower()


def fsdp_sharding(env) -> str:
    """The sharding strategy the file asks for, whichever way it says it.

    FSDP1 files name it in `fsdp_sharding_strategy`, or (newer ones) in `fsdp_reshard_after_forward`;
    FSDP2 files give `fsdp_reshard_after_forward` as true / false. The launcher always sets both
    variables, with defaults FULL_SHARD and true, so an explicit value is one that differs from them.
    """
    reshard = env.get("FSDP_RESHARD_AFTER_FORWARD", "true").strip()
    strategy = env.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD").strip().upper()
    strategy = SHARDING_BY_NUMBER.get(strategy, strategy)
    if reshard.upper() in SHARDING_STRATEGIES or reshard in SHARDING_BY_NUMBER:
        return SHARDING_BY_NUMBER.get(reshard, reshard.upper())
    if reshard.lower() not in TRUE + FALSE:
        refuse(f"fsdp_reshard_after_forward `{reshard}` is neither true / false nor one of "
               f"{', '.join(SHARDING_STRATEGIES)}; fix it in the accelerate config")
    if strategy not in SHARDING_STRATEGIES:
        refuse(f"fsdp_sharding_strategy `{strategy}` is not one of {', '.join(SHARDING_STRATEGIES)}; "
               "fix it in the accelerate config")
    if reshard.lower() in FALSE:
        return "SHARD_GRAD_OP" if strategy == "FULL_SHARD" else strategy
    return strategy


def translate_fsdp(env, on_gpu: bool) -> list[str]:
    """Rewrite the launcher's FSDP variables into the FSDP2 form accelerate builds its plugin from.

    Returns what was translated, for the one line the recipe prints.
    """
    for name, choices in CHOICES.items():
        value = env.get(name)
        if value is not None and value.upper() not in choices and not value.isdigit():
            refuse(f"{setting(name)} `{value}` is not one of {', '.join(choices)}; fix it in the accelerate config")
    for name in SWITCHES:
        value = env.get(name, "false").lower()
        if value not in TRUE + FALSE:
            refuse(f"{setting(name)} `{env[name]}` is not true or false; fix it in the accelerate config")
    version = env.get("FSDP_VERSION", "1")
    if version not in ("1", "2"):
        refuse(f"fsdp_version `{version}` is not 1 or 2; set `fsdp_version: 2` in the accelerate config")

    notes = []
    strategy = fsdp_sharding(env)
    if strategy == "NO_SHARD":
        if env.get("FSDP_OFFLOAD_PARAMS", "false").lower() in TRUE:
            refuse("fsdp_offload_params needs sharding, but the sharding strategy is NO_SHARD; use "
                   "accelerate_configs/fsdp_offload.yaml, or drop the offload and use ddp.yaml")
        env["ACCELERATE_USE_FSDP"] = "false"  # NO_SHARD replicates everything: that is DDP
        return ["NO_SHARD -> DDP"]
    reshard, hybrid = SHARDING_STRATEGIES[strategy]
    asked = env.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower()
    env["FSDP_VERSION"] = "2"
    env["FSDP_RESHARD_AFTER_FORWARD"] = str(reshard).lower()
    if version == "1" or asked not in (TRUE if reshard else FALSE):
        notes.append(f"{strategy} -> FSDP2 with reshard_after_forward {str(reshard).lower()}")
    if hybrid:
        if not on_gpu:
            refuse_hybrid_on_cpu()
        processes = int(env.get("WORLD_SIZE", "1"))
        per_machine = int(env.get("LOCAL_WORLD_SIZE", str(processes)))
        if env.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true":
            pass  # the file gives the mesh itself
        elif processes == per_machine:
            notes.append("hybrid shard on one machine = full shard over its processes")
        else:  # FSDP1's hybrid shard: shard within a machine, replicate across machines
            env.update(ACCELERATE_USE_PARALLELISM_CONFIG="true",
                       PARALLELISM_CONFIG_DP_REPLICATE_SIZE=str(processes // per_machine),
                       PARALLELISM_CONFIG_DP_SHARD_SIZE=str(per_machine))
            notes.append(f"hybrid: replicated over {processes // per_machine} machines, sharded over {per_machine}")
    if env.get("FSDP_STATE_DICT_TYPE", "").upper() in ("LOCAL_STATE_DICT", "3"):  # FSDP2 has no local form
        env["FSDP_STATE_DICT_TYPE"] = "SHARDED_STATE_DICT"
        notes.append("LOCAL_STATE_DICT -> SHARDED_STATE_DICT")
    if env.get("FSDP_AUTO_WRAP_POLICY", "").upper() in ("SIZE_BASED_WRAP", "1"):
        # FSDP2 shards modules that run a forward; a size rule also picks the layers' ModuleList, which has none
        env["FSDP_AUTO_WRAP_POLICY"] = "TRANSFORMER_BASED_WRAP"
        env.pop("FSDP_MIN_NUM_PARAMS", None)
        notes.append("SIZE_BASED_WRAP -> TRANSFORMER_BASED_WRAP (FSDP2 shards each decoder layer)")
    prefetch = env.pop("FSDP_BACKWARD_PREFETCH", None)
    forward = env.get("FSDP_FORWARD_PREFETCH", "false").lower() in TRUE
    if prefetch or forward:
        notes.append("prefetch: FSDP2 prefetches the next layer itself")
    if version == "1":
        notes.append("use_orig_params / sync_module_states: not needed by FSDP2")
    return notes


def translate_fsdp_activation_checkpointing(env, args) -> list[str]:
    """FSDP's activation checkpointing wraps each layer in a module of its own, which renames the
    weights a LoRA adapter is saved under (and, without a wrap policy, has no layers to wrap).
    transformers' own checkpointing of each decoder layer keeps the same activations and the names."""
    if env.get("FSDP_ACTIVATION_CHECKPOINTING", "false").lower() not in TRUE or args.gradient_checkpointing:
        return []  # not asked, or asked twice: preflight refuses the latter in one line
    env["FSDP_ACTIVATION_CHECKPOINTING"] = "false"
    args.gradient_checkpointing = 1
    return ["fsdp_activation_checkpointing -> --gradient-checkpointing (transformers checkpoints each layer)"]


# --- DeepSpeed: the JSON (or the inline keys) and the recipe agree ---------------------------------

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


def deepspeed_source(env) -> tuple[str, dict]:
    """(where the DeepSpeed settings come from, those settings as a DeepSpeed config dict)."""
    path = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if path != "none":
        inline = [name for name in env.get("ACCELERATE_CONFIG_DS_FIELDS", "").split(",")
                  if name in DEEPSPEED_FILE_CONFLICTS]
        if inline:
            refuse(f"the accelerate config sets {', '.join(inline)} beside deepspeed_config_file; move them into "
                   f"{path} (or drop deepspeed_config_file and keep the inline keys)")
        try:
            config = json.loads(Path(path).read_text())
        except (OSError, ValueError) as error:
            refuse(f"deepspeed_config_file {path} cannot be read as JSON ({error}); fix the file or its path")
        if not isinstance(config, dict):
            refuse(f"deepspeed_config_file {path} holds a JSON {type(config).__name__}, not an object of "
                   "DeepSpeed settings; write it as {{\"zero_optimization\": {{\"stage\": ...}}, ...}}")
        if not isinstance(config.get("zero_optimization"), dict):
            refuse(f"{path} has no `zero_optimization` section; add one with the ZeRO \"stage\" to use")
        return path, config

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
    }


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


def settle_deepspeed(config: dict, source: str, args, env, on_gpu: bool) -> list[str]:
    """Make the DeepSpeed settings and `args` agree, or refuse in one line.

    A value the config fixes and the command line does not mention becomes the recipe's (`args`
    is changed in place); a value both give differently is refused, and so is a section the
    recipe cannot honour. Returns what was taken over, for the one line the recipe prints.
    """
    check_deepspeed_sections(config, source, on_gpu)
    notes = []
    given = set(getattr(args, "given_flags", ()))
    for key, (flag, dest) in SETTLED_BY_FLAGS.items():
        value = lookup(config, key)
        if value in (None, "auto") or not differs(value, getattr(args, dest)):
            continue
        if dest in given:
            refuse(f"{source} sets {key} = {value} but {flag} is {getattr(args, dest)}; pass the same value, "
                   f"or set \"{key.split('.')[-1]}\": \"auto\" there (or delete it) so that {flag} applies")
        setattr(args, dest, int(value) if dest == "batch_size" else type(getattr(args, dest))(value))
        args.given_flags = sorted(set(getattr(args, "given_flags", ())) | {dest})  # fixed by the file
        notes.append(f"{flag} {getattr(args, dest)} (its {key})")
    # The global batch: batch_size.settle works out the accumulation that keeps it, or refuses.
    train_batch = config.get("train_batch_size", "auto")
    fixed = [config.get(key, "auto") for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")]
    processes = number(env, "WORLD_SIZE")
    if train_batch != "auto" and "auto" not in fixed and int(train_batch) != int(fixed[0]) * int(fixed[1]) * processes:
        refuse(f"{source} sets train_batch_size {train_batch}, but train_micro_batch_size_per_gpu {fixed[0]} x "
               f"gradient_accumulation_steps {fixed[1]} x {processes} processes = {int(fixed[0]) * int(fixed[1]) * processes}; "
               "fix one of the three, or set it to \"auto\"")
    if train_batch != "auto" and args.global_batch_size is None:
        args.global_batch_size = int(train_batch)
        notes.append(f"--global-batch-size {train_batch} (its train_batch_size)")
    elif train_batch != "auto" and differs(train_batch, args.global_batch_size):
        refuse(f"{source} sets train_batch_size = {train_batch} but --global-batch-size is {args.global_batch_size}; "
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
        kind = config["scheduler"].get("type", "") if isinstance(config["scheduler"], dict) else ""
        refuse(f"{source} asks for a DeepSpeed {kind + ' ' if kind else ''}scheduler, but the recipe "
               "builds its own warm-up + cosine schedule from --lr and --warmup-ratio; delete the `scheduler` "
               "section (or edit the recipe's schedule)")

    compile_asked = torch_compile_section(config)
    if compile_asked:
        backend = config["compile"].get("backend", "inductor")
        if backend != "inductor":
            refuse(f"{source} asks torch.compile for the `{backend}` backend; the recipes' --compile uses inductor: "
                   "delete the `compile` section, or set \"backend\": \"inductor\"")
        if not args.compile:
            args.compile = True
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
    if precision == "fp16" and not on_gpu:
        refuse(f"{source} trains in fp16, which DeepSpeed cannot do on CPU; on this machine set the fp16 block's "
               "\"enabled\" to \"auto\" or false (bf16 works on CPU)")
    if precision != launcher:
        env["ACCELERATE_MIXED_PRECISION"] = precision  # what the plan and the model's dtypes follow
        notes.append(f"precision {precision} (its {precision}.enabled)")
    check_zero_section(config["zero_optimization"], source)
    return notes


def check_deepspeed_sections(config: dict, source: str, on_gpu: bool) -> None:
    """What DeepSpeed itself would only reject after the model loaded, or fail on deep inside."""
    zero = config["zero_optimization"]
    stage = str(zero.get("stage", 0))
    if stage not in ("0", "1", "2", "3"):
        refuse(f"zero_optimization.stage in {source} is {zero.get('stage')!r}; give the ZeRO stage as 0, 1, 2 or 3 "
               "(\"auto\" is not a stage)")
    misplaced_or_misspelt_key(config, source)
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
    # DeepSpeed needs a batch size; a file without one takes the recipe's, as with "auto".
    config.setdefault("train_micro_batch_size_per_gpu", args.batch_size)
    if "bfloat16" in config:  # the old name of the bf16 block (settle_deepspeed took its precision)
        config.setdefault("bf16", config.pop("bfloat16"))
    if torch_compile_section(config) is not None:
        del config["compile"]  # torch.compile's options: --compile applies them (DeepSpeed would refuse them)
    zero = config.setdefault("zero_optimization", {})
    if zero.get("stage") == 3:
        # Saving the final model needs the gathered 16-bit weights; the file may use either name.
        name = next((key for key in ("gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save")
                     if key in zero), "stage3_gather_16bit_weights_on_model_save")
        zero[name] = True


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
            hint = f"did you mean `{close[0]}`? " if close else ""
            refuse(f"`{key}` in zero_optimization of {source} is not a DeepSpeed setting; {hint}fix or delete it")
        refuse(f"zero_optimization.{key} in {source}: {first['msg']}; fix it")


# --- the whole check --------------------------------------------------------------------------


def adapt_launch(args, env=None, config_file: Path | None | str = "launcher", on_gpu: bool | None = None) -> list[str]:
    """Check and translate the launch described by `env` (default: this process's environment)
    and the config file the launcher read. Returns the notes of what was translated."""
    env = os.environ if env is None else env
    if on_gpu is None:
        import torch

        on_gpu = torch.cuda.is_available()
    refuse_unsupported_parallelism(env, on_gpu)  # before the keys: such files often carry extra keys too
    path = config_file_of_launcher() if config_file == "launcher" else config_file
    if path is not None and Path(path).is_file():
        config = read_config(Path(path))
        problem = unknown_key(config)
        if problem:
            refuse(f"{Path(path).name}: {problem}")
        refuse_unsupported_type(config, Path(path).name)
    notes = translate_dynamo(env, args)
    if env.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        notes += translate_fsdp(env, on_gpu)
        refuse_unsupported_parallelism(env, on_gpu)
    if tensor_parallel_size(env) > 1:
        notes += hand_tensor_parallel_to_transformers(env)
    elif env.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        notes += translate_fsdp_activation_checkpointing(env, args)
    if env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        source, config = deepspeed_source(env)
        notes += settle_deepspeed(config, source, args, env, on_gpu)
    return notes
