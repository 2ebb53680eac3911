"""The results tables (numbers behind the paper's figures) and Table 2 (platforms): Markdown, CSV, LaTeX."""
from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

from repro.report import settings
from repro.report.collect import Result

RESULT_COLUMNS = [
    "workload", "framework", "gpus", "status", "epoch_s", "epoch_s_low", "epoch_s_high", "repeats", "speedup",
    "step_median_ms", "step_p10_ms", "step_p90_ms", "samples_per_s", "peak_memory_mib",
    "model_state_mib", "activation_mib", "estimated_peak_mib", "memory_method", "comm_mib_per_step", "final_metric",
    "last_epoch_change", "epochs_to_target", "samples_to_target", "time_to_target_s", "differs_in", "implementation", "note",
]
PLATFORM_COLUMNS = [
    "platform", "nodes", "cpu", "cores_per_node", "gpu", "gpus_per_node", "cpu_memory_gb", "gpu_memory_gb",
    "gpu_fp64_tflops",
]


def _mib(value: float | None) -> float | None:
    return None if value is None else value / 2**20


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1e3


def spread(r: Result) -> dict[str, Any]:
    """Repeats and the interval of the median epoch time (its coverage in the note), step times in ms."""
    interval = r.epoch_interval()
    return {
        "epoch_s_low": interval[0] if interval else None, "epoch_s_high": interval[1] if interval else None,
        "repeats": len(r.repeat_epoch_s) or None,
        **{f"step_{key}_ms": _ms(r.step_time(key)) for key in ("median", "p10", "p90")},
    }


def note(r: Result) -> str:
    """Why a cell has no numbers, or that its times span a stop and a resume."""
    if r.ok:
        notes = [f"resumed from step {r.resumed_from_step}"] if r.resumed_from_step else []
        interval = r.epoch_interval()
        if interval:
            notes.append(f"epoch_s interval: {interval[2]:.0%} coverage; seeds {', '.join(map(str, r.seeds))}")
        return "; ".join(notes)
    return r.error.strip().splitlines()[-1][:120] if r.error else r.status


def result_rows(results: list[Result]) -> list[dict[str, Any]]:
    """One row per cell; speed-up is over the same framework row's smallest GPU count; `differs_in`: the
    effective settings in which a cell trains unlike most cells of its workload and GPU count."""
    base = {}
    for r in sorted(results, key=lambda r: r.cell.gpus):
        if r.ok:
            base.setdefault((r.cell.workload, r.cell.row), r.epoch_time)
    groups = {(r.cell.workload, r.cell.gpus) for r in results}
    common = {g: settings.common([r.settings for r in results if r.ok and (r.cell.workload, r.cell.gpus) == g])
              for g in groups}
    rows = []
    for r in results:
        first = base.get((r.cell.workload, r.cell.row))
        rows.append({
            "workload": r.cell.workload, "framework": r.cell.row, "gpus": r.cell.gpus, "status": r.status,
            "epoch_s": r.epoch_time, **spread(r), "speedup": first / r.epoch_time if r.ok and first else None,
            "samples_per_s": r.mean_throughput, "peak_memory_mib": _mib(r.peak_bytes),
            "model_state_mib": _mib(r.model_state_bytes), "activation_mib": _mib(r.activation_bytes),
            "estimated_peak_mib": _mib(r.estimated_peak_bytes), "memory_method": r.memory_method,
            "comm_mib_per_step": _mib(r.comm_bytes),
            "differs_in": settings.departures(r.settings, common[r.cell.workload, r.cell.gpus]) if r.ok else "",
            "final_metric": r.final_metric, "last_epoch_change": r.last_epoch_change,
            "epochs_to_target": r.epochs_to_target(),
            "samples_to_target": r.samples_to_target(), "time_to_target_s": r.time_to_target(),
            "implementation": settings.implementation(r.settings),
            "note": note(r),
        })
    return rows


def _text(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def markdown(rows: list[dict[str, Any]], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_text(row.get(c)).replace("|", "/") for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def to_csv(rows: list[dict[str, Any]], columns: list[str]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows({c: "" if row.get(c) is None else row.get(c) for c in columns} for row in rows)
    return buffer.getvalue()


def latex(rows: list[dict[str, Any]], columns: list[str]) -> str:
    def escape(text: str) -> str:
        for char in "\\&%$#_{}":
            text = text.replace(char, "\\" + char)
        return text

    lines = [r"\begin{tabular}{" + "l" * len(columns) + "}", r"\hline",
             " & ".join(escape(c) for c in columns) + r" \\", r"\hline"]
    lines += [" & ".join(escape(_text(row.get(c))) for c in columns) + r" \\" for row in rows]
    return "\n".join(lines + [r"\hline", r"\end{tabular}"]) + "\n"


def write_all(folder: Path, stem: str, rows: list[dict[str, Any]], columns: list[str]) -> list[Path]:
    paths = []
    for suffix, render in ((".md", markdown), (".csv", to_csv), (".tex", latex)):
        path = folder / f"{stem}{suffix}"
        path.write_text(render(rows, columns))
        paths.append(path)
    return paths
