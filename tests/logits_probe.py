"""One rank of a training job, as `python -m repro.loop RUN_DIR` runs it, that also keeps logits.

The loop records losses only; to compare frameworks logit for logit, this runs the same Trainer
and saves the full-vocabulary logits of a fixed validation batch before and after training to
RUN_DIR/logits.pt (reporting rank), and each rank's trained weights to RUN_DIR/state-RANK.pt.
Started by tests in the ranks tier (tests/ranks.py), or by torchrun: `python tests/logits_probe.py RUN_DIR`.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from repro.loop import Trainer
from repro.recipe import resolve
from repro.runfiles import RUN_FILE

PROBE_SAMPLES = 4


def main(run_dir: str | Path) -> None:
    run_dir = Path(run_dir)
    spec = json.loads((run_dir / RUN_FILE).read_text())
    recipe = resolve(spec["recipe"], spec["recipe"]["source"])
    trainer = Trainer(recipe, run_dir, Path(spec["data_dir"]))
    clean = False
    try:
        tokens = torch.stack([trainer.val_set[i][0] for i in range(PROBE_SAMPLES)]).to(trainer.device)
        with torch.no_grad():
            before = trainer.adapter.forward(tokens)
        trainer.run()
        with torch.no_grad():
            after = trainer.adapter.forward(tokens)
        torch.save(trainer.adapter.model.state_dict(), run_dir / f"state-{trainer.ctx.rank}.pt")
        if trainer.reporting:
            torch.save({"before": before.cpu(), "after": after.cpu()}, run_dir / "logits.pt")
        clean = True
    finally:
        trainer.close(clean)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
