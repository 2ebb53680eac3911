"""The suite's tiers, named by what their tests need (pytest markers, registered in pyproject.toml).

Every test is in exactly one tier: conftest.py refuses to run a suite holding a test in none or in
two. `make test-fast` runs the units, and the units guard (tests/guard/sitecustomize.py) fails a
units test that starts a process group or launches ranks, in pytest's process or in any it starts.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

TIERS = ("units", "ranks", "end_to_end", "services")
GUARD_FOLDER = Path(__file__).with_name("guard")


def load_guard():
    """tests/guard/sitecustomize.py as a module of its own name (in this process it must not act on import)."""
    spec = importlib.util.spec_from_file_location("units_guard", GUARD_FOLDER / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GUARD = load_guard()
sys.addaudithook(GUARD.on_event)  # a no-op while no units test runs


def tiers_of(item: pytest.Item) -> list[str]:
    return [tier for tier in TIERS if item.get_closest_marker(tier)]


def check_every_test_has_one_tier(items: list[pytest.Item]) -> None:
    wrong = [f"  {item.nodeid}: {', '.join(tiers) or 'no tier'}" for item in items if len(tiers := tiers_of(item)) != 1]
    if wrong:
        raise pytest.UsageError(
            f"every test needs exactly one tier marker ({', '.join(TIERS)}; see tests/tiers.py), but\n" + "\n".join(wrong))


def guard_units(marks: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """For a units test: refuse process groups and rank launches here and in every process it starts."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    monkeypatch.setenv(GUARD.VARIABLE, str(marks))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(GUARD_FOLDER), os.environ.get("PYTHONPATH")])))
    monkeypatch.setattr(dist, "init_process_group", GUARD.refusing_init)
    monkeypatch.setattr(c10d, "init_process_group", GUARD.refusing_init)


def refused(marks: Path) -> str:
    return marks.read_text() if marks.exists() else ""
