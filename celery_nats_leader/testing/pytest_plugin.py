"""Pytest fixtures for testing code built on celery-nats-leader.

Registered with pytest (entry point ``pytest11``, name ``nats_leader``) when the
package is installed, like ``celery.contrib.pytest``: its fixtures do nothing
until a test asks for one, and importing it imports neither Celery nor Django.
Disable it with ``-p no:nats_leader``; enable it explicitly (for example where
entry points are not loaded, ``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``) with
``-p celery_nats_leader.testing.pytest_plugin`` or
``pytest_plugins = ["celery_nats_leader.testing.pytest_plugin"]`` in a conftest.

Fixtures:

* ``nats_leader_server``: a real ``nats-server`` with JetStream on a free port
  and a private store, stopped after the test
  (:class:`~celery_nats_leader.testing.NatsServer`). Its version comes from
  ``--nats-server-version`` (``system``, ``newest``, ``2.12``, ``2.15.1``), else
  ``$NATS_SERVER_VERSION``, else the first ``nats-server`` found; override the
  ``nats_leader_server_version`` fixture to pin one.
* ``nats_leader_memory`` and ``nats_leader_elector``: an in-memory store and a
  started :class:`~celery_nats_leader.Elector` on it. Several electors on one
  ``nats_leader_memory`` play several processes. For logic tests only.
* ``nats_leader_leadership``: makes this process the leader of a role, or not,
  as ``@leader_only`` tasks see it (:class:`Leadership`).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from celery_nats_leader.election.elector import Elector
    from celery_nats_leader.nats.memory import MemoryServer
    from celery_nats_leader.term.token import FencingToken
    from celery_nats_leader.testing.nats_server import NatsServer
    from celery_nats_leader.worker.shared_leadership import WorkerLeadership

__all__ = ["Execution", "Leadership"]

#: The instance id written for this process by :class:`Leadership`.
INSTANCE_ID = "pytest"

# A lease that outlives any test: the stand-in leader never expires on its own.
_LEASE_SECONDS = 7 * 86400.0


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add ``--nats-server-version``."""
    parser.addoption(
        "--nats-server-version",
        default=None,
        help="nats-server of the nats_leader_server fixture: system, newest, 2.12, 2.15.1, ... "
        "(default: $NATS_SERVER_VERSION, else the first nats-server found)",
    )


@pytest.fixture(scope="session")
def nats_leader_server_version(request: pytest.FixtureRequest) -> str | None:
    """The ``nats-server`` version the ``nats_leader_server`` fixture runs (``None``: any).

    Override it in a conftest to pin a version for a whole suite.
    """
    option: str | None = request.config.getoption("--nats-server-version")
    return option or os.environ.get("NATS_SERVER_VERSION") or None


@pytest.fixture
def nats_leader_server(nats_leader_server_version: str | None) -> Iterator[NatsServer]:
    """A started ``nats-server`` with JetStream; use ``.url`` to connect, stopped after the test."""
    from celery_nats_leader.testing.nats_server import NatsServer
    from celery_nats_leader.testing.server_binaries import server_binary

    binary = server_binary(nats_leader_server_version) if nats_leader_server_version else None
    with NatsServer(binary=binary) as server:
        yield server


@pytest.fixture
def nats_leader_memory() -> MemoryServer:
    """An in-memory KV store and message bus shared by in-memory electors."""
    from celery_nats_leader.nats.memory import MemoryServer

    return MemoryServer()


@pytest.fixture
def nats_leader_elector(nats_leader_memory: MemoryServer) -> Iterator[Elector]:
    """A started :class:`~celery_nats_leader.Elector` on ``nats_leader_memory``, stopped after.

    Add roles with ``create_bucket=True`` (the in-memory store starts empty).
    """
    from celery_nats_leader.election.elector import Elector
    from celery_nats_leader.nats.memory import MemoryBackend

    elector = Elector(
        name="pytest-elector", backend_factory=lambda: MemoryBackend(nats_leader_memory)
    )
    elector.start(timeout=10.0)
    try:
        yield elector
    finally:
        elector.stop()


@dataclasses.dataclass(frozen=True)
class Execution:
    """What a worker did with one message of a task (:meth:`Leadership.execute`).

    Attributes:
        state: Celery's state: ``SUCCESS``, ``FAILURE``, ``IGNORED`` (skipped on a
            follower), ``REJECTED`` (given back to the leader queue), ``RETRY``.
        result: The return value, or the exception of a failure.
        request: The task's request as the body saw it (``leader_token``,
            ``leader_role``, ...).

    """

    state: str
    result: Any
    request: Any


class Leadership:
    """This process's leadership as ``@leader_only`` tasks see it, set by the test.

    Installed by the ``nats_leader_leadership`` fixture in place of the worker's
    election (removed after the test). At first this process leads no role.

    A leader-only task checks leadership only when a worker executes it from a
    message: a direct call (``task()``) or ``task.apply()`` runs the body
    unchecked. :meth:`execute` runs a task as a worker does, in this process;
    a Celery worker started in this process (``celery.contrib.testing.worker``)
    for an app *without* :func:`~celery_nats_leader.install`'s bootstep sees the
    same leadership. Prefork children do not: use threads or solo.
    """

    def __init__(self) -> None:
        self._tokens: dict[str, FencingToken] = {}
        self._invalid: set[str] = set()
        self._roles: tuple[str, ...] = ()
        self._epoch = 0
        self._state: WorkerLeadership | None = None

    # ------------------------------------------------------------ the test's side

    def lead(self, role: str = "default", *, valid: bool = True) -> FencingToken:
        """Make this process the leader of ``role``, in a new term.

        Args:
            role: The role.
            valid: With ``False``, the fencing token fails validation (a leader
                whose key was taken and that has not noticed yet):
                ``validate=True`` tasks refuse to run, the others run.

        Returns:
            The new term's fencing token (its epoch is higher than any before).

        """
        from celery_nats_leader.term.token import FencingToken

        self._epoch += 1
        token = FencingToken(self._epoch, secrets.token_hex(16))
        self._tokens[role] = token
        if valid:
            self._invalid.discard(role)
        else:
            self._invalid.add(role)
        self._publish(role)
        return token

    def follow(self, role: str = "default") -> None:
        """Make this process a follower of ``role`` (it campaigns, another process leads)."""
        self._tokens.pop(role, None)
        self._invalid.discard(role)
        self._publish(role)

    def token(self, role: str = "default") -> FencingToken | None:
        """The fencing token while this process leads ``role``, else ``None``."""
        return self._tokens.get(role)

    def execute(self, task: Any, *args: Any, **kwargs: Any) -> Execution:
        """Run ``task`` as a worker runs a message taken from the role's leader queue.

        Goes through Celery's own task tracer (signals, ``on_follower``, results
        stored in the app's result backend), in this process, with no broker.

        Args:
            task: A Celery task (``@app.task`` over ``@leader_only``, or ``LeaderTask``).
            *args: The task's arguments.
            **kwargs: The task's keyword arguments.

        Returns:
            What happened; the body's exceptions are in ``result``, not raised.

        Raises:
            TypeError: If ``task`` is not leader-only.

        """
        from celery import signals
        from celery.app.trace import build_tracer

        from celery_nats_leader.worker.tasks import leader_router, upgrade_task

        route = leader_router(task.name, args, kwargs, {}, task=task)
        if route is None:
            raise TypeError(f"task {task.name!r} is not leader-only")
        queue = route["queue"]
        # As the worker does when it starts: acks_late, so that a follower
        # gives the message back (REJECTED) instead of forwarding a copy.
        upgrade_task(task)
        seen: list[Any] = []
        tracer = build_tracer(task.name, task, app=task.app, eager=False, propagate=False)
        request = {
            "id": f"pytest-{secrets.token_hex(8)}",
            "delivery_info": {"routing_key": queue, "exchange": "", "redelivered": False},
            "hostname": "pytest@localhost",
        }

        def capture(sender: Any = None, task: Any = None, **_: Any) -> None:
            # The request as the body saw it (the tracer pops it afterwards).
            if task is not None:
                seen.append(task.request)

        signals.task_postrun.connect(capture, weak=False)
        try:
            result, info, _, _ = tracer(request["id"], list(args), kwargs, request)
        finally:
            signals.task_postrun.disconnect(capture)
        state = str(info.state) if info is not None else "SUCCESS"
        # A failure's result is Celery's ExceptionInfo: give the exception itself.
        result = getattr(result, "exception", result)
        return Execution(state, result, seen[0] if seen else None)

    # ------------------------------------------------------ what the worker reads

    def current_token(self, role: str) -> FencingToken | None:
        """The token while this process leads ``role`` (the worker's local answer)."""
        return self._tokens.get(role)

    def validate(self, role: str, token: FencingToken, timeout: float | None) -> bool:
        """``validate=True``'s KV check: the token is this role's, and not made invalid."""
        return self._tokens.get(role) == token and role not in self._invalid

    def _publish(self, role: str) -> None:
        from celery_nats_leader.config.connection import ConnectOptions
        from celery_nats_leader.worker import shared_leadership

        if role not in self._roles:
            # The shared slots are sized when made: a new role needs new ones.
            self._roles = (*self._roles, role)
            self._state = shared_leadership.WorkerLeadership(
                shared_leadership.SharedLeadership(self._roles),
                self,
                instance_id=INSTANCE_ID,
                bucket="pytest",
                connection=ConnectOptions.build(None),
                request_timeouts={},
            )
            shared_leadership.install(self._state)
        assert self._state is not None
        shared = self._state.shared
        for name in self._roles:
            token = self._tokens.get(name)
            if token is None:
                shared.clear(name)
            else:
                deadline = time.monotonic() + _LEASE_SECONDS
                shared.publish(name, token.epoch, deadline, token.value)

    def _install(self) -> None:
        from celery_nats_leader.worker import shared_leadership

        shared_leadership.install(self._state)


@pytest.fixture
def nats_leader_leadership() -> Iterator[Leadership]:
    """Make this process lead a role or not, as ``@leader_only`` tasks see it.

    ``nats_leader_leadership.lead("reports")`` returns the term's token;
    ``.follow("reports")`` ends it; ``.execute(task, ...)`` runs a task as a
    worker would. The worker's previous state is restored after the test.
    """
    from celery_nats_leader.worker import shared_leadership

    previous = shared_leadership.current()
    leadership = Leadership()
    leadership._install()
    try:
        yield leadership
    finally:
        shared_leadership.install(previous)
