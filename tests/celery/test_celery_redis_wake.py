"""A promoted worker reads its leader queue at once on Redis, whatever its polling interval.

kombu's Redis transport blocks in one ``BRPOP`` on the queues it consumed
when the read began, for up to ``polling_interval`` seconds. Here that
interval is 30 s: without the wake-up (``CLIENT UNBLOCK`` of the pending
read, see ``celery_nats_leader.worker.broker_wake``) a promoted worker would start
reading its leader queue only up to 30 s later. The timing goal itself
(milliseconds) is measured in benchmarks/celery_overhead.py.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from cnl_celery_harness import Broker, Cluster, wait_for

pytestmark = [pytest.mark.celery, pytest.mark.integration]

POLL = 30.0


@pytest.mark.parametrize("broker", ["redis"], indirect=True)
def test_promoted_worker_reads_its_leader_queue_without_waiting_for_its_poll(
    cluster_factory: Any, broker: Broker
) -> None:
    options = {**broker.transport_options, "polling_interval": POLL}
    cluster: Cluster = cluster_factory(ttl=2.0, broker_transport_options=options)
    first = cluster.start_worker("w1", pool="solo", concurrency=1)
    assert cluster.wait_leader() is first
    for seq in range(3):
        cluster.send("cnl.record", seq)
    wait_for(lambda: cluster.ledger.committed() == 3, 30, "the first leader's tasks")
    second = cluster.start_worker("w2", pool="solo", concurrency=1)
    # w2 has just begun a BRPOP on its ordinary queue, for POLL seconds.

    # The leader leaves (its key is released); w2 is promoted and must read
    # the leader queue now, not when its pending read times out (~POLL s).
    first.terminate()
    cluster.wait_leader(exclude=(first,))
    promoted_at = time.monotonic()
    for seq in range(3, 6):
        cluster.send("cnl.record", seq)
    wait_for(
        lambda: cluster.ledger.committed() == 6,
        POLL / 3,
        "the new leader's first tasks",
        cluster.diagnostics,
    )
    waited = time.monotonic() - promoted_at
    rows = cluster.ledger.rows("SELECT DISTINCT main_pid FROM commits WHERE seq >= 3")
    assert rows == [(second.pid,)]
    print(f"\npromotion -> 3 leader-only tasks committed on Redis: {waited * 1000:.0f} ms")
