"""PyTorch DistributedDataParallel: each rank holds the whole model and averages gradients.

Memory settings (issue 39): train.recompute=full runs the workload's blocks (repro.shapes: `blocks`;
GPT-2's transformer blocks, VGG-16's five convolution stages up to and with their max-pools) under
torch.utils.checkpoint (repro.adapters.recompute); train.micro_batch cuts the rank's batch into
micro-batches whose gradients accumulate in `.grad`, inside `no_sync()` for all but the last, so the
gradients are all-reduced once a step, as without micro-batches.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from repro.adapters.base import Adapter
from repro.adapters.ddp_plan import DDPPlan
from repro.adapters.recompute import apply_recompute
from repro.optim import make_optimizer


class DDPAdapter(DDPPlan, Adapter):
    def setup(self, model: nn.Sequential) -> None:
        from torch.nn.parallel import DistributedDataParallel

        device = self.ctx.device
        model = model.to(device)
        self.recomputed = apply_recompute(model, self.ctx.recipe, self.recompute(self.ctx.recipe), self.activations, self.flops)
        ids = [device.index] if device.type == "cuda" else None
        self.model = DistributedDataParallel(model, device_ids=ids)
        self.optimizer = make_optimizer(self.ctx.recipe.optimizer(), self.model.parameters())
        fp16 = self.ctx.recipe.train.precision == "fp16"
        self.scaler = torch.amp.GradScaler(device.type, enabled=fp16)

    def facts(self) -> dict[str, Any]:
        return {"recomputed_blocks": self.recomputed} if self.recomputed else {}  # without recompute: as before

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        inputs, targets = inputs.to(self.ctx.device), targets.to(self.ctx.device)
        self.optimizer.zero_grad(set_to_none=True)
        loss = sum(self.accumulate(*micro) for micro in self.split_micro_batches(inputs, targets))
        self.scaler.unscale_(self.optimizer)
        self.clip_gradients(self.model.parameters())
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return self.shard_loss(loss)

    def accumulate(self, inputs: torch.Tensor, targets: torch.Tensor, last: bool) -> torch.Tensor:
        """Forward and backward of one micro-batch; DDP all-reduces the summed gradients with the last one only."""
        with contextlib.nullcontext() if last else self.model.no_sync():
            loss = self.micro_batch_loss(inputs, targets)
            self.scaler.scale(loss).backward()
        return loss.detach()

    def model_state_bytes(self) -> dict[str, int]:
        """Parameters, gradients and Adam state as the base counts them, plus DDP's reducer buckets.

        With `gradient_as_bucket_view` off (PyTorch's default, used here), DDP all-reduces gradients in
        flat bucket tensors that cover every parameter and copies the result into `.grad`: the rank holds
        the gradients twice. The buckets are not reachable from Python; their sizes are DDP's own record.
        """
        state = super().model_state_bytes()
        logged = self.model._get_ddp_logging_data()
        buckets = [int(size) for size in str(logged.get("bucket_sizes", "")).split(",") if size]
        if not logged.get("gradient_as_bucket_view"):
            state["gradients"] += sum(buckets)
        return state

    def state_dict(self) -> dict:
        return {**super().state_dict(), "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.scaler.load_state_dict(state["scaler"])
