"""VGG-16 on images, as the parent plans it: the model section, its checks and the training images the
data holds (torch-free; the model and its data, with torchvision: repro.workloads.vgg16)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from repro.data.sets import DIGITS_SIZE  # the size digits are written at; they are not resampled
from repro.recipe import Recipe
from repro.schema import AT_LEAST_1, FRACTION, Bounds, RecipeError
from repro.workloads.plan import WorkloadPlan

NUM_CLASSES = {"imagenet": 1000, "digits": 10, "synthetic": 1000}
# Mean and standard deviation per channel (RGB), by which the images are normalised (LBANN's reader too)
NORMALIZE = {
    "imagenet": ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    "digits": ([0.5, 0.5, 0.5], [0.5, 0.5, 0.5]),
}
POOLS = 5  # configuration D halves the image five times


@dataclass
class VGG16Spec:
    width_div: Annotated[int, Bounds(low=1, high=64)] = 1  # 64, the narrowest layer, keeps one channel
    classifier_width: Annotated[int, AT_LEAST_1] = 4096
    pool_size: Annotated[int, AT_LEAST_1] = 7
    image_size: Annotated[int, Bounds(low=2**POOLS)] = 224
    dropout: Annotated[float, FRACTION] = 0.5


class VGG16Plan(WorkloadPlan):
    ModelSpec = VGG16Spec
    metric = "accuracy"
    higher_is_better = True
    supported_datasets = tuple(NUM_CLASSES)

    @classmethod
    def check(cls, recipe: Recipe, source: str) -> None:
        super().check(recipe, source)
        if recipe.data.dataset == "digits" and recipe.model.image_size != DIGITS_SIZE:
            raise RecipeError(source, "model.image_size", f"digits are {DIGITS_SIZE}x{DIGITS_SIZE} images and are "
                              f"not resampled; set model.image_size={DIGITS_SIZE}, not {recipe.model.image_size}")

    @classmethod
    def real_train_samples(cls, recipe: Recipe, data_dir: Path) -> int:
        """Files under train/ (ImageFolder keeps only the images among them)."""
        return sum(len(files) for _, _, files in os.walk(data_dir / "train"))
