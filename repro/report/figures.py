"""The paper's figures as PNG: scaling, statistical efficiency and memory per GPU."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Callable

from repro.report import settings
from repro.report.collect import METRIC, Result


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _by_workload(results: list[Result]) -> dict[str, dict[str, list[Result]]]:
    grouped: dict[str, dict[str, list[Result]]] = defaultdict(lambda: defaultdict(list))
    for r in results:
        if r.ok:
            grouped[r.cell.workload][r.cell.row].append(r)
    return grouped


def label(result: Result, others: list[Result], keys: tuple[str, ...] = settings.KEYS) -> str:
    """The row's name, with the settings in which it trains unlike most of `others` (the legend's
    way of saying that two lines differ in more than their framework)."""
    differ = settings.departures(result.settings, settings.common([o.settings for o in others]), keys)
    return f"{result.cell.row} ({differ})" if differ else result.cell.row


def _per_gpu_plot(results: list[Result], path: Path, value: Callable[[Result], float | None], ylabel: str,
                  title: str) -> Path | None:
    grouped = _by_workload(results)
    if not grouped:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(grouped), figsize=(6 * len(grouped), 4.5), squeeze=False)
    for ax, (workload, rows) in zip(axes[0], sorted(grouped.items())):
        everyone = [c for cells in rows.values() for c in cells]
        for row, cells in sorted(rows.items()):
            points = sorted((c.cell.gpus, value(c)) for c in cells if value(c))
            if points:
                ax.plot(*zip(*points), marker="o", label=label(cells[0], everyone, settings.TRAINING))
        ax.set(xscale="log", yscale="log", xlabel="GPUs", ylabel=ylabel, title=f"{workload}: {title}")
        ax.set_xticks(sorted({c.cell.gpus for cells in rows.values() for c in cells}))
        ticker = plt.matplotlib.ticker
        ax.xaxis.set_major_formatter(ticker.ScalarFormatter())
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())  # else log axes label 3 as "3 x 10^0"
        ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def epoch_time(results: list[Result], folder: Path) -> Path | None:
    return _per_gpu_plot(results, folder / "epoch_time.png", lambda r: r.epoch_time, "epoch time (s)",
                         "epoch time vs GPUs")


def memory(results: list[Result], folder: Path) -> list[Path]:
    mib = 2**20
    peak = _per_gpu_plot(results, folder / "memory_peak.png", lambda r: r.peak_bytes and r.peak_bytes / mib,
                         "peak memory per GPU (MiB)", "peak memory per GPU")
    state = _per_gpu_plot(results, folder / "memory_model_state.png",
                          lambda r: r.model_state_bytes and r.model_state_bytes / mib,
                          "model state per GPU (MiB)", "parameters + gradients + optimizer state")
    return [p for p in (peak, state) if p]


def communication(results: list[Result], folder: Path) -> Path | None:
    """Payload each GPU hands to communication per step (repro.communication), against GPU count."""
    return _per_gpu_plot(results, folder / "comm_per_step.png", lambda r: r.comm_bytes and r.comm_bytes / 2**20,
                         "communication per step per GPU (MiB)", "payload handed per step")


def statistical_efficiency(results: list[Result], folder: Path) -> list[Path]:
    """Validation metric against training wall-clock and against epochs, at the largest GPU count
    with at least two frameworks (the paper's comparison at a fixed GPU count)."""
    grouped = _by_workload(results)
    if not grouped:
        return []
    plt = _pyplot()
    paths = []
    for name, xlabel, x_of in (("val_vs_time.png", "training time (s)", lambda r: r.elapsed_s),
                               ("val_vs_epoch.png", "epoch", lambda r: list(range(1, len(r.val) + 1)))):
        fig, axes = plt.subplots(1, len(grouped), figsize=(6 * len(grouped), 4.5), squeeze=False)
        for ax, (workload, rows) in zip(axes[0], sorted(grouped.items())):
            cells = [c for cs in rows.values() for c in cs]
            counts = defaultdict(int)
            for c in cells:
                counts[c.cell.gpus] += 1
            gpus = max((g for g, n in counts.items() if n >= 2), default=max(counts))
            shown = sorted((c for c in cells if c.cell.gpus == gpus), key=lambda c: c.cell.row)
            for c in shown:
                ax.plot(x_of(c), c.val, marker="o", label=label(c, shown))
            key, higher = METRIC[workload]
            ax.set(xlabel=xlabel, ylabel=key, title=f"{workload} at {gpus} GPUs ({'higher' if higher else 'lower'} is better)")
            ax.legend(fontsize=8)
            ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(folder / name, dpi=110)
        plt.close(fig)
        paths.append(folder / name)
    return paths


def all_figures(results: list[Result], folder: Path) -> list[Path]:
    found = [epoch_time(results, folder), *memory(results, folder), communication(results, folder),
             *statistical_efficiency(results, folder)]
    return [p for p in found if p]


def convergence_curves(study: dict, path: Path) -> Path | None:
    """The convergence study (repro.convergence, as its JSON): per question, each arm's mean validation
    curve over the seeds against samples seen, with its 95% t band, and the target."""
    from repro.report.statistics import t_interval

    groups: dict[str, list[str]] = defaultdict(list)
    for outcome in study["outcomes"]:
        for name in (outcome["control"], outcome["treatment"]):
            if name in study["arms"] and name not in groups[outcome["group"]]:
                groups[outcome["group"]].append(name)
    if not groups:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4.5), squeeze=False)
    for ax, (group, arms) in zip(axes[0], groups.items()):
        for name in arms:
            arm = study["arms"][name]
            runs = [curve for curve in arm["by_seed"] if curve]
            length = min((len(curve) for curve in runs), default=0)
            if len(runs) < 2 or not length:
                continue
            bands = [t_interval([curve[i] for curve in runs]) for i in range(length)]
            x = arm["samples"][:length]
            line, = ax.plot(x, [b.mean for b in bands], marker="o", markersize=3, label=f"{name} ({len(runs)} seeds)")
            ax.fill_between(x, [b.low for b in bands], [b.high for b in bands], color=line.get_color(), alpha=0.2)
        ax.axhline(study["target"], color="grey", linestyle="--", linewidth=1, label=f"target {study['target']:g}")
        key, higher = METRIC[study["workload"]]
        ax.set(xlabel="training samples", ylabel=key, title=f"{group} ({'higher' if higher else 'lower'} is better)")
        ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
