"""A vision-language model's processor: it turns a row's images into the model's pixel inputs and expands their
placeholders into image tokens (data/images.py calls it as the loader collates), and it is saved with the model."""

from __future__ import annotations

from pathlib import Path

from ..data.formats import DEFAULT_CHAT_TEMPLATE, lays_out_prompt, prefix_template
from .model_config import model_config_object, vision_language


def load(name: str, tokenizer, trust_remote_code: bool = False, config_from: str | None = None):
    """A vision-language model's processor (it turns a row's images into the model's pixel inputs and expands
    their placeholders), sharing the run's `tokenizer`; None for a model that reads text only. Where the
    processor's video part cannot load (it needs torchvision), the processor is built without it: images only.
    A tokenizer left with the plain default template takes the processor's chat template, or where the processor
    lays its prompt out itself and has none (PaliGemma), a template in that layout. `config_from`: the folder
    or id whose config says whether the model reads images (default `name`: an adapter folder has none)."""
    config = model_config_object(config_from or name, trust_remote_code)
    if config is None or not vision_language(config):
        return None
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(name, trust_remote_code=trust_remote_code)
    except ImportError as error:
        if "torchvision" not in str(error).lower():
            raise
        processor = without_video(name, config, trust_remote_code)
    if tokenizer.chat_template == DEFAULT_CHAT_TEMPLATE and getattr(processor, "chat_template", None):
        tokenizer.chat_template = processor.chat_template
    elif tokenizer.chat_template == DEFAULT_CHAT_TEMPLATE and lays_out_prompt(processor):  # PaliGemma's checkpoints
        tokenizer.chat_template = prefix_template(processor.image_token)
    processor.tokenizer, processor.chat_template = tokenizer, tokenizer.chat_template  # one template, saved with both
    return processor


def without_video(name: str, config, trust_remote_code: bool = False):
    """The model's processor built from its image processor and tokenizer, its video processor left out (it
    needs torchvision, which the images do not): Qwen2-VL's family, for one."""
    from unittest import mock

    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES
    from transformers.processing_utils import ProcessorMixin
    import transformers

    processor_class = getattr(transformers, PROCESSOR_MAPPING_NAMES[config.model_type])
    check = ProcessorMixin.check_argument_for_proper_class
    template = Path(name) / "chat_template.jinja"
    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class",
                           lambda self, key, value: None if value is None else check(self, key, value)):
        return processor_class(
            image_processor=AutoImageProcessor.from_pretrained(name, trust_remote_code=trust_remote_code),
            tokenizer=AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code),
            video_processor=None, chat_template=template.read_text() if template.is_file() else None,
            **settings(processor_class, name, trust_remote_code))


def settings(processor_class, name: str, trust_remote_code: bool = False) -> dict:
    """The processor's own settings in its processor_config.json (SmolVLM's image_seq_len, for one), as
    `from_pretrained` reads them (`get_processor_dict`: a folder or a hub id): what its class takes beside its
    parts."""
    try:
        found = processor_class.get_processor_dict(name, trust_remote_code=trust_remote_code)[0]
    except OSError:  # a hub id that cannot be reached: the class's defaults
        return {}
    return {key: value for key, value in found.items() if key not in PARTS}


PARTS = ("processor_class", "image_processor", "video_processor", "tokenizer", "chat_template", "auto_map")


def save(processing, path) -> None:
    """The run's tokenizer, or a vision-language model's processor, saved where from_pretrained (and `load`) finds
    it. A processor built `without_video` saves its parts (its own save_pretrained stops at the missing one): the
    tokenizer, the image processor, the chat template, and its class named in processor_config.json."""
    import json

    if getattr(processing, "video_processor", False) is not None:  # a tokenizer, or a whole processor
        processing.save_pretrained(path)
        return
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    processing.tokenizer.save_pretrained(path)
    processing.image_processor.save_pretrained(path)
    own = {key: value for key, value in processing.to_dict().items() if key not in PARTS}
    (path / "processor_config.json").write_text(
        json.dumps({"processor_class": type(processing).__name__, **own}, indent=2) + "\n")
    if processing.chat_template:
        (path / "chat_template.jinja").write_text(processing.chat_template)
