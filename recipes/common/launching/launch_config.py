"""The user's accelerate config file, run as written or refused in one line.

`accelerate launch` reads the config file and hands its choices to the recipe as environment
variables. Three things go wrong there without a word: a misspelt key inside `fsdp_config` or
`deepspeed_config` is dropped, an FSDP1-style file runs FSDP1 (a path these recipes do not take),
and a DeepSpeed JSON written for another project asks for its own precision, batch sizes,
optimizer or schedule. Before the model loads, `adapt_launch` reads what the launcher handed over
and either translates it (FSDP1 -> FSDP2, DeepSpeed values -> the recipe's flags), printing one
line that says what it translated, or refuses with one line that names the key and the fix.
The DeepSpeed part lives in deepspeed_config.py.

Everything here reads the environment of the launch (and the file named by the launcher), which
is the same on every rank, so every rank reaches the same verdict.
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path

from ..refusal import refuse
from ..strict_reading import DuplicateKey, StrictLoader, mapping_without_repeats
from .deepspeed_config import deepspeed_source, settle_deepspeed
from .launch import number, sequence_attention, sequence_parallel_size, tensor_parallel_size
from .settled import Run

TRUE = ("true", "1", "yes", "on", "y", "t")
FALSE = ("false", "0", "no", "off", "n", "f")

# --- the config file -------------------------------------------------------------------------


def launcher_argv() -> list[str]:
    """The command line of the `accelerate launch` that started this process (empty when unknown)."""
    try:
        return Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


def launched_by_accelerate(argv: list[str]) -> bool:
    """Whether `argv` (the parent's command line) is `accelerate launch` (else torchrun, srun or plain python)."""
    return any("accelerate" in arg for arg in argv[:3])


def config_file_of_launcher(argv: list[str] | None = None) -> Path | None:
    """The config file `accelerate launch` read: `--config_file X`, else its default file."""
    argv = launcher_argv() if argv is None else argv
    if not launched_by_accelerate(argv):
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
    refuse(f"model parallel runs as ONE process that spreads the layers over the GPUs, but {requested} were "
           "asked (--num_processes, or num_processes in the config file); ask for 1, or use "
           "accelerate_configs/ddp.yaml (model fits one GPU) or fsdp.yaml (it does not)")


def file_distributed_type() -> str:
    """distributed_type of the config file `accelerate launch` read ("NO" when there is none)."""
    path = config_file_of_launcher()
    config = read_config(path) if path is not None and Path(path).is_file() else {}
    return str(config.get("distributed_type", "NO")).upper()



def requested_processes_of_launcher() -> int:
    """`--num_processes N` given to the `accelerate launch` that started this single process, else
    the config file's `num_processes`.

    With `distributed_type: 'NO'` accelerate starts one process whatever `--num_processes`
    says; only the launcher's own command line and its file still show what the user asked for.
    """
    argv = launcher_argv()
    for i, arg in enumerate(argv):
        if arg.startswith("--num_processes="):
            return int(arg.split("=", 1)[1])
        if arg in ("--num_processes", "--num-processes") and i + 1 < len(argv) and argv[i + 1].isdigit():
            return int(argv[i + 1])
    path = config_file_of_launcher()
    config = read_config(path) if path is not None and Path(path).is_file() else {}
    processes = str(config.get("num_processes", 1))
    return int(processes) if processes.isdigit() else 1


def check_process_count(launch) -> None:
    """One process where several were asked: accelerate's own rule for some launches, said in one line."""
    if launch.processes == 1 and launch.kind in ("single", "model_parallel"):
        refuse_one_process_for_several(file_distributed_type(), requested_processes_of_launcher())


def translate_dynamo(env, run: Run) -> tuple[Run, list[str]]:
    """A `dynamo_config` makes accelerate compile the whole model, which renames the weights a LoRA
    adapter is saved under; the recipes' --compile compiles each decoder layer in place instead."""
    backend = env.get("ACCELERATE_DYNAMO_BACKEND", "no").strip().lower()
    if backend in ("no", ""):
        return run, []
    if backend != "inductor":
        refuse(f"dynamo_backend {backend.upper()}: the recipes compile with inductor (--compile); set "
               "dynamo_backend: INDUCTOR, or NO")
    env["ACCELERATE_DYNAMO_BACKEND"] = "NO"
    # the rest of the dynamo block: --compile uses torch.compile's defaults, so say what is not applied
    unused = [f"dynamo_{name.lower()} {env.pop(f'ACCELERATE_DYNAMO_{name}')}" for name in ("MODE", "USE_FULLGRAPH",
              "USE_DYNAMIC") if env.get(f"ACCELERATE_DYNAMO_{name}", "").lower() not in ("", "default", "false")]
    if run.compile is not None:  # --compile / --no-compile typed: the flag wins
        return run, [f"not applied: {', '.join(unused)}"] if unused else []
    return run.settled({"compile": (True, "dynamo_backend INDUCTOR in the accelerate config")}), [
        "dynamo_backend INDUCTOR -> --compile (each decoder layer compiled in place)"
        + (f"; not applied: {', '.join(unused)}" if unused else "")]



def refuse_unsupported_parallelism(env, on_gpu: bool) -> None:
    """Context parallel needs loop changes these recipes do not make; sequence parallel runs under DeepSpeed
    (`settle_sequence_parallel`); hybrid sharding needs GPUs."""
    if env.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
        return
    size = number(env, "PARALLELISM_CONFIG_CP_SIZE")
    if size > 1:
        refuse(f"context parallel (parallelism_config_cp_size: {size}) is not supported by these recipes; for long "
               "sequences use sequence parallel (accelerate_configs/sp.yaml: parallelism_config_sp_size under DeepSpeed)")
    size = sequence_parallel_size(env)
    if size > 1 and env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        refuse(f"sequence parallel (parallelism_config_sp_size: {size}) runs under DeepSpeed (its ALST / Ulysses), "
               "not this config's strategy; use accelerate_configs/sp.yaml, or delete sp_size from parallelism_config")
    if number(env, "PARALLELISM_CONFIG_DP_REPLICATE_SIZE") > 1 and not on_gpu:
        refuse_hybrid_on_cpu()


# what DeepSpeed's Ulysses runs on the gathered heads (a hub kernel, "owner/name", too); eager and flex refused
SEQUENCE_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3")


def settle_sequence_parallel(env, run: Run) -> tuple[Run, list[str]]:
    """Sequence parallel (sp.yaml): every sequence split over `parallelism_config_sp_size` ranks by DeepSpeed's
    Ulysses, which accelerate sets up from the file. The file's attention implementation is the model's
    (`--attention`); where the file names none, the run's (sdpa by default) is handed to accelerate, which
    cannot start without one."""
    size = sequence_parallel_size(env)
    processes = int(env.get("WORLD_SIZE", "1"))
    backend = env.get("PARALLELISM_CONFIG_SP_BACKEND", "deepspeed")
    if backend != "deepspeed":
        refuse(f"parallelism_config_sp_backend {backend!r} is not one accelerate knows; set it to deepspeed")
    if processes % size:
        refuse(f"parallelism_config_sp_size {size} does not divide the {processes} processes; launch a multiple of "
               f"{size} (--num_processes) or change sp_size")
    shard = number(env, "PARALLELISM_CONFIG_DP_SHARD_SIZE")
    if shard not in (1, processes // size):
        refuse(f"parallelism_config_dp_shard_size {shard} x sp_size {size} is not the {processes} processes; under "
               f"DeepSpeed the groups are all processes / sp_size = {processes // size}: set dp_shard_size to that or 1")
    # accelerate counts DeepSpeed's train_batch_size over dp_shard_size (1 where the file names none)
    env["PARALLELISM_CONFIG_DP_SHARD_SIZE"] = str(processes // size)
    named = sequence_attention(env)
    attention = named or run.attention or "sdpa"
    if named and run.attention and run.attention != named:
        refuse(f"--attention {run.attention} but parallelism_config_sp_attn_implementation {named}: sequence parallel "
               "runs the model's attention on the gathered heads; make them the same")
    if attention not in SEQUENCE_ATTENTION and "/" not in attention:
        refuse(f"sequence parallel cannot split {attention} attention (it needs the whole mask); use "
               f"--attention sdpa or flash_attention_2 (parallelism_config_sp_attn_implementation)")
    notes = [f"sequence parallel: each sequence split over {size} ranks (DeepSpeed Ulysses, {attention} attention), "
             f"{processes // size} data-parallel group(s)"]
    if named is None:
        env["PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION"] = attention
    if run.attention != attention:
        run = run.settled({"attention": (attention, "parallelism_config_sp_attn_implementation in the accelerate config"
                                         if named else "sequence parallel's attention")})
    return run, notes


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
    classes = env.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "")
    if classes.strip().startswith("["):  # a YAML list: accelerate splits its text at the commas, brackets and all
        import re

        env["FSDP_TRANSFORMER_CLS_TO_WRAP"] = ",".join(re.findall(r"[A-Za-z_][A-Za-z0-9_.]*", classes))
        notes.append(f"fsdp_transformer_layer_cls_to_wrap list -> {env['FSDP_TRANSFORMER_CLS_TO_WRAP']}")
    prefetch = env.pop("FSDP_BACKWARD_PREFETCH", None)
    forward = env.get("FSDP_FORWARD_PREFETCH", "false").lower() in TRUE
    if prefetch or forward:
        notes.append("prefetch: FSDP2 prefetches the next layer itself")
    if version == "1":
        notes.append("use_orig_params / sync_module_states: not needed by FSDP2")
    return notes


def translate_fsdp_activation_checkpointing(env, run: Run) -> tuple[Run, list[str]]:
    """FSDP's activation checkpointing wraps each layer in a module of its own, which renames the
    weights a LoRA adapter is saved under (and, without a wrap policy, has no layers to wrap).
    transformers' own checkpointing of each decoder layer keeps the same activations and the names."""
    offload = env.get("FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD", "false").lower() in TRUE
    if env.get("FSDP_ACTIVATION_CHECKPOINTING", "false").lower() not in TRUE:
        if offload:  # accelerate's plugin stops at it, after the model loaded
            refuse("fsdp_activation_checkpointing_offload needs fsdp_activation_checkpointing: true; delete the "
                   "offload line, or pass --gradient-checkpointing to the recipe")
        return run, []
    if run.gradient_checkpointing:
        return run, []  # asked twice: preflight refuses it in one line
    env["FSDP_ACTIVATION_CHECKPOINTING"] = "false"
    run = run.settled({"gradient_checkpointing": (1, "fsdp_activation_checkpointing in the accelerate config")})
    notes = ["fsdp_activation_checkpointing -> --gradient-checkpointing (transformers checkpoints each layer)"]
    if offload:
        env["FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD"] = "false"
        notes.append("fsdp_activation_checkpointing_offload: not done (the checkpointed activations stay on the GPU)")
    return run, notes


# --- the whole check --------------------------------------------------------------------------


def adapt_launch(run: Run, env=None, config_file: Path | None | str = "launcher",
                 on_gpu: bool | None = None) -> tuple[Run, list[str]]:
    """Check and translate the launch described by `env` (default: this process's environment)
    and the config file the launcher read. Returns the run with what the file settled, and the
    notes of what was translated."""
    run = Run.of(run)
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
    run, notes = translate_dynamo(env, run)
    fsdp_file = env.get("ACCELERATE_USE_FSDP", "false").lower() == "true"  # before NO_SHARD turns it into DDP
    if fsdp_file:
        notes += translate_fsdp(env, on_gpu)
        refuse_unsupported_parallelism(env, on_gpu)
    if tensor_parallel_size(env) > 1:
        notes += hand_tensor_parallel_to_transformers(env)
    elif fsdp_file:
        run, checkpointing = translate_fsdp_activation_checkpointing(env, run)
        notes += checkpointing
    if env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        source, config, renamed = deepspeed_source(env)
        notes += [f"renamed in {Path(source).name}: {', '.join(renamed)}"] if renamed else []
        run, settled = settle_deepspeed(config, source, run, env, on_gpu)
        notes += settled
        if sequence_parallel_size(env) > 1:
            run, sequence = settle_sequence_parallel(env, run)
            notes += sequence
    return run, notes
