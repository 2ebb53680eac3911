"""The workloads' shapes without torch: each layer's parameter tensors (element counts, in the order
`nn.Module.parameters()` yields them) and what each layer saves for backward, from the model section
of a recipe. `repro.model.costs` works from these, so `repro predict` and the pre-launch check need no
torch; `tests/test_costmodel.py` checks them against the built modules (repro.workloads), element for
element. (They live outside repro/workloads/ because what they describe is shared by every workload:
the cost model's terms; the workloads' own constants come from their torch-free plans.)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from repro.workloads.gpt2_plan import TOKENIZER_VOCAB
from repro.workloads.vgg16_plan import NUM_CLASSES

# VGG-16, configuration D (Simonyan & Zisserman 2015, Table 1): output channels of each 3x3 convolution,
# "M" a 2x2 max-pool (torchvision.models.vgg.cfgs["D"])
VGG16_D = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")
INT64 = 8
FP32 = 4
Rows = tuple[int, int]  # a parameter tensor as (dim-0 size, elements per dim-0 row)


def numels(layer: list[Rows]) -> list[int]:
    return [rows * row for rows, row in layer]


@dataclass(frozen=True)
class GPT2Shape:
    n_layer: int
    d_model: int
    n_head: int
    seq_len: int
    vocab: int
    dropout: float = 0.0
    # Whether attention with dropout runs SDPA's math path: PyTorch takes it on CPU, where its fused kernel
    # takes no dropout (torch._fused_sdp_choice on CPU: flash at dropout 0, math at dropout > 0); costs.cell_of sets it
    math_attention: bool = False

    @classmethod
    def from_model(cls, model: Any) -> "GPT2Shape":
        """From a recipe's model section: its spec object or the raw mapping of a recipe file."""
        get = model.get if isinstance(model, dict) else lambda key, default=None: getattr(model, key, default)
        return cls(get("n_layer", 24), get("d_model", 1024), get("n_head", 16), get("seq_len", 1024),
                   TOKENIZER_VOCAB[get("tokenizer", "gpt2")], get("dropout", 0.1))

    def shaped_runs(self) -> list[tuple[list[Rows], int]]:
        """(a layer's parameter tensors as (dim-0 size, elements per dim-0 row), how many such layers
        follow): the embedding, the blocks (nn.Linear's weight is (out, in)), the head (its weight is
        the embedding's and belongs to the embedding)."""
        d, vector = self.d_model, lambda n: (n, 1)
        block = [vector(d), vector(d), (3 * d, d), vector(3 * d), (d, d), vector(d), vector(d), vector(d),
                 (4 * d, d), vector(4 * d), (d, 4 * d), vector(d)]
        return [([(self.vocab, d), (self.seq_len, d)], 1), (block, self.n_layer), ([vector(d), vector(d)], 1)]

    def runs(self) -> list[tuple[list[int], int]]:
        """(a layer's parameter tensors' element counts, how many such layers follow)."""
        return [(numels(layer), repeat) for layer, repeat in self.shaped_runs()]

    def layer_tensors(self) -> list[list[int]]:
        """Element counts of each layer's own parameters, layer by layer."""
        return [layer for layer, repeat in self.runs() for _ in range(repeat)]

    def tied_elements(self) -> int:
        """The head's weight, shared with the token embedding (a copy where a pipeline unties it)."""
        return self.vocab * self.d_model

    def linear_elements(self) -> int:
        """Parameter elements of the nn.Linear modules (the blocks' four, weights and biases; the head is a
        functional linear on the embedding's weight)."""
        d = self.d_model
        return self.n_layer * (12 * d * d + 9 * d)

    def activation_bytes(self, batch: int, element: int = 4, mask: int = 1, autocast: bool = False) -> int:
        """The whole model's `layer_activations`, summed in closed form."""
        embedding, block, head = self.layer_activations(batch, element, mask, layers=1, autocast=autocast)
        return embedding + self.n_layer * block + head

    def layer_activations(self, batch: int, element: int = 4, mask: int = 1, layers: int | None = None,
                          autocast: bool = False) -> list[int]:
        """Bytes each layer saves for backward at `batch` sequences (docs/memory.md, "One GPT-2 block,
        by hand"): a block with its input 16 N d + 4 N elements and attention's h N fp32 log-sum-exp, N =
        batch x seq_len tokens; the embedding its token ids and positions (int64); the head its layer
        norm's input and statistics, the projection's input and the loss's log-softmax (fp32: the loss
        upcasts), targets and total weight. Under `autocast` (16-bit `element` over fp32 weights:
        docs/memory.md, "16-bit activations") the residual stream stays fp32 (the embedding's fp32 sum
        plus 16-bit branches promotes), so the layer norms save fp32 inputs and statistics, and every
        linear layer saves the 16-bit copy of its weight that autocast casts (12 d^2 a block, the tied
        head's V d). With dropout, each nn.Dropout saves a mask of `mask` bytes per element of its input
        (the embedding's, and two per block: after attention and after the MLP). Attention's own dropout
        is inside SDPA: its fused kernels keep the logsumexp (h N fp32) whether or not they drop
        (unchecked on GPUs); its math path (`math_attention`) keeps instead the softmax's output, the
        dropout's noise (`mask` bytes an element) and the dropped probabilities, batch x h x seq_len^2
        elements each (aten's _scaled_dot_product_attention_math: softmax, dropout as a product with the
        noise, a matmul with v; in 16 bits unchecked)."""
        n, d = batch * self.seq_len, self.d_model
        masked = mask * n * d if self.dropout else 0
        attention = FP32 * self.n_head * n
        if self.dropout and self.math_attention:
            attention = (2 * element + mask) * batch * self.n_head * self.seq_len**2
        norm = (FP32 if autocast else element) * (n * d + 2 * n)  # a layer norm's input, mean and rstd
        copies = element if autocast else 0  # bytes per weight element of autocast's saved casts
        block = 2 * norm + element * 14 * n * d + attention + copies * 12 * d * d + 2 * masked
        head = norm + element * n * d + copies * self.vocab * d + self.loss_bytes(batch)
        embedding = INT64 * (n + self.seq_len) + masked
        return [embedding, *([block] * (self.n_layer if layers is None else layers)), head]

    def stage_activation_bytes(self, start: int, stop: int, batch: int, element: int = 4, mask: int = 1,
                               keep_input: bool = False, autocast: bool = False) -> int:
        """Bytes layers start..stop-1 save for backward at `batch` sequences (`layer_activations`, in closed
        form): every layer saves its own input, so a stage's received input is counted by its first layer
        (`keep_input` changes nothing)."""
        embedding, block, head = self.layer_activations(batch, element, mask, layers=1, autocast=autocast)
        blocks = max(0, min(stop, self.n_layer + 1) - max(start, 1))
        return (embedding if start == 0 else 0) + blocks * block + (head if stop == self.n_layer + 2 else 0)

    def weight_copy_bytes(self, start: int, stop: int, element: int) -> int:
        """Bytes of autocast's 16-bit weight copies that layers start..stop-1 save (`layer_activations`):
        12 d^2 a block, the tied head's V d."""
        blocks = max(0, min(stop, self.n_layer + 1) - max(start, 1))
        return element * (blocks * 12 * self.d_model**2 + (self.tied_elements() if stop == self.n_layer + 2 else 0))

    def loss_bytes(self, batch: int) -> int:
        """What the loss saves (in the head's `layer_activations`): the fp32 log-softmax, the int64
        targets and the total weight."""
        tokens = batch * self.seq_len
        return 4 * tokens * self.vocab + INT64 * tokens + 4

    def loss_backward_bytes(self, batch: int) -> int:
        """What the loss's backward holds beyond what it saved, at its largest moment: nll_loss's backward
        makes a dense gradient of the log-softmax output and log_softmax's backward one of its input, each
        tokens x vocabulary fp32, beside the saved log-softmax output (tools/autograd/derivatives.yaml:
        nll_loss_forward, _log_softmax)."""
        return 2 * FP32 * batch * self.seq_len * self.vocab

    def stage_starts(self) -> list[bool]:
        return [True] * (self.n_layer + 2)

    def blocks(self) -> list[tuple[int, int]]:
        """The layer ranges (start, stop) that full recompute checkpoints: each transformer block."""
        return [(index, index + 1) for index in range(1, self.n_layer + 1)]

    def shard_units(self) -> int:
        """Units FSDP2 gathers one after another (repro.workloads Workload.blocks): each transformer block,
        and the root with the embeddings, final norm and tied head."""
        return self.n_layer + 1

    def batch_views(self, batch: int, autocast: bool = False) -> tuple[int, int]:
        """Bytes of what the first layer saves of the input batch (token ids) and the last of the targets:
        a micro-batch cut from a batch is a view, and saving it keeps the whole batch's storage (integers:
        autocast casts neither)."""
        return INT64 * batch * self.seq_len, INT64 * batch * self.seq_len

    @staticmethod
    def block_output_width(element: int, autocast: bool) -> int:
        """Bytes per element of a block's output: under autocast the residual stream stays fp32."""
        return FP32 if autocast else element

    def output_elements(self, batch: int) -> list[int]:
        """Elements of each layer's output at `batch` sequences: a pipeline's activation across a cut
        after it (tokens x width; the head's logits, tokens x vocabulary)."""
        tokens = batch * self.seq_len
        return [tokens * self.d_model] * (self.n_layer + 1) + [tokens * self.vocab]


@dataclass(frozen=True)
class VGG16Shape:
    width_div: int
    classifier_width: int
    pool_size: int
    image_size: int
    classes: int
    dropout: float = 0.0

    @classmethod
    def from_model(cls, model: Any, dataset: str) -> "VGG16Shape":
        get = model.get if isinstance(model, dict) else lambda key, default=None: getattr(model, key, default)
        return cls(get("width_div", 1), get("classifier_width", 4096), get("pool_size", 7), get("image_size", 224),
                   NUM_CLASSES[dataset], get("dropout", 0.5))

    def widths(self) -> list[int | str]:
        return [c if c == "M" else c // self.width_div for c in VGG16_D]

    def shaped_runs(self) -> list[tuple[list[Rows], int]]:
        return [(layer, 1) for layer in self.shaped_layers()]

    def runs(self) -> list[tuple[list[int], int]]:
        return [(numels(layer), 1) for layer in self.shaped_layers()]

    def layer_tensors(self) -> list[list[int]]:
        return [numels(layer) for layer in self.shaped_layers()]

    def shaped_layers(self) -> list[list[Rows]]:
        return [tensors for _, tensors, _ in self.layers()]

    def layers(self) -> list[tuple[str, list[Rows], int]]:
        """Each layer of repro.workloads.vgg16.build_vgg16 in order: (kind, its tensors as (dim-0 size,
        elements per dim-0 row), elements of its output per image): convolutions (3x3, with bias), ReLU
        (in place), max-pool, adaptive average pool, flatten, then linear, ReLU, dropout, linear, ReLU,
        dropout, linear."""
        layers: list[tuple[str, list[Rows], int]] = []
        channels, side = 3, self.image_size
        for width in self.widths():
            if width == "M":
                side //= 2
                layers.append(("pool", [], channels * side * side))
            else:
                out = width * side * side
                layers += [("conv", [(width, channels * 9), (width, 1)], out), ("relu", [], out)]
                channels = width
        last, hidden = channels * self.pool_size**2, self.classifier_width
        layers += [("avgpool", [], last), ("flatten", [], last)]
        for width, inputs in ((hidden, last), (hidden, hidden)):
            layers += [("linear", [(width, inputs), (width, 1)], width), ("relu", [], width), ("dropout", [], width)]
        layers.append(("linear", [(self.classes, hidden), (self.classes, 1)], self.classes))
        return layers

    def stage_starts(self) -> list[bool]:
        """Where a pipeline stage may begin: not at an in-place ReLU (its input must stay a leaf)."""
        return [index == 0 or kind != "relu" for index, (kind, _, _) in enumerate(self.layers())]

    def blocks(self) -> list[tuple[int, int]]:
        """The layer ranges (start, stop) that full recompute checkpoints: each of the five convolution
        stages, its convolutions and ReLUs up to and with its max-pool (the classifier is not recomputed:
        its linear layers save little beside their weights)."""
        ends = [index + 1 for index, (kind, _, _) in enumerate(self.layers()) if kind == "pool"]
        return list(zip([0, *ends[:-1]], ends))

    def shard_units(self) -> int:
        """Units FSDP2 gathers one after another (repro.workloads.vgg16 `blocks`): each convolution stage,
        then each linear layer; the root keeps no parameter, so it gathers nothing."""
        return len(self.blocks()) + sum(1 for kind, _, _ in self.layers() if kind == "linear")

    @staticmethod
    def block_output_width(element: int, autocast: bool) -> int:
        """Bytes per element of a block's output (a max-pool's, in `element` under autocast too)."""
        return element

    def output_elements(self, batch: int) -> list[int]:
        """Elements of each layer's output at `batch` images (what a pipeline hands across a cut after it)."""
        return [batch * out for _, _, out in self.layers()]

    def tied_elements(self) -> int:
        return 0

    def linear_elements(self) -> int:
        """Parameter elements of the nn.Linear and nn.Conv2d modules: all of them."""
        return parameters(self)

    def stage_activation_bytes(self, start: int, stop: int, batch: int, element: int = 4, mask: int = 1,
                               keep_input: bool = False, autocast: bool = False) -> int:
        """Bytes layers start..stop-1 save for backward at `batch` images, as distinct storages (PyTorch's
        autograd formulas, tools/autograd/derivatives.yaml): a convolution, a max-pool, an average pool to
        more than 1x1 (to 1x1 torch takes a mean, which saves nothing) and a linear save their input; a
        ReLU (in place, as build_vgg16 makes them all) its output, which is its input's storage: the
        convolution's output, or a stage's received input where the stage starts at a ReLU (torchgpipe's
        balance may cut there); a max-pool its int64 indices; a dropout with p > 0 a mask of `mask` bytes per
        element and a new output, with p = 0 it returns its input, as flatten returns a view. A stage after the first receives its input as a new tensor (saved by its first layer if
        that layer saves its input, or always with `keep_input`: torchgpipe's checkpoint keeps it); the
        first stage's input is the image batch; the last stage also holds the loss (`loss_bytes`). Under
        `autocast` (16-bit `element` over fp32 weights) a convolution and a linear layer also save the
        16-bit copy of their weight that autocast casts, and the first convolution the 16-bit copy of the
        images (the `element` wide input already counted)."""
        layers, sizes, saved = self.layers(), {}, set()
        root = ("input", start)
        sizes[root] = element * batch * (layers[start - 1][2] if start else 3 * self.image_size**2)
        if keep_input:
            saved.add(root)
        for index in range(start, stop):
            kind, tensors, out = layers[index]
            if kind in ("conv", "pool", "linear") or (kind == "avgpool" and self.pool_size > 1):
                saved.add(root)
            if autocast and kind in ("conv", "linear"):
                sizes[("cast", index)] = element * tensors[0][0] * tensors[0][1]  # the weight; its bias is not saved
                saved.add(("cast", index))
            if kind == "pool":
                sizes[("indices", index)] = INT64 * batch * out
                saved.add(("indices", index))
            if kind == "dropout" and self.dropout:
                sizes[("mask", index)] = mask * batch * out
                saved.add(("mask", index))
            if kind == "relu":
                saved.add(root)  # in place: its output is its input's storage
                continue
            if kind == "flatten" or (kind == "dropout" and not self.dropout):
                continue  # the output is the input's storage
            root = ("output", index)
            sizes[root] = element * batch * out
        loss = self.loss_bytes(batch) if stop == len(layers) else 0
        return sum(sizes[key] for key in saved) + loss

    def weight_copy_bytes(self, start: int, stop: int, element: int) -> int:
        """Bytes of autocast's 16-bit weight copies that layers start..stop-1 save: every convolution's
        and linear layer's weight (`stage_activation_bytes`)."""
        return element * sum(rows * row for kind, tensors, _ in self.layers()[start:stop] if kind in ("conv", "linear")
                             for rows, row in tensors[:1])

    def loss_bytes(self, batch: int) -> int:
        """What the loss saves: the fp32 log-softmax, the int64 targets and the total weight."""
        return 4 * batch * self.classes + INT64 * batch + 4

    def loss_backward_bytes(self, batch: int) -> int:
        """What the loss's backward holds beyond what it saved (GPT2Shape.loss_backward_bytes): two fp32
        gradients of images x classes."""
        return 2 * FP32 * batch * self.classes

    def batch_views(self, batch: int, autocast: bool = False) -> tuple[int, int]:
        """Bytes of what the first layer saves of the input batch (the fp32 images) and the loss of the
        targets (int64): micro-batches cut from a batch are views of its storage. Under `autocast` the
        first convolution saves a 16-bit copy of its micro-batch instead, no view (0 bytes)."""
        return (0 if autocast else FP32 * batch * 3 * self.image_size**2), INT64 * batch

    def activation_bytes(self, batch: int, element: int = 4, mask: int = 1, autocast: bool = False) -> int:
        """Bytes saved for backward at `batch` images, at the end of the forward: every layer's
        (`stage_activation_bytes`), the image batch itself the first convolution's input."""
        return self.stage_activation_bytes(0, len(self.layers()), batch, element, mask, autocast=autocast)


def shape_of(workload: str, model: Any, dataset: str) -> GPT2Shape | VGG16Shape:
    """The shape description of `workload` from its recipe's model section."""
    if workload == "gpt2":
        return GPT2Shape.from_model(model)
    return VGG16Shape.from_model(model, dataset)


def parameters(shape: GPT2Shape | VGG16Shape) -> int:
    """Psi: the model's distinct parameter elements (closed form: a recipe may ask for 10^8 layers)."""
    return sum(sum(layer) * repeat for layer, repeat in shape.runs())


def tensor_count(shape: GPT2Shape | VGG16Shape) -> int:
    return sum(len(layer) * repeat for layer, repeat in shape.runs())


def tensors(shape: GPT2Shape | VGG16Shape) -> list[int]:
    """Every distinct parameter tensor's element count, in `model.parameters()` order."""
    return [numel for layer in shape.layer_tensors() for numel in layer]


def tensor_at(shape: GPT2Shape | VGG16Shape, offset: int) -> tuple[int, int]:
    """(first element, elements) of the parameter tensor holding element `offset` of the model's
    parameters laid end to end in `model.parameters()` order; (offset, 0) past the end."""
    start = 0
    for layer, repeat in shape.runs():
        size = sum(layer)
        if offset < start + size * repeat:
            start += (offset - start) // size * size if size else 0
            for numel in layer:
                if offset < start + numel:
                    return start, numel
                start += numel
        start += size * repeat
    return offset, 0


def flat_sharded(shape: GPT2Shape | VGG16Shape, ranks: int) -> int:
    """Elements of one rank's partition of every parameter tensor flattened and padded to a multiple of
    `ranks` (ceil(numel / ranks) each: DeepSpeed ZeRO-3's `ds_tensor`), summed over the model."""
    return sum(-(-numel // ranks) * repeat for layer, repeat in shape.runs() for numel in layer)


def dim0_sharded(shape: GPT2Shape | VGG16Shape, ranks: int) -> int:
    """Elements of the largest shard of every parameter tensor split along dim 0 into `ranks` chunks
    (torch.chunk: ceil(dim 0 / ranks) rows to the first rank), summed over the model."""
    return sum(-(-rows // ranks) * row * repeat for layer, repeat in shape.shaped_runs() for rows, row in layer)
