"""The environment report: versions, devices and data, for `repro doctor` and every run's record."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import runpy
import subprocess
from pathlib import Path
from typing import Any

from repro import hardware, registry

MEASURED = Path(__file__).resolve().parent.parent / "docs" / "measured"  # GPU results, committed with device and date
# Code paths that run only on GPUs, and the command that checks each one on a GPU machine.
GPU_PATHS = {
    "megatron": "python bench/gpu_check.py --only gpt2:megatron (or make gpu-check): GPTModel with "
                "megatron-core's DDP and optimizer, 1 GPU; tp=2 and dp=2 with the distributed optimizer on 2",
}
DISTRIBUTIONS = ["torch", "torchvision", "deepspeed", "megatron-core", "torchgpipe", "mlflow", "datasets", "timm"]


def version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_sha() -> str:
    """The kit's source commit: from its checkout, else $REPRO_GIT_SHA (set in the image), else 'unknown'."""
    source = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        if out.returncode == 0:
            return out.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return os.environ.get("REPRO_GIT_SHA", "unknown")


def image() -> str:
    """The container image this runs in (set by the image itself), or '' outside one."""
    return os.environ.get("REPRO_IMAGE", "")


def torch_cuda() -> str | None:
    """The CUDA torch was built with (torch.version.cuda), read from torch/version.py, a module of plain
    assignments, without importing torch (None without torch, or for a CPU build)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    return runpy.run_path(str(Path(spec.submodule_search_locations[0]) / "version.py")).get("cuda")


def devices() -> dict[str, Any]:
    """The GPUs and the CUDA of torch's build. Where there is no GPU driver (hardware.gpu_count), torch is
    not imported: every run's parent writes this report (repro.run.record), and stays free of torch."""
    if not hardware.gpu_count():
        return {"cuda_available": False, "cuda": torch_cuda(), "gpus": [], "cpu_cores": os.cpu_count()}
    import torch

    info: dict[str, Any] = {"cuda_available": torch.cuda.is_available(), "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    else:
        info["gpus"] = []
        info["cpu_cores"] = os.cpu_count()
    return info


def data_status() -> dict[str, str]:
    from repro.data import DataError
    from repro.data.sets import DATASETS

    status = {}
    for name, spec in DATASETS.items():
        try:
            status[name] = f"present at {spec.locate()}"
        except DataError:
            status[name] = f"missing (repro data prepare {name})"
    return status


def gpu_paths() -> dict[str, str]:
    """Each GPU-only path: the docs/measured/ files that hold its result, else 'not yet run' and the command."""
    status = {}
    for name, command in GPU_PATHS.items():
        results = sorted(p.name for p in MEASURED.glob(f"gpu_check*{name}*.json"))
        status[name] = f"measured: {', '.join(results)}" if results else f"not yet run on a GPU: {command}"
    return status


def availability(entry: registry.FrameworkEntry) -> str:
    absence = entry.absence()
    return f"unavailable: {absence}" if absence else "available"


def report() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "hostname": platform.node(),
        "git_sha": git_sha(),
        "image": image(),
        "versions": {d: version(d) for d in DISTRIBUTIONS},
        "frameworks": {name: availability(entry) for name, entry in registry.FRAMEWORKS.items()},
        "devices": devices(),
        "gpu_paths": gpu_paths(),
        "data": data_status(),
    }


def packages() -> list[str]:
    """`name==version` of every installed distribution, sorted (the run's package list)."""
    return sorted({f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions()})
