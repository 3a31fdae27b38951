"""The embedded beat of ``celery worker -B``, on three worker replicas.

Every worker runs its own beat process (Celery forks it); only the leader's
dispatches. The active embedded beat is killed (SIGKILL), then the worker
hosting the next one is shut down warmly (SIGTERM), which stops its beat
gracefully: the role is handed over in milliseconds. A plain worker executes
the ticks (the ``-B`` workers consume a queue of their own), so stopping the
``-B`` workers loses no message.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
from cnl_beat_checks import check_exactly_once, check_gaps, check_terms
from cnl_beat_harness import FAILOVER, SLACK, BeatCluster

pytestmark = [pytest.mark.integration, pytest.mark.celery, pytest.mark.timeout(240)]

ENTRIES = [
    {"name": "every-second", "kind": "interval", "seconds": 1},
    {"name": "fast-cron", "kind": "fastcron"},
]


def test_embedded_beat_fails_over_and_hands_over(
    cluster_factory: Callable[..., BeatCluster], broker: Any
) -> None:
    cluster = cluster_factory(entries=ENTRIES)
    cluster.start_worker()
    for _ in range(3):
        cluster.start_embedded()
    first = cluster.wait_leader(timeout=60)
    cluster.wait_runs_by(first.epoch, 3)

    # Kill the active embedded beat process; its worker keeps running.
    beat_pid = int(first.meta["pid"])
    host = cluster.beat_by_pid(beat_pid)
    assert host is not None and host.pid != beat_pid, "the beat runs in a child of the worker"
    os.kill(beat_pid, signal.SIGKILL)
    second = cluster.wait_new_term(first.epoch)
    cluster.wait_runs_by(second.epoch, 3)

    # Warm shutdown of the worker hosting the active beat: it hands over.
    worker = cluster.leading(second)
    worker.signal(signal.SIGTERM)
    assert worker.wait(60) == 0
    released_at = time.monotonic()
    third = cluster.wait_new_term(second.epoch)
    cluster.wait_runs_by(third.epoch, 3)
    end_wall = time.time()
    cluster.drain()

    verdicts = check_exactly_once(cluster, end_wall=end_wall)  # none lost: the outbox
    check_gaps(cluster, verdicts, FAILOVER)
    check_terms(cluster)
    handover = min(r.mono for r in cluster.runs("every-second") if r.epoch == third.epoch)
    assert handover - released_at <= 1.0 + SLACK, f"{handover - released_at:.2f}s"
