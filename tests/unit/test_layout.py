"""The layout's promises, checked on the source: who may import what.

* ``celery_nats_leader.nats`` is the only code that imports nats-py (the
  test helpers under ``testing/`` too go through it);
* the core (everything but the Celery wiring ``worker/``, ``beat/``,
  the ``celery nats-leader`` command ``ops/cli.py`` and the test helpers
  ``testing/``) imports neither Celery,
  kombu nor Django, and imports in a fresh interpreter where those cannot
  be imported at all;
* only ``celery_nats_leader.nats`` speaks the JetStream API (``$JS.API``
  subjects, its numeric error codes);
* the package has no import circle, at import time or through deferred
  imports, and every import points down a floor (:data:`FLOORS`);
* the package root holds ``__init__.py`` and folders only, and no module
  is a re-export of another (an old import path kept alive);
* the installed package ships test helpers for users, not this project's
  chaos harness: nothing in it imports the Django app, the test suite or a
  database or Redis client, and the pytest plugin loads without Celery and
  Django.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import celery_nats_leader
import django_nats_leader

PACKAGE = Path(celery_nats_leader.__file__).resolve().parent
DJANGO_APP = Path(django_nats_leader.__file__).resolve().parent

#: Subpackages and modules that are not the core (they wire Celery, or help tests);
#: ops/cli.py is the Celery command (click, the app's configuration).
NOT_CORE = ("worker", "beat", "testing", "ops/cli.py")

#: Where nats-py may be imported.
NATS_ALLOWED = ("nats",)

INTEGRATIONS = ("celery", "kombu", "django")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def core_files() -> list[Path]:
    return [
        p
        for p in package_files()
        if p.relative_to(PACKAGE).parts[0] not in NOT_CORE
        and p.relative_to(PACKAGE).as_posix() not in NOT_CORE
    ]


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
import sys

# As if not installed: an import of these fails with ModuleNotFoundError and
# importlib.util.find_spec() answers None, as it does without the package.
for name in {blocked!r}:
    sys.modules[name] = None
for name in {modules!r}:
    __import__(name)
loaded = sorted(
    m for m, module in sys.modules.items()
    if module is not None and m.partition(".")[0] in {blocked!r}
)
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
    assert "ModuleNotFoundError: import of celery halted" in result.stderr


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


#: JetStream API error codes (``err_code`` in nats-server's errors.json) lie
#: in this range; only the NATS door translates them.
JETSTREAM_ERROR_CODES = range(10001, 10400)


def outside_the_nats_door() -> list[Path]:
    return [
        *(p for p in package_files() if p.relative_to(PACKAGE).parts[0] not in NATS_ALLOWED),
        *sorted(DJANGO_APP.rglob("*.py")),
    ]


def jetstream_error_codes(path: Path) -> Iterator[tuple[int, int]]:
    """``(line, code)`` of every integer literal that is a JetStream API error code."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (
            isinstance(node, ast.Constant)
            and type(node.value) is int
            and node.value in JETSTREAM_ERROR_CODES
        ):
            yield node.lineno, node.value


def test_the_scans_for_the_jetstream_api_see_it_in_the_nats_door() -> None:
    # The check below would pass vacuously if the scans missed what they look for.
    jetstream = PACKAGE / "nats" / "jetstream.py"
    assert "$JS.API" in jetstream.read_text()
    assert {10059, 10037} <= {code for _, code in jetstream_error_codes(jetstream)}


def test_only_the_nats_package_speaks_the_jetstream_api() -> None:
    # Raw $JS.API requests and JetStream error codes outside nats/ would be a
    # second place translating JetStream's errors: the events stream, like
    # the buckets, goes through the backend's methods.
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {what}"
        for path in outside_the_nats_door()
        for line, what in [
            *(
                (number, "$JS.API")
                for number, text in enumerate(path.read_text().splitlines(), 1)
                if "$JS.API" in text
            ),
            *((number, f"error code {code}") for number, code in jetstream_error_codes(path)),
        ]
    ]
    assert offenders == []


def imports_of(path: Path, *, deferred: bool) -> Iterator[str]:
    """The package's modules ``path`` imports: at import time, or (``deferred``) anywhere.

    Anywhere includes imports under ``if TYPE_CHECKING:`` and inside
    functions, which do not run when the module is imported.
    """
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    modules = {module_name(p) for p in package_files()}

    def statements(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                yield node
            elif deferred and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from (
                    n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))
                )
            elif isinstance(node, ast.If):
                test = ast.unparse(node.test)
                if deferred or test not in {"TYPE_CHECKING", "typing.TYPE_CHECKING"}:
                    yield from statements(node.body)
                yield from statements(node.orelse)
            elif isinstance(node, ast.Try):
                for block in (node.body, node.orelse, node.finalbody):
                    yield from statements(block)
                for handler in node.handlers:
                    yield from statements(handler.body)
            elif isinstance(node, (ast.With, ast.ClassDef)):
                yield from statements(node.body)

    for node in statements(ast.parse(path.read_text(), str(path)).body):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            # ``from pkg import sub`` imports the module pkg.sub when there is one.
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
            ]
        for target in targets:
            known = target
            while known and known not in modules:
                known = known.rpartition(".")[0]
            if known and known != name:
                yield known


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` that hold more than one node."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's algorithm
        order[module] = low[module] = len(order)
        stack.append(module)
        for target in graph[module]:
            if target not in order:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], order[target])
        if low[module] == order[module]:
            component = [stack.pop()]
            while component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return sorted(found)


def import_circles(*, deferred: bool) -> list[list[str]]:
    """The import circles of the package (see :func:`imports_of` for ``deferred``)."""
    return circles({module_name(p): set(imports_of(p, deferred=deferred)) for p in package_files()})


def test_the_circle_finder_sees_imports_and_circles() -> None:
    # Zero circles would prove nothing if the finder could miss one.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": {"a"}}
    assert circles(graph) == [["a", "b", "c"], ["d", "e"]]
    events = PACKAGE / "ops" / "events.py"
    assert {"celery_nats_leader.core.backend", "celery_nats_leader.election.events"} <= set(
        imports_of(events, deferred=False)
    )
    # base.py builds leader services in its methods (a deferred import).
    base = PACKAGE / "election" / "base.py"
    assert "celery_nats_leader.election.leader_services" not in set(
        imports_of(base, deferred=False)
    )
    assert "celery_nats_leader.election.leader_services" in set(imports_of(base, deferred=True))


def test_the_package_has_no_import_circle() -> None:
    # Not even through deferred imports: the election's words (states,
    # reasons, callback types, subjects) live in election/vocabulary.py,
    # which its parts import instead of each other.
    assert import_circles(deferred=False) == []
    assert import_circles(deferred=True) == []


def test_leader_services_depend_on_the_vocabulary_not_the_election_class() -> None:
    services = PACKAGE / "election" / "leader_services.py"
    imported = set(imports_of(services, deferred=True))
    assert "celery_nats_leader.election.vocabulary" in imported
    assert "celery_nats_leader.election.base" not in imported
    # Nothing of the election's own private state is read from outside it.
    assert not re.search(r"election\._[a-z]", services.read_text())


#: The package's floors, bottom first: a folder imports only from its own
#: floor's folders and the floors below. ``__init__`` is the package root's
#: facade; ``testing`` (the pytest plugin and helpers for users' tests) stands
#: on all of it.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("core",),  # the election's own types and runtime: errors, backend, clocks, loop thread
    ("config",),  # settings and their validation
    ("nats",),  # the one door to NATS, and the per-process client
    ("term", "recipes"),  # the record and the fencing token; the once-guard
    ("election",),  # the state machines, their events, the elector, the status read model
    ("observe",),  # probes and metrics
    ("worker",),  # the Celery worker wiring (and Celery's version differences)
    ("beat",),  # the leader scheduler
    ("ops",),  # the operator layer and the celery command
    ("__init__",),
    ("testing",),
)


def floor_of(module: str) -> int:
    """The floor of a module of the package, by its folder (``__init__`` for the root)."""
    parts = module.split(".")
    folder = parts[1] if len(parts) > 1 else "__init__"
    for number, folders in enumerate(FLOORS):
        if folder in folders:
            return number
    raise AssertionError(f"{module}: folder {folder!r} is on no floor of FLOORS")


def back_arrows(graph: dict[str, set[str]]) -> list[str]:
    """The imports of ``graph`` that run from a lower floor to a higher one."""
    return sorted(
        f"{source} -> {target}"
        for source, targets in graph.items()
        for target in targets
        if floor_of(target) > floor_of(source)
    )


def test_the_floor_check_sees_a_back_arrow() -> None:
    graph = {
        "celery_nats_leader.core.errors": set(),
        "celery_nats_leader.election.kv": {"celery_nats_leader.core.errors"},
        "celery_nats_leader.core.events": {"celery_nats_leader.election.vocabulary"},
    }
    assert back_arrows(graph) == [
        "celery_nats_leader.core.events -> celery_nats_leader.election.vocabulary"
    ]


def test_every_import_points_down_a_floor() -> None:
    # Deferred imports too: a function-level import up a floor is the same
    # dependency, only hidden.
    graph = {module_name(p): set(imports_of(p, deferred=True)) for p in package_files()}
    assert back_arrows(graph) == []


def test_the_package_root_holds_its_init_and_folders_only() -> None:
    loose = sorted(p.name for p in PACKAGE.iterdir() if p.is_file())
    assert loose == ["__init__.py", "py.typed"]
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == {f for floor in FLOORS for f in floor} - {"__init__"}


def only_re_exports(source: str) -> bool:
    """Whether a module's body is nothing but a docstring, imports and ``__all__``."""
    body = ast.parse(source).body
    return bool(body) and all(
        isinstance(node, (ast.Import, ast.ImportFrom))
        or (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
        or (
            isinstance(node, ast.Assign)
            and [ast.unparse(target) for target in node.targets] == ["__all__"]
        )
        for node in body
    )


def test_the_shim_check_sees_a_shim() -> None:
    shim = '"""Moved."""\nfrom a.b import C\n__all__ = ["C"]\n'
    assert only_re_exports(shim)
    assert not only_re_exports(shim + "D = 1\n")


def test_no_module_is_only_a_re_export() -> None:
    # Before the first release there are no old import paths to keep alive:
    # a module that only re-exports another's names is a second name for it.
    # A package's __init__.py may gather its folder's public names.
    shims = [
        p.relative_to(PACKAGE.parent).as_posix()
        for p in [*package_files(), *sorted(DJANGO_APP.rglob("*.py"))]
        if p.name != "__init__.py" and only_re_exports(p.read_text())
    ]
    assert shims == []
