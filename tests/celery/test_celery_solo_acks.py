"""A solo leader on RabbitMQ starts its tasks back to back, not in pairs every 10 s.

A solo worker runs a task inside kombu's event loop. When kombu's reader
drained the message from a deferred read (a callback in the loop's ready
set), the task's ack was queued in the ready set after the loop took it, and
the loop polled before running it: until the next timer, up to 10 s with
these workers (no heartbeat, gossip or mingle). With one message
prefetched, RabbitMQ holds the next task until that ack.

Whether the deferred read finds the next message is a race with the broker
(a few tasks in a hundred stalled here, more under load); the worker's acks
wait for the next delivery, which makes it find it whenever the loop runs
the ack before the read (about every other task).
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest
from cnl_celery_harness import Cluster, wait_for

from tests.support.brokers import Broker

pytestmark = [pytest.mark.celery, pytest.mark.integration]

TASKS = 20
#: Seconds between two task starts that count as a stall: each task takes
#: milliseconds; this leaves room for a loaded machine and is far below the
#: 10-s poll the acks waited for.
STALL = 3.0


@pytest.mark.parametrize("broker", ["amqp"], indirect=True)
def test_a_solo_leader_starts_each_task_soon_after_the_last(
    cluster_factory: Any, broker: Broker
) -> None:
    cluster: Cluster = cluster_factory(acks_wait_for_the_next_delivery=True)  # prefetch 1
    worker = cluster.start_worker("w1", pool="solo", concurrency=1)
    assert cluster.wait_leader() is worker

    for seq in range(TASKS):
        cluster.send("cnl.record", seq, work=0.0)

    def starts() -> list[float]:
        return [t for (t,) in cluster.ledger.rows("SELECT t FROM attempts ORDER BY t")]

    def done() -> bool:
        started = starts()
        if len(started) == TASKS:
            return cluster.ledger.committed() == TASKS
        # A stall fails the test as it happens, not after the batch.
        assert not started or time.monotonic() - started[-1] < STALL, (
            f"no task started for {STALL} s after {len(started)} of {TASKS}"
        )
        return False

    wait_for(done, 60, f"{TASKS} tasks committed", cluster.diagnostics)
    gaps = [later - earlier for earlier, later in itertools.pairwise(starts())]
    assert max(gaps) < STALL, [round(gap, 2) for gap in gaps]
