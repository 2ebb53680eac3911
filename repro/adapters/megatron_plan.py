"""Megatron (megatron-core), as the parent plans it: the `megatron:` section (tp), its checks and the
paper's name of each variant (torch-free; the adapter, which imports megatron-core: repro.adapters.megatron)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from repro.adapters.plan import FrameworkPlan
from repro.recipe import FrameworkOptions, Recipe
from repro.schema import RecipeError

MEGATRON_OPTIMIZERS = ("adam", "adamw", "sgd")  # what megatron-core's get_megatron_optimizer offers


@dataclass
class MegatronOptions(FrameworkOptions):
    tp: int = 1  # tensor-parallel size: ranks that split each layer; dp = gpus / tp
    # GPUs only: shard the optimizer state over the dp group (megatron-core's distributed optimizer).
    # Off by default, as in the paper's Megatron-LM 2.3, which had none (it came with Megatron-LM 3.0).
    distributed_optimizer: bool = False


class MegatronPlan(FrameworkPlan):
    Options = MegatronOptions
    own_checkpoint = True  # one file per rank: its shards of the model and the optimizer

    # megatron-core's own recompute (TransformerConfig's recompute_granularity), and micro-batches through its
    # schedule (num_microbatches)
    recompute_modes, accumulates = ("selective", "full"), True
    workloads = ("gpt2",)
    not_applicable_because = "Megatron's intra-layer scheme targets transformers"

    @classmethod
    def check(cls, recipe: Recipe, source: str) -> None:
        tp, gpus, spec = recipe.options("megatron").tp, recipe.run.gpus, recipe.model
        if tp < 1:
            raise RecipeError(source, "megatron.tp", f"must be at least 1, got {tp}")
        if gpus % tp:
            raise RecipeError(
                source, "megatron.tp", f"gpus ({gpus}) must be tp ({tp}) x dp: {gpus} % {tp} = {gpus % tp}"
            )
        if spec.n_head % tp:
            raise RecipeError(
                source, "megatron.tp", f"model.n_head ({spec.n_head}) must split over tp ({tp}): "
                f"{spec.n_head} % {tp} = {spec.n_head % tp}",
            )
        if recipe.optimizer().name not in MEGATRON_OPTIMIZERS:
            raise RecipeError(
                source, "megatron.optimizer",
                f"megatron-core's optimizers are {', '.join(MEGATRON_OPTIMIZERS)}, not {recipe.optimizer().name} "
                "(LAMB's per-tensor trust ratio would be taken per shard); set megatron.optimizer",
            )
        if recipe.run.device == "cpu":
            cls.check_device(recipe, source, "cpu")

    @classmethod
    def check_device(cls, recipe: Recipe, source: str, device_type: str) -> None:
        """16-bit runs on GPUs only (the parent checks run.device=cpu; a rank, the device auto became).

        megatron-core's tensor-parallel linear layers are autograd functions whose autocast decorators name
        CUDA (megatron/core/tensor_parallel/layers.py: custom_fwd and custom_bwd with device_type="cuda"), so
        under CPU autocast their backward multiplies a 16-bit gradient by fp32 weights and fails; on GPUs the
        adapter trains 16-bit through Float16Module instead of autocast (repro.adapters.megatron)."""
        if device_type == "cpu" and recipe.train.precision in ("fp16", "bf16", "auto"):  # auto: bf16 on a CPU
            raise RecipeError(source, "train.precision",
                              f"megatron's CPU path runs fp32, not {recipe.train.precision}: megatron-core's linear "
                              "layers autocast on CUDA only (tensor_parallel/layers.py); use fp32 on CPU")

    @classmethod
    def check_memory(cls, recipe: Recipe, source: str) -> None:
        super().check_memory(recipe, source)
        if recipe.train.recompute == "selective" and recipe.train.recompute_layers is not None:
            raise RecipeError(source, "train.recompute_layers", "megatron-core's selective recompute takes no number "
                              "of layers (it recomputes attention's core in every layer); unset it or use full")

    @staticmethod
    def recompute_config(recipe: Recipe) -> dict[str, Any]:
        """train.recompute as megatron-core's TransformerConfig takes it (transformer_config.py): selective
        recomputes attention's core in every layer (recompute_modules' default, core_attn); full
        checkpoints the first train.recompute_layers layers (all when unset), each on its own: the block
        method (transformer_block.py, `_checkpointed_forward`), which is the kit's meaning of recompute_layers."""
        train = recipe.train
        if train.recompute == "selective":
            return {"recompute_granularity": "selective"}
        if train.recompute == "full":
            return {"recompute_granularity": "full", "recompute_method": "block",
                    "recompute_num_layers": train.recompute_layers or recipe.model.n_layer}
        return {}

    @classmethod
    def variant(cls, recipe: Recipe) -> str:
        """The paper's name of this run's scheme: megatron-data (tp=1), -intra (tp=gpus) or -hybrid."""
        tp = recipe.options("megatron").tp
        if tp == 1:
            return "megatron-data"
        return "megatron-intra" if tp == recipe.run.gpus else "megatron-hybrid"
