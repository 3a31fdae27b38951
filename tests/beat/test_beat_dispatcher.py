"""The tick dispatcher on its own: validate, commit, send, revert, on the in-memory KV.

No Celery here: the dispatcher takes a lease (anything with ``is_leader`` and
``validate_token()``) and a send callable, so each step and each failure
between them is driven directly.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone

import pytest

from celery_nats_leader.beat.dispatcher import Outcome, Tick, TickDispatcher
from celery_nats_leader.beat.state import EntryState, ScheduleStateStore
from celery_nats_leader.elector import Elector
from celery_nats_leader.nats.memory import MemoryBackend, MemoryServer
from celery_nats_leader.token import FencingToken

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
        "import celery_nats_leader.beat.state, celery_nats_leader.beat.ticks\n"
        "assert celery_nats_leader.beat.tick_task_id('b', 'r', 'e', 't')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
