"""Follower-driven expiry on the in-memory store, with an injected clock.

The store here never expires the key by itself (like a replica whose
``max_age`` timer did not fire): only the follower's own count can end a
term. Every step is driven by advancing the clock and waking the follower.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from celery_nats_leader import ElectionConfig, ElectionState, KvElection
from celery_nats_leader.core import constants as c
from celery_nats_leader.core.clock import ManualClock
from celery_nats_leader.nats.memory import MemoryBackend, MemoryBucket, MemoryServer
from celery_nats_leader.term.record import decode_record, encode_record
from celery_nats_leader.term.token import FencingToken

# Long enough that no real-time timer of the election fires during a test:
# only the manual clock and wake() move it.
TTL = 30.0
CONFIG = ElectionConfig(role="beat", ttl=TTL, instance_id="follower")
EXPIRES = TTL + c.FOLLOWER_EXPIRY_MARGIN_SECONDS
# The follower's own campaign delay (priority 0 among priority 0: jitter only).
LATEST_DELAY = CONFIG.campaign_jitter + 0.001


class Transitions:
    """An observer that lets the test await the follower's state changes."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []
        self.changed = asyncio.Event()

    def state_changed(self, role: str, instance_id: str, old: str, new: str) -> None:
        self.seen.append((old, new))
        self.changed.set()

    def campaign(self, role: str, instance_id: str, won: bool) -> None:
        pass

    def heartbeat(self, role: str, instance_id: str, seconds: float, ok: bool) -> None:
        pass

    def validation(self, role: str, instance_id: str, ok: bool) -> None:
        pass

    async def next(self, old: ElectionState, new: ElectionState) -> None:
        want = (old.value, new.value)
        while want not in self.seen:
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), 3)
        self.seen.clear()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def server(clock: ManualClock) -> MemoryServer:
    return MemoryServer(clock)


@pytest.fixture
async def old_leader(server: MemoryServer) -> tuple[MemoryBucket, int]:
    """The bucket, with a term of "old" at the returned revision."""
    bucket = await MemoryBackend(server).open_bucket(
        "leaders", ttl=TTL, create=True, replicas=1, timeout=1
    )
    record = encode_record(instance_id="old", token="t-old", epoch=None, priority=0, meta={})
    return bucket, await bucket.create("beat", record, timeout=1)


@pytest.fixture
async def follower(
    server: MemoryServer, clock: ManualClock, old_leader: tuple[MemoryBucket, int]
) -> AsyncIterator[tuple[KvElection, Transitions]]:
    transitions = Transitions()
    election = KvElection(CONFIG, backend=MemoryBackend(server), clock=clock, observer=transitions)
    await election.start()
    server.buckets["leaders"].ttl = 0  # from now on the store never expires the key
    assert election.state is ElectionState.FOLLOWER and election.leader_id == "old"
    yield election, transitions
    await election.stop()


async def test_a_renewal_at_the_deadline_is_never_deleted_even_by_a_blind_follower(
    server: MemoryServer,
    clock: ManualClock,
    old_leader: tuple[MemoryBucket, int],
    follower: tuple[KvElection, Transitions],
) -> None:
    bucket, first = old_leader
    election, transitions = follower
    # The follower's watch goes blind (as after a server restart): it will not
    # hear of the renewal, and still counts the first revision's age.
    server.buckets["leaders"].watchers.clear()
    # The old leader renews at the very end of its lease (TTL - lease margin).
    clock.advance(CONFIG.lease_seconds)
    record = encode_record(instance_id="old", token="t-old", epoch=first, priority=0, meta={})
    renewed = await bucket.update("beat", record, last=first, timeout=1)
    # The follower's count for the first revision runs out: it tries to delete
    # that revision, which the store refuses, and it learns of the renewal.
    clock.advance(EXPIRES - CONFIG.lease_seconds + LATEST_DELAY)
    election.wake()
    await transitions.next(ElectionState.CANDIDATE, ElectionState.FOLLOWER)
    entry = await bucket.get("beat", timeout=1)
    assert entry is not None and entry.revision == renewed
    assert decode_record(entry.value, entry.revision).token == "t-old"
    assert not election.is_leader and election.leader_id == "old"


async def test_an_unrenewed_record_is_deleted_at_its_revision_after_ttl_and_margin(
    clock: ManualClock,
    old_leader: tuple[MemoryBucket, int],
    follower: tuple[KvElection, Transitions],
) -> None:
    bucket, first = old_leader
    election, transitions = follower
    promoted: list[FencingToken] = []
    election.on_promote(promoted.append)
    clock.advance(EXPIRES + LATEST_DELAY)
    election.wake()
    await transitions.next(ElectionState.CANDIDATE, ElectionState.LEADER)
    assert election.is_leader
    token = election.token
    assert token is not None and token.epoch > first
    entry = await bucket.get("beat", timeout=1)
    assert entry is not None and decode_record(entry.value, entry.revision).id == "follower"
