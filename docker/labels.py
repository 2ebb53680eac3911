"""The image's labels, read from what the build produced: `make image` runs this inside the image
(`docker run -i --entrypoint python IMAGE - < docker/labels.py`) and builds again with its output,
one `--label io.repro.NAME=VALUE` per fact. Runs on the image's Python, so it imports only what the
image has."""
import contextlib
import importlib
import importlib.metadata
import platform
import sys
from pathlib import Path

DISTRIBUTIONS = ["torch", "torchvision", "deepspeed", "megatron-core", "torchgpipe", "datasets", "mlflow"]
LBANN_BUILD = Path("/opt/lbann/build-info")  # written by the Dockerfile's lbann-1 stage


def deepspeed_ops() -> list[str]:
    """Ops DeepSpeed's setup recorded as built and whose compiled module really imports: setup skips
    a requested op it judges incompatible without a warning."""
    from deepspeed.git_version_info import installed_ops
    from deepspeed.ops.op_builder.all_ops import ALL_OPS

    built = []
    for name, builder in sorted(ALL_OPS.items()):
        if installed_ops.get(name):
            try:
                importlib.import_module(builder.absolute_name())
            except ImportError:
                continue
            built.append(name)
    return built


def facts() -> dict[str, str]:
    import deepspeed.git_version_info
    import torch

    found = {
        "python": platform.python_version(),
        "cuda": torch.version.cuda or "none",
        "cudnn": str(torch.backends.cudnn.version() or "none"),
        "deepspeed-accelerator": deepspeed.git_version_info.accelerator_name or "none",
        "deepspeed-ops": ",".join(deepspeed_ops()) or "none",
        **{name: importlib.metadata.version(name) for name in DISTRIBUTIONS},
    }
    if LBANN_BUILD.exists():  # name=value lines
        found.update(line.split("=", 1) for line in LBANN_BUILD.read_text().split())
    return found


if __name__ == "__main__":
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed prints its accelerator choice on import
        found = facts()
    print(" ".join(f"--label io.repro.{name}={value}" for name, value in found.items()))
