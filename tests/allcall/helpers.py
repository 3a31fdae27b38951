"""Helpers of the ALLCALL tests (fixtures are in conftest.py).

Two tiers, as for the KV strategy:

* ``cluster``: candidates on the in-memory backend, all driven by one
  :class:`~celery_nats_leader.core.clock.ManualClock`. Logical time only moves when
  a test advances it, in steps of ``STEP``; after every step each election is
  woken and the event loop runs until no message is in flight. Each candidate
  has its own wall clock (the manual clock plus an offset), to play hosts
  whose clocks disagree. Timing assertions are exact in logical time.
* ``nats_server`` and friends: a real ``nats-server`` *without* JetStream on
  a free port, and elections with their own connections.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from celery_nats_leader import DemoteReason, ElectionConfig, FencingToken
from celery_nats_leader.config.connection import ConnectOptions
from celery_nats_leader.core.clock import ManualClock
from celery_nats_leader.election.allcall import AllcallElection
from celery_nats_leader.nats.memory import MemoryBackend, MemoryServer
from celery_nats_leader.term.record import LeaderRecord

# Logical timings of the memory tests: binary fractions, so that sums of
# steps land exactly on heartbeats and deadlines.
T0 = 1000.0
TTL = 2.0
HB = 0.25
SKEW = 0.25
STEP = 0.0625

# Real-server timings (the brief's: lease 2 s, heartbeat 0.2 s, skew 0.2 s).
REAL_TTL = 2.0
REAL_HB = 0.2
REAL_SKEW = 0.2
# Slack for scheduling noise on a loaded 2-core machine: generous on purpose,
# the assertions are about semantics (who leads, never two at once), and the
# benchmark measures latency.
SLACK = 1.5

# Fast client reconnects: the default 2 s would dominate every fault test.
FAST_RECONNECT: dict[str, Any] = {"reconnect_time_wait": 0.1, "connect_timeout": 2}


@dataclass
class Event:
    """Something a candidate's callbacks saw, with the (logical or real) time."""

    at: float
    kind: str
    detail: Any = None


@dataclass
class Node:
    """An election plus what its callbacks saw."""

    election: AllcallElection
    backend: Any
    events: list[Event] = field(default_factory=list)
    promoted: asyncio.Event = field(default_factory=asyncio.Event)
    demoted: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def name(self) -> str:
        return self.election.instance_id

    @property
    def promotions(self) -> list[Event]:
        return [e for e in self.events if e.kind == "promote"]

    @property
    def demotions(self) -> list[DemoteReason]:
        return [e.detail for e in self.events if e.kind == "demote"]

    @property
    def changes(self) -> list[LeaderRecord | None]:
        return [e.detail for e in self.events if e.kind == "change"]


def watch(election: AllcallElection, now: Callable[[], float]) -> Node:
    """Attach recording callbacks (async ones: they run on the loop, in order)."""
    node = Node(election=election, backend=None)

    @election.on_promote
    async def promoted(token: FencingToken) -> None:
        node.events.append(Event(now(), "promote", token))
        node.promoted.set()

    @election.on_demote
    async def demoted(reason: DemoteReason) -> None:
        node.events.append(Event(now(), "demote", reason))
        node.demoted.set()

    @election.on_leader_change
    async def changed(record: LeaderRecord | None) -> None:
        node.events.append(Event(now(), "change", record))

    return node


def allcall_config(name: str, **overrides: Any) -> ElectionConfig:
    options: dict[str, Any] = {
        "role": "beat",
        "instance_id": name,
        "strategy": "allcall",
        "ttl": TTL,
        "heartbeat_interval": HB,
        "max_clock_skew": SKEW,
    }
    options.update(overrides)
    return ElectionConfig(**options)


class MemoryCluster:
    """Candidates on one in-memory bus, under one manual clock."""

    def __init__(self) -> None:
        self.clock = ManualClock(T0)
        self.server = MemoryServer(self.clock)
        self.nodes: list[Node] = []
        # The largest number of simultaneous leaders seen after any step.
        self.max_leaders = 0
        self.overlaps: list[float] = []

    @property
    def now(self) -> float:
        return self.clock.monotonic()

    def add(
        self,
        name: str,
        *,
        priority: int = 0,
        offset: float = 0.0,
        seed: int | None = None,
        **kw: Any,
    ) -> Node:
        """A candidate whose wall clock reads the manual clock plus ``offset``."""
        clock = self.clock
        backend = MemoryBackend(self.server)
        election = AllcallElection(
            allcall_config(name, priority=priority, **kw),
            backend=backend,
            clock=clock,
            rng=random.Random(seed if seed is not None else name),
        )
        election.wall_clock = lambda: clock.monotonic() + offset
        node = watch(election, clock.monotonic)
        node.backend = backend
        self.nodes.append(node)
        return node

    async def start(self, *nodes: Node) -> None:
        for node in nodes:
            await node.election.start(wait=0)
        await self.settle()

    async def settle(self) -> None:
        """Run the loop until no message has been in flight for a while."""
        quiet = 0
        for _ in range(5000):
            await asyncio.sleep(0)
            quiet = 0 if self.server.deliveries else quiet + 1
            if quiet >= 40:
                return
        raise AssertionError("the in-memory bus never went quiet")

    async def step(self) -> None:
        self.clock.advance(STEP)
        for node in self.nodes:
            node.election.wake()
        await self.settle()
        leading = [n for n in self.nodes if n.election.is_leader]
        self.max_leaders = max(self.max_leaders, len(leading))
        if len(leading) > 1:
            self.overlaps.append(self.now)

    async def advance(self, seconds: float) -> None:
        for _ in range(round(seconds / STEP)):
            await self.step()

    async def run_until(self, predicate: Callable[[], bool], limit: float) -> float:
        """Step until ``predicate`` holds; return the logical time it took."""
        start = self.now
        while not predicate():
            if self.now - start > limit + 1e-9:
                raise AssertionError(f"condition not reached within {limit}s (logical)")
            await self.step()
        return self.now - start

    def leaders(self) -> list[Node]:
        return [n for n in self.nodes if n.election.is_leader]

    async def close(self) -> None:
        for node in self.nodes:
            node.backend.connected = True
            node.backend.blackholed = False
            await node.election.stop()


# ---------------------------------------------------------------- real server


def real_config(name: str, **overrides: Any) -> ElectionConfig:
    options: dict[str, Any] = {
        "ttl": REAL_TTL,
        "heartbeat_interval": REAL_HB,
        "max_clock_skew": REAL_SKEW,
    }
    options.update(overrides)
    return allcall_config(name, **options)


class RealNodes:
    """Elections with their own connection each, on the test's event loop."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []

    def add(self, url: str, name: str, *, priority: int = 0, **overrides: Any) -> Node:
        election = AllcallElection(
            real_config(name, priority=priority, **overrides),
            connect_options=ConnectOptions(servers=(url,), options=FAST_RECONNECT),
        )
        node = watch(election, time.monotonic)
        self.nodes.append(node)
        return node

    def leaders(self) -> list[Node]:
        return [n for n in self.nodes if n.election.is_leader]

    async def close(self) -> None:
        await asyncio.gather(*(n.election.stop() for n in self.nodes), return_exceptions=True)


async def wait_for(
    predicate: Callable[[], bool], timeout: float, *, interval: float = 0.01, what: str = ""
) -> float:
    """Poll a condition no event reports, with a deadline; return the time it took."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what or 'condition'} not reached within {timeout:.1f}s")
        await asyncio.sleep(interval)
    return time.monotonic() - start


async def stays(
    predicate: Callable[[], bool], duration: float, *, interval: float = 0.01, what: str = ""
) -> None:
    """Assert that a condition holds at every poll for ``duration`` seconds."""
    end = time.monotonic() + duration
    while time.monotonic() < end:
        assert predicate(), f"{what or 'condition'} stopped holding"
        await asyncio.sleep(interval)
