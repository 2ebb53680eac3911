"""torchgpipe, as the parent plans it: the `torchgpipe:` section, its checks, one process driving every
GPU and the paper's batch rule (micro-batch x chunks_per_gpu x GPUs) (torch-free; the adapter: repro.adapters.torchgpipe)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from repro.adapters.plan import FrameworkPlan, require_fp32
from repro.recipe import FrameworkOptions, Recipe
from repro.schema import RecipeError


@dataclass
class GPipeOptions(FrameworkOptions):
    balance: list[int] | None = None  # layers per partition; None: computed by `balance_by`
    balance_by: Literal["time", "size"] = "time"
    chunks_per_gpu: int = 4  # micro-batches per mini-batch = chunks_per_gpu x GPUs
    checkpoint: Literal["always", "except_last", "never"] = "except_last"


class GPipePlan(FrameworkPlan):
    Options = GPipeOptions
    replicated_state = True  # one process holds every partition: its state dict is the whole state
    memory_settings_refused_because = (
        "torchgpipe recomputes and cuts micro-batches its own way: set torchgpipe.checkpoint (always, except_last, "
        "never); its micro-batches are its chunks, train.batch_per_gpu samples each, torchgpipe.chunks_per_gpu x GPUs a step")

    @classmethod
    def check(cls, recipe: Recipe, source: str) -> None:
        options, run = recipe.options("torchgpipe"), recipe.run
        if run.nodes > 1:
            raise RecipeError(source, "run.nodes", f"torchgpipe drives the GPUs of one node only; got --nodes {run.nodes}")
        require_fp32(recipe, source, "torchgpipe")
        if options.chunks_per_gpu < 1:
            raise RecipeError(source, "torchgpipe.chunks_per_gpu", f"must be at least 1, got {options.chunks_per_gpu}")
        if options.balance is not None and len(options.balance) != run.gpus:
            raise RecipeError(
                source, "torchgpipe.balance", f"needs one entry per GPU: {len(options.balance)} entries for {run.gpus} GPUs"
            )

    @classmethod
    def check_memory(cls, recipe: Recipe, source: str) -> None:
        """train.recompute is refused whatever its value (even none: torchgpipe's own default recomputes)."""
        if recipe.train.recompute is not None:
            raise RecipeError(source, "train.recompute", f"torchgpipe does not take train.recompute: "
                              f"{cls.memory_settings_refused_because}")
        super().check_memory(recipe, source)

    @classmethod
    def recompute(cls, recipe: Recipe) -> str:
        return recipe.options("torchgpipe").checkpoint

    @classmethod
    def processes(cls, recipe: Recipe) -> int:
        return 1

    @classmethod
    def chunks(cls, recipe: Recipe) -> int:
        return recipe.options("torchgpipe").chunks_per_gpu * recipe.run.gpus

    @classmethod
    def global_batch(cls, recipe: Recipe) -> int:
        return recipe.train.batch_per_gpu * cls.chunks(recipe)

    @classmethod
    def micro_batches(cls, recipe: Recipe) -> int:
        return cls.chunks(recipe)
