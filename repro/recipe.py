"""Recipes: the typed, validated, fingerprinted description of one run.

A recipe file (configs/{model}-{scale}.yaml) holds the workload's fixed hyper-parameters; the
command line adds the run's shape (framework, GPU count, nodes) and any `--set key=value`.
Each component receives only its own section: the workload gets `model`, an adapter gets its
framework section, the loop gets `train`. A file's `train_by_framework` section sets `train` fields for
one framework only (its memory settings: each framework's own recompute and micro-batches), below any
`--set` of the same field.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Callable, Literal

import yaml

from repro import registry
from repro.schema import AT_LEAST_1, FRACTION, NOT_NEGATIVE, POSITIVE, RecipeError, as_dict, build

SCALES = ("smoke", "paper")


@dataclass
class OptimizerSpec:
    name: Literal["sgd", "adam", "adamw", "lamb"]
    lr: Annotated[float, POSITIVE]
    weight_decay: Annotated[float, NOT_NEGATIVE] = 0.0
    momentum: Annotated[float, FRACTION] = 0.9
    betas: list[Annotated[float, FRACTION]] = field(default_factory=lambda: [0.9, 0.999])
    eps: Annotated[float, POSITIVE] = 1e-8


@dataclass
class DataSpec:
    dataset: str
    max_train_samples: Annotated[int, AT_LEAST_1] | None = None
    max_val_samples: Annotated[int, AT_LEAST_1] | None = None
    workers: Annotated[int, NOT_NEGATIVE] = 0


@dataclass
class TrainSpec:
    epochs: Annotated[int, AT_LEAST_1]
    batch_per_gpu: Annotated[int, AT_LEAST_1]
    optimizer: OptimizerSpec
    max_steps: Annotated[int, AT_LEAST_1] | None = None
    # auto: bf16 where the device computes in bf16, else fp16 (repro.hardware.automatic_precision), decided by
    # each rank once its device is known (repro.rank.resolve_precision) and recorded as effective.precision
    precision: Literal["fp32", "fp16", "bf16", "auto"] = "fp32"
    grad_clip: Annotated[float, POSITIVE] | None = None
    log_every: Annotated[int, AT_LEAST_1] = 1
    target_metric: float | None = None  # time-to-target threshold (accuracy: higher is better, perplexity: lower)
    # samples per process in a validation batch; None: the process's training batch (a pipeline's whole
    # step, cut into its micro-batches). Validation is outside the timed steps; fewer, larger batches
    # spare the collectives and pipeline hand-overs each batch costs. LBANN validates with its trainer's
    # mini-batch (repro.adapters.lbann_experiment), whatever this says.
    eval_batch: Annotated[int, AT_LEAST_1] | None = None
    # a checkpoint after every N-th epoch and after the last one (a stop signal saves wherever it lands): each
    # costs its framework's save between epochs, which a run that is not resumed mid-way never reads
    checkpoint_every: Annotated[int, AT_LEAST_1] = 1
    # Memory settings (issue 39), applied by each framework through its own mechanism or refused before
    # launch (repro.adapters.plan.FrameworkPlan.check_memory). recompute: None is the framework's default
    # (no recompute; torchgpipe: its own `torchgpipe.checkpoint`); "full" keeps only the input of each of
    # the workload's blocks (repro.shapes: `blocks`) and recomputes the block in backward.
    recompute: Literal["none", "selective", "full"] | None = None
    recompute_layers: Annotated[int, AT_LEAST_1] | None = None  # blocks recomputed, from the first; None: all
    # samples per micro-batch: gradients accumulate over batch_per_gpu / micro_batch forward-backward passes
    # before the one optimizer step, so the global batch and the step are unchanged; None: one pass
    micro_batch: Annotated[int, AT_LEAST_1] | None = None


@dataclass
class RunSpec:
    framework: str = "ddp"
    gpus: Annotated[int, AT_LEAST_1] = 1
    nodes: Annotated[int, AT_LEAST_1] = 1
    device: Literal["auto", "cpu", "cuda"] = "auto"
    allow_unverified: bool = False
    timeout_s: Annotated[int, AT_LEAST_1] = 600


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


def one_line(error: Exception) -> str:
    """A multi-line parser message (YAML's points at the column) as one line."""
    return " ".join(str(error).split())


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (['a', 'b'], value parsed as a YAML scalar)."""
    key, sep, value = text.partition("=")
    path = key.split(".")
    if not sep or not all(path):
        raise RecipeError("--set", text, "expected key=value, for example --set train.epochs=2")
    try:
        return path, yaml.safe_load(value) if value else ""
    except yaml.YAMLError as error:
        raise RecipeError(f"--set {text}", key, f"the value is not valid YAML: {one_line(error)}") from None


def apply_override(raw: dict[str, Any], text: str, blame: Callable[[str], str]) -> str:
    """Set the field of `--set text` in `raw`; returns its dotted name. `blame(field)` says who set a
    field before (the file, or an earlier --set), for a section that turns out to be a value."""
    path, value = parse_override(text)
    node = raw
    for depth, part in enumerate(path[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            where = ".".join(path[: depth + 1])
            raise RecipeError(blame(where), where, f"expected a section (mapping), got {type(child).__name__} "
                              f"{child!r}, so --set {text} cannot apply")
        node = child
    node[path[-1]] = value
    return ".".join(path)


def section_key(framework: str) -> str:
    """The recipe section of a framework: its name, with '-' written '_' (torch-pipeline -> torch_pipeline)."""
    return framework.replace("-", "_")


def _framework_sections(raw: dict[str, Any], source: str, used: str) -> dict[str, Any]:
    """Pop and validate every framework section of `raw` (and the run's framework, with defaults)."""
    out = {}
    for name, entry in registry.FRAMEWORKS.items():
        key = section_key(name)
        if key in raw or name == used:
            options_cls = registry.load(entry.plan).Options
            section = raw.pop(key, None)
            out[name] = build(options_cls, {} if section is None else section, source, key)
    return out


def resolve(raw: Any, source: str, overrides: list[str] = (), flags: dict[str, str] | None = None) -> Recipe:
    """Validate a raw recipe dict plus overrides into a Recipe. Errors name the file, or the --set (or
    the command-line option in `flags`, override text -> option) that set the field, and the field."""
    if not isinstance(raw, dict):
        raise RecipeError(source, "", f"expected a mapping of sections (workload, data, model, train, run, ...), "
                          f"got {type(raw).__name__}")
    raw = copy.deepcopy(raw)
    setters: dict[str, str] = {}  # dotted field -> the option that set it

    def blame(field: str) -> str:
        owners = [key for key in setters if field == key or field.startswith((f"{key}.", f"{key}["))]
        return setters[max(owners, key=len)] if owners else source

    for text in overrides:
        setters[apply_override(raw, text, blame)] = (flags or {}).get(text, f"--set {text}")
    run = raw.get("run")
    framework = run.get("framework", RunSpec.framework) if isinstance(run, dict) else RunSpec.framework
    fold_framework_train(raw, source, framework, setters)
    try:
        recipe = _build(raw, source)
    except RecipeError as error:
        raise RecipeError(blame(error.field), error.field, error.problem) from None
    if overrides:
        recipe.source = f"{source} (with --set {' --set '.join(overrides)})"
    return recipe


TRAIN_BY_FRAMEWORK = "train_by_framework"


def fold_framework_train(raw: dict[str, Any], source: str, framework: str, kept: Any = ()) -> None:
    """Pop the file's `train_by_framework` section and set `framework`'s entry's fields in `train`, except
    those named in `kept` ("train.micro_batch", as the command line set them): a framework's own memory
    settings apply to its runs alone, and a --set wins over them."""
    section = raw.pop(TRAIN_BY_FRAMEWORK, None) or {}
    if not isinstance(section, dict):
        raise RecipeError(source, TRAIN_BY_FRAMEWORK, f"expected a mapping of framework -> train fields, got "
                          f"{type(section).__name__}")
    for name, fields in section.items():
        if name not in registry.FRAMEWORKS:
            raise RecipeError(source, f"{TRAIN_BY_FRAMEWORK}.{name}", f"unknown framework {name!r}; valid: "
                              f"{', '.join(registry.FRAMEWORKS)}")
        if not isinstance(fields, dict):
            raise RecipeError(source, f"{TRAIN_BY_FRAMEWORK}.{name}", f"expected a mapping of train fields, got "
                              f"{type(fields).__name__}")
    train = raw.setdefault("train", {})
    for key, value in (section.get(framework) or {}).items():
        if f"train.{key}" not in kept and isinstance(train, dict):
            train[key] = value


def _build(raw: dict[str, Any], source: str) -> Recipe:
    run = raw.get("run")
    used = run.get("framework", RunSpec.framework) if isinstance(run, dict) else RunSpec.framework
    if used not in registry.FRAMEWORKS:
        raise RecipeError(source, "run.framework", f"unknown framework {used!r}; valid: {', '.join(registry.FRAMEWORKS)}")
    frameworks = _framework_sections(raw, source, used)
    model_raw = raw.pop("model", None)
    recipe = build(Recipe, {**raw, "model": {}}, source)
    workload = registry.workload_plan(recipe.workload)
    recipe.model = build(workload.ModelSpec, {} if model_raw is None else model_raw, source, "model")
    recipe.frameworks = frameworks
    recipe.source = source
    check(recipe, source)
    return recipe


def check(recipe: Recipe, source: str) -> None:
    """Cross-field rules; each error prints the arithmetic."""
    run = recipe.run
    if run.gpus % run.nodes:
        raise RecipeError(
            source, "run.gpus",
            f"gpus ({run.gpus}) must spread evenly over nodes ({run.nodes}): {run.gpus} % {run.nodes} = {run.gpus % run.nodes}",
        )
    for section, optimizer in (("train", recipe.train.optimizer), *(
            (section_key(name), options.optimizer) for name, options in recipe.frameworks.items())):
        if optimizer and len(optimizer.betas) != 2:
            raise RecipeError(source, f"{section}.optimizer.betas", f"expected two numbers [beta1, beta2], got {optimizer.betas}")
    check_dataset(recipe, source)
    registry.workload_plan(recipe.workload).check(recipe, source)
    plan = registry.load(registry.FRAMEWORKS[run.framework].plan)
    plan.check_workload(recipe, source)
    plan.check(recipe, source)
    check_memory_settings(recipe, source)
    plan.check_memory(recipe, source)
    limit = recipe.data.max_train_samples
    if limit is not None and plan.global_batch(recipe) > limit:
        raise RecipeError(source, "train.batch_per_gpu", batch_too_big(recipe, plan.global_batch(recipe), limit,
                                                                     f"data.max_train_samples = {limit}"))


def check_memory_settings(recipe: Recipe, source: str) -> None:
    """The memory settings' own rules, whatever the framework: a micro-batch divides the batch, and
    recompute_layers names blocks that exist and are recomputed."""
    from repro.shapes import shape_of

    train = recipe.train
    if train.micro_batch is not None and train.batch_per_gpu % train.micro_batch:
        raise RecipeError(source, "train.micro_batch", f"must divide train.batch_per_gpu into equal micro-batches: "
                          f"{train.batch_per_gpu} % {train.micro_batch} = {train.batch_per_gpu % train.micro_batch}")
    if train.recompute_layers is None:
        return
    if train.recompute in (None, "none"):
        raise RecipeError(source, "train.recompute_layers", f"{train.recompute_layers} blocks to recompute, but "
                          f"train.recompute is {train.recompute or 'unset'}: set train.recompute=full")
    blocks = len(shape_of(recipe.workload, recipe.model, recipe.data.dataset).blocks())
    if train.recompute_layers > blocks:
        raise RecipeError(source, "train.recompute_layers", f"{recipe.workload} has {blocks} blocks to recompute, "
                          f"got {train.recompute_layers}")


def check_dataset(recipe: Recipe, source: str) -> None:
    from repro.data.sets import DATASETS

    name = recipe.data.dataset
    if name not in DATASETS:
        raise RecipeError(source, "data.dataset", f"unknown dataset {name!r}; valid datasets: {', '.join(DATASETS)}")


def batch_too_big(recipe: Recipe, batch: int, samples: int, why: str) -> str:
    """The message of a global batch larger than the training samples: not even one step per epoch."""
    gpus = f"{recipe.run.gpus} GPU{'s' if recipe.run.gpus > 1 else ''}"
    return (f"the global batch ({batch} samples per step with {gpus}) exceeds the {samples} "
            f"training samples ({why}): not one step per epoch; lower train.batch_per_gpu")


def differing_fields(before: Recipe, after: Recipe) -> list[str]:
    """Dotted names of the fields whose values differ between two recipes (what changes a fingerprint)."""
    old, new = before.flat(), after.flat()
    return sorted(key for key in old.keys() | new.keys() if old.get(key) != new.get(key))


def load_file(path: Path | str, overrides: list[str] = (), flags: dict[str, str] | None = None) -> Recipe:
    """The recipe of a YAML file plus overrides (`flags`: see resolve)."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(str(path), "", "recipe file not found")
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as error:
        raise RecipeError(str(path), "", f"cannot be read: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise RecipeError(str(path), "", f"not UTF-8 text (byte 0x{error.object[error.start]:02x} at offset "
                          f"{error.start}); a recipe is a YAML file") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise RecipeError(str(path), "", f"not valid YAML: {one_line(error)}") from None
    return resolve({} if raw is None else raw, str(path), overrides, flags)
