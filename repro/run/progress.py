"""The terminal's view of a run: one line per epoch, and a step counter that rewrites itself on a terminal."""
from __future__ import annotations

from typing import TextIO

from repro import events


class Progress:
    def __init__(self, out: TextIO):
        self.out, self.total, self.epochs = out, None, None
        self.tty = out.isatty()

    def show(self, event: dict) -> None:
        kind = event["event"]
        if kind == events.START:
            per_epoch = event["steps_per_epoch"]
            self.epochs = event["epochs"]
            self.total = min(per_epoch * self.epochs, event["max_steps"] or per_epoch * self.epochs)
        elif kind == events.STEP and self.tty:
            self.out.write(f"\r  step {event['step']}/{self.total}  loss {event['loss']:.4f}   ")
            self.out.flush()
        elif kind == events.EPOCH:
            val = "  ".join(f"{k} {v:.4g}" for k, v in event["val"].items())
            lead = "\r" if self.tty else ""
            self.out.write(
                f"{lead}epoch {event['epoch'] + 1}/{self.epochs}  step {event['step']}/{self.total}  "
                f"{event['epoch_s']:.1f}s  {event['samples_per_s']:.1f} samples/s  {val}\n"
            )
            self.out.flush()
