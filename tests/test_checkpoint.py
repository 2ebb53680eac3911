"""Checkpoint folders and the data position: the pieces that make a resume continue exactly."""
from __future__ import annotations

import pytest
import torch

from repro import checkpoint
from repro.batches import GlobalBatches
from repro.runfiles import Position, RunFolder

pytestmark = pytest.mark.units


def save(folder, value: float) -> None:
    folder.mkdir(parents=True)
    checkpoint.atomic_torch_save({"w": torch.full((2,), value)}, folder / "adapter.pt")


def test_a_folder_counts_only_once_published(tmp_path):
    run = RunFolder(tmp_path)
    assert run.latest_checkpoint() is None
    first, second = run.checkpoint_folder(8), run.checkpoint_folder(16)
    save(first, 1.0)
    run.publish_checkpoint(first, Position(epoch=1, step=8))
    save(second, 2.0)  # written, but not published: a crash here leaves the first one current
    assert run.latest_checkpoint() == (first, Position(epoch=1, step=8))
    run.publish_checkpoint(second, Position(epoch=2, step=16))
    assert run.latest_checkpoint() == (second, Position(epoch=2, step=16))
    assert not first.exists()
    assert sorted(p.name for p in second.iterdir()) == ["adapter.pt"]  # no temporary file left behind


def test_skipping_batches_resumes_the_same_epoch_order():
    whole = list(GlobalBatches(64, 8, (1, 2), seed=5, epoch=3))
    rest = GlobalBatches(64, 8, (1, 2), seed=5, epoch=3, skip=3)
    assert len(rest) == 5 and list(rest) == whole[3:]


def test_rng_states_round_trip():
    state = checkpoint.rng_state()
    drawn = torch.rand(3), torch.randn(2)
    checkpoint.restore_rng(state)
    assert all(torch.equal(a, b) for a, b in zip(drawn, (torch.rand(3), torch.randn(2))))
