"""LBANN: the C++ framework with its own runtime, driven through its Python front end.

LBANN does not fit the per-step loop (repro.loop): it reads its data, trains and validates in
its own binary. So LBANN has a framework plan (LBANNPlan: facts and the job's command line) and no
per-rank adapter; the job is repro.adapters.lbann_driver, which
  1. translates the recipe into a plan (`plan` below, pure): VGG-16 with the layers and
     initialisation of repro/workloads/vgg16.py, the recipe's optimizer and global batch, the
     ImageNet reader over the same files (lists of the ImageFolder samples), the print, timer
     and GPU-memory callbacks, and CallbackClipGradientNorm for train.grad_clip;
  2. runs repro/adapters/lbann_experiment.py under LBANN's Python, which builds the plan with
     LBANN's front end and saves experiment.prototext;
  3. launches the `lbann` binary with srun or mpirun (repro.launch, pure) and turns its out.log
     into the kit's events (repro.adapters.lbann_log), so MLflow and the tables work unchanged.
LBANN's GPU memory is device-wide (used = total - free), not the allocator peak the loop records:
the runs say so in their `repro.memory_method` tag.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from repro.adapters.plan import FrameworkPlan
from repro.recipe import FrameworkOptions, Recipe
from repro.schema import RecipeError
from repro.workloads.vgg16_plan import NORMALIZE, POOLS

DRIVER_MODULE = "repro.adapters.lbann_driver"
OPTIMIZERS = ("sgd", "adam")
BYTES_PER_VALUE = 4  # LBANN's default build: dtype=float


@dataclass
class LBANNOptions(FrameworkOptions):
    # auto: srun inside a SLURM allocation ($SLURM_JOB_ID set), else mpirun.
    launcher: Literal["auto", "slurm", "mpirun"] = "auto"


class LBANNPlan(FrameworkPlan):
    Options = LBANNOptions

    workloads = ("vgg16",)
    memory_settings_refused_because = ("LBANN runs its own model and trainer (repro.adapters.lbann_experiment), "
                                       "which the kit gives no recompute or gradient accumulation")
    not_applicable_because = ("the kit translates only VGG-16 into LBANN's layers (LBANN 0.104 ships no GPT-2 "
                              "model); use ddp, zero or megatron")

    @classmethod
    def check(cls, recipe: Recipe, source: str) -> None:
        train = recipe.train
        if train.precision != "fp32":
            raise RecipeError(
                source, "train.precision",
                f"LBANN is built with dtype=float: fp32 only, got {train.precision}; use --set train.precision=fp32",
            )
        if recipe.optimizer().name not in OPTIMIZERS:
            raise RecipeError(
                source, "train.optimizer.name",
                f"LBANN's front end offers {', '.join(OPTIMIZERS)} here, not {recipe.optimizer().name}",
            )
        if train.max_steps is not None:
            raise RecipeError(source, "train.max_steps", "LBANN trains whole epochs; use --epochs instead")
        spec = recipe.model
        feature_size = spec.image_size // 2**POOLS
        if feature_size != spec.pool_size:
            raise RecipeError(
                source, "model.pool_size",
                f"LBANN has no adaptive pooling: the feature map must already be pool_size wide, but "
                f"image_size {spec.image_size} / 2**{POOLS} = {feature_size} != pool_size {spec.pool_size}",
            )

    @classmethod
    def command(cls, recipe: Recipe, run_dir: Path, rdzv_endpoint: str | None = None) -> list[str]:
        """LBANN's driver, one process: it launches the `lbann` ranks itself, with srun or mpirun."""
        return [sys.executable, "-m", DRIVER_MODULE, str(run_dir)]

    @classmethod
    def processes(cls, recipe: Recipe) -> int:
        return 1


# -- the translation: recipe -> plan (plain data that lbann_experiment.py builds with LBANN) -------------


def layers(spec: Any, num_classes: int) -> list[dict[str, Any]]:
    """VGG-16's layers in LBANN's terms, one entry per layer of repro.workloads.vgg16.build_vgg16.

    Initialisation as torchvision's: convolutions Kaiming-normal over fan-out (std sqrt(2 / (out*k*k)))
    and zero bias, linear layers N(0, 0.01) and zero bias. The adaptive average pool and the flatten
    are no-ops in LBANN (check() requires the feature map to be pool_size wide already; LBANN's fully
    connected layers flatten their input).
    """
    from torchvision.models.vgg import cfgs

    out: list[dict[str, Any]] = []
    for width in cfgs["D"]:
        if width == "M":
            out.append({"kind": "max_pool", "size": 2, "stride": 2})
            continue
        channels = width // spec.width_div
        std = math.sqrt(2.0 / (channels * 3 * 3))
        out += [
            {"kind": "convolution", "out_channels": channels, "kernel_size": 3, "stride": 1, "padding": 1,
             "init_std": std},
            {"kind": "relu"},
        ]
    for size in (spec.classifier_width, spec.classifier_width):
        out += [
            {"kind": "fully_connected", "size": size, "init_std": 0.01},
            {"kind": "relu"},
            {"kind": "dropout", "keep_prob": 1.0 - spec.dropout},
        ]
    out.append({"kind": "fully_connected", "size": num_classes, "init_std": 0.01})
    return out


def parameter_count(plan_layers: list[dict[str, Any]], in_channels: int, image_size: int) -> int:
    """Weights and biases of the plan's layers (LBANN does not report them; this counts them)."""
    channels, width, flat, total = in_channels, image_size, None, 0
    for layer in plan_layers:
        if layer["kind"] == "convolution":
            total += channels * layer["out_channels"] * layer["kernel_size"] ** 2 + layer["out_channels"]
            channels = layer["out_channels"]
        elif layer["kind"] == "max_pool":
            width //= layer["stride"]
        elif layer["kind"] == "fully_connected":
            inputs = flat if flat is not None else channels * width * width
            total += inputs * layer["size"] + layer["size"]
            flat = layer["size"]
    return total


def model_state_bytes(plan: dict[str, Any], in_channels: int = 3) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state per rank (every LBANN rank holds all of them)."""
    params = parameter_count(plan["layers"], in_channels, plan["image_size"]) * BYTES_PER_VALUE
    optimizer = plan["optimizer"]
    states = 2 if optimizer["name"] == "adam" else (1 if optimizer.get("momentum") else 0)
    return {"parameters": params, "gradients": params, "optimizer": states * params}


def optimizer_plan(recipe: Recipe) -> tuple[dict[str, Any], float]:
    """(LBANN optimizer, L2 scale). Weight decay is LBANN's L2 term on the objective, whose gradient
    (scale * w) is what PyTorch's coupled weight_decay adds to each gradient."""
    spec = recipe.optimizer()
    if spec.name == "sgd":
        return {"name": "sgd", "learn_rate": spec.lr, "momentum": spec.momentum}, spec.weight_decay
    beta1, beta2 = spec.betas
    return {"name": "adam", "learn_rate": spec.lr, "beta1": beta1, "beta2": beta2, "eps": spec.eps}, spec.weight_decay


def reader_transforms(dataset: str, image_size: int, train: bool) -> list[dict[str, Any]]:
    """LBANN's image transforms matching the workload's, in the order of LBANN's own ImageNet reader
    (applications/vision/data/imagenet/data_reader.prototext).

    LBANN's image reader takes its sample size only from the last crop or resize transform
    (src/proto/init_image_data_readers.cpp), else 256x256: digits, already image_size wide, get a
    `resize` that only sets that size. `colorize` turns grayscale files (ILSVRC2012 has some) into 3
    channels before normalisation. LBANN decodes with OpenCV, in BGR order, so the per-channel mean
    and std are given reversed."""
    if dataset == "digits":  # no resampling, no augmentation
        steps: list[dict[str, Any]] = [{"resize": {"height": image_size, "width": image_size}}]
    elif train:
        steps = [{"random_resized_crop": {"height": image_size, "width": image_size}},
                 {"horizontal_flip": {"p": 0.5}}]
    else:
        resize = image_size * 8 // 7
        steps = [{"resized_center_crop": {"height": resize, "width": resize,
                                          "crop_height": image_size, "crop_width": image_size}}]
    mean, std = NORMALIZE[dataset]
    bgr = {"means": " ".join(map(str, mean[::-1])), "stddevs": " ".join(map(str, std[::-1]))}
    return [*steps, {"colorize": {}}, {"normalize_to_lbann_layout": bgr}]


def reader(role: str, split_dir: Path, label_file: Path, recipe: Recipe, num_classes: int) -> dict[str, Any]:
    return {
        "name": "imagenet", "role": role, "shuffle": role == "train",
        "data_filedir": f"{split_dir}/", "data_filename": str(label_file), "num_labels": num_classes,
        "transforms": reader_transforms(recipe.data.dataset, recipe.model.image_size, role == "train"),
    }


def plan(recipe: Recipe, data_dir: Path, work_dir: Path, num_classes: int) -> dict[str, Any]:
    """Everything LBANN needs to run `recipe`, as plain data (written to plan.json)."""
    optimizer, l2_scale = optimizer_plan(recipe)
    return {
        "seed": recipe.seed,
        "mini_batch_size": LBANNPlan.global_batch(recipe),  # LBANN's mini-batch is the global one
        "epochs": recipe.train.epochs,
        "image_size": recipe.model.image_size,
        "layers": layers(recipe.model, num_classes),
        "optimizer": optimizer,
        "l2_scale": l2_scale,
        "readers": [
            reader("train", data_dir / "train", work_dir / "train.txt", recipe, num_classes),
            reader("validate", data_dir / "val", work_dir / "val.txt", recipe, num_classes),
        ],
        "callbacks": ["print", "timer", "gpu_memory_usage"],
        # Clip by the norm over all weights, as torch.nn.utils.clip_grad_norm_ (null: no clipping).
        "grad_clip": recipe.train.grad_clip or None,
    }


def label_lines(samples: list[tuple[str, int]], split_dir: Path) -> list[str]:
    """LBANN's label list: 'relative/path label' per image, in the samples' order."""
    return [f"{Path(path).relative_to(split_dir)} {label}" for path, label in samples]
