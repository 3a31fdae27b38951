"""The same scenario with django-celery-beat's database scheduler (``-S django_nats_leader``).

PostgreSQL (a schema of the test's own in database ``test``) where reachable,
as users run it; SQLite otherwise (CI must have PostgreSQL). Entries are
database rows: a 1-second interval and a real ``* * * * *`` crontab. The
active scheduler is killed just before a wall-clock minute boundary, so the
crontab's tick at that boundary must come from its successor, exactly once;
then the new one is paused past the TTL, and finally stopped gracefully.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import pytest
from cnl_beat_checks import check_exactly_once, check_gaps, check_terms
from cnl_beat_harness import FAILOVER, TTL, BeatCluster, Database, wait_for

from celery_nats_leader.beat.ticks import parse_slot

pytestmark = [pytest.mark.integration, pytest.mark.celery, pytest.mark.timeout(300)]

ENTRIES = [
    {"name": "db-every-second", "kind": "interval", "seconds": 1},
    {"name": "db-wall-cron", "kind": "cron"},
]


def test_database_scheduler_every_tick_exactly_once(
    cluster_factory: Callable[..., BeatCluster], database: Database, broker: Any
) -> None:
    cluster = cluster_factory(entries=ENTRIES, scheduler="django_nats_leader", database=database)
    cluster.django_setup()
    cluster.start_worker()
    for _ in range(3):
        cluster.start_beat()
    first = cluster.wait_leader()
    cluster.wait_runs_by(first.epoch, 3)

    # Kill the active scheduler 1.2-2 s before a minute boundary: the
    # crontab's tick at that boundary is its successor's to dispatch.
    wait_for(lambda: 58.0 <= time.time() % 60 <= 58.8, 65, "1.2-2 s before a minute boundary")
    boundary = datetime.fromtimestamp((time.time() // 60 + 1) * 60, tz=timezone.utc)
    killed = cluster.kill_leader(first)
    second = cluster.wait_leader(exclude=(killed,))
    cluster.wait_runs_by(second.epoch, 3)

    def cron_ran() -> list[Any]:
        return [
            r for r in cluster.runs("db-wall-cron") if r.tick and parse_slot(r.tick) == boundary
        ]

    runs = wait_for(cron_ran, FAILOVER + 5, f"the crontab tick at {boundary}", cluster.diagnostics)
    assert [r.epoch for r in runs] == [second.epoch], runs

    # Pause the new one past the TTL, then continue it.
    paused = cluster.leading(second)
    paused.signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    third = cluster.wait_leader(exclude=(killed, paused))
    cluster.wait_runs_by(third.epoch, 3)
    wait_for(lambda: time.monotonic() >= stopped_at + 2 * TTL, 10, "a pause of 2 TTL")
    paused.signal(signal.SIGCONT)
    continued_at = time.monotonic()
    cluster.wait_runs_by(third.epoch, 5)

    # Graceful stop of the active one.
    active = cluster.leading(third)
    active.signal(signal.SIGTERM)
    assert active.wait(30) == 0
    fourth = cluster.wait_leader(exclude=(killed, active))
    cluster.wait_runs_by(fourth.epoch, 3)
    end_wall = time.time()
    cluster.drain()

    verdicts = check_exactly_once(cluster, end_wall=end_wall)  # none lost: the outbox
    check_gaps(cluster, verdicts, FAILOVER)
    check_terms(cluster)
    assert boundary in verdicts["db-wall-cron"].executed
    late = [
        o.key
        for o, s in cluster.recorder.all_state_writes()
        if s.epoch == second.epoch and o.mono > continued_at
    ]
    assert not late, f"the paused ex-leader wrote schedule state after waking up: {late}"
