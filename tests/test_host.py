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


# Each service test module, and the Debian packages that a machine with none of its programs must install
SERVICES = {
    "test_slurm_cluster.py": "slurm-wlm munge",
    "test_tracking_server.py": "postgresql",
    "test_tracking_ui.py": "postgresql chromium",
    "test_image.py": "docker.io docker-registry mmdebstrap docker-compose binutils",
    "test_containers.py::test_compose_file_is_accepted_and_wires_the_services": "docker-compose",
}


def test_a_service_test_without_its_programs_fails_in_one_line_naming_the_packages(tmp_path: Path) -> None:
    """As on a machine without slurm-wlm, postgresql, chromium or docker.io: every service test fails
    before it starts anything, in one line that names what to install; none is skipped."""
    env = {**os.environ, "REPRO_TEST_PROGRAMS_PATH": str(tmp_path), "COLUMNS": "1000"}  # no cut summary lines
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "--rootdir", str(TESTS.parent),
         "-m", "services", *(str(TESTS / m) for m in SERVICES)],
        capture_output=True, text=True, env=env, cwd=TESTS.parent, timeout=300,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    results = [line for line in out.stdout.splitlines() if line.startswith(("PASSED", "FAILED", "ERROR", "SKIPPED"))]
    for module, packages in SERVICES.items():
        mine = [line for line in results if f"tests/{module.partition('::')[0]}::" in line]
        assert mine, (module, out.stdout[-3000:])
        for line in mine:
            assert line.startswith("ERROR") and line.endswith(
                f"install Debian's {packages} (`make test-deps`, or apt-get install {packages})"), line
    summary = out.stdout.splitlines()[-1]
    assert f"{len(results)} error" in summary and "skipped" not in summary and "passed" not in summary, summary
