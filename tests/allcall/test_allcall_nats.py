"""ALLCALL against real nats-server processes started WITHOUT JetStream.

Timings are the seed's, scaled down: lease 2 s, heartbeat 0.2 s, max clock
skew 0.2 s. Assertions are about semantics (who leads, never two at once
where the algorithm promises it, no takeover before a lease ran out) with
generous upper bounds: other suites share this machine. Latency is measured
by benchmarks/allcall_failover.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client

from celery_nats_leader import DemoteReason, ElectionConfig, Elector
from celery_nats_leader.election import control_subject
from celery_nats_leader.testing import FaultProxy, NatsServer, free_port
from tests.allcall.helpers import (
    REAL_HB,
    REAL_SKEW,
    REAL_TTL,
    SLACK,
    Node,
    RealNodes,
    real_config,
    stays,
    wait_for,
)

pytestmark = pytest.mark.integration

INIT = REAL_TTL + REAL_SKEW
REPO = Path(__file__).resolve().parents[2]


def single_leader(nodes: RealNodes, name: str | None = None) -> bool:
    """Exactly one leader (``name`` if given), and every candidate agrees on it."""
    leaders = nodes.leaders()
    if len(leaders) != 1 or (name is not None and leaders[0].name != name):
        return False
    return all(n.election.leader_id == leaders[0].name for n in nodes.nodes)


async def start_all(*nodes: Node) -> None:
    await asyncio.gather(*(n.election.start(wait=0) for n in nodes))


class NodeProcess:
    """A candidate in its own process (see node_process.py), to be SIGKILLed."""

    def __init__(self, proc: asyncio.subprocess.Process, name: str) -> None:
        self.proc = proc
        self.name = name
        self.events: list[dict[str, Any]] = []
        self._changed = asyncio.Event()
        self._reader = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def spawn(cls, url: str, name: str, priority: int) -> NodeProcess:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.allcall.node_process",
            url,
            name,
            str(priority),
            str(REAL_TTL),
            str(REAL_HB),
            str(REAL_SKEW),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            cwd=REPO,
        )
        return cls(proc, name)

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for line in self.proc.stdout:
            self.events.append(json.loads(line))
            self._changed.set()

    async def wait_event(self, kind: str, timeout: float) -> dict[str, Any]:
        async def seen() -> dict[str, Any]:
            while True:
                for event in self.events:
                    if event["event"] == kind:
                        return event
                self._changed.clear()
                await self._changed.wait()

        return await asyncio.wait_for(seen(), timeout)

    def first(self, kind: str) -> dict[str, Any]:
        return next(event for event in self.events if event["event"] == kind)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)

    async def close(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
        await self.proc.wait()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


@pytest.fixture
async def processes() -> AsyncIterator[list[NodeProcess]]:
    made: list[NodeProcess] = []
    yield made
    for proc in made:
        await proc.close()


# -------------------------------------------------------------------- tests


async def test_one_node_elects_itself_after_lease_plus_skew(
    nats_server: NatsServer, real_nodes: RealNodes
) -> None:
    node = real_nodes.add(nats_server.url, "solo")
    started = time.monotonic()
    await node.election.start(wait=0)
    await asyncio.wait_for(node.promoted.wait(), INIT + 2 * REAL_HB + SLACK)
    took = node.promotions[0].at - started
    assert took >= INIT  # never before the init phase is over
    assert node.election.is_leader and node.election.leader_id == "solo"
    assert await node.election.validate_token() is True
    await stays(lambda: node.election.is_leader, 3 * REAL_HB, what="solo leadership")
    assert not node.demotions


async def test_three_nodes_converge_to_the_lowest_rank(
    nats_server: NatsServer, real_nodes: RealNodes
) -> None:
    nodes = [
        real_nodes.add(nats_server.url, "low", priority=1),
        real_nodes.add(nats_server.url, "top", priority=7),
        real_nodes.add(nats_server.url, "mid", priority=3),
    ]
    await start_all(*nodes)
    await wait_for(
        lambda: single_leader(real_nodes, "top"), INIT + 3 * REAL_HB + SLACK, what="'top' leads"
    )
    await stays(lambda: single_leader(real_nodes, "top"), 5 * REAL_HB, what="one leader")
    assert sum(len(n.promotions) for n in nodes) == 1
    assert not any(n.demotions for n in nodes)


async def test_killed_leader_is_replaced_within_lease_plus_skew(
    nats_server: NatsServer, real_nodes: RealNodes, processes: list[NodeProcess]
) -> None:
    leader = await NodeProcess.spawn(nats_server.url, "doomed", priority=10)
    processes.append(leader)
    # It leads before the others join: a candidate still in its init phase
    # is not eligible, so if the others started while it was (a slow
    # process start), one of them could win instead.
    await leader.wait_event("started", 30)
    await leader.wait_event("promote", INIT + 3 * REAL_HB + SLACK)
    b = real_nodes.add(nats_server.url, "b", priority=5)
    c = real_nodes.add(nats_server.url, "c", priority=1)
    await start_all(b, c)
    await wait_for(lambda: b.election.leader_id == "doomed" == c.election.leader_id, 2)
    await stays(lambda: not real_nodes.leaders(), 2 * REAL_HB)

    # Track the old lease as the survivors know it until a new term begins.
    wall_offset = time.time() - time.monotonic()
    known_expiry = 0.0

    def old_lease_or_new_leader() -> bool:
        nonlocal known_expiry
        view = b.election.describe()
        if view["leader_id"] == "doomed" and view["lease_expires"] is not None:
            known_expiry = max(known_expiry, view["lease_expires"])
        return b.election.is_leader or c.election.is_leader

    leader.kill()
    killed_at = time.monotonic()
    await wait_for(old_lease_or_new_leader, INIT + 2 * REAL_HB + SLACK, interval=0.005)
    await asyncio.wait_for(b.promoted.wait(), 1)
    promoted_at = b.promotions[0].at
    # Within one lease + skew (+ the heartbeat phase and scheduling noise).
    assert promoted_at - killed_at <= INIT + 2 * REAL_HB + SLACK
    # And never before the last lease the survivors heard of, plus the skew.
    assert known_expiry > 0
    assert promoted_at + wall_offset >= known_expiry + REAL_SKEW - 0.005
    await stays(lambda: single_leader(real_nodes, "b"), 3 * REAL_HB)
    token = b.election.token
    assert token is not None
    assert token.epoch > leader.first("promote")["epoch"]


async def test_two_node_cluster_hands_over_on_stop(
    nats_server: NatsServer, real_nodes: RealNodes
) -> None:
    a = real_nodes.add(nats_server.url, "a", priority=5)
    b = real_nodes.add(nats_server.url, "b", priority=1)
    await start_all(a, b)
    await wait_for(lambda: single_leader(real_nodes, "a"), INIT + 3 * REAL_HB + SLACK)
    stopped_at = time.monotonic()
    await a.election.stop()
    await asyncio.wait_for(b.promoted.wait(), 3 * REAL_HB + SLACK)
    # A release is not a crash: the survivor is elected at once, not after a lease.
    assert b.promotions[0].at - stopped_at < REAL_TTL
    assert a.demotions == [DemoteReason.STOPPED]
    assert b.election.is_leader


async def test_joining_node_does_not_disturb_a_leader_with_a_valid_lease(
    nats_server: NatsServer, real_nodes: RealNodes
) -> None:
    a = real_nodes.add(nats_server.url, "a", priority=0)
    await start_all(a)
    await asyncio.wait_for(a.promoted.wait(), INIT + 2 * REAL_HB + SLACK)
    joiner = real_nodes.add(nats_server.url, "joiner", priority=100)
    await joiner.election.start()  # returns once the leader is known
    assert joiner.election.leader_id == "a"
    await stays(lambda: single_leader(real_nodes, "a"), INIT + 5 * REAL_HB, what="the first leader")
    assert not a.demotions and not joiner.promotions


async def test_blackholed_leader_steps_down_before_a_successor_is_elected(
    nats_server: NatsServer, real_nodes: RealNodes
) -> None:
    """Its renewals are no longer echoed, so its lease runs out on its own clock first."""
    async with FaultProxy("127.0.0.1", nats_server.port) as proxy:
        a = real_nodes.add(proxy.url, "a", priority=5)
        b = real_nodes.add(nats_server.url, "b", priority=1)
        await start_all(a, b)
        await wait_for(lambda: single_leader(real_nodes, "a"), INIT + 3 * REAL_HB + SLACK)
        proxy.blackhole()
        await asyncio.wait_for(b.promoted.wait(), INIT + 2 * REAL_HB + SLACK)
        assert a.demotions == [DemoteReason.LEASE_EXPIRED]
        demoted_at = next(e.at for e in a.events if e.kind == "demote")
        assert demoted_at < b.promotions[0].at  # never two leaders
        proxy.heal()


async def test_validate_token_and_roster_on_a_real_server(
    nats_server: NatsServer, real_nodes: RealNodes
) -> None:
    a = real_nodes.add(nats_server.url, "a", priority=5)
    b = real_nodes.add(nats_server.url, "b")
    await start_all(a, b)
    await wait_for(lambda: single_leader(real_nodes, "a"), INIT + 3 * REAL_HB + SLACK)
    assert await a.election.validate_token() is True
    assert await b.election.validate_token() is False
    nc = await nats.connect(nats_server.url)
    try:
        inbox = nc.new_inbox()
        views: list[dict[str, Any]] = []

        async def collect(msg: Any) -> None:
            views.append(json.loads(msg.data))

        await nc.subscribe(inbox, cb=collect)
        await nc.publish(control_subject("leaders", "beat", "roster"), b"{}", reply=inbox)
        await wait_for(lambda: len(views) == 2, 5, what="two roster answers")
    finally:
        await nc.close()
    assert sorted((v["id"], v["is_leader"], v["strategy"]) for v in views) == [
        ("a", True, "allcall"),
        ("b", False, "allcall"),
    ]


async def test_elector_runs_allcall_roles_without_jetstream(nats_server: NatsServer) -> None:
    elector = Elector(nats_server.url, connect_options={"reconnect_time_wait": 0.1})
    handle = elector.add_role(real_config("elected", role="beat"))
    other = elector.add_role(ElectionConfig(**{**_plain(real_config("x")), "role": "reports"}))
    promoted: list[int] = []
    handle.on_promote(lambda token: promoted.append(token.epoch))
    await asyncio.to_thread(elector.start)
    try:
        assert await asyncio.to_thread(handle.wait_for_leadership, INIT + 2 * REAL_HB + SLACK)
        assert await asyncio.to_thread(other.wait_for_leadership, 2)
        assert await asyncio.to_thread(handle.validate_token) is True
        await wait_for(lambda: bool(promoted), 2, what="the promote callback")
        assert handle.token is not None and promoted == [handle.token.epoch]
        # No JetStream, so no bucket: the status comes from the live candidates.
        rows = {row.role: row for row in await asyncio.to_thread(elector.status)}
        assert sorted(rows) == ["beat", "reports"]
        assert rows["beat"].leader_id == "elected"
        assert rows["beat"].epoch == handle.token.epoch
        assert rows["beat"].expires_in is not None and rows["beat"].expires_in > 0
        assert [c["id"] for c in rows["beat"].candidates] == ["elected"]
    finally:
        await asyncio.to_thread(elector.stop)
    assert not handle.is_leader


def _plain(config: ElectionConfig) -> dict[str, Any]:
    return {
        "instance_id": config.instance_id,
        "strategy": config.strategy,
        "ttl": config.ttl,
        "heartbeat_interval": config.heartbeat_interval,
        "max_clock_skew": config.max_clock_skew,
    }


# ---------------------------------------------------------------- partition


class TwoServers:
    """Two clustered nats-servers (no JetStream) whose route runs through a FaultProxy."""

    def __init__(self) -> None:
        self.route_port = free_port()
        self.first = NatsServer(
            jetstream=False,
            server_name="allcall-1",
            cluster_name="allcall",
            cluster_port=self.route_port,
        )
        self.proxy = FaultProxy("127.0.0.1", self.route_port)
        self.second: NatsServer | None = None

    async def start(self) -> None:
        await asyncio.to_thread(self.first.start)
        await self.proxy.start()
        self.second = NatsServer(
            jetstream=False,
            server_name="allcall-2",
            cluster_name="allcall",
            cluster_port=free_port(),
            routes=[f"nats://127.0.0.1:{self.proxy.port}"],
        )
        await asyncio.to_thread(self.second.start)
        await self.wait_routed()

    async def wait_routed(self, timeout: float = 10) -> None:
        """Until a message published on the second server reaches the first."""
        assert self.second is not None
        one: Client = await nats.connect(self.first.url)
        two: Client = await nats.connect(self.second.url)
        try:
            got = asyncio.Event()

            async def received(msg: Any) -> None:
                got.set()

            await one.subscribe("route.check", cb=received)
            await one.flush()
            deadline = time.monotonic() + timeout
            while not got.is_set():
                assert time.monotonic() < deadline, "the route never came up"
                await two.publish("route.check", b"")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(got.wait(), 0.05)
        finally:
            await one.close()
            await two.close()

    async def close(self) -> None:
        await self.proxy.stop()
        for server in (self.second, self.first):
            if server is not None:
                await asyncio.to_thread(server.close)


@pytest.fixture
async def two_servers() -> AsyncIterator[TwoServers]:
    servers = TwoServers()
    try:
        await servers.start()
        yield servers
    finally:
        await servers.close()


async def test_partition_makes_two_leaders_and_healing_converges_within_a_lease(
    two_servers: TwoServers, real_nodes: RealNodes
) -> None:
    assert two_servers.second is not None
    a = real_nodes.add(two_servers.first.url, "a", priority=9)
    b = real_nodes.add(two_servers.first.url, "b", priority=5)
    c = real_nodes.add(two_servers.second.url, "c", priority=1)
    await start_all(a, b, c)
    await wait_for(lambda: single_leader(real_nodes, "a"), INIT + 3 * REAL_HB + SLACK)

    two_servers.proxy.blackhole()  # the route between the servers: a real partition
    await asyncio.wait_for(c.promoted.wait(), INIT + 2 * REAL_HB + SLACK)
    assert a.election.is_leader and c.election.is_leader  # AP: one leader per side
    assert b.election.leader_id == "a"
    c_epoch = c.promotions[0].detail.epoch

    two_servers.proxy.heal()
    took = await wait_for(lambda: single_leader(real_nodes), REAL_TTL + SLACK, what="one leader")
    assert took <= REAL_TTL  # within one lease (measured: about a heartbeat)

    def settled() -> bool:
        # The survivor may re-term above the loser's epoch: demote, then
        # promote a millisecond later. Never two leaders, and all agree.
        leaders = real_nodes.leaders()
        names = {n.election.leader_id for n in real_nodes.nodes}
        return len(leaders) <= 1 and len(names) == 1

    await stays(settled, 5 * REAL_HB, what="one agreed leader after healing")
    await wait_for(lambda: single_leader(real_nodes), REAL_TTL, what="the survivor leading")
    (survivor,) = real_nodes.leaders()
    token = survivor.election.token
    assert token is not None and token.epoch >= c_epoch  # fencing stays monotonic
    assert survivor.name in {"a", "c"}
    if survivor is a:
        assert c.demotions == [DemoteReason.REVISION_CHANGED]
        assert set(a.demotions) <= {DemoteReason.TOKEN_MISMATCH}  # at most the re-term
