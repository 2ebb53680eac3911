"""PyTorch DistributedDataParallel, as the parent plans it (torch-free; the adapter: repro.adapters.ddp)."""
from __future__ import annotations

from repro.adapters.plan import FrameworkPlan


class DDPPlan(FrameworkPlan):
    replicated_state = True  # DDP keeps every replica equal: rank 0's state dict is every rank's
