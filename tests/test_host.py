"""The tests' own needs from the host: a missing Debian program fails a service test in one line naming its package."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from host import package_of

pytestmark = pytest.mark.units

TESTS = Path(__file__).resolve().parent


def test_every_program_the_fixtures_start_is_listed_with_its_package() -> None:
    assert package_of("slurmctld") == "slurm-wlm"
    assert package_of("munged") == "munge"
    assert package_of("initdb") == "postgresql"
    assert package_of("dockerd") == "docker.io"
    with pytest.raises(KeyError):
        package_of("no-such-program")


def test_a_slurm_test_without_slurm_fails_in_one_line_naming_the_package(tmp_path: Path) -> None:
    """As on a machine without slurm-wlm: the cluster fixture finds none of Debian's programs."""
    env = {**os.environ, "REPRO_TEST_PROGRAMS_PATH": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(TESTS.parent),
         str(TESTS / "test_slurm_cluster.py"), "-k", "test_a_two_node_job_finishes_recorded_once"],
        capture_output=True, text=True, env=env, cwd=TESTS.parent, timeout=300,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    wanted = "needs slurmctld: install Debian's slurm-wlm (`make test-deps`, or apt-get install slurm-wlm)"
    lines = [line for line in out.stdout.splitlines() if wanted in line]
    assert lines, out.stdout
    assert "1 error" in out.stdout.splitlines()[-1]
