"""PyTorch's pipeline schedules, as the parent plans them: the `torch_pipeline:` section and its checks
(the schedule exists, the stages fit the GPUs and the model's layers, the microbatches the batch), from
the workload's shape without building the model (torch-free; the adapter: repro.adapters.torch_pipeline)."""
from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from typing import Literal

from repro.adapters.plan import FrameworkPlan
from repro.model.pipelines import MULTI_STAGE, microbatch_count, stage_count
from repro.partition import balance
from repro.recipe import FrameworkOptions, Recipe, section_key
from repro.schema import RecipeError
from repro.shapes import shape_of

SCHEDULES = {  # recipe name -> class in torch.distributed.pipelining
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zero-bubble": "ScheduleInterleavedZeroBubble",
}
# The torch release each schedule came with: torch.distributed.pipelining with 2.4, the zero-bubble schedule
# with 2.5 (pytorch/pytorch#133467, merged in August 2024). Read from the installed package's metadata: the
# parent does not import torch.
SINCE = {"gpipe": (2, 4), "1f1b": (2, 4), "interleaved-1f1b": (2, 4), "zero-bubble": (2, 5)}
SECTION = section_key("torch-pipeline")


@dataclass
class TorchPipelineOptions(FrameworkOptions):
    schedule: Literal["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"] = "1f1b"
    microbatches: int | None = None  # per global batch; default train.micro_batch samples each, else 2 x GPUs
    stages_per_rank: int | None = None  # default 1, or 2 for the interleaved schedules (which need 2 or more)
    balance: list[int] | None = None  # layers per stage; default balances parameter counts


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as "2.14.1" or "2.5.0+cu121"."""
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def stages_per_rank(options: TorchPipelineOptions) -> int:
    return stage_count(options.schedule, options.stages_per_rank)


def microbatches(recipe: Recipe) -> int:
    """The schedule's micro-batches a step (repro.model.pipelines.microbatch_count: the model reads the same rule)."""
    train = recipe.train
    return microbatch_count(recipe.options().microbatches, train.micro_batch, train.batch_per_gpu, recipe.run.gpus)


def layers(recipe: Recipe) -> tuple[list[int], list[bool]]:
    """Each layer's parameter count, and where a stage may begin, from the workload's shape (repro.shapes)
    rather than its built model (the adapter's `layer_weights`, `stage_starts`). The head's tied weight
    counts with the embedding there, which leaves every layer as weighted or weightless as in the model,
    so a split exists here exactly where the adapter finds one."""
    shape = shape_of(recipe.workload, recipe.model, recipe.data.dataset)
    return [sum(layer) for layer in shape.layer_tensors()], shape.stage_starts()


def valid_split(weights: list[int], starts: list[bool], sizes: list[int]) -> bool:
    """Every stage non-empty, with parameters, and beginning where a stage may begin."""
    firsts = [sum(sizes[:s]) for s in range(len(sizes))]
    return min(sizes) >= 1 and all(
        starts[first] and sum(weights[first : first + size]) for first, size in zip(firsts, sizes)
    )


class TorchPipelinePlan(FrameworkPlan):
    Options = TorchPipelineOptions
    own_checkpoint = True  # one file per rank: its stages' parameters and optimizer state
    # train.micro_batch is the schedule's micro-batch size (the schedule accumulates the gradients over its
    # micro-batches); torch_pipeline.microbatches counts them instead, so a recipe sets one of the two
    accumulates = True
    memory_settings_refused_because = "recompute around its stages' blocks is not yet applied by the kit"

    @classmethod
    def micro_batches(cls, recipe: Recipe) -> int:
        return microbatches(recipe)

    @classmethod
    def check(cls, recipe: Recipe, source: str) -> None:
        options = recipe.options()
        installed = importlib.metadata.version("torch")
        if release(installed) < SINCE[options.schedule]:
            raise RecipeError(source, f"{SECTION}.schedule", f"this PyTorch ({installed}) has no {options.schedule} schedule "
                              f"(torch.distributed.pipelining.{SCHEDULES[options.schedule]} came with torch "
                              f"{'.'.join(map(str, SINCE[options.schedule]))})")
        if recipe.train.precision == "fp16":
            raise RecipeError(source, "train.precision", "torch-pipeline runs fp32 or bf16 (no loss scaling across stages); "
                              "use bf16, or fp32 on GPUs without bf16")
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
        stages, (weights, starts) = gpus * per_rank, layers(recipe)
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
        if recipe.options().microbatches and recipe.train.micro_batch:
            raise RecipeError(source, field, f"set either {field} ({count} a step) or train.micro_batch "
                              f"({recipe.train.micro_batch} samples each), not both: they could disagree")
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
