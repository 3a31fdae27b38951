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
