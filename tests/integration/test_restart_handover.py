"""A graceful hand-over after nats-server restarted: still milliseconds.

A restarted server has lost the consumers behind the followers' KV watches;
nats-py resubscribes their inboxes but nothing feeds them. Followers then
learned of a release only from their periodic read, up to a
``resync_interval`` late (139-142 ms in a seeded fault run with TTL 1 s,
against 2-9 ms for a hand-over before any restart).

A candidate that leaves while the server is down says goodbye to no one: its
place in line must go with the reconnect, not three heartbeats later.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from celery_nats_leader import DemoteReason
from celery_nats_leader.testing import NatsServer
from tests.integration.helpers import HEARTBEAT, LEASE, SLACK, TTL, LocalElections, in_thread

pytestmark = pytest.mark.integration

NAMES = ["a", "b", "c", "d", "e"]
RESTARTS = 3
#: A hand-over is a delete seen on the watch, then one conditional write.
#: Far above what it takes (single-digit milliseconds when idle), far below
#: what a blind watch costs: the periodic read comes once per TTL here.
HANDOVER_BOUND = HEARTBEAT / 4


async def agreed_leader(local: LocalElections, names: list[str], timeout: float) -> str:
    """Wait until every election is connected and all name the same, single leader."""
    deadline = time.monotonic() + timeout
    while True:
        elections = [local[name] for name in names]
        leaders = [e.instance_id for e in elections if e.is_leader]
        connected = all(e._backend is not None and e._backend.is_connected for e in elections)
        if connected and len(leaders) == 1 and {e.leader_id for e in elections} == set(leaders):
            return leaders[0]
        assert time.monotonic() < deadline, [(e.instance_id, e.leader_id) for e in elections]
        await asyncio.sleep(0.01)


async def test_graceful_handover_after_a_server_restart_takes_milliseconds(
    local: LocalElections, bucket: str, nats_server: NatsServer
) -> None:
    # The periodic read only once per TTL: a blind watch cannot hide behind it.
    for name in NAMES:
        local.add(name, resync_interval=TTL)
    await asyncio.gather(*(local[name].start() for name in NAMES))
    running = list(NAMES)
    handovers: list[float] = []
    for _ in range(RESTARTS):
        await in_thread(nats_server.restart)  # same port, same store: the bucket survives
        leader = await agreed_leader(local, running, 2 * TTL + 3 * SLACK)
        # The scenario is a hand-over some time after the restart, not one
        # racing the reconnect itself.
        await asyncio.sleep(HEARTBEAT)
        running.remove(leader)
        stopped_at = time.monotonic()
        await local[leader].stop()
        successor = await local.wait_for("promoted", running, after=stopped_at, timeout=TTL + SLACK)
        handovers.append(successor.at - stopped_at)

    assert max(handovers) < HANDOVER_BOUND, [f"{h * 1000:.1f} ms" for h in handovers]
    # No term born with its lease over (promoted, then lease_expired at once):
    # a lease can only run out a whole lease after the term's first write.
    for demoted in local.events("demoted"):
        if demoted.value is DemoteReason.LEASE_EXPIRED:
            promoted = max(
                (e for e in local.events("promoted", [demoted.name]) if e.at <= demoted.at),
                key=lambda e: e.at,
            )
            assert demoted.at - promoted.at > LEASE / 2, (promoted, demoted)


#: Each priority point below the best live candidate costs priority_step
#: (10 ms): a stale candidate this far ahead cost the cap, 0.5 s.
PREFERRED_PRIORITY = 50


async def test_a_candidate_gone_while_the_server_was_down_keeps_no_place_in_line(
    local: LocalElections, bucket: str, nats_server: NatsServer
) -> None:
    # b is preferred over c: while b lives, c campaigns 0.5 s after a release.
    local.add("a")
    await local["a"].start()
    assert local["a"].is_leader
    local.add("b", priority=PREFERRED_PRIORITY)
    local.add("c")
    await asyncio.gather(local["b"].start(), local["c"].start())
    assert await agreed_leader(local, ["a", "b", "c"], TTL + SLACK) == "a"
    # b leaves while the server is down: its "bye" goes nowhere.
    await in_thread(nats_server.stop)
    await local["b"].stop()
    await in_thread(nats_server.start)
    assert await agreed_leader(local, ["a", "c"], TTL + SLACK) == "a"
    # At once: b's last "here" is still well within the roster's expiry
    # (three heartbeats), so only the reconnect can have removed it.
    stopped_at = time.monotonic()
    await local["a"].stop()
    successor = await local.wait_for("promoted", ["c"], after=stopped_at, timeout=TTL + SLACK)

    took = successor.at - stopped_at
    assert took < HANDOVER_BOUND, f"{took * 1000:.1f} ms"
