"""PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`): PyTorch's own fully sharded data parallelism.

Each rank holds 1/N of every parameter, gradient and optimizer state as DTensor shards (the native
counterpart of ZeRO-3); a unit's parameters are all-gathered just before it runs and its gradients
reduce-scattered right after. Each block of the workload's model (`Workload.blocks`: a GPT-2
transformer block, a VGG-16 convolution stage or classifier layer) is one FSDP unit, as torchtitan
wraps a transformer block; layers sharing a parameter (GPT-2's head is tied to the token embedding)
stay in the root unit, because FSDP2 requires a shared parameter to live in one unit. On CPU every
unit costs its collectives' latency and its hooks whatever its size (docs/measurement.md "FSDP's
cost"): VGG-16's 16 layers with parameters were 16 units before, now 8.

Recipe section `fsdp:` chooses the sharding strategy (full: reshard after forward, ZeRO-3;
grad-op: keep parameters gathered from forward to backward, ZeRO-2-like traffic; hybrid: shard
within groups of gpus/replicas ranks and replicate across the groups, HSDP) and the dtype of the
gradient reduction; parameters compute in train.precision. fp16 scales the loss dynamically
(`loss_scaler`: torch's ShardedGradScaler, which unscales the DTensor gradient shards and agrees
on an overflow over all ranks, skipping the step everywhere).

Memory settings (issue 39): train.recompute=full runs the workload's blocks under torch.utils.checkpoint
(repro.adapters.recompute, as DDP), around the units: FSDP2's pre-forward hook does not gather a unit
again for the recomputation, which runs after the unit's pre-backward gather (torch/distributed/fsdp/
_fully_shard/_fsdp_state.py, `_pre_forward`/`_post_forward`: nothing in TrainingState.PRE_BACKWARD).
train.micro_batch cuts the rank's batch into micro-batches with gradient sync off for all but the last
(`set_requires_gradient_sync(False)`, _fully_shard.py: each param group's `reduce_grads` and
`all_reduce_grads`); their gradients are reduce-scattered once, after the last. Between micro-batches
FSDP2 keeps every parameter's whole (unsharded) gradient: `post_backward` (_fsdp_param_group.py) returns
early without reducing, leaving the gradient on `_unsharded_param.grad`, cast to the reduce dtype into
`unsharded_accumulated_grad` where that differs (_fsdp_param.py, `to_accumulated_grad_if_needed`);
the adapter counts those buffers as gradients (`unsharded_gradient_bytes`).

Checkpoints are PyTorch's distributed checkpoint (`torch.distributed.checkpoint`), as FSDP2's users
write them: the sharded state dicts of model and optimizer (DTensors), every rank writing its own
shards into CHECKPOINT_FOLDER and reading them back into the same mesh.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from repro.adapters.base import Adapter, parameter_users
from repro.adapters.fsdp_plan import FSDPPlan
from repro.adapters.recompute import apply_recompute
from repro.metrics import optimizer_tensors, tensor_bytes
from repro.optim import make_optimizer

CHECKPOINT_FOLDER = "fsdp"  # the subfolder of a loop checkpoint that holds the DCP files
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def local(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """The part of a (D)Tensor that this rank stores."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def units(model: nn.Sequential, blocks: list[list[int]]) -> list[list[nn.Module]]:
    """The layers each FSDP unit below the root holds: a block's layers with parameters, less those that
    share a parameter with another layer (left to the root); blocks left empty are dropped."""
    shared = {index for users in parameter_users(model).values() if len(users) > 1 for index in users}
    found = [[model[index] for index in block if index not in shared and next(model[index].parameters(), None) is not None]
             for block in blocks]
    return [unit for unit in found if unit]


def unsharded_gradient_bytes(model: nn.Module) -> int:
    """Bytes of the whole gradients FSDP2 holds between micro-batches while gradient sync is off: each
    parameter's on its unsharded parameter, or its reduce-dtype copy (the module docstring cites the source)."""
    from torch.distributed.fsdp import FSDPModule

    held = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for param in group.fsdp_params:
                    unsharded = getattr(param, "_unsharded_param", None)  # absent before the first gather
                    held += [param.unsharded_accumulated_grad, None if unsharded is None else unsharded.grad]
    return tensor_bytes(held)


class FSDPAdapter(FSDPPlan, Adapter):
    def setup(self, model: nn.Sequential) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        model = model.to(self.ctx.device)
        self.recomputed = apply_recompute(model, self.ctx.recipe, self.recompute(self.ctx.recipe), self.activations, self.flops)
        self.gradients_between = 0  # the most bytes of whole gradients held between micro-batches
        precision = self.ctx.recipe.train.precision
        policy = MixedPrecisionPolicy(
            param_dtype=None if precision == "fp32" else DTYPES[precision],
            reduce_dtype=DTYPES[self.options.reduce_dtype],
        )
        settings = {"mesh": self.mesh(), "reshard_after_forward": self.options.sharding != "grad-op", "mp_policy": policy}
        found = units(model, self.ctx.workload.blocks(model))
        self.unit_layers = [[type(layer).__name__ for layer in unit] for unit in found]  # before FSDP renames them
        for unit in found:
            fully_shard(unit, **settings)
        self.model = fully_shard(model, **settings)
        # The multi-tensor path (foreach): on CPU torch's optimizers default to a loop over the
        # parameters, and each of its operations on a DTensor passes DTensor's dispatch in Python;
        # foreach takes a few operations for all of them. Same arithmetic, bit for bit (docs/measurement.md
        # "FSDP's cost"); not for timm's LAMB, whose foreach path rounds differently (repro.optim).
        self.optimizer = make_optimizer(self.ctx.recipe.optimizer(), self.model.parameters(), foreach=True)
        self.scaler = self.loss_scaler()

    def loss_scaler(self) -> Any:
        """fp16's dynamic loss scaling (a pass-through under fp32 and bf16): torch's ShardedGradScaler
        (torch/distributed/fsdp/sharded_grad_scaler.py), whose unscale_ all-reduces the found-inf flag over
        every rank, so that the step is skipped and the scale halved on all ranks or on none, whichever shard
        overflowed; it unscales FSDP2's DTensor gradients through DTensor's dispatch, which reduces the flag
        over the mesh too (torch/distributed/tensor/_dispatch.py, found_inf_reduce_handler). A process alone
        has no group to agree with: torch's GradScaler."""
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        enabled = self.ctx.recipe.train.precision == "fp16"
        if dist.is_initialized() and dist.get_world_size() > 1:
            return ShardedGradScaler(self.ctx.device.type, enabled=enabled, process_group=dist.group.WORLD)
        return torch.amp.GradScaler(self.ctx.device.type, enabled=enabled)

    def facts(self) -> dict[str, Any]:
        """The units below the root, each as the types of its layers with parameters, and the recomputed blocks."""
        recomputed = {"recomputed_blocks": self.recomputed} if self.recomputed else {}
        return {"units": self.unit_layers, **recomputed}

    def mesh(self) -> Any:
        """1-D mesh over all ranks, or (replicate, shard) for hybrid sharding."""
        from torch.distributed.device_mesh import init_device_mesh

        world = self.ctx.world
        if self.options.sharding == "hybrid":
            replicas = self.options.replicas
            return init_device_mesh(self.ctx.device.type, (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))
        return init_device_mesh(self.ctx.device.type, (world,), mesh_dim_names=("shard",))

    def set_training(self, mode: bool) -> None:
        """Back in training after evaluation, reshard every unit: grad-op keeps a unit gathered from its
        forward until its backward, and an evaluation forward has no backward, so the whole model would
        stay gathered into the next step (and the model-state count would see it instead of the shards)."""
        from torch.distributed.fsdp import FSDPModule

        super().set_training(mode)
        if mode:
            for module in self.model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    def autocast(self) -> contextlib.AbstractContextManager:
        """FSDP casts parameters itself (MixedPrecisionPolicy), so no autocast on top."""
        return contextlib.nullcontext()

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
        """Forward and backward of one micro-batch, gradient sync on for the last only (the sharded
        gradients are reduce-scattered once a step, from the whole gradients summed over the micro-batches)."""
        self.model.set_requires_gradient_sync(last)
        loss = self.micro_batch_loss(inputs, targets)
        self.scaler.scale(loss).backward()
        if not last:
            self.gradients_between = max(self.gradients_between, unsharded_gradient_bytes(self.model))
        return loss.detach()

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of the shards this rank stores (the local tensors of the DTensors); gradients: the sharded
        ones, or with micro-batches the whole gradients held between them where those are more (sharded
        gradients appear only in the last micro-batch's backward, as the whole ones are reduce-scattered)."""
        params = list(self.model.parameters())
        return {
            "parameters": tensor_bytes(local(p) for p in params),
            "gradients": max(tensor_bytes(local(p.grad) for p in params), self.gradients_between),
            "optimizer": tensor_bytes(local(t) for t in optimizer_tensors(self.optimizer)),
        }

    def sharded_state(self) -> dict[str, Any]:
        """Model and optimizer state dicts whose tensors are this rank's DTensor shards (no gathering)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optimizer": optimizer, "scaler": self.scaler.state_dict()}  # fp16's scale (else empty)

    def save_checkpoint(self, folder: Path) -> None:
        """Every rank writes its shards (plus rank 0 the replicated entries) with torch.distributed.checkpoint."""
        import torch.distributed.checkpoint as dcp

        dcp.save(self.sharded_state(), checkpoint_id=folder / CHECKPOINT_FOLDER)

    def load_checkpoint(self, folder: Path) -> None:
        """Read this rank's shards in place into a state dict of the same layout, then hand it to model and optimizer."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self.sharded_state()
        dcp.load(state, checkpoint_id=folder / CHECKPOINT_FOLDER)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
