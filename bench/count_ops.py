"""The aten operations one training step of each smoke workload dispatches, by phase: what the
step-time model's op counts (repro.model.time: GPT2_OPS, VGG16_OPS, OPTIMIZER_OPS) state. One process,
plain PyTorch (the kit's modules and optimizers), counted with TorchDispatchMode; tests/test_time.py
reruns it.

    python bench/count_ops.py
"""
from __future__ import annotations

import json
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from repro import registry
from repro.optim import make_optimizer
from repro.recipe import load_file, recipe_path


class Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def step_ops(workload: str, sets: list[str] = ()) -> dict[str, int]:
    """Operations of the forward with its loss, the backward and the optimizer step of one training step
    (the second: the first creates the optimizer's state), and the model's parameter tensors."""
    from repro.calibrate import sample_batch

    recipe = load_file(recipe_path(workload, "smoke"), list(sets))
    model = registry.workload_class(workload)(recipe.model, recipe.data, ".").build_model()
    optimizer = make_optimizer(recipe.train.optimizer, model.parameters())
    inputs, targets = sample_batch(workload, recipe)
    counts = {}
    for _ in range(2):
        phases = [Count() for _ in range(3)]
        with phases[0]:
            output = model(inputs)
            loss = torch.nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), targets.reshape(-1))
        with phases[1]:
            loss.backward()
        with phases[2]:
            optimizer.step()
            optimizer.zero_grad()
        counts = {"forward": phases[0].ops, "backward": phases[1].ops, "optimizer": phases[2].ops}
    return {**counts, "tensors": len(list(model.parameters()))}


if __name__ == "__main__":
    table = {f"gpt2 n_layer={n}": step_ops("gpt2", [f"model.n_layer={n}"]) for n in (2, 4)}
    table["vgg16"] = step_ops("vgg16")
    print(json.dumps(table, indent=2))
