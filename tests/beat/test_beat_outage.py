"""A NATS outage of 10 s and of 60 s with beat and its worker running.

Two real ``celery beat`` replicas under the leader scheduler (ticks run once
by default: the worker claims each tick in the once-guard, and the dispatch
fence checks its term) send a 1-second entry to a real worker. Then the
nats-server stops for 10 s, or for 60 s, and comes back with its store.

What a user sees: every tick dispatched before the outage (some of them
still queued, their claim or fence check waiting for NATS) and every tick
after it runs exactly once; none is lost. The ticks whose time came during
the outage are the catch-up window's business
(``docs/beat.md``): those inside it are dispatched one by one once a leader
is back, the older ones coalesce into one run, counted as skipped.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from cnl_beat_harness import BeatCluster, wait_for

from celery_nats_leader.beat.ticks import parse_slot
from celery_nats_leader.config.settings import LeaderSettings

pytestmark = [pytest.mark.integration, pytest.mark.celery, pytest.mark.timeout(300)]

ENTRIES = [
    {"kind": "interval", "name": "every-second", "seconds": 1},
    # Fenced and claimed, and running 3 s: some run is always under way when
    # NATS goes (its claim's completion must wait for NATS, not run twice).
    {"kind": "interval", "name": "slow", "seconds": 2, "task": "cnl_beat.slow", "args": [3.0]},
]


@pytest.mark.parametrize("outage", [10.0, 60.0])
def test_every_tick_dispatched_around_a_nats_outage_runs_once(
    cluster_factory: Callable[..., BeatCluster], nats_server: Any, outage: float
) -> None:
    cluster = cluster_factory(entries=ENTRIES)
    cluster.config["celery"] = {"beat_scheduler": "nats_leader"}
    worker = cluster.start_worker()
    for _ in range(2):
        cluster.start_beat()
    first = cluster.wait_leader()
    cluster.wait_runs_by(first.epoch, 3)

    nats_server.stop()
    down_at = time.time()
    # The outage itself is the thing under test: NATS away for its length.
    wait_for(lambda: time.time() >= down_at + outage, outage + 5, "the outage to last")
    nats_server.start()
    up_at = time.time()
    cluster.recorder.rewatch()

    after = cluster.wait_new_term(first.epoch, timeout=cluster.ttl + 30)
    cluster.wait_runs_by(after.epoch, 3, timeout=60)
    cluster.drain()

    window = LeaderSettings(ttl=cluster.ttl).catch_up_window()
    for spec in ENTRIES:
        name, step = spec["name"], float(spec["seconds"])
        # The entry's state as the last write left it: ``runs`` counts every
        # tick dispatched since the first, ``skipped`` the ones coalesced.
        final = cluster.recorder.state_writes(name)[-1][1]

        # Every tick dispatched runs (the run count is the state's): a tick
        # whose claim waited for NATS may run after later ones.
        def all_ran(name: str = name, runs: int = final.runs) -> bool:
            return len({r.tick for r in cluster.runs(name)}) >= runs

        wait_for(all_ran, 60, f"{final.runs} ticks of {name} to run", cluster.diagnostics)
        ran = Counter(parse_slot(r.tick) for r in cluster.runs(name) if r.tick)
        twice = sorted(slot for slot, n in ran.items() if n > 1)
        assert twice == [], f"{name}: ticks run twice: {twice}"
        assert len(ran) == final.runs, (name, final, sorted(ran))
        slots = sorted(ran)
        assert slots[-1] == final.slot, (name, final, slots)
        # The slots without a run are exactly the ones counted as coalesced:
        # the outage's, older than the catch-up window when a leader was back.
        span = round((slots[-1] - slots[0]).total_seconds() / step) + 1
        assert span - len(slots) == final.skipped, (name, final, slots)
        before = [s for s in slots if s.timestamp() < down_at]
        resumed = [s for s in slots if s.timestamp() >= up_at]
        assert len(before) >= 3 and len(resumed) >= 3, (name, before, resumed)
        print(
            f"outage {outage:.0f}s, {name}: {len(before)} ticks before, {len(resumed)} after, "
            f"{len(slots)} dispatched and run once, {final.skipped} coalesced "
            f"(window {window:.0f}s)"
        )
    assert "MaxRetriesExceededError" not in worker.log()
