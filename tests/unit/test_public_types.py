"""What a user's type checker sees of the package's public names.

The Celery-side names (``leader_only``, ``install``, ``run_once``, ...) are
imported lazily at run time so that the core never imports Celery; a type
checker must still see their real signatures, not ``Any``. These tests run
``mypy --strict`` on a small user module, as a user's CI would.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from mypy import api

import celery_nats_leader

ROOT = Path(__file__).resolve().parents[2]

USER_MODULE = """\
from celery_nats_leader import ElectionObserver, Elector, install, leader_only, run_once


@run_once
@leader_only(role="reports", validate=True)
def nightly_report(day: str) -> int:
    return len(day)


# Wrong uses are errors (with Any they would pass, and --strict would report
# these ignores as unused).
leader_only(on_follower="drop")  # type: ignore[call-overload]
run_once("not a function")  # type: ignore[type-var]

reveal_type(install)
reveal_type(leader_only)
reveal_type(run_once)
reveal_type(nightly_report)
reveal_type(ElectionObserver)
reveal_type(Elector)
"""


def mypy_strict(source: str, tmp_path: Path, cache: Path) -> tuple[int, list[str]]:
    """``mypy --strict`` on ``source``: its exit status and its ``note:``/``error:`` lines."""
    module = tmp_path / "user_tasks.py"
    module.write_text(textwrap.dedent(source))
    # From the repository root: mypy finds this checkout's package (an editable
    # install is an import hook mypy cannot follow) and the project's mypy
    # settings (Celery has no type information), as a user's CI finds theirs.
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        stdout, stderr, status = api.run(
            ["--strict", "--no-error-summary", "--cache-dir", str(cache), str(module)]
        )
    finally:
        os.chdir(cwd)
    assert stderr == "", stderr
    # The user's module's lines only: a user's mypy does not report the
    # package's own lines (installed, they are not checked), and its
    # type: ignore comments for Celery and kombu differ with their versions.
    # By file name, not path: when nothing it imports changed, a warm cache
    # replays the notes of an earlier run, under that run's temporary path.
    ours = [
        line for line in stdout.splitlines() if Path(line.partition(":")[0]).name == module.name
    ]
    return status, [line.partition(": ")[2] for line in ours]


@pytest.fixture(scope="module")
def revealed(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> list[str]:
    # mypy's cache in pytest's (a warm run takes seconds), if pytest keeps one.
    pytest_cache = getattr(request.config, "cache", None)
    cache = (
        Path(pytest_cache.mkdir("mypy-public-types"))
        if pytest_cache is not None
        else tmp_path_factory.mktemp("mypy-cache")
    )
    status, lines = mypy_strict(USER_MODULE, tmp_path_factory.mktemp("user"), cache)
    notes = [
        line.partition("Revealed type is ")[2].strip('"') for line in lines if "Revealed" in line
    ]
    errors = [line for line in lines if line.startswith("error:")]
    assert errors == [], errors
    # Exit status 1 can only come from the package's own lines then (see
    # mypy_strict); 2 is mypy failing.
    assert status in (0, 1)
    assert len(notes) == 6, lines
    return notes


def test_the_lazy_names_have_their_real_signatures(revealed: list[str]) -> None:
    install, leader_only, run_once, decorated, observer, elector = revealed
    assert install == "def (app: Any)"
    # Both overloads: bare, and with keyword arguments.
    assert leader_only.startswith("Overload(def [F <: def (*Any, **Any) -> Any] (F) -> F, ")
    assert "def (*, role: str | None =, validate: bool =, on_follower: " in leader_only
    assert run_once == "def [F <: def (*Any, **Any) -> Any] (fun: F) -> F"
    # A function under both decorators keeps its own signature.
    assert decorated == "def (day: str) -> int"
    assert observer == "def () -> celery_nats_leader.election.observer.ElectionObserver"
    assert "observer: celery_nats_leader.election.observer.ElectionObserver | None =" in elector


def test_every_exported_name_resolves() -> None:
    # Lazy names listed in __all__ must exist (a typo would pass mypy's
    # TYPE_CHECKING branch but fail a user at run time).
    for name in celery_nats_leader.__all__:
        assert getattr(celery_nats_leader, name) is not None, name
    assert set(dir(celery_nats_leader)) >= set(celery_nats_leader.__all__)


@pytest.mark.parametrize("name", ["LeaderServiceRunner", "read_status", "PERMANENT_ERRORS"])
def test_internals_are_not_exported(name: str) -> None:
    assert name not in celery_nats_leader.__all__
    assert not hasattr(celery_nats_leader, name)


def test_a_misspelt_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match=re.escape("'leader_onyl'")):
        _ = celery_nats_leader.leader_onyl  # type: ignore[attr-defined]


def test_the_election_class_has_one_name_at_each_import_path() -> None:
    # ``Election`` is the documented name of the KV state machine; one class.
    from celery_nats_leader.election import Election
    from celery_nats_leader.election.kv import KvElection

    assert celery_nats_leader.Election is Election is KvElection


def test_every_lazy_name_is_exported_where_celery_is_installed() -> None:
    assert set(celery_nats_leader._LAZY) <= set(celery_nats_leader.__all__)


def test_a_star_import_without_celery_brings_the_core() -> None:
    # A user without Celery (plain Python, or Django alone) may star-import
    # the package: the Celery names are then not listed, nothing fails.
    script = (
        "import sys\n"
        "sys.modules['celery'] = None  # as if not installed\n"
        "from celery_nats_leader import *\n"
        "assert 'leader_only' not in dir()\n"
        "print(Elector.__name__, ElectionConfig.__name__)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["Elector", "ElectionConfig"]
