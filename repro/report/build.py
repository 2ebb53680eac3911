"""Write reports/ from MLflow: Table 2, the results tables, the figures and the findings."""
from __future__ import annotations

import json
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any, Callable

from repro import names
from repro.hardware import PAPER_PLATFORMS, cpu_cores, this_platform
from repro.report import answers, evidence, figures, findings, model_check, tables
from repro.report.collect import Result, collect
from repro.cell import Cell

REPORT_RUN = "table2-report"


def write_reports(cells: list[Cell], uri: str, experiment: str, folder: Path, scale: str,
                  cores: int | None = None, predict: evidence.Predictor | None = None, final: bool = True,
                  with_settings: tuple[list[Cell], str] | None = None, platform: Any = None,
                  retimed: dict[tuple[str, object], list[float]] | None = None) -> list[Path]:
    """Every report file; the findings also read the parity report already in `folder`, if any.
    `cores`: the machine's (default), which decides whether epoch times can be compared; `predict`:
    the cost model at paper scale (default: repro.model.predict, quoted with the errors of this run's model check);
    `final`: also log the files to the matrix's MLflow report run (not while the matrix still runs);
    `with_settings`: the parity runs with memory settings (repro.parity.setting_cells) and their experiment,
    for the model check's section of them; `platform`: this machine's profile (`machine_profile`), for the
    model check's step-time rows (none without it), and `retimed`, the same recipes timed again beside its
    calibration (repro.framework_overhead.retimed), which the rows read too."""
    folder.mkdir(parents=True, exist_ok=True)
    results = collect(cells, uri, experiment)
    nodes = max((r.cell.recipe.run.nodes for r in results if r.ok), default=1)
    paths = tables.write_all(folder, "table2_platforms", [*PAPER_PLATFORMS, this_platform(nodes)], tables.PLATFORM_COLUMNS)
    paths += tables.write_all(folder, "results", tables.result_rows(results), tables.RESULT_COLUMNS)
    paths += figures.all_figures(results, folder)
    cores = cores or cpu_cores()
    checked = model_check.checks(results, platform, cores, retimed)
    if final:
        model_check.log_step_times(uri, checked)
    settings_checked = []
    if with_settings:
        setting_cells, setting_experiment = with_settings
        settings_checked = model_check.setting_checks(collect(setting_cells, uri, setting_experiment))
    paths += model_check.write(folder, checked, settings_checked)
    predict = predict or model_check.paper_predictor(checked)
    (parity, partings), study = read_parity(folder), read_study(folder)
    verdicts = findings.judge(results, parity=parity, cores=cores, predict=predict, partings=partings, study=study)
    answered = answers.answer(evidence.Results(results, cores, parity, predict, partings, study))
    (folder / "findings.md").write_text(answers.markdown(answered) + "\n" + findings.markdown(verdicts))
    (folder / "findings.json").write_text(json.dumps({"research_questions": [asdict(a) for a in answered],
                                                      "findings": [asdict(f) for f in verdicts]}, indent=2))
    paths += [folder / "findings.md", folder / "findings.json"]
    paths += [path for path in (folder / "parity.md", folder / "parity.json", *study_files(folder)) if path.is_file()]
    if final:
        log_report_run(uri, experiment, scale, paths, results)
    return paths


def machine_profile(uri: str, measure: bool) -> Any:
    """This machine's calibrated profile kept beside the MLflow store (repro.calibrate), measured now where
    none is kept and `measure` (the final reports: not while cells train beside the measurement)."""
    from repro import calibrate

    folder = calibrate.store_folder(uri)
    if measure or calibrate.profile_path(folder).is_file():
        return calibrate.calibrated(folder)
    return None


class EarlyReports:
    """Rewrites reports/ while the matrix runs, after a cell, so that a user reads the first results, figures
    and findings within minutes rather than at the end. A rewrite takes seconds that no cell trains in, so one
    is due only once the job has run MIN_INTERVAL_S since the last and COST_SHARE times that rewrite's own
    time: the rewrites take at most 1/COST_SHARE of the job. Each early results.md and findings.md opens
    with a line saying it is early, and when; the final reports (write_reports) replace them."""

    MIN_INTERVAL_S = 120.0
    COST_SHARE = 40

    def __init__(self, cells: list[Cell], uri: str, experiment: str, folder: Path, scale: str,
                 out: Callable[[str], None]):
        self.write = partial(write_reports, cells, uri, experiment, folder, scale, final=False,
                             platform=machine_profile(uri, measure=False))
        self.folder, self.out = folder, out
        self.last, self.cost = time.monotonic(), 0.0

    def __call__(self) -> None:
        if time.monotonic() - self.last < max(self.MIN_INTERVAL_S, self.COST_SHARE * self.cost):
            return
        started = time.monotonic()
        paths = self.write()
        self.last = time.monotonic()
        self.cost = self.last - started
        note = (f"*Early report, {time.strftime('%H:%M')}: the matrix is still running; this is rewritten as cells "
                f"finish, and replaced by the final report at the end.*\n\n")
        for path in (self.folder / "results.md", self.folder / "findings.md"):
            path.write_text(note + path.read_text())
        self.out(f"reports/ rewritten so far ({len(paths)} files, {self.cost:.1f} s): {self.folder / 'findings.md'}")


def read_parity(folder: Path) -> tuple[list[dict], list[dict]]:
    """The parity report's rows and its partings (the matrix's runs step by step), if it is there."""
    path = folder / "parity.json"
    report = json.loads(path.read_text()) if path.is_file() else {}
    return report.get("rows", []), report.get("partings", [])


def read_study(folder: Path) -> dict | None:
    """The convergence study's report (repro.convergence), if it is there."""
    path = folder / "convergence.json"
    return json.loads(path.read_text()) if path.is_file() else None


def study_files(folder: Path) -> tuple[Path, ...]:
    return tuple(folder / f"convergence.{ext}" for ext in ("md", "json", "png"))


def log_report_run(uri: str, experiment: str, scale: str, paths: list[Path], results: list[Result]) -> None:
    """One MLflow run gathering the matrix: every report file, and the run id of each cell."""
    from repro import tracking

    run = tracking.Run.create(uri, experiment, f"{REPORT_RUN}-{scale}", {names.REPORT: "table2", names.SCALE: scale}, {})
    for path in paths:
        run.log_artifact(path)
    run.log_dict({r.cell.label: {"status": r.status, "run_id": r.run_id} for r in results}, "cells.json")
    run.end("FINISHED")
