"""The model's shape and its parameters: `ModelShape` (a Llama-style decoder, from its config.json),
`load_shape` (an offline alias, a config .json, a model folder or a hub id) and the parameter
counts of the LoRA adapters."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

# Offline aliases: the shipped configs (data/model_configs/<alias>.json), so the planner works without the hub.
ALIASES = {path.stem: path for path in sorted((REPO_ROOT / "data" / "model_configs").glob("*.json"))}
ALIASES["tiny-llama"] = REPO_ROOT / "data" / "tiny-llama-config.json"

# What the recipes' --model takes for each alias: the hub id of the model whose config.json it copies, or
# for tiny-llama the folder scripts/build_tiny_model.py writes (the recipes' default model).
HUB_IDS = {
    "codellama-34b": "codellama/CodeLlama-34b-hf",
    "gemma-2-27b": "google/gemma-2-27b",
    "gemma-2-9b": "google/gemma-2-9b",
    "llama-3.1-70b": "meta-llama/Llama-3.1-70B",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B",
    "mistral-7b": "mistralai/Mistral-7B-v0.3",
    "mixtral-8x7b": "mistralai/Mixtral-8x7B-v0.1",
    "phi-3-mini": "microsoft/Phi-3-mini-4k-instruct",
    "qwen2.5-32b": "Qwen/Qwen2.5-32B",
    "qwen2.5-72b": "Qwen/Qwen2.5-72B",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B",
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
    "tinyllama-1.1b": "TinyLlama/TinyLlama-1.1B-Chat-v1.0",
    "tiny-llama": "models/tiny-llama",
}
# A config .json is no model: its Launch line asks for the model it describes, in a word the shell leaves as it is.
MODEL_PLACEHOLDER = "YOUR_MODEL"
# Every Launch line asks for the user's data in this word (the recipes' default is the bundled toy task); the
# recipes refuse it, unreplaced, before anything reads the network.
DATASET_PLACEHOLDER = "YOUR_DATA"

# The seven linears of a Llama block, as transformers names them (peft's LoRA targets).
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# A mixture of experts' SwiGLU linears: one per expert (and one more per shared expert).
EXPERT_LINEARS = ("gate_proj", "up_proj", "down_proj")


@dataclass
class ModelShape:
    """A Llama-style decoder (Llama, Mistral, Qwen2, CodeLlama, ...): embedding, `layers` blocks of
    (RMSNorm, attention with q/k/v/o, RMSNorm, SwiGLU gate/up/down), a final norm and an lm_head.

    A mixture of experts (Mixtral, Qwen2/3-MoE, OLMoE) has `experts` SwiGLU blocks of width `ffn` per
    layer (and a shared one of width `shared_ffn`), a router, and sends each token through
    `experts_per_token` of them: every expert's weights are held, the active ones compute."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied_embeddings: bool = False
    head_dim: int | None = None  # None: hidden // heads
    attention_bias: bool = False
    mlp_bias: bool = False
    name: str = ""
    experts: int = 0  # 0: a dense model
    experts_per_token: int = 0
    shared_ffn: int = 0
    logits_after_head: bool = False  # a softcap or scale after the LM head (Gemma-2, Cohere, Granite)
    reads_images: bool = False  # the language model of a vision-language model (its config names a vision part)

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden // self.heads

    @classmethod
    def from_config(cls, config, name: str = "") -> "ModelShape":
        """From a transformers config object or a config.json dict (a multimodal config's text part)."""
        if not isinstance(config, dict):
            config = config.to_dict() if hasattr(config, "to_dict") else vars(config)
        reads_images = config.get("vision_config") is not None  # as model_config.vision_language decides
        # the text part where the top level lacks a decoder's sizes (PaliGemma's top-level hidden_size is its
        # projector's, beside no heads or layers)
        decoder = {"hidden_size", "num_attention_heads", "num_hidden_layers"}
        if not decoder <= set(config) and isinstance(config.get("text_config"), dict):
            config = config["text_config"]
        try:
            heads = int(config["num_attention_heads"])
            experts = int(config.get("num_local_experts") or config.get("num_experts") or config.get("n_routed_experts") or 0)
            experts = experts if experts > 1 else 0
            ffn = int(config.get("moe_intermediate_size") or config["intermediate_size"]) if experts else int(
                config["intermediate_size"])
            shared = int(config.get("shared_expert_intermediate_size") or 0) or (
                int(config.get("n_shared_experts") or 0) * ffn)
            return cls(
                hidden=int(config["hidden_size"]),
                layers=int(config["num_hidden_layers"]),
                heads=heads,
                kv_heads=int(config.get("num_key_value_heads") or heads),
                ffn=ffn,
                experts=experts,
                experts_per_token=int(config.get("num_experts_per_tok") or 0) if experts else 0,
                shared_ffn=shared if experts else 0,
                vocab=int(config["vocab_size"]),
                tied_embeddings=bool(config.get("tie_word_embeddings", False)),
                head_dim=config.get("head_dim") or None,
                attention_bias=bool(config.get("attention_bias", False)),
                mlp_bias=bool(config.get("mlp_bias", False)),
                name=name or str(config.get("_name_or_path") or ""),
                logits_after_head=bool(config.get("final_logit_softcapping")) or config.get("logit_scale") not in (
                    None, 1, 1.0) or config.get("logits_scaling") not in (None, 1, 1.0),
                reads_images=reads_images,
            )
        except KeyError as missing:
            raise ValueError(f"not a Llama-style decoder config: {missing} is missing") from None

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of the seven linears of one block."""
        h, q, kv, f = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.ffn
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}

    def shared_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of the shared expert's gate/up/down (none without one)."""
        h, s = self.hidden, self.shared_ffn
        return {"gate_proj": (h, s), "up_proj": (h, s), "down_proj": (s, h)} if s else {}

    @property
    def active_ffn(self) -> int:
        """The SwiGLU width a token passes through: its experts' (and the shared one's), or the dense one."""
        return self.ffn * self.experts_per_token + self.shared_ffn if self.experts else self.ffn

    def fused_expert_parameters_per_layer(self) -> int:
        """The experts' gate/up/down weights of one block (0 for a dense model). transformers holds them as
        fused 3-D tensors, which bitsandbytes does not quantize: QLoRA keeps them in the float dtype."""
        if not self.experts:
            return 0
        return sum(i * o * self.experts for name, (i, o) in self.linear_shapes().items() if name in EXPERT_LINEARS)

    def linear_parameters_per_layer(self) -> dict[str, int]:
        """in * out (+ out for a bias) for each linear of one block, times its copies (experts), with
        the shared expert's."""
        biased = {"q_proj": self.attention_bias, "k_proj": self.attention_bias, "v_proj": self.attention_bias,
                  "o_proj": self.attention_bias, "gate_proj": self.mlp_bias, "up_proj": self.mlp_bias,
                  "down_proj": self.mlp_bias}
        shared = self.shared_shapes()
        copies = {name: self.experts if self.experts and name in EXPERT_LINEARS else 1 for name in LINEAR_NAMES}
        return {name: (i * o + (o if biased[name] else 0)) * copies[name] + (
                    shared[name][0] * shared[name][1] if name in shared else 0)
                for name, (i, o) in self.linear_shapes().items()}

    def parameter_counts(self) -> dict:
        """The parameters split by kind:

        - embedding = vocab * hidden; lm_head = vocab * hidden, or 0 when tied to the embedding;
        - linear_per_layer: q = h*(a*d), k = v = h*(kv*d), o = (a*d)*h, gate = up = h*f, down = f*h;
          linear = their sum * layers;
        - norms = (2 * layers + 1) * hidden (two RMSNorm weights per block and the final norm).
        """
        per_layer = self.linear_parameters_per_layer()
        counts = {
            "embedding": self.vocab * self.hidden,
            "lm_head": 0 if self.tied_embeddings else self.vocab * self.hidden,
            "linear_per_layer": per_layer,
            "linear": sum(per_layer.values()) * self.layers,
            "norms": (2 * self.layers + 1) * self.hidden,
            "router": self.layers * self.hidden * self.experts,  # the experts' router (0 for a dense model)
        }
        counts["total"] = (counts["embedding"] + counts["lm_head"] + counts["linear"] + counts["norms"]
                           + counts["router"])
        return counts

    @property
    def parameters(self) -> int:
        """All parameters (a tied lm_head counted once)."""
        return self.parameter_counts()["total"]


def load_shape(model: str) -> ModelShape:
    """The shape of `model`: an offline alias (`ALIASES`: `llama-3.1-8b`, `mixtral-8x7b`, ...), a config
    .json, a local model folder (its config.json), or a hub id (from the hub cache, else from the hub when
    it can be reached: `transformers.AutoConfig.from_pretrained`)."""
    key = model.strip()
    path = ALIASES.get(key.lower(), Path(key).expanduser())
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return ModelShape.from_config(json.loads(path.read_text()), name=key)
    if key.endswith(".json") or key.startswith(("/", "./", "../", "~")):
        raise ValueError(f"no config at {key!r}; use an offline alias ({', '.join(ALIASES)}), a config .json, "
                         "a local model folder or a hub id")
    from transformers import AutoConfig

    try:
        cached = AutoConfig.from_pretrained(key, local_files_only=True)
    except Exception:  # noqa: BLE001  (not in the hub cache: ask the hub, if it can be reached)
        cached = None
    if cached is not None:
        return ModelShape.from_config(cached, name=key)
    if not hub_reachable():
        raise ValueError(f"{key!r} is not an offline alias, a local path or in the hub cache, and the hub cannot be "
                         f"reached from here; use an offline alias ({', '.join(ALIASES)}), a config .json or a "
                         "local model folder")
    try:
        config = AutoConfig.from_pretrained(key)
    except Exception as error:  # unknown id, gated repo, ...
        raise ValueError(
            f"cannot read the config of {key!r} ({type(error).__name__}: {_first_line(error)}); without the "
            f"network use an "
            f"offline alias ({', '.join(ALIASES)}), a config .json or a local model folder"
        ) from None
    return ModelShape.from_config(config, name=key)


def config_source(model: str) -> str:
    """What transformers' AutoConfig reads for the planner's `model` (`load_shape`'s): an alias's config .json,
    else the config .json, folder or hub id as given."""
    key = model.strip()
    return str(ALIASES.get(key.lower(), Path(key).expanduser()))


def launch_model(model: str) -> str:
    """What the recipes' --model takes for the planner's `model`: an alias's hub id (`HUB_IDS`, also for
    the alias's own config file), a folder or a hub id as given, a model folder's config.json its folder,
    and `MODEL_PLACEHOLDER` for another config .json (it holds no weights)."""
    key = model.strip()
    if key.lower() in HUB_IDS:
        return HUB_IDS[key.lower()]
    path = Path(key).expanduser()
    if path.is_file():
        alias = next((name for name, config in ALIASES.items() if config.resolve() == path.resolve()), None)
        if alias:
            return HUB_IDS[alias]
        return str(path.parent) if path.name == "config.json" else MODEL_PLACEHOLDER
    return str(path) if path.is_dir() else key  # a folder with ~ expanded: a quoted ~ would not be


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the hub (HF_ENDPOINT) answers a connection within `timeout_s`; False under HF_HUB_OFFLINE. Asked
    before a config download, whose retries take ~30 s to give up where there is no network."""
    import os
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "0").strip().lower() in ("1", "true", "yes", "on"):
        return False
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        with socket.create_connection((endpoint.hostname, endpoint.port or (443 if endpoint.scheme == "https" else 80)),
                                      timeout=timeout_s):
            return True
    except OSError:
        return False


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return text[0][:160] if text else "no message"


def lora_target_names(targets) -> list[str]:
    """`all-linear` (peft: every linear of the blocks, never lm_head), a comma-separated string
    or a list of module names (`q_proj` or a longer path ending in it; `lm_head` allowed)."""
    if targets is None or targets == "all-linear":
        return list(LINEAR_NAMES)
    if isinstance(targets, str):
        targets = targets.split(",")
    names = [str(name).strip().rsplit(".", 1)[-1] for name in targets if str(name).strip()]
    unknown = sorted(set(names) - set(LINEAR_NAMES) - {"lm_head"})
    if unknown or not names:
        raise ValueError(f"unknown LoRA target(s) {unknown or targets}: use all-linear or names among "
                         f"{', '.join(LINEAR_NAMES)}, lm_head")
    return list(dict.fromkeys(names))


def lora_parameters_per_layer(shape: ModelShape, rank: int, targets="all-linear") -> int:
    """LoRA parameters of one block: rank * (in + out) for each adapted linear (A is rank x in,
    B is out x rank), a shared expert's included.

    A mixture of experts: peft adapts each expert of transformers' fused weights, gate and up being one
    (hidden -> 2 x ffn) weight whose adapter gets twice the rank; all-linear adapts the router too."""
    wanted = lora_target_names(targets)
    h, f, e = shape.hidden, shape.ffn, shape.experts
    total = sum(rank * (i + o) for name, (i, o) in shape.linear_shapes().items()
                if name in wanted and not (e and name in EXPERT_LINEARS))
    total += sum(rank * (i + o) for name, (i, o) in shape.shared_shapes().items() if name in wanted)
    if e:
        total += 2 * rank * (h + 2 * f) * e if "gate_proj" in wanted and "up_proj" in wanted else 0
        total += rank * (f + h) * e if "down_proj" in wanted else 0
        total += rank * (h + e) if targets is None or targets == "all-linear" else 0
    return total


def lora_parameters(shape: ModelShape, rank: int, targets="all-linear") -> int:
    """Trainable adapter parameters: rank * (in + out) per adapted linear, over all layers
    (+ rank * (hidden + vocab) when `lm_head` is a target)."""
    head = rank * (shape.hidden + shape.vocab) if "lm_head" in lora_target_names(targets) else 0
    return lora_parameters_per_layer(shape, rank, targets) * shape.layers + head
