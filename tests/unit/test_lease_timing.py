"""The leader's lease on its own clock: where a term's lease starts, how it drifts.

Against the in-memory backend with an injected monotonic clock: the clock
only moves when a test moves it, so "a write timed out a minute ago" is one
``advance`` and no real minute.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from celery_nats_leader import DemoteReason, ElectionConfig, KvElection
from celery_nats_leader.core.clock import ManualClock
from celery_nats_leader.core.errors import BackendTimeoutError
from celery_nats_leader.nats.memory import MemoryBackend, MemoryBucket, MemoryServer
from celery_nats_leader.term.record import encode_record
from celery_nats_leader.term.token import FencingToken

TTL = 1.0


class Watched:
    """An election with a log of its promotions and demotions."""

    def __init__(self, election: KvElection, backend: MemoryBackend) -> None:
        self.election = election
        self.backend = backend
        self.promotions: list[int] = []
        self.demotions: list[DemoteReason] = []
        self.promoted = asyncio.Event()

        @election.on_promote
        async def promoted(token: FencingToken) -> None:
            self.promotions.append(token.epoch)
            self.promoted.set()

        @election.on_demote
        async def demoted(reason: DemoteReason) -> None:
            self.demotions.append(reason)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def server() -> MemoryServer:
    # The store expires records on the real clock: moving the candidate's
    # clock never expires anything server-side, only in the candidate's view.
    return MemoryServer()


@pytest.fixture
async def candidate(server: MemoryServer, clock: ManualClock) -> AsyncIterator[Watched]:
    backend = MemoryBackend(server)
    config = ElectionConfig(role="beat", ttl=TTL, instance_id="a", create_bucket=True)
    watched = Watched(KvElection(config, backend=backend, clock=clock), backend)
    yield watched
    backend.connected = True
    await watched.election.stop()


async def _turns(n: int = 50) -> None:
    """Let the election's tasks run whatever is due (the memory store answers at once)."""
    for _ in range(n):
        await asyncio.sleep(0)


async def _step(election: KvElection, clock: ManualClock, seconds: float) -> None:
    clock.advance(seconds)
    election.wake()
    await _turns()


def _time_out_next(
    monkeypatch: pytest.MonkeyPatch, candidate: Watched, server: MemoryServer, method: str
) -> None:
    """The candidate's next ``method`` (create or update): ``b`` takes the key, no answer comes."""
    original = getattr(MemoryBucket, method)
    armed = [True]

    async def write(self: MemoryBucket, key: str, value: bytes, **kwargs: object) -> int:
        if self._backend is candidate.backend and armed[0]:
            armed[0] = False
            record = encode_record(
                instance_id="b", token="b-token", epoch=None, priority=0, meta={}
            )
            await MemoryBucket(MemoryBackend(server), "leaders").put("beat", record, timeout=1)
            raise BackendTimeoutError("no answer within 0.2s")
        result: int = await original(self, key, value, **kwargs)
        return result

    monkeypatch.setattr(MemoryBucket, method, write)


@pytest.mark.parametrize("timed_out", ["campaign", "renewal"])
async def test_a_term_won_long_after_a_timed_out_write_gets_a_whole_lease(
    candidate: Watched,
    server: MemoryServer,
    clock: ManualClock,
    monkeypatch: pytest.MonkeyPatch,
    timed_out: str,
) -> None:
    """A write that timed out in an earlier campaign or term does not shorten a later term.

    The timed-out write turned out not to be ours (``b`` holds the key), so
    its send time says nothing about the revision a later campaign creates.
    """
    election = candidate.election
    if timed_out == "campaign":
        _time_out_next(monkeypatch, candidate, server, "create")
        await election.start(wait=0.05)
        assert candidate.promotions == []
    else:
        await election.start()
        assert candidate.promotions == [1]
        _time_out_next(monkeypatch, candidate, server, "update")
        await _step(election, clock, election.config.heartbeat_interval)
        assert candidate.demotions == [DemoteReason.REVISION_CHANGED]
    assert election.leader_id == "b"
    # b stops renewing; a minute later a ends b's record as expired and wins.
    promotions_before = len(candidate.promotions)
    candidate.promoted.clear()
    await _step(election, clock, 60.0)
    await asyncio.wait_for(candidate.promoted.wait(), 1)
    await _turns()
    assert len(candidate.promotions) == promotions_before + 1
    assert election.is_leader
    assert election.lease_remaining == pytest.approx(election.config.lease_seconds)
    # Not promoted, then demoted at birth by a lease that ran out a minute ago.
    assert DemoteReason.LEASE_EXPIRED not in candidate.demotions


async def test_background_validation_finds_a_foreign_record_and_demotes(
    server: MemoryServer, clock: ManualClock
) -> None:
    """``validation_interval``: between two renewals, a read finds someone else's record.

    The record is replaced without a watch event reaching the leader (a
    blind watch), half a heartbeat before its next renewal would notice.
    """
    backend = MemoryBackend(server)
    heartbeat = TTL / 4
    config = ElectionConfig(
        role="beat",
        ttl=TTL,
        instance_id="a",
        create_bucket=True,
        validation_interval=1.5 * heartbeat,
    )
    a = Watched(KvElection(config, backend=backend, clock=clock), backend)
    try:
        await a.election.start()
        await _step(a.election, clock, heartbeat)  # renewed at t0 + 1 heartbeat
        assert a.election.is_leader
        state = server.buckets["leaders"]
        watchers, state.watchers = state.watchers, []
        foreign = encode_record(instance_id="b", token="other", epoch=None, priority=0, meta={})
        await MemoryBucket(MemoryBackend(server), "leaders").put("beat", foreign, timeout=1)
        state.watchers = watchers
        await _step(a.election, clock, heartbeat / 2)  # t0 + 1.5: validation, no renewal yet
        assert a.demotions == [DemoteReason.TOKEN_MISMATCH]
        assert not a.election.is_leader
    finally:
        await a.election.stop()


class DriftingClock:
    """A monotonic clock that runs at ``rate`` times the true one (a drifting oscillator)."""

    def __init__(self, true: ManualClock, rate: float) -> None:
        self._true = true
        self._rate = rate
        self._origin = true.monotonic()

    def monotonic(self) -> float:
        return 1000.0 + (self._true.monotonic() - self._origin) * self._rate


def _cut_off(monkeypatch: pytest.MonkeyPatch, backend: MemoryBackend, election: KvElection) -> None:
    """Every write and read of ``backend`` times out at once, its watch goes silent.

    A leader partitioned from the store, with nothing to tell it so.
    """
    state = backend.server.buckets["leaders"]
    state.watchers = [w for w in state.watchers if getattr(w[1], "__self__", None) is not election]
    for method in ("update", "get"):
        original = getattr(MemoryBucket, method)

        async def cut(self: MemoryBucket, *args: object, _orig: Any = original, **kw: Any) -> Any:
            if self._backend is backend:
                raise BackendTimeoutError("no answer")
            return await _orig(self, *args, **kw)

        monkeypatch.setattr(MemoryBucket, method, cut)


@pytest.mark.parametrize(
    ("leader_rate", "follower_rate", "safe"),
    [
        (1.0, 1.0, True),
        (0.92, 1.0, True),  # the leader's clock 8 % slow
        (1.0, 1.08, True),  # the follower's 8 % fast
        (0.95, 1.04, True),  # both, 8.7 % apart
        (0.905, 1.0, True),  # just inside the bound (90 % of the store's TTL)
        (1.0, 1.11, True),  # the follower alone 11 % fast: (ttl - margin) / (ttl + 10 ms)
        (0.85, 1.0, False),  # 15 %: beyond the bound, the terms overlap
    ],
)
async def test_the_lease_margin_covers_clock_rate_drift_up_to_the_documented_bound(
    monkeypatch: pytest.MonkeyPatch, leader_rate: float, follower_rate: float, safe: bool
) -> None:
    """A partitioned leader and a follower whose monotonic clocks run at different rates.

    The leader leads until ``send + ttl - lease_margin`` on its clock; the
    follower deletes the record at ``seen + ttl + 10 ms`` on its own; the
    store expires it at ``store + ttl`` on its own. docs/design.md: no overlap
    while the leader's clock measures a duration at least
    ``(ttl - lease_margin) / ttl`` (90 %) of what the others measure.
    """
    true = ManualClock()
    server = MemoryServer(true)
    backends = {name: MemoryBackend(server) for name in ("a", "b")}
    rates = {"a": leader_rate, "b": follower_rate}
    elections = {
        name: Watched(
            KvElection(
                ElectionConfig(role="beat", ttl=TTL, instance_id=name, create_bucket=True),
                backend=backends[name],
                clock=DriftingClock(true, rates[name]),
            ),
            backends[name],
        )
        for name in ("a", "b")
    }
    a, b = elections["a"].election, elections["b"].election
    try:
        await a.start()
        assert a.is_leader
        _cut_off(monkeypatch, backends["a"], a)  # no renewal of a's lands from now on
        await b.start(wait=0)
        overlap = 0.0
        step = 0.002
        while not b.is_leader:
            assert true.monotonic() < 1000.0 + 2 * TTL, "b never took over"
            true.advance(step)
            a.wake()
            b.wake()
            await _turns(20)
            if a.is_leader and b.is_leader:
                overlap += step
        if safe:
            assert overlap == 0.0
            assert elections["a"].demotions == [DemoteReason.LEASE_EXPIRED]
        else:
            assert overlap > 0.0  # the test does see a violation when there is one
    finally:
        for election in (a, b):
            await election.stop()


class _Renewals:
    """An election observer that keeps the send time of each confirmed renewal."""

    def __init__(self) -> None:
        self.sent: list[float] = []

    def state_changed(self, role: str, instance_id: str, old: str, new: str) -> None:
        """Ignore."""

    def campaign(self, role: str, instance_id: str, won: bool) -> None:
        """Ignore."""

    def heartbeat(self, role: str, instance_id: str, seconds: float, ok: bool) -> None:
        """Keep the send time of a confirmed renewal."""
        if ok:
            self.sent.append(time.monotonic() - seconds)

    def validation(self, role: str, instance_id: str, ok: bool) -> None:
        """Ignore."""


async def test_a_leader_whose_renewal_hangs_steps_down_at_the_last_lease_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After two renewals, a renewal that never returns: demoted at its lease's end.

    On the real clock. The renewal hangs past any timeout, so only the lease
    timer can end the term. The timer armed at the promotion is due before the
    renewals' deadline (renewals do not re-schedule it): it must find the
    lease still valid, wait on, and end the term at the last confirmed send +
    ``lease_seconds``, not later.
    """
    renewals = _Renewals()
    backend = MemoryBackend(MemoryServer())
    config = ElectionConfig(role="beat", ttl=TTL, instance_id="a", create_bucket=True)
    watched = Watched(KvElection(config, backend=backend, observer=renewals), backend)
    election = watched.election
    demoted = asyncio.Event()
    election.on_demote(lambda reason: demoted.set())
    original = MemoryBucket.update
    hang = asyncio.Event()

    async def update(self: MemoryBucket, key: str, value: bytes, **kwargs: Any) -> int:
        if len(renewals.sent) >= 2:
            await hang.wait()  # never set: no answer, no timeout
        result: int = await original(self, key, value, **kwargs)
        return result

    monkeypatch.setattr(MemoryBucket, "update", update)
    try:
        await election.start()
        await asyncio.wait_for(demoted.wait(), 4 * TTL)
        demoted_at = time.monotonic()
        assert len(renewals.sent) == 2
        assert watched.demotions == [DemoteReason.LEASE_EXPIRED]
        late = demoted_at - (renewals.sent[-1] + config.lease_seconds)
        # Never early; late only by the loop's timer latency (a loaded machine).
        assert 0.0 <= late < 0.1
    finally:
        hang.set()
        await election.stop()
