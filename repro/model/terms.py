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
    transient: int | None = None  # held beyond model state and activations at the step's largest moment (`loss_transient`); None: not modelled

    @property
    def model_state(self) -> int:
        return self.parameters + self.gradients + self.optimizer

    @property
    def comm_bytes(self) -> int:
        return sum(self.comm.values())

    @property
    def estimated_peak(self) -> int | None:
        """Model state + activations + the transient: what a GPU's allocator holds at the step's largest
        moment (the CPU stand-ins' `memory/estimated_peak_bytes` counts the first two: the counters see
        no transient)."""
        return None if self.activations is None else self.model_state + self.activations + (self.transient or 0)

    @property
    def fit_bytes(self) -> int:
        """What a device must hold: the estimated peak, or the model state where activations are not modelled."""
        return self.model_state if self.estimated_peak is None else self.estimated_peak


def optimizer_bytes(cell: Cell, elements: int, tensor_count: int) -> int:
    per_element, per_tensor = OPTIMIZER_STATE[cell.optimizer]
    if cell.optimizer == "sgd" and not cell.option("momentum", 0.9):
        per_element = 0
    return per_element * elements + per_tensor * tensor_count


AUTOCAST_FRAMEWORKS = ("ddp", "zero", "torch-pipeline")  # their adapters' 16-bit runs under torch.autocast


def autocasts(cell: Cell) -> bool:
    """Whether a 16-bit cell computes under torch.autocast over fp32 weights (repro/adapters/base.py
    `autocast`; ZeRO's bf16 through DeepSpeed's torch_autocast): DDP, torch-pipeline and ZeRO but its fp16,
    DeepSpeed's own fp16 mode (an fp16 module: repro/adapters/zero.py). FSDP's MixedPrecisionPolicy casts
    the parameters themselves (repro/adapters/fsdp.py), Megatron has its own (`megatron_activations`), and
    torchgpipe and PipeDream run fp32 only."""
    return (cell.precision != "fp32" and cell.framework in AUTOCAST_FRAMEWORKS
            and (cell.framework, cell.precision) != ("zero", "fp16"))


def loss_transient(cell: Cell) -> int:
    """Bytes the loss's backward holds for a moment beyond the model state and the activation peak
    (shapes' `loss_backward_bytes`, per micro-batch): it runs first in backward, while everything the
    forward saved is held, so it adds in full to the forward's end; with full recompute, where a block's
    recomputation is the activation peak, only what the forward's end plus it exceeds that by. What a GPU's
    allocator sees at its peak (docs/memory.md, "16-bit activations"), not what the CPU counters count."""
    return activations(cell, cell.batch_per_gpu, loss_backward=True) - activations(cell, cell.batch_per_gpu)


def activations(cell: Cell, batch: int, loss_backward: bool = False) -> int | None:
    """Activation peak of the whole model on one GPU, `batch` samples a step (docs/memory.md): without
    recompute the sum of what each layer saves for backward (reached at the end of the forward), with
    full recompute `recomputed_peak`; with micro-batches, one micro-batch's, but the first layer's input
    and the loss's targets are views of the whole batch, whose storage they keep (`batch_views`; under
    autocast the images are cast to a copy of the micro-batch, unless a checkpoint saves them first);
    `loss_backward`: with the loss's backward at its largest moment (`loss_transient`)."""
    element, autocast = ACTIVATION_ELEMENT[cell.precision], autocasts(cell)
    mask, micro = element if cell.device == "cpu" else 1, cell.micro_batch or batch
    cast_inputs = autocast and not cell.recomputed  # the first block's checkpoint saves the raw input
    inputs, targets = (whole - part for whole, part in zip(cell.shape.batch_views(batch, cast_inputs),
                                                           cell.shape.batch_views(micro, cast_inputs)))
    targets += cell.shape.loss_backward_bytes(micro) if loss_backward else 0  # with the loss, as its targets
    if not cell.recomputed:
        return cell.shape.activation_bytes(micro, element, mask, autocast) + inputs + targets
    return recomputed_peak(cell.shape, cell.shape.blocks()[: cell.recomputed], micro, element, mask, (inputs, targets),
                           autocast)


def recomputed_peak(shape: GPT2Shape | VGG16Shape, blocks: list[tuple[int, int]], batch: int, element: int, mask: int,
                    views: tuple[int, int], autocast: bool = False) -> int:
    """Activation peak with `blocks` (layer ranges) under full recompute (torch.utils.checkpoint, docs/memory.md
    "Recompute"): the forward keeps each block's input (the checkpoint) and what the other layers save, the
    loss included; backward frees the layers after a block before it recomputes the block, whose whole set
    (its input included) is then held beside everything saved before it. The peak is the larger of the end
    of the forward and the largest of those moments. `views`: what the batch's input and targets keep
    beyond the micro-batch's (the input's at every moment, the targets' with the loss only). Under
    `autocast` a recomputation casts the block's weights again (in its set) and a checkpoint is the
    block's input as it arrives (GPT-2's fp32 residual stream; the raw images)."""
    outputs = shape.output_elements(batch)
    width = shape.block_output_width(element, autocast)
    edges = [0, *(edge for block in blocks for edge in block), len(outputs)]
    before, recomputing = 0, 0  # held by the ranges so far (at the forward's end); the largest recomputation moment
    for index, (start, stop) in enumerate(zip(edges, edges[1:])):
        if index % 2 == 0:  # the layers between blocks, as one range (a layer may save its predecessor's output)
            before += shape.stage_activation_bytes(start, stop, batch, element, mask, autocast=autocast) if stop > start else 0
            continue
        recomputing = max(recomputing, before + shape.stage_activation_bytes(start, stop, batch, element, mask,
                                                                              autocast=autocast))
        before += width * outputs[start - 1] if start else shape.batch_views(batch)[0]  # the block's checkpoint
    return max(before + views[1], recomputing) + views[0]


def even_balance(layers: int, parts: int) -> list[int]:
    return [layers // parts + (1 if index < layers % parts else 0) for index in range(parts)]


def split(items: list, balance: list[int]) -> list[list]:
    out, start = [], 0
    for size in balance:
        out.append(items[start : start + size])
        start += size
    return out
