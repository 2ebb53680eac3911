"""Peak arithmetic rates of known devices, keyed by the name CUDA reports (matched by substring).

Vendor datasheet numbers, dense (no sparsity). An unknown device has no entry, and then the kit
reports no MFU rather than guessing.
"""
from __future__ import annotations

import ctypes
import os

NVML_LIBRARY = "libnvidia-ml.so.1"  # NVIDIA's management library, installed with its driver
ROCM_DEVICE = "/dev/kfd"  # AMD's compute driver, which ROCm's torch.cuda runs on

# name fragment -> (FP64, FP32, FP16/BF16 tensor-core) TFLOP/s; the first match wins, so more
# specific fragments come first.
PEAK_TFLOPS: list[tuple[str, float, float, float]] = [
    ("H200", 34.0, 67.0, 989.0),
    ("H100 PCIe", 26.0, 51.0, 756.0),
    ("H100", 34.0, 67.0, 989.0),
    ("A100", 9.7, 19.5, 312.0),
    ("V100", 7.8, 15.7, 125.0),
]

# name fragment -> CUDA compute capability (major), from NVIDIA's CUDA GPUs table: bf16 arithmetic
# starts at 8 (Ampere), torch's own test without emulation (torch/cuda/__init__.py, is_bf16_supported)
COMPUTE_CAPABILITY: list[tuple[str, int]] = [("H200", 9), ("H100", 9), ("A100", 8), ("V100", 7)]
BF16_CAPABILITY = 8


def capability_of(device_name: str) -> int | None:
    """The compute capability (major) of a device named like "V100-16GB" or CUDA's "Tesla V100-SXM2-16GB"."""
    return next((major for fragment, major in COMPUTE_CAPABILITY if fragment in device_name), None)


def automatic_precision(device_type: str, capability: int | None = None) -> str:
    """What `train.precision: auto` trains with on a device: bf16 where the device computes in bf16, fp16 on
    GPUs that do not (the paper's V100s, capability 7: fp16 with loss scaling, as Megatron-LM and DeepSpeed
    trained there). CPUs: bf16, torch's CPU autocast dtype (torch.get_autocast_dtype("cpu")); fp16 on a CPU
    needs AVX512-FP16 or AMX-FP16 (torch.ops.mkldnn._is_mkldnn_fp16_supported), bf16 runs on any. A GPU of
    unknown capability (None) is taken as today's GPUs are: bf16."""
    if device_type == "cuda" and capability is not None and capability < BF16_CAPABILITY:
        return "fp16"
    return "bf16"


# The paper's Table 2, as published (memory per node: 4 x 16 GB V100 on Lassen, 8 x 40 GB A100 on ThetaGPU).
PAPER_PLATFORMS = [
    {"platform": "Lassen (paper)", "nodes": 795, "cpu": "IBM Power9", "cores_per_node": 44, "gpu": "NVIDIA V100",
     "gpus_per_node": 4, "cpu_memory_gb": 256, "gpu_memory_gb": 64, "gpu_fp64_tflops": 7.0},
    {"platform": "ThetaGPU (paper)", "nodes": 24, "cpu": "AMD Rome", "cores_per_node": 64, "gpu": "NVIDIA A100",
     "gpus_per_node": 8, "cpu_memory_gb": 1024, "gpu_memory_gb": 320, "gpu_fp64_tflops": 9.7},
]


def paper_gpu_memory() -> dict[str, float]:
    """Memory of one GPU of each of the paper's platforms, from Table 2 (per node / GPUs per node), named
    as `repro predict` names devices ("V100-16GB"); GiB, since HBM stacks come in binary sizes (a 16 GB
    V100 holds 16 GiB)."""
    return {f"{row['gpu'].split()[-1]}-{row['gpu_memory_gb'] / row['gpus_per_node']:g}GB":
            row["gpu_memory_gb"] / row["gpus_per_node"] for row in PAPER_PLATFORMS}


# GPU memory of the devices `repro predict` checks fits against by default, GiB: the paper's GPUs (Table 2)
# and today's (vendor datasheets: the H100 SXM 80 GB, the H200 141 GB)
GPU_MEMORY_GIB = {**paper_gpu_memory(), "H100-80GB": 80.0, "H200-141GB": 141.0}


def peak(device_name: str) -> tuple[float, float, float] | None:
    """(FP64, FP32, 16-bit tensor) peak TFLOP/s of `device_name`, or None for a device not in the table."""
    for fragment, *rates in PEAK_TFLOPS:
        if fragment in device_name:
            return tuple(rates)
    return None


def mfu(device_name: str, precision: str, flops_per_s: float) -> float | None:
    """Model FLOPs utilisation against the device's peak for `precision`; None for an unknown device."""
    rates = peak(device_name)
    if rates is None:
        return None
    return flops_per_s / (1e12 * (rates[1] if precision == "fp32" else rates[2]))


def cpu_model() -> str:
    import platform

    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_gb() -> float:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("nan")


def gpu_count() -> int:
    """CUDA devices this process can use (0 without CUDA).

    Where no GPU driver is installed there are none, and torch is not imported to say so (2 s), so the
    parent of a run of CPU stand-ins stays free of torch: no NVIDIA driver library (libnvidia-ml.so.1,
    through which torch.cuda.device_count counts first, torch/cuda/__init__.py `_raw_device_count_nvml`)
    and no AMD kernel driver (/dev/kfd, for ROCm's torch). Otherwise torch counts them."""
    if not os.path.exists(ROCM_DEVICE):
        try:
            ctypes.CDLL(NVML_LIBRARY)
        except OSError:
            return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_capability() -> int | None:
    """Compute capability (major) of this machine's first CUDA device (None without CUDA)."""
    import torch

    return torch.cuda.get_device_capability(0)[0] if torch.cuda.is_available() else None


def gpu_memory_bytes() -> int:
    """Memory of this machine's first CUDA device (0 without CUDA)."""
    import torch

    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0


def cpu_computes_fp16() -> bool:
    """Whether oneDNN computes fp16 on this CPU (torch.ops.mkldnn._is_mkldnn_fp16_supported: AVX512-FP16 or
    AMX-FP16 on x86; an AMD EPYC with AVX-512 has neither): the test DeepSpeed's CPU accelerator makes before it
    trains fp16 (deepspeed/accelerator/cpu_accelerator.py, is_fp16_supported), reading any failure as no.
    Imports torch (2 s), so only a run that asks for fp16 on CPU calls it."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:  # noqa: BLE001 - DeepSpeed's test reads any failure as no, so the refusal matches it
        return False


def cpu_cores() -> int:
    """Cores this process may run on (its affinity: what a container or `taskset` grants, not the host's;
    all of the host's where the system has no affinity, as on macOS)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def this_platform(nodes: int) -> dict[str, object]:
    """Table 2's row for the machine the runs used (nodes from the run tags)."""
    row: dict[str, object] = {"platform": "this machine", "nodes": nodes, "cpu": cpu_model(),
                              "cores_per_node": os.cpu_count(), "cpu_memory_gb": round(memory_gb())}
    if gpu_count():
        import torch

        name = torch.cuda.get_device_name(0)
        count = torch.cuda.device_count()
        rates = peak(name)
        row.update(gpu=name, gpus_per_node=count,
                   gpu_memory_gb=round(count * torch.cuda.get_device_properties(0).total_memory / 2**30),
                   gpu_fp64_tflops=rates[0] if rates else "unknown device")
    else:
        row.update(gpu="none (CPU processes stand in)", gpus_per_node=0, gpu_memory_gb=0, gpu_fp64_tflops="n/a")
    return row
