"""Names users type, mapped to the code behind them, without importing any of it.

`repro --help` and `repro list` read this module only: availability is checked with
`importlib.util.find_spec`, so a missing framework costs nothing until it is asked for.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
from dataclasses import dataclass

IMAGE_HINT = "use the kit's container image (see README, 'Containers')"


@dataclass(frozen=True)
class FrameworkEntry:
    name: str
    adapter: str  # "module:Class"
    parallelism: str
    needs_modules: tuple[str, ...] = ()
    needs_programs: tuple[str, ...] = ()
    install_hint: str = ""
    image_hint: str = ""  # inside the kit's image ($REPRO_IMAGE set), when the image was built without it
    # what its adapter imports inside its methods: a warm launcher imports it once for all ranks (repro.warm)
    rank_modules: tuple[str, ...] = ()

    def missing(self) -> list[str]:
        """What this framework needs that is not installed here (empty when available), each name once."""
        gone = [m for m in self.needs_modules if importlib.util.find_spec(m) is None]
        gone += [p for p in self.needs_programs if shutil.which(p) is None]
        return list(dict.fromkeys(gone))  # LBANN's module and program share one name: say it once

    def hint(self) -> str:
        """How to get what is missing, here: the install hint, or inside the image how to rebuild it."""
        return self.image_hint if self.image_hint and os.environ.get("REPRO_IMAGE") else self.install_hint


FRAMEWORKS: dict[str, FrameworkEntry] = {
    entry.name: entry
    for entry in (
        FrameworkEntry("ddp", "repro.adapters.ddp:DDPAdapter", "data", rank_modules=("torch.nn.parallel",)),
        FrameworkEntry(
            "zero", "repro.adapters.zero:ZeroAdapter", "data (sharded)", ("deepspeed",),
            install_hint="pip install -r requirements.txt (deepspeed)",
        ),
        FrameworkEntry(
            "megatron", "repro.adapters.megatron:MegatronAdapter", "intra-layer (tensor) + data",
            ("megatron.core",), install_hint="pip install -r requirements.txt (megatron-core)",
            rank_modules=("megatron.core.models.gpt.gpt_model", "megatron.core.optimizer", "megatron.core.distributed"),
        ),
        FrameworkEntry(
            "torchgpipe", "repro.adapters.torchgpipe:GPipeAdapter", "inter-layer (pipeline, flush)",
            ("torchgpipe",), install_hint="pip install -r requirements.txt (torchgpipe)",
            rank_modules=("torchgpipe.balance",),
        ),
        FrameworkEntry("pipedream", "repro.adapters.pipedream:PipeDreamAdapter", "inter-layer (pipeline, async)"),
        FrameworkEntry(
            "lbann", "repro.adapters.lbann:LBANNAdapter", "data", ("lbann",), ("lbann",),
            install_hint=f"{IMAGE_HINT}, or build it with Spack: spack install lbann@0.104 +cuda +vision +pfe",
            image_hint="this image was built without it: make image WITH_LBANN=1 (docs/containers.md)",
        ),
        FrameworkEntry("fsdp", "repro.adapters.fsdp:FSDPAdapter", "data (fully sharded, FSDP2)",
                       rank_modules=("torch.distributed.fsdp", "torch.distributed.checkpoint.state_dict")),
        FrameworkEntry(
            "torch-pipeline", "repro.adapters.torch_pipeline:TorchPipelineAdapter", "inter-layer (pipeline schedules)",
            rank_modules=("torch.distributed.pipelining",),
        ),
        FrameworkEntry(
            "axonn", "repro.adapters.axonn:AxoNNAdapter", "inter-layer + data (async)", ("axonn",),
            install_hint="not supported: axonn 0.2.0 needs CUDA GPUs and NCCL (see repro/adapters/axonn.py)",
        ),
    )
}

WORKLOADS: dict[str, str] = {
    "vgg16": "repro.workloads.vgg16:VGG16Workload",
    "gpt2": "repro.workloads.gpt2:GPT2Workload",
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


def adapter_class(name: str) -> type:
    """The adapter class for `name`, or a one-line reason why it cannot be used here."""
    entry = framework(name)
    missing = entry.missing()
    if missing:
        raise Unavailable(
            f"framework {name!r} is not available here: missing {', '.join(missing)}; {entry.hint()}"
        )
    return load(entry.adapter)


def workload_class(name: str) -> type:
    if name not in WORKLOADS:
        raise UnknownName(f"unknown model {name!r}; valid models: {', '.join(WORKLOADS)}")
    return load(WORKLOADS[name])
