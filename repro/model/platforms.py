"""Platform profiles: what the step-time model (repro.model.time) knows of a machine, kept as data in a
YAML file (Calculon's way: systems/a100_80g.json), from published figures (configs/platforms/: the
paper's Lassen and ThetaGPU, marked assumptions) or measured here by `repro calibrate`.

A profile holds the matrix-multiply rate per precision with the share of it reached by operations of a
given size (Calculon's efficiency table: it falls for small operations), the bandwidth of memory-bound
operations, the host's cost of dispatching one operation, ranks per node, a measured profile's own
rates of each workload's operations (WorkloadRates), and per scope (intra-node,
inter-node) and kind of collective a latency and a bandwidth on the wire (docs/time.md). Errors name the
file and the field, in one line (repro.schema). No torch.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import yaml

from repro.schema import AT_LEAST_1, POSITIVE, Bounds, RecipeError, build

SCOPES = ("intra", "inter")
KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "send", "recv")
DEFAULT_KIND = "default"  # the figures of every kind a scope does not list
SHARE = Bounds(low=0, high=1, open_low=True)


@dataclass(frozen=True)
class Link:
    """One kind of collective in one scope: seconds it takes at least, and bytes a second on the wire
    (the bytes repro.model.costs.wire_bytes counts), as a peak and the share of it reached."""

    latency_s: Annotated[float, Bounds(low=0)]
    bandwidth: Annotated[float, POSITIVE]  # bytes/s; inter-node: a node's, shared by its ranks' groups
    efficiency: Annotated[float, SHARE] = 1.0

    def seconds(self, wire: float) -> float:
        """Time of one operation moving `wire` bytes a rank (none moved: nothing to wait for)."""
        return 0.0 if wire <= 0 else self.latency_s + wire / (self.bandwidth * self.efficiency)


@dataclass(frozen=True)
class Matmul:
    """Peak FLOP/s per precision and the share of it an operation of at least so many FLOPs reaches:
    [[flops, share], ...], the largest threshold at or below the operation's size applies (Calculon)."""

    peak: dict[str, float]
    efficiency: list[list[float]]

    def rate(self, precision: str, flops_per_op: float) -> float:
        """FLOP/s of one operation of `flops_per_op` in `precision` (fp32's rate where it is not listed)."""
        peak = self.peak.get(precision, self.peak["fp32"])
        share = max((point for point in self.efficiency if point[0] <= flops_per_op), key=lambda p: p[0],
                    default=min(self.efficiency, key=lambda p: p[0]))[1]
        return peak * share


@dataclass(frozen=True)
class Memory:
    bandwidth: Annotated[float, POSITIVE]  # bytes/s of memory-bound operations
    efficiency: Annotated[float, SHARE] = 1.0


@dataclass(frozen=True)
class WorkloadRates:
    """A workload's own operations as `repro calibrate` timed them in its fp32 training step on this
    machine, at sizes other than the ones the check holds it to (docs/time.md, "This machine"): the
    matrix rate by the step's mean matrix operation, and the seconds its memory-bound operations take per
    byte the model counts for them. Where a profile has them, they stand in for the square multiplies'
    rate and the copy's bandwidth."""

    matmul: list[list[float]]  # [[FLOPs of the mean matrix operation, FLOP/s], ...], interpolated in log size
    activation_bandwidth: Annotated[float, POSITIVE]  # 2 x saved activations (bytes) over the passes' elementwise seconds
    state_bandwidth: Annotated[float, POSITIVE]  # 3 x model state (bytes) over the optimizer step's seconds

    def matmul_rate(self, flops_per_op: float) -> float:
        """FLOP/s at `flops_per_op`: log-linear between the measured sizes, the nearest outside them."""
        points = sorted(self.matmul)
        size = min(max(flops_per_op, points[0][0]), points[-1][0])
        for (low, low_rate), (high, high_rate) in zip(points, points[1:]):
            if low <= size <= high:
                share = math.log(size / low) / math.log(high / low) if high > low else 0.0
                return low_rate + share * (high_rate - low_rate)
        return points[0][1]


@dataclass(frozen=True)
class Platform:
    name: str
    device: str  # what the ranks run on: a GPU's name, or the CPU model (`repro calibrate` reuses a profile by it)
    ranks_per_node: Annotated[int, AT_LEAST_1]
    backend: str  # nccl, gloo
    matmul: Matmul
    memory: Memory
    dispatch_s: dict[str, float]  # host seconds per operation dispatched (kernel launch, Python, autograd), by workload or "default"
    dispatch_overlaps: bool  # the host dispatches ahead of the device (a GPU), or one thread does both (a CPU)
    comm_overlaps: bool  # communication can run beside compute (NCCL on its own stream), or takes the cores (gloo on a CPU)
    collectives: dict[str, Any]  # scope -> kind (or "default") -> Link
    assumption: bool = False  # published figures with a stated efficiency, not measured on the platform
    sources: list[str] = field(default_factory=list)
    measured: dict[str, Any] = field(default_factory=dict)  # `repro calibrate`'s raw points, kept for the record
    workloads: dict[str, Any] = field(default_factory=dict)  # workload -> WorkloadRates (measured profiles only)
    # repro.model.time.framework_key -> [[where, seconds], ...]: a framework's own time a step beyond the model's
    # terms, measured at two sizes (repro.framework_overhead; measured profiles only), each where the model reads it
    # (repro.model.time.own_time_scale: the model state bytes a rank, or ZeRO-1/2's bucket flushes a step)
    frameworks: dict[str, list[list[float]]] = field(default_factory=dict)
    path: str = ""

    def dispatch(self, workload: str) -> float:
        """Seconds per dispatched operation of `workload`'s step (the default where it is not measured)."""
        return self.dispatch_s.get(workload, self.dispatch_s[DEFAULT_KIND])

    def rates(self, workload: str, precision: str) -> WorkloadRates | None:
        """The workload's own measured rates, for the precision they were measured in (fp32), else None."""
        return self.workloads.get(workload) if precision == "fp32" else None

    def framework_seconds(self, key: str, where: float) -> float:
        """A framework's own seconds a step at `where` (repro.model.time.own_time_scale): on the line through the
        two sizes it was measured at (0 where the profile has no figures for `key`)."""
        points = sorted(self.frameworks.get(key) or [])
        if len(points) < 2:
            return points[0][1] if points else 0.0
        (small, at_small), (large, at_large) = points[0], points[-1]
        return at_small + (where - small) * (at_large - at_small) / (large - small) if large > small else at_small

    def link(self, scope: str, kind: str) -> Link:
        """The figures of collective `kind` in `scope` (the scope's default where the kind is not listed;
        the intra-node figures where the profile has no inter-node scope: one node)."""
        table = self.collectives.get(scope) or self.collectives["intra"]
        return table.get(kind) or table[DEFAULT_KIND]


def configs_platforms() -> Path:
    from repro.recipe import configs_dir

    return configs_dir() / "platforms"


SHIPPED = ("lassen", "thetagpu")


def load(name_or_path: str | Path) -> Platform:
    """A profile by shipped name (configs/platforms/NAME.yaml) or by file; RecipeError naming the file and
    the field where it is not a valid profile."""
    path = Path(name_or_path)
    if str(name_or_path) in SHIPPED:
        path = configs_platforms() / f"{name_or_path}.yaml"
    if not path.is_file():
        raise RecipeError(str(path), "", f"no such profile; shipped: {', '.join(SHIPPED)}, or a file")
    return parse(yaml.safe_load(path.read_text()), str(path))


def parse(raw: Any, source: str) -> Platform:
    """A profile from its YAML mapping: the typed fields (repro.schema), then each collective's figures."""
    platform = build(Platform, raw, source)
    collectives = {}
    for scope, kinds in platform.collectives.items():
        if scope not in SCOPES:
            raise RecipeError(source, f"collectives.{scope}", f"unknown scope; valid: {', '.join(SCOPES)}")
        if not isinstance(kinds, dict) or DEFAULT_KIND not in kinds and set(KINDS) - set(kinds):
            raise RecipeError(source, f"collectives.{scope}", f"needs `{DEFAULT_KIND}` or every kind: {', '.join(KINDS)}")
        for kind in kinds:
            if kind not in (*KINDS, DEFAULT_KIND):
                raise RecipeError(source, f"collectives.{scope}.{kind}", f"unknown kind; valid: {', '.join(KINDS)}, {DEFAULT_KIND}")
        collectives[scope] = {kind: build(Link, figures, source, f"collectives.{scope}.{kind}") for kind, figures in kinds.items()}
    if "intra" not in collectives:
        raise RecipeError(source, "collectives.intra", "missing required field")
    if DEFAULT_KIND not in platform.dispatch_s or not all(isinstance(v, (int, float)) and v >= 0 for v in platform.dispatch_s.values()):
        raise RecipeError(source, "dispatch_s", f"needs `{DEFAULT_KIND}` and seconds >= 0, got {platform.dispatch_s!r}")
    if not all(isinstance(v, (int, float)) and v > 0 for v in platform.matmul.peak.values()):
        raise RecipeError(source, "matmul.peak", f"FLOP/s must be numbers > 0 (YAML: 1.5e+12, not 1.5e12), got {platform.matmul.peak!r}")
    if "fp32" not in platform.matmul.peak or not platform.matmul.efficiency:
        raise RecipeError(source, "matmul", "needs peak.fp32 and at least one efficiency point")
    for index, point in enumerate(platform.matmul.efficiency):
        if len(point) != 2 or not 0 < point[1] <= 1 or point[0] < 0:
            raise RecipeError(source, f"matmul.efficiency[{index}]", f"expected [flops >= 0, share in (0, 1]], got {point!r}")
    workloads = {name: build(WorkloadRates, figures, source, f"workloads.{name}")
                 for name, figures in platform.workloads.items()}
    for name, rates in workloads.items():
        if not rates.matmul or any(len(point) != 2 or min(point) <= 0 for point in rates.matmul):
            raise RecipeError(source, f"workloads.{name}.matmul", f"expected [[flops > 0, FLOP/s > 0], ...], got {rates.matmul!r}")
    for key, points in platform.frameworks.items():
        if not isinstance(points, list) or any(not isinstance(p, list) or len(p) != 2 or p[0] < 0 for p in points):
            raise RecipeError(source, f"frameworks.{key}", f"expected [[where >= 0, seconds], ...], got {points!r}")
    return dataclasses.replace(platform, collectives=collectives, workloads=workloads, path=source)


def dump(platform: Platform, path: Path) -> None:
    """Write `platform` as a profile file that `load` reads back."""
    from repro.schema import as_dict

    data = as_dict(platform)
    data.pop("path")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
