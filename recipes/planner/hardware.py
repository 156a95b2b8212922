"""The GPUs and links the time estimate knows: each GPU's memory, dense matmul peak, memory bandwidth
and usual interconnect (`GPUS`), and the bandwidth a collective reaches over each kind of link
(`collective_bandwidth`).

Every figure is a datasheet value or an assumption said as such; `scripts/plan.py` prints the ones a
plan used, and `--bandwidth` / `--mfu` replace the assumptions with what you measured (nccl-tests'
`busbw`, your own tokens per second).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

INTERCONNECTS = ("nvlink", "pcie", "network")


@dataclass(frozen=True)
class Gpu:
    """One GPU model. Peaks are dense (no sparsity) tensor-core figures with fp32 accumulation, which
    is what PyTorch's bf16 matmuls use; `fp32_tflops` without TF32 (PyTorch's default for matmuls)."""

    name: str
    memory_gb: float  # as the card is sold ("48 GB"): what the plan prints
    bf16_tflops: float
    fp32_tflops: float
    memory_gb_s: float  # HBM / GDDR bandwidth: the optimizer step and QLoRA's dequantisation are bound by it
    interconnect: str  # how several of them usually talk within a machine
    nvlink_gb_s: float = 0.0  # NCCL bus bandwidth over NVLink (~80% of the link's rate per direction)
    peer_to_peer: bool = True  # PCIe peer-to-peer; without it NCCL stages every transfer in host memory
    pcie_gen: int = 4
    # What CUDA gives a process of it, in GiB (torch.cuda.get_device_properties().total_memory / 2**30): what the
    # plan divides. Below the size sold: the driver keeps a part, and ECC on GDDR memory keeps 1/16.
    cuda_gib: float = 0.0

    def memory_gib(self, memory_gb: float | None = None) -> float:
        """GiB CUDA gives of this card, or of one like it sold with `memory_gb` (--gpu-memory): at the card's own
        ratio of given to sold."""
        if memory_gb is None or memory_gb == self.memory_gb:
            return self.cuda_gib
        return self.cuda_gib * memory_gb / self.memory_gb


# cuda_gib: measured on this project's lent GPUs (H100 79.2, H200 139.8: results/2026-11-26_h100_call1,
# results/2026-11-27_h200_call1); for the others the figure CUDA reports as their total capacity, with ECC as
# the cards ship (off on the workstation cards, on on the L40S: 46,068 of 49,140 MiB).
GPUS = {
    "h100": Gpu("H100 SXM", 80, 989, 67, 3350, "nvlink", nvlink_gb_s=360, pcie_gen=5, cuda_gib=79.2),
    "h200": Gpu("H200 SXM", 141, 989, 67, 4800, "nvlink", nvlink_gb_s=360, pcie_gen=5, cuda_gib=139.8),
    "a100": Gpu("A100 SXM 80GB", 80, 312, 19.5, 2039, "nvlink", nvlink_gb_s=240, cuda_gib=79.2),
    "a6000": Gpu("RTX A6000", 48, 154.8, 38.7, 768, "pcie", cuda_gib=47.5),
    # The Ada workstation and GeForce cards run NCCL without PCIe peer-to-peer (through host memory).
    "rtx6000-ada": Gpu("RTX 6000 Ada", 48, 364.2, 91.1, 960, "pcie", peer_to_peer=False, cuda_gib=47.5),
    "l40s": Gpu("L40S", 48, 362, 91.6, 864, "pcie", cuda_gib=44.4),
    "4090": Gpu("RTX 4090", 24, 165.2, 82.6, 1008, "pcie", peer_to_peer=False, cuda_gib=23.6),
}
DEFAULT_GPU = "h100"

# Assumed bus bandwidths (GB/s) of NCCL's collectives, the figure nccl-tests prints as busbw.
PCIE_PEER_TO_PEER = {4: 20.0, 5: 40.0}  # ~80% of a x16 link's rate per direction
PCIE_THROUGH_HOST = 8.0  # staged in host memory: each transfer crosses PCIe twice and is copied by the CPU
NETWORK = 10.0  # between machines: 100 Gb/s Ethernet or InfiniBand at ~80%
GPUS_PER_MACHINE = 8  # a collective over more GPUs than a machine holds crosses the network
HOST_LINK = {4: 20.0, 5: 40.0}  # one GPU's own copies to and from CPU RAM (the offload configs)
# The CPU's AdamW step of the offload configs: parameters per second on one rank's cores.
CPU_OPTIMIZER_PARAMS_PER_S = 0.5e9
# Share of the dense peak a training step's matmuls sustain, by default: tuned runs reach 40-58%
# (torchtitan, FSDP2 on A100/H100); the reference runs of docs/choosing.md ran at 6-14%. Measured here on one
# H200 (results/2026-11-28_h200_calls): TinyLlama-1.1B LoRA's epoch at the recipes' defaults 38.8%, CodeLlama-34B's
# LoRA step (every layer recomputed) 49.3%.
DEFAULT_MFU = 0.4


def _squashed(name: str) -> str:
    return "".join(character for character in name.lower() if character not in " -_")


def gpu_key(name: str) -> str:
    """The key in `GPUS` of a card given by its key or its own name, case and separators ignored
    (`RTX6000_Ada`, `RTX 6000 Ada` and `rtx6000-ada` are one card). An unknown name is refused in one line
    that names the closest known card and lists them all."""
    names = {_squashed(spelling): key for key, card in GPUS.items() for spelling in (key, card.name)}
    asked = _squashed(name)
    if asked in names:
        return names[asked]
    # The most similar spelling, and the cards whose name starts with the asked one or it with theirs
    # (`rtx6000`: rtx6000-ada as well as the similar a6000; `a100-80gb`: a100)
    similar = difflib.get_close_matches(asked, names, n=1, cutoff=0.5)
    related = [spelling for spelling in names
               if len(asked) >= 3 and (spelling.startswith(asked) or asked.startswith(spelling))]
    closest = list(dict.fromkeys(names[spelling] for spelling in similar + related))[:2]
    hint = f" (closest: {' or '.join(closest)})" if closest else ""
    raise ValueError(f"unknown GPU {name!r}{hint}; --gpu takes {', '.join(GPUS)} (for another card, the closest of "
                     "these with --gpu-memory, --mfu and --bandwidth)")


def card_of_device(device_name: str) -> str | None:
    """The key in `GPUS` of a device as torch names it (`NVIDIA H100 80GB HBM3`, `NVIDIA RTX 6000 Ada
    Generation`): the longest key or card name found in it, case and separators ignored; None for another card."""
    found = _squashed(device_name)
    spellings = sorted(((_squashed(spelling), key) for key, card in GPUS.items() for spelling in (key, card.name)),
                       key=lambda pair: -len(pair[0]))
    return next((key for spelling, key in spellings if spelling in found), None)


def gpu(name: str) -> Gpu:
    """A GPU of `GPUS` by its key or its name (`gpu_key`)."""
    return GPUS[gpu_key(name)]


def cards_of_memory(memory_gb: float) -> list[str]:
    """The keys of the known cards sold with `memory_gb` of memory."""
    return [key for key, card in GPUS.items() if card.memory_gb == memory_gb]


def collective_bandwidth(card: Gpu, interconnect: str | None = None) -> float:
    """Bus bandwidth in GB/s a collective reaches between these GPUs over `interconnect` (None: the
    card's usual one): the card's NVLink figure, PCIe peer-to-peer by generation or through host
    memory where the card has no peer-to-peer, or the network between machines."""
    interconnect = interconnect or card.interconnect
    if interconnect not in INTERCONNECTS:
        raise ValueError(f"interconnect must be one of {INTERCONNECTS}, not {interconnect!r}")
    if interconnect == "nvlink":
        if not card.nvlink_gb_s:
            raise ValueError(f"{card.name} has no NVLink between all its GPUs: use --interconnect pcie")
        return card.nvlink_gb_s
    if interconnect == "network":
        return NETWORK
    return PCIE_PEER_TO_PEER.get(card.pcie_gen, 20.0) if card.peer_to_peer else PCIE_THROUGH_HOST


def describe_link(card: Gpu, interconnect: str | None = None) -> str:
    """The link in words, as the plan prints it."""
    interconnect = interconnect or card.interconnect
    if interconnect == "pcie":
        return f"PCIe {card.pcie_gen}" + ("" if card.peer_to_peer else " through host memory (no peer-to-peer)")
    return {"nvlink": "NVLink", "network": "a network between machines"}[interconnect]
