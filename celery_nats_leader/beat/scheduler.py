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
import math
import multiprocessing
import signal
import threading
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from types import FrameType
from typing import TYPE_CHECKING, Any

from celery import beat as celery_beat
from celery.beat import PersistentScheduler
from celery.schedules import crontab
from celery.schedules import schedule as celery_schedule
from kombu.exceptions import OperationalError, SerializationError

from celery_nats_leader.beat.agenda import Agenda
from celery_nats_leader.beat.dispatcher import Outcome, Tick, TickDispatcher
from celery_nats_leader.beat.election import SCHEDULER_META_KEY, BeatElection
from celery_nats_leader.beat.fence import (
    DISPATCHER_HEADER,
    ENTRY_HEADER,
    EPOCH_HEADER,
    ONCE_HEADER,
    ROLE_HEADER,
    RUN_HEADER,
    TICK_HEADER,
)
from celery_nats_leader.beat.metrics import TickMetrics
from celery_nats_leader.beat.state import EntryState
from celery_nats_leader.beat.ticks import TickPlan, TickPlanner, slot_text, tick_task_id, to_utc
from celery_nats_leader.celery_compat import (
    beat_nodename,
    deadline_left_to_the_slots,
    slot_schedule,
    slots_overrule_is_due,
)
from celery_nats_leader.config import ElectionConfig
from celery_nats_leader.elector import Elector, RoleHandle
from celery_nats_leader.errors import (
    BucketConfigError,
    BucketNotFoundError,
    ConfigError,
    ElectionError,
    PermissionDeniedError,
)
from celery_nats_leader.observe.probes import ProbeResult, ProbeServer, liveness, readiness
from celery_nats_leader.settings import LeaderSettings
from celery_nats_leader.token import FencingToken

if TYPE_CHECKING:
    # Celery is untyped: type-check the mixin as a Scheduler (``Any``).
    from celery.beat import Scheduler as _SchedulerBase

    from celery_nats_leader.observe.prometheus import PrometheusObserver
else:
    _SchedulerBase = object

__all__ = ["LeaderScheduler", "LeaderSchedulerMixin"]

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGTERM and SIGINT back while a tick is committed, sent and recorded.

    ``celery beat``'s SIGTERM handler closes the scheduler and raises
    ``SystemExit`` wherever the main thread is, a KV round trip included;
    between the commit and the record that would leave the tick pending on a
    plain graceful stop, for the next scheduler to send (late, maybe twice).
    Python runs signal handlers on the main thread only, so swapping the
    handlers there for the millisecond of the dispatch is enough. Elsewhere
    (the embedded beat thread) signals never interrupt this code.
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

    As Celery's scheduler, it asks each entry's ``is_due()`` whether it is
    due and when to ask again. The mixin only adapts Celery's hooks; the work
    is done by parts composed in, none of which imports Celery:
    :class:`~celery_nats_leader.beat.election.BeatElection` (the role),
    :class:`~celery_nats_leader.beat.agenda.Agenda` (when to ask each entry
    again), :class:`~celery_nats_leader.beat.ticks.TickPlanner` (a due tick's
    slot, catch-up) and :class:`~celery_nats_leader.beat.dispatcher.TickDispatcher`
    (validate, commit, send, revert).

    Hooks for subclasses: :meth:`prepare_entry`, :meth:`earliest_slot`,
    :meth:`same_entry`, :meth:`catches_up`, :meth:`dispatch_gate` and
    :meth:`record_run` (the Django scheduler overrides the first three and the
    last).
    """

    def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
        # Read (and validate) the settings first: a bad value stops beat here
        # with a message naming the setting, even for a lazy instance.
        #: The election settings (read once; see :meth:`leader_settings`).
        self.nats_leader_settings = self.leader_settings(app)
        settings = self.nats_leader_settings
        self.nats_leader_election = BeatElection(
            settings, self._election_config(settings), self.make_elector, self._watch_elector
        )
        window = settings.catch_up_window()
        self.nats_leader_planner = TickPlanner(
            settings.beat_max_catch_up,
            interval_of,
            # Infinity (or beyond 300,000 years, near timedelta's range): no window.
            window=timedelta(seconds=window) if window < _NO_WINDOW_SECONDS else None,
        )
        self.nats_leader_dispatcher: TickDispatcher | None = None
        #: Tick counters by entry and outcome (served on :func:`beat_metrics_port`).
        self.nats_leader_metrics = TickMetrics(settings.beat_role, settings.instance_id)
        #: The election metrics (``None`` unless beat has a metrics port).
        self.nats_leader_observer: PrometheusObserver | None = None
        #: The port the metrics are served on, once served.
        self.nats_leader_metrics_port: int | None = None
        #: ``/healthz``, ``/readyz`` and ``/metrics`` on that port.
        self.nats_leader_probes: ProbeServer | None = None
        if beat_metrics_port(settings) is not None:
            # Imported only when asked for: prometheus-client is an optional extra.
            from celery_nats_leader.observe.prometheus import PrometheusObserver

            observer = PrometheusObserver(
                bucket=settings.bucket, namespace=settings.metrics_namespace
            )
            self.nats_leader_observer = observer
            self.nats_leader_metrics.export_to(observer.registry, observer.namespace)
        self._closed = False
        self._unsynced = 0
        self._sending = False
        #: When to ask each entry again (holds and backoffs).
        self.nats_leader_agenda = Agenda(self.same_entry)
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
            observer=self.nats_leader_observer,
        )

    def prepare_entry(self, entry: Any, state: EntryState) -> None:
        """Give the entry its KV state before Celery's ``is_due(entry)`` is asked.

        ``entry.is_due()`` reads ``last_run_at`` (and django-celery-beat's
        ``total_run_count`` for one-off rows): they are set from the last
        committed tick, so the answer is the one Celery's scheduler would give
        with the shared state. Called on the leader only.

        Args:
            entry: The schedule entry.
            state: Its KV state.

        """
        entry.last_run_at = state.slot.astimezone(self.app.timezone)
        entry.total_run_count = state.runs

    def same_entry(self, old: Any, new: Any) -> bool:
        """Whether ``new`` is ``old`` unedited (so its last ``is_due()`` answer still holds).

        Celery's scheduler compares entries the same way to notice an edited
        schedule (``schedules_equal``); the shelve of ``PersistentScheduler``
        hands out new objects after each sync.
        """
        return old is new or bool(old == new)

    def catches_up(self, schedule: Any) -> bool:
        """Whether missed ticks of ``schedule`` are caught up (``beat_max_catch_up``).

        Only for schedules whose ``is_due()`` is Celery's own (interval,
        crontab, solar): a schedule that overrides ``is_due()`` (business days,
        holidays) refuses ticks on purpose, and those must not be dispatched
        later as "missed"; after a gap it gets one tick, as with Celery.
        """
        module = getattr(type(schedule).is_due, "__module__", "")
        return module in STANDARD_IS_DUE_MODULES

    def earliest_slot(self, entry: Any) -> datetime | None:
        """The time before which the entry has no ticks (``None``: no such bound).

        The Django scheduler returns the row's ``start_time``: the ticks its
        schedule had before are neither dispatched nor caught up.
        """
        return None

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
        self._serve_metrics()
        election = self.nats_leader_election
        election.start()
        if self.nats_leader_dispatcher is None:
            assert election.store is not None
            self.nats_leader_dispatcher = TickDispatcher(
                election.store,
                self.instance_id,
                send_guard=_signals_deferred,
                is_permanent=is_permanent_send_error,
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
                if self.nats_leader_probes is not None:
                    self.nats_leader_probes.close()
                if self.nats_leader_observer is not None:
                    self.nats_leader_observer.close()

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
            "worker": beat_nodename(),
            # What tells a beat replica that the role's holder is a scheduler.
            SCHEDULER_META_KEY: f"{cls.__module__}.{cls.__qualname__}",
        }
        return dataclasses.replace(config, meta=meta)

    def _serve_metrics(self) -> None:
        observer, settings = self.nats_leader_observer, self.nats_leader_settings
        if self.nats_leader_metrics_port:
            return
        port = beat_metrics_port(settings)
        if observer is None or port is None:
            if _embedded() and settings.metrics_port is not None:
                # ``celery worker -B``: the worker's port serves the worker's
                # elections; this child process needs a port of its own.
                logger.info(
                    "nats-leader beat: embedded in a worker, which serves "
                    "nats_leader_metrics_port for its own roles; set "
                    "nats_leader_beat_metrics_port to serve beat's probes and metrics"
                )
            return
        setting = "beat_metrics_port" if settings.beat_metrics_port is not None else "metrics_port"
        # The worker's probes, on the beat's election (started after this:
        # until then neither probe passes). In ``worker -B`` this runs in the
        # beat's own process, after the fork: its thread and socket are its own.
        probes = ProbeServer(
            live=lambda: self._probe(liveness),
            ready=lambda: self._probe(readiness),
            registry=observer.registry,
        )
        try:
            self.nats_leader_metrics_port = probes.serve(port, settings.metrics_address)
        except OSError as exc:
            raise ConfigError(
                f"nats_leader_{setting}={port}: cannot serve metrics on "
                f"{settings.metrics_address}:{port} ({exc}); pick a free port or unset it"
            ) from exc
        self.nats_leader_probes = probes

    def _watch_elector(self, elector: Elector) -> None:
        # The connection gauge, leaders seen, leaderless time, TTL and ends of
        # terms: what the shipped alerts read, for beat as for a worker.
        if self.nats_leader_observer is not None:
            self.nats_leader_observer.watch_elector(elector, self.instance_id)

    def _probe(self, check: Callable[[Elector], ProbeResult]) -> ProbeResult:
        elector = self.nats_leader_election.elector
        if elector is None:
            return ProbeResult(False, {"election": "not started"})
        return check(elector)

    def _retry_delay(self) -> float:
        return self.nats_leader_election.retry_delay(float(self.max_interval))

    def _lead(self, handle: RoleHandle, token: FencingToken, dispatcher: TickDispatcher) -> float:
        """A leader's pass: dispatch the oldest due tick, or say when to look again."""
        max_interval = float(self.max_interval)
        # Seconds before anything needs a look (not bounded by max_interval
        # yet: Celery bounds the adjusted delay, see the end).
        wake = math.inf
        best: _Due | None = None
        for name, entry in list(self.schedule.items()):
            state = dispatcher.states.get(name)
            if state is None:
                state = self._adopt(name, entry, handle, token, dispatcher)
                if state is None:
                    wake = min(wake, self._retry_delay())
                    continue
            resend = dispatcher.pending_tick(name)
            if resend is not None:
                # The outbox: committed by another term, maybe never sent.
                # Sent again before any later tick of the entry (no gate: it
                # was admitted when it was committed).
                again = _Due(resend.slot, name, entry, state, 0)
                return self._dispatch(handle, token, dispatcher, again, resend=True)
            # As Celery's heap: times on the entry's own clock (its schedule's now).
            now = _timestamp(entry.default_now())
            held = self.nats_leader_agenda.held_for(name, entry, state.revision, now)
            if held is not None:
                wake = min(wake, held)
                continue
            due = self._due(name, entry, state, now)
            if not isinstance(due, _Due):
                wake = min(wake, due)
                continue
            if best is not None and due.slot >= best.slot:
                continue
            gate = self.dispatch_gate(entry, state)
            if gate is not None:
                wake = min(wake, max(gate, 0.0))
                continue
            best = due
        if best is None:
            if wake == math.inf:
                return max_interval
            # As Celery's tick(): wake up 10 ms early (its adjust()), then
            # bound by max_interval.
            return max(0.0, min(float(self.adjust(wake)), max_interval))
        return self._dispatch(handle, token, dispatcher, best)

    def _due(self, name: str, entry: Any, state: EntryState, now_ts: float) -> _Due | float:
        """The entry's due tick, or seconds before asking its schedule again.

        As Celery, the entry's ``is_due()`` decides *whether* it is due and
        when to ask again; the planner gives a due tick its identity (its
        slot) and applies the catch-up rules.
        """
        max_interval = float(self.max_interval)
        self.prepare_entry(entry, state)
        try:
            # Before Celery 5.7 the crontab's own deadline check refuses a due slot.
            with deadline_left_to_the_slots(entry.schedule):
                due, next_check = self.is_due(entry)
        except Exception:
            # As Celery: one entry that cannot be calculated must not stop the
            # others; logged as Celery logs it, on the celery.beat logger.
            due, next_check = self._is_due_failed(entry)
        if not due:
            wait = float(next_check) if is_numeric(next_check) else max_interval
            wait = max(wait, 0.0)
            held = min(wait, max_interval)
            self.nats_leader_agenda.hold(name, entry, state.revision, now_ts + held)
            return wait
        self.nats_leader_agenda.release(name)
        try:
            now = entry.default_now()
            plan = self._plan(name, entry, state, now)
        except Exception:
            logger.exception(
                "nats-leader beat: cannot calculate the slot of %r's due tick; trying again in %gs",
                name,
                max_interval,
            )
            self.nats_leader_agenda.hold(name, entry, state.revision, now_ts + max_interval)
            return max_interval
        if plan is not None and plan.due and plan.slot is not None:
            return _Due(plan.slot, name, entry, state, plan.skipped)
        if (
            plan is not None
            and plan.slot is not None
            and self.catches_up(entry.schedule)
            and slots_overrule_is_due(entry.schedule)
        ):
            # Celery's own crontab/solar is_due() said due, its slots say not
            # yet: the slots decide (before Celery 5.7 crontab.is_due() computes
            # in wall-clock time, an hour off across a DST change), so no extra tick.
            wait = min(plan.wait, max_interval)
            self.nats_leader_agenda.hold(name, entry, state.revision, now_ts + wait)
            return wait
        # Due by is_due() although no slot of the schedule is (a custom
        # is_due(), a clocked time before the entry's anchor): the tick is
        # identified by the time it was found due, as Celery's last_run_at.
        slot = to_utc(now)
        if slot <= state.slot:
            slot = state.slot + _ONE_MICROSECOND
        return _Due(slot, name, entry, state, 0)

    def _is_due_failed(self, entry: Any) -> tuple[bool, float]:
        """Celery's handling of an entry whose ``is_due()`` raised: log, ask again later.

        Celery 5.7 has it (logged on the ``celery.beat`` logger, which is
        where users watch beat's errors); older versions let the error stop
        beat, so the same is done here with Celery's message.
        """
        celery_handler = getattr(super(), "_is_due_failed", None)
        if celery_handler is not None:
            due, next_check = celery_handler(entry)
            return bool(due), float(next_check)
        celery_beat.error(
            "beat: Cannot calculate the next run of %r, trying again in %ss.",
            entry.name,
            self.max_interval,
            exc_info=True,
        )
        return False, float(self.max_interval)

    def _plan(self, name: str, entry: Any, state: EntryState, now: datetime) -> TickPlan | None:
        """The planner's view of a due entry (``None``: its schedule has no slots)."""
        schedule = entry.schedule
        not_before = self.earliest_slot(entry)
        deadline = self.app.conf.beat_cron_starting_deadline
        if deadline is not None and isinstance(schedule, crontab):
            # As Celery: a cron slot older than the deadline is not run.
            cutoff = to_utc(now) - timedelta(seconds=float(deadline))
            not_before = cutoff if not_before is None else max(to_utc(not_before), cutoff)
        # A schedule with its own is_due() decides which ticks exist: the
        # ticks it refused are not caught up later (Celery's behaviour).
        limit = None if self.catches_up(schedule) else 0
        try:
            # Before Celery 5.7 a crontab needs help to give 5.7's slots.
            return self.nats_leader_planner.plan(
                name,
                slot_schedule(schedule),
                state.slot,
                now,
                not_before=not_before,
                max_catch_up=limit,
            )
        except NotImplementedError:
            # A custom schedule with is_due() only: its ticks have no slots.
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
        self,
        handle: RoleHandle,
        token: FencingToken,
        dispatcher: TickDispatcher,
        due: _Due,
        *,
        resend: bool = False,
    ) -> float:
        """Hand one due tick to the dispatcher. Returns the delay before the next pass."""
        # Connect to the broker before committing: a tick must not wait for
        # a broker connection between its commit and its send.
        producer = self.producer
        name, entry = due.name, due.entry
        tick = Tick(name, due.slot, task=str(entry.task), skipped=due.skipped, resend=resend)
        result = dispatcher.dispatch(
            handle, token, tick, lambda committed: self._send(entry, committed, token, producer)
        )
        outcome, metrics = result.outcome, self.nats_leader_metrics
        if result.error is not None:
            metrics.add(name, "send_failed")
        if outcome in (Outcome.REVERTED, Outcome.UNSENT):
            # Both are sent later: undone, or left pending for the outbox.
            metrics.add(name, "reverted")
        elif outcome is Outcome.FAILED:
            metrics.add(name, "lost")
        if outcome is Outcome.REVERTED and result.error is not None:
            # A failed send: this entry backs off, the others go on.
            self.nats_leader_agenda.back_off(
                name,
                _timestamp(entry.default_now()),
                first=self._retry_delay(),
                cap=float(self.max_interval),
            )
            return 0.0
        if outcome in (Outcome.UNCONFIRMED, Outcome.NOT_COMMITTED, Outcome.REVERTED):
            return self._retry_delay() if handle.is_leader else 0.0
        if outcome is Outcome.CONFLICT and result.state is None:
            return self._retry_delay()
        if outcome not in (Outcome.SENT, Outcome.FAILED):
            return 0.0
        self.nats_leader_agenda.succeeded(name)
        committed = result.state
        assert committed is not None
        if outcome is Outcome.SENT:
            metrics.add(name, "resent" if resend else "dispatched")
        metrics.add(name, "skipped", due.skipped)
        if due.skipped:
            logger.warning(
                "nats-leader beat: %r had %s%d overdue ticks: skipped all but the latest, %s "
                "(one run: the oldest was older than the catch-up window of %gs, or more "
                "than beat_max_catch_up=%d were overdue)",
                name,
                "" if self.nats_leader_planner.interval_of(entry.schedule) else "at least ",
                due.skipped + 1,
                slot_text(committed.slot),
                self.nats_leader_settings.catch_up_window(),
                self.nats_leader_settings.beat_max_catch_up,
            )
        self.record_run(entry, committed)
        if self.should_sync():
            self._do_sync()
        return 0.0

    def _send(self, entry: Any, committed: EntryState, token: FencingToken, producer: Any) -> None:
        """Publish one committed tick through Celery's ``apply_async`` hook."""
        role = self.nats_leader_election.config.role
        slot = slot_text(committed.slot)
        options = dict(entry.options or {})
        own_headers = dict(options.get("headers") or {})
        task_id = tick_task_id(
            self.nats_leader_settings.beat_state_bucket, role, committed.entry, slot
        )
        # Run once on the workers unless opted out (the settings, the entry's
        # options or, for database rows, the entry's headers), and only under
        # our per-tick id: an id the entry fixes is the same for every tick.
        opted_out = _opts_out(options.pop(ONCE_HEADER, None)) or _opts_out(
            own_headers.get(ONCE_HEADER)
        )
        options.setdefault("task_id", task_id)
        once = (
            self.nats_leader_settings.beat_once and not opted_out and options["task_id"] == task_id
        )
        # The epoch, not the token: the token is the term's secret, and
        # headers end up in logs and brokers. The worker-side check needs the
        # epoch only; the dispatcher's instance id says who sent it.
        options["headers"] = {
            **own_headers,
            EPOCH_HEADER: token.epoch,
            ROLE_HEADER: role,
            ENTRY_HEADER: committed.entry,
            TICK_HEADER: slot,
            RUN_HEADER: committed.runs,
            DISPATCHER_HEADER: self.instance_id,
            ONCE_HEADER: once,
        }
        # Send a shallow clone carrying this tick's options: the entry itself
        # may be persisted (shelve, database) and must not keep them. No
        # __reduce__ (ModelEntry cannot be rebuilt that way): copy the fields.
        outgoing = object.__new__(type(entry))
        outgoing.__dict__.update(entry.__dict__)
        outgoing.options = options
        self._sending = True
        try:
            result = self.apply_async(outgoing, producer=producer, advance=False)
        except Exception as exc:
            # As Celery's apply_entry(), on the celery.beat logger (where
            # users alert on beat's errors); the dispatcher then decides
            # whether the tick is sent again or dropped, and says so.
            celery_beat.error("Message Error: %s\n%s", exc, traceback.format_stack(), exc_info=True)
            raise
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


def _opts_out(value: Any) -> bool:
    """Whether an entry's ``nats_leader_once`` option or header turns the once-guard off."""
    return value is not None and str(value).strip().lower() in {"false", "0", "no", "off"}


@dataclass(frozen=True)
class _Due:
    """A due tick chosen for dispatch."""

    slot: datetime
    name: str
    entry: Any
    state: EntryState
    skipped: int


_ONE_MICROSECOND = timedelta(microseconds=1)

#: A catch-up window at least this long is none (``float("inf")`` included).
_NO_WINDOW_SECONDS = 1e13

#: Modules whose schedules' ``is_due()`` is plain "is a slot due" (see ``catches_up``).
STANDARD_IS_DUE_MODULES = frozenset({"celery.schedules", "django_celery_beat.tzcrontab"})


def beat_metrics_port(settings: LeaderSettings) -> int | None:
    """The port a beat scheduler serves its probes and metrics on, or ``None``.

    ``nats_leader_beat_metrics_port`` when set; otherwise a standalone beat
    uses ``nats_leader_metrics_port``, and the embedded beat of ``celery
    worker -B`` serves nothing (its worker already holds that port).
    """
    if settings.beat_metrics_port is not None:
        return int(settings.beat_metrics_port)
    if settings.metrics_port is None or _embedded():
        return None
    return int(settings.metrics_port)


def _embedded() -> bool:
    """Whether this is the embedded beat of a worker (``celery worker -B``).

    Celery runs it in a process (or thread) named ``Beat``.
    """
    return (
        multiprocessing.current_process().name == "Beat"
        or threading.current_thread().name == "Beat"
    )


def _timestamp(moment: datetime) -> float:
    return to_utc(moment).timestamp()


def is_numeric(value: object) -> bool:
    """Whether ``value`` is a number of seconds (Celery's schedules may return ``None``)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def interval_of(schedule: Any) -> timedelta | None:
    """The period of a schedule whose slots are ``anchor + k * period``, else ``None``.

    That is Celery's plain ``schedule`` (and django-celery-beat's interval
    rows), not relative and with Celery's own ``remaining_estimate``; a
    subclass that computes its remaining time otherwise is planned by jumping.
    """
    if not isinstance(schedule, celery_schedule) or schedule.relative:
        return None
    if type(schedule).remaining_estimate is not celery_schedule.remaining_estimate:
        return None
    period = schedule.run_every
    return period if isinstance(period, timedelta) else None


def is_permanent_send_error(exc: BaseException) -> bool:
    """Whether a send failed in a way that every retry would repeat.

    Celery wraps the cause in ``SchedulingError``; a message that cannot be
    serialized (kombu's ``EncodeError``, a ``TypeError`` or ``ValueError``
    from the encoder) fails the same way every time, while a broker or
    network error (``OSError``, kombu's ``OperationalError``) may pass later.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (OSError, OperationalError)):
            return False
        if isinstance(current, (SerializationError, TypeError, ValueError)):
            return True
        current = current.__cause__ or current.__context__
    return False


class LeaderScheduler(LeaderSchedulerMixin, PersistentScheduler):  # type: ignore[misc]
    """Celery's default scheduler (``PersistentScheduler``), dispatching only while leading.

    Entries come from ``beat_schedule`` as usual; their state (last tick, run
    count) lives in KV. The local shelve file (``-s``) is kept up to date by
    the leader for display only; any path works on every replica.

    Use it with ``celery beat -S nats_leader`` (the short alias) or
    ``-S celery_nats_leader.beat:LeaderScheduler``, or
    ``beat_scheduler = "nats_leader"`` for ``celery worker -B``.
    """
