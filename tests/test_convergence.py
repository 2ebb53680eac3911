"""The convergence study: its statistics give the textbook numbers, its equivalence test flags a real
difference (a changed learning rate), and the findings rest on it."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from repro import convergence
from repro.convergence import (ARMS, NEGATIVE_CONTROL, ROUNDING_CONTROL, Comparison, Curves, Plan, Study, compare,
                               recipe, to_json)
from repro.report import answers, findings
from repro.report.evidence import FAILS, HOLDS, INCONCLUSIVE, Results
from repro.report.statistics import (DIFFERENT, EQUIVALENT, Interval, crossing, equivalence, relative_effect, spread,
                                     t_interval, t_quantile)

SAMPLES = [160, 320, 480, 640]
# validation perplexity of one process on three seeds, shaped like the study's own (lr 0.001, reaching 20 in the
# third evaluation); a treatment is built from it seed by seed
CONTROL = [[47.8, 26.15, 19.52, 16.0], [48.3, 26.6, 19.9, 16.2], [47.1, 25.8, 19.3, 15.8]]


def curves(name: str, by_seed: list[list[float]]) -> Curves:
    return Curves(name, "ddp", 1, ARMS[name].lr if name in ARMS else 0.001, 8, SAMPLES, by_seed)


def scaled(by_seed: list[list[float]], factors: list[float]) -> list[list[float]]:
    return [[value * factor for value in curve] for curve, factor in zip(by_seed, factors)]


@pytest.mark.units
def test_t_interval_relative_effect_and_spread_give_the_textbook_numbers():
    assert t_quantile(1) == 12.706 and t_quantile(2) == 4.303 and t_quantile(25) == 2.086  # 25: df 20's, wider
    with pytest.raises(ValueError, match="at least 2 values"):
        t_quantile(0)
    # mean 2, sd 1, n 3: 2 +- 4.303 / sqrt(3)
    interval = t_interval([1.0, 2.0, 3.0])
    assert (interval.mean, interval.low, interval.high, interval.n) == pytest.approx((2.0, 2 - 2.484338, 2 + 2.484338, 3))
    # paired, relative: +10%, +20%, +30%: mean 20%, sd 10%: +- 4.303 x 0.1 / sqrt(3)
    effect = relative_effect([11.0, 12.0, 13.0], [10.0, 10.0, 10.0])
    assert (effect.mean, effect.low, effect.high) == pytest.approx((0.2, 0.2 - 0.2484338, 0.2 + 0.2484338))
    assert effect.text() == "+20.0% [-4.8%, +44.8%]"
    assert spread([10.0, 11.0, 12.0]) == pytest.approx(1 / 11)
    with pytest.raises(ValueError, match="3 treatment against 2 control"):
        relative_effect([1.0, 2.0, 3.0], [1.0, 2.0])


@pytest.mark.units
def test_equivalence_needs_the_whole_interval_inside_the_margin():
    assert equivalence(Interval(0.001, -0.002, 0.004, 3), 0.01) == EQUIVALENT
    assert equivalence(Interval(0.2, 0.1, 0.3, 3), 0.05) == DIFFERENT
    assert equivalence(Interval(0.03, 0.01, 0.05, 3), 0.04) == DIFFERENT  # excludes zero, reaches past the margin
    assert equivalence(Interval(0.01, -0.05, 0.07, 3), 0.03) == "inconclusive"  # too wide to tell


@pytest.mark.units
def test_crossing_interpolates_samples_to_the_target_between_evaluations():
    assert crossing(SAMPLES, CONTROL[0], 20.0, False) == pytest.approx(320 + 160 * 6.15 / 6.63)  # 468.4
    assert crossing(SAMPLES, CONTROL[0], 50.0, False) == 160.0  # reached at the first evaluation
    assert crossing(SAMPLES, CONTROL[0], 10.0, False) is None
    assert crossing([10, 20], [0.5, 0.9], 0.8, True) == pytest.approx(17.5)  # accuracy: higher is better


@pytest.mark.units
def test_the_equivalence_test_flags_a_changed_learning_rate_and_passes_a_rounding_difference():
    """The check that can fail: the negative control (a higher learning rate ends 20-24% lower in perplexity,
    seed by seed) must be `different`; a framework off by rounding only (1e-6) must be `equivalent`."""
    low, high, rounding = ROUNDING_CONTROL.control, NEGATIVE_CONTROL.treatment, ROUNDING_CONTROL.treatment
    arms = {low: curves(low, CONTROL), high: curves(high, scaled(CONTROL, [0.8, 0.78, 0.76])),
            rounding: curves(rounding, scaled(CONTROL, [1 + 1e-6, 1.0, 1 - 1e-6]))}
    negative = compare(NEGATIVE_CONTROL, arms, 20.0)
    assert negative.verdict == DIFFERENT and negative.seeds == 3
    assert negative.at_end.mean == pytest.approx(-0.22) and negative.at_end.high < -negative.margin
    assert negative.margin == pytest.approx(max(spread([16.0, 16.2, 15.8]), 1e-6))  # the seed spread, 1.25%
    same = compare(ROUNDING_CONTROL, arms, 20.0)
    assert same.verdict == EQUIVALENT and abs(same.at_end.mean) < 1e-6
    # a treatment that differs by less than the seed spread, but inconsistently, cannot be told either way
    arms["zero-1"] = curves("zero-1", scaled(CONTROL, [1.03, 0.98, 1.0]))
    assert compare(Comparison("data-parallel identity", "zero-1", low, "equivalence"), arms, 20.0).verdict == "inconclusive"
    # a missing seed leaves 2 pairs; one pair is no interval at all
    arms[high] = curves(high, [None, None, scaled(CONTROL, [0.8] * 3)[2]])
    assert compare(NEGATIVE_CONTROL, arms, 20.0).note.startswith("fewer than 2 seeds")


def study_of(treatments: dict[str, list[float]]) -> dict:
    """A study whose arms are CONTROL scaled seed by seed (name -> factors), compared as the command does."""
    arms = {name: curves(name, scaled(CONTROL, factors)) for name, factors in treatments.items()}
    study = Study("gpt2", Plan(), 20.0, [1234, 1235, 1236], arms)
    study.outcomes = [compare(c, arms, 20.0) for c in convergence.COMPARISONS]
    return json.loads(json.dumps(to_json(study)))


def judged(study: dict) -> dict[str, findings.Finding]:
    return {f.key: f for f in findings.judge([], study=study, cores=2)}


SAME = [1.0, 1.0, 1.0]
ALL_SAME = {name: SAME for name in ARMS}


@pytest.mark.units
def test_findings_rest_on_the_study_with_effects_and_intervals():
    stale = [1.3, 1.32, 1.28]  # PipeDream 30% worse perplexity: its curve reaches 20 much later, or never
    study = study_of({**ALL_SAME, "one process, lr 0.003": [0.8, 0.78, 0.76],
                      "pipedream-2, lr 0.001": stale, "pipedream-2, lr 0.003": stale, "pipedream-4, lr 0.003": stale,
                      "megatron-intra-2, batch 16": [1.1, 1.12, 1.08]})
    verdicts = judged(study)
    assert verdicts["data_parallel_curves"].verdict == HOLDS
    assert "zero-3 against ddp-2 (3 seeds, paired, 95% t interval)" in "\n".join(verdicts["data_parallel_curves"].evidence)
    slow = verdicts["pipedream_slower"]
    assert slow.verdict == HOLDS, slow.evidence
    assert "pipedream-2, lr 0.003 against 1f1b-2, lr 0.003" in "\n".join(slow.evidence)
    megatron = verdicts["megatron_statistical_efficiency"]
    assert megatron.verdict == FAILS and "final perplexity +10.0% [" in "\n".join(megatron.evidence)
    rq3 = {a.key: a for a in answers.answer(Results([], 2, study=study), [8])}["RQ3"]
    assert rq3.sentences[0].text.startswith("At equal settings (Adam at lr 0.001 and 0.003, global batch 8, 160 steps")


@pytest.mark.units
def test_without_power_or_with_a_real_gap_the_identity_is_not_claimed():
    # the negative control is not flagged (the learning rate changes nothing): equivalence proves nothing
    assert judged(study_of(ALL_SAME))["data_parallel_curves"].verdict == INCONCLUSIVE
    gap = judged(study_of({**ALL_SAME, "one process, lr 0.003": [0.8, 0.78, 0.76], "zero-3": [1.1, 1.12, 1.09]}))
    assert gap["data_parallel_curves"].verdict == FAILS


@pytest.mark.units
def test_every_arm_trains_at_its_global_batch_with_its_rate_and_the_seed_fixes_weights_and_order():
    plan = Plan(seeds=3, evals=4, steps_per_eval=10)
    pipedream = recipe(ARMS["pipedream-2, lr 0.003"], 1235, plan, "smoke")
    assert (pipedream.seed, pipedream.optimizer().lr, pipedream.train.batch_per_gpu) == (1235, 0.003, 8)
    assert (pipedream.train.epochs, pipedream.train.max_steps, pipedream.data.max_train_samples) == (4, 40, 80)
    assert (pipedream.train.checkpoint_every, pipedream.data.max_val_samples, pipedream.train.eval_batch) == (4, 64, 64)
    ddp = recipe(ARMS["ddp-2"], 1235, plan, "smoke")
    assert (ddp.train.batch_per_gpu, ddp.optimizer().name, ddp.optimizer().lr) == (4, "adam", 0.001)
    paper = recipe(ARMS["megatron-intra-2, batch 16"], 1235, plan, "smoke")
    assert (paper.train.batch_per_gpu, paper.data.max_train_samples, paper.optimizer().lr) == (8, 80, 0.001)
    assert replace(ddp, seed=1234).fingerprint() != ddp.fingerprint()


@pytest.mark.end_to_end
def test_the_command_flags_the_changed_learning_rate_on_real_runs(repro, tmp_path: Path):
    """The controls on 2 seeds of 3 short runs each: a higher learning rate is reported as different from
    the lower, and DDP at 2 processes as equivalent to one process."""
    result = repro("convergence", "--only", "control", "--seeds", "2", "--evals", "2", "--steps-per-eval", "10",
                   "--reports", str(tmp_path / "reports"))
    assert result.returncode == 0, result.stderr[-2000:]
    study = json.loads((tmp_path / "reports" / "convergence.json").read_text())
    verdicts = {(o["treatment"], o["control"]): o["verdict"] for o in study["outcomes"]}
    assert verdicts == {("ddp-2", "one process, lr 0.001"): "equivalent",
                        ("one process, lr 0.003", "one process, lr 0.001"): "different"}
    assert all(len(curve) == 2 for arm in study["arms"].values() for curve in arm["by_seed"])
    assert (tmp_path / "reports" / "convergence.png").stat().st_size > 10_000
    assert "| control | one process, lr 0.003 | one process, lr 0.001 | equivalence | 2 |" in \
        (tmp_path / "reports" / "convergence.md").read_text()
