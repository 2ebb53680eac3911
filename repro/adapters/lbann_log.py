"""LBANN's console output (out.log) turned into per-epoch numbers: a pure parser.

LBANN's print, timer and GPU-memory callbacks write lines such as

    model0 (instance 0) training epoch 19 objective function : 0.00160377
    model0 (instance 0) training epoch 19 accuracy : 99.9717%
    model0 (instance 0) training epoch 19 run time : 0.80641s
    model0 (instance 0) validation objective function : 34.3421
    Model 0 GPU memory usage statistics : 0.902 GiB mean, 0.902 GiB median, 0.902 GiB max, 0.902 GiB min (15.8 GiB total)

"instance" is the trainer. Validation lines carry no epoch: they belong to their trainer's latest
training epoch. Any value may be `N/A` (kept as None), and some versions print no median. The
memory line names no trainer: it belongs to the epoch number in progress, and the largest reading
is kept (the peak over trainers). LBANN measures that memory device-wide (used = total - free), not the allocator's.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

GIB = 2**30

_METRIC = re.compile(
    r"^\S+ \(instance (?P<trainer>\d+)\) (?P<mode>training|validation|testing)"
    r"(?: epoch (?P<epoch>\d+))? (?P<name>.+?) : (?P<value>N/A|[-+]?[\d.]+(?:[eE][-+]?\d+)?)(?P<unit>%|s)?\s*$"
)
_MEMORY = re.compile(r"^Model \d+ GPU memory usage statistics : (?P<stats>.*)$")
_MEMORY_STAT = re.compile(r"(?P<value>N/A|[\d.]+) GiB (?P<name>mean|median|max|min)\b")
_MEMORY_TOTAL = re.compile(r"\((?P<value>N/A|[\d.]+) GiB total\)")


@dataclass
class Epoch:
    """One trainer's numbers for one epoch: `training` and `validation` map metric name to value."""

    trainer: int
    epoch: int
    training: dict[str, float | None] = field(default_factory=dict)
    validation: dict[str, float | None] = field(default_factory=dict)
    memory_gib: dict[str, float | None] = field(default_factory=dict)  # mean/median/max/min/total


def number(text: str) -> float | None:
    return None if text == "N/A" else float(text)


def parse_memory(stats: str) -> dict[str, float | None]:
    values = {m["name"]: number(m["value"]) for m in _MEMORY_STAT.finditer(stats)}
    total = _MEMORY_TOTAL.search(stats)
    if total:
        values["total"] = number(total["value"])
    return values


def peak(old: dict[str, float | None], new: dict[str, float | None]) -> dict[str, float | None]:
    """The reading with the larger max (a reading with a number beats one without)."""
    if not old or (new.get("max") is not None and (old.get("max") is None or new["max"] > old["max"])):
        return new
    return old


def parse(text: str) -> list[Epoch]:
    """Every trainer's epochs found in `text`, in the order their first line appears."""
    epochs: dict[tuple[int, int], Epoch] = {}
    latest: dict[int, Epoch] = {}  # trainer -> its epoch in progress
    memory: dict[int, dict[str, float | None]] = {}  # epoch number -> its peak reading
    current: int | None = None  # the epoch number of the last training line
    for line in text.splitlines():
        line = line.strip()
        metric = _METRIC.match(line)
        if metric:
            trainer = int(metric["trainer"])
            if metric["mode"] == "training" and metric["epoch"] is not None:
                current = int(metric["epoch"])
                key = (trainer, current)
                epochs.setdefault(key, Epoch(trainer, current))
                latest[trainer] = epochs[key]
                epochs[key].training[metric["name"]] = number(metric["value"])
            elif metric["mode"] == "validation" and trainer in latest:
                latest[trainer].validation[metric["name"]] = number(metric["value"])
            continue
        reading = _MEMORY.match(line)
        if reading and current is not None:
            memory[current] = peak(memory.get(current, {}), parse_memory(reading["stats"]))
    for epoch in epochs.values():
        epoch.memory_gib = memory.get(epoch.epoch, {})
    return list(epochs.values())


def trainer_epochs(epochs: list[Epoch], trainer: int = 0) -> list[Epoch]:
    """The epochs of one trainer, in epoch order."""
    return sorted((e for e in epochs if e.trainer == trainer), key=lambda e: e.epoch)
