"""The units tier's guard: a units test starts no process group and launches no ranks.

tests/tiers.py sets $REPRO_TEST_UNITS_GUARD (a file) for each units test and puts this folder on
PYTHONPATH, so that every Python process the test starts loads this module; pytest's own process
uses its functions too. A guarded process refuses `torch.distributed.init_process_group` and any
launch of ranks, and writes what it refused to that file: the test's fixture reads it afterwards, so
the refusal fails the test even where the process that met it swallowed the error.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

VARIABLE = "REPRO_TEST_UNITS_GUARD"
C10D = "torch.distributed.distributed_c10d"
LAUNCHERS = ("torch.distributed.run", "torchrun", "repro.loop")  # what starts ranks, as a command names it


def refuse(what: str) -> None:
    with open(os.environ[VARIABLE], "a") as out:
        out.write(f"{what} (pid {os.getpid()})\n")
    raise RuntimeError(f"units tier: this test must start no process group, but {what}")


def refusing_init(*args: object, **kwargs: object) -> None:
    refuse("torch.distributed.init_process_group was called")


def on_event(event: str, args: tuple) -> None:
    """An audit hook: refuses a subprocess that launches ranks while the guard is on."""
    if event == "subprocess.Popen" and os.environ.get(VARIABLE):
        argv = args[1] if isinstance(args[1], (list, tuple)) else str(args[1]).split()
        if any(str(arg).endswith(LAUNCHERS) for arg in argv):
            refuse(f"it launched ranks: {' '.join(map(str, argv))}")


class PatchC10d(importlib.abc.MetaPathFinder):
    """Replaces init_process_group as c10d is imported, before torch.distributed re-exports it."""

    def find_spec(self, name: str, path: object, target: object = None):
        if name != C10D:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module: object) -> None:
            load(module)
            module.init_process_group = refusing_init

        spec.loader.exec_module = exec_module
        return spec


if __name__ == "sitecustomize" and os.environ.get(VARIABLE):
    sys.addaudithook(on_event)
    sys.meta_path.insert(0, PatchC10d())
