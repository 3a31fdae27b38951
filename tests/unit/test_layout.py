"""The layout's promises, checked on the source: who may import what.

* ``celery_nats_leader.nats`` is the only code that imports nats-py (the
  test helpers under ``testing/`` too go through it);
* the core (everything but the Celery wiring ``worker/``, ``beat/``,
  ``cli.py`` and the test helpers ``testing/``) imports neither Celery,
  kombu nor Django, and imports in a fresh interpreter where those cannot
  be imported at all;
* the installed package ships test helpers for users, not this project's
  chaos harness: nothing in it imports the Django app, the test suite or a
  database or Redis client, and the pytest plugin loads without Celery and
  Django.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import celery_nats_leader
import django_nats_leader

PACKAGE = Path(celery_nats_leader.__file__).resolve().parent
DJANGO_APP = Path(django_nats_leader.__file__).resolve().parent

#: Subpackages and modules that are not the core (they wire Celery, or help tests).
NOT_CORE = ("worker", "beat", "testing", "cli.py")

#: Where nats-py may be imported.
NATS_ALLOWED = ("nats",)

INTEGRATIONS = ("celery", "kombu", "django")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def core_files() -> list[Path]:
    return [p for p in package_files() if p.relative_to(PACKAGE).parts[0] not in NOT_CORE]


def imported_top_levels(path: Path) -> Iterator[tuple[int, str]]:
    """``(line, top-level package)`` of every absolute import, module level or not."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name.partition(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module.partition(".")[0]


def test_the_scan_sees_every_kind_of_import() -> None:
    # The checks below would pass vacuously if the scan missed imports.
    nats_files = [
        p for p in package_files() if "nats" in {top for _, top in imported_top_levels(p)}
    ]
    assert PACKAGE / "nats" / "connection.py" in nats_files
    assert PACKAGE / "nats" / "jetstream.py" in nats_files
    celery_files = {
        p.relative_to(PACKAGE).as_posix()
        for p in package_files()
        if "celery" in {top for _, top in imported_top_levels(p)}
    }
    assert {"worker/tasks.py", "beat/scheduler.py"} <= celery_files
    assert len(core_files()) >= 25


def test_only_the_nats_package_imports_nats_py() -> None:
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path in [*package_files(), *sorted(DJANGO_APP.rglob("*.py"))]
        if path.is_relative_to(DJANGO_APP) or path.relative_to(PACKAGE).parts[0] not in NATS_ALLOWED
        for line, top in imported_top_levels(path)
        if top == "nats"
    ]
    assert offenders == [], "nats-py imported outside celery_nats_leader/nats/"


def test_the_core_imports_no_integration() -> None:
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {top}"
        for path in core_files()
        for line, top in imported_top_levels(path)
        if top in INTEGRATIONS
    ]
    assert offenders == []


BLOCKER = """
import importlib.abc
import sys

BLOCKED = {blocked!r}


class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is blocked in this test")
        return None


sys.meta_path.insert(0, Blocker())
for name in {modules!r}:
    __import__(name)
loaded = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)
assert not loaded, loaded
print(len({modules!r}))
"""


@pytest.fixture(scope="module")
def core_modules() -> list[str]:
    return [module_name(path) for path in core_files()]


def test_every_core_module_imports_without_celery_and_django(core_modules: list[str]) -> None:
    script = BLOCKER.format(blocked=list(INTEGRATIONS), modules=core_modules)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == len(core_modules)


def test_the_blocker_blocks() -> None:
    # The import test would prove nothing if a blocked import could succeed.
    script = BLOCKER.format(blocked=["celery"], modules=["celery_nats_leader.worker.tasks"])
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode != 0
    assert "celery is blocked in this test" in result.stderr


#: What the shipped package never imports: the Django app (its own
#: extra) and this repository's tests.
NEVER_IMPORTED = ("django_nats_leader", "tests")

#: What the shipped test helpers do not need: databases and Redis.
SERVICE_CLIENTS = ("psycopg2", "redis", "django")


def test_the_package_ships_no_chaos_harness() -> None:
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {top}"
        for path in package_files()
        for line, top in imported_top_levels(path)
        if top in NEVER_IMPORTED
        or (path.relative_to(PACKAGE).parts[0] == "testing" and top in SERVICE_CLIENTS)
    ]
    assert offenders == []
    testing = {p.name for p in (PACKAGE / "testing").glob("*.py")}
    assert not testing & {"soak.py", "soak_child.py", "checker.py", "netns.py", "services.py"}


def test_the_pytest_plugin_loads_without_celery_and_django() -> None:
    # Registered for every pytest run of every user who installs the package:
    # loading it must cost nothing and need no extra.
    script = BLOCKER.format(
        blocked=list(INTEGRATIONS), modules=["celery_nats_leader.testing.pytest_plugin"]
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
