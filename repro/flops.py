"""FLOPs: the floating-point operations of one training step on this rank, by phase.

torch's FlopCounterMode (torch/utils/flop_counter.py) counts matrix products, convolutions and
scaled-dot-product attention by their shapes (`flop_registry`: mm, addmm, bmm, baddbmm 2 m n k;
convolution and convolution_backward; the CUDA SDPA kernels and their backwards) and nothing
elementwise. This counter is a dispatch mode that applies the same formulas (the registry itself), plus
CPU's SDPA kernel (`_scaled_dot_product_flash_attention_for_cpu`, which the registry lacks) with the
registry's SDPA formulas, and files each operation under a phase:
- backward: run by the autograd engine (a graph task is current) with grad mode off, as the engine runs
  gradient formulas;
- recompute: run by the engine with grad mode on: activation checkpointing's forward again, which
  torch.utils.checkpoint and torchgpipe run under enable_grad inside backward; or inside `recomputing()`,
  which the kit's own checkpoint opens around its recomputation (repro.adapters.recompute), or under a
  reentrant checkpoint's node (megatron-core's), since an autograd Function's forward runs with grad
  mode off even there (ZeRO-3's linears; megatron-core's);
- forward: the rest (the optimizer's step is elementwise: none of it counts).

A dispatch mode is thread-local: it sees the ops of the thread that entered it and of the autograd
engine's threads, which inherit the caller's thread-local state; torchgpipe's partitions run their
forwards on worker threads of their own, which the counter reaches by hooks on them (`watch`). The
loop counts one warm-up step (`Trainer.counters`), which the step times leave out.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count, shape_wrapper

from repro import names

PHASES = names.FLOP_PHASES
# a reentrant checkpoint's node: its backward runs the recomputation (megatron-core's CheckpointFunction,
# megatron/core/tensor_parallel/random.py: its custom linears' forwards run with grad mode off even there)
REENTRANT_CHECKPOINT = "CheckpointFunctionBackward"
aten = torch.ops.aten


@shape_wrapper
def cpu_sdpa(query: torch.Size, key: torch.Size, value: torch.Size, *args: Any, **kwargs: Any) -> int:
    return sdpa_flop_count(query, key, value)


@shape_wrapper
def cpu_sdpa_backward(grad_out: torch.Size, query: torch.Size, key: torch.Size, value: torch.Size, *args: Any,
                      **kwargs: Any) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


# the CPU kernels' arguments lead with the same tensors as the CUDA ones' (aten's native_functions.yaml)
CPU_FORMULAS = {aten._scaled_dot_product_flash_attention_for_cpu: cpu_sdpa,
                aten._scaled_dot_product_flash_attention_for_cpu_backward: cpu_sdpa_backward}


class PhaseMode(TorchDispatchMode):
    """The dispatch mode that files each counted operation of its thread under its phase with `counter`."""

    def __init__(self, counter: "FlopCounter"):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        formula = CPU_FORMULAS.get(packet) or flop_registry.get(packet)
        if formula is not None:
            self.counter.add(self.counter.phase(), formula(*args, **kwargs, out_val=out))  # the registry's calling convention
        return out


class FlopCounter:
    """Counts one step's FLOPs by phase, while `counting()` is open, on the thread that opened it and,
    for modules it `watch`es, in their forwards on other threads (torchgpipe's workers)."""

    def __init__(self) -> None:
        self.counts = dict.fromkeys(PHASES, 0)
        self.counted = False
        self.thread: int | None = None  # the counting thread while counting
        self.lock = threading.Lock()
        self.elsewhere = threading.local()  # a watched module's modes open on other threads
        self.recomputations = 0  # `recomputing()` contexts open

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        self.counts = dict.fromkeys(PHASES, 0)
        self.thread = threading.get_ident()
        try:
            with PhaseMode(self):
                yield
        finally:
            self.thread = None
        self.counted = True

    def phase(self) -> str:
        """The phase of the operation running now (the module's docstring)."""
        if self.recomputations:
            return "recompute"
        if torch._C._current_graph_task_id() == -1:
            return "forward"
        node = torch._C._current_autograd_node()  # the node whose backward the engine runs now
        reentrant = node is not None and node.name().endswith(REENTRANT_CHECKPOINT)
        return "recompute" if torch.is_grad_enabled() or reentrant else "backward"

    @contextlib.contextmanager
    def recomputing(self) -> Iterator[None]:
        """Everything inside is recompute: a checkpoint's recomputation (torch.utils.checkpoint's
        `context_fn`), where grad mode alone cannot tell: a custom autograd Function's forward runs with
        grad mode off (DeepSpeed ZeRO-3's LinearFunctionForZeroStage3, megatron-core's linear layers)."""
        self.recomputations += 1
        try:
            yield
        finally:
            self.recomputations -= 1

    def add(self, phase: str, flops: int) -> None:
        with self.lock:
            self.counts[phase] += flops

    def watch(self, modules: Sequence[nn.Module]) -> None:
        """Count the forwards of `modules` wherever they run: a dispatch mode is thread-local, and
        torchgpipe runs its partitions' forwards on worker threads that do not inherit it."""
        for module in modules:
            module.register_forward_pre_hook(self.enter_elsewhere)
            module.register_forward_hook(self.leave_elsewhere, always_call=True)

    def enter_elsewhere(self, module: nn.Module, args: Any) -> None:
        if self.thread is not None and threading.get_ident() != self.thread:
            mode = PhaseMode(self)
            mode.__enter__()
            self.elsewhere.modes = [*getattr(self.elsewhere, "modes", []), mode]

    def leave_elsewhere(self, module: nn.Module, args: Any, output: Any) -> None:
        modes = getattr(self.elsewhere, "modes", [])
        if modes:
            modes.pop().__exit__(None, None, None)

    def per_step(self) -> dict[str, int] | None:
        """FLOPs by phase of the counted step; None before one is counted."""
        return dict(self.counts) if self.counted else None
