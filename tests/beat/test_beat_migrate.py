"""Migrating to the leader scheduler from each previous scheduler, as docs/migrating.md says.

For each previous scheduler, the real one runs first (``celery beat`` with
Celery's ``PersistentScheduler``, the same under single-beat on two hosts
with its Redis lock, celery-redbeat on Redis, django-celery-beat's
``DatabaseScheduler`` on PostgreSQL) and sends a 2-second interval entry to a
real worker; then the documented cut-over: stop it gracefully, seed our state
from its storage (``celery nats-leader seed-beat`` / ``manage.py
election_seed_beat``), start ``celery beat -S nats_leader`` (or
``django_nats_leader``). The ledger must show, across the cut-over, none lost
(the first tick is the old scheduler's last run + 2 s, then every slot), none
doubled (each tick once, the old last run not again) and no burst (only the
ticks that came due during the cut-over are caught up).

The new scheduler runs with a schedule file of its own (``-s``): as on a
host other than the old beat's, it sees none of the old file's ``last_run_at``.
The TTL is 5 s (catch-up window 15 s): a cut-over on a loaded machine takes
several seconds, and only ticks missed inside the window are caught up one by one.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from cnl_beat_harness import CELERY, HERE, BeatCluster, Database, wait_for
from cnl_beat_ledger import Run

from celery_nats_leader.beat.ticks import parse_slot
from celery_nats_leader.config.settings import LeaderSettings
from tests.support.brokers import REDIS_URL
from tests.support.services import require_service

pytestmark = [pytest.mark.integration, pytest.mark.celery, pytest.mark.timeout(240)]

PERIOD = 2
ENTRY = "every-two-seconds"
ENTRIES = [{"name": ENTRY, "kind": "interval", "seconds": PERIOD}]
TTL = 5.0
WINDOW = LeaderSettings(ttl=TTL).catch_up_window()
STEP = timedelta(seconds=PERIOD)


def old_runs(cluster: BeatCluster) -> list[Run]:
    """The runs the previous scheduler sent (no tick header)."""
    return [r for r in cluster.ledger.runs("cnl_beat.record") if r.tick is None]


def run_old_then_stop(cluster: BeatCluster, runs: int = 3, hosts: int = 1) -> float:
    """Run the previous scheduler until the worker ran ``runs`` ticks, then stop it (SIGTERM).

    Args:
        cluster: Where it runs.
        runs: Ticks to see first.
        hosts: Beat processes started (under a wrapper such as single-beat,
            which runs the scheduler on one of them).

    Returns:
        When it had stopped (wall clock).

    """
    cluster.start_worker()
    old = [cluster.start_beat() for _ in range(hosts)]
    deadline = time.monotonic() + 60
    while len(old_runs(cluster)) < runs:
        assert all(proc.alive for proc in old), [proc.log()[-3000:] for proc in old]
        assert time.monotonic() < deadline, cluster.diagnostics()
        # Nothing to await but the worker's ledger rows (another process's writes).
        time.sleep(0.1)
    for proc in old:
        proc.signal(signal.SIGTERM)
    for proc in old:
        assert proc.wait(30) == 0, proc.log()[-3000:]
    return time.time()


def seed(cluster: BeatCluster, argv: list[str]) -> dict[str, Any]:
    """Run a seed command the way an operator would; its JSON outcome for ENTRY."""
    result = subprocess.run(
        argv,
        env=cluster.env,
        cwd=str(HERE),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    body = json.loads(result.stdout.strip().splitlines()[-1])
    by_name = {e["entry"]: e for e in body["entries"]}
    return dict(by_name[ENTRY])


def start_ours_and_check(
    cluster: BeatCluster, scheduler: str, seeded: dict[str, Any], stopped: float
) -> None:
    """Start our scheduler, let it run, and check the ticks across the cut-over."""
    assert seeded["action"] == "seeded", seeded
    last = parse_slot(seeded["last_run_at"])
    before = old_runs(cluster)
    # The seed is the old scheduler's own count and last run.
    assert seeded["runs"] == len(before) >= 3, (seeded, len(before))
    assert abs(last.timestamp() - before[-1].wall) < 1.0, (last, before[-1].wall)

    # A cut-over of three periods (a deploy): ticks come due while no
    # scheduler runs, inside the catch-up window. The duration is the thing
    # under test: nothing to await but the clock.
    wait_for(lambda: time.time() >= stopped + 3 * PERIOD, 3 * PERIOD + 5, "the cut-over")
    cluster.scheduler = scheduler
    cluster.start_beat()
    leader = cluster.wait_leader()
    cluster.wait_runs_by(leader.epoch, 7)
    cluster.drain()
    assert old_runs(cluster) == before  # the old scheduler is gone

    new = sorted(cluster.runs(ENTRY), key=lambda r: parse_slot(r.tick or ""))
    slots = [parse_slot(r.tick or "") for r in new]
    # None lost: the first tick is the one the old scheduler would have sent
    # next, then every slot; none doubled: each once, the old last run not again.
    assert slots[0] == last + STEP, (slots[0], last)
    assert slots == [last + k * STEP for k in range(1, len(slots) + 1)]
    assert len({r.task_id for r in new}) == len(new)
    state = cluster.recorder.state_writes(ENTRY)[-1][1]
    assert (state.runs, state.skipped) == (seeded["runs"] + len(new), 0)
    # No burst: only the ticks that came due during the cut-over went out at
    # once (each late by the cut-over), the rest on time.
    first_run = new[0].wall
    caught_up = [s for s in slots if s.timestamp() < first_run - 0.3]
    due_in_cut_over = [
        s for s in (last + k * STEP for k in range(1, 100)) if s.timestamp() < first_run - 0.3
    ]
    assert 2 <= len(caught_up) == len(due_in_cut_over) <= WINDOW / PERIOD
    for run, slot in zip(new, slots, strict=True):
        if slot.timestamp() >= first_run:
            assert run.wall <= slot.timestamp() + 2.0, (slot, run.wall)
    print(
        f"{scheduler}: old scheduler {len(before)} runs, last {last.isoformat()}; cut-over "
        f"{first_run - stopped:.1f}s after its stop; {len(caught_up)} missed ticks caught up; "
        f"{len(new)} ticks by ours, first {slots[0].isoformat()}"
    )


def test_from_celerys_persistent_scheduler(
    cluster_factory: Callable[..., BeatCluster], tmp_path: Path
) -> None:
    cluster = cluster_factory(entries=ENTRIES, scheduler="celery.beat:PersistentScheduler", ttl=TTL)
    stopped = run_old_then_stop(cluster)
    seeded = seed(
        cluster,
        [CELERY, "-A", "cnl_beat_app", "nats-leader", "seed-beat", "--json",
         "--shelve", str(tmp_path / "schedule0")],
    )  # fmt: skip
    start_ours_and_check(cluster, "nats_leader", seeded, stopped)


def test_from_single_beat(cluster_factory: Callable[..., BeatCluster], tmp_path: Path) -> None:
    """single-beat on two hosts ran Celery's PersistentScheduler on one of them."""
    require_service("redis (single-beat)", REDIS_URL)
    import redis

    identifier = f"cnl-migrate-{uuid.uuid4().hex[:10]}"
    cluster = cluster_factory(entries=ENTRIES, scheduler="celery.beat:PersistentScheduler", ttl=TTL)
    cluster.beat_wrapper = [str(Path(sys.executable).parent / "single-beat")]
    cluster.wrapper_env = {
        "SINGLE_BEAT_REDIS_SERVER": REDIS_URL,
        "SINGLE_BEAT_IDENTIFIER": identifier,
        "SINGLE_BEAT_LOCK_TIME": "5",
        "SINGLE_BEAT_HEARTBEAT_INTERVAL": "1",
        "SINGLE_BEAT_LOG_LEVEL": "info",
    }
    client = redis.Redis.from_url(REDIS_URL)
    try:
        # single-beat on two hosts; the cut-over's first step stops it on
        # both (it stops its celery beat child with SIGTERM).
        stopped = run_old_then_stop(cluster, hosts=2)
        # Only the host whose single-beat held the lock ran celery beat and
        # wrote a schedule file: seed from that one.
        written = [i for i in (0, 1) if list(tmp_path.glob(f"schedule{i}*"))]
        assert len(written) == 1, sorted(p.name for p in tmp_path.iterdir())
        seeded = seed(
            cluster,
            [CELERY, "-A", "cnl_beat_app", "nats-leader", "seed-beat", "--json",
             "--shelve", str(tmp_path / f"schedule{written[0]}")],
        )  # fmt: skip
        # Then celery beat -S nats_leader directly, without single-beat.
        cluster.beat_wrapper, cluster.wrapper_env = [], {}
        start_ours_and_check(cluster, "nats_leader", seeded, stopped)
    finally:
        for key in client.scan_iter(f"*{identifier}*"):
            client.delete(key)
        client.close()


def test_from_celery_redbeat(cluster_factory: Callable[..., BeatCluster]) -> None:
    require_service("redis (celery-redbeat)", REDIS_URL)
    import redis

    prefix = f"cnl-migrate-{uuid.uuid4().hex[:10]}:redbeat"
    cluster = cluster_factory(entries=ENTRIES, scheduler="redbeat.RedBeatScheduler", ttl=TTL)
    cluster.config["celery"] = {
        "redbeat_redis_url": REDIS_URL,
        "redbeat_key_prefix": prefix,
        "redbeat_lock_timeout": 5,
    }
    client = redis.Redis.from_url(REDIS_URL)
    try:
        stopped = run_old_then_stop(cluster)
        argv = [CELERY, "-A", "cnl_beat_app", "nats-leader", "seed-beat", "--redbeat", "--json"]
        seeded = seed(cluster, argv)
        start_ours_and_check(cluster, "nats_leader", seeded, stopped)
    finally:
        for key in client.scan_iter(f"{prefix}*"):
            client.delete(key)
        client.close()


def test_from_django_celery_beats_database_scheduler(
    cluster_factory: Callable[..., BeatCluster], database: Database
) -> None:
    cluster = cluster_factory(
        entries=ENTRIES,
        scheduler="django_celery_beat.schedulers:DatabaseScheduler",
        database=database,
        ttl=TTL,
    )
    cluster.django_setup()
    stopped = run_old_then_stop(cluster)
    seeded = seed(cluster, [sys.executable, "-m", "django", "election_seed_beat", "--json"])
    start_ours_and_check(cluster, "django_nats_leader", seeded, stopped)


def test_seeding_twice_keeps_the_state(cluster_factory: Callable[..., BeatCluster]) -> None:
    # A second run (an operator repeating the step) leaves the seeded state alone.
    cluster = cluster_factory(entries=ENTRIES, scheduler="celery.beat:PersistentScheduler", ttl=TTL)
    run_old_then_stop(cluster, runs=1)
    argv = [CELERY, "-A", "cnl_beat_app", "nats-leader", "seed-beat", "--json",
            "--shelve", str(cluster.tmp / "schedule0")]  # fmt: skip
    first = seed(cluster, argv)
    again = seed(cluster, argv)
    assert (first["action"], again["action"]) == ("seeded", "kept")
    assert again["state"]["slot"] == first["state"]["slot"]
    assert datetime.fromisoformat(first["last_run_at"]) == parse_slot(first["state"]["slot"])
