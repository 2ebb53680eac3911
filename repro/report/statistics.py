"""Intervals across seeds, paired effects and an equivalence test, for the convergence study.

Each comparison trains a control and a treatment on the same seeds; a seed fixes the initial
weights and the data order, so the two runs of a seed differ only by the treatment and their
difference is the unit of evidence (a paired design). Across seeds, the mean difference gets a
Student t interval. Equivalence is judged like a TOST (Schuirmann 1987), with the 95% interval
(a little stricter than TOST's 90%): equivalent when the whole interval lies inside the margin.
No scipy here (not a dependency of the kit): the t quantiles are a table.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# the 0.975 quantile of Student's t by degrees of freedom (any statistics table); between two entries the
# lower df's is used, which widens the interval a little rather than narrowing it
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000, 120: 1.980}
EQUIVALENT, DIFFERENT, INCONCLUSIVE = "equivalent", "different", "inconclusive"
# the convergence study's questions and kinds of test (repro.convergence writes them, the findings read them)
STALENESS, IDENTITY, MEGATRON, CONTROL = "staleness", "data-parallel identity", "Megatron's effective batch", "control"
EFFECT, EQUIVALENCE = "effect", "equivalence"
# the comparisons a finding singles out (an Outcome's `role`)
AGAINST_SYNC, NEGATIVE = "stale against synchronous", "negative control"


@dataclass(frozen=True)
class Interval:
    """A mean over `n` values with its 95% t interval."""
    mean: float
    low: float
    high: float
    n: int

    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0

    def text(self, form: str = "+.1%") -> str:
        return f"{self.mean:{form}} [{self.low:{form}}, {self.high:{form}}]"


def t_quantile(df: int) -> float:
    if df < 1:
        raise ValueError(f"a t interval needs at least 2 values (df {df})")
    return T_975[max(key for key in T_975 if key <= df)]


def t_interval(values: list[float]) -> Interval:
    """Mean of `values` with its 95% Student t interval (at least 2 values)."""
    n = len(values)
    mean = sum(values) / n if n else math.nan
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else math.nan
    half = t_quantile(n - 1) * sd / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)


def relative_effect(treatment: list[float], control: list[float]) -> Interval:
    """The treatment's paired difference from the control, relative to the control, seed by seed."""
    if len(treatment) != len(control):
        raise ValueError(f"paired values: {len(treatment)} treatment against {len(control)} control")
    return t_interval([(t - c) / abs(c) for t, c in zip(treatment, control)])


def spread(values: list[float]) -> float:
    """Standard deviation across seeds relative to the mean (the coefficient of variation)."""
    n, mean = len(values), sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) / abs(mean)


def equivalence(effect: Interval, margin: float) -> str:
    """Equivalent when the whole 95% interval of the effect lies within +-margin; different when it
    does not and excludes zero; else inconclusive (too few seeds, or too wide a spread, to tell)."""
    if -margin < effect.low and effect.high < margin:
        return EQUIVALENT
    return DIFFERENT if effect.excludes_zero() else INCONCLUSIVE


def crossing(samples: list[int], values: list[float], target: float, higher_is_better: bool) -> float | None:
    """Samples seen when the validation curve first reaches `target`, interpolated linearly between the
    two evaluations around it (None: never reached)."""
    previous = None
    for seen, value in zip(samples, values):
        reached = value >= target if higher_is_better else value <= target
        if reached:
            if previous is None:
                return float(seen)
            (seen0, value0) = previous
            return seen0 + (seen - seen0) * (target - value0) / (value - value0)
        previous = (seen, value)
    return None
