"""Fast tests of the once-guard recipe on the in-memory KV (manual clock).

Every interleaving that matters: a duplicate of a finished run is told
``DONE``, one of a running run ``BUSY``; a run whose runner died (its lease
expired) is claimable again; a runner that lost its lease learns it on renewal
and on completion; a timed-out create is settled by reading the key.
"""

from __future__ import annotations

import pytest

from celery_nats_leader.config.settings import LeaderSettings
from celery_nats_leader.core.clock import ManualClock
from celery_nats_leader.core.errors import BackendTimeoutError, ConfigError
from celery_nats_leader.nats.memory import MemoryBackend, MemoryBucket, MemoryServer
from celery_nats_leader.recipes.once_guard import (
    ClaimLostError,
    OnceGuard,
    Verdict,
    decode_once,
    once_key,
)

LEASE = 30.0
RETENTION = 3600.0


async def _guard(server: MemoryServer, claimant: str) -> tuple[OnceGuard, MemoryBackend]:
    backend = MemoryBackend(server)
    leases = await backend.open_bucket("once_leases", ttl=LEASE, create=True, replicas=1, timeout=1)
    done = await backend.open_bucket("once", ttl=RETENTION, create=True, replicas=1, timeout=1)
    return OnceGuard(leases, done, claimant=claimant, timeout=1.0), backend


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def server(clock: ManualClock) -> MemoryServer:
    return MemoryServer(clock)


async def test_a_finished_run_is_not_run_again(server: MemoryServer) -> None:
    a, _ = await _guard(server, "a")
    b, _ = await _guard(server, "b")
    first = await a.claim("tick-1")
    assert first.verdict is Verdict.RUN
    assert await a.complete(first) is True
    again = await b.claim("tick-1")
    assert again.verdict is Verdict.DONE
    assert again.holder is not None and again.holder["by"] == "a"
    assert again.holder["outcome"] == "success"
    # The duplicate's claim released its lease: a third one is told DONE too.
    assert (await a.claim("tick-1")).verdict is Verdict.DONE
    # Other ids are independent.
    assert (await b.claim("tick-2")).verdict is Verdict.RUN


async def test_a_duplicate_of_a_running_run_is_busy_until_it_finishes(
    server: MemoryServer,
) -> None:
    a, _ = await _guard(server, "a")
    b, _ = await _guard(server, "b")
    running = await a.claim("t")
    busy = await b.claim("t")
    assert busy.verdict is Verdict.BUSY
    assert busy.holder is not None and busy.holder["by"] == "a"
    await a.complete(running, "failure")
    done = await b.claim("t")
    assert done.verdict is Verdict.DONE
    assert done.holder is not None and done.holder["outcome"] == "failure"


async def test_a_run_whose_runner_died_runs_again_after_the_lease(
    server: MemoryServer, clock: ManualClock
) -> None:
    a, _ = await _guard(server, "a")
    b, _ = await _guard(server, "b")
    await a.claim("t")  # a dies here: no renewal, no completion
    clock.advance(LEASE - 0.5)
    assert (await b.claim("t")).verdict is Verdict.BUSY
    clock.advance(0.5)
    second = await b.claim("t")
    assert second.verdict is Verdict.RUN
    assert await b.complete(second) is True
    assert (await a.claim("t")).verdict is Verdict.DONE


async def test_renewal_keeps_a_long_run_claimed(server: MemoryServer, clock: ManualClock) -> None:
    a, _ = await _guard(server, "a")
    b, _ = await _guard(server, "b")
    claim = await a.claim("t")
    for _ in range(10):  # 10 x LEASE/3: three leases long
        clock.advance(LEASE / 3)
        claim = await a.renew(claim)
        assert (await b.claim("t")).verdict is Verdict.BUSY
    assert await a.complete(claim) is True
    assert (await b.claim("t")).verdict is Verdict.DONE


async def test_a_runner_paused_past_its_lease_learns_it_lost_the_claim(
    server: MemoryServer, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    a, _ = await _guard(server, "a")
    b, _ = await _guard(server, "b")
    paused = await a.claim("t")
    clock.advance(LEASE)  # a is paused: its lease expires
    taken = await b.claim("t")
    assert taken.verdict is Verdict.RUN  # the documented limit: a second run
    with pytest.raises(ClaimLostError):
        await a.renew(paused)
    assert await b.complete(taken) is True
    assert await a.complete(paused) is False
    assert "ran twice" in caplog.text
    # b's record stands.
    status = await a.status("t")
    assert status is not None and status["by"] == "b"


async def test_a_timed_out_claim_that_landed_is_ours(server: MemoryServer) -> None:
    a, _ = await _guard(server, "a")
    leases = a.leases
    assert isinstance(leases, MemoryBucket)
    original = leases.create

    async def create_then_time_out(key: str, value: bytes, *, timeout: float) -> int:
        await original(key, value, timeout=timeout)
        raise BackendTimeoutError("no answer (but stored)")

    leases.create = create_then_time_out  # type: ignore[method-assign]
    claim = await a.claim("t")
    assert claim.verdict is Verdict.RUN and claim.revision > 0
    leases.create = original  # type: ignore[method-assign]
    assert await a.complete(claim) is True


async def test_a_timed_out_claim_that_did_not_land_raises(server: MemoryServer) -> None:
    a, backend = await _guard(server, "a")
    backend.fail_next = lambda: BackendTimeoutError("no answer")
    with pytest.raises(BackendTimeoutError):
        await a.claim("t")
    # Nothing is held: the next attempt claims it.
    assert (await a.claim("t")).verdict is Verdict.RUN


def test_keys_are_valid_and_distinct() -> None:
    assert once_key("5d1f9b1e-2c4a-4e0b-9a57-6b3c1f0d8e42") == (
        "id.5d1f9b1e-2c4a-4e0b-9a57-6b3c1f0d8e42"
    )
    hashed = once_key("report.daily 2024-05-01")
    assert hashed.startswith("h.") and len(hashed) == 66
    assert once_key("h") != once_key("h.")
    assert decode_once(b"not json") is None
    assert decode_once(b'{"key": "x"}') == {"key": "x"}


def test_settings_defaults_and_validation() -> None:
    settings = LeaderSettings(bucket="elections")
    assert settings.once_bucket == "elections_once"
    assert (settings.once_lease, settings.once_retention) == (30.0, 86400.0)
    with pytest.raises(ConfigError, match="once_lease"):
        LeaderSettings(once_lease=0)
    with pytest.raises(ConfigError, match="once_retention"):
        LeaderSettings(once_lease=60, once_retention=100)
    with pytest.raises(ConfigError):
        LeaderSettings(once_bucket="bad.name")


async def test_a_renewal_that_lands_after_the_run_does_not_keep_the_lease(
    server: MemoryServer,
) -> None:
    # The runner stopped renewing while one renewal was already sent; it
    # landed after the run ended, one revision past the claim the runner
    # holds. Releasing (or completing) at the older revision failed, the
    # lease stayed until it expired, and a requeued copy sat BUSY.
    a, _ = await _guard(server, "a")
    b, _ = await _guard(server, "b")
    claim = await a.claim("tick-7")
    await a.renew(claim)  # the late renewal; the runner still holds `claim`
    await a.release(claim)
    assert (await b.claim("tick-7")).verdict is Verdict.RUN

    done_claim = await a.claim("tick-8")
    await a.renew(done_claim)
    assert await a.complete(done_claim) is True
    assert (await b.claim("tick-8")).verdict is Verdict.DONE
    leases = await MemoryBackend(server).open_bucket(
        "once_leases", ttl=LEASE, create=False, replicas=1, timeout=1
    )
    assert await leases.get(once_key("tick-8"), timeout=1) is None


async def test_a_lease_taken_by_another_run_is_not_released(
    server: MemoryServer, clock: ManualClock
) -> None:
    a, _ = await _guard(server, "a")
    b, _ = await _guard(server, "b")
    claim = await a.claim("tick-9")
    clock.advance(LEASE + 1)  # a's lease expired; b runs it now
    taken = await b.claim("tick-9")
    assert taken.verdict is Verdict.RUN
    await a.release(claim)
    c, _ = await _guard(server, "c")
    assert (await c.claim("tick-9")).verdict is Verdict.BUSY
