"""Catch-up on real ``celery beat`` replicas: a failover loses no tick, an outage is one run.

With the default catch-up window (``2 x ttl + 5`` s), the ticks a failover
missed are dispatched one by one (TTL 3 s, window 11 s), and the ticks of an
outage longer than the window (every replica down; TTL 1.5 s, window 8 s)
coalesce into one run, as with Celery's own scheduler: no burst when beat
comes back.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
from cnl_beat_checks import check_exactly_once, check_terms
from cnl_beat_harness import LEADERS_BUCKET, TTL, BeatCluster, wait_for

from celery_nats_leader.beat.ticks import parse_slot
from celery_nats_leader.config.settings import LeaderSettings
from celery_nats_leader.term.record import decode_record

pytestmark = [pytest.mark.integration, pytest.mark.celery, pytest.mark.timeout(240)]

ENTRIES = [{"name": "every-second", "kind": "interval", "seconds": 1}]
#: The default catch-up window at the tests' TTL (8 s).
WINDOW = LeaderSettings(ttl=TTL).catch_up_window()
ONE = timedelta(seconds=1)
#: The TTL of the failover test.
FAILOVER_TTL = 3.0


def term_began(cluster: BeatCluster, epoch: int) -> float:
    """When the recorder saw the beat role's record of ``epoch`` (monotonic clock)."""
    for seen in list(cluster.recorder.seen):
        if (
            seen.bucket == LEADERS_BUCKET
            and not seen.deleted
            and decode_record(seen.value, seen.revision).epoch == epoch
        ):
            return seen.mono
    raise AssertionError(f"no record of epoch {epoch} seen")


def test_a_failover_catches_up_every_missed_tick(
    cluster_factory: Callable[..., BeatCluster],
) -> None:
    # A TTL of 3 s (default window 11 s): a crash leaves the role without a
    # leader for at least 3/4 of it (2.25 s), so at least two 1-s ticks are missed.
    cluster = cluster_factory(entries=ENTRIES, ttl=FAILOVER_TTL)
    cluster.start_worker()
    for _ in range(2):
        cluster.start_beat()
    first = cluster.wait_leader()
    cluster.wait_runs_by(first.epoch, 3)
    killed = cluster.kill_leader(first)
    second = cluster.wait_leader(exclude=(killed,))
    cluster.wait_runs_by(second.epoch, 3)
    end_wall = time.time()
    cluster.drain()

    # Every tick once, none skipped (the final state's ``skipped`` is 0).
    verdict = check_exactly_once(cluster, end_wall=end_wall)["every-second"]
    check_terms(cluster)
    # The successor's first ticks were the ones the crash left behind, each
    # dispatched (not coalesced) although they were overdue.
    last_old = max(slot for slot, runs in verdict.executed.items() if runs[0].epoch == first.epoch)
    new = sorted(slot for slot, runs in verdict.executed.items() if runs[0].epoch == second.epoch)
    new_runs = [verdict.executed[slot][0] for slot in new]
    assert new[0] == last_old + ONE
    # The ticks due between the crash and the successor's term (at least
    # two: a successor leads at least 3/4 TTL after the crash, the leader's
    # last renewal being at most a heartbeat, TTL/4, older than the crash)
    # were caught up, each once. The term's start, seen by the recorder on the
    # monotonic clock, on the wall clock (one host: a run has both).
    began = term_began(cluster, second.epoch) + (new_runs[0].wall - new_runs[0].mono)
    caught_up = [slot for slot in new if slot.timestamp() < began]
    assert len(caught_up) >= 2, f"the crash missed {len(caught_up)} ticks"
    assert all(s.skipped == 0 for _, s in cluster.recorder.state_writes("every-second"))
    late = [round(verdict.executed[slot][0].wall - slot.timestamp(), 2) for slot in caught_up]
    print(f"failover: {len(caught_up)} missed ticks caught up, late by {late} s")


def test_an_outage_longer_than_the_window_is_one_run(
    cluster_factory: Callable[..., BeatCluster],
) -> None:
    cluster = cluster_factory(entries=ENTRIES)
    cluster.start_worker()
    old = cluster.start_beat()
    first = cluster.wait_leader()
    cluster.wait_runs_by(first.epoch, 3)
    old.signal(signal.SIGTERM)
    assert old.wait(30) == 0
    last = cluster.recorder.state_writes("every-second")[-1][1]
    stopped = time.time()

    # The outage itself is the thing under test: every replica down for
    # longer than the catch-up window (nothing to await but the clock).
    outage = WINDOW + 6.0
    wait_for(lambda: time.time() >= stopped + outage, outage + 5, "the outage to last")
    cluster.start_beat()
    second = cluster.wait_leader(exclude=(old,))
    cluster.wait_runs_by(second.epoch, 4)
    cluster.drain()

    runs = sorted(cluster.runs("every-second"), key=lambda r: parse_slot(r.tick or ""))
    new = [r for r in runs if r.epoch == second.epoch]
    coalesced = parse_slot(new[0].tick or "")
    missed = (coalesced - last.slot) // ONE
    # N periods of outage: more than the window's worth of ticks were overdue...
    assert missed >= WINDOW + 6, (missed, WINDOW)
    # ... and exactly one of them ran: the latest, the others counted as skipped.
    during = [r for r in runs if last.slot < parse_slot(r.tick or "") <= coalesced]
    assert len(during) == 1
    state = next(s for _, s in cluster.recorder.state_writes("every-second") if s.slot == coalesced)
    assert state.skipped == missed - 1
    assert state.runs == last.runs + 1
    # No burst: after the coalesced run the schedule goes on one tick per
    # period, each dispatched at (not before, not long after) its slot.
    slots = [parse_slot(r.tick or "") for r in new]
    assert slots == [coalesced + k * ONE for k in range(len(slots))]
    for run, slot in zip(new[1:], slots[1:], strict=True):
        assert slot.timestamp() - 0.05 <= run.wall <= slot.timestamp() + 2.0, (slot, run.wall)
    print(
        f"outage {outage:.1f}s: {missed} ticks overdue, 1 run, {state.skipped} skipped; "
        f"window {WINDOW:g}s"
    )
