"""The cost model's terms (repro.model.costs): what it knows of a run (Cell), what it predicts (Prediction),
byte sizes, and the terms every framework's model shares: optimizer state, a whole model's activations,
layers split into stages. No torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from repro.shapes import GPT2Shape, VGG16Shape

FP32 = 4
ACTIVATION_ELEMENT = {"fp32": 4, "bf16": 2, "fp16": 2}
# optimizer state per parameter element, and per parameter tensor (torch.optim.Adam(W)'s `step` is a
# 4-byte tensor per parameter; timm's Lamb keeps its step in the param group)
OPTIMIZER_STATE = {"adam": (2 * FP32, FP32), "adamw": (2 * FP32, FP32), "lamb": (2 * FP32, 0), "sgd": (FP32, 0)}

@dataclass(frozen=True)
class Cell:
    """What the model needs of a run: the workload's shape and the framework's settings."""

    shape: GPT2Shape | VGG16Shape
    framework: str
    gpus: int
    batch_per_gpu: int
    optimizer: str = "adam"
    precision: str = "fp32"
    options: dict[str, Any] = field(default_factory=dict)  # the framework's recipe section, as a mapping
    device: str = "cuda"  # "cpu": dropout keeps a mask of the activations' own dtype (CUDA's fused kernel: 1 byte)
    micro_batch: int | None = None  # samples per micro-batch where gradients accumulate over several (None: one pass)
    recomputed: int = 0  # the workload's blocks (shape.blocks()) under full recompute, from the first
    selective: bool = False  # selective recompute (megatron-core's: attention's core in every layer)

    def option(self, name: str, default: Any) -> Any:
        return self.options.get(name, default)

    @staticmethod
    def recomputed_blocks(shape: GPT2Shape | VGG16Shape, recompute: str | None, layers: int | None) -> int:
        """`recomputed` of a recipe's train.recompute and train.recompute_layers: under full recompute its
        first `layers` blocks (all when unset), else none."""
        return (layers or len(shape.blocks())) if recompute == "full" else 0

    @property
    def accumulation_steps(self) -> int:
        """Forward-backward passes a step on each process: batch_per_gpu / micro_batch (1 without micro-batches)."""
        return self.batch_per_gpu // (self.micro_batch or self.batch_per_gpu)


@dataclass(frozen=True)
class Prediction:
    """Per GPU, the busiest one: model state and activation peak in bytes, payload per step by kind."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int | None  # None: not modelled for this framework and workload
    comm: dict[str, int]

    @property
    def model_state(self) -> int:
        return self.parameters + self.gradients + self.optimizer

    @property
    def comm_bytes(self) -> int:
        return sum(self.comm.values())

    @property
    def estimated_peak(self) -> int | None:
        """Model state + activations: what the CPU stand-ins measure as `memory/estimated_peak_bytes`."""
        return None if self.activations is None else self.model_state + self.activations

    @property
    def fit_bytes(self) -> int:
        """What a device must hold: the estimated peak, or the model state where activations are not modelled."""
        return self.model_state if self.estimated_peak is None else self.estimated_peak


def optimizer_bytes(cell: Cell, elements: int, tensor_count: int) -> int:
    per_element, per_tensor = OPTIMIZER_STATE[cell.optimizer]
    if cell.optimizer == "sgd" and not cell.option("momentum", 0.9):
        per_element = 0
    return per_element * elements + per_tensor * tensor_count


def activations(cell: Cell, batch: int) -> int | None:
    """Activation peak of the whole model on one GPU, `batch` samples a step (docs/memory.md): without
    recompute the sum of what each layer saves for backward (reached at the end of the forward), with
    full recompute `recomputed_peak`; with micro-batches, one micro-batch's, but the first layer's input
    and the loss's targets are views of the whole batch, whose storage they keep (`batch_views`)."""
    element = ACTIVATION_ELEMENT[cell.precision]
    mask, micro = element if cell.device == "cpu" else 1, cell.micro_batch or batch
    inputs, targets = (whole - part for whole, part in zip(cell.shape.batch_views(batch), cell.shape.batch_views(micro)))
    if not cell.recomputed:
        return cell.shape.activation_bytes(micro, element, mask) + inputs + targets
    return recomputed_peak(cell.shape, cell.shape.blocks()[: cell.recomputed], micro, element, mask, (inputs, targets))


def recomputed_peak(shape: GPT2Shape | VGG16Shape, blocks: list[tuple[int, int]], batch: int, element: int, mask: int,
                    views: tuple[int, int]) -> int:
    """Activation peak with `blocks` (layer ranges) under full recompute (torch.utils.checkpoint, docs/memory.md
    "Recompute"): the forward keeps each block's input (the checkpoint) and what the other layers save, the
    loss included; backward frees the layers after a block before it recomputes the block, whose whole set
    (its input included) is then held beside everything saved before it. The peak is the larger of the end
    of the forward and the largest of those moments. `views`: what the batch's input and targets keep
    beyond the micro-batch's (the input's at every moment, the targets' with the loss only)."""
    outputs = shape.output_elements(batch)
    edges = [0, *(edge for block in blocks for edge in block), len(outputs)]
    before, recomputing = 0, 0  # held by the ranges so far (at the forward's end); the largest recomputation moment
    for index, (start, stop) in enumerate(zip(edges, edges[1:])):
        if index % 2 == 0:  # the layers between blocks, as one range (a layer may save its predecessor's output)
            before += shape.stage_activation_bytes(start, stop, batch, element, mask) if stop > start else 0
            continue
        recomputing = max(recomputing, before + shape.stage_activation_bytes(start, stop, batch, element, mask))
        before += element * outputs[start - 1] if start else shape.batch_views(batch)[0]  # the block's checkpoint
    return max(before + views[1], recomputing) + views[0]


def even_balance(layers: int, parts: int) -> list[int]:
    return [layers // parts + (1 if index < layers % parts else 0) for index in range(parts)]


def split(items: list, balance: list[int]) -> list[list]:
    out, start = [], 0
    for size in balance:
        out.append(items[start : start + size])
        start += size
    return out
