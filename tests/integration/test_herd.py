"""A thundering herd: 100 candidates of one role in one process, on 4 connections.

One process hosting many candidates is the worst case for the herd: every
message of every candidate is handled by the same event loop, and the leader
renews on that loop too. (100 processes would cost 100 interpreters for the
same test.)
"""

from __future__ import annotations

import asyncio
import functools
import time

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from celery_nats_leader import DemoteReason
from tests.integration.helpers import (
    BUCKET,
    ROLE,
    SLACK,
    TTL,
    LocalElections,
    assert_increasing,
    poll,
)

pytestmark = pytest.mark.integration

CANDIDATES = 100
CONNECTIONS = 4
RELEASES = 4


class WriteCounter:
    """Counts writes to the role's key (campaigns and renewals) seen by the server."""

    def __init__(self) -> None:
        self.count = 0

    async def attach(self, nc: Client) -> None:
        async def on_write(msg: Msg) -> None:
            self.count += 1

        await nc.subscribe(f"$KV.{BUCKET}.{ROLE}", cb=on_write)
        await nc.flush()


async def everyone_follows(local: LocalElections, names: list[str], leader: str) -> bool:
    return all(local[name].leader_id == leader for name in names)


async def test_herd_of_100_one_winner_per_release_and_epochs_grow(
    local: LocalElections, bucket: str, nc: Client
) -> None:
    connections = await local.connect(CONNECTIONS)
    names = [f"h{i:03d}" for i in range(CANDIDATES)]
    for i, name in enumerate(names):
        local.add(name, connection=connections[i % CONNECTIONS], release_on_stop=False)

    async def start(name: str) -> float:
        await local[name].start()
        return time.monotonic()

    began = time.monotonic()
    returned = await asyncio.gather(*(start(name) for name in names))
    first = await local.wait_for("promoted", timeout=TTL + SLACK)
    assert local.leaders() == [first.name]
    assert {local[name].leader_id for name in names} == {first.name}
    # start() returns once the candidate knows who leads, not after a TTL: a
    # start waiting for the key to expire would return a TTL after it began,
    # and the leader's promotion comes a campaign after the hundred joined.
    # Measured from that promotion, not from the start: the herd's first
    # decision took about 0.5 s here with one core busy, 0.8 s with a test
    # beside it; in a CI run with a CPU hog and the other lane, the hundred
    # starts returned 2.5 s after they began (their TTL-long wait for it).
    late = [round(at - first.at, 3) for at in sorted(returned)[-5:]]
    assert max(returned) - first.at < TTL / 2, (late, round(first.at - began, 3))
    writes = WriteCounter()
    await writes.attach(nc)

    winners = [first]
    for _ in range(RELEASES):
        leader = winners[-1]
        before = writes.count
        released_at = time.monotonic()
        await local[leader.name].resign()
        winner = await local.wait_for("promoted", after=released_at, timeout=TTL + SLACK)
        # Released (deleted), so the herd campaigns at once, well before an expiry.
        assert winner.at - released_at < TTL / 2, winner.at - released_at
        assert winner.name != leader.name  # it sits out one TTL after resigning
        assert local.leaders() == [winner.name]
        await poll(
            functools.partial(everyone_follows, local, names, winner.name),
            timeout=TTL,
            what="all candidates know the winner",
        )
        # A loser learns who won from one failed create (two writes: the
        # create, and the retry over the delete marker), or from the watch
        # before it even tried: no retry storm on the key. (Allowance: a few
        # creates timed out under load and retried once; and renewals.)
        campaigns = writes.count - before
        assert campaigns <= 2 * CANDIDATES + 20, campaigns
        winners.append(winner)

    # Expiry instead of release: the leader leaves without deleting its key.
    leader = winners[-1]
    stopped_at = time.monotonic()
    await local[leader.name].stop()
    winner = await local.wait_for("promoted", after=stopped_at, timeout=TTL + SLACK)
    assert TTL - 0.75 < winner.at - stopped_at < TTL + SLACK, winner.at - stopped_at
    winners.append(winner)
    assert local.leaders() == [winner.name]

    # Exactly one winner per round: every promotion is the round's winner, and
    # each leader was demoted (by its resignation) before the next promotion.
    promotions = local.events("promoted")
    assert [e.name for e in promotions] == [w.name for w in winners]
    assert_increasing(e.value.epoch for e in promotions)
    demotions = local.events("demoted")
    assert [e.value for e in demotions] == [DemoteReason.RESIGNED] * RELEASES + [
        DemoteReason.STOPPED
    ]
    for demoted, promoted in zip(demotions, promotions[1:], strict=True):
        assert demoted.at < promoted.at
