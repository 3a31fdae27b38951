"""The leader's lease on its own clock: where a term's lease starts, how it drifts.

Against the in-memory backend with an injected monotonic clock: the clock
only moves when a test moves it, so "a write timed out a minute ago" is one
``advance`` and no real minute.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from celery_nats_leader import DemoteReason, Election, ElectionConfig
from celery_nats_leader.clock import ManualClock
from celery_nats_leader.errors import BackendTimeoutError
from celery_nats_leader.nats.memory import MemoryBackend, MemoryBucket, MemoryServer
from celery_nats_leader.record import encode_record
from celery_nats_leader.token import FencingToken

TTL = 1.0


class Watched:
    """An election with a log of its promotions and demotions."""

    def __init__(self, election: Election, backend: MemoryBackend) -> None:
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
    watched = Watched(Election(config, backend=backend, clock=clock), backend)
    yield watched
    backend.connected = True
    await watched.election.stop()


async def _turns(n: int = 50) -> None:
    """Let the election's tasks run whatever is due (the memory store answers at once)."""
    for _ in range(n):
        await asyncio.sleep(0)


async def _step(election: Election, clock: ManualClock, seconds: float) -> None:
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
