"""Communication: what a rank hands to collectives and point-to-point operations in one training step.

Every framework reaches its process group from C++ (DDP's reducer) or Python (DeepSpeed, megatron-core,
FSDP, the pipelines), and every process group records each operation it runs as a profiler event named
after its backend and kind (`gloo:all_reduce`, `nccl:all_reduce`, `gloo:send`), with the shapes and
dtypes of the tensors handed to it. So one counter serves every adapter: the torch profiler with
`record_shapes=True` around one step, and each such event's payload (elements x element size of its
tensors) added to its kind. The payload is what the operation is given, per rank; what a ring or tree
then moves on the wire follows from payload, kind and group size (repro.model.costs).

What the backend runs is what is counted: gloo has no reduce-scatter, and torch runs
`reduce_scatter_tensor` on gloo as an all-reduce of the whole input (counted as that all-reduce).

The profiler costs a Python pass over the step's events, so the loop counts one step only, a warm-up
step left out of the step-time distribution (`Trainer.counters`).

torchgpipe runs its partitions in one process and hands tensors from one partition to the next without
a process group: `BoundaryCounter` counts the activations entering each partition after the first and
the gradients leaving it in backward, per partition (per stand-in GPU).
"""
from __future__ import annotations

import collections
import contextlib
import os
import re
import threading
from functools import partial
from typing import Any, Iterator, Sequence

import torch
from torch import nn

# the profiler's dtype names (c10's ScalarType names as kineto writes them) -> bytes per element
ELEMENT_BYTES = {
    "float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4, "short int": 2,
    "signed char": 1, "unsigned char": 1, "bool": 1, "c10::complex<float>": 8, "c10::complex<double>": 16,
    "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1,
}
# a process group's event: backend, then the operation's kind
OPERATION = re.compile(r"^(gloo|nccl|mpi|ucc|xccl):(\w+)$")
BOUNDARY_ACTIVATION = "boundary:activation"  # torchgpipe: a partition's input, handed over from the previous one
BOUNDARY_GRADIENT = "boundary:gradient"  # and its gradient, handed back in backward
# Kineto prints its trace stages and device probing at every profile, each rank to the job's output: on a
# machine without a GPU "gpuGetDeviceCount failed with code 35" (ERROR) and "profiler_start" (USDT) lines
# that read as failures. This counter records CPU events only, so none of them concerns the run: a level
# above every message type kineto has (USDT, its highest, is 5 in torch 2.14's kineto) silences them. Kineto
# reads KINETO_LOG_LEVEL as a profile starts; a user's own setting wins.
QUIET_KINETO_LEVEL = "10"


def payload_bytes(shapes: Sequence[Sequence[int]], dtypes: Sequence[str]) -> int:
    """Bytes of the tensors of one operation (shape x element size of each)."""
    total = 0
    for shape, dtype in zip(shapes, dtypes):
        if dtype not in ELEMENT_BYTES:
            raise ValueError(f"communication: no element size for the profiler's dtype {dtype!r}")
        elements = 1
        for size in shape:
            elements *= size
        total += elements * ELEMENT_BYTES[dtype]
    return total


class CommCounter:
    """Payload bytes and counts per operation kind, summed over the counted steps."""

    def __init__(self) -> None:
        self.bytes: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self.steps = 0
        self.lock = threading.Lock()  # torchgpipe hands tensors over on its partitions' worker threads

    def add(self, kind: str, nbytes: int) -> None:
        with self.lock:
            self.bytes[kind] += nbytes
            self.calls[kind] += 1

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Count what this process hands to its process groups while the context is open (one step)."""
        from torch.profiler import ProfilerActivity, profile

        os.environ.setdefault("KINETO_LOG_LEVEL", QUIET_KINETO_LEVEL)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as profiler:
            yield
        for event in profiler.profiler.kineto_results.events():
            found = OPERATION.match(event.name())
            if found:
                self.add(found.group(2), payload_bytes(event.shapes(), event.dtypes()))
        self.steps += 1

    def per_step(self) -> dict[str, Any]:
        """{"bytes": {kind: bytes}, "calls": {kind: count}} of one step (averaged over counted steps);
        {} when no step was counted (a run stopped before the step the loop counts)."""
        if not self.steps:
            return {}
        steps = self.steps
        return {"bytes": {kind: value // steps for kind, value in sorted(self.bytes.items())},
                "calls": {kind: value // steps for kind, value in sorted(self.calls.items())}}


class CallCounter(CommCounter):
    """Counts at the torch.distributed call instead of the profiler, for adapters whose operations outlive
    the step: PipeDream's `isend`s complete in the next step, and a profiler stopped while a process group
    still runs an operation it recorded corrupted the heap (`free(): invalid next size`, seen on gloo).
    Each call's first tensor is its payload (what `send`, `recv`, `all_reduce` and `broadcast` are handed)."""

    KINDS = {"send": "send", "isend": "send", "recv": "recv", "irecv": "recv", "all_reduce": "all_reduce",
             "broadcast": "broadcast"}

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        import torch.distributed as dist

        originals = {name: getattr(dist, name) for name in self.KINDS}
        for name, kind in self.KINDS.items():
            setattr(dist, name, self.counted(originals[name], kind))
        try:
            yield
        finally:
            for name, function in originals.items():
                setattr(dist, name, function)
            self.steps += 1

    def counted(self, function: Any, kind: str) -> Any:
        def call(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.add(kind, tensor.numel() * tensor.element_size())
            return function(tensor, *args, **kwargs)

        return call


class BoundaryCounter:
    """torchgpipe: tensors handed between partitions of one process, one CommCounter per partition.

    A forward pre-hook on each partition after the first counts its input (received by it, sent by the
    previous partition) while counting is on, and a hook on that input counts the gradient handed back.
    Each transfer counts to both partitions it joins: a rank's payload includes what it receives, as a
    `recv`'s tensor does for the other frameworks.
    """

    def __init__(self, partitions: Sequence[nn.Module]):
        self.counters = [CommCounter() for _ in partitions]
        self.on = False
        for index, partition in enumerate(partitions):
            if index:
                partition.register_forward_pre_hook(partial(self.enter, index))

    def enter(self, index: int, module: nn.Module, args: Any) -> None:
        if not self.on or not torch.is_grad_enabled():
            return  # checkpointed micro-batches run their forward again in backward: counted once
        for tensor in args:
            if not isinstance(tensor, torch.Tensor):
                continue
            self.transfer(index, BOUNDARY_ACTIVATION, tensor.numel() * tensor.element_size())
            if tensor.requires_grad:
                tensor.register_hook(partial(self.gradient, index))

    def gradient(self, index: int, grad: torch.Tensor) -> None:
        if self.on:
            self.transfer(index, BOUNDARY_GRADIENT, grad.numel() * grad.element_size())

    def transfer(self, index: int, kind: str, nbytes: int) -> None:
        self.counters[index - 1].add(kind, nbytes)
        self.counters[index].add(kind, nbytes)

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        self.on = True
        try:
            yield
        finally:
            self.on = False
            for counter in self.counters:
                counter.steps += 1

    def per_step(self) -> dict[str, Any]:
        """The busiest partition's step: communication, like memory, is per GPU."""
        return max((counter.per_step() for counter in self.counters), key=lambda step: sum(step.get("bytes", {}).values()))
