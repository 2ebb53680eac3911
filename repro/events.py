"""Structured run events: one JSON object per line, written by the reporting rank.

This file is the single source of truth for a run: the tracker, the progress display, the
tables and the checks all read these events, never console text. Event kinds are defined once here;
the metric keys they become in MLflow are in repro.names.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

# event kinds
START = "start"
STEP = "step"
EPOCH = "epoch"
MEMORY = "memory"
END = "end"
CHECKPOINT = "checkpoint"  # a complete checkpoint was made current
INTERRUPTED = "interrupted"  # a stop signal: every rank saved and stopped (no_checkpoint: why it could not save)
RESUME = "resume"  # training continues from a checkpoint


class EventWriter:
    """Appends events to a file, flushing each line so a crash loses nothing written."""

    def __init__(self, path: Path):
        self.path = path
        self._file = open(path, "a", buffering=1)

    def emit(self, kind: str, **fields: Any) -> None:
        self._file.write(json.dumps({"event": kind, "wall": time.time(), **fields}, sort_keys=True) + "\n")

    def emit_all(self, kind: str, rows: Iterable[dict[str, Any]]) -> None:
        """Events of one kind written at once (a window's step events: one write, not one a line), each
        stamped with its own `wall` where the row carries one (when its step ended), else with now."""
        now = time.time()
        self._file.write("".join(json.dumps({"event": kind, "wall": now, **fields}, sort_keys=True) + "\n"
                                 for fields in rows))

    def close(self) -> None:
        self._file.close()


class EventReader:
    """Reads the events appended since the last call (a complete line at a time), from byte `offset` on."""

    def __init__(self, path: Path, offset: int = 0):
        self.path = path
        self.offset = offset  # the end of the last complete line read

    def new(self) -> Iterator[dict[str, Any]]:
        if not self.path.exists():
            return
        with open(self.path) as f:
            f.seek(self.offset)
            while True:
                line = f.readline()
                if not line.endswith("\n"):
                    break
                self.offset = f.tell()
                yield json.loads(line)


def read_all(path: Path) -> list[dict[str, Any]]:
    return list(EventReader(path).new())
