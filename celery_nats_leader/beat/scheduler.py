"""The Celery side of the leader scheduler: the mixin that wires the parts into Celery's hooks.

:class:`LeaderSchedulerMixin` adapts Celery's ``Scheduler`` hooks
(``setup_schedule``, ``tick``, ``should_sync``/``sync``, ``close``,
``info``) and offers the hooks its subclasses override (``prepare_entry``,
``catches_up``, ...). The work is done by the parts it wires:

* :mod:`~celery_nats_leader.beat.leader_pass`: the leader's pass (which due
  tick goes first; its dispatch and what came of it), a base of the mixin;
* :mod:`~celery_nats_leader.beat.send`: the message of a committed tick and
  Celery's ``apply_async``;
* :mod:`~celery_nats_leader.beat.introspection`: what is read from Celery's
  schedules (the period of an interval, Celery's own ``is_due()``, the cron
  starting deadline);
* :mod:`~celery_nats_leader.beat.signals`: SIGTERM and SIGINT held back
  during a dispatch;
* and, importing no Celery, the beat role
  (:mod:`~celery_nats_leader.beat.election`), tick identity and planning
  (:mod:`~celery_nats_leader.beat.ticks`), the state in KV
  (:mod:`~celery_nats_leader.beat.schedule_store`) and the dispatcher that validates
  the token, commits, sends and reverts
  (:mod:`~celery_nats_leader.beat.dispatcher`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import threading
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, NoReturn

from celery.beat import PersistentScheduler

from celery_nats_leader.beat.agenda import Agenda
from celery_nats_leader.beat.dispatcher import TickDispatcher
from celery_nats_leader.beat.election import SCHEDULER_META_KEY, BeatElection
from celery_nats_leader.beat.introspection import has_standard_is_due, interval_of
from celery_nats_leader.beat.leader_pass import LeaderPass
from celery_nats_leader.beat.metrics import TickMetrics
from celery_nats_leader.beat.schedule_store import EntryState
from celery_nats_leader.beat.send import is_permanent_send_error
from celery_nats_leader.beat.signals import signals_deferred
from celery_nats_leader.beat.ticks import TickPlanner
from celery_nats_leader.config import ElectionConfig
from celery_nats_leader.config.settings import LeaderSettings
from celery_nats_leader.core.errors import (
    BucketConfigError,
    BucketNotFoundError,
    ConfigError,
    ElectionError,
    PermissionDeniedError,
)
from celery_nats_leader.election.elector import Elector, RoleHandle
from celery_nats_leader.observe.probes import ProbeResult, ProbeServer, liveness, readiness
from celery_nats_leader.worker.celery_compat import beat_nodename

if TYPE_CHECKING:
    from celery_nats_leader.observe.prometheus import PrometheusObserver

__all__ = ["LeaderScheduler", "LeaderSchedulerMixin"]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------- scheduler


class LeaderSchedulerMixin(LeaderPass):
    """Makes any Celery scheduler dispatch only while it leads the beat role.

    Put it first among the bases of a Celery scheduler class::

        class MyLeaderScheduler(LeaderSchedulerMixin, MyScheduler):
            pass

    The wrapped scheduler keeps providing the *entries* (what to run, on which
    schedule, with which options); their *state* (the last tick dispatched and
    the run count) comes from KV, and the wrapped scheduler's own copy
    (``last_run_at``, ``total_run_count``) is updated by the leader for
    display only. Configuration comes from the app's ``nats_leader_*``
    settings (see :class:`~celery_nats_leader.config.settings.LeaderSettings`).

    As Celery's scheduler, it asks each entry's ``is_due()`` whether it is
    due and when to ask again. The mixin adapts Celery's hooks; the leader's
    pass is its base :class:`~celery_nats_leader.beat.leader_pass.LeaderPass`,
    and the rest is done by parts composed in, none of which imports Celery:
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
        return has_standard_is_due(schedule)

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
        election = self.nats_leader_election
        try:
            self._serve_metrics()
            election.start()
        except BaseException:
            # The constructor raises, so no close() will come: release what
            # Celery's set-up opened (beat's shelve; on Python 3.13 a
            # dbm.sqlite3 connection, which the garbage collector would
            # otherwise close from whatever thread it runs in, and fail).
            with contextlib.suppress(Exception):
                self.close()
            raise
        if self.nats_leader_dispatcher is None:
            assert election.store is not None
            self.nats_leader_dispatcher = TickDispatcher(
                election.store,
                self.instance_id,
                send_guard=signals_deferred,
                is_permanent=is_permanent_send_error,
            )

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """One scheduler pass: dispatch at most one due tick, if leading.

        Returns:
            Seconds until the next pass is wanted.

        Raises:
            ElectionError: The election or the state bucket failed permanently.
            SystemExit: The scheduler was closed by beat's stop signal (see
                :meth:`_pass_after_close`).

        """
        if self._closed:
            self._pass_after_close()
        try:
            return self._pass()
        except Exception:
            if self._closed:
                self._pass_after_close()
            raise

    def _pass_after_close(self) -> NoReturn:
        # ``celery beat``'s SIGTERM handler closes the scheduler, then raises
        # SystemExit wherever the main thread is. When that is inside a
        # weakref callback or a __del__ (the garbage collector runs them at
        # any allocation), Python prints "Exception ignored" and drops the
        # SystemExit: the pass goes on, on a closed election (its pending
        # KV request cancelled), and beat would fail with that error or,
        # on the next pass, sleep on with nothing to do. Stop as the
        # signal meant to (Service.start() ends on SystemExit).
        raise SystemExit()

    def _pass(self) -> float:
        election = self.nats_leader_election
        handle = election.handle
        dispatcher = self.nats_leader_dispatcher
        if handle is None or dispatcher is None:
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


#: A catch-up window at least this long is none (``float("inf")`` included).
_NO_WINDOW_SECONDS = 1e13


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


class LeaderScheduler(LeaderSchedulerMixin, PersistentScheduler):  # type: ignore[misc]
    """Celery's default scheduler (``PersistentScheduler``), dispatching only while leading.

    Entries come from ``beat_schedule`` as usual; their state (last tick, run
    count) lives in KV. The local shelve file (``-s``) is kept up to date by
    the leader for display only; any path works on every replica.

    Use it with ``celery beat -S nats_leader`` (the short alias) or
    ``-S celery_nats_leader.beat:LeaderScheduler``, or
    ``beat_scheduler = "nats_leader"`` for ``celery worker -B``.
    """
