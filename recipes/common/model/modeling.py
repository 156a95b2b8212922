"""Loading the model so that it suits the strategy: dtype, device placement and quantisation."""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import os
import subprocess
import sys
from pathlib import Path

import torch

from ..data.formats import DEFAULT_CHAT_TEMPLATE
from ..quiet import loading_bars_off
from ..refusal import refuse
from .model_config import (DEFAULT_MODEL, REPO_ROOT, bits_config, default_model_needs_building, empty_model,
                           is_default_model, model_class, model_config_object, unquantized_modules,
                           vision_language)
from .pipeline_layout import layout_of
from .stage_loading import load_stage, refuse_a_changed_forward
from .vision import linear_layers, tower_linears, vision_parameters

def ensure_default_model(name: str, accelerator) -> None:
    """Build the bundled tiny model the first time it is asked for (random init, a few seconds)."""
    if not is_default_model(name):
        return
    with accelerator.local_main_process_first():
        if accelerator.is_local_main_process and default_model_needs_building():
            builder = REPO_ROOT / "scripts" / "build_tiny_model.py"
            subprocess.run([sys.executable, str(builder), "--output-dir", str(DEFAULT_MODEL)], check=True)


def load_tokenizer(name: str, trust_remote_code: bool = False, chat_template: str | None = None):
    """The model's tokenizer, with a pad token, and a chat template: the file `chat_template` when given,
    else its own, else the plain default."""
    from transformers import AutoTokenizer

    template = None
    if chat_template:
        try:
            template = Path(chat_template).expanduser().read_text()
        except (OSError, UnicodeDecodeError) as error:
            refuse(f"--chat-template {chat_template} cannot be read ({type(error).__name__}: "
                   f"{getattr(error, 'strerror', None) or error}); give a Jinja template file")

    try:
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:  # offline hub id, no tokenizer files, a tokenizer library missing
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        refuse(f"--model {name}: its tokenizer cannot be loaded ({reason[:200]}); give a folder holding the "
               "model's tokenizer files, or a hub id that is downloaded (or reachable)")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if template is not None:
        tokenizer.chat_template = template
    if tokenizer.chat_template is None:  # chat rows are rendered with it; saved with the tokenizer, it travels along
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    return tokenizer


def lora_targets(model, targets, vision_tower: bool = False):
    """peft's target_modules: `targets` ("all-linear" or layer names) as given, and for a vision-language model the
    full names of those linear layers of its language model, and with `vision_tower` of its vision tower too (not
    of its projector, which trains whole: vision.projector_modules). Without, the vision side stays frozen."""
    if not vision_language(model.config):
        return targets
    decoder = model.get_decoder()
    prefix = next(name for name, module in model.named_modules() if module is decoder)
    return linear_layers(decoder, prefix, targets) + (tower_linears(model, targets) if vision_tower else [])


def freeze_vision_parts(model, vision_tower: bool = False, projector: bool = False) -> int:
    """Full fine-tuning of a vision-language model trains its language model (and LM head); its vision tower and
    projector stay as loaded, as peers default to, unless `vision_tower` / `projector` asks them trained too (the
    tower's modules the model never reads stay frozen: vision.unread_modules). Returns how many parameters were
    frozen (0 for a text model)."""
    if not vision_language(model.config):
        return 0
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    kept = {id(param) for module in (decoder, head) for param in module.parameters()}
    parts = vision_parameters(model)
    kept |= {id(param) for part, wanted in (("tower", vision_tower), ("projector", projector)) if wanted
             for param in parts[part]}
    frozen = [param for param in model.parameters() if id(param) not in kept]
    for param in frozen:
        param.requires_grad_(False)
    return sum(param.numel() for param in frozen)


def load_model(name: str, accelerator, launch, *, frozen: bool, quantization=None, trust_remote_code: bool = False,
               attention: str | None = None, liger: bool = False):
    """The model placed for the launched strategy, with the attention kernel asked for (default:
    transformers' choice, SDPA) and, with `liger`, Liger's Triton kernels for the layers patched in.

    - model parallel: `device_map="auto"` spreads the layers over the visible GPUs;
    - quantised weights under DDP / ZeRO-1/2: each process loads its own copy on its device;
    - tensor parallel (with FSDP across the groups): transformers splits (and shards) the layers as
      they load, over the launch's processes;
    - FSDP with `fsdp_cpu_ram_efficient_loading` (fsdp.yaml): every process builds the model with unread
      weights (`shape_only`) and reads its shards from the files once `accelerator.prepare` has sharded it
      (shard_loading); where the files do not allow it, the main process alone reads the weights and
      `accelerator.prepare` sends each process its shards;
    - ZeRO-3 with zero3_init_flag (on unless a config turns it off): the main process alone reads the
      weights, the others build the model with unread weights, and `partition_for_zero3` hands each
      process its partitions from the main one's, a tensor at a time (with it off, every process reads the
      whole model, then partitions it); 4-bit weights load under transformers' own `zero.Init`;
    - everything else loads on CPU and `accelerator.prepare` places or shards it.
    Host RAM per machine at load: planner.load_bytes_per_machine, printed in the `plan:` line.
    """
    loading_bars_off()
    if accelerator.is_main_process:  # one line for the wait (transformers' bar is off)
        print(f"model: loading the weights of {name}", flush=True)
    # where loading frees layers as it goes (read or sent as shards, partitioned, quantized) or leaves unread
    # weights behind: their memory is given back rather than reused, page by page, by later steps
    if (launch.reads_shards or launch.main_process_loads or launch.zero_stage == 3
            or quantization is not None):
        hand_freed_tensors_back_to_the_host()
    kwargs = dict(dtype=launch.float_dtype(frozen), use_safetensors=True, trust_remote_code=trust_remote_code)
    if attention is not None:
        kwargs["attn_implementation"] = attention
    if launch.spreads_layers:
        kwargs["device_map"] = "auto"
    if launch.tensor_parallel > 1:
        from transformers.distributed import DistributedConfig

        sizes = dict(tp_size=launch.tensor_parallel)
        if launch.data_parallel_size > 1:  # FSDP over the groups (transformers >= 5.18; checked before)
            sizes["fsdp_size"] = launch.data_parallel_size
        kwargs["distributed_config"] = DistributedConfig(**sizes)
    if quantization is not None:
        kwargs["quantization_config"] = quantization
        if not launch.shards_parameters and not launch.spreads_layers:
            kwargs["device_map"] = {"": accelerator.device}
    model = None
    zero3_partitions_here = launch.zero_stage == 3 and launch.loading is not None
    with built_whole(accelerator) if zero3_partitions_here else contextlib.nullcontext():
        if launch.pipeline_stages > 1:  # each process reads only its stage's weights where the files allow
            model = load_pipeline_stage(name, accelerator, launch, kwargs, quantized=quantization is not None)
        if launch.reads_shards or (launch.main_process_loads and quantization is None and not accelerator.is_main_process):
            # one copy of the weights in host RAM, not one per process: each process reads its rows of the
            # weights once accelerator.prepare has sharded the model, or receives them from the main process
            # (there, or for ZeRO-3 just below; 4-bit weights are quantized as each process loads)
            model = shape_only(name, kwargs)
        if model is None:
            model = model_class(model_config_object(name, trust_remote_code)).from_pretrained(name, **kwargs)
    if zero3_partitions_here:
        partition_for_zero3(model)
    if quantization is not None and not quantized_weights(model):  # preflight's check, confirmed on what loaded
        refuse(f"bitsandbytes quantized none of {name}'s layers while it loaded, so qlora.py would train plain "
               "LoRA on a full-precision base; use recipes/lora.py")
    if quantization is not None and not launch.on_gpu:
        keep_4bit_weights_unpacked_on_cpu(model)
    if liger:  # RMSNorm, RoPE, SwiGLU; not Liger's loss: the recipe's own loss runs chunk by chunk (loss_head)
        from transformers.integrations.liger import apply_liger_kernel

        apply_liger_kernel(model, {"fused_linear_cross_entropy": False, "cross_entropy": False})
    accept_logits_to_keep(model)
    keep_present_layer_classes(model)
    return model


def keep_present_layer_classes(model) -> None:
    """The layer classes FSDP wraps as units (the model's `_no_split_modules`, which accelerate reads) cut to those
    the model holds: a vision-language model inherits its towers' lists whole (LLaVA's CLIP vision tower names
    CLIP's text embeddings too), and accelerate stops at a class it cannot find."""
    classes = getattr(model, "_no_split_modules", None)
    if classes:
        present = {type(module).__name__ for module in model.modules()}
        model._no_split_modules = {name for name in classes if name in present}


@contextlib.contextmanager
def built_whole(accelerator):
    """transformers builds and loads the model whole while this lasts, not partitioned under DeepSpeed's
    zero.Init: accelerate (1.15) hands transformers the ZeRO-3 config whatever zero3_init_flag says, and that
    path gathers and re-partitions every layer to load it, after broadcasting its random start."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        accelerator.state.deepspeed_plugin.set_deepspeed_weakref()  # as accelerate left it


def partition_for_zero3(model) -> None:
    """ZeRO-3's partitions of `model`, a parameter at a time: DeepSpeed broadcasts each from the main process
    (the others hold unread weights, or the same ones) and keeps this process's part, freeing the whole
    tensor before the next. Done here, not in accelerator.prepare: DeepSpeed's engine would broadcast every
    whole parameter first, all of them held at once."""
    import deepspeed
    from transformers.integrations.deepspeed import deepspeed_config

    deepspeed.zero.Init(module=model, config_dict_or_path=deepspeed_config())


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def hand_freed_tensors_back_to_the_host() -> None:
    """Tensors of 1 MiB and more get memory maps of their own, returned to the system when freed.

    Loading frees tensors as it goes (each whole layer once sharded, partitioned or converted, or the
    unread weights FSDP's shards were read beside). glibc otherwise raises its threshold towards 32 MiB
    as such blocks are freed, serves the next ones from its heap, and a heap left holed keeps the freed
    memory, or touches the unread holes page by page as later steps reuse them: a ZeRO-3 rank of a 0.78B
    model measured from 2.7 to 4.5 GiB from one launch to the next, 2.4 GiB every time with the threshold
    fixed (results/2026-11-27_cpu_load-memory); FSDP's ranks reading their shards 2.3 GiB at start-up either
    way but 5.0-5.4 GiB after the first step without it, 2.7 with it. The price: freed layers' pages are
    faulted in anew. Tensors above 32 MiB (a large model's) glibc maps alone anyway. A no-op where the C
    library is not glibc.
    """
    try:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 1 << 20)
    except (OSError, AttributeError):
        pass


def pretrained_config(name: str, trust_remote_code: bool):
    """Model `name`'s config as from_pretrained reads it (the checks' cached copy where they read one)."""
    from transformers import AutoConfig

    return model_config_object(name, trust_remote_code) or AutoConfig.from_pretrained(
        name, trust_remote_code=trust_remote_code)


def shape_only(name: str, kwargs: dict):
    """Model `name` as from_pretrained with `kwargs` builds it, its weights left unread: each parameter an
    uninitialised tensor (address space the process never touches, so no memory), whose shards
    `accelerator.prepare` fills (shard_loading, or the main process's weights). Not the meta device:
    accelerate tells the optimizer's parameters apart by their addresses."""
    trust = kwargs["trust_remote_code"]
    model = empty_model(pretrained_config(name, trust), trust, kwargs.get("attn_implementation"), dtype=kwargs["dtype"])
    unread = {}  # one tensor per parameter, tied ones included
    for module in model.modules():
        for key, param in module._parameters.items():
            if param is not None:
                if id(param) not in unread:
                    unread[id(param)] = torch.nn.Parameter(torch.empty_like(param, device="cpu"),
                                                           requires_grad=param.requires_grad)
                module._parameters[key] = unread[id(param)]
    model.tie_weights()  # as from_pretrained ties them (an LM head that is the embedding, GPT-2's)
    model.eval()  # as from_pretrained leaves it
    return model


def load_pipeline_stage(name: str, accelerator, launch, kwargs: dict, quantized: bool):
    """Pipeline parallel: this process's stage of the model, its weights alone read from the files; None
    (said once) where the whole model must load first, as for every other strategy, and be cut after.
    Either way the stages' forward is checked first (a refusal before any weight loads)."""
    trust, attention = kwargs["trust_remote_code"], kwargs.get("attn_implementation")
    config = pretrained_config(name, trust)
    refuse_a_changed_forward(empty_model(config, trust, attention))
    if quantized:
        why = "bitsandbytes quantizes the weights as the whole model loads"
    else:
        layers = config.get_text_config().num_hidden_layers
        model, why = load_stage(name, empty_model(config, trust, attention), layout_of(accelerator, launch, layers),
                                kwargs["dtype"])
        if model is not None:
            return model
    if accelerator.is_main_process:
        print(f"pipeline: every process loads the whole model, then keeps its stage: {why}", flush=True)
    return None


def router_loss_weight(model) -> float:
    """The weight of a mixture of experts' load-balancing loss (`router_aux_loss_coef`) when its config asks
    for it (`output_router_logits`, on which transformers adds it to the loss it computes), else 0."""
    config = model.config
    if not getattr(config, "output_router_logits", False):
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def accept_logits_to_keep(model) -> None:
    """Give `logits_to_keep` to a model whose forward lacks it (remote code, a few transformers
    classes), so the recipes' loss runs on any model: it computes every position's logits and keeps
    the ones asked for (the same loss, without the saving). Transformers' meaning: an int keeps the
    last N positions (0: all), a 1-D tensor keeps those positions.
    """
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        return
    forward = model.forward

    def forward_keeping_logits(*args, logits_to_keep=0, **kwargs):
        outputs = forward(*args, **kwargs)
        kept = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        outputs.logits = outputs.logits[:, kept]
        return outputs

    model.forward = forward_keeping_logits


def checkpoint_activations(model, every_n_layers: int) -> None:
    """Recompute every Nth decoder layer's activations in the backward instead of keeping them.

    transformers 5.23 named it `activation_checkpointing_enable`; 5.17 to 5.22 call it
    `gradient_checkpointing_enable` with the same arguments (the old name warns from 5.23 on).
    """
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable(every_n_layers=every_n_layers)


def compile_cache_dir() -> str:
    """Where inductor keeps compiled kernels between launches: TORCHINDUCTOR_CACHE_DIR when set, else
    <torch home>/inductor (~/.cache/torch/inductor), not torch's default under /tmp, which a machine or a
    job scheduler may clear between runs."""
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(os.path.dirname(torch.hub.get_dir()), "inductor")


def compile_layers(model) -> None:
    """torch.compile every decoder layer in place (regional compilation), its kernels cached in
    compile_cache_dir() so that the next launch of the same shapes compiles faster.

    The layers share one compiled graph, so compiling costs about one layer's time, not the
    model's. In place, the module tree stays as it was: DDP, FSDP2 and DeepSpeed wrap it, hooks
    still fire, and checkpoints and exports keep their parameter names.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = compile_cache_dir()  # read by inductor when it first compiles

    layers = [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]
    if not layers:  # remote code without transformers' layer class: the whole model, and one graph per shape
        from accelerate import PartialState

        if PartialState().is_main_process:
            print(f"compile: {type(model).__name__} has no transformers decoder-layer class; compiling the whole "
                  "model (slower to compile, recompiled for every new sequence length)", flush=True)
    for layer in layers or [model]:
        layer.compile()


def keep_4bit_weights_unpacked_on_cpu(model) -> None:
    """bitsandbytes repacks 4-bit weights in place for a bf16 CPU kernel the first time a module
    runs in eval mode. Under FSDP the repacked buffer is thrown away at the next reshard while
    the layout flag stays, which corrupts later forwards; the plain path computes the same in fp32."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def seed_adapter(model, seed: int) -> None:
    """Draw the adapter's first values again, from the seed alone.

    peft draws them while it builds the adapter, and how many random numbers the building takes
    depends on the layout (under tensor parallel it builds split layers), so without this each
    strategy would start from a different adapter and a different random stream (dropout). Each layer
    draws from the seed and its own name: a pipeline stage, which holds some of the layers, draws
    theirs as one process does."""
    import zlib

    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            torch.manual_seed((seed << 32) ^ zlib.crc32(name.encode()))
            for adapter in module.lora_A:
                module.reset_lora_parameters(adapter, init_lora_weights=True)  # A: kaiming, B: zeros
    torch.manual_seed(seed)  # the random stream after it (dropout) the same on every layout


def keep_adapter_inputs_in_compute_dtype(model, launch) -> bool:
    """Under mixed precision, no float32 copy of each adapted layer's input (and dropout's second one), forward
    and backward:
    - where the forward runs under autocast (`launch.autocasts`), peft's cast of the input to the adapter's
      float32 is switched off: autocast runs the adapter's matmuls in 16 bits either way (the same numbers);
      the weights stay float32 for the optimizer;
    - under DeepSpeed's bf16 / fp16 (no autocast) the adapters take DeepSpeed's dtype, as DeepSpeed gives every
      other weight, keeping their float32 master copy in its optimizer: ZeRO-3 leaves in float32 the adapters
      peft adds after its zero.Init, where ZeRO-1/2 cast them themselves (ZeRO-3 now computes as they do).
    True where either applies."""
    if launch.autocasts:
        from peft.tuners.tuners_utils import BaseTunerLayer

        for module in model.modules():
            if isinstance(module, BaseTunerLayer):
                module.cast_input_dtype_enabled = False
        return True
    if launch.casts_weights:
        dtype = torch.bfloat16 if launch.precision == "bf16" else torch.float16
        for param in model.parameters():
            if param.requires_grad and param.dtype == torch.float32:
                param.data = param.data.to(dtype)
        return True
    return False


@contextlib.contextmanager
def adapters_off(model):
    """The base model alone: peft's `disable_adapter`, with the adapters still marked as trained. peft marks them
    frozen while they are off, and FSDP2 settles each parameter group's gradient dtype at the first forward from
    the parameters that train then: a first forward with the adapters off (the DPO reference's pass) left their
    bf16 gradients uncast for their float32 weights, which torch refuses in the first backward."""
    trained = [param for param in model.parameters() if param.requires_grad]
    with model.disable_adapter():
        for param in trained:
            param.requires_grad_(True)  # under no_grad, as the reference runs, nothing is recorded for them
        yield


def trained_parameter_groups(model) -> list[dict]:
    """The trained parameters, as optimizer groups of one kind each: plain tensors, and DTensors per
    device mesh (tensor parallel splits some weights and leaves others whole; a fused optimizer
    kernel cannot mix them). One group where there is one kind."""
    from torch.distributed.tensor import DTensor

    groups = {}
    for param in model.parameters():
        if param.requires_grad:
            mesh = param.device_mesh if isinstance(param, DTensor) else None
            key = None if mesh is None else (mesh.mesh_dim_names, tuple(mesh.mesh.flatten().tolist()))
            groups.setdefault(key, []).append(param)
    return [{"params": params} for params in groups.values()]


def parameter_counts(model) -> dict:
    """Elements of all parameters, of the trainable ones, and of those this rank holds.

    FSDP2 parameters are DTensors (numel is global, the local shard is `to_local()`); ZeRO-3
    keeps the full size in `ds_numel` and this rank's partition in `ds_tensor`.
    """
    from torch.distributed.tensor import DTensor

    total = trainable = held = 0
    for param in model.parameters():
        if hasattr(param, "ds_tensor"):
            full, local = param.ds_numel, param.ds_tensor.numel()
        elif isinstance(param, DTensor):
            full, local = param.numel(), param.to_local().numel()
        else:
            full = local = param.numel()
        total += full
        held += local
        trainable += full if param.requires_grad else 0
    return {"total": total, "trainable": trainable, "held_by_this_rank": held, "quantized": quantized_weights(model)}


def quantized_weights(model) -> int:
    """Weights (elements, before packing) that bitsandbytes layers of `model` hold quantized."""
    return sum(module.in_features * module.out_features for module in model.modules()
               if type(module).__module__.startswith("bitsandbytes") and type(module).__name__ in ("Linear4bit", "Linear8bitLt"))


def quantization_config(launch, bits: int, model: str | None = None, trust_remote_code: bool = False):
    """NF4 with double quantisation (QLoRA), or 8-bit, computing in the run's float dtype; a vision-language
    `model`'s vision tower and projector left in it (model_config.unquantized_modules).

    Under FSDP and ZeRO-3 the packed 4-bit weights are stored in that float dtype too: both
    shard flat tensors of one dtype, and integer storage breaks them (or silently zeroes the loss).
    """
    compute_dtype = launch.float_dtype(frozen=True)
    storage = compute_dtype if launch.shards_parameters else torch.uint8
    keep = unquantized_modules(model, trust_remote_code) if model else None
    return bits_config(bits, compute_dtype, storage, keep)
