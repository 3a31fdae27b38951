"""The synchronous facade: many roles, one loop thread, one NATS connection.

Celery workers, celery beat and Django management commands use this; asyncio
programs can use :class:`~celery_nats_leader.election.KvElection` directly.

Example::

    with Elector("nats://127.0.0.1:4222") as elector:
        beat = elector.add_role(ElectionConfig(role="beat", ttl=5))
        if beat.is_leader:
            ...
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from celery_nats_leader.config import ElectionConfig
from celery_nats_leader.config.connection import ConnectOptions
from celery_nats_leader.core.backend import Backend, Bucket
from celery_nats_leader.core.backoff import Backoff, retry_transient
from celery_nats_leader.core.clock import Clock
from celery_nats_leader.core.errors import (
    ConfigError,
    ElectionError,
    ElectionStoppedError,
    NatsUnavailableError,
    is_transient,
)
from celery_nats_leader.core.loop_thread import EventLoopThread
from celery_nats_leader.election import (
    DemoteCallback,
    ElectionState,
    ErrorCallback,
    LeaderChangeCallback,
    PromoteCallback,
)
from celery_nats_leader.election.interface import LeaderElection, new_election
from celery_nats_leader.election.leader_services import LeaderServiceRunner, ServiceFunction
from celery_nats_leader.election.observer import ElectionObserver
from celery_nats_leader.election.status import RoleStatus, read_report
from celery_nats_leader.nats import ConnectionListener, open_backend
from celery_nats_leader.term.record import LeaderRecord
from celery_nats_leader.term.token import FencingToken

logger = logging.getLogger(__name__)

#: Seconds between attempts to start after a permanent error (missing bucket...).
_PERMANENT_RETRY = 30.0
#: Seconds between two warnings that the election is still not running.
_REPEAT_INTERVAL = 30.0
#: What a required start() raises when stop() came first.
_STOPPED_WHILE_STARTING = "the leader election was stopped (stop()) before it started"


def _duration(seconds: float) -> str:
    """``0.05`` -> ``"50ms"``, ``30.0`` -> ``"30s"``: never "0.0s"."""
    return f"{seconds * 1000:.0f}ms" if seconds < 1 else f"{seconds:.3g}s"


#: Builds a backend on the elector's loop (tests pass the in-memory one).
BackendFactory = Callable[[], "Backend"]


class RoleHandle:
    """One role hosted by an :class:`Elector`; every method is thread-safe."""

    def __init__(self, elector: Elector, election: LeaderElection) -> None:
        self._elector = elector
        self.election = election
        # Set once the elector tried to start this role's election (or gave
        # up). Before that there is nothing to wait on in the election itself:
        # with require_connection=False roles start only once NATS is reachable.
        self._start_attempted = threading.Event()

    @property
    def role(self) -> str:
        """The role's name."""
        return self.election.role

    @property
    def config(self) -> ElectionConfig:
        """The role's configuration."""
        return self.election.config

    @property
    def is_leader(self) -> bool:
        """Whether this process leads the role now (checked against the lease clock)."""
        return self.election.is_leader

    @property
    def state(self) -> ElectionState:
        """The election's state."""
        return self.election.state

    @property
    def token(self) -> FencingToken | None:
        """The current fencing token while leading, else ``None``."""
        return self.election.token

    @property
    def leader_id(self) -> str | None:
        """The id of the last leader seen."""
        return self.election.leader_id

    @property
    def leader(self) -> LeaderRecord | None:
        """The last leader record seen."""
        return self.election.leader

    @property
    def error(self) -> ElectionError | None:
        """The permanent error that stopped this role's election, if any."""
        return self.election.error

    def validate_token(self, timeout: float | None = None) -> bool:
        """Confirm the token against the store (one KV read); see :meth:`KvElection.validate_token`.

        Args:
            timeout: Seconds to wait; default twice the request timeout.

        Returns:
            ``True`` only if this process still holds its term. ``False`` on
            any doubt, including a timeout.

        """
        if not self.election.is_leader or not self._elector.running:
            return False
        limit = timeout if timeout is not None else 2 * self.config.request_timeout
        try:
            return self._elector.loop.run(self.election.validate_token(), limit)
        except (TimeoutError, RuntimeError):
            return False

    def resign(self, timeout: float | None = None) -> None:
        """Step down if leading (demote callbacks, then the key is released)."""
        if not self._elector.running:
            return
        self._elector.loop.run(self.election.resign(), timeout or self.config.ttl)

    def wait_for_leadership(self, timeout: float | None = None) -> bool:
        """Block until this process leads the role.

        Also waits for the elector to connect, when it was started with
        ``require_connection=False`` and NATS was not reachable yet.

        Returns:
            ``True`` if leading, ``False`` if ``timeout`` passed first.

        """
        if self.election.is_leader:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._start_attempted.wait(timeout) or not self._elector.running:
            return False  # still not connected to NATS, or the elector stopped
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        future = self._elector.loop.submit(self.election.wait_for_leadership(remaining))
        return future.result()

    def run_while_leading(
        self, service: ServiceFunction, *, name: str | None = None, grace: float | None = None
    ) -> LeaderServiceRunner:
        """Run ``service(ctx)`` for as long as this process leads the role, every term.

        A plain function runs on a thread of its own and must return soon
        after ``ctx.stopped`` turns true (``ctx.wait(seconds)`` sleeps and
        wakes at the end of the term); a coroutine function runs on the
        elector's loop and is cancelled (it must never block). See
        :mod:`celery_nats_leader.election.leader_services`.

        Args:
            service: ``service(ctx)``; ``ctx.token`` is the term's fencing token.
            name: For logs; default the function's name.
            grace: Seconds a release waits for the service to stop;
                default the role's ``lease_margin``.

        Returns:
            The service's handle.

        """
        election = self.election
        if self._elector.running:

            async def register() -> LeaderServiceRunner:
                return election.run_while_leading(service, name=name, grace=grace)

            return self._elector.loop.run(register(), 10.0)
        return election.run_while_leading(service, name=name, grace=grace)

    def on_promote(self, callback: PromoteCallback) -> PromoteCallback:
        """Register ``callback(token)``; runs on a worker thread of the elector."""
        return self.election.on_promote(callback)

    def on_demote(self, callback: DemoteCallback) -> DemoteCallback:
        """Register ``callback(reason)``; runs on a worker thread of the elector."""
        return self.election.on_demote(callback)

    def on_leader_change(self, callback: LeaderChangeCallback) -> LeaderChangeCallback:
        """Register ``callback(record_or_None)`` for changes of the observed leader."""
        return self.election.on_leader_change(callback)

    def on_error(self, callback: ErrorCallback) -> ErrorCallback:
        """Register ``callback(error)`` for a permanent error stopping the role."""
        return self.election.on_error(callback)

    def describe(self) -> dict[str, Any]:
        """This candidate's view of the role (see :meth:`KvElection.describe`)."""
        return self.election.describe()


class Elector(ConnectionListener):
    """Hosts many roles on one background event loop and one NATS connection.

    Args:
        servers: NATS URL(s): a string (comma-separated) or a sequence.
        connect_options: Extra :func:`nats.connect` options (TLS, credentials,
            token, nkeys, ...); see :class:`~celery_nats_leader.nats.connection.ConnectOptions`.
        name: Connection name (visible in the server's monitoring).
        observer: Receives every role's measurements (metrics).
        clock: Monotonic clock (tests).
        backend_factory: Builds the backend instead of connecting (tests).

    """

    def __init__(
        self,
        servers: str | Sequence[str] | None = None,
        *,
        connect_options: Mapping[str, Any] | None = None,
        name: str = "celery-nats-leader",
        observer: ElectionObserver | None = None,
        clock: Clock | None = None,
        backend_factory: BackendFactory | None = None,
    ) -> None:
        self.connect_options = ConnectOptions.build(servers, connect_options)
        self._name = name
        self._observer = observer
        self._clock = clock
        self._backend_factory = backend_factory
        self._roles: dict[str, RoleHandle] = {}
        self._lock = threading.Lock()
        self.loop = EventLoopThread(name=f"{name}-loop")
        self._own_backend: Backend | None = None
        self._backend: Backend | None = None
        self._connected = threading.Event()
        self._connector: asyncio.Task[None] | None = None
        self._started = False
        self._start_error: ElectionError | None = None

    # ------------------------------------------------------------- roles

    def add_role(self, config: ElectionConfig) -> RoleHandle:
        """Join the election for ``config.role``.

        May be called before or after :meth:`start`; after, the role starts
        campaigning at once.

        Returns:
            The role's handle.

        Raises:
            ConfigError: If the role was added already.

        """
        with self._lock:
            key = f"{config.bucket}/{config.role}"
            if key in self._roles:
                raise ConfigError(f"role {config.role!r} in bucket {config.bucket!r} added twice")
            election = new_election(config, clock=self._clock, observer=self._observer)
            handle = RoleHandle(self, election)
            self._roles[key] = handle
        if self._started and self._connected.is_set():
            self.loop.run(self._start_election(handle), timeout=config.ttl + 10)
        return handle

    def role(self, name: str, bucket: str | None = None) -> RoleHandle:
        """The handle of an added role.

        Raises:
            KeyError: If no such role was added.

        """
        for handle in self._roles.values():
            if handle.role == name and (bucket is None or handle.config.bucket == bucket):
                return handle
        raise KeyError(f"role {name!r} was not added to this elector")

    @property
    def roles(self) -> list[RoleHandle]:
        """Every added role."""
        return list(self._roles.values())

    @property
    def running(self) -> bool:
        """Whether the elector's loop is running."""
        return self._started and self.loop.is_running

    @property
    def start_error(self) -> ElectionError | None:
        """Why the last attempt to connect and start the roles failed.

        ``None`` once every role has started (or before the first attempt);
        meanwhile the elector keeps trying in the background.
        """
        error = self._start_error
        if error is None:
            return None
        if any(h.election.state is ElectionState.INIT for h in list(self._roles.values())):
            return error
        return None

    @property
    def connected(self) -> bool:
        """Whether the elector has connected (and started its roles)."""
        return self._connected.is_set()

    @property
    def nats_connected(self) -> bool:
        """Whether the NATS connection is up right now (``False`` while reconnecting)."""
        backend = self._backend
        return self._connected.is_set() and backend is not None and backend.is_connected

    # ---------------------------------------------------------- lifecycle

    def start(self, *, timeout: float = 10.0, require_connection: bool = True) -> None:
        """Start the loop thread, connect, and start every role.

        Args:
            timeout: Seconds to wait for the connection and the first
                decision of every role.
            require_connection: With ``True``, raise when NATS cannot be
                reached; with ``False``, keep trying in the background (and
                log every failure) while the caller goes on.

        Raises:
            NatsUnavailableError: No connection within ``timeout`` (only with
                ``require_connection``).
            ElectionError: A permanent problem (missing bucket, no JetStream, ...).
            ElectionStoppedError: :meth:`stop` was called (from another
                thread) before the start succeeded.

        """
        if self._started:
            return
        self.loop.start()
        self._started = True
        if require_connection:

            def attempt(remaining: float) -> None:
                if not self._started:
                    # stop() came from another thread while this one waited
                    # to retry: the loop is gone, there is nothing to start.
                    raise ElectionStoppedError(_STOPPED_WHILE_STARTING)
                self.loop.run(self._connect_and_start_roles(remaining), remaining + 30)

            try:
                retry_transient(attempt, timeout=timeout, what="starting the leader election")
            except Exception as exc:
                stopped = not self._started
                self.stop()
                if stopped and not isinstance(exc, ElectionStoppedError):
                    # The loop stopped under a running attempt (its task was
                    # cancelled): say that, not what the cancellation looked like.
                    raise ElectionStoppedError(_STOPPED_WHILE_STARTING) from exc
                raise
            except BaseException:
                self.stop()
                raise
            if not self._started:
                # The start succeeded while stop() ran: the roles are stopped.
                raise ElectionStoppedError(_STOPPED_WHILE_STARTING)
            return
        self._connector = self.loop.run(self._spawn_connector(timeout), timeout)

    async def _spawn_connector(self, timeout: float) -> asyncio.Task[None]:
        return asyncio.get_running_loop().create_task(self._connect_forever(timeout))

    async def _connect_forever(self, timeout: float) -> None:
        """Connect and start the roles, retrying until it works; say why, periodically.

        Transient failures (NATS unreachable) retry with backoff; permanent
        ones (a missing bucket, a permission) every ``_PERMANENT_RETRY``
        seconds, in case an operator fixes them. Either way the reason is
        logged at once, then again at most every ``_REPEAT_INTERVAL``
        seconds, and kept in :attr:`start_error` for health checks.
        """
        backoff = Backoff(maximum=10.0, breaker_threshold=1_000_000)
        attempts = 0
        next_warning = 0.0
        while True:
            try:
                await self._connect_and_start_roles(timeout)
            except ElectionError as exc:
                attempts += 1
                self._start_error = exc
                permanent = not is_transient(exc)
                delay = _PERMANENT_RETRY if permanent else backoff.failure()
                now = time.monotonic()
                level = logging.DEBUG
                if now >= next_warning:
                    next_warning = now + _REPEAT_INTERVAL
                    level = logging.ERROR if permanent else logging.WARNING
                logger.log(
                    level,
                    "leader election is not running (%d failed attempt%s): %s: %s; retrying in %s",
                    attempts,
                    "" if attempts == 1 else "s",
                    type(exc).__name__,
                    exc,
                    _duration(delay),
                )
                await asyncio.sleep(delay)
                continue
            if attempts:
                logger.warning("leader election started after %d failed attempt(s)", attempts)
            self._start_error = None
            return

    async def _connect_and_start_roles(self, timeout: float) -> None:
        if self._backend is None:
            if self._backend_factory is not None:
                self._backend = self._backend_factory()
            else:
                self._backend = self._own_backend = await open_backend(
                    self.connect_options, listeners=[self], timeout=timeout, name=self._name
                )
        self._connected.set()
        # Every start runs to its end before an error is raised: a retry must
        # never start a role whose first start is still in flight.
        outcomes = await asyncio.gather(
            *(self._start_election(h) for h in list(self._roles.values())),
            return_exceptions=True,
        )
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        # A permanent error (or a cancellation) wins over a transient one.
        errors.sort(key=lambda exc: isinstance(exc, Exception) and is_transient(exc))
        if errors:
            raise errors[0]

    async def _start_election(self, handle: RoleHandle) -> None:
        election = handle.election
        if election.state is not ElectionState.INIT:
            return
        assert self._backend is not None
        election.bind(self._backend)
        try:
            await election.start()
        finally:
            handle._start_attempted.set()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every role (leaders release their keys first), then disconnect. Idempotent."""
        if not self._started:
            return
        self._started = False
        if self.loop.is_running:
            try:
                self.loop.run(self._shutdown(), timeout)
            except (TimeoutError, RuntimeError):
                logger.warning("leader election did not stop within %.1fs", timeout)
        self.loop.stop()
        self._connected.clear()
        for handle in list(self._roles.values()):
            handle._start_attempted.set()  # release waiters: the roles are stopped

    async def _shutdown(self) -> None:
        if self._connector is not None:
            self._connector.cancel()
        await asyncio.gather(
            *(h.election.stop() for h in list(self._roles.values())), return_exceptions=True
        )
        own, self._own_backend = self._own_backend, None
        if own is not None:
            self._backend = None
            await own.close()

    def __enter__(self) -> Elector:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # --------------------------------------------------------- listeners

    def disconnected(self) -> None:
        """Connection lost: wake every role so it applies its disconnect grace."""
        for handle in list(self._roles.values()):
            handle.election.wake()

    def reconnected(self) -> None:
        """Connection back: wake every role so it renews or campaigns now."""
        for handle in list(self._roles.values()):
            handle.election.wake()

    # ------------------------------------------------------------ buckets

    def open_bucket(
        self,
        name: str,
        *,
        create: bool = False,
        persistent: bool = False,
        ttl: float | None = None,
        replicas: int = 1,
        timeout: float = 5.0,
    ) -> Bucket:
        """Open another KV bucket on this elector's connection (for example the beat state).

        The returned bucket's coroutines must run on :attr:`loop`
        (``elector.loop.run(bucket.get(key, timeout=1), 2)``).

        Args:
            name: The bucket.
            create: Create it when missing.
            persistent: Its data must not expire: created without ``max_age``,
                refused if it has one (see :meth:`Backend.open_bucket`).
            ttl: The ``max_age`` it must have; ``None`` skips the check.
            replicas: Replicas when creating it.
            timeout: Seconds to wait.

        Returns:
            The bucket.

        Raises:
            NatsUnavailableError: Not connected yet.
            BucketNotFoundError: Missing and ``create`` is false.
            BucketConfigError: Its ``max_age`` is wrong.

        """
        backend = self._backend
        if backend is None or not self.running:
            raise NatsUnavailableError("not connected to NATS yet")
        return self.loop.run(
            backend.open_bucket(
                name,
                ttl=ttl,
                create=create,
                replicas=replicas,
                timeout=timeout,
                persistent=persistent,
            ),
            timeout + 5,
        )

    # ------------------------------------------------------------- status

    def status(self, bucket: str | None = None, *, timeout: float = 5.0) -> list[RoleStatus]:
        """Every role in ``bucket`` with its leader, as the status commands print it.

        Args:
            bucket: The bucket; default the first added role's bucket.
            timeout: Seconds to wait.

        Returns:
            One :class:`~celery_nats_leader.election.status.RoleStatus` per role.

        """
        if self._backend is None:
            raise NatsUnavailableError("not connected to NATS yet")
        if bucket is None:
            bucket = next(iter(self._roles.values())).config.bucket if self._roles else "leaders"
        mine = [h.config for h in self._roles.values() if h.config.bucket == bucket]
        strategy = mine[0].strategy if mine else "kv"
        roles = [config.role for config in mine]
        backend = self._backend
        report = self.loop.run(
            read_report(
                backend, bucket, configured_roles=roles, strategy=strategy, timeout=timeout
            ),
            timeout + 5,
        )
        return list(report.roles)
