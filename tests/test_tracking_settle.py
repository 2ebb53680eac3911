"""repro.slurm.job_state where squeue is absent: nobody can tell whether the job is gone, so it raises."""
from __future__ import annotations

import pytest

from repro import slurm

pytestmark = pytest.mark.units


def test_job_state_without_squeue_raises(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no squeue
    with pytest.raises(slurm.SlurmUnreachable, match="squeue not found"):
        slurm.job_state("42")

