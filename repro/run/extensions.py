"""The C++ extensions that CPU stand-in ranks load (a plan's `cpu_extension`): installed prebuilt, or built
by the first run that needs it, which needs a compiler and Python's headers; or built now, once for this
Python environment (`repro doctor --build-ops`, which `make setup` runs), so that no run pays the build."""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Callable

from repro import registry
from repro.run.options import LaunchError


def installed_prebuilt(extension: str) -> bool:
    """Whether the compiled module `extension` (dotted) is installed, found without importing its packages."""
    top, *inner = extension.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return False
    return any(Path(spec.submodule_search_locations[0], *inner[:-1]).glob(f"{inner[-1]}*.so"))


def check_extension_build(framework: str) -> None:
    """This machine can build a C++ extension for this Python, as torch's builder does (a compiler and
    Python.h: torch/utils/cpp_extension.py)."""
    needs = {"g++": shutil.which("c++") is not None,
             "python3-dev": Path(sysconfig.get_paths()["include"], "Python.h").exists()}
    missing = [package for package, present in needs.items() if not present]
    if missing:
        raise LaunchError(f"run.framework: {framework} on CPU stand-ins builds a C++ extension as it starts, and "
                          f"this machine lacks a compiler or Python's headers: apt-get install {' '.join(missing)}")


def build_cpu_extensions(echo: Callable[[str], None]) -> None:
    """Build every available framework's CPU extension that is neither prebuilt nor built here yet, each in a
    process of its own as a rank would (its plan's `cpu_extension_builder`); where this machine cannot build
    one, say why and go on: the first run that needs it is refused with the same line."""
    for name, entry in registry.FRAMEWORKS.items():
        if entry.missing():
            continue
        plan = registry.plan_class(name)
        if not plan.cpu_extension_builder:
            continue
        if installed_prebuilt(plan.cpu_extension):
            echo(f"{name}: {plan.cpu_extension} is installed prebuilt")
            continue
        try:
            check_extension_build(name)
        except LaunchError as error:
            echo(f"{name}: {plan.cpu_extension} not built: {error}")
            continue
        module, function = plan.cpu_extension_builder.split(":")
        started = time.monotonic()
        out = subprocess.run([sys.executable, "-c", f"import {module}; {module}.{function}()"],
                             capture_output=True, text=True)
        if out.returncode:
            raise LaunchError(f"{name}: building {plan.cpu_extension} failed:\n{(out.stdout + out.stderr)[-3000:]}")
        echo(f"{name}: {plan.cpu_extension} ready for this environment ({time.monotonic() - started:.0f} s)")
