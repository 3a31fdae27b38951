"""An operator deletes the role's key by hand (as the demo suggests).

The leader must step down at once (``key_deleted``), a follower lead within
milliseconds, and the new term's epoch be greater than the old one's.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.aio.client import Client

from celery_nats_leader import DemoteReason
from tests.integration.helpers import BUCKET, ROLE, SLACK, TTL, LocalElections

pytestmark = pytest.mark.integration

NAMES = ["a", "b", "c"]


async def test_key_deleted_by_hand_demotes_the_leader_and_a_follower_leads(
    local: LocalElections, bucket: str, nc: Client
) -> None:
    for name in NAMES:
        local.add(name)
    await asyncio.gather(*(local[name].start() for name in NAMES))
    (leader,) = local.leaders()
    token = local[leader].token
    assert token is not None

    kv = await nc.jetstream().key_value(BUCKET)
    deleted_at = time.monotonic()
    await kv.delete(ROLE)

    demoted = await local.wait_for("demoted", [leader], after=deleted_at, timeout=SLACK)
    assert demoted.value is DemoteReason.KEY_DELETED
    assert demoted.at - deleted_at < 0.1
    successor = await local.wait_for("promoted", after=deleted_at, timeout=TTL + SLACK)
    assert successor.name != leader
    assert successor.at - deleted_at < 0.1  # the delete is seen at once: no TTL wait
    assert successor.value.epoch > token.epoch
    assert local.leaders() == [successor.name]
    assert demoted.at < successor.at
