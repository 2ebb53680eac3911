"""PyTorch DistributedDataParallel, as the parent plans it (torch-free; the adapter: repro.adapters.ddp)."""
from __future__ import annotations

from repro.adapters.plan import FrameworkPlan, checkpoints_whole_blocks


class DDPPlan(FrameworkPlan):
    replicated_state = True  # DDP keeps every replica equal: rank 0's state dict is every rank's
    # torch.utils.checkpoint around the workload's blocks, and no_sync() for all micro-batches but the last
    recompute_modes, accumulates = ("full",), True
    memory_settings_refused_because = checkpoints_whole_blocks("DDP")
