"""The leader's pass over the schedule: which due tick goes first, and its dispatch.

:class:`LeaderPass` is the part of the leader scheduler that runs on the
leader only, once per ``tick()``: it asks each entry's ``is_due()`` (as
Celery's scheduler does), lets the planner (:mod:`.ticks`) give a due tick
its slot, picks the oldest, hands it to the dispatcher (:mod:`.dispatcher`),
counts the outcome and says when to look again. It is a base of
:class:`~celery_nats_leader.beat.scheduler.LeaderSchedulerMixin`, whose
hooks (``prepare_entry``, ``catches_up``, ``earliest_slot``,
``dispatch_gate``, ``record_run``) and parts (agenda, planner, metrics,
election) it uses; the message itself is built by :mod:`.send`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from celery import beat as celery_beat

from celery_nats_leader.beat.agenda import Agenda
from celery_nats_leader.beat.dispatcher import Outcome, Tick, TickDispatcher
from celery_nats_leader.beat.election import BeatElection
from celery_nats_leader.beat.introspection import cron_cutoff, is_numeric
from celery_nats_leader.beat.metrics import TickMetrics
from celery_nats_leader.beat.schedule_store import EntryState
from celery_nats_leader.beat.send import send_tick, tick_options
from celery_nats_leader.beat.ticks import TickPlan, TickPlanner, slot_text, to_utc
from celery_nats_leader.config.settings import LeaderSettings
from celery_nats_leader.election.elector import RoleHandle
from celery_nats_leader.term.token import FencingToken
from celery_nats_leader.worker.celery_compat import (
    deadline_left_to_the_slots,
    slot_schedule,
    slots_overrule_is_due,
)

if TYPE_CHECKING:
    # Celery is untyped: type-check the pass as a Scheduler (``Any``).
    from celery.beat import Scheduler as _SchedulerBase
else:
    _SchedulerBase = object

__all__ = ["DueTick", "LeaderPass"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DueTick:
    """A due tick chosen for dispatch: its slot, its entry and the entry's state."""

    slot: datetime
    name: str
    entry: Any
    state: EntryState
    skipped: int


_ONE_MICROSECOND = timedelta(microseconds=1)


class LeaderPass(_SchedulerBase):  # type: ignore[misc]  # Celery is untyped
    """The leader's pass of the leader scheduler (a base of its mixin, not used alone)."""

    # Set by LeaderSchedulerMixin.__init__ (declared here for the type checker).
    nats_leader_settings: LeaderSettings
    nats_leader_election: BeatElection
    nats_leader_planner: TickPlanner
    nats_leader_agenda: Agenda
    nats_leader_metrics: TickMetrics
    _sending: bool

    def _retry_delay(self) -> float:
        return self.nats_leader_election.retry_delay(float(self.max_interval))

    def _lead(self, handle: RoleHandle, token: FencingToken, dispatcher: TickDispatcher) -> float:
        """A leader's pass: dispatch the oldest due tick, or say when to look again."""
        max_interval = float(self.max_interval)
        # Seconds before anything needs a look (not bounded by max_interval
        # yet: Celery bounds the adjusted delay, see the end).
        wake = math.inf
        best: DueTick | None = None
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
                again = DueTick(resend.slot, name, entry, state, 0)
                return self._dispatch(handle, token, dispatcher, again, resend=True)
            # As Celery's heap: times on the entry's own clock (its schedule's now).
            now = _timestamp(entry.default_now())
            held = self.nats_leader_agenda.held_for(name, entry, state.revision, now)
            if held is not None:
                wake = min(wake, held)
                continue
            due = self._due(name, entry, state, now)
            if not isinstance(due, DueTick):
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

    def _due(self, name: str, entry: Any, state: EntryState, now_ts: float) -> DueTick | float:
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
            return DueTick(plan.slot, name, entry, state, plan.skipped)
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
        return DueTick(slot, name, entry, state, 0)

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
        cutoff = cron_cutoff(schedule, now, self.app.conf.beat_cron_starting_deadline)
        if cutoff is not None:
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
        due: DueTick,
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
        settings = self.nats_leader_settings
        options = tick_options(
            entry,
            committed,
            token,
            state_bucket=settings.beat_state_bucket,
            role=self.nats_leader_election.config.role,
            dispatcher_id=self.instance_id,
            once=settings.beat_once,
        )
        self._sending = True
        try:
            send_tick(self.apply_async, entry, committed, token, producer=producer, options=options)
        finally:
            self._sending = False


def _timestamp(moment: datetime) -> float:
    return to_utc(moment).timestamp()
