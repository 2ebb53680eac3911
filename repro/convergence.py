"""`repro convergence`: the paper's statistical-efficiency findings, judged at equal settings over seeds.

The matrix trains each framework with the paper's own settings (PipeDream with LAMB at batch 8, its rivals
otherwise), so its curves mix frameworks with settings; the parity report holds the settings equal but runs
4 steps on one seed. This study holds everything but the treatment equal (optimizer, learning rate, global
batch, data order and initial weights) and runs long enough to reach the target: GPT-2's reduced model
(`SMALL` in repro.parity) on EVALS x STEPS_PER_EVAL steps, validated every STEPS_PER_EVAL steps, on SEEDS
seeds. A seed fixes the initial weights and the data order, so control and treatment of one seed differ
only by the treatment: each comparison is a paired one (repro.report.statistics).

- Staleness: PipeDream with 2 stages against a synchronous 1F1B pipeline with the same 2 stages and against
  one process, at two learning rates (staleness costs more at a higher rate); with 4 stages (the first
  stage 3 updates stale) against 1F1B with the same 4, at the higher rate. PipeDream's adapter always
  stashes weights (repro/adapters/pipedream.py): a run without stashing cannot be made here.
- Data-parallel identity: ZeRO-1/2/3 and FSDP against DDP at 2 processes, by an equivalence test whose
  margin is the seed spread or the rounding control (DDP at 2 against one process), whichever is larger. A
  negative control (one process at the higher rate against the lower) must come out different: otherwise
  the test has no power here.
- Megatron's effective batch: Megatron-intra (tp=2) against DDP at equal global batch (the framework), then
  Megatron-intra at its paper batch rule (batch per GPU x GPUs: 16 at 2 GPUs) against itself at 8 (the batch).

Runs are recorded in MLflow (experiment `convergence-SCALE`) and reused by recipe fingerprint, like the
matrix and the parity report (repro.parity.train), with warm ranks (repro.table2.kept_warm).
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from repro import names, parity, registry
from repro.recipe import Recipe, load_file, recipe_path
from repro.report import statistics
from repro.report.statistics import (AGAINST_SYNC, CONTROL, EFFECT, EQUIVALENCE, IDENTITY, MEGATRON, NEGATIVE, STALENESS,
                                     Interval)
from repro.schema import RecipeError

WORKLOAD = "gpt2"  # GPT-2's reduced model reaches its target in about 60 steps; VGG-16's needs epochs
SEEDS = 3
EVALS, STEPS_PER_EVAL = 8, 20  # 160 steps, validated every 20 (the loop validates after each epoch)
VAL_SAMPLES = 64  # one validation batch per process
# Adam. Measured here (3 seeds): at 0.001 one process reaches perplexity 20 in 60-80 steps; at 0.003 it sits on the
# byte-unigram plateau (about 27.5) for about 100 steps first, so the higher rate is the harder one
LOW_LR, HIGH_LR = 0.001, 0.003
PAPER_BATCH = 16  # Megatron-intra's paper rule at 2 GPUs: 8 per GPU x 2


@dataclass(frozen=True)
class Arm:
    """One trained configuration: a framework, its layout, a learning rate and a global batch."""
    name: str
    config: parity.Config
    global_batch: int = parity.GLOBAL_BATCH

    @property
    def lr(self) -> float:
        return dict(self.config.optimizer)["lr"]


def arm(name: str, framework: str, gpus: int, lr: float = LOW_LR, settings: tuple[str, ...] = (),
        global_batch: int = parity.GLOBAL_BATCH) -> Arm:
    optimizer = tuple({**parity.ADAM, "lr": lr}.items())
    return Arm(name, parity.Config(name, framework, gpus, settings, optimizer=optimizer), global_batch)


def lr_tag(lr: float) -> str:
    return f"lr {lr:g}"


ARMS = {a.name: a for a in (
    *(arm(f"one process, {lr_tag(lr)}", "ddp", 1, lr) for lr in (LOW_LR, HIGH_LR)),
    *(arm(f"pipedream-2, {lr_tag(lr)}", "pipedream", 2, lr) for lr in (LOW_LR, HIGH_LR)),
    *(arm(f"1f1b-2, {lr_tag(lr)}", "torch-pipeline", 2, lr, ("torch_pipeline.schedule=1f1b",))
      for lr in (LOW_LR, HIGH_LR)),
    # 4 stages, each a layer of the reduced model, at the higher rate only (4 processes on 2 cores: the budget)
    arm(f"pipedream-4, {lr_tag(HIGH_LR)}", "pipedream", 4, HIGH_LR),
    arm(f"1f1b-4, {lr_tag(HIGH_LR)}", "torch-pipeline", 4, HIGH_LR, ("torch_pipeline.schedule=1f1b",)),
    arm("ddp-2", "ddp", 2),
    *(arm(f"zero-{stage}", "zero", 2, settings=(f"zero.stage={stage}",)) for stage in (1, 2, 3)),
    arm("fsdp-2", "fsdp", 2),
    arm("megatron-intra-2", "megatron", 2, settings=("megatron.tp=2",)),
    arm(f"megatron-intra-2, batch {PAPER_BATCH}", "megatron", 2, settings=("megatron.tp=2",),
        global_batch=PAPER_BATCH),
)}
ROUNDING = ("ddp-2", f"one process, {lr_tag(LOW_LR)}")  # differ only in the order of the gradient's sums


@dataclass(frozen=True)
class Comparison:
    group: str
    treatment: str
    control: str
    test: str  # EFFECT: how much the treatment changes convergence; EQUIVALENCE: whether it changes it at all
    role: str = ""  # AGAINST_SYNC, NEGATIVE: the comparisons a finding singles out


ROUNDING_CONTROL = Comparison(CONTROL, *ROUNDING, EQUIVALENCE)
# a real difference (the learning rate): the equivalence test must flag it, else it has no power here
NEGATIVE_CONTROL = Comparison(CONTROL, f"one process, {lr_tag(HIGH_LR)}", f"one process, {lr_tag(LOW_LR)}", EQUIVALENCE,
                              NEGATIVE)
COMPARISONS = (
    *(Comparison(STALENESS, f"pipedream-2, {lr_tag(lr)}", f"1f1b-2, {lr_tag(lr)}", EFFECT, AGAINST_SYNC)
      for lr in (LOW_LR, HIGH_LR)),
    *(Comparison(STALENESS, f"pipedream-2, {lr_tag(lr)}", f"one process, {lr_tag(lr)}", EFFECT)
      for lr in (LOW_LR, HIGH_LR)),
    *(Comparison(STALENESS, f"1f1b-2, {lr_tag(lr)}", f"one process, {lr_tag(lr)}", EQUIVALENCE)
      for lr in (LOW_LR, HIGH_LR)),
    Comparison(STALENESS, f"pipedream-4, {lr_tag(HIGH_LR)}", f"1f1b-4, {lr_tag(HIGH_LR)}", EFFECT, AGAINST_SYNC),
    Comparison(STALENESS, f"1f1b-4, {lr_tag(HIGH_LR)}", f"one process, {lr_tag(HIGH_LR)}", EQUIVALENCE),
    ROUNDING_CONTROL,
    NEGATIVE_CONTROL,
    *(Comparison(IDENTITY, name, "ddp-2", EQUIVALENCE) for name in ("zero-1", "zero-2", "zero-3", "fsdp-2")),
    Comparison(MEGATRON, "megatron-intra-2", "ddp-2", EQUIVALENCE),
    Comparison(MEGATRON, f"megatron-intra-2, batch {PAPER_BATCH}", "megatron-intra-2", EFFECT),
)


@dataclass(frozen=True)
class Plan:
    """How long and on how many seeds every arm trains (the command's options; the defaults above)."""
    seeds: int = SEEDS
    evals: int = EVALS
    steps_per_eval: int = STEPS_PER_EVAL

    def seed_list(self, base: int) -> list[int]:
        return [base + index for index in range(self.seeds)]


def recipe(one: Arm, seed: int, plan: Plan, scale: str, extra: list[str] = ()) -> Recipe:
    """The arm's recipe on `seed`: an epoch is `steps_per_eval` steps at the arm's global batch (PAPER_BATCH
    arms: as many samples an epoch, in fewer steps), validated on VAL_SAMPLES after each; one checkpoint, at
    the end (a save per epoch would cost every framework its save between validations, read by no one)."""
    per_epoch = plan.steps_per_eval * parity.GLOBAL_BATCH
    fields = [f"seed={seed}", f"train.epochs={plan.evals}", f"train.max_steps={plan.evals * plan.steps_per_eval}",
              f"data.max_train_samples={per_epoch}", f"data.max_val_samples={VAL_SAMPLES}",
              f"train.eval_batch={VAL_SAMPLES}", f"train.checkpoint_every={plan.evals}", *extra]
    return parity.recipe_for(one.config, WORKLOAD, scale, plan.steps_per_eval, fields, one.global_batch)


@dataclass
class Curves:
    """One arm's validation curves, one per seed (None: the run is missing or failed)."""
    name: str
    framework: str
    gpus: int
    lr: float
    global_batch: int
    samples: list[int]  # training samples seen at each validation
    by_seed: list[list[float] | None]
    why_missing: str = ""


@dataclass
class Outcome:
    """A comparison's result: relative paired effects with 95% intervals, at the target and at the end."""
    group: str
    treatment: str
    control: str
    test: str
    role: str = ""
    seeds: int = 0
    at_target: Interval | None = None  # samples to reach the target, relative to the control's
    at_end: Interval | None = None  # final validation metric, relative to the control's
    margin: float | None = None  # EQUIVALENCE: the largest relative effect called equivalent
    verdict: str = statistics.INCONCLUSIVE
    note: str = ""


def target_samples(curves: Curves, seed: int, target: float) -> float | None:
    return statistics.crossing(curves.samples, curves.by_seed[seed], target, metric()[1])


def metric() -> tuple[str, bool]:
    from repro.report.collect import METRIC

    return METRIC[WORKLOAD]


def finals(curves: Curves) -> list[float]:
    return [curve[-1] for curve in curves.by_seed if curve]


def rounding_margin(arms: dict[str, Curves]) -> float:
    """Largest relative gap of the final metric between the rounding control's two arms over the seeds."""
    a, b = (arms.get(name) for name in ROUNDING)
    if not a or not b or not all(a.by_seed) or not all(b.by_seed):
        return 0.0
    return max(abs(x - y) / abs(y) for x, y in zip(finals(a), finals(b)))


def compare(comparison: Comparison, arms: dict[str, Curves], target: float) -> Outcome:
    outcome = Outcome(comparison.group, comparison.treatment, comparison.control, comparison.test, comparison.role)
    treatment, control = arms.get(comparison.treatment), arms.get(comparison.control)
    paired = [seed for seed in range(len(control.by_seed)) if treatment.by_seed[seed] and control.by_seed[seed]] \
        if treatment and control else []
    outcome.seeds = len(paired)
    if len(paired) < 2:
        outcome.note = "fewer than 2 seeds with both runs: no interval"
        return outcome
    outcome.at_end = statistics.relative_effect([treatment.by_seed[s][-1] for s in paired],
                                                [control.by_seed[s][-1] for s in paired])
    reached = [(target_samples(treatment, s, target), target_samples(control, s, target)) for s in paired]
    if all(t is not None and c is not None for t, c in reached):
        outcome.at_target = statistics.relative_effect([t for t, _ in reached], [c for _, c in reached])
    else:
        outcome.note = (f"target {target:g} not reached on every seed (treatment {sum(t is not None for t, _ in reached)}, "
                        f"control {sum(c is not None for _, c in reached)} of {len(paired)})")
    if comparison.test == EQUIVALENCE:
        control_finals = [control.by_seed[s][-1] for s in paired]
        rounding = 0.0 if comparison == ROUNDING_CONTROL else rounding_margin(arms)
        outcome.margin = max(statistics.spread(control_finals), rounding)
        outcome.verdict = statistics.equivalence(outcome.at_end, outcome.margin)
    else:
        apart = [where for where, effect in (("target", outcome.at_target), ("end", outcome.at_end))
                 if effect and effect.excludes_zero()]
        outcome.verdict = f"{statistics.DIFFERENT} at the {' and '.join(apart)}" if apart else statistics.INCONCLUSIVE
    return outcome


@dataclass
class Study:
    workload: str
    plan: Plan
    target: float
    seeds: list[int]
    arms: dict[str, Curves] = field(default_factory=dict)
    outcomes: list[Outcome] = field(default_factory=list)
    unavailable: list[str] = field(default_factory=list)  # what could not run here, and why


def planned_recipes(plan: Plan, scale: str, extra: list[str], selected: list[str]) -> tuple[dict, list[str]]:
    """(arm name -> its recipe per seed, one line per arm that cannot run here and why)."""
    base = load_file(recipe_path(WORKLOAD, scale), list(extra)).seed
    recipes, unavailable = {}, []
    for name in selected:
        one = ARMS[name]
        absence = registry.framework(one.config.framework).absence()
        if absence:
            unavailable.append(f"{name}: unavailable here: {absence}")
            continue
        try:
            recipes[name] = [recipe(one, seed, plan, scale, extra) for seed in plan.seed_list(base)]
        except RecipeError as error:
            unavailable.append(f"{name}: not applicable: {error.problem}")
    return recipes, unavailable


def arms_of(comparisons: list[Comparison]) -> list[str]:
    return list(dict.fromkeys(name for c in comparisons for name in (c.control, c.treatment)))


def run_study(scale: str, uri: str, experiment: str, plan: Plan = Plan(), comparisons: list[Comparison] = COMPARISONS,
              extra: list[str] = (), execute: bool = True,
              out: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)) -> Study:
    """Train (unless `execute` is False) every arm the comparisons need on every seed, then compare."""
    recipes, unavailable = planned_recipes(plan, scale, list(extra), arms_of(list(comparisons)))
    lbann = registry.framework("lbann").absence()
    unavailable += [f"lbann: its binary does not run here ({lbann})"] if lbann else []
    every = [r for rs in recipes.values() for r in rs]
    begun = time.monotonic()
    problems = parity.train(every, uri, experiment, out, "convergence") if execute else {}
    if execute:
        out(f"convergence: {len(every)} runs of {len(recipes)} arms, trained or reused in {time.monotonic() - begun:.0f} s")
    first = every[0] if every else None
    study = Study(WORKLOAD, plan, first.train.target_metric if first else 0.0,
                  [r.seed for r in next(iter(recipes.values()), [])], unavailable=unavailable)
    newest = parity.newest_runs(uri, experiment)
    for name, seeded in recipes.items():
        study.arms[name] = curves_of(ARMS[name], seeded, newest, uri)
        missing = [problems[r.fingerprint()] for r in seeded if r.fingerprint() in problems]
        study.arms[name].why_missing = "; ".join(dict.fromkeys(missing))
    study.outcomes = [compare(c, study.arms, study.target) for c in comparisons]
    return study


def curves_of(one: Arm, seeded: list[Recipe], newest: dict[str, str], uri: str) -> Curves:
    from repro.report.collect import history
    from repro.tracking import client

    mlflow_client, key = client(uri), metric()[0]
    by_seed = []
    for r in seeded:
        run_id = newest.get(r.fingerprint())
        by_seed.append((history(mlflow_client, run_id, key) or None) if run_id else None)
    per_epoch = seeded[0].data.max_train_samples
    evals = max((len(c) for c in by_seed if c), default=0)
    return Curves(one.name, one.config.framework, one.config.gpus, one.lr, one.global_batch,
                  [per_epoch * (index + 1) for index in range(evals)], by_seed)


def settings_text(study: Study) -> str:
    p = study.plan
    return (f"{study.workload}'s reduced model ({', '.join(parity.SMALL[study.workload])}), Adam (weight decay 0), "
            f"global batch {parity.GLOBAL_BATCH} unless named, {p.evals * p.steps_per_eval} steps validated every "
            f"{p.steps_per_eval} on {VAL_SAMPLES} samples, seeds {', '.join(map(str, study.seeds))} (each fixes "
            f"the initial weights and the data order of every arm), target perplexity {study.target:g}")


def interval_text(value: Interval | None) -> str:
    return "-" if value is None else value.text()


def markdown(study: Study) -> str:
    lines = ["# Convergence at equal settings: staleness, data-parallel identity, Megatron's effective batch", "",
             f"{settings_text(study)}. Effects are paired by seed and relative to the control: `at target` is "
             "the change in training samples to reach the target (positive: slower), `at end` the change in the "
             "final validation perplexity (positive: worse); each with its 95% t interval across seeds. "
             "`equivalent`: the whole interval of the end effect lies within the margin (the larger of the "
             "control's seed spread and the rounding control's gap); `different`: it lies outside the margin "
             "and excludes zero. An `effect` row is `different` where an interval excludes zero, else "
             "`inconclusive` at these seeds.", "",
             "| question | treatment | control | test | seeds | at target | at end | margin | verdict | note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for o in study.outcomes:
        margin = "-" if o.margin is None else f"{o.margin:.1%}"
        lines.append(f"| {o.group} | {o.treatment} | {o.control} | {o.test} | {o.seeds} | {interval_text(o.at_target)} "
                     f"| {interval_text(o.at_end)} | {margin} | {o.verdict} | {o.note or '-'} |")
    lines += ["", "## Validation perplexity by arm (mean over seeds, every evaluation)", "",
              "| arm | framework | GPUs | lr | global batch | seeds run | curve | missing |", "|---|---|---|---|---|---|---|---|"]
    for c in study.arms.values():
        means = mean_curve(c)
        lines.append(f"| {c.name} | {c.framework} | {c.gpus} | {c.lr:g} | {c.global_batch} | "
                     f"{sum(1 for v in c.by_seed if v)}/{len(c.by_seed)} | {', '.join(f'{v:.2f}' for v in means) or '-'} "
                     f"| {c.why_missing or '-'} |")
    lines += ["", "## What this study cannot show", "", *(f"- {line}" for line in LIMITS),
              *(f"- Not run here: {line}." for line in study.unavailable)]
    return "\n".join(lines) + "\n"


LIMITS = (
    "PipeDream's adapter always stashes weights (repro/adapters/pipedream.py): 'without stashing' is not an arm, "
    "so 'stashing does not cure staleness' is judged as: PipeDream, with stashing, is still slower than the "
    "synchronous pipeline.",
    "2 and 4 stages only: stage s runs S-1-s updates behind, so the first stage is 1 or 3 updates stale (4 stages "
    "at the higher rate alone). Deeper pipelines (the paper's up to 64 GPUs), larger models and longer training, "
    "where staleness may bite harder or wash out, are not measured; nor are data-parallel frameworks beyond 2 "
    "processes (more 4-process arms on 2 cores would blow the main job's budget).",
    "LBANN is no arm of the data-parallel identity: its reader orders the data its own way and its Adam is not "
    "PyTorch's (docs/lbann.md), so it cannot train at equal settings with the others.",
    "A reduced GPT-2 (2 blocks, 64 wide) on bytes of WikiText-2: equivalence at this size is evidence about the "
    "frameworks' arithmetic, not about statistical efficiency at the paper's scale.",
)


def mean_curve(curves: Curves) -> list[float]:
    runs = [c for c in curves.by_seed if c]
    length = min((len(c) for c in runs), default=0)
    return [sum(c[i] for c in runs) / len(runs) for i in range(length)]


def to_json(study: Study) -> dict[str, Any]:
    return {"workload": study.workload, "plan": asdict(study.plan), "target": study.target, "seeds": study.seeds,
            "arms": {name: asdict(c) for name, c in study.arms.items()},
            "outcomes": [asdict(o) for o in study.outcomes], "unavailable": study.unavailable}


def write(study: Study, folder: Path) -> list[Path]:
    from repro.report.figures import convergence_curves

    folder.mkdir(parents=True, exist_ok=True)
    md, js = folder / "convergence.md", folder / "convergence.json"
    md.write_text(markdown(study))
    js.write_text(json.dumps(to_json(study), indent=2))
    figure = convergence_curves(to_json(study), folder / "convergence.png")
    return [md, js, *([figure] if figure else [])]


def by_name(selection: str | None) -> list[Comparison]:
    """The comparisons whose group or treatment contains one of the comma-separated words (all: None)."""
    if not selection:
        return list(COMPARISONS)
    words = selection.split(",")
    return [c for c in COMPARISONS if any(w in c.group or w in c.treatment for w in words)]
