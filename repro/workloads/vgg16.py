"""VGG-16 (configuration D) on images, as one flat list of layers.

At width_div=1, classifier_width=4096, pool_size=7 and 1000 classes this is torchvision's vgg16
(138,357,544 parameters), built from torchvision's own `make_layers` and initialised as it is.
The smoke variant divides the convolution widths and shrinks the classifier for 32x32 inputs.
"""
from __future__ import annotations

import torch
from torch import nn
from torchvision import datasets, transforms
from torchvision.models.vgg import cfgs, make_layers

from repro.workloads.base import Workload, limit
from repro.workloads.vgg16_plan import NORMALIZE, NUM_CLASSES, VGG16Plan, VGG16Spec


def build_vgg16(spec: VGG16Spec, num_classes: int) -> nn.Sequential:
    widths = [c if c == "M" else c // spec.width_div for c in cfgs["D"]]
    features = make_layers(widths)
    last = widths[-2] * spec.pool_size**2
    hidden = spec.classifier_width
    model = nn.Sequential(
        *features,
        nn.AdaptiveAvgPool2d(spec.pool_size),
        nn.Flatten(1),
        nn.Linear(last, hidden), nn.ReLU(True), nn.Dropout(spec.dropout),
        nn.Linear(hidden, hidden), nn.ReLU(True), nn.Dropout(spec.dropout),
        nn.Linear(hidden, num_classes),
    )
    for module in model.modules():  # torchvision's VGG initialisation
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0, 0.01)
            nn.init.zeros_(module.bias)
    return model


def conv_flops(model: nn.Sequential, image_size: int) -> float:
    """Forward FLOPs (2 per multiply-add) of the convolution and linear layers of a meta-device model."""
    total = 0.0

    def count(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        nonlocal total
        if isinstance(module, nn.Conv2d):
            total += 2.0 * module.weight.numel() * output.shape[-1] * output.shape[-2]
        elif isinstance(module, nn.Linear):
            total += 2.0 * module.weight.numel()

    hooks = [m.register_forward_hook(count) for m in model]
    with torch.no_grad():
        model(torch.zeros(1, 3, image_size, image_size, device="meta"))
    for hook in hooks:
        hook.remove()
    return total


class VGG16Workload(VGG16Plan, Workload):
    @property
    def num_classes(self) -> int:
        return NUM_CLASSES[self.data.dataset]

    def build_model(self) -> nn.Sequential:
        return build_vgg16(self.spec, self.num_classes)

    def blocks(self, model: nn.Sequential) -> list[list[int]]:
        """VGG's own blocks (Simonyan and Zisserman 2015, table 1): each stage of convolutions up to its
        max-pool, then the classifier's layers one by one (a linear layer with its ReLU and dropout)."""
        blocks: list[list[int]] = [[]]
        for index, layer in enumerate(model):
            if isinstance(layer, nn.Linear) and blocks[-1]:
                blocks.append([])
            blocks[-1].append(index)
            if isinstance(layer, nn.MaxPool2d):
                blocks.append([])
        return [block for block in blocks if block]

    def _transforms(self, train: bool) -> transforms.Compose:
        normalize = transforms.Normalize(*NORMALIZE[self.data.dataset])
        size = self.spec.image_size
        if self.data.dataset == "digits":  # already 32x32: no resampling, no augmentation
            steps = []
        elif train:
            steps = [transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip()]
        else:
            steps = [transforms.Resize(size * 8 // 7), transforms.CenterCrop(size)]
        return transforms.Compose([*steps, transforms.ToTensor(), normalize])

    def random_samples(self, count: int, generator: torch.Generator) -> torch.utils.data.TensorDataset:
        size = self.spec.image_size
        images = torch.randn(count, 3, size, size, generator=generator)
        return torch.utils.data.TensorDataset(images, torch.randint(self.num_classes, (count,), generator=generator))

    def real_datasets(self) -> tuple[datasets.ImageFolder, datasets.ImageFolder]:
        train = datasets.ImageFolder(str(self.data_dir / "train"), self._transforms(True))
        val = datasets.ImageFolder(str(self.data_dir / "val"), self._transforms(False))
        return limit(train, self.data.max_train_samples), limit(val, self.data.max_val_samples)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output.float(), target)

    def _metric(self, loss: float, accuracy: float) -> dict[str, float]:
        return {"val/accuracy": accuracy}

    def flops_per_sample(self) -> float:
        with torch.device("meta"):
            model = self.build_model()
        return 3.0 * conv_flops(model, self.spec.image_size)
