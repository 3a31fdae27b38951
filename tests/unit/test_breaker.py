"""The campaign backoff and its circuit breaker, with a store that refuses writes.

JetStream out of storage answers reads but refuses every write. The breaker
must open on failed writes whatever the reads say, and an open circuit must
never retry faster than the backoff it replaces.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random

import pytest

from celery_nats_leader import ElectionConfig, KvElection
from celery_nats_leader.core.backoff import Backoff
from celery_nats_leader.core.clock import ManualClock
from celery_nats_leader.core.constants import BACKOFF_MAX_SECONDS, CIRCUIT_BREAKER_THRESHOLD
from celery_nats_leader.nats.memory import MemoryBackend, MemoryBucket, MemoryServer

TTL = 0.6  # min(30 s, TTL) was the old cooldown: far below the 5-s backoff ceiling


def test_circuit_opens_after_the_threshold_of_consecutive_failures() -> None:
    backoff = Backoff(breaker_threshold=4, rng=random.Random(1))
    delays = [backoff.failure() for _ in range(3)]
    assert not backoff.circuit_open
    assert delays == sorted(delays)  # still growing
    backoff.failure()
    assert backoff.circuit_open
    backoff.success()
    assert not backoff.circuit_open and backoff.failures == 0


@pytest.mark.parametrize("cooldown", [0.0, 0.6, 4.99, 5.0, 30.0])
def test_open_circuit_never_waits_less_than_the_backoff_ceiling(cooldown: float) -> None:
    backoff = Backoff(
        maximum=BACKOFF_MAX_SECONDS, breaker_threshold=3, breaker_cooldown=cooldown, jitter=0.1
    )
    before_open = [backoff.failure() for _ in range(2)]
    open_delays = [backoff.failure() for _ in range(5)]
    assert backoff.circuit_open
    assert open_delays == [max(cooldown, BACKOFF_MAX_SECONDS)] * 5
    assert all(d <= BACKOFF_MAX_SECONDS * 1.1 for d in before_open)


async def _pump(election: KvElection, clock: ManualClock, seconds: float, step: float) -> None:
    """Move the election's clock forward ``seconds`` in ``step``s, letting its loop run."""
    for _ in range(round(seconds / step)):
        clock.advance(step)
        election.wake()
        # The memory store answers at once: a few loop turns let the election
        # run whatever became due (a read, a campaign) before the next step.
        for _ in range(20):
            await asyncio.sleep(0)


async def test_breaker_opens_when_creates_fail_but_reads_succeed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    clock = ManualClock()
    server = MemoryServer(clock)
    server.storage_full = True
    attempts: list[float] = []
    reads: list[float] = []
    original_create, original_get = MemoryBucket.create, MemoryBucket.get

    async def create(self: MemoryBucket, key: str, value: bytes, *, timeout: float) -> int:
        attempts.append(clock.monotonic())
        return await original_create(self, key, value, timeout=timeout)

    async def get(self: MemoryBucket, key: str, *, timeout: float) -> object:
        reads.append(clock.monotonic())
        return await original_get(self, key, timeout=timeout)

    monkeypatch.setattr(MemoryBucket, "create", create)
    monkeypatch.setattr(MemoryBucket, "get", get)
    election = KvElection(
        ElectionConfig(role="beat", ttl=TTL, instance_id="a", create_bucket=True),
        backend=MemoryBackend(server),
        clock=clock,
    )
    caplog.set_level(logging.WARNING, logger="celery_nats_leader.election")
    try:
        await election.start(wait=0)
        simulated = 120.0
        await _pump(election, clock, simulated, step=0.05)
        assert not election.is_leader
        # Reads kept succeeding every heartbeat all along...
        assert len(reads) > simulated / election.config.heartbeat_interval / 2
        # ...and still the writes backed off and the circuit opened.
        gaps = [b - a for a, b in itertools.pairwise(attempts)]
        assert len(attempts) > CIRCUIT_BREAKER_THRESHOLD
        open_gaps = gaps[CIRCUIT_BREAKER_THRESHOLD - 1 :]
        assert min(open_gaps) >= BACKOFF_MAX_SECONDS - 1e-6
        # At most one create per 5 s once open (40 in 3 s were measured before).
        assert len(attempts) <= CIRCUIT_BREAKER_THRESHOLD + simulated / BACKOFF_MAX_SECONDS
        assert any(
            f"{CIRCUIT_BREAKER_THRESHOLD} failures in a row" in r.getMessage()
            for r in caplog.records
        )
        # Storage freed: the next attempt after the cooldown wins.
        server.storage_full = False
        await _pump(election, clock, BACKOFF_MAX_SECONDS * 1.2, step=0.05)
        assert election.is_leader
    finally:
        await election.stop()
