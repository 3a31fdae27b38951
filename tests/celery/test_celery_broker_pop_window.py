"""A leader killed after its broker handed it a message it had not yet recorded.

kombu's Redis transport takes a message off the queue (``BRPOP``) before it
records it as unacknowledged; a worker killed in between loses that message
(docs/workers.md, "Broker notes"). A paused worker widens that window to
what is left of its pending read (up to ``polling_interval``, the read's
server-side timeout): the read still takes a message that arrives meanwhile,
and the message waits in the stopped process's socket. The soak's checker
counts such a loss apart, at most one per killed leader
(``tests.chaos.checker``); this test shows the window on the
real brokers: on Redis the message is then nowhere, on RabbitMQ the broker
gives it to the next leader, which runs it.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis
from cnl_celery_harness import Broker, Cluster, wait_for

pytestmark = [pytest.mark.celery, pytest.mark.integration]


def blocked_reads(broker: Broker, client_name: str) -> int:
    """Clients named ``client_name`` blocked in a ``BRPOP`` now."""
    client = redis.Redis.from_url(broker.url)
    try:
        return sum(
            1
            for entry in client.client_list(_type="normal")
            if entry.get("name") == client_name
            and entry.get("cmd") == "brpop"
            and "b" in entry.get("flags", "")
        )
    finally:
        client.close()


def unacknowledged(broker: Broker) -> int:
    """Messages kombu's Redis transport has recorded as delivered and not acknowledged."""
    client = redis.Redis.from_url(broker.url)
    try:
        return int(client.hlen(broker.prefix + "unacked"))
    finally:
        client.close()


@pytest.mark.parametrize("broker", ["redis", "amqp"], indirect=True)
def test_a_leader_killed_holding_a_message_it_had_not_recorded(
    cluster_factory: Any, broker: Broker
) -> None:
    client_name = f"cnl-pop-window-{uuid.uuid4().hex[:8]}"
    if broker.kind == "redis":
        # A read that stays pending through the pause (10 s instead of 1 s),
        # on connections this test can tell from any other client's.
        options = {**broker.transport_options, "polling_interval": 10, "client_name": client_name}
    else:
        # The send returns once RabbitMQ has the message.
        options = {**broker.transport_options, "confirm_publish": True}
    cluster: Cluster = cluster_factory(ttl=2.0, broker_transport_options=options)
    ledger = cluster.ledger
    queue = cluster.leader_queue()
    first = cluster.start_worker("w1", pool="threads", concurrency=1)
    assert cluster.wait_leader() is first
    cluster.send("cnl.record", 0)
    wait_for(lambda: ledger.committed() == 1, 30, "the leader's first task", cluster.diagnostics)
    if broker.kind == "redis":
        # Paused while its BRPOP (on its queues, the leader queue among them)
        # is pending. Each read ends after polling_interval and the next
        # starts at once; a pause in between leaves no read pending, so look
        # again after the pause.
        while True:
            wait_for(lambda: blocked_reads(broker, client_name) == 1, 30, "the leader's next read")
            first.pause()
            if blocked_reads(broker, client_name) == 1:
                break
            first.resume()
    else:
        first.pause()
    cluster.send("cnl.record", 1)
    # The paused leader's pending read (Redis) or its prefetch (RabbitMQ)
    # takes the message off the queue (the send returned once the broker had
    # it: Redis's LPUSH is a reply, RabbitMQ confirms).
    wait_for(lambda: broker.ready_messages(queue) == 0, 30, "the message to leave the queue")
    first.kill()
    first.wait()

    if broker.kind == "redis":
        # Neither waiting in the queue nor recorded as unacknowledged: no
        # sweep of kombu's will ever bring it back.
        assert broker.ready_messages(queue) == 0
        assert unacknowledged(broker) == 0
        assert ledger.committed() == 1
        return
    # RabbitMQ returns the dead consumer's unacknowledged message to the
    # queue; the next leader runs it.
    second = cluster.start_worker("w2", pool="threads", concurrency=1)
    assert cluster.wait_leader(exclude=(first,)) is second
    wait_for(lambda: ledger.committed() == 2, 60, "the message on the next leader")
    assert [
        seq for (seq,) in ledger.rows("SELECT seq FROM commits WHERE main_pid = ?", second.pid)
    ] == [1]
