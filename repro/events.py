"""Structured run events: one JSON object per line, written by the reporting rank.

This file is the single source of truth for a run: the tracker, the progress display, the
tables and the checks all read these events, never console text. Keys are defined once here.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

EVENTS_FILE = "events.jsonl"

# event kinds
START = "start"
STEP = "step"
EPOCH = "epoch"
MEMORY = "memory"
END = "end"
CHECKPOINT = "checkpoint"  # a complete checkpoint was made current
INTERRUPTED = "interrupted"  # a stop signal: every rank saved and stopped (no_checkpoint: why it could not save)
RESUME = "resume"  # training continues from a checkpoint

# metric keys, as they appear in MLflow
TRAIN_LOSS = "train/loss"
VAL_ACCURACY = "val/accuracy"
VAL_PERPLEXITY = "val/perplexity"
VAL_LOSS = "val/loss"
EPOCH_TIME = "time/epoch_s"
ELAPSED = "time/elapsed_s"
THROUGHPUT = "throughput/samples_per_s"
STEP_TIME = "time/step_{}_s"  # {} is median, p10, p90 or mean of the epoch's step times (warm-up left out)
STEP_COUNT = "time/step_count"  # steps the step-time figures summarise
HARNESS_TIME = "time/harness_us"  # the loop's own host time between the frameworks' steps, mean per step
COUNTERS_TIME = "time/counters_us"  # the kit's counters inside the first steps, mean per step of the epoch
PEAK_MEMORY = "memory/peak_bytes"
MODEL_STATE = "memory/model_state_bytes"
ACTIVATION_PEAK = "memory/activation_peak_bytes"  # tensors saved for backward (repro.activation)
ESTIMATED_PEAK = "memory/estimated_peak_bytes"  # model state + activation peak: a GPU's peak, estimated on CPU
COMM_BYTES = "comm/bytes_per_step"  # payload a rank hands to its process groups in one step (repro.communication), busiest rank
MODEL_CHECK = "model/{}_{}"  # {quantity}_{bytes|error}: the cost model's figure for a run, and its relative error
COMM_KIND_BYTES = "comm/{}_bytes_per_step"  # {} is an operation kind (all_reduce, send, boundary:activation, ...)


class EventWriter:
    """Appends events to a file, flushing each line so a crash loses nothing written."""

    def __init__(self, path: Path):
        self.path = path
        self._file = open(path, "a", buffering=1)

    def emit(self, kind: str, **fields: Any) -> None:
        self._file.write(json.dumps({"event": kind, "wall": time.time(), **fields}, sort_keys=True) + "\n")

    def emit_all(self, kind: str, rows: Iterable[dict[str, Any]]) -> None:
        """Events of one kind written at once (a window's step events: one write, not one a line)."""
        wall = time.time()
        self._file.write("".join(json.dumps({"event": kind, "wall": wall, **fields}, sort_keys=True) + "\n"
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
