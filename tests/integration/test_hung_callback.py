"""A hung ``on_promote`` does not keep ``on_demote`` from running when the term ends."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from celery_nats_leader import DemoteReason, FencingToken
from tests.integration.helpers import SLACK, LocalElections, LogCounter

pytestmark = pytest.mark.integration

DEMOTE_TIMEOUT = 1.0


async def test_a_hung_sync_on_promote_does_not_block_the_demote(
    local: LocalElections, bucket: str, package_log: LogCounter
) -> None:
    loop = asyncio.get_running_loop()
    hanging = asyncio.Event()
    release = threading.Event()
    election = local.add("a", demote_timeout=DEMOTE_TIMEOUT)

    @election.on_promote
    def warm_up(token: FencingToken) -> None:
        loop.call_soon_threadsafe(hanging.set)
        release.wait(30)  # a hung connection to some service, say

    # start() waits for the promote callbacks (up to its wait): not awaited here.
    starting = asyncio.create_task(election.start())
    try:
        await asyncio.wait_for(hanging.wait(), 10)
        assert election.is_leader
        resigned_at = time.monotonic()
        await election.resign()

        # The user's on_demote runs within demote_timeout, not once on_promote returns.
        demoted = await local.wait_for(
            "demoted", ["a"], after=resigned_at, timeout=DEMOTE_TIMEOUT + SLACK
        )
        assert demoted.value is DemoteReason.RESIGNED
        assert not election.is_leader
        assert package_log.count("without waiting for it") == 1
        (record,) = [r for r in package_log.records if "without waiting for it" in r.getMessage()]
        assert "warm_up" in record.getMessage()
    finally:
        release.set()
        await asyncio.wait_for(starting, 10)
