"""The tick dispatcher on its own: validate, commit, send, revert, on the in-memory KV.

No Celery here: the dispatcher takes a lease (anything with ``is_leader`` and
``validate_token()``) and a send callable, so each step and each failure
between them is driven directly.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone

import pytest

from celery_nats_leader.beat.dispatcher import Outcome, Tick, TickDispatcher
from celery_nats_leader.beat.schedule_store import EntryState, ScheduleStateStore
from celery_nats_leader.core.errors import BackendTimeoutError
from celery_nats_leader.election.elector import Elector
from celery_nats_leader.nats.memory import MemoryBackend, MemoryServer
from celery_nats_leader.term.token import FencingToken

UTC = timezone.utc
T0 = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)
TOKEN = FencingToken(epoch=7, value="t-7")


class Lease:
    """A lease the test holds or loses at will."""

    def __init__(self) -> None:
        self.is_leader = True
        self.valid = True
        self.validations = 0

    def validate_token(self) -> bool:
        self.validations += 1
        return self.valid


@pytest.fixture
def store() -> Iterator[ScheduleStateStore]:
    server = MemoryServer()
    elector = Elector(backend_factory=lambda: MemoryBackend(server))
    elector.start(timeout=5.0)
    try:
        yield ScheduleStateStore(
            elector, "leaders_beat", "beat", create=True, replicas=1, timeout=1.0
        )
    finally:
        elector.stop()


@pytest.fixture
def dispatcher(store: ScheduleStateStore) -> TickDispatcher:
    dispatcher = TickDispatcher(store, "unit-a")
    dispatcher.begin_term(TOKEN)
    assert dispatcher.adopt("e", T0, runs=0, task="t", token=TOKEN) is not None
    return dispatcher


def tick(seconds: int) -> Tick:
    return Tick("e", T0 + timedelta(seconds=seconds), task="t")


def test_a_tick_is_committed_before_it_is_sent(
    dispatcher: TickDispatcher, store: ScheduleStateStore
) -> None:
    lease = Lease()
    seen: list[EntryState | None] = []

    def send(committed: EntryState) -> None:
        seen.append(store.get("e"))  # what KV holds at the moment of the send

    result = dispatcher.dispatch(lease, TOKEN, tick(10), send)
    assert result.outcome is Outcome.SENT and lease.validations == 1
    [in_kv] = seen
    assert in_kv is not None and (in_kv.slot, in_kv.runs) == (T0 + timedelta(seconds=10), 1)
    assert dispatcher.states["e"] == result.state == store.get("e")


def test_a_failed_send_is_reverted_and_reported(
    dispatcher: TickDispatcher, store: ScheduleStateStore
) -> None:
    before = store.get("e")
    assert before is not None

    def send(committed: EntryState) -> None:
        raise TypeError("cannot serialize a set")

    result = dispatcher.dispatch(Lease(), TOKEN, tick(10), send)
    assert result.outcome is Outcome.REVERTED and isinstance(result.error, TypeError)
    after = store.get("e")
    assert after is not None and (after.slot, after.runs) == (before.slot, before.runs)
    assert after.revision > before.revision


def test_nothing_is_written_without_a_confirmed_token(
    dispatcher: TickDispatcher, store: ScheduleStateStore
) -> None:
    before = store.get("e")
    lease = Lease()
    lease.valid = False
    sent: list[EntryState] = []
    assert dispatcher.dispatch(lease, TOKEN, tick(10), sent.append).outcome is Outcome.UNCONFIRMED
    lease.is_leader = False
    assert dispatcher.dispatch(lease, TOKEN, tick(10), sent.append).outcome is Outcome.NOT_LEADING
    assert sent == [] and store.get("e") == before


def test_the_lease_ending_after_the_commit_reverts_it(
    dispatcher: TickDispatcher, store: ScheduleStateStore
) -> None:
    lease = Lease()
    real_update = store.update

    def update(state: EntryState, *, last: int) -> EntryState:
        result = real_update(state, last=last)
        lease.is_leader = False  # the lease runs out right after the commit
        return result

    store.update = update  # type: ignore[method-assign]
    sent: list[EntryState] = []
    result = dispatcher.dispatch(lease, TOKEN, tick(10), sent.append)
    assert result.outcome is Outcome.REVERTED and sent == []
    assert result.state is not None and result.state.slot == T0


def test_a_state_written_by_someone_else_is_not_sent_again(
    dispatcher: TickDispatcher, store: ScheduleStateStore
) -> None:
    state = dispatcher.states["e"]
    newer = state.advanced(T0 + timedelta(seconds=10), epoch=8, by="other")
    store.update(newer, last=state.revision)
    lease = Lease()
    sent: list[EntryState] = []
    result = dispatcher.dispatch(lease, TOKEN, tick(10), sent.append)
    assert result.outcome is Outcome.CONFLICT and sent == []
    assert result.state is not None and result.state.by == "other"
    # A newer term wrote it: the token was confirmed again (the election demotes).
    assert lease.validations == 2


def test_the_parts_without_celery_import_without_it() -> None:
    code = (
        "import sys\n"
        "for name in ('celery', 'kombu', 'django'):\n"
        "    sys.modules[name] = None\n"
        "import celery_nats_leader.beat\n"
        "import celery_nats_leader.beat.dispatcher, celery_nats_leader.beat.election\n"
        "import celery_nats_leader.beat.schedule_store, celery_nats_leader.beat.ticks\n"
        "import celery_nats_leader.beat.agenda, celery_nats_leader.beat.metrics\n"
        "assert celery_nats_leader.beat.tick_task_id('b', 'r', 'e', 't')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


# ------------------------------------------------------------------ outbox


def test_the_intent_is_recorded_before_the_send_and_the_send_after(
    dispatcher: TickDispatcher, store: ScheduleStateStore
) -> None:
    seen: list[EntryState | None] = []
    result = dispatcher.dispatch(Lease(), TOKEN, tick(10), lambda c: seen.append(store.get("e")))
    assert result.outcome is Outcome.SENT
    [during] = seen
    assert during is not None and during.pending and during.runs == 1
    after = store.get("e")
    assert (
        after is not None
        and not after.pending
        and (after.slot, after.runs)
        == (
            T0 + timedelta(seconds=10),
            1,
        )
    )
    assert dispatcher.pending_tick("e") is None


def test_a_pending_tick_of_a_dead_scheduler_is_sent_again_under_its_identity(
    dispatcher: TickDispatcher, store: ScheduleStateStore
) -> None:
    # The scheduler of epoch 6 committed tick 10 and died before recording its send.
    state = dispatcher.states["e"]
    dead = dataclasses.replace(
        state.advanced(T0 + timedelta(seconds=10), epoch=6, by="dead"), pending=True
    )
    store.update(dead, last=state.revision)
    successor = TickDispatcher(store, "unit-b")
    successor.begin_term(TOKEN)
    again = successor.pending_tick("e")
    assert again is not None and again.resend and again.slot == T0 + timedelta(seconds=10)
    sent: list[EntryState] = []
    result = successor.dispatch(Lease(), TOKEN, again, sent.append)
    assert result.outcome is Outcome.SENT
    # Same slot and run number (so the same task id), under the new term.
    [resent] = sent
    assert (resent.slot, resent.runs, resent.epoch, resent.by) == (dead.slot, 1, 7, "unit-b")
    final = store.get("e")
    assert final is not None and not final.pending and final.runs == 1
    assert successor.pending_tick("e") is None
    # The next tick follows it: nothing skipped, nothing twice.
    assert successor.dispatch(Lease(), TOKEN, tick(20), sent.append).outcome is Outcome.SENT
    assert [(s.slot, s.runs) for s in sent][1] == (T0 + timedelta(seconds=20), 2)


def test_a_tick_whose_send_was_not_recorded_is_sent_again_by_others_only(
    dispatcher: TickDispatcher, store: ScheduleStateStore
) -> None:
    real_update = store.update

    def update(state: EntryState, *, last: int) -> EntryState:
        if not state.pending:
            raise BackendTimeoutError("the record of the send got no answer")
        return real_update(state, last=last)

    store.update = update  # type: ignore[method-assign]
    sent: list[EntryState] = []
    assert dispatcher.dispatch(Lease(), TOKEN, tick(10), sent.append).outcome is Outcome.SENT
    store.update = real_update  # type: ignore[method-assign]
    in_kv = store.get("e")
    assert in_kv is not None and in_kv.pending
    # Its own dispatcher knows it sent it, even after re-reading the states.
    dispatcher.begin_term(TOKEN)
    assert dispatcher.pending_tick("e") is None
    # A successor does not know: it sends it again (the once-guard's case).
    successor = TickDispatcher(store, "unit-b")
    successor.begin_term(FencingToken(epoch=8, value="t-8"))
    again = successor.pending_tick("e")
    assert again is not None and again.slot == T0 + timedelta(seconds=10)


def test_a_commit_that_could_not_be_undone_stays_pending_and_is_sent_later(
    dispatcher: TickDispatcher, store: ScheduleStateStore
) -> None:
    real_update = store.update

    def update(state: EntryState, *, last: int) -> EntryState:
        if not state.pending:
            raise BackendTimeoutError("the revert got no answer")
        return real_update(state, last=last)

    def send(committed: EntryState) -> None:
        raise ConnectionError("broker down")

    store.update = update  # type: ignore[method-assign]
    result = dispatcher.dispatch(Lease(), TOKEN, tick(10), send)
    store.update = real_update  # type: ignore[method-assign]
    assert result.outcome is Outcome.UNSENT
    dispatcher.begin_term(TOKEN)
    again = dispatcher.pending_tick("e")
    assert again is not None and again.slot == T0 + timedelta(seconds=10)
    sent: list[EntryState] = []
    assert dispatcher.dispatch(Lease(), TOKEN, again, sent.append).outcome is Outcome.SENT
    assert [(s.slot, s.runs) for s in sent] == [(T0 + timedelta(seconds=10), 1)]


def test_a_tick_that_can_never_be_sent_is_dropped_not_resent(store: ScheduleStateStore) -> None:
    dispatcher = TickDispatcher(
        store, "unit-a", is_permanent=lambda exc: isinstance(exc, TypeError)
    )
    dispatcher.begin_term(TOKEN)
    assert dispatcher.adopt("e", T0, runs=0, task="t", token=TOKEN) is not None

    def send(committed: EntryState) -> None:
        raise TypeError("cannot serialize a set")

    result = dispatcher.dispatch(Lease(), TOKEN, tick(10), send)
    assert result.outcome is Outcome.FAILED
    # Dropped as Celery does, and recorded as such: no scheduler sends it again.
    in_kv = store.get("e")
    assert in_kv is not None and not in_kv.pending and in_kv.slot == T0 + timedelta(seconds=10)
    successor = TickDispatcher(store, "unit-b")
    successor.begin_term(FencingToken(epoch=8, value="t-8"))
    assert successor.pending_tick("e") is None
