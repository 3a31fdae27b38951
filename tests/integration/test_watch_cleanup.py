"""A watch whose start is given up leaves nothing on a connection the user owns.

nats-py's KV watch subscribes (and the server makes its consumer) before it
asks for that consumer's info. A start cancelled in that await (``close()``
ending a restart after a reconnect, or an election stopped while it starts)
left the subscription on the connection, fed by the server for as long as the
connection lives: for good, when the user owns it (``JetStreamBackend(nc)``).
The start is held in that await here by an event.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from nats.aio.client import Client
from nats.js.client import JetStreamContext

from celery_nats_leader.core.backend import KVEntry
from celery_nats_leader.nats.jetstream import JetStreamBackend, JetStreamBucket
from celery_nats_leader.testing import NatsServer
from tests.integration.helpers import BUCKET, ROLE, TTL

pytestmark = pytest.mark.integration


class Hold:
    """Holds the next watch start right after its subscription is made."""

    def __init__(self) -> None:
        self.armed = False
        self.entered = asyncio.Event()
        self.release = asyncio.Event()


@pytest.fixture
def hold(monkeypatch: pytest.MonkeyPatch) -> Iterator[Hold]:
    made = Hold()
    original = JetStreamContext.PushSubscription.consumer_info

    async def consumer_info(self: Any, *args: Any, **kwargs: Any) -> Any:
        # nats-py's KeyValue.watch() asks for the consumer's info once its
        # subscription exists: the window of the leak.
        if made.armed:
            made.armed = False
            made.entered.set()
            await made.release.wait()
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(JetStreamContext.PushSubscription, "consumer_info", consumer_info)
    yield made


async def subscriptions(server: NatsServer, nc: Client) -> list[str]:
    """The subjects ``nc`` is subscribed to, as the server sees them."""
    await nc.flush()  # every SUB/UNSUB sent so far has been processed
    connz = server.monitor(f"connz?cid={nc.client_id}&subs=1")
    [connection] = connz["connections"]
    return sorted(connection.get("subscriptions_list", []))


def ignore(entry: KVEntry) -> None:
    pass


async def open_bucket(backend: JetStreamBackend) -> JetStreamBucket:
    return await backend.open_bucket(BUCKET, ttl=TTL, create=False, replicas=1, timeout=2)


async def test_close_during_a_restart_of_the_watch_leaves_no_subscription(
    nats_server: NatsServer, bucket: str, nc: Client, hold: Hold
) -> None:
    backend = JetStreamBackend(nc)  # the user's connection, left open by close()
    kv = await open_bucket(backend)
    before = await subscriptions(nats_server, nc)
    watch = await kv.watch(ROLE, ignore)
    assert len(await subscriptions(nats_server, nc)) == len(before) + 1

    hold.armed = True
    backend.reconnected()  # as the docs ask of a user's connection
    await asyncio.wait_for(hold.entered.wait(), 5)  # the new watch is subscribed
    await watch.unsubscribe()  # the election stops (its watch is the last) ...
    # ... and close() cancels the restart before its first await; the start
    # then goes on (or not) as nats-py lets it.
    asyncio.get_running_loop().call_soon(hold.release.set)
    await backend.close()

    assert not nc.is_closed
    assert await subscriptions(nats_server, nc) == before


async def test_a_first_watch_cancelled_while_it_starts_leaves_no_subscription(
    nats_server: NatsServer, bucket: str, nc: Client, hold: Hold
) -> None:
    backend = JetStreamBackend(nc)
    kv = await open_bucket(backend)
    before = await subscriptions(nats_server, nc)

    hold.armed = True
    starting = asyncio.ensure_future(kv.watch(ROLE, ignore))
    await asyncio.wait_for(hold.entered.wait(), 5)
    starting.cancel()  # an election stopped while its watch starts
    asyncio.get_running_loop().call_soon(hold.release.set)
    await asyncio.wait([starting])
    await backend.close()

    assert starting.cancelled()
    assert await subscriptions(nats_server, nc) == before
