"""PipeDream, as the parent plans it: the `pipedream:` section, its checks and its batch rule (one
mini-batch of batch_per_gpu flows through the stages) (torch-free; the adapter: repro.adapters.pipedream)."""
from __future__ import annotations

from dataclasses import dataclass

from repro.adapters.plan import FrameworkPlan, require_fp32
from repro.recipe import FrameworkOptions, Recipe
from repro.schema import RecipeError


@dataclass
class PipeDreamOptions(FrameworkOptions):
    balance: list[int] | None = None  # layers per stage; None: balanced by measured per-layer time
    vertical_sync: bool = False


class PipeDreamPlan(FrameworkPlan):
    Options = PipeDreamOptions
    own_checkpoint = True  # one file per stage: its weights, stashed versions and mini-batches in flight
    memory_settings_refused_because = (
        "PipeDream has no such mechanism: each stage keeps every in-flight mini-batch's activations for its "
        "backward against the stashed weights, and a mini-batch is one step (no accumulation)")

    @classmethod
    def check(cls, recipe: Recipe, source: str) -> None:
        options = recipe.options("pipedream")
        require_fp32(recipe, source, "pipedream")
        if options.balance is not None and len(options.balance) != recipe.run.gpus:
            raise RecipeError(
                source, "pipedream.balance",
                f"needs one entry per stage (GPU): {len(options.balance)} entries for {recipe.run.gpus} GPUs",
            )

    @classmethod
    def global_batch(cls, recipe: Recipe) -> int:
        return recipe.train.batch_per_gpu
