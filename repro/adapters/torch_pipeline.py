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

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from repro import registry
from repro.adapters import pipeline
from repro.adapters.base import Adapter, Reduction, parameter_users
from repro.checkpoint import atomic_torch_save
from repro.optim import make_optimizer
from repro.partition import balance
from repro.recipe import FrameworkOptions, Recipe, section_key
from repro.schema import RecipeError

SCHEDULES = {  # recipe name -> class in torch.distributed.pipelining
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zero-bubble": "ScheduleInterleavedZeroBubble",
}
MULTI_STAGE = ("interleaved-1f1b", "zero-bubble")
SECTION = section_key("torch-pipeline")


@dataclass
class TorchPipelineOptions(FrameworkOptions):
    schedule: Literal["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"] = "1f1b"
    microbatches: int | None = None  # per global batch; default 2 x GPUs
    stages_per_rank: int | None = None  # default 1, or 2 for the interleaved schedules (which need 2 or more)
    balance: list[int] | None = None  # layers per stage; default balances parameter counts


def stages_per_rank(options: TorchPipelineOptions) -> int:
    return options.stages_per_rank or (2 if options.schedule in MULTI_STAGE else 1)


def microbatches(recipe: Recipe) -> int:
    return recipe.options().microbatches or 2 * recipe.run.gpus


def stage_starts(model: nn.Sequential) -> list[bool]:
    """Where a stage may begin: its input is a leaf tensor autograd must keep, so not at an in-place layer
    (VGG's ReLU(inplace=True))."""
    return [index == 0 or not getattr(layer, "inplace", False) for index, layer in enumerate(model)]


def layer_weights(model: nn.Sequential) -> list[int]:
    return [sum(p.numel() for p in layer.parameters()) for layer in model]


def valid_split(weights: list[int], starts: list[bool], sizes: list[int]) -> bool:
    """Every stage non-empty, with parameters, and beginning where a stage may begin."""
    firsts = [sum(sizes[:s]) for s in range(len(sizes))]
    return min(sizes) >= 1 and all(
        starts[first] and sum(weights[first : first + size]) for first, size in zip(firsts, sizes)
    )


class TorchPipelineAdapter(Adapter):
    Options = TorchPipelineOptions

    @classmethod
    def micro_batches(cls, recipe: Recipe) -> int:
        return microbatches(recipe)

    @classmethod
    def check(cls, recipe: Recipe, source: str) -> None:
        import torch.distributed.pipelining as pipelining

        options = recipe.options()
        if not hasattr(pipelining, SCHEDULES[options.schedule]):
            raise RecipeError(source, f"{SECTION}.schedule", f"this PyTorch ({torch.__version__}) has no {options.schedule} schedule")
        if recipe.train.precision == "fp16":
            raise RecipeError(source, "train.precision", "torch-pipeline runs fp32 or bf16 (no loss scaling across stages); use bf16")
        stages = cls.check_stages(recipe, source)
        cls.check_microbatches(recipe, source, stages)

    @classmethod
    def check_stages(cls, recipe: Recipe, source: str) -> int:
        """The number of stages, once it fits the schedule, the GPUs and the model's layers."""
        options, gpus = recipe.options(), recipe.run.gpus
        per_rank = stages_per_rank(options)
        if (options.schedule in MULTI_STAGE) != (per_rank > 1):
            raise RecipeError(
                source, f"{SECTION}.stages_per_rank",
                f"{options.schedule} needs {'2 or more stages' if options.schedule in MULTI_STAGE else '1 stage'} per rank, got {per_rank}",
            )
        model = cls.meta_model(recipe)
        stages, weights, starts = gpus * per_rank, layer_weights(model), stage_starts(model)
        trainable = sum(1 for weight in weights if weight)
        if stages > trainable:  # every stage needs a parameter, or its optimizer has nothing to step
            raise RecipeError(
                source, "run.gpus",
                f"{gpus} GPUs x {per_rank} stages per rank = {stages} stages, but the model has only {trainable} layers with parameters",
            )
        sizes = options.balance
        if sizes is None:
            try:
                balance(weights, stages, starts)
            except ValueError as error:
                raise RecipeError(source, "run.gpus", str(error)) from None
        elif len(sizes) != stages or sum(sizes) != len(weights) or not valid_split(weights, starts, sizes):
            raise RecipeError(
                source, f"{SECTION}.balance",
                f"needs {stages} layer counts summing to {len(weights)}, each stage with parameters and not beginning "
                f"with an in-place layer, got {sizes} (sum {sum(sizes)})",
            )
        return stages

    @classmethod
    def check_microbatches(cls, recipe: Recipe, source: str, stages: int) -> None:
        field, count, batch = f"{SECTION}.microbatches", microbatches(recipe), cls.global_batch(recipe)
        if count < 1 or batch % count:
            raise RecipeError(source, field, f"the global batch ({batch}) must split into {count} equal microbatches: {batch} % {count} = {batch % max(count, 1)}")
        schedule = recipe.options().schedule
        if schedule == "1f1b" and count < stages:
            raise RecipeError(source, field, f"1f1b needs at least one microbatch per stage: {count} < {stages} stages")
        rounds = max(1, count // recipe.run.gpus)
        if schedule in MULTI_STAGE and count % rounds:
            raise RecipeError(
                source, field,
                f"{schedule} runs max(1, {count} // {recipe.run.gpus}) = {rounds} rounds, which must divide {count} microbatches",
            )

    @staticmethod
    def meta_model(recipe: Recipe) -> nn.Sequential:
        """The workload's layers on the meta device (no memory): enough to count and weigh them."""
        workload = registry.workload_class(recipe.workload)(recipe.model, recipe.data, None)
        with torch.device("meta"):
            return workload.build_model()

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
