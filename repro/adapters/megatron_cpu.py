"""megatron-core's GPTModel on the CPU: the smallest adaptations around its hard-coded CUDA calls.

Imported only by repro.adapters.megatron, and only where the ranks train on the CPU. Every
adaptation names the megatron-core 0.16.1 file it works around; tests/test_megatron.py pins the
source of each of those internals (PINNED), so that a new megatron-core fails a test instead of
silently changing what the CPU path trains. One more adaptation is public and lives in the adapter:
`TransformerConfig(use_cpu_initialization=True)`.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import random as mcore_random
from megatron.core.utils import GlobalMemoryBuffer
from torch.overrides import TorchFunctionMode

# The internals the adaptations below rely on or replace: "module:qualified name". The pin guard
# test hashes each one's source; a change means re-reading it before moving megatron-core's pin.
PINNED = (
    "megatron.core.utils:GlobalMemoryBuffer.get_tensor",
    "megatron.core.parallel_state:get_global_memory_buffer",
    "megatron.core.tensor_parallel.random:CudaRNGStatesTracker.add",
    "megatron.core.tensor_parallel.random:CudaRNGStatesTracker.fork",
    "megatron.core.tensor_parallel.random:initialize_rng_tracker",
    "megatron.core.tensor_parallel.random:get_cuda_rng_tracker",
    "megatron.core.transformer.utils:get_default_causal_mask",
    "megatron.core.fusions.fused_softmax:FusedScaleMaskSoftmax.forward_torch_softmax",
    "megatron.core.transformer.dot_product_attention:DotProductAttention.forward",
    "megatron.core.pipeline_parallel.schedules:forward_backward_no_pipelining",
    "megatron.core.tensor_parallel.random:_get_all_rng_states",
    "megatron.core.tensor_parallel.random:_set_all_rng_states",
    "megatron.core.tensor_parallel.random:_fork_rng",
    "megatron.core.tensor_parallel.random:CheckpointFunction.forward",
    "megatron.core.tensor_parallel.random:CheckpointFunction.backward",
)


class CpuMemoryBuffer(GlobalMemoryBuffer):
    """megatron/core/utils.py: GlobalMemoryBuffer.get_tensor allocates with
    device=torch.cuda.current_device(); the local spec's DotProductAttention
    (transformer/dot_product_attention.py) takes its attention-score buffer from it through
    parallel_state.get_global_memory_buffer(). Same reuse by (name, dtype), on the CPU."""

    def get_tensor(self, tensor_shape: Any, dtype: torch.dtype, name: str,
                   mem_alloc_context: Callable | None = None) -> torch.Tensor:
        needed = math.prod(tensor_shape)
        buffer = self.buffer.get((name, dtype))
        if buffer is None or buffer.numel() < needed:
            buffer = self.buffer[(name, dtype)] = torch.empty(needed, dtype=dtype)
        return buffer[:needed].view(*tensor_shape)


class CpuRngTracker(mcore_random.CudaRNGStatesTracker):
    """megatron/core/tensor_parallel/random.py: CudaRNGStatesTracker.add and .fork read and set the
    CUDA generator (torch.cuda.get_rng_state, _set_cuda_rng_state). Attention dropout
    (dot_product_attention.py) draws inside `get_cuda_rng_tracker().fork()`, a stream of this tp
    rank's own. The public `inference_rng_tracker=True` makes fork a no-op, which is right only with
    dropout 0; this tracker keeps the named streams on the CPU generator instead."""

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_ or name in self.states_:
            raise ValueError(f"RNG stream {name!r} or seed {seed} already added")
        self.seeds_.add(seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
        self._is_initialized = True

    @contextlib.contextmanager
    def fork(self, name: str = mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def all_rng_states() -> tuple[torch.Tensor, None, dict[str, torch.Tensor]]:
    """megatron/core/tensor_parallel/random.py: recompute's CheckpointFunction saves `_get_all_rng_states()`
    before its forward and restores them (`_set_all_rng_states`, inside `_fork_rng`) before recomputing,
    so that dropout draws the same masks; they read and set the CUDA generator (_get_cuda_rng_state,
    _set_cuda_rng_state). On the CPU: the CPU generator and the tracker's streams (CpuRngTracker's,
    CPU states too), the CUDA state left None."""
    return torch.get_rng_state(), None, mcore_random.get_cuda_rng_tracker().get_states()


def set_all_rng_states(cpu_state: torch.Tensor, cuda_state: None, tracker_states: dict[str, torch.Tensor]) -> None:
    """The counterpart of `all_rng_states`: restore the CPU generator and the tracker's streams."""
    torch.set_rng_state(cpu_state)
    mcore_random.get_cuda_rng_tracker().set_states(tracker_states)


class CudaAllocationsOnCpu(TorchFunctionMode):
    """megatron/core/pipeline_parallel/schedules.py: forward_backward_no_pipelining counts the step's
    tokens in `torch.zeros([], dtype=torch.int, device="cuda")`. Entered around the schedule, this mode
    makes a tensor asked for on a CUDA device on the CPU instead (torch's own function-mode hook, which
    every torch function passes while it is entered); everything else runs unchanged."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def install() -> None:
    """Replace megatron-core's CUDA memory buffer, RNG tracker and recompute's RNG states by the CPU ones
    (after parallel_state.initialize_model_parallel, which makes the buffer)."""
    parallel_state._GLOBAL_MEMORY_BUFFER = CpuMemoryBuffer()
    mcore_random._CUDA_RNG_STATE_TRACKER = CpuRngTracker()
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mcore_random._get_all_rng_states, mcore_random._set_all_rng_states = all_rng_states, set_all_rng_states


def causal_mask(seq_len: int) -> torch.Tensor:
    """True above the diagonal: what GPTModel's causal attention masks out. Without an explicit mask,
    fusions/fused_softmax.py (FusedScaleMaskSoftmax.forward_torch_softmax) builds one with
    transformer/utils.py's get_default_causal_mask, on device="cuda"."""
    return torch.triu(torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool), diagonal=1)
