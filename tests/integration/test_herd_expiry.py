"""A thundering herd on *expiry*: the leader is SIGKILLed, 100 followers wait it out.

The leader is a process of its own (so that it can really be killed, with
nothing released); the 100 followers run in the test's loop on 4 connections,
as in tests/integration/test_herd.py. Nobody deletes the key: each follower
counts the record out on its own clock, the first in line deletes it at the
revision it saw and campaigns.
"""

from __future__ import annotations

import asyncio
import functools

import pytest
from nats.aio.client import Client

from tests.harness.candidate_control import CandidateGroup
from tests.integration.helpers import SLACK, TTL, LocalElections, poll
from tests.integration.test_herd import CANDIDATES, CONNECTIONS, WriteCounter, everyone_follows

pytestmark = pytest.mark.integration


async def test_herd_of_100_after_a_sigkill_one_winner_after_the_ttl(
    local: LocalElections, group: CandidateGroup, bucket: str, nc: Client
) -> None:
    group.spawn("leader")
    first = await asyncio.to_thread(group.wait_for, "promoted", {"leader"}, timeout=TTL + SLACK)
    connections = await local.connect(CONNECTIONS)
    names = [f"h{i:03d}" for i in range(CANDIDATES)]
    for i, name in enumerate(names):
        local.add(name, connection=connections[i % CONNECTIONS])
    await asyncio.gather(*(local[name].start() for name in names))
    assert {local[name].leader_id for name in names} == {"leader"}
    writes = WriteCounter()
    await writes.attach(nc)

    killed_at = group["leader"].kill()
    winner = await local.wait_for("promoted", after=killed_at, timeout=TTL + 2 * SLACK)
    # Not before the dead leader's record could have expired (the followers
    # count TTL from when they first saw its last renewal, up to a heartbeat
    # before the kill), and not much after.
    assert TTL * 3 / 4 - 0.05 < winner.at - killed_at < TTL + SLACK, winner.at - killed_at
    await poll(
        functools.partial(everyone_follows, local, names, winner.name),
        timeout=TTL,
        what="all candidates know the winner",
    )
    assert local.leaders() == [winner.name]
    # One winner, once: no follower was promoted but the winner, and no
    # retry storm on the key (a conditional delete and a create per
    # follower at most, plus renewals and a few retries under load).
    # (Absence of a second promotion cannot be awaited: look half a TTL on.)
    await asyncio.sleep(TTL / 2)
    assert [e.name for e in local.events("promoted")] == [winner.name]
    assert winner.value.epoch > first["epoch"]
    assert writes.count <= 2 * CANDIDATES + 20, writes.count
    assert local.events("demoted") == []
