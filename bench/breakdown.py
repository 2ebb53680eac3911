"""Where a matrix's wall time goes, cell by cell, from what its runs recorded (nothing is rerun).

For each run folder: start-up (the runner creates the folder; the reporting rank's start event comes
after process start, imports, process-group and framework initialisation and model setup), the
timed training steps (the epochs' epoch_s), the work between epochs (validation, memory gathering,
checkpoints: epoch events' wall clocks minus epoch_s) and the end (last event to the last file the
run's processes wrote: teardown and process exit).

    python bench/breakdown.py RUNS_DIR [--json OUT]
"""
from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone
from pathlib import Path

PHASES = ("startup_s", "train_s", "between_epochs_s", "end_s")


def created(run_dir: Path) -> float:
    """The run folder's creation time, from its name (…-YYYYMMDDTHHMMSSffffff, UTC)."""
    stamp = run_dir.name.rsplit("-", 1)[-1]
    return datetime.strptime(stamp, "%Y%m%dT%H%M%S%f").replace(tzinfo=timezone.utc).timestamp()


def cell_breakdown(run_dir: Path) -> dict[str, float] | None:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return None
    events = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    starts = [e for e in events if e["event"] == "start"]
    epochs = [e for e in events if e["event"] == "epoch"]
    ends = [e for e in events if e["event"] == "end"]
    if not (starts and epochs and ends):
        return None
    begun, first = created(run_dir), starts[0]["wall"]
    train = sum(e["epoch_s"] for e in epochs)
    closed = max(f.stat().st_mtime for f in run_dir.rglob("*") if f.is_file())
    return {
        "startup_s": first - begun, "train_s": train,
        "between_epochs_s": ends[0]["wall"] - first - train, "end_s": closed - ends[0]["wall"],
        "total_s": closed - begun,
    }


def matrix_breakdown(runs: Path) -> dict[str, dict]:
    """Each cell's phases (by run folder name) and their totals over the matrix."""
    cells: dict[str, dict[str, float]] = {}
    for run_dir in sorted(runs.iterdir()):
        if found := cell_breakdown(run_dir):
            name = run_dir.name.split("-smoke")[0]  # rows of one framework share it (megatron-data, -intra)
            cells[name if name not in cells else f"{name} #{sum(k.startswith(name) for k in cells) + 1}"] = found
    return {"cells": cells, "totals": {p: sum(b[p] for b in cells.values()) for p in (*PHASES, "total_s")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    found = matrix_breakdown(args.runs)
    cells, totals = found["cells"], found["totals"]
    print(f"{'cell':<28}" + "".join(f"{p:>18}" for p in (*PHASES, "total_s")))
    for name, b in cells.items():
        print(f"{name:<28}" + "".join(f"{b[p]:>18.1f}" for p in (*PHASES, "total_s")))
    print(f"{'all ' + str(len(cells)) + ' cells':<28}" + "".join(f"{totals[p]:>18.1f}" for p in (*PHASES, "total_s")))
    if args.json:
        args.json.write_text(json.dumps(found, indent=2))


if __name__ == "__main__":
    main()
