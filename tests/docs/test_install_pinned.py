"""A team pinned to Celery 5.4 and Django 4.2 installs the built wheel as it is.

The wheel is built from this work tree and installed with pip into a fresh
virtualenv that already holds Celery 5.4.0, kombu 5.4.2 and Django 4.2: pip
must resolve without upgrading any of them, and the README's Celery
quickstart (the ``celery-quickstart`` scenario of test_snippets.py) must run
with that virtualenv's interpreter, ``celery`` command and packages.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PINS = ["celery[redis]==5.4.0", "kombu==5.4.2", "django==4.2.*"]

pytestmark = [pytest.mark.integration, pytest.mark.celery, pytest.mark.timeout(900)]


def _pip(python: Path, *args: str) -> str:
    done = subprocess.run(
        [str(python), "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, f"pip {' '.join(args)}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _versions(python: Path) -> dict[str, str]:
    frozen = _pip(python, "freeze")
    names = {"celery", "kombu", "django"}
    found = {}
    for line in frozen.splitlines():
        name, _, version = line.partition("==")
        if name.lower() in names:
            found[name.lower()] = version
    return found


def test_the_wheel_installs_beside_celery_5_4_and_django_4_2(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    _pip(Path(sys.executable), "wheel", "-q", "--no-deps", "-w", str(dist), str(ROOT))
    (wheel,) = dist.glob("celery_nats_leader-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    _pip(python, "install", "-q", *PINS)
    before = _versions(python)
    assert before["celery"] == "5.4.0"
    assert before["kombu"] == "5.4.2"
    assert before["django"].startswith("4.2.")

    _pip(python, "install", "-q", f"{wheel}[celery,django]")
    assert _versions(python) == before

    # The README's quickstart, run by that interpreter (the test runner stays here).
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/docs/test_snippets.py::test_scenario[celery-quickstart]",
        ],
        cwd=ROOT,
        env={**os.environ, "CNL_DOCS_PYTHON": str(python)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "1 passed" in done.stdout
