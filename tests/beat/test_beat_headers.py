"""The fencing token never leaves the scheduler: what a beat message carries.

Real ``celery beat`` replicas and a real broker, no worker: the messages the
active scheduler sends are read raw from the queue. None contains the term's
token (a secret: headers end up in logs, broker tools and monitoring); each
carries the term's epoch, the dispatcher's id and the tick's identity, which
is all the worker-side checks need. After a failover the successor's messages
carry its own epoch. The schedulers' logs do not show the token either.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from typing import Any

import pytest
from cnl_beat_app import make_app
from cnl_beat_harness import BeatCluster, wait_for

from celery_nats_leader.beat import (
    DISPATCHER_HEADER,
    ENTRY_HEADER,
    EPOCH_HEADER,
    ONCE_HEADER,
    TICK_HEADER,
    TOKEN_HEADER,
)

pytestmark = [pytest.mark.integration, pytest.mark.celery, pytest.mark.timeout(180)]

ENTRIES = [{"name": "every-second", "kind": "interval", "seconds": 1, "task": "cnl_beat.plain"}]


def _drain_queue(cluster: BeatCluster, want: int) -> list[tuple[str, dict[str, Any]]]:
    """Take at least ``want`` messages off the queue: (everything raw, headers)."""
    client = make_app(cluster.config)
    found: list[tuple[str, dict[str, Any]]] = []
    try:
        with client.connection_for_read() as conn:
            queue = conn.SimpleQueue(cluster.queue)

            def take() -> bool:
                try:
                    message = queue.get(block=True, timeout=0.5)
                except queue.Empty:
                    return len(found) >= want
                raw = message.body if isinstance(message.body, str) else repr(message.body)
                everything = " ".join(
                    [raw, json.dumps(message.headers, default=str), repr(message.properties)]
                )
                found.append((everything, dict(message.headers)))
                message.ack()
                return False

            wait_for(take, 30, f"{want} beat messages in the queue", cluster.diagnostics)
            queue.close()
    finally:
        client.close()
    return found


def test_no_message_carries_the_token(
    cluster_factory: Callable[..., BeatCluster], broker: Any
) -> None:
    cluster = cluster_factory(entries=ENTRIES)
    for _ in range(2):
        cluster.start_beat()
    first = cluster.wait_leader()
    killed = cluster.leading(first)
    wait_for(lambda: killed.log().count("Sending due task") >= 2, 30, "two dispatches")
    killed.signal(signal.SIGKILL)
    killed.wait(10)
    second = cluster.wait_new_term(first.epoch)
    assert second.token != first.token
    wait_for(
        lambda: sum(p.log().count(f"epoch {second.epoch} id") for p in cluster.beats) >= 2,
        30,
        "two dispatches of the new term",
        cluster.diagnostics,
    )
    messages = _drain_queue(cluster, 4)
    epochs = {headers.get(EPOCH_HEADER) for _, headers in messages}
    assert {first.epoch, second.epoch} <= epochs, epochs
    for everything, headers in messages:
        assert first.token not in everything and second.token not in everything
        assert TOKEN_HEADER not in headers
        assert headers[ENTRY_HEADER] == "every-second" and headers[TICK_HEADER]
        assert headers[DISPATCHER_HEADER] and headers[ONCE_HEADER] is True
    for proc in cluster.beats:
        log = proc.log()
        assert first.token not in log and second.token not in log, proc
