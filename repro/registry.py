"""Names users type, mapped to the code behind them, without importing any of it.

`repro --help` and `repro list` read this module only: availability is checked by finding the modules
on the import path without importing them (`installed`), so a missing framework costs nothing until
it is asked for, and planning a run imports no framework.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import shutil
from dataclasses import dataclass

IMAGE_HINT = "use the kit's container image (see README, 'Containers')"


def installed(module: str) -> bool:
    """Whether `module` is installed, found without importing it or any package above it
    (importlib.util.find_spec("megatron.core") would import megatron's __init__)."""
    parts = module.split(".")
    spec = importlib.util.find_spec(parts[0])
    for depth in range(2, len(parts) + 1):
        if spec is None or spec.submodule_search_locations is None:
            return False
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:depth]), spec.submodule_search_locations)
    return spec is not None


@dataclass(frozen=True)
class FrameworkEntry:
    name: str
    plan: str  # "module:Class" of its FrameworkPlan, which imports no framework (the parent reads it)
    adapter: str  # "module:Class" of its Adapter, which its ranks run ("": the framework runs its own ranks)
    parallelism: str
    needs_modules: tuple[str, ...] = ()
    needs_programs: tuple[str, ...] = ()
    install_hint: str = ""
    image_hint: str = ""  # inside the kit's image ($REPRO_IMAGE set), when the image was built without it
    # what its adapter imports inside its methods: a warm launcher imports it once for all ranks (repro.warm)
    rank_modules: tuple[str, ...] = ()

    def missing(self) -> list[str]:
        """What this framework needs that is not installed here (empty when available), each name once."""
        gone = [m for m in self.needs_modules if not installed(m)]
        gone += [p for p in self.needs_programs if shutil.which(p) is None]
        return list(dict.fromkeys(gone))  # LBANN's module and program share one name: say it once

    def absence(self) -> str:
        """What this framework lacks here, as every refusal says it ("missing deepspeed"); empty when nothing."""
        missing = self.missing()
        return f"missing {', '.join(missing)}" if missing else ""

    def hint(self) -> str:
        """How to get what is missing, here: the install hint, or inside the image how to rebuild it."""
        return self.image_hint if self.image_hint and os.environ.get("REPRO_IMAGE") else self.install_hint


FRAMEWORKS: dict[str, FrameworkEntry] = {
    entry.name: entry
    for entry in (
        FrameworkEntry("ddp", "repro.adapters.ddp_plan:DDPPlan", "repro.adapters.ddp:DDPAdapter", "data",
                       rank_modules=("torch.nn.parallel",)),
        FrameworkEntry(
            "zero", "repro.adapters.zero_plan:ZeroPlan", "repro.adapters.zero:ZeroAdapter", "data (sharded)",
            ("deepspeed",), install_hint="pip install -r requirements.txt (deepspeed)",
        ),
        FrameworkEntry(
            "megatron", "repro.adapters.megatron_plan:MegatronPlan", "repro.adapters.megatron:MegatronAdapter",
            "intra-layer (tensor) + data", ("megatron.core",), install_hint="pip install -r requirements.txt (megatron-core)",
            rank_modules=("megatron.core.models.gpt.gpt_model", "megatron.core.optimizer", "megatron.core.distributed"),
        ),
        FrameworkEntry(
            "torchgpipe", "repro.adapters.torchgpipe_plan:GPipePlan", "repro.adapters.torchgpipe:GPipeAdapter",
            "inter-layer (pipeline, flush)", ("torchgpipe",), install_hint="pip install -r requirements.txt (torchgpipe)",
            rank_modules=("torchgpipe.balance",),
        ),
        FrameworkEntry("pipedream", "repro.adapters.pipedream_plan:PipeDreamPlan", "repro.adapters.pipedream:PipeDreamAdapter",
                       "inter-layer (pipeline, async)"),
        FrameworkEntry(  # no adapter: its driver (repro.adapters.lbann_driver) starts LBANN's own ranks
            "lbann", "repro.adapters.lbann:LBANNPlan", "", "data", ("lbann",), ("lbann",),
            install_hint=f"{IMAGE_HINT}, or build it with Spack: spack install lbann@0.104 +cuda +vision +pfe",
            image_hint="this image was built without it: make image WITH_LBANN=1 (docs/containers.md)",
        ),
        FrameworkEntry("fsdp", "repro.adapters.fsdp_plan:FSDPPlan", "repro.adapters.fsdp:FSDPAdapter", "data (fully sharded, FSDP2)",
                       rank_modules=("torch.distributed.fsdp", "torch.distributed.checkpoint.state_dict")),
        FrameworkEntry(
            "torch-pipeline", "repro.adapters.torch_pipeline_plan:TorchPipelinePlan",
            "repro.adapters.torch_pipeline:TorchPipelineAdapter", "inter-layer (pipeline schedules)",
            rank_modules=("torch.distributed.pipelining",),
        ),
        FrameworkEntry(  # no adapter: its plan refuses every recipe, with the reason
            "axonn", "repro.adapters.axonn:AxoNNPlan", "", "inter-layer + data (async)", ("axonn",),
            install_hint="not supported: axonn 0.2.0 needs CUDA GPUs and NCCL (see repro/adapters/axonn.py)",
        ),
    )
}

@dataclass(frozen=True)
class WorkloadEntry:
    plan: str  # "module:Class" of its WorkloadPlan, which imports no torch (the parent reads it)
    workload: str  # "module:Class" of its Workload, which its ranks run


WORKLOADS: dict[str, WorkloadEntry] = {
    "vgg16": WorkloadEntry("repro.workloads.vgg16_plan:VGG16Plan", "repro.workloads.vgg16:VGG16Workload"),
    "gpt2": WorkloadEntry("repro.workloads.gpt2_plan:GPT2Plan", "repro.workloads.gpt2:GPT2Workload"),
}


class UnknownName(LookupError):
    pass


class Unavailable(RuntimeError):
    pass


def framework(name: str) -> FrameworkEntry:
    if name not in FRAMEWORKS:
        raise UnknownName(f"unknown framework {name!r}; valid frameworks: {', '.join(FRAMEWORKS)}")
    return FRAMEWORKS[name]


def load(dotted: str) -> type:
    """Import "module:Class". A module that exists but fails to import re-raises its own error."""
    module, _, attr = dotted.partition(":")
    return getattr(importlib.import_module(module), attr)


def available(name: str) -> FrameworkEntry:
    """The entry of `name`, or a one-line reason why the framework cannot be used here."""
    entry = framework(name)
    absence = entry.absence()
    if absence:
        raise Unavailable(f"framework {name!r} is not available here: {absence}; {entry.hint()}")
    return entry


def plan_class(name: str) -> type:
    """The framework plan of `name`, which imports no framework: what the parent plans a run with."""
    return load(available(name).plan)


def adapter_class(name: str) -> type:
    """The adapter class of `name`, which its ranks run (its module imports the framework)."""
    entry = available(name)
    if not entry.adapter:
        raise UnknownName(f"framework {name!r} has no adapter: its own runtime trains ({entry.plan})")
    return load(entry.adapter)


def workload(name: str) -> WorkloadEntry:
    if name not in WORKLOADS:
        raise UnknownName(f"unknown model {name!r}; valid models: {', '.join(WORKLOADS)}")
    return WORKLOADS[name]


def workload_plan(name: str) -> type:
    """The workload plan of `name` (repro.workloads.plan: no torch imported)."""
    return load(workload(name).plan)


def workload_class(name: str) -> type:
    """The workload class for `name`, which its ranks run (imports torch)."""
    return load(workload(name).workload)
