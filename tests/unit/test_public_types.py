"""What a user's type checker sees of the package's public names.

The Celery-side names (``leader_only``, ``install``, ``run_once``, ...) are
imported lazily at run time so that the core never imports Celery; a type
checker must still see their real signatures, not ``Any``. These tests run
``mypy --strict`` on a small user module, as a user's CI would.
"""

from __future__ import annotations

import ast
import importlib
import os
import pickle
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from kombu.utils.imports import symbol_by_name
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


#: Names that moved: ``old module:name`` -> ``new module:name``.
MOVED = [
    "celery_nats_leader.once:OnceGuard -> celery_nats_leader.recipes.once_guard:OnceGuard",
    "celery_nats_leader.once:once_key -> celery_nats_leader.recipes.once_guard:once_key",
    "celery_nats_leader.worker.once:run_once -> celery_nats_leader.worker.once_tasks:run_once",
    "celery_nats_leader.worker.once:OnceTask -> celery_nats_leader.worker.once_tasks:OnceTask",
    "celery_nats_leader.probes:ProbeServer -> celery_nats_leader.observe.probes:ProbeServer",
    "celery_nats_leader.prometheus:PrometheusObserver"
    " -> celery_nats_leader.observe.prometheus:PrometheusObserver",
    "celery_nats_leader.ops.oneshot:run_once -> celery_nats_leader.ops.oneshot:run_sync",
    "celery_nats_leader.cli:nats_leader -> celery_nats_leader.ops.cli:nats_leader",
    "celery_nats_leader.settings:LeaderSettings"
    " -> celery_nats_leader.config.settings:LeaderSettings",
    "celery_nats_leader.constants:DEFAULT_TTL_SECONDS"
    " -> celery_nats_leader.config.constants:DEFAULT_TTL_SECONDS",
    "celery_nats_leader.config:ElectionConfig -> celery_nats_leader.config.election:ElectionConfig",
    "celery_nats_leader.token:FencingToken -> celery_nats_leader.term.token:FencingToken",
    "celery_nats_leader.record:LeaderRecord -> celery_nats_leader.term.record:LeaderRecord",
    "celery_nats_leader.term:TermReader -> celery_nats_leader.term.current:TermReader",
    "celery_nats_leader.election.base:DemoteReason"
    " -> celery_nats_leader.election.vocabulary:DemoteReason",
    "celery_nats_leader.events:event_subject"
    " -> celery_nats_leader.election.vocabulary:event_subject",
    "celery_nats_leader:Election -> celery_nats_leader.election.kv:KvElection",
    "celery_nats_leader.election:Election -> celery_nats_leader.election.kv:KvElection",
    "celery_nats_leader.election.kv:Election -> celery_nats_leader.election.kv:KvElection",
]

#: Modules that moved: ``old path -> new path``; the old one re-exports
#: every public name of the new one.
MOVED_MODULES = [
    "celery_nats_leader.worker.service -> celery_nats_leader.worker.election",
    "celery_nats_leader.worker.state -> celery_nats_leader.worker.shared_leadership",
    "celery_nats_leader.election.services -> celery_nats_leader.election.leader_services",
    "celery_nats_leader.beat.fence -> celery_nats_leader.beat.dispatch_fence",
    "celery_nats_leader.beat.state -> celery_nats_leader.beat.schedule_store",
    "celery_nats_leader.ops.fence -> celery_nats_leader.ops.fence_leader",
]


def _resolve(path: str) -> object:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("moved", MOVED)
def test_a_moved_name_keeps_its_old_import_path(moved: str) -> None:
    # Documented import paths of modules that moved keep working (re-exports).
    old, _, new = moved.partition(" -> ")
    assert _resolve(old) is _resolve(new)


def _defined_public_names(module: object) -> set[str]:
    """The public names a module defines itself (not those it imports)."""
    source = Path(str(getattr(module, "__file__", ""))).read_text()
    names: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    # A TypeVar and the logger are the module's own business.
    return {n for n in names if not n.startswith("_") and n not in {"T", "logger"}}


@pytest.mark.parametrize("moved", MOVED_MODULES)
def test_a_moved_module_keeps_its_old_import_path(moved: str) -> None:
    # Users' imports, Celery's ``base="module:Class"`` strings and pickles
    # that name the old module all resolve to the same objects.
    old_name, _, new_name = moved.partition(" -> ")
    old, new = importlib.import_module(old_name), importlib.import_module(new_name)
    # Nothing but a re-export: its docstring, imports from the new module, __all__.
    body = ast.parse(Path(str(old.__file__)).read_text()).body
    imported = {n.module for n in body if isinstance(n, ast.ImportFrom)}
    assert imported == {"__future__", new_name}
    assert [type(n) for n in body] == [ast.Expr, ast.ImportFrom, ast.ImportFrom, ast.Assign]
    assert old.__doc__ is not None
    assert old.__doc__.startswith(f"Moved to :mod:`{new_name}`; this path keeps working.")
    assert sorted(old.__all__) == sorted(_defined_public_names(new))
    for name in old.__all__:
        assert getattr(old, name) is getattr(new, name), name
        assert symbol_by_name(f"{old_name}:{name}") is getattr(new, name), name
        if isinstance(getattr(new, name), type):
            reference = f"c{old_name}\n{name}\n.".encode()
            assert pickle.loads(reference) is getattr(new, name), name


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
