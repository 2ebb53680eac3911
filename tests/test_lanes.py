"""The lanes (tests/lanes.py): tests that share a fixture wider than a test share one pytest-xdist worker."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

import lanes

pytestmark = pytest.mark.units


def made_here() -> None:
    """Stands for a fixture function of this suite."""


def fixture(scope: str, func=made_here) -> list[SimpleNamespace]:
    return [SimpleNamespace(scope=scope, func=func)]


def item(path: str, **fixtures: list[SimpleNamespace]) -> SimpleNamespace:
    made = SimpleNamespace(path=Path(path), nodeid=f"{path}::{len(fixtures)}-{'-'.join(fixtures)}", marks=[],
                           _fixtureinfo=SimpleNamespace(name2fixturedefs=fixtures))
    made.add_marker = made.marks.append
    return made


def groups(*items: SimpleNamespace) -> list[str | None]:
    lanes.group_by_shared_fixtures(list(items))
    return [made.marks[0].args[0] if made.marks else None for made in items]


def test_a_module_fixture_pins_its_module_and_a_session_daemon_every_test_using_it() -> None:
    found = groups(
        item("test_a.py", shared_repro=fixture("module"), tmp_path=fixture("function")),
        item("test_a.py", shared_repro=fixture("module")),
        item("test_a.py", tmp_path=fixture("function")),  # shares nothing: free
        item("test_b.py", slurm=fixture("module")),
        item("test_c.py", tracking_server=fixture("session")),
        item("test_d.py", tracking_server=fixture("session")),
    )
    assert found == ["test_a.py", "test_a.py", None, "test_b.py", "tracking_server", "tracking_server"]


def test_groups_joined_by_one_test_become_one() -> None:
    """test_e's module fixture and the server: one test needs both, so every test of either is in one lane."""
    found = groups(
        item("test_e.py", ui=fixture("module")),
        item("test_f.py", tracking_server=fixture("session")),
        item("test_e.py", ui=fixture("module"), tracking_server=fixture("session")),
    )
    assert found[0] == found[1] == found[2] is not None


def test_the_reference_store_and_pytests_own_fixtures_leave_a_test_free() -> None:
    found = groups(item("test_g.py", references=fixture("session"), tmp_path_factory=fixture("session", pytest.fail)))
    assert found == [None]


def test_a_worker_shares_the_base_temp_of_its_session() -> None:
    alone, in_a_worker = SimpleNamespace(), SimpleNamespace(workerinput={"workerid": "gw1"})  # as xdist sets it
    assert lanes.worker(alone) is None and lanes.worker(in_a_worker) == "gw1"
    assert lanes.session_base(alone, Path("/tmp/pytest-of-me/pytest-7")) == Path("/tmp/pytest-of-me/pytest-7")
    # xdist's worker base temp: the session's, plus the worker's name
    assert lanes.session_base(in_a_worker, Path("/tmp/pytest-of-me/pytest-7/gw1")) == Path("/tmp/pytest-of-me/pytest-7")


def test_once_makes_a_folder_once_and_again_after_a_maker_that_failed(tmp_path: Path) -> None:
    made: list[Path] = []

    def fail(folder: Path) -> None:
        (folder / "half").touch()
        raise RuntimeError("ranks failed")

    with pytest.raises(RuntimeError, match="ranks failed"):
        lanes.once(tmp_path / "run", fail)
    assert lanes.once(tmp_path / "run", made.append) == tmp_path / "run"
    assert lanes.once(tmp_path / "run", made.append) == tmp_path / "run"
    assert made == [tmp_path / "run"] and not (tmp_path / "run" / "half").exists()
