"""LBANN's console output (out.log) turned into per-epoch numbers: a pure parser.

The line shapes are those LBANN 0.104 prints with the kit's callbacks, trainers reporting on their
own (LBANN's default: no --ltfb_allow_global_statistics). For model M and trainer T:

  src/callbacks/gpu_memory_usage.cpp, when each epoch *begins* (one line per trainer):
    Model T GPU memory usage statistics : 0.902 GiB mean, 0.902 GiB median, 0.902 GiB max, 0.902 GiB min (15.8 GiB total)
  src/callbacks/print_statistics.cpp, when a training epoch ends and when its validation ends:
    M (instance T) training epoch 0 objective function : 2.30281
    M (instance T) training epoch 0 accuracy : 11.5385%          (metric name, value, the metric's unit)
    M (instance T) validation objective function : 2.30155
  src/callbacks/timer.cpp, after each of those:
    M (instance T) training epoch 0 run time : 4.21437s
    M (instance T) training epoch 0 mini-batch time statistics : 0.0957s mean, ... (not read here)

print_statistics.cpp also prints a dashed epoch header, which carries nothing per trainer. Values are
C++ stream output: a diverged run prints nan, -nan, inf or -inf, read as floats (never N/A: only the
mini-batch statistics print that). Validation lines name no epoch: they belong to their trainer's
latest training epoch. A memory reading is taken as an epoch begins, so it belongs to the epoch its
trainer trains next; it is device-wide (used = total - free), not the allocator's peak.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

GIB = 2**30
MEMORY_STATS = ("mean", "median", "max", "min", "total")

_NUMBER = r"[-+]?(?:nan|inf|\d+(?:\.\d*)?(?:e[-+]?\d+)?)"
_METRIC = re.compile(
    rf"^\S+ \(instance (?P<trainer>\d+)\) (?:training epoch (?P<epoch>\d+)|(?P<mode>validation|test|tournament))"
    rf" (?P<name>.+?) : (?P<value>{_NUMBER})(?:%|s)?$"
)
_MEMORY = re.compile(
    rf"^Model (?P<trainer>\d+) GPU memory usage statistics : (?P<mean>{_NUMBER}) GiB mean, (?P<median>{_NUMBER}) "
    rf"GiB median, (?P<max>{_NUMBER}) GiB max, (?P<min>{_NUMBER}) GiB min \((?P<total>{_NUMBER}) GiB total\)$"
)


@dataclass
class Epoch:
    """One trainer's numbers for one epoch: `training` and `validation` map metric name to value."""

    trainer: int
    epoch: int
    training: dict[str, float] = field(default_factory=dict)
    validation: dict[str, float] = field(default_factory=dict)
    memory_gib: dict[str, float] = field(default_factory=dict)  # MEMORY_STATS, read as the epoch began


def parse(text: str) -> list[Epoch]:
    """Every trainer's epochs found in `text`, in the order their first training line appears."""
    epochs: dict[tuple[int, int], Epoch] = {}
    latest: dict[int, Epoch] = {}  # trainer -> its latest training epoch
    begun: dict[int, dict[str, float]] = {}  # trainer -> the memory reading of the epoch it began
    for line in text.splitlines():
        if metric := _METRIC.match(line.strip()):
            trainer, value = int(metric["trainer"]), float(metric["value"])
            if metric["epoch"] is not None:
                key = (trainer, int(metric["epoch"]))
                if key not in epochs:
                    epochs[key] = Epoch(*key, memory_gib=begun.pop(trainer, {}))
                latest[trainer] = epochs[key]
                epochs[key].training[metric["name"]] = value
            elif metric["mode"] == "validation" and trainer in latest:
                latest[trainer].validation[metric["name"]] = value
        elif reading := _MEMORY.match(line.strip()):
            begun[int(reading["trainer"])] = {name: float(reading[name]) for name in MEMORY_STATS}
    return list(epochs.values())


def trainer_epochs(epochs: list[Epoch], trainer: int = 0) -> list[Epoch]:
    """The epochs of one trainer, in epoch order."""
    return sorted((e for e in epochs if e.trainer == trainer), key=lambda e: e.epoch)
