"""The Celery side of the leader scheduler: a thin mixin over Celery's scheduler hooks.

:class:`LeaderSchedulerMixin` adapts Celery's ``Scheduler`` hooks
(``setup_schedule``, ``tick``, ``apply_async``, ``should_sync``/``sync``,
``close``, ``info``) to the parts that do the work, none of which imports
Celery: the beat role (:mod:`celery_nats_leader.beat.election`), tick
identity and planning (:mod:`celery_nats_leader.beat.ticks`), the state in KV
(:mod:`celery_nats_leader.beat.state`) and the dispatcher that validates the
token, commits, sends and reverts (:mod:`celery_nats_leader.beat.dispatcher`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from types import FrameType
from typing import TYPE_CHECKING, Any

from celery.beat import PersistentScheduler

from celery_nats_leader.beat.dispatcher import Outcome, Tick, TickDispatcher
from celery_nats_leader.beat.election import BeatElection
from celery_nats_leader.beat.fence import (
    DISPATCHER_HEADER,
    ENTRY_HEADER,
    ROLE_HEADER,
    RUN_HEADER,
    TICK_HEADER,
    TOKEN_HEADER,
)
from celery_nats_leader.beat.state import EntryState
from celery_nats_leader.beat.ticks import TickPlan, TickPlanner, slot_text, tick_task_id, to_utc
from celery_nats_leader.config import ElectionConfig
from celery_nats_leader.elector import Elector, RoleHandle
from celery_nats_leader.errors import (
    BucketConfigError,
    BucketNotFoundError,
    ElectionError,
    PermissionDeniedError,
)
from celery_nats_leader.settings import LeaderSettings
from celery_nats_leader.token import FencingToken

if TYPE_CHECKING:
    # Celery is untyped: type-check the mixin as a Scheduler (``Any``).
    from celery.beat import Scheduler as _SchedulerBase
else:
    _SchedulerBase = object

__all__ = ["LeaderScheduler", "LeaderSchedulerMixin"]

logger = logging.getLogger(__name__)


def _beat_nodename() -> str:
    # celery.beat.beat_nodename exists from Celery 5.7 on.
    import celery.beat

    nodename = getattr(celery.beat, "beat_nodename", None)
    if callable(nodename):
        return str(nodename())
    return f"celerybeat@{socket.gethostname()}"


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGTERM and SIGINT back while a committed tick is being sent.

    ``celery beat``'s SIGTERM handler closes the scheduler and raises
    ``SystemExit`` wherever the main thread is; between the commit and the
    send that would lose the tick on a plain graceful stop. Python runs
    signal handlers on the main thread only, so swapping the handlers there
    for the few hundred microseconds of the send is enough. Elsewhere (the
    embedded beat thread) signals never interrupt this code.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[tuple[int, FrameType | None]] = []

    def defer(signum: int, frame: FrameType | None) -> None:
        pending.append((signum, frame))

    saved: dict[int, Any] = {}
    try:
        for held in (signal.SIGTERM, signal.SIGINT):
            saved[held] = signal.signal(held, defer)
        yield
    finally:
        for number, handler in saved.items():
            signal.signal(number, handler)
        for signum, frame in pending:
            handler = saved.get(signum)
            if callable(handler):
                handler(signum, frame)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(signum)


# ---------------------------------------------------------------- scheduler


class LeaderSchedulerMixin(_SchedulerBase):  # type: ignore[misc]  # Celery is untyped
    """Makes any Celery scheduler dispatch only while it leads the beat role.

    Put it first among the bases of a Celery scheduler class::

        class MyLeaderScheduler(LeaderSchedulerMixin, MyScheduler):
            pass

    The wrapped scheduler keeps providing the *entries* (what to run, on which
    schedule, with which options); their *state* (the last tick dispatched and
    the run count) comes from KV, and the wrapped scheduler's own copy
    (``last_run_at``, ``total_run_count``) is updated by the leader for
    display only. Configuration comes from the app's ``nats_leader_*``
    settings (see :class:`~celery_nats_leader.settings.LeaderSettings`).

    The mixin only adapts Celery's hooks; the work is done by parts composed
    in: :class:`~celery_nats_leader.beat.election.BeatElection` (the role),
    :class:`~celery_nats_leader.beat.ticks.TickPlanner` (which tick is due)
    and :class:`~celery_nats_leader.beat.dispatcher.TickDispatcher`
    (validate, commit, send, revert).

    Override :meth:`dispatch_gate` for entry-level rules (enabled flags, start
    dates) and :meth:`record_run` to mirror a dispatch into the wrapped
    scheduler's storage.
    """

    def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
        # Read (and validate) the settings first: a bad value stops beat here
        # with a message naming the setting, even for a lazy instance.
        #: The election settings (read once; see :meth:`leader_settings`).
        self.nats_leader_settings = self.leader_settings(app)
        settings = self.nats_leader_settings
        self.nats_leader_election = BeatElection(
            settings, self._election_config(settings), self.make_elector
        )
        self.nats_leader_planner = TickPlanner(settings.beat_max_catch_up)
        self.nats_leader_dispatcher: TickDispatcher | None = None
        self._closed = False
        self._unsynced = 0
        self._sending = False
        self._broken: dict[str, float] = {}
        super().__init__(app, *args, **kwargs)

    # ------------------------------------------------------------ queries

    @property
    def beat_role(self) -> RoleHandle | None:
        """The beat role's handle (``None`` before :meth:`setup_schedule`)."""
        return self.nats_leader_election.handle

    @property
    def is_leader(self) -> bool:
        """Whether this scheduler is the active one right now."""
        return self.nats_leader_election.is_leader

    @property
    def instance_id(self) -> str:
        """This scheduler's election id."""
        return self.nats_leader_election.config.instance_id

    def entry_states(self) -> dict[str, EntryState]:
        """The KV state of every entry, as last read or written by this leader."""
        dispatcher = self.nats_leader_dispatcher
        return dict(dispatcher.states) if dispatcher is not None else {}

    # ------------------------------------------------------------- hooks

    @classmethod
    def leader_settings(cls, app: Any) -> LeaderSettings:
        """The election settings of this scheduler (read once, at construction).

        Args:
            app: The Celery app.

        Returns:
            ``LeaderSettings.from_celery(app.conf)``; subclasses may read them
            elsewhere (the Django scheduler also reads ``NATS_LEADER``).

        Raises:
            ConfigError: On an invalid value; the message names the setting.

        """
        return LeaderSettings.from_celery(app.conf)

    def make_elector(self) -> Elector:
        """Build the elector that hosts the beat role (one loop thread, one connection).

        Returns:
            An elector, not started. Tests override this to use the
            in-memory backend.

        """
        settings = self.nats_leader_settings
        return Elector(
            settings.servers,
            connect_options=settings.connect_options,
            name=f"celery-nats-leader beat {self.instance_id}",
        )

    def dispatch_gate(self, entry: Any, state: EntryState) -> float | None:
        """Entry-level rules checked before a due tick is dispatched.

        Called on the leader only, for an entry whose tick is due.

        Args:
            entry: The schedule entry.
            state: Its KV state.

        Returns:
            ``None`` to dispatch, or seconds after which to ask again.

        """
        return None

    def record_run(self, entry: Any, state: EntryState) -> None:
        """Mirror a dispatched tick into the wrapped scheduler's entry.

        KV holds the authoritative state; this keeps ``last_run_at`` and
        ``total_run_count`` of the scheduler's own storage meaningful for
        display (shelve file, database admin). Called on the leader only.

        Args:
            entry: The schedule entry.
            state: Its new state (``state.slot`` is the tick dispatched).

        """
        entry.last_run_at = state.slot.astimezone(self.app.timezone)
        entry.total_run_count = state.runs
        self._unsynced += 1

    # ------------------------------------------------------- Celery hooks

    def setup_schedule(self) -> None:
        """Set the wrapped scheduler up, then join the election for the beat role.

        Raises:
            ElectionError: With ``nats_leader_required``, when NATS cannot be
                reached; always, on a permanent problem (bucket missing,
                permission denied). Beat stops with the message.

        """
        super().setup_schedule()
        election = self.nats_leader_election
        election.start()
        if self.nats_leader_dispatcher is None:
            assert election.store is not None
            self.nats_leader_dispatcher = TickDispatcher(
                election.store, self.instance_id, send_guard=_signals_deferred
            )

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """One scheduler pass: dispatch at most one due tick, if leading.

        Returns:
            Seconds until the next pass is wanted.

        Raises:
            ElectionError: The election or the state bucket failed permanently.

        """
        election = self.nats_leader_election
        handle = election.handle
        dispatcher = self.nats_leader_dispatcher
        if handle is None or dispatcher is None or self._closed:
            return float(self.max_interval)
        token = handle.token
        if token is None:
            # A follower: no reserve, no advance, no sync; wait and look again.
            if dispatcher.term is not None:
                dispatcher.end_term()
            election.follow(float(self.max_interval))
            return 0.0
        if dispatcher.term != token:
            try:
                dispatcher.begin_term(token)
            except (BucketNotFoundError, BucketConfigError, PermissionDeniedError):
                raise
            except ElectionError as exc:
                logger.warning(
                    "nats-leader beat: could not load the schedule state (%s); retrying", exc
                )
                return self._retry_delay()
        return self._lead(handle, token, dispatcher)

    def should_sync(self) -> bool:
        """Sync only what this scheduler dispatched: a follower never syncs.

        Never in the middle of a dispatch either (Celery's ``apply_async``
        asks): a sync may replace the entry objects being worked on.
        """
        if self._sending or not self._unsynced:
            return False
        return bool(super().should_sync())

    def sync(self) -> None:
        """Persist the wrapped scheduler's storage (dispatched runs only)."""
        super().sync()
        self._unsynced = 0

    def close(self) -> None:
        """Sync, release the broker connection, then release leadership.

        The release deletes the role's key, so a successor is elected in
        milliseconds and continues the schedule from KV.
        """
        first = not self._closed
        self._closed = True
        try:
            super().close()
        finally:
            if first:
                self.nats_leader_election.stop()

    @property
    def info(self) -> str:
        """Lines for the ``celery beat`` banner."""
        settings = self.nats_leader_settings
        config = self.nats_leader_election.config
        lines = [str(super().info)] if super().info else []
        lines.append(
            f"    . leader election -> role {config.role!r} in KV bucket {config.bucket!r} "
            f"(ttl {config.ttl:g}s) on {', '.join(settings.servers)}"
        )
        lines.append(f"    . schedule state -> KV bucket {settings.beat_state_bucket!r}")
        return "\n".join(lines)

    # ------------------------------------------------------------ adapters

    def _election_config(self, settings: LeaderSettings) -> ElectionConfig:
        config = settings.election_config(settings.beat_role)
        cls = type(self)
        meta = {
            **config.meta,
            "worker": _beat_nodename(),
            "scheduler": f"{cls.__module__}.{cls.__qualname__}",
        }
        return dataclasses.replace(config, meta=meta)

    def _retry_delay(self) -> float:
        return self.nats_leader_election.retry_delay(float(self.max_interval))

    def _lead(self, handle: RoleHandle, token: FencingToken, dispatcher: TickDispatcher) -> float:
        """A leader's pass: dispatch the oldest due tick, or say when to look again."""
        wake = float(self.max_interval)
        best: _Due | None = None
        for name, entry in list(self.schedule.items()):
            state = dispatcher.states.get(name)
            if state is None:
                state = self._adopt(name, entry, handle, token, dispatcher)
                if state is None:
                    wake = min(wake, self._retry_delay())
                    continue
            plan = self._plan(name, entry, state)
            if plan is None:
                continue
            if not plan.due or plan.slot is None:
                wake = min(wake, plan.wait)
                continue
            if best is not None and plan.slot >= best.slot:
                continue
            gate = self.dispatch_gate(entry, state)
            if gate is not None:
                wake = min(wake, max(gate, 0.0))
                continue
            best = _Due(plan.slot, name, entry, state, plan)
        if best is None:
            return max(0.0, min(wake, float(self.max_interval)))
        return self._dispatch(handle, token, dispatcher, best)

    def _plan(self, name: str, entry: Any, state: EntryState) -> TickPlan | None:
        """The entry's next tick; ``None`` while its schedule cannot be calculated."""
        now_mono = time.monotonic()
        if self._broken.get(name, 0.0) > now_mono:
            return None
        try:
            now = entry.default_now()
            try:
                return self.nats_leader_planner.plan(name, entry.schedule, state.slot, now)
            except NotImplementedError:
                # A custom schedule with is_due() only: its ticks have no
                # slots; one is identified by the time it was found due (the
                # compare-and-set still commits it once).
                due, next_check = entry.schedule.is_due(state.slot.astimezone(self.app.timezone))
                if due:
                    return TickPlan(to_utc(now), True, 0.0)
                return TickPlan(None, False, float(next_check))
        except Exception:
            # As Celery: one entry that cannot be calculated must not stop the others.
            self._broken[name] = now_mono + float(self.max_interval)
            logger.exception(
                "nats-leader beat: cannot calculate the next run of %r; trying again in %gs",
                name,
                self.max_interval,
            )
            return None

    def _adopt(
        self,
        name: str,
        entry: Any,
        handle: RoleHandle,
        token: FencingToken,
        dispatcher: TickDispatcher,
    ) -> EntryState | None:
        """Give a new entry its KV state, anchored at its own last run (or now)."""
        if not handle.is_leader:
            return None
        last = getattr(entry, "last_run_at", None) or entry.default_now()
        return dispatcher.adopt(
            name,
            last,
            runs=int(getattr(entry, "total_run_count", 0) or 0),
            task=str(entry.task),
            token=token,
        )

    def _dispatch(
        self, handle: RoleHandle, token: FencingToken, dispatcher: TickDispatcher, due: _Due
    ) -> float:
        """Hand one due tick to the dispatcher. Returns the delay before the next pass."""
        # Connect to the broker before committing: a tick must not wait for
        # a broker connection between its commit and its send.
        producer = self.producer
        tick = Tick(due.name, due.slot, task=str(due.entry.task), skipped=due.plan.skipped)
        result = dispatcher.dispatch(
            handle, token, tick, lambda committed: self._send(due.entry, committed, token, producer)
        )
        outcome = result.outcome
        if outcome in (Outcome.UNCONFIRMED, Outcome.NOT_COMMITTED, Outcome.REVERTED):
            return 0.0 if not handle.is_leader else self._retry_delay()
        if outcome is Outcome.CONFLICT and result.state is None:
            return self._retry_delay()
        if outcome is not Outcome.SENT:
            return 0.0
        committed = result.state
        assert committed is not None
        if due.plan.skipped:
            logger.warning(
                "nats-leader beat: %r had %d overdue ticks (more than beat_max_catch_up=%d): "
                "skipped all but the latest, %s",
                due.name,
                due.plan.skipped + 1,
                self.nats_leader_settings.beat_max_catch_up,
                slot_text(committed.slot),
            )
        self.record_run(due.entry, committed)
        if self.should_sync():
            self._do_sync()
        return 0.0

    def _send(self, entry: Any, committed: EntryState, token: FencingToken, producer: Any) -> None:
        """Publish one committed tick through Celery's ``apply_async`` hook."""
        role = self.nats_leader_election.config.role
        slot = slot_text(committed.slot)
        headers = {
            TOKEN_HEADER: token.to_header(),
            ROLE_HEADER: role,
            ENTRY_HEADER: committed.entry,
            TICK_HEADER: slot,
            RUN_HEADER: committed.runs,
            DISPATCHER_HEADER: self.instance_id,
        }
        options = dict(entry.options or {})
        options["headers"] = {**(options.get("headers") or {}), **headers}
        options.setdefault(
            "task_id",
            tick_task_id(self.nats_leader_settings.beat_state_bucket, role, committed.entry, slot),
        )
        # Send a shallow clone carrying this tick's options: the entry itself
        # may be persisted (shelve, database) and must not keep them. No
        # __reduce__ (ModelEntry cannot be rebuilt that way): copy the fields.
        outgoing = object.__new__(type(entry))
        outgoing.__dict__.update(entry.__dict__)
        outgoing.options = options
        self._sending = True
        try:
            result = self.apply_async(outgoing, producer=producer, advance=False)
        finally:
            self._sending = False
        logger.info(
            "Scheduler: Sending due task %s (%s) tick %s run %d epoch %d id %s",
            committed.entry,
            entry.task,
            slot,
            committed.runs,
            token.epoch,
            getattr(result, "id", options["task_id"]),
        )


@dataclass(frozen=True)
class _Due:
    """A due tick chosen for dispatch."""

    slot: datetime
    name: str
    entry: Any
    state: EntryState
    plan: TickPlan


class LeaderScheduler(LeaderSchedulerMixin, PersistentScheduler):  # type: ignore[misc]
    """Celery's default scheduler (``PersistentScheduler``), dispatching only while leading.

    Entries come from ``beat_schedule`` as usual; their state (last tick, run
    count) lives in KV. The local shelve file (``-s``) is kept up to date by
    the leader for display only; any path works on every replica.

    Use it with ``celery beat -S nats_leader`` (the short alias) or
    ``-S celery_nats_leader.beat:LeaderScheduler``, or
    ``beat_scheduler = "nats_leader"`` for ``celery worker -B``.
    """
