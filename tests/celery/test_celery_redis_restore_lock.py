"""A leader killed while it holds kombu's lock on the redelivery of unacknowledged messages.

kombu's Redis transport redelivers a dead worker's unacknowledged messages
from a periodic look at them (``QoS.restore_visible``), which holds a lock in
Redis (``unacked_mutex``) for its few milliseconds so that workers do not look
at once. A worker SIGKILLed inside that look never releases it: until the lock
expires (``unacked_mutex_expire``, 300 s by default) no worker redelivers
anything, and the crashed leader's task waits that long. The failover tests
SIGKILL a leader that looks every second (``unacked_restore_interval=1``), so
now and then one dies holding the lock; the tests' broker options bound the
lock to 2 s (docs/workers.md, "Broker notes").

The kill inside the look is made deterministic: the lock is taken for the
leader (as kombu takes it: a key with the option's expiry) just before the
SIGKILL.
"""

from __future__ import annotations

from typing import Any

import kombu.transport.redis
import pytest
import redis
from cnl_celery_harness import Broker, Cluster, wait_for

pytestmark = [pytest.mark.celery, pytest.mark.integration]

#: kombu's default ``unacked_mutex_expire``.
KOMBU_DEFAULT_EXPIRE = 300


@pytest.mark.parametrize("broker", ["redis"], indirect=True)
def test_a_leader_killed_holding_the_restore_lock(cluster_factory: Any, broker: Broker) -> None:
    cluster: Cluster = cluster_factory(ttl=2.0)
    ledger = cluster.ledger
    first = cluster.start_worker("w1", pool="threads", concurrency=1)
    assert cluster.wait_leader() is first
    second = cluster.start_worker("w2", pool="threads", concurrency=1)

    # The leader is running the task: delivered, not acknowledged.
    cluster.send("cnl.record", 0, work=5.0)
    wait_for(
        lambda: ledger.count("SELECT COUNT(*) FROM attempts WHERE main_pid = ?", first.pid),
        30,
        "the task to start on the leader",
        cluster.diagnostics,
    )
    expire = broker.transport_options.get("unacked_mutex_expire", KOMBU_DEFAULT_EXPIRE)
    client = redis.Redis.from_url(broker.url)
    try:
        # The leader dies inside its look: the lock stays for its expiry. (Set
        # over a look in progress, whose release then finds another owner.)
        assert client.set(broker.prefix + "unacked_mutex", "killed", ex=expire)
    finally:
        client.close()
    first.kill()
    assert cluster.wait_leader(exclude=(first,)) is second

    # Redelivered at the first look after the visibility timeout (6 s) and
    # the lock (2 s), and run (5 s): well before kombu's default lock expiry
    # (300 s), which a successor would otherwise wait out. kombu 5.7 looks
    # as often as the options say (every second here); before 5.7 there is
    # no such option, and it looks every 100 s.
    options = broker.transport_options
    if hasattr(kombu.transport.redis.Channel, "unacked_restore_interval"):
        look = options["unacked_restore_interval"] * options["unacked_restore_throttle"]
    else:
        look = 100
    patience = options["visibility_timeout"] + look + 5 + 20
    assert patience < KOMBU_DEFAULT_EXPIRE
    wait_for(
        lambda: ledger.count("SELECT COUNT(*) FROM commits WHERE main_pid = ?", second.pid),
        patience,
        "the crashed leader's task to run on its successor",
        cluster.diagnostics,
    )
