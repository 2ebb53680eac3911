"""Activation memory: the bytes of tensors autograd keeps for backward, counted the same on CPU and GPU.

A `saved_tensors_hooks` pair sees every tensor an operation saves for its backward. Each storage is
counted once however many saved views point into it (GPT-2's q, k and v are views of one c_attn
output), from the first save until autograd drops the last reference to it (after its backward, or
when the graph is freed): that is what occupies memory between a forward and its backward, and what
makes Megatron's and the pipelines' per-GPU memory curves bend. Weights are model state, counted by
`repro.metrics.model_state`: `nn.Parameter`s and views of them are left out.

Hooks are thread-local. Frameworks that run layers on worker threads (torchgpipe runs each partition
on a thread of its device) use `PartitionCounters`, which installs the hooks in whichever thread runs
a partition and keeps one count per partition: per stand-in GPU.
"""
from __future__ import annotations

import contextlib
import threading
import time
import weakref
from functools import partial
from typing import Any, Iterator, Sequence

import torch
from torch import nn


def is_weight(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)


class _Saved:
    """What autograd stores instead of a saved tensor: the tensor, and a release when autograd drops it."""

    __slots__ = ("tensor", "counter", "key")

    def __init__(self, tensor: torch.Tensor, counter: "Counter", key: tuple[str, int]):
        self.tensor, self.counter, self.key = tensor, counter, key

    def __del__(self) -> None:
        self.counter.release(self.key)


class Counter:
    """Bytes of distinct storages saved for backward and still held: now and at the peak."""

    def __init__(self) -> None:
        self.held: dict[tuple[str, int], list[int]] = {}  # storage -> [saved references, bytes]
        self.current = 0
        self.peak = 0
        self.lock = threading.Lock()  # torchgpipe saves on worker threads and releases on the main one
        self.spent_ns = 0  # host time in pack and release: what counting adds to a step (repro.loop)
        self.open = False  # while `hooks()` is open (torch.utils.checkpoint's recomputation counts only then)

    def pack(self, tensor: torch.Tensor) -> Any:
        started = time.perf_counter_ns()
        if is_weight(tensor) or tensor.device.type == "meta":
            self.spent_ns += time.perf_counter_ns() - started  # unlocked: a lost addition loses a few ns
            return tensor
        # detached: a saved output would otherwise hold its own grad_fn, a cycle only the garbage
        # collector frees (autograd gives the unpacked tensor its place in the graph again)
        saved = _Saved(tensor.detach(), self, self.hold(tensor))
        self.spent_ns += time.perf_counter_ns() - started
        return saved

    def hold(self, tensor: torch.Tensor) -> tuple[str, int]:
        """Count one more saved reference to `tensor`'s storage; its key, for `release`."""
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr())
        with self.lock:
            entry = self.held.setdefault(key, [0, storage.nbytes()])
            if entry[0] == 0:
                self.current += entry[1]
                self.peak = max(self.peak, self.current)
            entry[0] += 1
        return key

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether a saved tensor still held shares `tensor`'s storage."""
        with self.lock:
            return (str(tensor.device), tensor.untyped_storage().data_ptr()) in self.held

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def release(self, key: tuple[str, int]) -> None:
        started = time.perf_counter_ns()
        with self.lock:
            entry = self.held[key]
            entry[0] -= 1
            if entry[0] == 0:
                self.current -= entry[1]
                del self.held[key]
            self.spent_ns += time.perf_counter_ns() - started

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        """Count what is saved for backward on this thread while the context is open."""
        self.open = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            self.open = False

    @contextlib.contextmanager
    def recomputation(self) -> Iterator[None]:
        """Count what torch.utils.checkpoint (non-reentrant) recomputes in backward, while `hooks()` is open:
        the recompute context of its `context_fn`, entered around the block's second forward.

        checkpoint stores the recomputed tensors through a saved-tensors hook of its own, pushed above ours
        (torch/utils/checkpoint.py: _recomputation_hook), so the counter would never see the recomputed
        block, the largest thing held in backward. This hook, pushed above checkpoint's, counts each tensor
        and hands it on to checkpoint's hook (the hooks' stack is read with the private function checkpoint
        itself uses); the count is released when checkpoint's stored tensor dies (its backward has unpacked
        and used it). Weights are model state, as in `pack`."""
        if not self.open:
            yield
            return
        inner_pack, inner_unpack = torch._C._autograd._top_saved_tensors_default_hooks(False)  # checkpoint's, on entry

        def pack(tensor: torch.Tensor) -> Any:
            if is_weight(tensor):
                return inner_pack(tensor)
            stored = tensor.detach()  # what checkpoint would store (it detaches what requires grad), now ours to watch
            weakref.finalize(stored, self.release, self.hold(tensor))
            return inner_pack(stored)

        with torch.autograd.graph.saved_tensors_hooks(pack, inner_unpack):
            yield

    @property
    def peak_bytes(self) -> int:
        return self.peak


class PartitionCounters:
    """One Counter per pipeline partition of a single process (torchgpipe).

    A forward pre-hook on each partition installs the saving hooks in the thread that runs it (once
    per thread; torchgpipe starts fresh worker threads for every forward) and makes that partition
    the thread's current one. A saved tensor counts to its thread's current partition: torchgpipe's
    checkpointed micro-batches save their input just after the partition's forward returns, and a
    recomputation during backward runs the partition's forward again. Tensors saved on the thread
    that opened `hooks()` before any partition ran there count to the partition already holding their
    storage (torchgpipe's Recompute saves the input its Checkpoint saved), else to the last one (the loss).
    """

    def __init__(self, partitions: Sequence[nn.Module]):
        self.counters = [Counter() for _ in partitions]
        self.local = threading.local()
        self.counting = False  # while `hooks()` is open: the partitions' threads install the hooks
        for index, partition in enumerate(partitions):
            partition.register_forward_pre_hook(partial(self.enter, index))

    def enter(self, index: int, module: nn.Module, args: Any) -> None:
        if self.counting and not getattr(self.local, "installed", False):
            torch.autograd.graph.saved_tensors_hooks(self.pack, Counter.unpack).__enter__()  # lives with the thread
            self.local.installed = True
        self.local.current = index

    def pack(self, tensor: torch.Tensor) -> Any:
        current = getattr(self.local, "current", -1)
        if current == -1:
            # outside any partition: torchgpipe's Recompute saves a checkpointed micro-batch's input on the
            # main thread (Pipeline.compute's finalize), the storage its partition's Checkpoint already
            # holds on that partition's device; what no partition holds (the loss) is the last one's
            current = next((index for index, counter in enumerate(self.counters) if counter.holds(tensor)), -1)
        return self.counters[current].pack(tensor)

    @property
    def spent_ns(self) -> int:
        return sum(counter.spent_ns for counter in self.counters)

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        self.local.installed, self.local.current, self.counting = True, -1, True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, Counter.unpack):
                yield
        finally:
            self.local.installed, self.counting = False, False

    @property
    def peak_bytes(self) -> int:
        """The busiest partition's peak: memory is per GPU."""
        return max(counter.peak for counter in self.counters)
