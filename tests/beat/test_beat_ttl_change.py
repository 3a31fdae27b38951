"""Changing the TTL while beat runs, as docs/operating.md says: one leader, every tick once.

Three real ``celery beat`` replicas on the bucket ``leaders`` (TTL 1.5 s)
send a 1-second entry to a real worker. The operator writes the new settings
(bucket ``leaders_4s``, TTL 4 s) and runs ``nats-leader bucket --migrate-from
leaders``; then the replicas roll over as a Deployment's rolling update does:
a new replica starts, an old one stops, one at a time, the leader last, and
killed (SIGKILL: its term must run out, not be handed over).

What a user sees: the migration refuses settings that would leave beat's state
behind and says what to set; through the roll, no tick is lost or run twice;
no replica on the new bucket starts a term before the old leader is gone;
the new terms' epochs continue above the old ones.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import pytest
from cnl_beat_checks import check_exactly_once
from cnl_beat_harness import (
    LEADERS_BUCKET,
    STATE_BUCKET,
    BeatCluster,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.celery, pytest.mark.timeout(240)]

NEW_BUCKET = "leaders_4s"
NEW_TTL = 4.0

#: Celery's log line prefix: "[2026-11-28 21:47:24,975: INFO/MainProcess] ".
STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}): ")


def _promotions(log: str) -> list[tuple[float, int]]:
    """(wall time, epoch) of each "promoted, epoch N" line of a replica's log."""
    found = []
    for line in log.splitlines():
        epoch = re.search(r"beat: promoted, epoch (\d+)", line)
        stamp = STAMP.match(line)
        if epoch and stamp:
            when = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            found.append((when, int(epoch.group(1))))
    return found


@pytest.mark.parametrize("broker", ["redis"], indirect=True)
def test_a_ttl_change_rolled_over_the_beat_replicas_runs_every_tick_once(
    cluster_factory: Callable[..., BeatCluster], broker: Any
) -> None:
    cluster = cluster_factory(entries=[{"kind": "interval", "name": "every-second", "seconds": 1}])
    cluster.config["celery"] = {"beat_scheduler": "nats_leader"}
    cluster.start_worker()
    old = [cluster.start_beat() for _ in range(3)]
    first = cluster.wait_leader()
    cluster.wait_runs_by(first.epoch, 2)

    # The new settings as first written: refused, saying what to keep.
    cluster.config.update(bucket=NEW_BUCKET, ttl=NEW_TTL)
    refused = cluster.operator("bucket", "--migrate-from", LEADERS_BUCKET)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    # (The worker made the once-guard's buckets at its start: both are named.)
    assert (
        f"set nats_leader_beat_state_bucket = {STATE_BUCKET!r}; "
        f"nats_leader_once_bucket = '{LEADERS_BUCKET}_once'"
    ) in refused.stderr
    assert "ticks around the cut-over would be skipped or run twice" in refused.stderr
    # Refused before anything changed: the old replicas are not told to move.
    assert cluster.operator("bucket", "--bucket", NEW_BUCKET).returncode == 1  # missing

    cluster.config["extra"].update(
        beat_state_bucket=STATE_BUCKET, once_bucket=f"{LEADERS_BUCKET}_once"
    )
    migrated = cluster.operator("bucket", "--migrate-from", LEADERS_BUCKET)
    assert migrated.returncode == 0, migrated.stdout + migrated.stderr
    [floor_line] = [x for x in migrated.stdout.splitlines() if x.startswith("  next epoch")]
    floor = int(floor_line.split()[2])

    # The roll: a new replica up, an old one down; the leader last, killed.
    leader = cluster.leading(first)
    order = [p for p in old if p is not leader] + [leader]
    new = []
    for proc in order:
        new.append(cluster.start_beat())
        if proc is leader:
            # Every new replica waits for the old term (none leads yet).
            for replica in new:
                wait_for(
                    lambda r=replica: "on the old bucket 'leaders' to end" in r.log(),
                    30,
                    "a new replica waiting for the old term",
                    cluster.diagnostics,
                )
            killed_at = time.time()
            proc.kill()
        else:
            proc.stop()
    wait_for(
        lambda: any(_promotions(r.log()) for r in new),
        NEW_TTL + 10,
        "a new replica to lead",
        cluster.diagnostics,
    )
    promotions = sorted(p for r in new for p in _promotions(r.log()))
    when, epoch = promotions[0]
    # Not before the old leader was gone (Celery's log stamps have ms; the
    # kill's time is read before the signal), and above every old epoch.
    assert when >= killed_at - 0.001, (when, killed_at)
    assert epoch >= floor > first.epoch
    assert len(promotions) == 1, promotions
    cluster.wait_runs_by(epoch, 3, timeout=NEW_TTL + 20)
    end_wall = time.time()
    cluster.drain()
    verdicts = check_exactly_once(cluster, end_wall=end_wall)
    assert verdicts["every-second"].lost == []
    # The old leader died holding its term: the old followers did not start
    # one on the moved bucket.
    for proc in order[:-1]:
        assert "was moved to 'leaders_4s'" in proc.log() or not _promotions(proc.log())
