"""``@leader_only`` with the once-guard on real workers: a task id runs once on the leader.

A producer that publishes one task id several times (a retry after a lost
acknowledgement, a resubmission) makes Celery run every copy; with
``@run_once`` under ``@leader_only`` the leader runs its body once and
acknowledges the other copies. Both are measured by the ledger's *attempts*
(every time a body started), beside each other in one test.
"""

from __future__ import annotations

import uuid
from collections import Counter
from typing import Any

import pytest
from cnl_celery_harness import Cluster, wait_for

pytestmark = [pytest.mark.celery, pytest.mark.integration]


def test_leader_only_task_id_runs_once_with_the_guard(cluster_factory: Any) -> None:
    cluster: Cluster = cluster_factory(ttl=2.0, extra={"once_lease": 2.0})
    worker = cluster.start_worker("w1", pool="threads", concurrency=4)
    cluster.wait_leader()
    copies, ids = 3, {name: [str(uuid.uuid4()) for _ in range(5)] for name in ("once", "plain")}
    for _ in range(copies):
        for seq, task_id in enumerate(ids["once"]):
            cluster.send("cnl.record_once", seq, options={"task_id": task_id})
        for seq, task_id in enumerate(ids["plain"]):
            cluster.send("cnl.record", 100 + seq, options={"task_id": task_id})

    def attempts(name: str) -> Counter[str]:
        rows = cluster.ledger.rows("SELECT task_id FROM attempts WHERE name = ?", name)
        return Counter(task_id for (task_id,) in rows)

    duplicates = len(ids["once"]) * (copies - 1)
    wait_for(
        lambda: (
            sum(attempts("cnl.record").values()) == len(ids["plain"]) * copies
            and worker.log().count("already ran (on ") == duplicates
        ),
        90,
        f"every plain copy run and {duplicates} guarded copies acknowledged",
        cluster.diagnostics,
    )
    # Celery runs every copy (the ledger's idempotent commit hides it, the
    # attempts show it); the guard runs each id once, on the leader.
    assert attempts("cnl.record") == dict.fromkeys(ids["plain"], copies)
    assert attempts("cnl.record_once") == dict.fromkeys(ids["once"], 1)


def test_beat_tick_copies_run_once_on_a_worker_with_the_bootstep(cluster_factory: Any) -> None:
    # Messages marked as our schedulers mark a tick (``nats_leader_once``),
    # sent three times each under one id: the bootstep's guard runs each id
    # once, for a task without the guard (``cnl.record``) as for one that
    # guards itself (``cnl.record_once``: claimed once, not twice), in
    # prefork children (the guard is installed before the fork).
    from celery_nats_leader.beat import ENTRY_HEADER, ONCE_HEADER, TICK_HEADER

    cluster: Cluster = cluster_factory(ttl=2.0, extra={"once_lease": 2.0})
    worker = cluster.start_worker("w1", pool="prefork", concurrency=2)
    cluster.wait_leader()
    copies = 3
    names = ("cnl.record", "cnl.record_once")
    ids = {name: [str(uuid.uuid4()) for _ in range(3)] for name in names}
    for _ in range(copies):
        for base, (name, task_ids) in zip((200, 300), ids.items(), strict=True):
            for seq, task_id in enumerate(task_ids):
                headers = {
                    ONCE_HEADER: True,
                    ENTRY_HEADER: "manual",
                    TICK_HEADER: f"2026-01-01T00:00:0{seq}+00:00",
                }
                cluster.send(name, base + seq, options={"task_id": task_id, "headers": headers})

    def attempts(name: str) -> Counter[str]:
        rows = cluster.ledger.rows("SELECT task_id FROM attempts WHERE name = ?", name)
        return Counter(task_id for (task_id,) in rows)

    duplicates = sum(len(task_ids) for task_ids in ids.values()) * (copies - 1)
    wait_for(
        lambda: (
            worker.log().count("already ran (on ") == duplicates
            and all(set(attempts(name)) == set(task_ids) for name, task_ids in ids.items())
        ),
        90,
        f"{duplicates} copies acknowledged and every id run",
        cluster.diagnostics,
    )
    for name, task_ids in ids.items():
        assert attempts(name) == dict.fromkeys(task_ids, 1), name
