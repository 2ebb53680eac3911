"""Measurement: timers synchronised with the device, peak memory, and bytes of model state."""
from __future__ import annotations

import resource
import statistics
import sys
import time
from typing import Iterable

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """Wall time between two device-synchronised points."""

    def __init__(self, device: torch.device):
        self.device = device
        self.start = 0.0

    def __enter__(self) -> "Timer":
        synchronize(self.device)
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = self.seconds_so_far()

    def seconds_so_far(self) -> float:
        synchronize(self.device)
        return time.perf_counter() - self.start


WARMUP_STEPS = 5  # the run's first steps (allocator, autotuning, first communication) are left out of step times


class StepClock:
    """Per-step times of one epoch, read only at the epoch end: CUDA events on a GPU (recording one
    does not wait for the device), the host clock on a CPU. Each step runs from the end of the
    previous one (or the epoch start) to its own end, so work between steps counts too."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = [self._now()]

    def _now(self) -> object:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark(self) -> None:
        """The end of a step."""
        self.marks.append(self._now())

    def seconds(self) -> list[float]:
        """Every step's duration; on a GPU this waits for the device (call it after the timed steps)."""
        if not self.cuda:
            return [b - a for a, b in zip(self.marks, self.marks[1:])]
        self.marks[-1].synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]


class Stopwatch:
    """Nanoseconds summed over stretches of host time, each between `start()` and `stop()`: the loop's
    own work between the frameworks' steps (`perf_counter_ns`: about 50 ns a reading, no float)."""

    def __init__(self) -> None:
        self.ns = 0
        self.started = 0
        self.laps: list[int] = []  # nanoseconds of each step's share (`lap`)
        self.lapped = 0

    def start(self) -> None:
        self.started = time.perf_counter_ns()

    def stop(self) -> None:
        self.ns += time.perf_counter_ns() - self.started

    def lap(self) -> None:
        """End a step's share of the summed time (called while running, which it goes on doing): the
        nanoseconds since the last lap, to subtract from the same step's clock time (`framework_median`)."""
        self.stop()
        self.laps.append(self.ns - self.lapped)
        self.lapped = self.ns
        self.start()

    def mean_us(self, steps: int) -> float | None:
        """Microseconds per step over `steps` steps (None without steps)."""
        return self.ns / 1e3 / steps if steps else None


def step_time_summary(seconds: list[float]) -> dict[str, float | int | None]:
    """Median, 10th and 90th percentile, mean and count of step times (None without steps)."""
    if not seconds:
        return {"median": None, "p10": None, "p90": None, "mean": None, "count": 0}
    ordered = sorted(seconds)
    deciles = statistics.quantiles(ordered, n=10, method="inclusive") if len(ordered) > 1 else ordered * 9
    return {"median": statistics.median(ordered), "p10": deciles[0], "p90": deciles[-1],
            "mean": statistics.fmean(ordered), "count": len(ordered)}


def framework_median(seconds: list[float], harness_ns: list[int]) -> float | None:
    """The median over steps of each step's time less the loop's own time in it: the framework's step, on
    the same steps as the step times' median. Not the median less the loop's mean: one stall of the loop can
    take more than a whole step (600 ms in one 20-step run: docs/measurement.md), and 20 steps do not dilute it."""
    own = [step - ns / 1e9 for step, ns in zip(seconds, harness_ns)]
    return statistics.median(own) if own else None


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    """(peak bytes, method): CUDA allocator peak on GPU, peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda_max_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss * (1 if sys.platform == "darwin" else 1024), "cpu_peak_rss"


def device_name(device: torch.device) -> str:
    """The name peak-FLOP tables are keyed by: the GPU's, or the CPU model's."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    from repro.hardware import cpu_model

    return cpu_model()


def device_used_bytes(device: torch.device) -> int | None:
    """Device-wide memory in use (all processes, caches included) on CUDA; None elsewhere."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of distinct storages among `tensors` (shared and tied tensors count once)."""
    seen, total = set(), 0
    for tensor in tensors:
        if tensor is None or not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            continue
        storage = tensor.untyped_storage()
        key = (tensor.device, storage.data_ptr())
        if storage.nbytes() and key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def optimizer_tensors(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter] | None = None) -> list[torch.Tensor]:
    """The optimizer's state tensors (of `params` only, when given)."""
    states = optimizer.state.values() if params is None else (optimizer.state[p] for p in params if p in optimizer.state)
    return [v for state in states for v in state.values() if isinstance(v, torch.Tensor)]


def model_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state of `module`'s parameters, counted from tensors."""
    params = list(module.parameters())
    return {
        "parameters": tensor_bytes(params),
        "gradients": tensor_bytes(p.grad for p in params),
        "optimizer": tensor_bytes(optimizer_tensors(optimizer, params)) if optimizer else 0,
    }
