"""Helpers shared by the pipeline adapters (torchgpipe, pipedream): partitions and tied weights.

A workload's model is an `nn.Sequential`; a pipeline cuts it into contiguous partitions given by a
balance (layers per partition). GPT-2 ties its output head to the token embedding, which sit at
the two ends of the layer list, so in a pipeline they land in different partitions (on different
devices). The standard fix (Megatron's, for the same reason) is used: the later layer gets its own
copy of the tied parameter, initialised equal, and the two copies' gradients are summed before
every optimizer step, which keeps them equal and equals the tied model's update.
"""
from __future__ import annotations

import time
from typing import Sequence

import torch
from torch import nn

from repro.adapters.base import Reduction

TIMING_REPEATS = 3


def last_stage_losses(losses: list[torch.Tensor | None]) -> Reduction | None:
    """A pipeline's reduce_losses: the last stage's loss is already the whole batch's, so nothing is
    communicated; ranks without the last stage have None."""
    return None if losses[0] is None else Reduction(torch.stack(losses).float())


def untie(model: nn.Sequential, group_of_layer: Sequence[int]) -> list[tuple[nn.Parameter, nn.Parameter]]:
    """Give every layer a private copy of a parameter it shares with a layer of another group.

    Returns (original, copy) pairs; copies start equal to their originals.
    """
    owners: dict[int, tuple[int, nn.Parameter]] = {}
    pairs = []
    for index, layer in enumerate(model):
        for name, param in list(layer.named_parameters(remove_duplicate=False)):
            owner = owners.setdefault(id(param), (group_of_layer[index], param))
            if owner[0] == group_of_layer[index]:
                continue
            copy = nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad)
            module_path, _, leaf = name.rpartition(".")
            setattr(layer.get_submodule(module_path), leaf, copy)
            pairs.append((param, copy))
    return pairs


def disable_inplace(model: nn.Module) -> int:
    """Turn in-place activations (VGG's ReLU(inplace=True)) out of place; returns how many.

    Same arithmetic, one more activation buffer each: a layer that starts a partition receives a
    leaf tensor requiring grad (from the previous device, or from a layer profiler), which an
    in-place operation may not modify.
    """
    changed = 0
    for module in model.modules():
        if getattr(module, "inplace", False) is True:
            module.inplace = False
            changed += 1
    return changed


def tied_names(model: nn.Sequential, pairs: list[tuple[nn.Parameter, nn.Parameter]]) -> list[str]:
    """'copy <- original' parameter names of untied pairs, for the run record."""
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    return [f"{names[id(copy)]} <- {names[id(original)]}" for original, copy in pairs]


def sum_tied_gradients(pairs: list[tuple[nn.Parameter, nn.Parameter]]) -> None:
    """Give both copies of each untied parameter the sum of their gradients (the tied gradient)."""
    for original, copy in pairs:
        total = original.grad + copy.grad.to(original.device)
        original.grad.copy_(total)
        copy.grad.copy_(total)


def group_of_layers(balance: Sequence[int]) -> list[int]:
    """[partition index of each layer] for a balance."""
    return [part for part, count in enumerate(balance) for _ in range(count)]


def check_balance(balance: Sequence[int], layers: int, parts: int) -> None:
    if len(balance) != parts or sum(balance) != layers or min(balance) < 1:
        raise ValueError(
            f"balance {list(balance)} must give each of {parts} partitions at least one of the model's "
            f"{layers} layers (sum {sum(balance)}, {len(balance)} entries)"
        )


def layer_times(model: nn.Sequential, sample: torch.Tensor) -> list[float]:
    """Seconds of forward and backward of each layer on `sample` (best of a few repeats)."""
    best = [float("inf")] * len(model)
    for _ in range(TIMING_REPEATS):
        x = sample
        for index, layer in enumerate(model):
            x = x.detach().requires_grad_(x.is_floating_point())
            start = time.perf_counter()
            y = layer(x)
            y.backward(torch.ones_like(y))
            if y.is_cuda:
                torch.cuda.synchronize(y.device)
            best[index] = min(best[index], time.perf_counter() - start)
            x = y
    model.zero_grad(set_to_none=True)
    return best


def balance_costs(costs: Sequence[float], parts: int) -> list[int]:
    """Contiguous partition of layers into `parts` minimising the largest partition's total cost."""
    n = len(costs)
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    # best[p][i]: (largest partition cost, sizes) splitting the first i layers into p partitions
    best: list[dict[int, tuple[float, list[int]]]] = [{0: (0.0, [])}]
    for p in range(1, parts + 1):
        row = {}
        for i in range(p, n - (parts - p) + 1):
            row[i] = min(
                (max(best[p - 1][j][0], prefix[i] - prefix[j]), best[p - 1][j][1] + [i - j])
                for j in range(p - 1, i) if j in best[p - 1]
            )
        best.append(row)
    return best[parts][n][1]


def sample_inputs(workload: object, size: int) -> torch.Tensor:
    """The first `size` training inputs, a realistic sample for timing layers."""
    train, _ = workload.datasets()
    return torch.stack([train[i][0] for i in range(min(size, len(train)))])
