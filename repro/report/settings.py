"""The effective settings a run trains with, and the ones in which two compared runs differ.

A comparison of two frameworks means something only where they train alike; where they do not
(the smoke recipes give DDP LAMB at lr 0.01 and ZeRO Adam at lr 0.001), every place of the report
that compares them says how they differ. The settings are read from MLflow's `effective.*` params
(what the framework really trains with, the same names for every framework); a run recorded
before those params existed falls back to its recipe (through the same `FrameworkPlan.effective`).
"""
from __future__ import annotations

from collections import Counter
from typing import Any

from repro.recipe import Recipe

KEYS = ("optimizer", "lr", "weight_decay", "global_batch", "micro_batches", "precision")
TRAINING = ("optimizer", "lr", "weight_decay", "precision")  # a row keeps them at every GPU count; curves compare on them
EFFECTIVE_PREFIX = "effective."
# Each piece's implementation where the ranks chose it by device (Adapter.pieces; Megatron's GPU and CPU paths)
IMPLEMENTATION = ("model_impl", "layer_spec", "dp_impl", "optimizer_impl")


def from_params(params: dict[str, str], recipe: Recipe | None) -> dict[str, str]:
    """The run's settings: MLflow's `effective.*` params, the recipe's where a run lacks them."""
    recorded = KEYS + IMPLEMENTATION
    settings = {key: params[EFFECTIVE_PREFIX + key] for key in recorded if EFFECTIVE_PREFIX + key in params}
    if recipe is not None:
        settings = {**from_recipe(recipe), **settings}
    if "train.precision" in params and EFFECTIVE_PREFIX + "precision" not in params:  # runs from before issue 39
        settings["precision"] = params["train.precision"]
    return settings


def from_recipe(recipe: Recipe) -> dict[str, str]:
    """The settings a recipe trains with, as its framework's plan derives them (`FrameworkPlan.effective`)."""
    from repro import registry

    plan = registry.load(registry.framework(recipe.run.framework).plan)
    values: dict[str, Any] = {**plan.effective(recipe), "precision": recipe.train.precision}
    return {key: str(value) for key, value in values.items()}


def implementation(settings: dict[str, str]) -> str:
    """'megatron-core GPTModel, local, ...': the implementation of each piece the run recorded (empty if none)."""
    return ", ".join(settings[key] for key in IMPLEMENTATION if key in settings)


def differences(a: dict[str, str], b: dict[str, str], keys: tuple[str, ...] = KEYS) -> list[str]:
    """'optimizer lamb vs adam'-style phrases for every setting in which two runs differ."""
    return [f"{key} {a[key]} vs {b[key]}" for key in keys if key in a and key in b and a[key] != b[key]]


def common(all_settings: list[dict[str, str]]) -> dict[str, str]:
    """The most frequent value of each setting (what 'most runs' train with)."""
    out = {}
    for key in KEYS:
        values = [s[key] for s in all_settings if key in s]
        if values:
            out[key] = Counter(values).most_common(1)[0][0]
    return out


def departures(settings: dict[str, str], reference: dict[str, str], keys: tuple[str, ...] = KEYS) -> str:
    """'optimizer adam, lr 0.001': where a run departs from the reference (empty when it does not)."""
    return ", ".join(f"{key} {settings[key]}" for key in keys
                     if key in settings and key in reference and settings[key] != reference[key])
