"""The short chaos soak: at least 30 random faults, every kind at least once.

A 3-node cluster with an R3 bucket, five candidate processes on two roles
with file and PostgreSQL fences, three ``celery beat`` replicas with a 1-s
entry (and a worker on Redis running its ticks), three workers running
leader-only tasks sent four times a second, and faults in combinations (see
:mod:`tests.chaos.soak`). The independent checker reads the
recorded events; any violation fails the test, with the checker's table and
the seed (``benchmarks/soak.py --seed N --faults 30 --ttl 1`` replays the
schedule). About a minute and a half of wall time.

It runs on the newest nats-server: a clustered 2.9.10 (Debian's) sometimes
accepts two concurrent creates of one key (nats-server#4320), which no client
can prevent; ``benchmarks/soak.py --server system`` measures that case (see
docs/design.md, "What is not guaranteed").
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from celery_nats_leader.testing.server_binaries import server_binary
from tests.chaos.checker import Report
from tests.chaos.soak import FAULT_KINDS, Soak, SoakOptions, postgres_reachable
from tests.support.services import IN_CI, require_service

REDIS_URL = os.environ.get("CNL_REDIS_URL", "redis://127.0.0.1:6379/0")
BEAT_APP = Path(__file__).resolve().parent.parent / "beat"
CELERY_APP = Path(__file__).resolve().parent.parent / "celery"

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def run_short_soak(faults: int, ttl: float, **options: Any) -> tuple[Report, str]:
    """A short soak with the suite's services (PostgreSQL required in CI); its report and table."""
    pg = postgres_reachable()
    if IN_CI and not pg:
        pytest.fail("PostgreSQL (db 'test' on 127.0.0.1:5432) is required when CI=true")
    require_service("Redis", REDIS_URL)
    soak = Soak(
        SoakOptions(
            faults=faults,
            ttl=ttl,
            mean_gap=0.7,
            max_concurrent=3,
            pg=pg,
            beats=3,
            beat_app_dir=BEAT_APP,
            broker_url=REDIS_URL,
            binary=server_binary("newest"),
            workers=3,
            celery_app_dir=CELERY_APP,
            **options,
        )
    )
    report = soak.run()
    failed = "".join(f"\nfault failed: {error}" for error in soak.errors)
    return report, f"seed {soak.seed}, events in {soak.workdir}\n{report.table()}{failed}"


@pytest.mark.timeout(240)
def test_short_soak_has_no_violation() -> None:
    report, table = run_short_soak(30, 1.0)
    assert report.ok, table
    assert len(report.faults) >= 30, table
    assert {f.kind for f in report.faults} == set(FAULT_KINDS), table
    assert report.overlap_seconds == 0.0, table
    assert report.writes["accepted"] > 100, table  # the leaders did work all along
    # Beat ticked (one a second) between its restarts; none ran twice.
    assert report.ticks["ran"] >= 10, table
    assert report.ticks["twice"] == 0, table
    assert report.tasks["sent"] >= 50 and report.tasks["lost"] == 0, table
    print(table)


@pytest.mark.timeout(240)
def test_short_soak_with_fast_failover_has_no_violation() -> None:
    """The same faults with ``fast_failover=True`` everywhere, at TTL 3 s.

    Candidates, beats and workers each run with a designated successor (a
    frozen or killed leader with one named is replaced in about a second,
    the table's sigstop and sigkill rows); the checker's invariants are the
    same: no two leaders, no stale write, no tick twice, no task lost.
    Fewer faults than above, to stay near a minute.
    """
    report, table = run_short_soak(20, 3.0, fast_failover=True)
    assert report.ok, table
    assert len(report.faults) >= 20, table
    assert {f.kind for f in report.faults} == set(FAULT_KINDS), table
    assert report.overlap_seconds == 0.0, table
    assert report.writes["accepted"] > 100, table
    assert report.ticks["twice"] == 0, table
    assert report.tasks["sent"] >= 30 and report.tasks["lost"] == 0, table
    print(table)
