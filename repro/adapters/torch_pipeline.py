"""PyTorch's own pipeline schedules (`torch.distributed.pipelining`): GPipe, 1F1B, interleaved 1F1B, zero bubble.

One process per GPU. The workload's nn.Sequential is cut into contiguous stages (balanced by
parameter count unless the recipe gives `balance`); stage s runs on rank s % GPUs, so the
interleaved schedules give each rank several stages ("looped" placement) and the last stage, which
computes the loss and reports it, is always on the last rank. Every rank reads the whole global
batch (the first stage needs the inputs, the last the targets); the schedule splits it into
`microbatches` and scales gradients by 1/microbatches, so one step equals one step of sequential
training on the whole batch.

Two things a per-stage optimizer cannot see, handled here as Megatron does:
- Tied weights. GPT-2's output head multiplies by the token embedding's weight. The first and the
  last stage each keep that weight; after the backward pass their gradients are summed between the
  two ranks (the same sum autograd forms in one process), so both copies take identical steps.
  The copy is real memory on the last stage and is counted in its model state.
- The global gradient norm. `train.grad_clip` and optimizers that clip by the whole model's norm
  (timm's LAMB: `max_grad_norm` in its defaults) need every stage's gradients; the norm is summed
  over ranks (a tied weight counted once) and the clipping applied here, so the optimizer's own
  clip then finds nothing left to do.

Checkpoints: one file per rank, torch-pipeline-rank{r}.pt, with its stages' parameters (a tied
weight's copy included, so both copies come back equal) and its optimizer's state. The schedules
keep no state between steps (each step() builds its microbatches and actions afresh), so there is
none to save.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from repro.adapters import pipeline
from repro.adapters.base import Adapter, Reduction, parameter_users
from repro.adapters.torch_pipeline_plan import MULTI_STAGE, SCHEDULES, TorchPipelinePlan, microbatches, stages_per_rank
from repro.checkpoint import atomic_torch_save
from repro.optim import make_optimizer
from repro.partition import balance


def stage_starts(model: nn.Sequential) -> list[bool]:
    """Where a stage may begin: its input is a leaf tensor autograd must keep, so not at an in-place layer
    (VGG's ReLU(inplace=True))."""
    return [index == 0 or not getattr(layer, "inplace", False) for index, layer in enumerate(model)]


def layer_weights(model: nn.Sequential) -> list[int]:
    return [sum(p.numel() for p in layer.parameters()) for layer in model]


class TorchPipelineAdapter(TorchPipelinePlan, Adapter):
    @property
    def stage_count(self) -> int:
        return self.ctx.world * stages_per_rank(self.options)

    @property
    def reporting_rank(self) -> int:
        return (self.stage_count - 1) % self.ctx.world

    def data_shard(self) -> tuple[int, int]:
        return 0, 1

    def setup(self, model: nn.Sequential) -> None:
        import torch.distributed.pipelining as pipelining

        count, world, rank = self.stage_count, self.ctx.world, self.ctx.rank
        sizes = self.options.balance or balance(layer_weights(model), count, stage_starts(model))
        starts = [sum(sizes[:s]) for s in range(count)]
        stage_modules = [nn.Sequential(*model[start : start + size]) for start, size in zip(starts, sizes)]
        self.mine = [s for s in range(count) if s % world == rank]
        self.model = nn.ModuleList(stage_modules[s] for s in self.mine).to(self.ctx.device)
        stages = [pipelining.PipelineStage(stage_modules[s], s, count, self.ctx.device) for s in self.mine]
        schedule_class = getattr(pipelining, SCHEDULES[self.options.schedule])
        self.schedule = schedule_class(
            stages if self.options.schedule in MULTI_STAGE else stages[0],
            n_microbatches=microbatches(self.ctx.recipe), loss_fn=self.ctx.workload.loss,
        )
        self.tie_across_ranks(stage_modules)
        self.optimizer = make_optimizer(self.ctx.recipe.optimizer(), self.model.parameters())

    def tie_across_ranks(self, stage_modules: list[nn.Module]) -> None:
        """Process groups for parameters held by stages on different ranks (every rank creates every group)."""
        self.tied: list[tuple[nn.Parameter, Any]] = []
        self.counted_elsewhere: set[nn.Parameter] = set()  # tied copies whose norm another rank counts
        for param, stages in parameter_users(stage_modules).items():
            ranks = sorted({s % self.ctx.world for s in stages})
            if len(ranks) < 2:
                continue
            group = dist.new_group(ranks)
            if self.ctx.rank in ranks:
                self.tied.append((param, group))
            if self.ctx.rank in ranks[1:]:
                self.counted_elsewhere.add(param)

    def pipeline_arguments(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[tuple, dict]:
        """The whole batch goes in on the rank holding the first stage, the targets on the one holding the last."""
        args = (inputs.to(self.ctx.device),) if 0 in self.mine else ()
        kwargs = {"target": targets.to(self.ctx.device)} if self.stage_count - 1 in self.mine else {}
        return args, kwargs

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        self.optimizer.zero_grad(set_to_none=True)
        args, kwargs = self.pipeline_arguments(inputs, targets)
        losses: list[torch.Tensor] = []
        with self.autocast():
            self.schedule.step(*args, losses=losses, return_outputs=False, **kwargs)
        for param, group in self.tied:
            dist.all_reduce(param.grad, group=group)
        self.clip_whole_model()
        self.optimizer.step()
        return self.shard_loss(torch.stack(losses).mean()) if losses else None

    def reduce_losses(self, losses: list[torch.Tensor | None]) -> Reduction | None:
        return pipeline.last_stage_losses(losses)

    def clip_whole_model(self) -> None:
        """Apply train.grad_clip and the optimizer's own global-norm clip with the norm of every stage's gradients."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        counted = [p.grad for p in self.model.parameters() if p.grad is not None and p not in self.counted_elsewhere]
        squares = torch.stack([torch.linalg.vector_norm(g.float()) ** 2 for g in counted]).sum()
        norm = self.all_reduce(squares).sqrt()
        grad_clip = self.ctx.recipe.train.grad_clip
        if grad_clip:  # as nn.utils.clip_grad_norm_ computes it
            coefficient = (grad_clip / (norm + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(grads, coefficient)
            norm = norm * coefficient
        optimizer_clip = self.optimizer.defaults.get("max_grad_norm")
        if optimizer_clip:  # as timm's LAMB computes it
            torch._foreach_div_(grads, (norm / optimizer_clip).clamp(min=1.0))

    def eval_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward through every stage (the schedule also wants targets, for its loss); sums on the last stage.

        A batch that does not split into equal microbatches (the last one, or one smaller than the
        microbatch count) is padded with copies of its first sample, whose outputs are dropped.
        """
        count, parts = len(inputs), microbatches(self.ctx.recipe)
        extra = max(parts, -(-count // parts) * parts) - count
        inputs, targets = (torch.cat([t, t[:1].expand(extra, *t.shape[1:])]) for t in (inputs, targets))
        args, kwargs = self.pipeline_arguments(inputs, targets)
        with torch.no_grad(), self.autocast():
            output = self.schedule.eval(*args, **kwargs)
        if not kwargs:
            return None
        return self.ctx.workload.metric_sums(output[:count], kwargs["target"][:count])

    def checkpoint_file(self, folder: Path) -> Path:
        return folder / f"torch-pipeline-rank{self.ctx.rank}.pt"

    def save_checkpoint(self, folder: Path) -> None:
        """Every rank writes its own stages' state: no rank holds another's layers."""
        atomic_torch_save(self.state_dict(), self.checkpoint_file(folder))

    def load_checkpoint(self, folder: Path) -> None:
        self.load_state_dict(torch.load(self.checkpoint_file(folder), map_location=self.ctx.device))
