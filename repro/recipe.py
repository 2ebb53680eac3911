"""Recipes: the typed, validated, fingerprinted description of one run.

A recipe file (configs/{model}-{scale}.yaml) holds the workload's fixed hyper-parameters; the
command line adds the run's shape (framework, GPU count, nodes) and any `--set key=value`.
Each component receives only its own section: the workload gets `model`, an adapter gets its
framework section, the loop gets `train`.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from repro import registry
from repro.schema import RecipeError, as_dict, build

SCALES = ("smoke", "paper")


@dataclass
class OptimizerSpec:
    name: Literal["sgd", "adam", "adamw", "lamb"]
    lr: float
    weight_decay: float = 0.0
    momentum: float = 0.9
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8


@dataclass
class DataSpec:
    dataset: str
    max_train_samples: int | None = None
    max_val_samples: int | None = None
    workers: int = 0


@dataclass
class TrainSpec:
    epochs: int
    batch_per_gpu: int
    optimizer: OptimizerSpec
    max_steps: int | None = None
    precision: Literal["fp32", "fp16", "bf16"] = "fp32"
    grad_clip: float | None = None
    log_every: int = 1
    target_metric: float | None = None  # time-to-target threshold (accuracy: higher is better, perplexity: lower)


@dataclass
class RunSpec:
    framework: str = "ddp"
    gpus: int = 1
    nodes: int = 1
    device: Literal["auto", "cpu", "cuda"] = "auto"
    allow_unverified: bool = False
    timeout_s: int = 600


@dataclass
class Recipe:
    workload: Literal["vgg16", "gpt2"]
    scale: Literal["smoke", "paper"]
    seed: int
    data: DataSpec
    model: Any
    train: TrainSpec
    run: RunSpec = field(default_factory=RunSpec)
    frameworks: dict[str, Any] = field(default_factory=dict)  # written as top-level sections in files
    description: str = ""
    source: str = ""

    def options(self, framework: str | None = None) -> Any:
        """The (validated) section of `framework`, defaulting to the run's framework."""
        return self.frameworks[framework or self.run.framework]

    def optimizer(self) -> OptimizerSpec:
        """The run's optimizer: the framework section's override, else the workload's."""
        return getattr(self.options(), "optimizer", None) or self.train.optimizer

    def to_dict(self) -> dict[str, Any]:
        """Plain data, framework sections at the top level as in recipe files."""
        data = as_dict(self)
        sections = data.pop("frameworks")
        return {**data, **{section_key(name): value for name, value in sections.items()}}

    def fingerprint(self) -> str:
        """SHA-256 of the canonical resolved recipe: what this run depends on. Its source path and the
        sections of other frameworks are left out, so adding a framework to a recipe file does not
        make every finished run of the others look new to the Table 2 matrix or to --resume."""
        data = json.dumps(self.own_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(data.encode()).hexdigest()

    def own_dict(self) -> dict[str, Any]:
        """to_dict() without the source path and the sections of frameworks other than the run's."""
        others = {section_key(name) for name in self.frameworks if name != self.run.framework}
        return {k: v for k, v in self.to_dict().items() if k != "source" and k not in others}

    def run_name(self) -> str:
        return f"{self.workload}-{self.run.framework}-{self.run.gpus}g-{self.scale}-s{self.seed}"

    def flat(self) -> dict[str, str]:
        """Dotted key -> value strings (MLflow params)."""
        out: dict[str, str] = {}

        def walk(prefix: str, value: Any) -> None:
            if isinstance(value, dict):
                for key, sub in value.items():
                    walk(f"{prefix}.{key}" if prefix else key, sub)
            else:
                out[prefix] = json.dumps(value) if isinstance(value, list) else str(value)

        walk("", self.own_dict())
        return out


@dataclass
class FrameworkOptions:
    """Base of every framework's recipe section; an adapter subclasses it for its own fields."""

    optimizer: OptimizerSpec | None = None


def configs_dir() -> Path:
    """Where recipes live: $REPRO_CONFIGS, else the checkout's configs/ folder."""
    env = os.environ.get("REPRO_CONFIGS")
    return Path(env) if env else Path(__file__).resolve().parent.parent / "configs"


def recipe_path(model: str, scale: str) -> Path:
    return configs_dir() / f"{model}-{scale}.yaml"


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (['a', 'b'], value parsed as a YAML scalar)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise RecipeError("--set", text, "expected key=value, for example --set train.epochs=2")
    return key.split("."), yaml.safe_load(value) if value else ""


def apply_override(raw: dict[str, Any], text: str) -> None:
    path, value = parse_override(text)
    node = raw
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise RecipeError("--set", text, f"{part} is not a section")
        node = child
    node[path[-1]] = value


def section_key(framework: str) -> str:
    """The recipe section of a framework: its name, with '-' written '_' (torch-pipeline -> torch_pipeline)."""
    return framework.replace("-", "_")


def _framework_sections(raw: dict[str, Any], source: str, used: str) -> dict[str, Any]:
    """Pop and validate every framework section of `raw` (and the run's framework, with defaults)."""
    out = {}
    for name, entry in registry.FRAMEWORKS.items():
        key = section_key(name)
        if key in raw or name == used:
            options_cls = registry.load(entry.adapter).Options
            out[name] = build(options_cls, raw.pop(key, None) or {}, source, key)
    return out


def resolve(raw: dict[str, Any], source: str, overrides: list[str] = ()) -> Recipe:
    """Validate a raw recipe dict plus overrides into a Recipe; errors name file and field."""
    raw = copy.deepcopy(raw)
    for text in overrides:
        apply_override(raw, text)
    if overrides:
        source = f"{source} (with --set {' --set '.join(overrides)})"
    used = (raw.get("run") or {}).get("framework", RunSpec.framework)
    if used not in registry.FRAMEWORKS:
        raise RecipeError(source, "run.framework", f"unknown framework {used!r}; valid: {', '.join(registry.FRAMEWORKS)}")
    frameworks = _framework_sections(raw, source, used)
    model_raw = raw.pop("model", None)
    recipe = build(Recipe, {**raw, "model": {}}, source)
    workload = registry.workload_class(recipe.workload)
    recipe.model = build(workload.ModelSpec, model_raw or {}, source, "model")
    recipe.frameworks = frameworks
    recipe.source = source
    check(recipe, source)
    return recipe


def check(recipe: Recipe, source: str) -> None:
    """Cross-field rules; each error prints the arithmetic."""
    run = recipe.run
    if run.gpus < 1 or run.nodes < 1:
        raise RecipeError(source, "run.gpus", f"gpus ({run.gpus}) and nodes ({run.nodes}) must be at least 1")
    if run.gpus % run.nodes:
        raise RecipeError(
            source, "run.gpus",
            f"gpus ({run.gpus}) must spread evenly over nodes ({run.nodes}): {run.gpus} % {run.nodes} = {run.gpus % run.nodes}",
        )
    for name in ("epochs", "batch_per_gpu"):
        if getattr(recipe.train, name) < 1:
            raise RecipeError(source, f"train.{name}", f"must be at least 1, got {getattr(recipe.train, name)}")
    if recipe.train.max_steps is not None and recipe.train.max_steps < 1:
        raise RecipeError(source, "train.max_steps", f"must be at least 1, got {recipe.train.max_steps}")
    adapter = registry.load(registry.FRAMEWORKS[run.framework].adapter)
    adapter.check_workload(recipe, source)
    adapter.check(recipe, source)


def differing_fields(before: Recipe, after: Recipe) -> list[str]:
    """Dotted names of the fields whose values differ between two recipes (what changes a fingerprint)."""
    old, new = before.flat(), after.flat()
    return sorted(key for key in old.keys() | new.keys() if old.get(key) != new.get(key))


def load_file(path: Path | str, overrides: list[str] = ()) -> Recipe:
    path = Path(path)
    if not path.is_file():
        raise RecipeError(str(path), "", "recipe file not found")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise RecipeError(str(path), "", f"not valid YAML: {error}".replace("\n", " ")) from None
    return resolve(raw or {}, str(path), overrides)
