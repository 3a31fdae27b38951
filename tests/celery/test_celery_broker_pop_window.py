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

Each step waits for the broker-side event it needs, never for a time: the
paused leader can only take the message while it has room for one
(``worker_prefetch_multiplier=1`` with one thread: at most one message
delivered and not acknowledged). Leader-only tasks are ``acks_late``: a task
is acknowledged only after its body (and the ledger's commit) returned, so a
leader paused right after a task's commit may still hold that task's
acknowledgement, and RabbitMQ would then keep the next message in the queue
for as long as the pause lasts.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import pytest
import redis
from cnl_celery_harness import Broker, Cluster, wait_for

pytestmark = [pytest.mark.celery, pytest.mark.integration]


def local_ports(pid: int) -> set[int]:
    """Local TCP ports of the sockets process ``pid`` holds open (Linux ``/proc``)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}") as rows:
            next(rows)  # the header
            for row in rows:
                fields = row.split()
                if fields[9] in inodes:
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def blocked_reads(broker: Broker, pid: int) -> int:
    """Connections of process ``pid`` blocked in a ``BRPOP`` now.

    The process's connections are told from any other client's (other tests
    share the server) by their ports: Redis's ``addr`` is the client's
    address. (kombu's ``client_name`` transport option would name them, but
    kombu 5.4, Celery 5.4's, has no such option.)
    """
    ports = local_ports(pid)
    client = redis.Redis.from_url(broker.url)
    try:
        return sum(
            1
            for entry in client.client_list(_type="normal")
            if int(str(entry.get("addr", ":0")).rsplit(":", 1)[1]) in ports
            and entry.get("cmd") == "brpop"
            and "b" in entry.get("flags", "")
        )
    finally:
        client.close()


def consumers(broker: Broker, queue: str) -> int:
    """RabbitMQ: consumers of ``queue`` the broker delivers to (0 while it does not exist)."""
    from kombu import Connection

    with Connection(broker.url) as conn:
        try:
            return int(conn.default_channel.queue_declare(queue, passive=True).consumer_count)
        except Exception:
            return 0


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
    if broker.kind == "redis":
        # A read that stays pending through the pause (10 s instead of 1 s).
        options = {**broker.transport_options, "polling_interval": 10}
    else:
        # The send returns once RabbitMQ has the message.
        options = {**broker.transport_options, "confirm_publish": True}
    cluster: Cluster = cluster_factory(ttl=2.0, broker_transport_options=options)
    ledger = cluster.ledger
    queue = cluster.leader_queue()
    first = cluster.start_worker("w1", pool="threads", concurrency=1)
    assert cluster.wait_leader() is first
    if broker.kind == "redis":
        # A first task shows that the leader reads the leader queue.
        cluster.send("cnl.record", 0)
        wait_for(
            lambda: ledger.committed() == 1, 30, "the leader's first task", cluster.diagnostics
        )
        # Paused while its BRPOP (on its queues, the leader queue among them)
        # is pending: kombu's Redis transport issues one only while it has
        # room for a message (the first task acknowledged). Each read ends
        # after polling_interval and the next starts at once; a pause in
        # between leaves no read pending, so look again after the pause.
        while True:
            wait_for(lambda: blocked_reads(broker, first.pid) == 1, 30, "the leader's next read")
            first.pause()
            if blocked_reads(broker, first.pid) == 1:
                break
            first.resume()
    else:
        # RabbitMQ pushes a message to a consumer with room for it (basic.qos
        # prefetch 1), paused or not. The leader's consumer of the leader
        # queue is registered with the broker, and no task was sent yet, so
        # none is waiting for its acknowledgement (no first task here: its
        # late acknowledgement is not visible from outside the worker).
        wait_for(lambda: consumers(broker, queue) == 1, 30, "the leader's consumer")
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
    wait_for(lambda: ledger.committed() == 1, 60, "the message on the next leader")
    assert [
        seq for (seq,) in ledger.rows("SELECT seq FROM commits WHERE main_pid = ?", second.pid)
    ] == [1]
