"""A verdict on each of the paper's findings, with the measured numbers behind it.

The paper's wording, what each finding needs the runs to show, and the thresholds live in
configs/findings.yaml. A check judges a finding only where the runs can show what it needs
(repro.report.evidence says what a verdict can be); the checks themselves live by what they judge:
statistical efficiency in repro.report.convergence, speed and memory in repro.report.performance,
and the cost model's paper-scale predictions they quote in repro.report.predicted.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from repro.hardware import cpu_cores
from repro.report import convergence, performance
from repro.report.collect import Result
from repro.report.evidence import Predictor, Results, thresholds_path


@dataclass
class Finding:
    key: str
    paper: str
    verdict: str
    evidence: list[str]  # one line per comparison, with its numbers
    needs: list[str] = field(default_factory=list)


CHECKS: dict[str, Callable[[Results, dict[str, Any]], tuple[str, list[str]]]] = {
    "data_parallel_curves": convergence.data_parallel_curves,
    "zero_memory": performance.zero_memory,
    "pipedream_slower": convergence.pipedream_slower,
    "pipelines_slowest": performance.pipelines_slowest,
    "megatron_u_shape": performance.megatron_u_shape,
    "pipeline_memory": performance.pipeline_memory,
    "megatron_statistical_efficiency": convergence.megatron_statistical_efficiency,
    "hybrid_best_at_scale": performance.hybrid_best_at_scale,
}


def judge(results: list[Result], path: Path | None = None, parity: list[dict[str, Any]] | None = None,
          cores: int | None = None, predict: Predictor | None = None,
          partings: list[dict[str, Any]] | None = None, study: dict[str, Any] | None = None) -> list[Finding]:
    """Every finding's verdict; `parity`: the parity report's rows, `cores`: this machine's (default),
    `predict`: the cost model at paper scale (none: the findings say that predictions are not available),
    `partings`: the parity report's matrix runs step by step, with its rounding control; `study`: the
    convergence study's report, on which the statistical-efficiency findings rest where it ran."""
    thresholds = yaml.safe_load((path or thresholds_path()).read_text())
    indexed = Results(results, cores or cpu_cores(), parity, predict, partings, study)
    findings = []
    for key, check in CHECKS.items():
        verdict, notes = check(indexed, thresholds[key])
        findings.append(Finding(key, " ".join(thresholds[key]["paper"].split()), verdict,
                                notes or ["no cells with the frameworks this finding needs"],
                                thresholds[key].get("needs", [])))
    return findings


def markdown(findings: list[Finding]) -> str:
    lines = ["# The paper's findings on this machine: the evidence", "",
             "Each finding is judged only where the runs can show what it needs (configs/findings.yaml).", ""]
    for number, f in enumerate(findings, 1):
        lines += [f"## {number}. {f.key}: **{f.verdict}**", "", f"> {f.paper}", "",
                  f"Needs: {', '.join(f.needs) or '-'}.", ""]
        lines += [f"- {note}" for note in f.evidence] + [""]
    return "\n".join(lines)
