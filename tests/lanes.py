"""The suite in parallel lanes: pytest-xdist's workers (`make test` runs `-n 2 --dist loadgroup`).

A fixture wider than one test (a Slurm cluster, the MLflow server, a module's shared runs) is made once
per pytest process. So that it is made once per session, every test that uses it runs in one worker:
`group_by_shared_fixtures` marks them with one `xdist_group`, and `group_scheduling` sends each group to
a single worker. Tests that share nothing go to whichever worker is free. The reference store shares
itself across the workers through a folder (tests/references.py), so its tests stay free.

Why a scheduler of our own: pytest-xdist 3.8's loadgroup tells the controller a test's group by
appending it to the item's `_nodeid` (xdist/remote.py, pytest_collection_modifyitems), which pytest 9
no longer reads (a node's id is `_id`, a NodeId: _pytest/nodes.py), so every test went to any worker.
Here each worker writes its groups to the session's folder as it collects, and the controller's
scheduler (xdist's LoadScopeScheduling: groups with the most tests first) reads them.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Callable

import pytest

TESTS = Path(__file__).resolve().parent
SHARED_BY_ITSELF = {"references"}  # session fixtures that share their work across processes on their own
WIDER_THAN_A_TEST = {"session", "package", "module", "class"}


def worker(config: pytest.Config) -> str | None:
    """The pytest-xdist worker ("gw0", ...) that `config` is of; None outside xdist or in its controller.
    (Not $PYTEST_XDIST_WORKER: a pytest that a test starts inherits it.)"""
    return getattr(config, "workerinput", {}).get("workerid")


def session_base(config: pytest.Config, basetemp: Path) -> Path:
    """The base temp of the session, given this process's (pytest-xdist gives a worker one inside it)."""
    return basetemp.parent if worker(config) else basetemp


def session_folder(config: pytest.Config, tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A folder that every pytest process of the session shares."""
    folder = session_base(config, tmp_path_factory.getbasetemp()) / name
    folder.mkdir(exist_ok=True)
    return folder


DONE = ".done"  # in a folder that `once` made, once its maker returned


def once(folder: Path, make: Callable[[Path], object]) -> Path:
    """`folder`, filled by `make(folder)` unless a process of the session made it already: the first to come
    makes it under a lock on it, the others wait and then find it done (a maker that raised left nothing
    done, so the next one tries again). `folder` is in a session_folder."""
    with open(folder.parent / f"{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released as the file closes, or as its process dies
        if not (folder / DONE).exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            make(folder)
            (folder / DONE).touch()
    return folder


def defined_here(fixturedef: pytest.FixtureDef) -> bool:
    module = sys.modules.get(fixturedef.func.__module__)
    return bool(module and getattr(module, "__file__", None) and Path(module.__file__).resolve().parent == TESTS)


def shared_fixtures(item: pytest.Item) -> set[str]:
    """What `item` shares with other tests: a session fixture by its name, a module's fixtures by module."""
    keys = set()
    for name, fixturedefs in item._fixtureinfo.name2fixturedefs.items():
        fixturedef = fixturedefs[-1]  # the one this test gets (the closest override)
        if name in SHARED_BY_ITSELF or fixturedef.scope not in WIDER_THAN_A_TEST or not defined_here(fixturedef):
            continue
        keys.add(name if fixturedef.scope == "session" else item.path.name)
    return keys


def group_by_shared_fixtures(items: list[pytest.Item]) -> None:
    """Mark tests that share a fixture, directly or through another test, with one xdist_group."""
    parent: dict[str, str] = {}

    def root(key: str) -> str:
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    shared = {item.nodeid: shared_fixtures(item) for item in items}
    for keys in shared.values():
        first, *others = sorted(keys) or [None]
        for key in others:
            parent[root(key)] = root(first)
    for item in items:
        if keys := shared[item.nodeid]:
            item.add_marker(pytest.mark.xdist_group(root(min(keys))))


GROUPS_FILE = "lanes-groups"  # in the session's base temp, one per worker: {nodeid: group}


def publish_groups(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a worker: write the groups of its tests where the controller's scheduler reads them."""
    if not (name := worker(config)):
        return
    folder = session_base(config, Path(config.option.basetemp))  # xdist sets a worker's (remote.py)
    groups = {item.nodeid: mark.args[0] for item in items if (mark := item.get_closest_marker("xdist_group"))}
    path = folder / f"{GROUPS_FILE}-{name}.json"
    path.with_suffix(".tmp").write_text(json.dumps(groups))
    os.replace(path.with_suffix(".tmp"), path)  # whole or absent, never half written


def group_scheduling(config: pytest.Config, log: object):
    """xdist's loadgroup, with each test's group read from the files of publish_groups (xdist is imported
    here only: a plain `pytest` without it still runs the suite in one lane)."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def __init__(self) -> None:
            super().__init__(config, log)
            self.folder = config._tmp_path_factory.getbasetemp()  # the session's, as xdist gives its workers
            self.groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # called once every worker has collected, so every file is there
                self.groups = {}
                for path in sorted(self.folder.glob(f"{GROUPS_FILE}-*.json")):
                    self.groups.update(json.loads(path.read_text()))
            return self.groups.get(nodeid, nodeid)

    return GroupScheduling()
