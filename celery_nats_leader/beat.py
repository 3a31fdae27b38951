"""Celery beat on every replica, dispatching from exactly one: the leader scheduler.

Run ``celery beat`` (or ``celery worker -B``) on every replica with::

    celery -A proj beat -S nats_leader            # Celery's default scheduler semantics
    celery -A proj beat -S django_nats_leader     # django-celery-beat's DatabaseScheduler

Every replica campaigns for the ``beat`` role (``nats_leader_beat_role``);
only its leader dispatches. A follower's tick reads and writes nothing: it
waits a short, bounded time (a promotion wakes it at once) and looks again.

Each dispatch, by the leader only:

1. **confirms the fencing token against KV** (one read of the role's key); on
   a mismatch it dispatches nothing and the election demotes it;
2. **commits the tick** to the entry's state in KV with a compare-and-set on
   the key's revision, marked *pending* (the intent, recorded before the
   send). A tick is identified by its *slot*, the time the schedule says it
   is due (:mod:`celery_nats_leader.beat_ticks`), so two schedulers that
   both believe they lead cannot both commit the same tick, and a new leader
   continues from the last committed slot: nothing twice, nothing skipped;
3. **sends the task** with the token, role, entry, slot and run number in its
   headers (``nats_leader_*``) and a task id derived from the tick, unless
   the lease ended meanwhile, in which case the commit is reverted so that the
   successor dispatches the tick;
4. **records the send** (the state is no longer pending): the outbox's
   completion.

A scheduler that finds an entry's state pending (its predecessor died between
the commit and the record) sends that tick again, under the same
deterministic task id, before any later tick of the entry. Delivery is
therefore **at least once per tick**, and a tick is sent twice only when a
scheduler dies after sending it and before recording it; the worker-side
once-guard (:class:`~celery_nats_leader.once_celery.OnceTask`) runs each task
id once, so ticks of guarded tasks execute exactly once. See ``docs/beat.md``.

Workers can opt in to rejecting tasks sent under an ended term: use
:class:`FencedBeatTask` as the task base, or call :func:`enforce_dispatch_token`
(or :func:`check_dispatch_token`) before the work; they live in
:mod:`celery_nats_leader.beat_fence` and are re-exported here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from types import FrameType
from typing import TYPE_CHECKING, Any

from celery.beat import PersistentScheduler

from celery_nats_leader.beat_fence import (
    DISPATCHER_HEADER,
    ENTRY_HEADER,
    ROLE_HEADER,
    RUN_HEADER,
    TICK_HEADER,
    TOKEN_HEADER,
    DispatchCheck,
    DispatchFence,
    FencedBeatTask,
    check_dispatch_token,
    enforce_dispatch_token,
)
from celery_nats_leader.beat_state import EntryState, ScheduleStateStore
from celery_nats_leader.beat_ticks import TickPlan, TickPlanner, slot_text, to_utc
from celery_nats_leader.config import ElectionConfig
from celery_nats_leader.election import DemoteReason, ElectionState
from celery_nats_leader.elector import Elector, RoleHandle
from celery_nats_leader.errors import (
    BackendTimeoutError,
    BucketConfigError,
    BucketNotFoundError,
    ElectionError,
    KeyExistsError,
    PermissionDeniedError,
    RecordFormatError,
    RevisionMismatchError,
)
from celery_nats_leader.record import LeaderRecord
from celery_nats_leader.settings import LeaderSettings
from celery_nats_leader.token import FencingToken

if TYPE_CHECKING:
    # Celery is untyped: type-check the mixin as a Scheduler (``Any``).
    from celery.beat import Scheduler as _SchedulerBase
else:
    _SchedulerBase = object

__all__ = [
    "DISPATCHER_HEADER",
    "ENTRY_HEADER",
    "ROLE_HEADER",
    "RUN_HEADER",
    "TICK_HEADER",
    "TOKEN_HEADER",
    "DispatchCheck",
    "DispatchFence",
    "FencedBeatTask",
    "LeaderScheduler",
    "LeaderSchedulerMixin",
    "check_dispatch_token",
    "enforce_dispatch_token",
    "tick_task_id",
]

logger = logging.getLogger(__name__)

#: Namespace of the task ids derived from ticks (uuid5).
TICK_ID_NAMESPACE = uuid.UUID("5d1f9b1e-2c4a-4e0b-9a57-6b3c1f0d8e42")

#: How often a scheduler that cannot lead says why, in seconds.
_WARNING_INTERVAL = 30.0


def tick_task_id(bucket: str, role: str, entry: str, tick: str) -> str:
    """The task id of a tick: the same for every scheduler that could send it.

    Args:
        bucket: The state bucket.
        role: The beat role.
        entry: The entry's name.
        tick: The tick's slot as sent in :data:`TICK_HEADER`.

    Returns:
        A UUID string (uuid5), usable as an idempotency key downstream.

    """
    return str(uuid.uuid5(TICK_ID_NAMESPACE, f"{bucket}/{role}/{entry}/{tick}"))


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

    Override :meth:`dispatch_gate` for entry-level rules (enabled flags, start
    dates) and :meth:`record_run` to mirror a dispatch into the wrapped
    scheduler's storage.
    """

    def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
        # Read (and validate) the settings first: a bad value stops beat here
        # with a message naming the setting, even for a lazy instance.
        #: The election settings (read once; see :meth:`leader_settings`).
        self.nats_leader_settings = self.leader_settings(app)
        self._nl_config = self._nl_election_config()
        self._nl_elector: Elector | None = None
        self._nl_handle: RoleHandle | None = None
        self._nl_store: ScheduleStateStore | None = None
        self._nl_states: dict[str, EntryState] = {}
        self._nl_term: FencingToken | None = None
        self._nl_planner = TickPlanner(self.nats_leader_settings.beat_max_catch_up)
        self._nl_wake = threading.Event()
        self._nl_closed = False
        self._nl_unsynced = 0
        self._nl_sending = False
        self._nl_next_warning = 0.0
        self._nl_connected_since: float | None = None
        self._nl_broken: dict[str, float] = {}
        # Entry name -> commit id of the pending state whose tick this
        # scheduler sent itself (its send is known even if unrecorded).
        self._nl_sent: dict[str, str] = {}
        super().__init__(app, *args, **kwargs)

    # ------------------------------------------------------------ queries

    @property
    def beat_role(self) -> RoleHandle | None:
        """The beat role's handle (``None`` before :meth:`setup_schedule`)."""
        return self._nl_handle

    @property
    def is_leader(self) -> bool:
        """Whether this scheduler is the active one right now."""
        return self._nl_handle is not None and self._nl_handle.is_leader

    @property
    def instance_id(self) -> str:
        """This scheduler's election id."""
        return self._nl_config.instance_id

    def entry_states(self) -> dict[str, EntryState]:
        """The KV state of every entry, as last read or written by this leader."""
        return dict(self._nl_states)

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
            name=f"celery-nats-leader beat {self._nl_config.instance_id}",
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
        self._nl_unsynced += 1

    # ------------------------------------------------------- Celery hooks

    def setup_schedule(self) -> None:
        """Set the wrapped scheduler up, then join the election for the beat role.

        Raises:
            ElectionError: With ``nats_leader_required``, when NATS cannot be
                reached; always, on a permanent problem (bucket missing,
                permission denied). Beat stops with the message.

        """
        super().setup_schedule()
        self._nl_start()

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """One scheduler pass: dispatch at most one due tick, if leading.

        Returns:
            Seconds until the next pass is wanted.

        Raises:
            ElectionError: The election or the state bucket failed permanently.

        """
        handle = self._nl_handle
        if handle is None or self._nl_closed:
            return float(self.max_interval)
        token = handle.token
        if token is None:
            return self._nl_follow(handle)
        if self._nl_term != token:
            retry = self._nl_begin_term(token)
            if retry is not None:
                return retry
        return self._nl_lead(handle, token)

    def should_sync(self) -> bool:
        """Sync only what this scheduler dispatched: a follower never syncs.

        Never in the middle of a dispatch either (Celery's ``apply_async``
        asks): a sync may replace the entry objects being worked on.
        """
        if self._nl_sending or not self._nl_unsynced:
            return False
        return bool(super().should_sync())

    def sync(self) -> None:
        """Persist the wrapped scheduler's storage (dispatched runs only)."""
        super().sync()
        self._nl_unsynced = 0

    def close(self) -> None:
        """Sync, release the broker connection, then release leadership.

        The release deletes the role's key, so a successor is elected in
        milliseconds and continues the schedule from KV.
        """
        first = not self._nl_closed
        self._nl_closed = True
        try:
            super().close()
        finally:
            if first:
                self._nl_stop()

    @property
    def info(self) -> str:
        """Lines for the ``celery beat`` banner."""
        settings = self.nats_leader_settings
        config = self._nl_config
        lines = [str(super().info)] if super().info else []
        lines.append(
            f"    . leader election -> role {config.role!r} in KV bucket {config.bucket!r} "
            f"(ttl {config.ttl:g}s) on {', '.join(settings.servers)}"
        )
        lines.append(f"    . schedule state -> KV bucket {settings.beat_state_bucket!r}")
        return "\n".join(lines)

    # ------------------------------------------------------------ election

    def _nl_election_config(self) -> ElectionConfig:
        settings = self.nats_leader_settings
        config = settings.election_config(settings.beat_role)
        cls = type(self)
        meta = {
            **config.meta,
            "worker": _beat_nodename(),
            "scheduler": f"{cls.__module__}.{cls.__qualname__}",
        }
        return dataclasses.replace(config, meta=meta)

    def _nl_start(self) -> None:
        if self._nl_elector is not None:
            return
        settings = self.nats_leader_settings
        config = self._nl_config
        elector = self.make_elector()
        handle = elector.add_role(config)
        handle.on_promote(self._nl_promoted)
        handle.on_demote(self._nl_demoted)
        self._nl_elector, self._nl_handle = elector, handle
        # State operations get a little more room than election reads: a
        # commit whose answer is late is reconciled, never retried blindly.
        self._nl_store = ScheduleStateStore(
            elector,
            settings.beat_state_bucket,
            config.role,
            create=settings.create_bucket,
            replicas=settings.bucket_replicas,
            timeout=max(2 * config.request_timeout, 0.5),
        )
        logger.info(
            "nats-leader beat: instance %s campaigns for role %r in bucket %r on %s "
            "(state in bucket %r)",
            config.instance_id,
            config.role,
            config.bucket,
            ", ".join(settings.servers),
            settings.beat_state_bucket,
        )
        try:
            elector.start(timeout=settings.start_timeout, require_connection=settings.required)
            if elector.connected:
                # Fail now, not at the first promotion, on a missing or
                # misconfigured state bucket.
                self._nl_store.open()
        except ElectionError as exc:
            logger.critical("nats-leader beat: cannot start: %s", exc)
            elector.stop()
            raise
        if not elector.connected:
            logger.warning(
                "nats-leader beat: NATS (%s) not reachable yet; this scheduler dispatches "
                "nothing until it is connected and leads role %r",
                ", ".join(settings.servers),
                config.role,
            )

    def _nl_stop(self) -> None:
        elector = self._nl_elector
        if elector is None:
            return
        was_leader = self.is_leader
        elector.stop()
        if was_leader:
            logger.info("nats-leader beat: stopped; role %r released", self._nl_config.role)

    def _nl_promoted(self, token: FencingToken) -> None:
        logger.info(
            "nats-leader beat: this replica is now the active scheduler (role %r, epoch %d)",
            self._nl_config.role,
            token.epoch,
        )
        self._nl_wake.set()

    def _nl_demoted(self, reason: DemoteReason) -> None:
        logger.info(
            "nats-leader beat: no longer the active scheduler (role %r, %s)",
            self._nl_config.role,
            reason.value,
        )
        self._nl_wake.set()

    # ------------------------------------------------------------ follower

    def _nl_follow(self, handle: RoleHandle) -> float:
        """A follower's pass: no reserve, no advance, no sync; wait and look again."""
        if self._nl_term is not None:
            self._nl_term = None
            self._nl_states.clear()
        self._nl_check_health(handle)
        bound = min(float(self.max_interval), self.nats_leader_settings.beat_follower_interval)
        if self._nl_wake.wait(bound):
            self._nl_wake.clear()
        return 0.0

    def _nl_check_health(self, handle: RoleHandle) -> None:
        """Make a scheduler that can never lead say so (or stop, on a permanent error)."""
        elector = self._nl_elector
        assert elector is not None
        if handle.error is not None:
            logger.critical(
                "nats-leader beat: the election for role %r stopped: %s",
                handle.role,
                handle.error,
            )
            raise handle.error
        now = time.monotonic()
        if elector.connected and handle.state is ElectionState.INIT:
            # Connected, but the role never started: the elector logged a
            # permanent error (missing bucket, ...). Give it start_timeout.
            if self._nl_connected_since is None:
                self._nl_connected_since = now
            elif now - self._nl_connected_since > self.nats_leader_settings.start_timeout:
                raise ElectionError(
                    f"the election for role {handle.role!r} could not start (see the error "
                    "logged above); this scheduler would never dispatch"
                )
        if now < self._nl_next_warning:
            return
        self._nl_next_warning = now + _WARNING_INTERVAL
        if not elector.connected:
            logger.warning(
                "nats-leader beat: still not connected to NATS (%s); dispatching nothing",
                ", ".join(self.nats_leader_settings.servers),
            )
        else:
            leader = handle.leader
            logger.debug(
                "nats-leader beat: following; the active scheduler is %s",
                _describe_leader(leader),
            )

    # -------------------------------------------------------------- leader

    def _nl_retry_delay(self) -> float:
        return min(float(self.max_interval), max(0.05, self._nl_config.heartbeat_interval / 2))

    def _nl_begin_term(self, token: FencingToken) -> float | None:
        """Load every entry's state for a new term; returns a retry delay on failure."""
        store = self._nl_store
        assert store is not None
        try:
            store.open()
            states = store.load()
        except (BucketNotFoundError, BucketConfigError, PermissionDeniedError) as exc:
            logger.critical("nats-leader beat: the schedule state is unusable: %s", exc)
            raise
        except ElectionError as exc:
            logger.warning(
                "nats-leader beat: could not load the schedule state (%s); retrying", exc
            )
            return self._nl_retry_delay()
        self._nl_states = states
        self._nl_term = token
        logger.info(
            "nats-leader beat: leading with epoch %d; continuing %d entr%s from KV bucket %r",
            token.epoch,
            len(states),
            "y" if len(states) == 1 else "ies",
            store.bucket_name,
        )
        return None

    def _nl_lead(self, handle: RoleHandle, token: FencingToken) -> float:
        """A leader's pass: dispatch the oldest due tick, or say when to look again."""
        wake = float(self.max_interval)
        best: _Due | None = None
        for name, entry in list(self.schedule.items()):
            state = self._nl_states.get(name)
            if state is None:
                state = self._nl_adopt(name, entry, handle, token)
                if state is None:
                    wake = min(wake, self._nl_retry_delay())
                    continue
            if state.pending and self._nl_sent.get(name) != state.commit:
                # The outbox: committed by an earlier scheduler, maybe never
                # sent. Send it again, before any later tick of the entry.
                resend = _Due(state.slot, name, entry, state, TickPlan(state.slot, True, 0.0))
                return self._nl_dispatch(handle, token, resend, resend=True)
            plan = self._nl_plan(name, entry, state)
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
        return self._nl_dispatch(handle, token, best)

    def _nl_plan(self, name: str, entry: Any, state: EntryState) -> TickPlan | None:
        """The entry's next tick; ``None`` while its schedule cannot be calculated."""
        now_mono = time.monotonic()
        if self._nl_broken.get(name, 0.0) > now_mono:
            return None
        try:
            now = entry.default_now()
            try:
                return self._nl_planner.plan(name, entry.schedule, state.slot, now)
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
            self._nl_broken[name] = now_mono + float(self.max_interval)
            logger.exception(
                "nats-leader beat: cannot calculate the next run of %r; trying again in %gs",
                name,
                self.max_interval,
            )
            return None

    def _nl_adopt(
        self, name: str, entry: Any, handle: RoleHandle, token: FencingToken
    ) -> EntryState | None:
        """Give a new entry its KV state, anchored at its own last run (or now)."""
        store = self._nl_store
        assert store is not None
        if not handle.is_leader:
            return None
        last = getattr(entry, "last_run_at", None) or entry.default_now()
        fresh = EntryState(
            entry=name,
            slot=to_utc(last),
            runs=int(getattr(entry, "total_run_count", 0) or 0),
            epoch=token.epoch,
            by=self.instance_id,
            commit=uuid.uuid4().hex[:12],
            task=str(entry.task),
        )
        state: EntryState | None
        try:
            state = store.create(fresh)
            logger.info(
                "nats-leader beat: new entry %r anchored at %s", name, slot_text(fresh.slot)
            )
        except (KeyExistsError, BackendTimeoutError):
            # Created meanwhile by another term, or our own create landed late.
            state = self._nl_read(name)
        except (BucketNotFoundError, PermissionDeniedError):
            raise
        except ElectionError as exc:
            logger.warning("nats-leader beat: could not create the state of %r: %s", name, exc)
            return None
        if state is not None:
            self._nl_states[name] = state
        return state

    def _nl_read(self, name: str) -> EntryState | None:
        store = self._nl_store
        assert store is not None
        try:
            return store.get(name)
        except RecordFormatError as exc:
            logger.error("nats-leader beat: the state of %r is unreadable: %s", name, exc)
            return None
        except ElectionError as exc:
            logger.warning("nats-leader beat: could not read the state of %r: %s", name, exc)
            return None

    def _nl_dispatch(
        self, handle: RoleHandle, token: FencingToken, due: _Due, *, resend: bool = False
    ) -> float:
        """Validate, commit, send, record one tick. Returns the delay before the next pass.

        With ``resend``, ``due`` is the entry's pending tick (committed by an
        earlier term, maybe not sent): it is committed again under this term
        (same slot and run number) before it is sent, so that of two
        schedulers believing they lead only one sends it.
        """
        store = self._nl_store
        assert store is not None
        name, entry, state, plan = due.name, due.entry, due.state, due.plan
        retry = self._nl_retry_delay()
        # Connect to the broker before committing: a tick must not wait for
        # a broker connection between its commit and its send.
        producer = self.producer
        # 1. The lock the user asked for: the token against KV (one read).
        if not handle.validate_token():
            if handle.is_leader:
                logger.warning(
                    "nats-leader beat: could not confirm the fencing token (epoch %d) against "
                    "KV; not dispatching %r now",
                    token.epoch,
                    name,
                )
                return retry
            logger.warning(
                "nats-leader beat: the fencing token (epoch %d) is no longer the role's; "
                "dispatched nothing, following from now on",
                token.epoch,
            )
            return 0.0
        # 2. Commit the tick (compare-and-set on the entry's revision), marked
        #    pending: the intent, recorded before the send.
        if resend:
            new = dataclasses.replace(
                state, epoch=token.epoch, by=self.instance_id, commit=uuid.uuid4().hex[:12]
            )
            logger.warning(
                "nats-leader beat: tick %s of %r was committed by %s (epoch %d) and maybe never "
                "sent; sending it again under the same task id",
                slot_text(state.slot),
                name,
                state.by,
                state.epoch,
            )
        else:
            new = dataclasses.replace(
                state.advanced(
                    due.slot, epoch=token.epoch, by=self.instance_id, skipped=plan.skipped
                ),
                task=str(entry.task),
                pending=True,
            )
        try:
            committed = store.update(new, last=state.revision)
        except RevisionMismatchError:
            return self._nl_conflict(handle, token, name)
        except BackendTimeoutError:
            found = self._nl_reconcile(name, new)
            if found is None:
                return retry
            committed = found
        except (BucketNotFoundError, PermissionDeniedError) as exc:
            logger.critical("nats-leader beat: the schedule state is unusable: %s", exc)
            raise
        except ElectionError as exc:
            logger.warning(
                "nats-leader beat: could not commit tick %s of %r (%s); retrying",
                slot_text(due.slot),
                name,
                exc,
            )
            return retry
        # 3. Send, unless the lease ended meanwhile (then hand the tick back).
        with _signals_deferred():
            if not handle.is_leader:
                self._nl_revert(committed, state, token, "the lease ended before the send")
                return 0.0
            try:
                self._nl_send(entry, committed, token, producer)
            except Exception as exc:
                logger.error(
                    "nats-leader beat: sending %r (tick %s) failed: %r",
                    name,
                    slot_text(committed.slot),
                    exc,
                    exc_info=True,
                )
                self._nl_revert(committed, state, token, "the send failed")
                return retry
        # 4. Record the send (the outbox's completion).
        self._nl_sent[name] = committed.commit
        committed = self._nl_record_sent(committed)
        self._nl_states[name] = committed
        if plan.skipped:
            logger.warning(
                "nats-leader beat: %r had %d overdue ticks (more than beat_max_catch_up=%d): "
                "skipped all but the latest, %s",
                name,
                plan.skipped + 1,
                self.nats_leader_settings.beat_max_catch_up,
                slot_text(committed.slot),
            )
        self.record_run(entry, committed)
        if self.should_sync():
            self._do_sync()
        return 0.0

    def _nl_send(
        self, entry: Any, committed: EntryState, token: FencingToken, producer: Any
    ) -> None:
        role = self._nl_config.role
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
        self._nl_sending = True
        try:
            result = self.apply_async(outgoing, producer=producer, advance=False)
        finally:
            self._nl_sending = False
        logger.info(
            "Scheduler: Sending due task %s (%s) tick %s run %d epoch %d id %s",
            committed.entry,
            entry.task,
            slot,
            committed.runs,
            token.epoch,
            getattr(result, "id", options["task_id"]),
        )

    def _nl_record_sent(self, committed: EntryState) -> EntryState:
        """Mark a sent tick's state as sent (one write); on failure it stays pending.

        A pending state this scheduler sent is never sent again by it (it
        remembers the commit id); the next tick's commit replaces it. Only a
        successor that finds it pending sends it again, which the worker-side
        once-guard makes harmless.
        """
        store = self._nl_store
        assert store is not None
        try:
            return store.update(committed.sent(), last=committed.revision)
        except ElectionError as exc:
            logger.warning(
                "nats-leader beat: tick %s of %r was sent but the send could not be recorded "
                "(%s); a successor may send it again (same task id)",
                slot_text(committed.slot),
                committed.entry,
                exc,
            )
            return committed

    def _nl_conflict(self, handle: RoleHandle, token: FencingToken, name: str) -> float:
        """Someone wrote the entry's state since we read it: re-read, send nothing."""
        fresh = self._nl_read(name)
        if fresh is None:
            self._nl_states.pop(name, None)
            return self._nl_retry_delay()
        self._nl_states[name] = fresh
        logger.warning(
            "nats-leader beat: the state of %r was written by %s (epoch %d) since it was read; "
            "dispatched nothing, re-reading",
            name,
            fresh.by,
            fresh.epoch,
        )
        if fresh.epoch > token.epoch:
            # A newer term wrote it: confirm (the election demotes on a mismatch).
            handle.validate_token()
        return 0.0

    def _nl_reconcile(self, name: str, new: EntryState) -> EntryState | None:
        """A commit timed out: it may have landed. Read the key to find out."""
        fresh = self._nl_read(name)
        if fresh is not None and fresh.commit == new.commit:
            return fresh
        if fresh is None:
            self._nl_states.pop(name, None)
            logger.error(
                "nats-leader beat: the commit of tick %s of %r timed out and the state cannot "
                "be read; not sending it (at most once). If the commit was stored, this tick "
                "is lost.",
                slot_text(new.slot),
                name,
            )
        else:
            self._nl_states[name] = fresh
        return None

    def _nl_revert(
        self, committed: EntryState, previous: EntryState, token: FencingToken, why: str
    ) -> None:
        """Undo a commit whose tick was not sent, if nobody wrote the key since."""
        store = self._nl_store
        assert store is not None
        undo = dataclasses.replace(
            previous, epoch=token.epoch, by=self.instance_id, commit=uuid.uuid4().hex[:12]
        )
        try:
            reverted = store.update(undo, last=committed.revision)
        except ElectionError as exc:
            self._nl_states.pop(committed.entry, None)
            logger.error(
                "nats-leader beat: tick %s of %r was committed but not sent (%s) and the commit "
                "could not be undone (%s): this tick is lost (at most once)",
                slot_text(committed.slot),
                committed.entry,
                why,
                exc,
            )
            return
        self._nl_states[committed.entry] = reverted
        logger.warning(
            "nats-leader beat: tick %s of %r not sent (%s); commit undone, the tick is "
            "dispatched later by the active scheduler",
            slot_text(committed.slot),
            committed.entry,
            why,
        )


@dataclass(frozen=True)
class _Due:
    """A due tick chosen for dispatch."""

    slot: datetime
    name: str
    entry: Any
    state: EntryState
    plan: TickPlan


def _describe_leader(record: LeaderRecord | None) -> str:
    if record is None:
        return "nobody"
    meta = record.meta
    return f"{record.id} (host {meta.get('hostname', '?')}, pid {meta.get('pid', '?')})"


class LeaderScheduler(LeaderSchedulerMixin, PersistentScheduler):  # type: ignore[misc]
    """Celery's default scheduler (``PersistentScheduler``), dispatching only while leading.

    Entries come from ``beat_schedule`` as usual; their state (last tick, run
    count) lives in KV. The local shelve file (``-s``) is kept up to date by
    the leader for display only; any path works on every replica.

    Use it with ``celery beat -S nats_leader`` (the short alias) or
    ``-S celery_nats_leader.beat:LeaderScheduler``, or
    ``beat_scheduler = "nats_leader"`` for ``celery worker -B``.
    """
