"""Library notices nobody running the recipes can act on, silenced before the libraries load.

Every recipe imports this first. Each notice below is printed by every rank of every launch and
is about the library's own set-up; real warnings and errors still show.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from contextlib import contextmanager

# logger name -> start of the messages it drops
LOG_NOTICES = {
    # DeepSpeed, imported by accelerate or peft, announces that it found no GPU (run.json records the device)
    "DeepSpeed": ("Setting accelerator to CPU",),
    # bitsandbytes looks for an optional CPU kernel package on every import, also for LoRA and full runs
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward",),
    # FSDP x TP: torch's advice on the order of the mesh transformers builds
    "torch.distributed.tensor._redistribute": ("While redistributing",),
}
# deprecation notices about the libraries' internals, repeated at every step
WARNING_NOTICES = (
    r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
    r"`is_gradient_checkpointing` is deprecated",
    # torch 2.13 renames DDP's broadcast_buffers; accelerate only passes the old name, which still works
    r"`broadcast_buffers` is deprecated",
    # FSDP x TP: transformers' layers return views; nothing downstream edits them in place
    r"FSDP2-wrapped module .* returned a view tensor",
    # bitsandbytes' 8-bit matmul says at every layer of every step that it computes in fp16
    r"MatMul8bitLt: inputs will be cast",
    # a checkpoint read by parameter name: each rank reads a distributed checkpoint alone, on purpose (reshard.py)
    r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to load in a single",
)


# printed (not logged) by a library on every rank: the start of each such line
PRINTED_NOTICES = (
    # DeepSpeed on CPU processes builds its shared-memory collectives when it starts, and says so
    "DeepSpeed deepspeed.ops.comm.",
)


class DropNotices(logging.Filter):
    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


for name, starts in LOG_NOTICES.items():
    logging.getLogger(name).addFilter(DropNotices(starts))
for pattern in WARNING_NOTICES:
    warnings.filterwarnings("ignore", message=pattern)
# datasets' bars (tokenising, generating a split, mapping columns): the data line says what was read, and a long
# tokenising says so in one line first (data/tokens.py)
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
if int(os.environ.get("RANK", "0")) != 0:
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # one download bar per launch (rank 0's), not one per rank


def loading_bars_off() -> None:
    """transformers' "Loading weights" bar off (the recipe says what it loads in one line); the hub's download
    bars, which the same switch turns off, put back as they were. Called once transformers is imported."""
    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars
    from transformers.utils import logging as transformers_logging

    downloads_shown = not are_progress_bars_disabled()
    transformers_logging.disable_progress_bar()
    if downloads_shown:
        enable_progress_bars()


class DropPrinted:
    """sys.stdout without the lines that start with one of PRINTED_NOTICES (see `printed_notices_dropped`)."""

    def __init__(self, stream):
        self.stream, self.pending = stream, ""

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            if not line.startswith(PRINTED_NOTICES):
                self.stream.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


@contextmanager
def printed_notices_dropped():
    """What runs inside prints to stdout as before, less the library notices of PRINTED_NOTICES."""
    kept = sys.stdout
    sys.stdout = filtered = DropPrinted(kept)
    try:
        yield
    finally:
        sys.stdout = kept
        if filtered.pending and not filtered.pending.startswith(PRINTED_NOTICES):
            kept.write(filtered.pending)  # a last line without its newline yet
