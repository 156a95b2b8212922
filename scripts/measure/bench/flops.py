"""The arithmetic behind MFU: FLOP per token of a model shape, the peak per device, MFU itself."""

from __future__ import annotations

from bench.shapes import ModelShape

# Nominal peak of one CPU process (one core, fp32): 2 FMA units x 8 lanes x 2 FLOP x ~3 GHz ~ 0.1 TFLOP/s.
# A round figure, not a measurement; only the smoke run uses it.
CPU_NOMINAL_PEAK_TFLOPS = 0.1

# Dense bf16 tensor-core peak per GPU, TFLOP/s (no sparsity). Matched in order on the lower-cased
# torch.cuda.get_device_name(): the first entry whose words all occur in it wins.
PEAK_TFLOPS = (
    (("h100", "nvl"), 835.0, "H100 NVL"),
    (("h100", "pcie"), 756.0, "H100 PCIe"),
    (("h100",), 989.0, "H100 SXM"),
    (("h200",), 989.0, "H200"),
    (("gh200",), 989.0, "GH200"),
    (("a100",), 312.0, "A100"),
    (("rtx 6000 ada",), 364.0, "RTX 6000 Ada"),
    (("l40s",), 362.0, "L40S"),
)


def matmul_parameters(shape: ModelShape) -> int:
    """N: parameters that take part in a matmul per token: every block linear and the lm_head (it
    multiplies even when tied to the embedding); the embedding lookup and the norms are excluded."""
    return shape.parameter_counts()["linear"] + shape.vocab * shape.hidden


def flop_per_token(shape: ModelShape, seq_len: int, method: str = "lora", recompute: bool = False) -> float:
    """Training FLOP per token (performance.md). A = layers x hidden x seq_len (attention scores and
    values: 4 A forward, 8 A backward).

    - LoRA / QLoRA: 4N + 12A (forward 2N, backward input gradients 2N; the frozen base gets no weight
      gradients); with activation recompute 6N + 16A (one more forward).
    - full fine-tuning: 6N + 12A; with recompute 8N + 16A.
    The adapters' own matmuls (< 1% at r=16) are left out.
    """
    n = matmul_parameters(shape)
    a = shape.layers * shape.hidden * seq_len
    base = 6 * n if method == "full" else 4 * n
    if recompute:
        return base + 2 * n + 16 * a
    return base + 12 * a


def mfu(tokens_per_s_per_gpu: float, flop: float, peak_flops_per_gpu: float) -> float:
    """tokens/s x FLOP/token / (GPUs x peak), with tokens/s already per GPU."""
    return tokens_per_s_per_gpu * flop / peak_flops_per_gpu


def table_peak(device_name: str) -> tuple[float, str] | None:
    """(dense bf16 TFLOP/s, matched entry) for a GPU name, or None when it is not in the table."""
    name = device_name.lower()
    for words, tflops, label in PEAK_TFLOPS:
        if all(word in name for word in words):
            return tflops, label
    return None
