"""PyTorch FSDP2, as the parent plans it: the `fsdp:` section and its checks (torch-free; the adapter:
repro.adapters.fsdp)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from repro.adapters.plan import FrameworkPlan, checkpoints_whole_blocks
from repro.recipe import FrameworkOptions, Recipe
from repro.schema import RecipeError


@dataclass
class FSDPOptions(FrameworkOptions):
    sharding: Literal["full", "grad-op", "hybrid"] = "full"
    replicas: int = 2  # hybrid only: how many replicas of the sharded model (each shards over gpus/replicas ranks)
    reduce_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"


class FSDPPlan(FrameworkPlan):
    Options = FSDPOptions
    own_checkpoint = True  # PyTorch's distributed checkpoint: every rank its shards
    # torch.utils.checkpoint around the workload's blocks, and set_requires_gradient_sync(False) for all
    # micro-batches but the last
    recompute_modes, accumulates = ("full",), True
    memory_settings_refused_because = checkpoints_whole_blocks("FSDP2")

    @classmethod
    def check(cls, recipe: Recipe, source: str) -> None:
        options = recipe.options()
        gpus = recipe.run.gpus
        if options.sharding == "hybrid" and (options.replicas < 2 or gpus % options.replicas):
            raise RecipeError(
                source, "fsdp.replicas",
                f"hybrid sharding needs at least 2 replicas that divide the GPUs: "
                f"{gpus} % {options.replicas} = {gpus % max(options.replicas, 1)}",
            )
