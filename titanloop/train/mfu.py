"""MFU: model FLOP/s achieved over the device's bf16 dense peak, the one definition every reader uses (the
trainer's metrics, `python -m titanloop.checks`, benchmarks/gpu_throughput.py, also --vs-dense).

Model FLOPs per token are LoopLMConfig.flops_per_token (every loop counted; attention over the keys each query
attends to under document masking, from the batch's document lengths). The peak is the device's bf16 dense
tensor-core peak, float8 runs included (as torchtitan quotes it). A device whose peak is not known here (the CPU,
a GPU not in PEAKS) has no MFU: it reads n/a, never a number against some other device's peak.
"""

from __future__ import annotations

TFLOP = 1e12
# (substrings of the upper-cased device name, bf16 dense FLOP/s); the first entry whose substrings all occur wins,
# so the more specific names come first (GB200 before B200, H100 NVL before H100, H200 and GH200 before H20).
# The figures are torchtitan's get_peak_flops (torchtitan.tools.utils; tests/test_train_mfu.py holds the two
# equal). Why a table of our own: for a device it does not know, get_peak_flops returns an A100's peak, which would
# print a wrong MFU where this prints n/a, and it runs `lspci` on every call.
PEAKS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("GB200",), 2.5e15),
    (("GB300",), 2.5e15),
    (("B300",), 2.25e15),
    (("B200",), 2.25e15),
    (("H100", "NVL"), 835e12),
    (("H100", "PCIE"), 756e12),
    (("H100",), 989e12),  # SXM ("NVIDIA H100 80GB HBM3") and other variants
    (("H200",), 989e12),  # H200 and GH200
    (("H20",), 148e12),
    (("A100",), 312e12),
    (("A6000",), 154.85e12),
    (("L40S",), 362e12),
    (("MI355X",), 2500e12),
    (("MI325X",), 1300e12),
    (("MI300X",), 1300e12),
    (("MI250X",), 191.5e12),
)


def peak_flops(device_name: str) -> float | None:
    """The bf16 dense peak FLOP/s of a device by its name (torch.cuda.get_device_name), None when unknown."""
    name = device_name.upper()
    return next((peak for keys, peak in PEAKS if all(k in name for k in keys)), None)


def device_name(device_type: str) -> str:
    """The name the peak is looked up by: the CUDA device's own name on CUDA, else the device type ("cpu")."""
    if device_type == "cuda":
        import torch

        return torch.cuda.get_device_name(torch.cuda.current_device())
    return device_type


def mfu(flops_per_s: float, peak: float | None, ranks: int = 1) -> float | None:
    """Model FLOP/s of `ranks` devices together over their summed peak; None without a known peak."""
    return None if peak is None else flops_per_s / (peak * ranks)


def peak_text(name: str, peak: float | None) -> str:
    """What the trainer's startup line says about the peak MFU is quoted against."""
    if peak is None:
        return f"MFU n/a (no peak known for {name})"
    return f"MFU peak: {name} {peak / TFLOP:g} TFLOP/s bf16"
