"""Ticks of a plain task run once by default on workers with the bootstep.

Three real ``celery beat`` replicas, a real worker running the bootstep
(``install(app)``), a real nats-server. The entry's task is a plain
``@app.task`` (no ``OnceTask``). The active scheduler is SIGKILLed right
after the publish of a tick, before it records the send, twice: its successor
finds the tick pending and sends it again under the same task id (the
outbox). The worker runs each tick once and acknowledges the copy.

Opted out (the entry's ``nats_leader_once = False`` option, or
``nats_leader_beat_once = False``), the same kills run each re-sent tick
twice, as before. The same with django-celery-beat's database scheduler, whose
rows opt out in their headers.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cnl_beat_checks import check_exactly_once
from cnl_beat_harness import BeatCluster, Database
from test_beat_outbox import kill_at_every_point

pytestmark = [pytest.mark.integration, pytest.mark.celery, pytest.mark.timeout(300)]

KILLS = 2


def _cluster(
    cluster_factory: Callable[..., BeatCluster],
    tmp_path: Path,
    *,
    options: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    database: Database | None = None,
    headers: dict[str, Any] | None = None,
) -> BeatCluster:
    entry: dict[str, Any] = {"name": "plain-every-second", "kind": "interval", "seconds": 1}
    entry["task"] = "cnl_beat.plain"
    if options:
        entry["options"] = options
    if headers:
        entry["headers"] = headers  # a database row's headers field
    django = {"scheduler": "django_nats_leader", "database": database} if database else {}
    cluster = cluster_factory(entries=[entry], extra={"once_lease": 2.0, **(extra or {})}, **django)
    cluster.config["bootstep"] = True
    (tmp_path / "kill-points").mkdir()
    cluster.config["kill_points"] = str(tmp_path / "kill-points")
    if database is not None:
        cluster.django_setup()
    cluster.start_worker()
    for _ in range(3):
        cluster.start_beat()
    return cluster


def _resends(cluster: BeatCluster) -> int:
    return sum(p.log().count("sending it again under the same task id") for p in cluster.beats)


@pytest.mark.parametrize("broker", ["filesystem", "redis"], indirect=True)
def test_a_plain_task_tick_sent_twice_runs_once(
    cluster_factory: Callable[..., BeatCluster], broker: Any, tmp_path: Path
) -> None:
    cluster = _cluster(cluster_factory, tmp_path)
    killed = kill_at_every_point(cluster, rounds=KILLS, points=("after_publish",))
    end_wall = time.time()
    cluster.drain()
    assert killed == {"after_publish": KILLS}
    # Each kill left a sent-but-unrecorded tick that the successor sent again...
    assert _resends(cluster) >= KILLS
    # ... and the worker ran every tick once (none lost, none twice, under
    # its per-tick id), acknowledging the copies.
    check_exactly_once(cluster, end_wall=end_wall)
    acknowledged = sum(w.log().count("already ran (on ") for w in cluster.workers)
    assert acknowledged >= KILLS


@pytest.mark.parametrize(
    ("options", "extra"),
    [({"nats_leader_once": False}, {}), ({}, {"beat_once": False})],
    ids=["entry-option", "setting"],
)
def test_opted_out_a_tick_sent_twice_runs_twice(
    cluster_factory: Callable[..., BeatCluster],
    broker: Any,
    tmp_path: Path,
    options: dict[str, Any],
    extra: dict[str, Any],
) -> None:
    cluster = _cluster(cluster_factory, tmp_path, options=options, extra=extra)
    kill_at_every_point(cluster, rounds=KILLS, points=("after_publish",))
    cluster.drain()
    executions = Counter((r.entry, r.tick) for r in cluster.runs())
    twice = sorted(tick for tick, n in executions.items() if n > 1)
    # Exactly the re-sent ticks ran twice: one per kill after the publish.
    assert len(twice) == KILLS, executions
    assert all(n <= 2 for n in executions.values()), executions
    assert not any("already ran (on " in w.log() for w in cluster.workers)


@pytest.mark.parametrize(("headers", "twice"), [({}, 0), ({"nats_leader_once": False}, KILLS)])
def test_database_scheduler_ticks_run_once_unless_the_row_opts_out(
    cluster_factory: Callable[..., BeatCluster],
    database: Database,
    broker: Any,
    tmp_path: Path,
    headers: dict[str, Any],
    twice: int,
) -> None:
    cluster = _cluster(cluster_factory, tmp_path, database=database, headers=headers)
    kill_at_every_point(cluster, rounds=KILLS, points=("after_publish",))
    cluster.drain()
    executions = Counter((r.entry, r.tick) for r in cluster.runs())
    assert sum(1 for n in executions.values() if n > 1) == twice, executions
    assert all(n <= 2 for n in executions.values()), executions
    acknowledged = sum(w.log().count("already ran (on ") for w in cluster.workers)
    assert (acknowledged >= KILLS) if twice == 0 else (acknowledged == 0)
