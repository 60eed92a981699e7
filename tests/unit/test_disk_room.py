"""`make test` and `make demo` check the disk first: a venv still to build and the runs' own
files must fit, or make stops naming the shortfall (the Makefile's disk_room)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def room(target: str, **variables: object) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    args = [f"{name}={value}" for name, value in variables.items()]
    return subprocess.run(["make", "-s", "-C", str(ROOT), target, *args], env=env,
                          capture_output=True, text=True, timeout=60)


def free_mb() -> int:
    return shutil.disk_usage(ROOT).free >> 20


@pytest.fixture()
def built(tmp_path) -> Path:
    """A venv dir with its stamp: built, as far as the Makefile can tell."""
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".raykv-installed").touch()
    return venv


def test_a_venv_still_to_build_counts_and_a_built_one_does_not(tmp_path, built):
    # Margins of a quarter of the disk's free space: other runs write while this one checks.
    half, quarter = free_mb() // 2, free_mb() // 4
    missing = tmp_path / "no-venv"
    # The scratch and a venv to build each fit alone; together they do not.
    short = room("disk-room-demo", VENV=missing, VENV_MB=3 * quarter, SCRATCH_MB=half)
    assert short.returncode != 0
    assert f"{missing} ({3 * quarter} MB)" in short.stderr
    assert "Free some, then run make again" in short.stderr
    assert room("disk-room-demo", VENV=built, VENV_MB=3 * quarter,
                SCRATCH_MB=half).returncode == 0


def test_make_test_counts_both_venvs(tmp_path, built):
    third = free_mb() // 3  # a venv to build and the scratch: 1.33 times the free space
    missing = tmp_path / "no-vllm-venv"
    short = room("disk-room-test", VENV=built, VLLM_VENV=missing,
                 VLLM_VENV_MB=3 * third, SCRATCH_MB=third, VENV_MB=10 * third)
    assert short.returncode != 0
    assert "no-vllm-venv" in short.stderr and str(built) not in short.stderr
    assert room("disk-room-test", VENV=built, VLLM_VENV=built, VENV_MB=10 * third,
                VLLM_VENV_MB=10 * third, SCRATCH_MB=third).returncode == 0


def test_make_test_and_make_demo_check_the_disk_before_building():
    """The checks run before the venvs' stamps (make takes prerequisites in order)."""
    text = (ROOT / "Makefile").read_text()
    assert "\ntest: system-deps disk-room-test $(STAMP)" in text
    assert "\ndemo: system-deps disk-room-demo $(STAMP)" in text
