"""What every election strategy shares: callbacks and lifecycle plumbing.

The words it uses (states, demote reasons, callback types, subjects) are in
:mod:`celery_nats_leader.election.vocabulary`; they are importable from here too.

:class:`BaseElection` holds the state and the machinery that do not depend on
how a leader is chosen: the callback registry and its runner, the lease
deadline that :attr:`~BaseElection.is_leader` checks on every call, the
loop-bound events that :meth:`~BaseElection.start` and
:meth:`~BaseElection.wait_for_leadership` wait on, the wakeable sleep of the
main loop, connecting, tearing down, failing loudly, health checks, resign and
takeover requests.

Each strategy subclasses it and supplies the algorithm:
:class:`~celery_nats_leader.election.KvElection` (the KV strategy) and
:class:`~celery_nats_leader.election.allcall.AllcallElection` (ALLCALL). What they
must provide is abstract here: :meth:`~BaseElection.start`,
:meth:`~BaseElection.stop`, :meth:`~BaseElection.validate_token`,
:meth:`~BaseElection.describe`, :attr:`~BaseElection.leader`,
:attr:`~BaseElection.leader_id`, and the private ``_loop``, ``_demote`` and
``_release``. Smaller differences are hooks with a documented default.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
import logging
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from celery_nats_leader.config import ElectionConfig
from celery_nats_leader.core import constants as c
from celery_nats_leader.core.backend import Backend, ConnectionListener, Subscription
from celery_nats_leader.core.clock import SYSTEM_CLOCK, Clock
from celery_nats_leader.core.errors import ConfigError, ElectionError, ElectionStoppedError
from celery_nats_leader.election.callbacks import CallbackRunner
from celery_nats_leader.election.control import ResignAnswer, ResignRequest
from celery_nats_leader.election.health import watch_health
from celery_nats_leader.election.observer import ElectionObserver, NullObserver
from celery_nats_leader.election.trail import EventTrail
from celery_nats_leader.election.vocabulary import (
    DemoteCallback,
    DemoteReason,
    ElectionState,
    ErrorCallback,
    LeaderChangeCallback,
    PromoteCallback,
    TransitionHook,
    control_subject,
)
from celery_nats_leader.term.record import LeaderRecord
from celery_nats_leader.term.token import FencingToken

if TYPE_CHECKING:
    from celery_nats_leader.config.connection import ConnectOptions
    from celery_nats_leader.election.leader_services import (
        LeaderServiceRunner,
        LeadingScope,
        ServiceFunction,
    )

logger = logging.getLogger(__name__)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class _Waker(ConnectionListener):
    """Wakes an election when its own connection goes down or comes back."""

    def __init__(self, election: BaseElection) -> None:
        self._election = election

    def disconnected(self) -> None:
        self._election.wake()

    def reconnected(self) -> None:
        self._election.wake()


class BaseElection(abc.ABC):
    """State and plumbing shared by the election strategies (one role each).

    Not used directly: see :func:`~celery_nats_leader.election.interface.new_election`.

    The one constructor of every strategy; a strategy sets up its own state
    in :meth:`_init_state`.

    Args:
        config: The role's configuration.
        backend: A ready backend: one shared with other roles (see
            :func:`celery_nats_leader.nats.open_backend`), or the in-memory
            one in tests. It is not closed by the election. When ``None``,
            the election opens its own from ``connect_options`` on
            :meth:`start` and closes it on :meth:`stop`.
        connect_options: Where to connect when ``backend`` is ``None``.
        clock: Monotonic clock for this process's own deadlines (injectable
            for tests).
        observer: Receives measurements (metrics).
        rng: Random source (jitter, tie-breakers).

    """

    #: The strategy module's logger: records keep the logger name they always had.
    _logger: ClassVar[logging.Logger] = logger
    #: Names the strategy's own connection and main task (``<prefix>-<role>``)
    #: and its crash message.
    _name_prefix: ClassVar[str] = "election"
    #: Errors after which retrying cannot help: the main loop stops with them
    #: as :attr:`error`, without the "loop crashed" traceback.
    _permanent_errors: ClassVar[tuple[type[ElectionError], ...]] = ()
    #: The ``ElectionConfig.strategy`` this class implements (``None``: any).
    _strategy: ClassVar[str | None] = None

    def __init__(
        self,
        config: ElectionConfig,
        backend: Backend | None = None,
        *,
        connect_options: ConnectOptions | None = None,
        clock: Clock | None = None,
        observer: ElectionObserver | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if self._strategy is not None and config.strategy != self._strategy:
            # Running one algorithm on a config that asks for another would be
            # a silent surprise: refuse and say how.
            raise ConfigError(
                f"{type(self).__name__} is the {self._strategy.upper()} strategy, but the config "
                f"has strategy={config.strategy!r}; build the election with "
                "celery_nats_leader.new_election(config), which returns the class of "
                "config.strategy"
            )
        self.config = config
        self._connect_options = connect_options
        self._backend: Backend | None = backend
        self._own_backend: Backend | None = None
        self._clock = clock or SYSTEM_CLOCK
        self._observer: ElectionObserver = observer or NullObserver()
        self._rng = rng or random.Random()
        self._state = ElectionState.INIT
        self._error: ElectionError | None = None

        # Leader side.
        self._token: FencingToken | None = None
        self._lease_deadline = 0.0
        self._term_started_at = 0.0
        self._last_confirmed_send = 0.0
        self._release_reason: DemoteReason | None = None
        self._health_task: asyncio.Task[None] | None = None

        # Eligibility.
        self._sit_out_until = 0.0
        self._next_takeover_at = 0.0
        self._disconnected_since: float | None = None

        self._promote_callbacks: list[PromoteCallback] = []
        self._demote_callbacks: list[DemoteCallback] = []
        self._change_callbacks: list[LeaderChangeCallback] = []
        self._error_callbacks: list[ErrorCallback] = []
        # A callback overrunning demote_timeout with later ones queued behind
        # it is abandoned: the election stops waiting for demote callbacks
        # then anyway, and an on_demote stuck behind a hung on_promote would
        # leave the user's code leading while a successor does.
        self._callbacks = CallbackRunner(f"{config.role}", abandon_after=config.demote_timeout)
        # Demote callbacks that outlived demote_timeout: the teardown does not
        # wait for them a second time (a stop would take twice the bound).
        self._overdue_callbacks: asyncio.Future[None] | None = None
        # Called synchronously on the loop at every state change (leader
        # services must be told to stop at that instant, not after the
        # callbacks queued before them).
        self._transition_hooks: list[TransitionHook] = []
        # Called synchronously on the loop whenever the lease deadline moves
        # (a renewal, a successor's promise): a copy of the deadline kept
        # elsewhere (a worker's pool children) must never outlast this one.
        self._lease_listeners: list[Callable[[], None]] = []
        # Why the term is ending, set just before the state leaves LEADER so
        # that the hooks can tell the services (consumed by _set_state).
        self._ending_reason: DemoteReason | None = None
        # Loop-bound: created in start(), never here.
        self._wake: asyncio.Event | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._decided: asyncio.Event | None = None
        self._leading: asyncio.Event | None = None
        self._main_task: asyncio.Task[None] | None = None
        self._subscriptions: list[Subscription] = []
        # The event trail: transitions waiting to be published, in order.
        self._trail = EventTrail(
            config,
            self._clock,
            lambda: self._backend,
            self._logger,
            f"{self._name_prefix}-events-{config.role}",
        )
        self._init_state()

    @abc.abstractmethod
    def _init_state(self) -> None:
        """Set up the strategy's own state; called at the end of ``__init__``.

        Raises:
            ConfigError: If the configuration does not suit the strategy.

        """

    # ------------------------------------------------------------------ API

    @property
    def role(self) -> str:
        """The role this election is for."""
        return self.config.role

    @property
    def instance_id(self) -> str:
        """This candidate's id."""
        return self.config.instance_id

    @property
    def state(self) -> ElectionState:
        """The current state (a leader past its lease reports ``FOLLOWER``)."""
        if self._state is ElectionState.LEADER and not self._lease_valid():
            return ElectionState.FOLLOWER
        return self._state

    @property
    def is_leader(self) -> bool:
        """Whether this process leads the role *now*.

        Checked against the local lease deadline on the monotonic clock at
        every call, so it turns ``False`` on time even if the event loop is
        late. Safe to read from any thread.
        """
        return self._state is ElectionState.LEADER and self._lease_valid()

    @property
    def token(self) -> FencingToken | None:
        """The current term's fencing token while leading, else ``None``."""
        return self._token if self.is_leader else None

    @property
    @abc.abstractmethod
    def leader(self) -> LeaderRecord | None:
        """The leader this process knows of (ours while leading), or ``None``."""

    @property
    @abc.abstractmethod
    def leader_id(self) -> str | None:
        """The id of the leader this process knows of, or ``None`` when the role looks free."""

    @property
    def error(self) -> ElectionError | None:
        """The permanent error that stopped the election, if any."""
        return self._error

    @property
    def lease_remaining(self) -> float:
        """Seconds left on the local lease (0 when not leading)."""
        if self._state is not ElectionState.LEADER:
            return 0.0
        return max(0.0, self._lease_deadline - self._clock.monotonic())

    def bind(self, backend: Backend) -> None:
        """Use ``backend`` (a connection shared with other roles) instead of connecting.

        Raises:
            ElectionStoppedError: If the election was started already.

        """
        if self._state is not ElectionState.INIT:
            raise ElectionStoppedError("bind() must be called before start()")
        self._backend = backend

    def wake(self) -> None:
        """Re-evaluate now; called when the connection goes down or comes back."""
        if self._trail.pending:
            self._trail.schedule_flush()
        if self._wake is not None:
            self._wake.set()
        if self._waiter is not None:
            _resolve(self._waiter)

    def on_promote(self, callback: PromoteCallback) -> PromoteCallback:
        """Register ``callback(token)``, called when this process becomes leader.

        Usable as a decorator. Sync callbacks run on a worker thread, async
        ones on the loop; either way never on the renewal path.
        """
        self._promote_callbacks.append(callback)
        return callback

    def on_demote(self, callback: DemoteCallback) -> DemoteCallback:
        """Register ``callback(reason)``, called when this process stops leading.

        See :class:`DemoteReason`, and the strategy's class for the reasons it uses.
        """
        self._demote_callbacks.append(callback)
        return callback

    def on_leader_change(self, callback: LeaderChangeCallback) -> LeaderChangeCallback:
        """Register ``callback(record_or_None)``, called when the known leader changes."""
        self._change_callbacks.append(callback)
        return callback

    def on_error(self, callback: ErrorCallback) -> ErrorCallback:
        """Register ``callback(error)``, called when an error stops the election."""
        self._error_callbacks.append(callback)
        return callback

    def run_while_leading(
        self,
        service: ServiceFunction,
        *,
        name: str | None = None,
        grace: float | None = None,
    ) -> LeaderServiceRunner:
        """Run ``service(ctx)`` for as long as this process leads, every term.

        Started on each promotion and stopped when the term ends: a
        coroutine function as a task on this loop (cancelled), a plain
        function on a thread of its own (``ctx.stopped`` turns true, it must
        return). See :mod:`celery_nats_leader.election.leader_services`. Register
        before :meth:`start`, or on the election's loop.

        Args:
            service: The service; it receives a
                :class:`~celery_nats_leader.election.leader_services.LeaderContext`.
            name: For logs; default the function's name.
            grace: Seconds a stopping service is awaited before the term is
                released; default ``lease_margin``.

        Returns:
            The service's handle (``runs``, ``running``, ``close()``).

        """
        from celery_nats_leader.election.leader_services import LeaderServiceRunner

        runner = LeaderServiceRunner(self, service, name=name, grace=grace)
        self._transition_hooks.append(runner.transition)
        # Async: runs on the loop, awaited by a release before the key goes.
        self._demote_callbacks.append(runner.demoted)
        if self._state is ElectionState.LEADER and self.is_leader:
            runner.transition(ElectionState.FOLLOWER, ElectionState.LEADER)
        return runner

    def leading(self, timeout: float | None = None) -> LeadingScope:
        """``async with election.leading() as ctx:`` runs the block while leading.

        Waits for leadership, then runs the block; if the term ends inside,
        the block is cancelled and raises
        :class:`~celery_nats_leader.core.errors.LeadershipLostError`.

        Args:
            timeout: Seconds to wait for leadership (``TimeoutError`` after).

        Returns:
            The scope; ``ctx.token`` is the term's fencing token.

        """
        from celery_nats_leader.election.leader_services import LeadingScope

        return LeadingScope(self, timeout)

    def add_transition_hook(self, hook: TransitionHook) -> None:
        """Call ``hook(old, new)`` synchronously on the loop at every state change.

        For leader services (:mod:`celery_nats_leader.election.leader_services`),
        which must be told at the instant a term ends, not after the
        callbacks queued before them.
        """
        self._transition_hooks.append(hook)

    def remove_transition_hook(self, hook: TransitionHook) -> None:
        """Stop calling ``hook`` (no error if it was not added)."""
        with contextlib.suppress(ValueError):
            self._transition_hooks.remove(hook)

    def add_lease_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` synchronously on the loop whenever the lease deadline moves.

        For a copy of the deadline kept outside the election (the worker's
        shared block that its pool children read): with fast failover the
        deadline moves with every promise, and it can move *earlier* (a
        successor designated), so the copy is refreshed at that instant.
        Read :attr:`lease_remaining` in it.
        """
        self._lease_listeners.append(listener)

    def _lease_moved(self) -> None:
        for listener in list(self._lease_listeners):
            try:
                listener()
            except Exception:
                self._logger.exception("%s: lease listener %r raised", self.role, listener)

    @property
    def recorded_state(self) -> ElectionState:
        """The state as last set, without the lease check that :attr:`state` makes."""
        return self._state

    @property
    def ending_reason(self) -> DemoteReason | None:
        """Why the term is ending, while it ends; else ``None``.

        Set just before the state leaves LEADER and cleared once the
        transition hooks have run, so the hooks can tell the leader services.
        """
        return self._ending_reason

    @abc.abstractmethod
    async def start(self, *, wait: float | None = None) -> None:
        """Join the election (see the strategy for what it waits for).

        Args:
            wait: Seconds to wait for the first decision.

        """

    @abc.abstractmethod
    async def stop(self) -> None:
        """Leave the election, releasing leadership. Idempotent."""

    async def resign(self) -> None:
        """Step down if leading: demote callbacks first, then the term is released.

        This process then sits out for one TTL, so that another candidate
        takes the role (if there is none, this one leads again).
        """
        if self._state is not ElectionState.LEADER or self._wake is None:
            return
        await self._release(DemoteReason.RESIGNED)

    @abc.abstractmethod
    async def validate_token(self) -> bool:
        """Confirm, as far as the strategy can, that this process still holds its term.

        Returns:
            ``True`` only if the term was confirmed and the local lease is
            still valid; ``False`` on any doubt.

        """

    async def wait_for_leadership(self, timeout: float | None = None) -> bool:
        """Wait until this process leads.

        Args:
            timeout: Seconds to wait; ``None`` waits indefinitely.

        Returns:
            ``True`` if leading, ``False`` if the timeout passed first.

        Raises:
            ElectionError: The election stopped on an error.
            ElectionStoppedError: The election is stopped or was never started.

        """
        if self.is_leader:
            return True
        if self._leading is None or self._state is ElectionState.STOPPED:
            if self._error is not None:
                raise self._error
            raise ElectionStoppedError(f"election for {self.role!r} is not running")
        try:
            await asyncio.wait_for(self._wait_leading(), timeout)
        except asyncio.TimeoutError:
            return False
        if self._error is not None:
            raise self._error
        return self.is_leader

    async def _wait_leading(self) -> None:
        assert self._leading is not None
        while not self.is_leader and self._state is not ElectionState.STOPPED:
            self._leading.clear()
            await self._leading.wait()

    @abc.abstractmethod
    def describe(self) -> dict[str, Any]:
        """This candidate as the roster and status commands show it.

        Returns:
            A JSON-serializable dict.

        """

    # ------------------------------------------------------ strategy parts

    @abc.abstractmethod
    async def _loop(self) -> None:
        """The strategy's main loop, until the state is ``STOPPED``."""

    @abc.abstractmethod
    def _demote(self, reason: DemoteReason) -> None:
        """Stop leading at once (state first, callbacks after); no-op unless leading."""

    @abc.abstractmethod
    async def _release(self, reason: DemoteReason) -> None:
        """Graceful hand-over: demote callbacks first, then give the term up."""

    def _may_take_over(self, leader_id: str, now: float) -> bool:
        """Whether this process may ask ``leader_id`` for the role now (rank aside)."""
        return now >= self._sit_out_until

    def _state_log_level(self, old: ElectionState, new: ElectionState) -> int:
        """The level at which the change from ``old`` to ``new`` is logged."""
        return logging.INFO

    def _decides(self, old: ElectionState, new: ElectionState) -> bool:
        """Whether the change from ``old`` to ``new`` lets :meth:`start` return."""
        return new is ElectionState.LEADER

    async def _respond(self, reply: str, body: Any) -> None:
        """Answer a control request; a failure propagates to the backend, which logs it."""
        assert self._backend is not None
        await self._backend.publish(reply, json.dumps(body).encode())

    # ------------------------------------------------------------ plumbing

    async def _prepare_start(self) -> Backend:
        """Refuse a second start, create the loop-bound events and open the backend."""
        if self._state is not ElectionState.INIT:
            raise ElectionStoppedError(f"election for {self.role!r} was already started")
        self._wake = asyncio.Event()
        self._decided = asyncio.Event()
        # Kept across a failed start retried later: waiters of
        # wait_for_leadership() from the first attempt must see this one.
        self._leading = self._leading or asyncio.Event()
        return await self._open_backend()

    async def _launch(self, wait: float) -> None:
        """Start the main loop, then wait up to ``wait`` seconds for the first decision.

        When the decision is to lead, returns once the promote callbacks
        (queued with it) have returned too, within the same ``wait``. Waiting
        for them explicitly is what makes that order hold; before, it hung on
        ``asyncio.wait_for`` taking one more loop iteration to resume this
        coroutine (it wrapped the awaitable in a task up to Python 3.11; from
        3.12 it awaits it directly, and ``start()`` returned before an async
        ``on_promote`` had run). A follower returns at once: a barrier costs
        loop turns, which a loop busy with many candidates makes long.
        """
        assert self._decided is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        self._main_task = loop.create_task(self._run(), name=f"{self._name_prefix}-{self.role}")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._decided.wait(), wait)
        if self._decided.is_set() and self.is_leader:
            callbacks_done = self._callbacks.barrier()
            await asyncio.wait({callbacks_done}, timeout=max(0.0, deadline - loop.time()))

    async def _open_backend(self) -> Backend:
        if self._backend is not None:
            return self._backend
        # Imported here: an election on the in-memory backend never loads nats-py.
        from celery_nats_leader.nats import open_backend

        # ALLCALL uses only the core-NATS half of this backend: no JetStream call.
        self._backend = self._own_backend = await open_backend(
            self._connect_options,
            name=f"{self._name_prefix}-{self.role}",
            listeners=[_Waker(self)],
        )
        return self._backend

    async def _teardown(self) -> None:
        # The last events (the release of a stop) go out before the connection closes.
        await self._trail.close()
        await self._unsubscribe_all()
        self._stop_health_watch()
        overdue = self._overdue_callbacks
        # Callbacks that already outlived demote_timeout get no second wait.
        wait = 0.0 if overdue is not None and not overdue.done() else self.config.demote_timeout
        await self._callbacks.stop(wait)
        await self._close_own_backend()
        if self._leading is not None:
            self._leading.set()

    async def _abandon_start(self) -> None:
        """Undo a failed start: the election stays in INIT and may start again.

        Subscriptions made so far go, the callback runner stops, and a
        connection this election opened is closed (it must not stay behind,
        reconnecting and logging forever, after ``start()`` raised).
        """
        await self._unsubscribe_all()
        await self._callbacks.stop()
        await self._close_own_backend()

    async def _unsubscribe_all(self) -> None:
        for sub in self._subscriptions:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subscriptions.clear()

    async def _close_own_backend(self) -> bool:
        """Close the backend this election opened, if any; return whether there was one."""
        own, self._own_backend = self._own_backend, None
        if own is None:
            return False
        if self._backend is own:
            self._backend = None  # a restart after a failed start opens a new one
        await own.close()
        return True

    async def _cancel_main(self) -> None:
        task, self._main_task = self._main_task, None
        if task is None or task is asyncio.current_task():
            return
        # Cancel until it is done: a library call inside the task may swallow
        # one cancellation (asyncio.wait_for on Python 3.11 can).
        while not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=0.1)

    async def _sleep_until(self, deadline: float) -> None:
        """Wait until ``deadline`` (monotonic) or until :meth:`wake` is called.

        Awaits a plain future rather than ``asyncio.wait_for``: on Python 3.11
        ``wait_for`` can swallow a cancellation that arrives just as its
        timeout fires, which would let the loop outlive :meth:`stop`.
        """
        assert self._wake is not None
        delay = deadline - self._clock.monotonic()
        if self._wake.is_set() or delay <= 0:
            self._wake.clear()
            return
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._waiter = waiter
        timer = loop.call_later(delay, _resolve, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None
            self._wake.clear()

    # ------------------------------------------------------------ events

    def _notify_promoted(self, token: FencingToken) -> asyncio.Future[None]:
        """Publish the ``promoted`` event, then run the promote callbacks."""
        self._trail.promoted(token.epoch)
        return self._callbacks.submit(self._promote_callbacks, token)

    def _notify_demoted(self, reason: DemoteReason) -> asyncio.Future[None]:
        """Publish the end of the term (its kind follows ``reason``), then run the callbacks."""
        term_age = round(self._clock.monotonic() - self._term_started_at, 3)
        self._trail.ended(reason, term_age)
        return self._callbacks.submit(self._demote_callbacks, reason)

    async def _demote_callbacks_done(self, done: asyncio.Future[None]) -> bool:
        """Wait for demote callbacks (``done``) at most ``demote_timeout``; whether they returned.

        A stop or a release waits for them so that leader work has stopped
        before the term is given up; a callback that hangs must not hang the
        stop, nor freeze the role's loop after a release.
        """
        await asyncio.wait({done}, timeout=self.config.demote_timeout)
        if done.done():
            return True
        self._overdue_callbacks = done
        self._logger.warning(
            "%s: demote callbacks still running after %.1fs (demote_timeout); "
            "not releasing the term, it ends when its lease runs out",
            self.role,
            self.config.demote_timeout,
        )
        return False

    def _lease_valid(self) -> bool:
        return self._clock.monotonic() < self._lease_deadline

    def _set_state(self, new: ElectionState) -> None:
        old = self._state
        if old is new:
            return
        self._state = new
        self._logger.log(
            self._state_log_level(old, new),
            "%s: %s -> %s (%s)",
            self.role,
            old.value,
            new.value,
            self.instance_id,
        )
        self._observer.state_changed(self.role, self.instance_id, old.value, new.value)
        for hook in list(self._transition_hooks):
            try:
                hook(old, new)
            except Exception:
                self._logger.exception("%s: transition hook %r raised", self.role, hook)
        self._ending_reason = None
        if self._decided is not None and self._decides(old, new):
            self._decided.set()
        if self._leading is not None:
            self._leading.set()

    async def _run(self) -> None:
        try:
            await self._loop()
        except asyncio.CancelledError:
            raise
        except self._permanent_errors as exc:
            await self._fail(exc)
        except Exception as exc:
            # The prefix goes into the format string itself, so that the
            # record's template stays "%s: election loop crashed" (grouping
            # by template, as error trackers do, is unchanged).
            self._logger.exception(f"%s: {self._name_prefix} loop crashed", self.role)
            await self._fail(ElectionError(f"{self._name_prefix} loop crashed: {exc!r}"))

    async def _fail(self, exc: ElectionError) -> None:
        self._logger.error("%s: election stopped: %s", self.role, exc)
        self._error = exc
        if self._state is ElectionState.LEADER:
            self._demote(DemoteReason.ERROR)
        self._set_state(ElectionState.STOPPED)
        if self._decided is not None:
            self._decided.set()
        await self._callbacks.submit(self._error_callbacks, exc)
        self._main_task = None
        await self._teardown()

    def _watch_health(self, token: FencingToken) -> None:
        """Run the configured health check, if any, for as long as ``token``'s term lasts."""
        cfg = self.config
        if cfg.health_check is not None:
            self._health_task = asyncio.get_running_loop().create_task(
                watch_health(cfg, lambda: self._token is token, self._resign_unhealthy),
                name=f"health-{cfg.role}",
            )

    def _stop_health_watch(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            self._health_task = None

    def _resign_unhealthy(self) -> None:
        self._release_reason = DemoteReason.HEALTH_CHECK_FAILED
        self.wake()

    async def _maybe_take_over(self, leader_id: str, leader_priority: int, now: float) -> None:
        """Ask a leader of lower priority to hand over, at most once per TTL."""
        cfg = self.config
        if (
            not cfg.allow_takeover
            or leader_priority >= cfg.priority
            or now < self._next_takeover_at
            or not self._may_take_over(leader_id, now)
        ):
            return
        self._next_takeover_at = now + cfg.ttl
        assert self._backend is not None
        request = ResignRequest(
            requester=cfg.instance_id, priority=cfg.priority, reason="takeover"
        ).encode()
        try:
            reply = await self._backend.request(
                control_subject(cfg.bucket, cfg.role, c.RESIGN_VERB),
                request,
                timeout=cfg.request_timeout,
            )
        except ElectionError as exc:
            self._logger.debug("%s: takeover request unanswered: %s", self.role, exc)
            return
        self._logger.info("%s: asked leader %s to hand over: %s", self.role, leader_id, reply[:200])

    async def _on_resign_request(self, data: bytes, reply: str | None) -> None:
        request = ResignRequest.decode(data)
        leading = self.is_leader
        if leading and request.verify:
            # A fence asks first and ends the term itself when nobody answers
            # in time; a leader that was paused reads the request only when it
            # runs again, maybe after the fence: confirm the term first, so it
            # steps down as fenced rather than "resign" a term it lost.
            leading = await self.validate_token()
        priority = request.priority
        accepted = leading
        if leading and priority is not None and priority <= self.config.priority:
            accepted = False  # a takeover request from a candidate not preferred over us
        if request.leader_id is not None and request.leader_id != self.instance_id:
            accepted = False  # meant for a leader that is no longer us (the role moved)
        if accepted:
            self._release_reason = (
                DemoteReason.TAKEOVER if priority is not None else DemoteReason.RESIGNED
            )
            self._logger.info("%s: asked to step down by %s", self.role, request.requester)
            self.wake()
        if reply and self._backend is not None and leading:
            await self._respond(reply, ResignAnswer(self.instance_id, accepted).to_dict())


__all__ = [
    "BaseElection",
    "DemoteCallback",
    "DemoteReason",
    "ElectionState",
    "ErrorCallback",
    "LeaderChangeCallback",
    "PromoteCallback",
    "control_subject",
]
