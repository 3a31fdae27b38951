"""Restarting the shared KV watch after reconnects: never two watches of a bucket.

Logic only (a stand-in bucket whose watch takes a while to start); the restart
itself against a real server that restarts is in tests/integration.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from celery_nats_leader.nats.jetstream import JetStreamBackend


class Connection:
    """What the backend reads of a nats-py client here."""

    is_connected = True
    is_closed = False

    def jetstream(self, timeout: float) -> None:
        return None


class SlowBucket:
    """A bucket whose watch exists on the server as soon as its start begins."""

    name = "leaders"

    def __init__(self) -> None:
        self.live = 0  # watches started and not stopped
        self.starts = 0
        self.entered = asyncio.Event()
        self.finish = asyncio.Event()
        self.finish.set()

    async def watch_all(self, callback: Callable[[Any], None]) -> Callable[[], Awaitable[None]]:
        self.starts += 1
        self.live += 1
        self.entered.set()
        await self.finish.wait()

        async def stop() -> None:
            self.live -= 1

        return stop


async def restarts_done(backend: JetStreamBackend) -> None:
    """Wait for every bucket's restart task (each ends its passes without error)."""
    tasks = list(backend._rewatch_tasks.values())
    assert tasks
    for task in tasks:
        await asyncio.wait_for(task, 5)


async def test_a_reconnect_during_a_restart_leaves_one_watch() -> None:
    backend = JetStreamBackend(Connection())  # type: ignore[arg-type]
    bucket = SlowBucket()
    await backend.shared_watch(bucket)  # type: ignore[arg-type]
    assert (bucket.starts, bucket.live) == (1, 1)

    bucket.finish.clear()
    bucket.entered.clear()
    backend.reconnected()
    await bucket.entered.wait()  # the restart is inside watch_all()
    backend.reconnected()  # and the connection drops and comes back again
    backend.reconnected()
    bucket.finish.set()
    await restarts_done(backend)

    # The first restart finished, then one more pass ran for the reconnects
    # that came during it; each replaced the watch before it.
    assert bucket.starts == 3
    assert bucket.live == 1


async def test_a_reconnect_during_the_first_start_leaves_one_watch() -> None:
    backend = JetStreamBackend(Connection())  # type: ignore[arg-type]
    bucket = SlowBucket()
    bucket.finish.clear()
    first = asyncio.ensure_future(backend.shared_watch(bucket))  # type: ignore[arg-type]
    await bucket.entered.wait()  # the first start is inside watch_all()
    backend.reconnected()
    bucket.finish.set()
    shared = await asyncio.wait_for(first, 5)
    await restarts_done(backend)
    # The restart waited for the first start, then replaced its watch.
    assert (bucket.starts, bucket.live) == (2, 1)
    assert shared.stop is not None
    await shared.stop()
    assert bucket.live == 0


class RefusedBucket(SlowBucket):
    """A bucket whose watch cannot start again (deleted, or its permission revoked)."""

    name = "revoked"

    async def watch_all(self, callback: Callable[[Any], None]) -> Callable[[], Awaitable[None]]:
        if self.starts:
            self.starts += 1
            self.entered.set()
            raise RuntimeError("permissions violation")
        return await super().watch_all(callback)


async def test_a_bucket_that_cannot_watch_again_does_not_hold_back_the_others() -> None:
    backend = JetStreamBackend(Connection())  # type: ignore[arg-type]
    refused, healthy = RefusedBucket(), SlowBucket()
    await backend.shared_watch(refused)  # type: ignore[arg-type]
    await backend.shared_watch(healthy)  # type: ignore[arg-type]

    for restarts in (2, 3):  # after this reconnect, and after the next one
        healthy.entered.clear()
        refused.entered.clear()
        backend.reconnected()
        # The healthy bucket's watch is restarted while the refused one keeps
        # retrying (it would until the connection drops again).
        await asyncio.wait_for(healthy.entered.wait(), 5)
        await asyncio.wait_for(refused.entered.wait(), 5)
        assert (healthy.starts, healthy.live) == (restarts, 1)
        assert refused.starts >= restarts and refused.live == 1
    tasks = dict(backend._rewatch_tasks)
    assert tasks["leaders"].done() and not tasks["revoked"].done()
    await backend.close()
    assert tasks["revoked"].cancelled()


class UnstoppableBucket(SlowBucket):
    """A bucket whose old watch fails to stop (its subscription already gone)."""

    name = "unstoppable"

    async def watch_all(self, callback: Callable[[Any], None]) -> Callable[[], Awaitable[None]]:
        await super().watch_all(callback)

        async def stop() -> None:
            raise RuntimeError("nats: connection closed")

        return stop


async def test_a_failed_stop_of_an_old_watch_is_logged_and_the_others_restart(
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend = JetStreamBackend(Connection())  # type: ignore[arg-type]
    unstoppable, healthy = UnstoppableBucket(), SlowBucket()
    await backend.shared_watch(unstoppable)  # type: ignore[arg-type]
    await backend.shared_watch(healthy)  # type: ignore[arg-type]
    backend.reconnected()
    await restarts_done(backend)
    assert (unstoppable.starts, healthy.starts, healthy.live) == (2, 2, 1)
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        "after a reconnect, the watch of 'unstoppable': nats: connection closed"
    ]
