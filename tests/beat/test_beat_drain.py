"""The soak drains its beat worker: a deferred tick runs before the worker stops.

A tick whose once-guard cannot claim its id (NATS unreachable under a fault)
is retried by Celery ``lease / 3`` seconds later and waits in the worker as a
scheduled task. The chaos soak stopped its worker a fixed 2 s after the beats,
before such a retry was due, and the checker reported the tick lost
(``every-second@29924150``: "cannot claim its id (no response from bucket
'..._once_leases'); retrying in 10s" 8 s before the worker's warm shutdown).
:func:`~tests.chaos.soak.drain_worker` returns only once the
worker has nothing queued, active, reserved or scheduled.
"""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from cnl_beat_app import make_app
from cnl_beat_harness import BeatCluster

from tests.chaos.soak import drain_worker

pytestmark = [pytest.mark.integration, pytest.mark.celery, pytest.mark.timeout(180)]

DEFER = 5.0  # seconds, like a once-guard retry's countdown (10 s by default)


@pytest.mark.parametrize("broker", ["redis"], indirect=True)
def test_drain_waits_for_a_deferred_tick(
    cluster_factory: Callable[..., BeatCluster], broker: Any
) -> None:
    cluster = cluster_factory(entries=[])
    cluster.config["remote_control"] = True
    app = make_app(cluster.config)
    cluster.start_worker(pool="threads", concurrency=4)
    task_id = str(uuid.uuid4())
    sent = time.monotonic()
    app.send_task("cnl_beat.once", task_id=task_id, queue=cluster.queue, countdown=DEFER)
    worker = f"w0-{cluster.queue}@{socket.gethostname()}"

    idle = drain_worker(
        cluster.broker.url, cluster.queue, worker, 90.0, cluster.broker.transport_options
    )

    waited = time.monotonic() - sent
    runs = [r.task_id for r in cluster.ledger.runs("cnl_beat.once")]
    assert idle, cluster.diagnostics()
    # The deferred task ran before the drain let the worker go, which a
    # fixed 2-s wait (the soak's before) does not give it.
    assert runs == [task_id], (waited, cluster.diagnostics())
    assert waited >= DEFER, waited
