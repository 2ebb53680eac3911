"""DeepSpeed ZeRO, as the parent plans it: the `zero:` recipe section and its checks (torch-free;
the adapter, which imports DeepSpeed: repro.adapters.zero)."""
from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from repro.adapters.plan import FrameworkPlan, checkpoints_whole_blocks
from repro.recipe import FrameworkOptions, Recipe
from repro.schema import RecipeError

STAGES = (1, 2, 3)
# torch optimizers whose state ZeRO knows how to partition (deepspeed.runtime.zero.utils)
ZERO_OPTIMIZERS = ("adam", "adamw")


@dataclass
class ZeroOptions(FrameworkOptions):
    """The `zero:` recipe section. Sizes are in elements; their defaults are DeepSpeed's."""

    stage: int = 2  # the Table 2 default; configs/*-paper.yaml give the reason
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    # stage 3: parameters with fewer elements stay whole on every rank
    param_persistence_threshold: int = 100_000
    prefetch_bucket_size: int = 50_000_000


class ZeroPlan(FrameworkPlan):
    Options = ZeroOptions
    own_checkpoint = True  # DeepSpeed's own: every rank writes its partition
    # On CPU DeepSpeed loads its shared-memory op at a run's start, building it unless it was installed
    # prebuilt (deepspeed/comm/torch.py, build_shm_op; its module: ops/op_builder/cpu/comm.py, absolute_name)
    cpu_extension = "deepspeed.ops.comm.deepspeed_shm_comm_op"
    cpu_extension_builder = "repro.adapters.zero:build_cpu_extension"
    # deepspeed.initialize raises "Type fp16 is not supported on your device" in every rank
    # (deepspeed/runtime/engine.py, _do_sanity_check; accelerator/cpu_accelerator.py, is_fp16_supported)
    cpu_fp16_refused_because = "DeepSpeed trains fp16 on a CPU only where oneDNN computes fp16 (AVX512-FP16 or AMX-FP16)"
    # DeepSpeed's gradient_accumulation_steps, and torch.utils.checkpoint around the workload's blocks
    # (repro.adapters.zero says why not deepspeed.checkpointing)
    recompute_modes, accumulates = ("full",), True
    memory_settings_refused_because = checkpoints_whole_blocks("under ZeRO the kit")

    @classmethod
    def check(cls, recipe: Recipe, source: str) -> None:
        options: ZeroOptions = recipe.options("zero")
        if options.stage not in STAGES:
            raise RecipeError(source, "zero.stage", f"got {options.stage}; ZeRO stages are 1, 2 and 3")
        optimizer = recipe.optimizer()
        if optimizer.name not in ZERO_OPTIMIZERS:
            field = "zero.optimizer.name" if options.optimizer else "train.optimizer.name"
            raise RecipeError(
                source, field,
                f"ZeRO stage {options.stage} partitions only Adam-type optimizer state; got {optimizer.name!r}, "
                f"valid: {', '.join(ZERO_OPTIMIZERS)} (set zero.optimizer to override the workload's optimizer)",
            )
        for name in ("reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size"):
            if getattr(options, name) < 1:
                raise RecipeError(source, f"zero.{name}", f"must be at least 1 element, got {getattr(options, name)}")
        if options.param_persistence_threshold < 0:
            raise RecipeError(source, "zero.param_persistence_threshold", "must be at least 0")


def extension_folder() -> Path:
    """Where DeepSpeed builds its CPU op for this Python environment (torch's TORCH_EXTENSIONS_DIR).

    torch's default is one folder per Python and CUDA version (torch/utils/cpp_extension.py,
    get_default_build_root), shared by every virtualenv; its build.ninja names the environment's include
    paths, so two checkouts that take turns rebuild the op each time (35 s here: a matrix's first ZeRO
    cell paid it after a test clone's run). A folder per environment builds once."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "torch_extensions" / f"repro-{hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]}"
