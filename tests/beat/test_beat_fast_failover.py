"""Fast failover of ``celery beat`` (``nats_leader_fast_failover``), TTL 10 s.

Two real ``celery beat`` replicas with the leader scheduler and a real
worker. Fast failover is switched on the ways a user does it: one replica by
the Celery setting ``nats_leader_fast_failover = True``, the other by the
environment variable ``NATS_LEADER_FAST_FAILOVER=true`` (a third, started
later, the same way). The leading scheduler is SIGKILLed twice; each time its
designated successor takes over and dispatches the overdue tick within
``DISPATCH_BOUND`` of the kill. Without fast failover the key outlives the
killed leader by 7.5 to 10 s (its last renewal, a quarter TTL before, plus
the TTL), so a dispatch that soon is the successor's compare-and-set.
Every tick of the run executes exactly once: the ticks that fell due during
the failover are caught up one by one, none lost.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
from cnl_beat_checks import check_exactly_once, check_gaps, check_terms
from cnl_beat_harness import LEADERS_BUCKET, BeatCluster, wait_for

from celery_nats_leader.beat.ticks import parse_slot
from celery_nats_leader.term.record import LeaderRecord, decode_record
from tests.support.procs import Proc

pytestmark = [pytest.mark.integration, pytest.mark.celery, pytest.mark.timeout(240)]

#: The default TTL: a failover by the lease would take 7.5 to 10 s.
FAST_TTL = 10.0
#: Kill to the next tick executed: the successor's wait (0.75-0.9 s), its
#: claim, the scheduler's promotion and the worker's delivery, on a busy host.
DISPATCH_BOUND = 2.5
#: The earliest a failover by the lease alone could dispatch: the key
#: expires a TTL after the leader's last renewal, at most a heartbeat
#: (TTL / 4) before the kill.
LEASE_ONLY_EARLIEST = FAST_TTL * 0.75

ENTRIES = [
    {"name": "every-second", "kind": "interval", "seconds": 1},
    {"name": "fast-cron", "kind": "fastcron"},
]


def _start(cluster: BeatCluster, *, how: str) -> Proc:
    """A beat replica with fast failover on through the Celery setting or the environment."""
    if how == "celery":
        cluster.config["extra"] = {"fast_failover": True}
        cluster.wrapper_env = {}
    else:
        cluster.config["extra"] = {}
        cluster.wrapper_env = {"NATS_LEADER_FAST_FAILOVER": "true"}
    try:
        return cluster.start_beat()
    finally:
        cluster.config["extra"], cluster.wrapper_env = {}, {}


def _with_successor(cluster: BeatCluster, epoch: int, timeout: float = 30.0) -> LeaderRecord:
    """Wait until the term ``epoch``'s record names a designated successor."""

    def named() -> LeaderRecord | None:
        record = cluster.recorder.leader()
        if record is not None and record.epoch == epoch and record.successor:
            return record
        return None

    return wait_for(named, timeout, f"term {epoch} to name a successor", cluster.diagnostics)


def _kill_leader(cluster: BeatCluster, leader: LeaderRecord) -> dict[str, Any]:
    """SIGKILL ``leader``'s scheduler; wait for its successor's term and first tick."""
    victim = cluster.leading(leader)
    # A random phase of the 1-second ticks: the kill lands wherever it lands.
    killed_at = time.monotonic()
    victim.signal(signal.SIGKILL)
    victim.wait(10)
    new = cluster.wait_new_term(leader.epoch, timeout=FAST_TTL + 10)
    term_seen = next(
        o.mono
        for o in list(cluster.recorder.seen)
        if o.bucket == LEADERS_BUCKET
        and not o.deleted
        and decode_record(o.value, o.revision).epoch == new.epoch
    )

    def first_run() -> Any:
        runs = [r for r in cluster.runs("every-second") if r.epoch == new.epoch]
        return min(runs, key=lambda r: r.mono) if runs else None

    run = wait_for(first_run, 30, f"a tick under epoch {new.epoch}", cluster.diagnostics)
    return {
        "victim": victim,
        "old": leader,
        "new": new,
        "takeover": term_seen - killed_at,
        "dispatch": run.mono - killed_at,
    }


@pytest.mark.parametrize("broker", ["redis"], indirect=True)
def test_successor_dispatches_within_seconds_of_a_kill_at_ttl_10(
    cluster_factory: Callable[..., BeatCluster], broker: Any
) -> None:
    cluster = cluster_factory(entries=ENTRIES, ttl=FAST_TTL)
    cluster.start_worker()
    by_setting = _start(cluster, how="celery")
    by_env = _start(cluster, how="env")

    first = cluster.wait_leader()
    cluster.wait_runs_by(first.epoch, 3)
    first = _with_successor(cluster, first.epoch)
    survivor = by_env if int(first.meta["pid"]) == by_setting.pid else by_setting

    # 1. The leader dies; the successor it named takes over.
    one = _kill_leader(cluster, first)
    cluster.wait_runs_by(one["new"].epoch, 3)

    # 2. A replacement joins (through the environment), is named, and the
    # second leader dies in turn.
    joined = _start(cluster, how="env")
    second = _with_successor(cluster, one["new"].epoch)
    two = _kill_leader(cluster, second)
    cluster.wait_runs_by(two["new"].epoch, 3)
    end_wall = time.time()
    cluster.drain()

    print(
        "\nfast failover at TTL 10 s: kill -> new term "
        f"{one['takeover']:.2f} s / {two['takeover']:.2f} s, kill -> next tick executed "
        f"{one['dispatch']:.2f} s / {two['dispatch']:.2f} s"
    )
    for failover, heir in ((one, survivor), (two, joined)):
        # The successor the record named took over, by its compare-and-set
        # (the lease would have kept the key for another 7.5 s at least).
        assert failover["new"].id == failover["old"].successor
        assert int(failover["new"].meta["pid"]) == heir.pid
        assert failover["dispatch"] <= DISPATCH_BOUND < LEASE_ONLY_EARLIEST, (
            f"next tick {failover['dispatch']:.2f}s after the kill (term after "
            f"{failover['takeover']:.2f}s) at TTL {FAST_TTL}"
        )
        assert "taking over (fast failover)" in heir.log()

    verdicts = check_exactly_once(cluster, end_wall=end_wall)  # none lost, none twice
    check_gaps(cluster, verdicts, DISPATCH_BOUND)
    check_terms(cluster)
    ticks = {e["name"]: len(verdicts[e["name"]].executed) for e in ENTRIES}
    assert ticks["every-second"] >= 9 and ticks["fast-cron"] >= 9, ticks
    for run in cluster.runs():
        assert run.tick is not None and parse_slot(run.tick)
