"""Leader services against the in-memory backend: started on promotion, stopped on demotion.

The same behaviour across real Celery worker processes (SIGKILL, SIGSTOP,
SIGTERM, resign) is in tests/celery/test_celery_services.py.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest

from celery_nats_leader import (
    ElectionConfig,
    KvElection,
    LeaderContext,
    LeadershipLostError,
)
from celery_nats_leader.nats.memory import MemoryBackend, MemoryServer

TTL = 0.6


@dataclass
class Runs:
    """Run intervals of a service, on the monotonic clock: (who, epoch, start, end)."""

    intervals: list[tuple[str, int, float, float]] = field(default_factory=list)
    started: dict[str, asyncio.Event] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, who: str, epoch: int, start: float, end: float) -> None:
        with self.lock:
            self.intervals.append((who, epoch, start, end))

    def assert_never_two_at_once(self) -> None:
        ordered = sorted(self.intervals, key=lambda run: run[2])
        for previous, following in itertools.pairwise(ordered):
            assert previous[3] <= following[2], f"{previous} overlaps {following}"


@pytest.fixture
async def make() -> AsyncIterator[Callable[..., tuple[KvElection, MemoryBackend]]]:
    server = MemoryServer()
    made: list[tuple[KvElection, MemoryBackend]] = []

    def factory(name: str, **overrides: object) -> tuple[KvElection, MemoryBackend]:
        options: dict[str, object] = {
            "role": "poller",
            "ttl": TTL,
            "instance_id": name,
            "create_bucket": True,
        }
        options.update(overrides)
        backend = MemoryBackend(server)
        election = KvElection(ElectionConfig(**options), backend=backend)  # type: ignore[arg-type]
        made.append((election, backend))
        return election, backend

    yield factory
    for election, backend in made:
        backend.connected = True
        backend.latency = 0.0
        await election.stop()


async def wait_until(predicate: Callable[[], bool], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


def async_service(runs: Runs, who: str, *, linger: float = 0.0) -> Callable[..., object]:
    async def service(ctx: LeaderContext) -> None:
        start = time.monotonic()
        runs.started.setdefault(who, asyncio.Event()).set()
        try:
            await asyncio.Event().wait()  # "work" until cancelled
        finally:
            if linger:
                # Cleanup that takes a while: the hand-over must wait for it.
                await asyncio.shield(asyncio.sleep(linger))
            runs.add(who, ctx.token.epoch, start, time.monotonic())

    return service


async def test_async_service_hands_over_without_overlap(
    make: Callable[..., tuple[KvElection, MemoryBackend]],
) -> None:
    runs = Runs()
    a, _ = make("a")
    b, _ = make("b")
    runner_a = a.run_while_leading(async_service(runs, "a", linger=0.1), grace=1.0)
    runner_b = b.run_while_leading(async_service(runs, "b"))
    await a.start()
    await b.start()
    await asyncio.wait_for(runs.started.setdefault("a", asyncio.Event()).wait(), 1)
    assert runner_a.running and not runner_b.running

    await a.resign()  # returns once the service ended and the key is released
    assert not runner_a.running
    await asyncio.wait_for(runs.started.setdefault("b", asyncio.Event()).wait(), 1)
    await b.stop()
    assert [run[0] for run in sorted(runs.intervals, key=lambda r: r[2])] == ["a", "b"]
    runs.assert_never_two_at_once()
    assert (runner_a.runs, runner_b.runs) == (1, 1)
    # The successor's epoch is newer: the fencing token handed to the service grows.
    epochs = [run[1] for run in sorted(runs.intervals, key=lambda r: r[2])]
    assert epochs[0] < epochs[1]


async def test_thread_service_sees_the_end_of_the_lease_on_time(
    make: Callable[..., tuple[KvElection, MemoryBackend]],
) -> None:
    runs = Runs()
    seen: dict[str, float] = {}

    def service(ctx: LeaderContext) -> None:
        start = time.monotonic()
        while not ctx.wait(0.01):
            pass
        seen["stopped"] = time.monotonic()
        runs.add(threading.current_thread().name, ctx.token.epoch, start, time.monotonic())
        assert ctx.reason is not None

    a, backend = make("a", ttl=1.0)
    b, _ = make("b", ttl=1.0)
    a.run_while_leading(service)
    b.run_while_leading(service)
    await a.start()
    await b.start()
    await wait_until(lambda: a.lease_remaining > 0)
    deadline = time.monotonic() + a.lease_remaining
    backend.latency = 2.0  # every renewal now outlives the lease
    await wait_until(lambda: "stopped" in seen, 3)
    # Told at the lease deadline (send + ttl - margin), before the key can expire.
    assert seen["stopped"] - deadline < a.config.lease_margin
    await wait_until(lambda: len(runs.intervals) == 1 and b.is_leader, 3)
    await b.stop()
    await wait_until(lambda: len(runs.intervals) == 2, 3)
    runs.assert_never_two_at_once()


async def test_leading_block_is_cancelled_when_the_term_ends(
    make: Callable[..., tuple[KvElection, MemoryBackend]],
) -> None:
    a, _ = make("a")
    await a.start()
    entered = asyncio.Event()

    async def block() -> None:
        async with a.leading(timeout=1) as ctx:
            assert ctx.token == a.token
            entered.set()
            await asyncio.sleep(60)

    task = asyncio.create_task(block())
    await asyncio.wait_for(entered.wait(), 1)
    await a.resign()
    with pytest.raises(LeadershipLostError, match="'poller' ended inside the block"):
        await asyncio.wait_for(task, 1)

    # A block that ends by itself while leading leaves the task alone.
    b, _ = make("b", role="other")
    await b.start()
    async with b.leading(timeout=1) as ctx:
        assert not ctx.stopped
    assert ctx.stopped  # the context ends with the block
    await asyncio.sleep(0.01)  # no stray cancellation reaches this task


async def test_raising_service_is_restarted_while_leading(
    make: Callable[..., tuple[KvElection, MemoryBackend]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    attempts: list[float] = []

    async def flaky(ctx: LeaderContext) -> None:
        attempts.append(time.monotonic())
        if len(attempts) < 3:
            raise RuntimeError("upstream down")
        await asyncio.Event().wait()

    monkeypatch.setattr("celery_nats_leader.election.leader_services._FIRST_RESTART_DELAY", 0.02)
    a, _ = make("a")
    runner = a.run_while_leading(flaky)
    await a.start()
    await wait_until(lambda: len(attempts) == 3)
    assert runner.running and runner.runs == 1  # one term, one run, restarted inside
    await a.stop()
    assert not runner.running


async def test_a_late_run_delays_the_next_terms_copy_instead_of_overlapping(
    make: Callable[..., tuple[KvElection, MemoryBackend]],
) -> None:
    runs = Runs()

    def stubborn(ctx: LeaderContext) -> None:
        start = time.monotonic()
        ctx.wait()
        if ctx.token.epoch == first_epoch[0]:
            time.sleep(1.0)  # ignores the stop for longer than grace and the sit-out
        runs.add("a", ctx.token.epoch, start, time.monotonic())

    first_epoch: list[int] = []
    a, _ = make("a")
    runner = a.run_while_leading(stubborn, grace=0.01)
    await a.start()
    assert a.token is not None
    first_epoch.append(a.token.epoch)
    await a.resign()  # alone: it takes the role back after sitting out one TTL
    await wait_until(lambda: a.is_leader and a.token is not None and a.token.epoch > first_epoch[0])
    assert runner.runs == 1  # the old copy is still running: no second one yet
    await wait_until(lambda: runner.runs == 2, 3)
    await a.stop()
    await wait_until(lambda: len(runs.intervals) == 2, 3)
    runs.assert_never_two_at_once()


async def test_the_end_of_a_term_has_its_reason_while_the_transition_runs(
    make: Callable[..., tuple[KvElection, MemoryBackend]],
) -> None:
    # A service thread woken by the lease clock can read ``ctx.reason`` after
    # the election left LEADER and before the service's own transition hook
    # recorded why; a hook that runs first sees exactly that window.
    contexts: list[LeaderContext] = []
    seen: list[object] = []

    def service(ctx: LeaderContext) -> None:
        contexts.append(ctx)
        ctx.wait()

    a, _ = make("a")

    def look(old: object, new: object) -> None:
        if contexts and old is not new and not a.is_leader:
            seen.append(contexts[-1].reason)

    a.add_transition_hook(look)  # registered before the service runner's
    a.run_while_leading(service)
    await a.start()
    await wait_until(lambda: bool(contexts))
    await a.resign()
    assert seen and seen[-1] is not None
    assert seen[-1].value == "resigned"
    assert contexts[-1].reason is not None and contexts[-1].reason.value == "resigned"
