"""Three real ``celery beat`` replicas and a real worker: one dispatch per tick, whatever happens.

The active scheduler is killed (SIGKILL), paused past the TTL (SIGSTOP, then
SIGCONT) and stopped gracefully (SIGTERM), in one run, with a 1-second
interval entry, a crontab entry whose clock runs 60x (one schedule minute per
second, so its cron slots tick every second) and a real wall-clock crontab
entry. The ledger of executed runs must show every tick exactly once, no
gap longer than one period plus the failover time, and only leaders writing
schedule state.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
from cnl_beat_checks import check_exactly_once, check_gaps, check_terms
from cnl_beat_harness import FAILOVER, SLACK, TTL, BeatCluster, wait_for

from celery_nats_leader.beat.ticks import parse_slot

pytestmark = [pytest.mark.integration, pytest.mark.celery, pytest.mark.timeout(240)]

ENTRIES = [
    {"name": "every-second", "kind": "interval", "seconds": 1},
    {"name": "fast-cron", "kind": "fastcron"},
    {"name": "wall-cron", "kind": "cron"},
]


@pytest.mark.parametrize("broker", ["filesystem", "redis", "amqp"], indirect=True)
def test_every_tick_exactly_once_across_kill_pause_and_stop(
    cluster_factory: Callable[..., BeatCluster], broker: Any
) -> None:
    cluster = cluster_factory(entries=ENTRIES)
    cluster.start_worker()
    for _ in range(3):
        cluster.start_beat()

    first = cluster.wait_leader()
    cluster.wait_runs_by(first.epoch, 3)

    # 1. The active scheduler crashes.
    killed = cluster.kill_leader(first)
    second = cluster.wait_leader(exclude=(killed,))
    assert second.epoch > first.epoch
    cluster.wait_runs_by(second.epoch, 3)

    # 2. The new one is paused past the TTL, then continued.
    paused = cluster.leading(second)
    paused.signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    third = cluster.wait_leader(exclude=(killed, paused))
    cluster.wait_runs_by(third.epoch, 3)
    wait_for(lambda: time.monotonic() >= stopped_at + 2 * TTL, 10, "a pause of 2 TTL")
    paused.signal(signal.SIGCONT)
    continued_at = time.monotonic()
    cluster.wait_runs_by(third.epoch, 6)

    # 3. The active scheduler is stopped gracefully: it hands over at once.
    active = cluster.leading(third)
    active.signal(signal.SIGTERM)
    assert active.wait(30) == 0
    released_at = time.monotonic()
    fourth = cluster.wait_leader(exclude=(killed, active))
    cluster.wait_runs_by(fourth.epoch, 3)
    end_wall = time.time()
    cluster.drain()

    verdicts = check_exactly_once(cluster, end_wall=end_wall)  # none lost: the outbox
    check_gaps(cluster, verdicts, FAILOVER)
    check_terms(cluster)

    # The paused ex-leader woke up as a follower: it wrote no state under its
    # old term after it was continued (it may lead again later, in a new term).
    late = [
        (o.key, s.slot)
        for o, s in cluster.recorder.all_state_writes()
        if s.epoch == second.epoch and o.mono > continued_at
    ]
    assert not late, f"the paused ex-leader wrote schedule state after waking up: {late}"
    # A graceful stop hands over in milliseconds: no tick waited for a TTL.
    after_release = sorted(r.mono for r in cluster.runs("every-second") if r.epoch == fourth.epoch)
    first_after = after_release[0] - released_at
    assert first_after <= 1.0 + SLACK, f"first tick {first_after:.2f}s after a graceful stop"
    # Every term that wrote state dispatched ticks of every entry it led for.
    ticks = {e["name"]: len(verdicts[e["name"]].executed) for e in ENTRIES}
    assert ticks["every-second"] >= 12 and ticks["fast-cron"] >= 12, ticks
    for run in cluster.runs():
        assert run.tick is not None and parse_slot(run.tick)
