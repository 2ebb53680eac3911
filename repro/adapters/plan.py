"""What the parent knows of a framework before any process starts, without importing it (or torch).

A framework's plan holds its recipe section (`Options`), the checks a recipe must pass, its batch
rule, how many processes its job has, the command that starts them and whether it can checkpoint.
`repro run`, `repro table2`, the recipe's validation and the run's record read these only, so the
parent stays free of torch (issue 30): each framework's plan lives in its own torch-free module
(`repro.adapters.NAME_plan`), and its adapter (repro.adapters.base.Adapter), which the ranks run,
subclasses it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from repro import launch
from repro.recipe import FrameworkOptions, Recipe
from repro.schema import RecipeError


class FrameworkPlan:
    """Base class: the data-parallel defaults (one process per GPU, batch per GPU x GPUs, torchrun of the loop)."""

    Options: type = FrameworkOptions

    workloads: tuple[str, ...] = ("vgg16", "gpt2")  # the workloads this framework applies to
    not_applicable_because: str = ""  # why it does not apply to the others

    # Whether every rank holds the same, whole training state after each step (data parallelism, or a
    # single process). Only then does the base checkpoint (rank 0's state_dict) restore every rank.
    replicated_state: bool = False
    # Whether the adapter brings its own save_checkpoint and load_checkpoint (its ranks hold different
    # state, or the framework has its own format); repro.adapters.base.Adapter holds adapters to it.
    own_checkpoint: bool = False
    # The C++ extension its ranks load on CPU stand-ins (a dotted module name), which they JIT-build where it
    # is not installed prebuilt: then they need a compiler and Python's headers (repro.run.preflight)
    cpu_extension: str | None = None
    # "module:function" that builds it now, in a process of its own (`repro doctor --build-ops`, run by
    # `make setup`), so that no first run pays the build
    cpu_extension_builder: str | None = None
    # Why it trains no fp16 on CPU stand-ins where the CPU computes no fp16 (hardware.cpu_computes_fp16), for a
    # framework that checks this itself as it starts; empty: it trains fp16 on any CPU (torch's autocast)
    cpu_fp16_refused_because: str = ""
    # The memory settings (train.recompute, train.micro_batch, issue 39) this framework applies through its
    # own mechanism: the recompute modes it takes, and whether it accumulates gradients over micro-batches;
    # a setting it does not take is refused before launch with `memory_settings_refused_because`.
    recompute_modes: tuple[str, ...] = ()
    accumulates: bool = False
    memory_settings_refused_because: str = "not yet applied by the kit"

    @classmethod
    def check_workload(cls, recipe: Recipe, source: str) -> None:
        """One line saying why this framework does not apply to the recipe's workload, if it does not."""
        if recipe.workload not in cls.workloads:
            raise RecipeError(source, "run.framework", f"{recipe.run.framework} is not applicable to "
                              f"{recipe.workload}: {cls.not_applicable_because}")

    @classmethod
    def no_checkpoint_because(cls, framework: str) -> str:
        """Why this framework can make no checkpoint, in one line naming `framework` (empty when it can)."""
        if cls.replicated_state or cls.own_checkpoint:
            return ""
        return (f"{framework} cannot checkpoint: its plan ({cls.__module__}.{cls.__name__}) declares neither "
                "a checkpoint of its own (own_checkpoint) nor replicated state (replicated_state)")

    @classmethod
    def check(cls, recipe: Recipe, source: str) -> None:
        """Raise RecipeError (naming the field) when the recipe cannot run under this framework."""

    @classmethod
    def check_memory(cls, recipe: Recipe, source: str) -> None:
        """Refuse, in one line naming the field, a memory setting this framework does not apply."""
        train, framework = recipe.train, recipe.run.framework
        if train.recompute not in (None, "none", *cls.recompute_modes):
            taken = f" (it applies train.recompute={' or '.join(cls.recompute_modes)})" if cls.recompute_modes else ""
            raise RecipeError(source, "train.recompute", f"{framework} does not apply recompute {train.recompute}"
                              f"{taken}: {cls.memory_settings_refused_because}")
        if train.micro_batch not in (None, train.batch_per_gpu) and not cls.accumulates:
            raise RecipeError(source, "train.micro_batch", f"{framework} does not accumulate gradients over "
                              f"micro-batches: {cls.memory_settings_refused_because}")

    @classmethod
    def accumulation_steps(cls, recipe: Recipe) -> int:
        """Forward-backward passes per optimizer step on each process: batch_per_gpu / micro_batch."""
        return recipe.train.batch_per_gpu // (recipe.train.micro_batch or recipe.train.batch_per_gpu)

    @classmethod
    def recompute(cls, recipe: Recipe) -> str:
        """The recompute this framework trains with (effective.recompute)."""
        return recipe.train.recompute or "none"

    @classmethod
    def command(cls, recipe: Recipe, run_dir: Path, rdzv_endpoint: str | None = None) -> list[str]:
        """This node's command line: PyTorch's launcher starting repro.loop in every process, joined
        to the other nodes' launchers through the c10d rendezvous at `rdzv_endpoint` (HOST:PORT).

        A framework with its own runtime (LBANN) returns the command of its own driver instead,
        which must write the same events (repro.events) into `run_dir`.
        """
        processes, nodes = cls.processes(recipe), recipe.run.nodes
        if nodes == 1:
            return launch.torchrun_local(processes, run_dir)
        return launch.torchrun_node(nodes, processes // nodes, rdzv_endpoint, run_dir.name, run_dir)

    @classmethod
    def processes(cls, recipe: Recipe) -> int:
        """Processes the launcher starts for the whole job (one per GPU unless the framework drives several)."""
        return recipe.run.gpus

    @classmethod
    def global_batch(cls, recipe: Recipe) -> int:
        """Samples per optimizer step over the whole job (the paper's rule: batch per GPU x GPUs)."""
        return recipe.train.batch_per_gpu * recipe.run.gpus

    @classmethod
    def micro_batches(cls, recipe: Recipe) -> int:
        """Micro-batches each process cuts its share of a global batch into (a pipeline's, or the passes a
        data-parallel process accumulates gradients over)."""
        return cls.accumulation_steps(recipe)

    @classmethod
    def effective(cls, recipe: Recipe) -> dict[str, Any]:
        """What this framework really trains with, under names every framework shares (MLflow's `effective.*`)."""
        optimizer = recipe.optimizer()
        return {"optimizer": optimizer.name, "lr": optimizer.lr, "weight_decay": optimizer.weight_decay,
                "global_batch": cls.global_batch(recipe), "micro_batches": cls.micro_batches(recipe),
                "recompute": cls.recompute(recipe)}


def checkpoints_whole_blocks(who: str) -> str:
    """Why a framework whose adapter recomputes through repro.adapters.recompute refuses selective recompute."""
    return (f"selective recompute (attention's core only) is megatron-core's granularity; {who} checkpoints "
            "whole blocks with torch.utils.checkpoint")


def require_fp32(recipe: Recipe, source: str, framework: str) -> None:
    """The paper ran both pipeline frameworks in fp32 (neither offered mixed precision)."""
    if recipe.train.precision != "fp32":
        raise RecipeError(source, "train.precision", f"{framework} runs fp32 as in the paper; got {recipe.train.precision}")
