"""The election state machine against the in-memory backend.

Fast logic tests only: every behaviour here is also exercised against a real
nats-server in tests/integration.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable

import pytest

from celery_nats_leader import DemoteReason, ElectionConfig, ElectionState, KvElection
from celery_nats_leader.core.clock import ManualClock
from celery_nats_leader.core.errors import BucketNotFoundError, ElectionStoppedError
from celery_nats_leader.nats.memory import MemoryBackend, MemoryServer
from celery_nats_leader.term.record import decode_record, encode_record
from celery_nats_leader.term.token import FencingToken

TTL = 0.6


class Candidate:
    """An election plus a log of what its callbacks saw."""

    def __init__(self, election: KvElection, backend: MemoryBackend) -> None:
        self.election = election
        self.backend = backend
        self.promotions: list[int] = []
        self.demotions: list[DemoteReason] = []
        self.promoted = asyncio.Event()
        self.demoted = asyncio.Event()

        @election.on_promote
        async def promoted(token: object) -> None:
            self.promotions.append(getattr(token, "epoch", -1))
            self.promoted.set()

        @election.on_demote
        async def demoted(reason: DemoteReason) -> None:
            self.demotions.append(reason)
            self.demoted.set()


@pytest.fixture
def server() -> MemoryServer:
    srv = MemoryServer()
    return srv


@pytest.fixture
async def make(server: MemoryServer) -> AsyncIterator[Callable[..., Candidate]]:
    made: list[Candidate] = []

    def factory(name: str, **overrides: object) -> Candidate:
        options: dict[str, object] = {
            "role": "beat",
            "ttl": TTL,
            "instance_id": name,
            "create_bucket": True,
        }
        options.update(overrides)
        clock = options.pop("clock", None)
        backend = MemoryBackend(server)
        election = KvElection(
            ElectionConfig(**options),  # type: ignore[arg-type]
            backend=backend,
            clock=clock,  # type: ignore[arg-type]
        )
        candidate = Candidate(election, backend)
        made.append(candidate)
        return candidate

    yield factory
    for candidate in made:
        candidate.backend.connected = True
        await candidate.election.stop()


def leaders(*candidates: Candidate) -> list[str]:
    return [c.election.instance_id for c in candidates if c.election.is_leader]


async def wait_until(predicate: Callable[[], bool], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


async def test_exactly_one_of_three_leads(make: Callable[..., Candidate]) -> None:
    cands = [make(f"c{i}") for i in range(3)]
    await asyncio.gather(*(c.election.start() for c in cands))
    assert len(leaders(*cands)) == 1
    leader = next(c for c in cands if c.election.is_leader)
    for c in cands:
        assert c.election.leader_id == leader.election.instance_id
    assert {c.election.state for c in cands} == {ElectionState.LEADER, ElectionState.FOLLOWER}


async def test_graceful_stop_hands_over_and_epochs_grow(
    make: Callable[..., Candidate], server: MemoryServer
) -> None:
    cands = [make(f"c{i}") for i in range(3)]
    await asyncio.gather(*(c.election.start() for c in cands))
    seen_epochs = []
    for _ in range(2):
        leader = next(c for c in cands if c.election.is_leader)
        token = leader.election.token
        assert token is not None
        seen_epochs.append(token.epoch)
        rest = [
            c for c in cands if c is not leader and c.election.state is not ElectionState.STOPPED
        ]
        await leader.election.stop()
        assert leader.demotions == [DemoteReason.STOPPED]
        await asyncio.wait_for(
            asyncio.wait(
                [asyncio.ensure_future(c.promoted.wait()) for c in rest],
                return_when=asyncio.FIRST_COMPLETED,
            ),
            1.0,
        )
        assert len(leaders(*cands)) == 1
        cands = rest
    last = next(c for c in cands if c.election.is_leader)
    assert last.election.token is not None
    seen_epochs.append(last.election.token.epoch)
    assert seen_epochs == sorted(seen_epochs) and len(set(seen_epochs)) == 3


async def test_renewals_keep_the_role_for_many_ttls(make: Callable[..., Candidate]) -> None:
    a, b = make("a"), make("b")
    await a.election.start()
    await b.election.start()
    await asyncio.sleep(TTL * 4)
    assert leaders(a, b) == ["a"]
    assert a.demotions == [] and b.promotions == []


async def test_crashed_leader_is_replaced_after_ttl(make: Callable[..., Candidate]) -> None:
    a, b = make("a"), make("b")
    await a.election.start()
    await b.election.start()
    # A crash: the process stops renewing, nothing is released.
    assert a.election._main_task is not None
    a.election._main_task.cancel()
    a.backend.connected = False
    started = time.monotonic()
    await asyncio.wait_for(b.promoted.wait(), TTL * 3)
    elapsed = time.monotonic() - started
    assert TTL * 0.5 < elapsed < TTL + 0.3
    assert not a.election.is_leader  # its own lease ran out before b won


async def test_paused_leader_reports_not_leader_and_fails_validation(
    make: Callable[..., Candidate],
) -> None:
    clock = ManualClock()
    a = make("a", clock=clock)
    await a.election.start()
    assert a.election.is_leader and a.election.token is not None
    # SIGSTOP past the lease: the monotonic clock jumps while nothing ran.
    clock.advance(TTL)
    assert not a.election.is_leader
    assert a.election.token is None
    assert await a.election.validate_token() is False


async def test_token_changed_by_hand_demotes_leader(
    make: Callable[..., Candidate], server: MemoryServer
) -> None:
    a = make("a")
    await a.election.start()
    bucket = await a.backend.open_bucket("leaders", ttl=TTL, create=False, replicas=1, timeout=1)
    forged = encode_record(instance_id="intruder", token="forged", epoch=None, priority=0, meta={})
    await bucket.put("beat", forged, timeout=1)
    await asyncio.wait_for(a.demoted.wait(), 1)
    assert a.demotions == [DemoteReason.REVISION_CHANGED]
    assert not a.election.is_leader
    assert a.election.leader_id == "intruder"


async def test_validate_token_detects_foreign_record(make: Callable[..., Candidate]) -> None:
    a = make("a", ttl=3.0)
    await a.election.start()
    assert await a.election.validate_token() is True
    # Replace the record without a watch event reaching the leader.
    state = a.backend.server.buckets["leaders"]
    watchers, state.watchers = state.watchers, []
    bucket = await a.backend.open_bucket("leaders", ttl=3.0, create=False, replicas=1, timeout=1)
    await bucket.put(
        "beat",
        encode_record(instance_id="b", token="other", epoch=None, priority=0, meta={}),
        timeout=1,
    )
    state.watchers = watchers
    assert await a.election.validate_token() is False
    await asyncio.wait_for(a.demoted.wait(), 1)
    assert a.demotions == [DemoteReason.TOKEN_MISMATCH]


async def test_unreachable_store_demotes_within_the_lease(make: Callable[..., Candidate]) -> None:
    a = make("a", ttl=1.0, disconnect_grace=0.5)
    b = make("b", ttl=1.0)
    await a.election.start()
    await b.election.start()
    a.backend.connected = False
    started = time.monotonic()
    await asyncio.wait_for(a.demoted.wait(), 2)
    assert a.demotions == [DemoteReason.DISCONNECTED]
    assert 0.5 <= time.monotonic() - started < 0.9
    await asyncio.wait_for(b.promoted.wait(), 2)
    # b cannot win before a's key expired, which is after a stepped down.
    assert b.election.is_leader and not a.election.is_leader


async def test_slow_store_makes_leader_step_down_before_expiry(
    make: Callable[..., Candidate],
) -> None:
    a = make("a", ttl=1.0)
    await a.election.start()
    promoted_at = time.monotonic()
    a.backend.latency = 2.0  # every renewal now outlives the lease
    await asyncio.wait_for(a.demoted.wait(), 2)
    assert a.demotions == [DemoteReason.LEASE_EXPIRED]
    assert time.monotonic() - promoted_at < 1.0  # before the key could expire


async def test_resign_hands_over_and_sits_out(make: Callable[..., Candidate]) -> None:
    a, b = make("a"), make("b")
    await a.election.start()
    await b.election.start()
    await a.election.resign()
    assert a.demotions == [DemoteReason.RESIGNED]
    await asyncio.wait_for(b.promoted.wait(), 1)
    assert leaders(a, b) == ["b"]


async def test_a_resigner_sitting_out_is_not_in_line_for_the_next_hand_over(
    make: Callable[..., Candidate],
) -> None:
    # a resigns, b leads; while a sits out (it will not campaign) it must not
    # announce itself as first in line, or c would wait a step for it when b
    # hands over next.
    # A TTL long enough that the sit-out outlasts an announce point under load.
    a, b, c = make("a", ttl=3.0), make("b", ttl=3.0), make("c", ttl=3.0)
    await a.election.start()
    await b.election.start()
    await c.election.start()
    announced: list[dict[str, object]] = []
    announce = a.election._announce

    async def spy(body: dict[str, object]) -> None:
        announced.append(body)
        await announce(body)

    a.election._announce = spy  # type: ignore[method-assign]
    await a.election.resign()
    resigned_at = time.monotonic()
    await asyncio.wait_for(b.promoted.wait(), 3)
    heartbeat = a.election.config.heartbeat_interval
    # a's loop passed at least one announce point during its sit-out.
    await wait_until(lambda: a.election._next_announce_at >= resigned_at + heartbeat * 0.99)
    assert a.election._clock.monotonic() < a.election._sit_out_until, "outlived the sit-out"
    assert [body for body in announced if "here" in body] == []
    assert c.election._roster.place(time.monotonic(), leaving="b") == (0, 0)


async def test_lonely_resigner_takes_the_role_back_after_a_ttl(
    make: Callable[..., Candidate],
) -> None:
    a = make("a")
    await a.election.start()
    a.promoted.clear()
    await a.election.resign()
    assert not a.election.is_leader
    await asyncio.wait_for(a.promoted.wait(), TTL * 3)
    assert a.promotions[0] < a.promotions[1]


async def test_start_returns_once_the_promote_callbacks_have_run(
    make: Callable[..., Candidate],
) -> None:
    """As leader, ``await start()`` returns after ``on_promote`` ran, sync or async.

    It used to depend on how many loop turns ``asyncio.wait_for`` took to
    resume ``start()``: an async callback had run on Python 3.11 and had not
    on 3.12+, a sync one (on its thread) had not on any version.
    """
    a = make("a")
    ran: list[int] = []

    @a.election.on_promote
    def slow_sync_promoted(token: FencingToken) -> None:
        time.sleep(0.05)
        ran.append(token.epoch)

    await a.election.start()
    assert a.election.is_leader
    assert a.promotions == [1]
    assert ran == [1]


async def test_failing_health_check_resigns(make: Callable[..., Candidate]) -> None:
    healthy = threading.Event()
    healthy.set()
    a = make("a", health_check=healthy.is_set, health_check_failures=2)
    b = make("b")
    await a.election.start()
    await b.election.start()
    healthy.clear()
    await asyncio.wait_for(a.demoted.wait(), 2)
    assert a.demotions == [DemoteReason.HEALTH_CHECK_FAILED]
    await asyncio.wait_for(b.promoted.wait(), 1)


async def test_stop_during_a_release_still_hands_over_in_milliseconds(
    make: Callable[..., Candidate],
) -> None:
    """stop() while a failed health check's release runs: the key still goes at once."""
    healthy = threading.Event()
    healthy.set()
    a = make("a", ttl=2.0, health_check=healthy.is_set, health_check_failures=1)
    b = make("b", ttl=2.0)
    leader_work_stopped = asyncio.Event()

    @a.election.on_demote
    async def stop_leader_work(reason: DemoteReason) -> None:
        await leader_work_stopped.wait()

    await a.election.start()
    await b.election.start()
    healthy.clear()
    await wait_until(lambda: a.demotions == [DemoteReason.HEALTH_CHECK_FAILED])
    stopping = asyncio.ensure_future(a.election.stop())
    await wait_until(lambda: a.election._main_task is None)  # stop() cancelled the loop
    released_at = time.monotonic()
    leader_work_stopped.set()
    await asyncio.wait_for(b.promoted.wait(), 3)
    assert time.monotonic() - released_at < 0.2  # not the TTL (2 s)
    await asyncio.wait_for(stopping, 1)
    assert a.demotions == [DemoteReason.HEALTH_CHECK_FAILED]


async def test_a_hanging_demote_callback_is_waited_for_demote_timeout_only(
    make: Callable[..., Candidate], caplog: pytest.LogCaptureFixture
) -> None:
    """A sync ``on_demote`` that never returns: resign() and stop() still return.

    The term is not released (leader work may still be stopping) but left to
    expire, and the role's loop goes on: the lone candidate leads again.
    """
    a = make("a", demote_timeout=0.2)
    hang = threading.Event()

    @a.election.on_demote
    def never_returns(reason: DemoteReason) -> None:
        hang.wait()

    try:
        await a.election.start()
        a.promoted.clear()
        started = time.monotonic()
        await asyncio.wait_for(a.election.resign(), 2)
        assert 0.2 <= time.monotonic() - started < 0.5
        assert "demote callbacks still running after 0.2s (demote_timeout)" in caplog.text
        # Its record expires (nobody deleted it) and the loop campaigns again.
        await wait_until(lambda: a.election.is_leader, timeout=TTL * 4)
        started = time.monotonic()
        await asyncio.wait_for(a.election.stop(), 2)
        # One demote_timeout: the teardown does not wait for the overdue callbacks again.
        assert 0.2 <= time.monotonic() - started < 0.2 * 2
    finally:
        hang.set()


async def test_garbage_in_the_key_is_someone_elses_until_it_expires(
    make: Callable[..., Candidate], server: MemoryServer, caplog: pytest.LogCaptureFixture
) -> None:
    setup = MemoryBackend(server)
    bucket = await setup.open_bucket("leaders", ttl=TTL, create=True, replicas=1, timeout=1)
    await bucket.put("beat", b"\x00garbage", timeout=1)
    a = make("a")
    await a.election.start()
    assert not a.election.is_leader
    assert a.election.leader_id is None
    await asyncio.wait_for(a.promoted.wait(), TTL * 3)
    assert sum("not a leader record" in r.message for r in caplog.records) == 1


async def test_higher_priority_campaigns_first(make: Callable[..., Candidate]) -> None:
    low = make("low", priority=0)
    high = make("high", priority=5)
    holder = make("holder", priority=0)
    await holder.election.start()
    await low.election.start()
    await high.election.start()
    await holder.election.stop()
    await asyncio.wait_for(high.promoted.wait(), 1)
    assert leaders(low, high) == ["high"]


async def test_polite_takeover(make: Callable[..., Candidate]) -> None:
    low = make("low", priority=0)
    await low.election.start()
    high = make("high", priority=10, allow_takeover=True)
    await high.election.start()
    await asyncio.wait_for(high.promoted.wait(), 2)
    assert low.demotions == [DemoteReason.TAKEOVER]
    assert leaders(low, high) == ["high"]


async def test_takeover_is_refused_by_a_preferred_leader(make: Callable[..., Candidate]) -> None:
    high = make("high", priority=10)
    await high.election.start()
    low = make("low", priority=0, allow_takeover=True)
    await low.election.start()
    await asyncio.sleep(TTL)
    assert leaders(low, high) == ["high"] and high.demotions == []


async def test_slow_and_raising_callbacks_do_not_stall_renewals(
    make: Callable[..., Candidate],
) -> None:
    a = make("a", ttl=1.0)
    release = threading.Event()

    def slow(_token: object) -> None:
        release.wait(5)

    def boom(_token: object) -> None:
        raise RuntimeError("callback bug")

    a.election.on_promote(boom)
    a.election.on_promote(slow)
    await a.election.start()
    await asyncio.sleep(2.5)  # several TTLs while the callback blocks its thread
    assert a.election.is_leader and a.demotions == []
    release.set()


async def test_leftover_record_of_ours_is_cleared(
    make: Callable[..., Candidate], server: MemoryServer
) -> None:
    a, b = make("a", ttl=2.0), make("b", ttl=2.0)
    await a.election.start()
    await b.election.start()
    token = a.election.token
    assert token is not None
    # a loses its connection long enough to step down, its key still stored.
    a.backend.connected = False
    await asyncio.wait_for(a.demoted.wait(), 3)
    a.backend.connected = True
    a.election.wake()  # what the connection's reconnected callback does
    reconnected = time.monotonic()
    # a deletes its own leftover record at once, so the role does not stay
    # empty until the record expires (about a second from now).
    await wait_until(lambda: len(leaders(a, b)) == 1, timeout=1.0)
    assert time.monotonic() - reconnected < 0.5
    epoch = a.election.token or b.election.token
    assert epoch is not None and epoch.epoch > token.epoch


async def test_bucket_missing_fails_fast_with_advice(server: MemoryServer) -> None:
    election = KvElection(ElectionConfig(ttl=TTL), backend=MemoryBackend(server))
    with pytest.raises(BucketNotFoundError):
        await election.start()


async def test_bucket_deleted_while_running_stops_with_error(
    make: Callable[..., Candidate], server: MemoryServer
) -> None:
    a = make("a")
    await a.election.start()
    del server.buckets["leaders"]
    await asyncio.wait_for(a.demoted.wait(), TTL * 2)
    await wait_until(lambda: a.election.state is ElectionState.STOPPED)
    assert isinstance(a.election.error, BucketNotFoundError)
    with pytest.raises(BucketNotFoundError):
        await a.election.wait_for_leadership(0.1)


async def test_start_twice_is_an_error(make: Callable[..., Candidate]) -> None:
    a = make("a")
    await a.election.start()
    with pytest.raises(ElectionStoppedError):
        await a.election.start()


async def test_describe_reports_the_term(make: Callable[..., Candidate]) -> None:
    a = make("a")
    await a.election.start()
    info = a.election.describe()
    assert info["is_leader"] and info["state"] == "leader" and info["epoch"] >= 1
    assert 0 < info["lease_remaining"] <= TTL
    stored = await (
        await a.backend.open_bucket("leaders", ttl=TTL, create=False, replicas=1, timeout=1)
    ).get("beat", timeout=1)
    assert stored is not None
    assert decode_record(stored.value, stored.revision).epoch == info["epoch"]


async def test_leftover_is_cleared_only_after_demote_callbacks_returned(
    make: Callable[..., Candidate],
) -> None:
    a, b = make("a", ttl=2.0), make("b", ttl=2.0)
    callback_returned: list[float] = []

    def slow_demote(_reason: DemoteReason) -> None:
        time.sleep(0.4)  # stopping leader work takes a while
        callback_returned.append(time.monotonic())

    a.election.on_demote(slow_demote)
    await a.election.start()
    await b.election.start()
    a.backend.connected = False
    await asyncio.wait_for(a.demoted.wait(), 3)
    a.promoted.clear()
    a.backend.connected = True
    a.election.wake()
    # The next term (whoever wins it) starts only after the callback returned.
    await wait_until(lambda: a.promoted.is_set() or b.promoted.is_set(), timeout=3)
    promoted_at = time.monotonic()
    assert callback_returned, "a new term started before the old leader's callback returned"
    assert callback_returned[0] <= promoted_at


async def test_a_create_overwritten_before_its_ack_is_a_lost_campaign(
    make: Callable[..., Candidate], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A clustered nats-server before 2.9.21 can accept two concurrent creates
    # of one key (nats-server#4320): ours lands, another lands right after it,
    # and the watch reports the other before our create's acknowledgement.
    from celery_nats_leader.nats.memory import MemoryBucket

    original = MemoryBucket.create
    other = encode_record(instance_id="other", token="t-other", epoch=None, priority=0, meta={})

    async def create_then_overwritten(
        self: MemoryBucket, key: str, value: bytes, *, timeout: float
    ) -> int:
        revision = await original(self, key, value, timeout=timeout)
        await self.put(key, other, timeout=timeout)  # the concurrent create that also won
        return revision

    monkeypatch.setattr(MemoryBucket, "create", create_then_overwritten)
    a = make("a")
    await a.election.start()
    assert not a.election.is_leader
    assert a.promotions == []  # never announced a term it did not hold
    assert a.election.leader_id == "other"
