"""NATS connections per worker process, counted on the server (``connz``).

A prefork worker's main process holds the election's connection; each child
that runs guarded tasks (``@leader_only(validate=True)``, ``@run_once``, the
beat fence) holds exactly one more, shared by every guard, whatever the kinds
of tasks it ran. A threads worker holds two: the election's and the guards'.
Connections are attributed to processes through the kernel
(the socket's port), not through anything the client names itself.
"""

from __future__ import annotations

import socket
from typing import Any

import pytest
from cnl_celery_harness import Cluster, wait_for

from celery_nats_leader.beat import EPOCH_HEADER, ROLE_HEADER
from tests.support.connections import connections_by_process, process_tree

pytestmark = [pytest.mark.celery, pytest.mark.integration, pytest.mark.timeout(180)]

KINDS = ("cnl.record_validated", "cnl.record_once", "cnl.record_fenced")


def _run_every_guard(cluster: Cluster) -> dict[int, set[str]]:
    """Send every kind of guarded task; the kinds each process ran, by pid."""
    cluster.wait_leader()
    epoch = cluster.ledger.promotions()[-1].epoch
    assert epoch is not None
    # The fence lets the task through: it was sent under the current term.
    headers = {EPOCH_HEADER: epoch, ROLE_HEADER: cluster.role}
    sent = 0
    for _ in range(4):
        for kind in KINDS:
            options = {"headers": headers} if kind == "cnl.record_fenced" else {}
            cluster.send(kind, sent, 0.05, options=options)
            sent += 1
    wait_for(lambda: cluster.ledger.committed() == sent, 60, "every task", cluster.diagnostics)
    ran: dict[int, set[str]] = {}
    for pid, name in cluster.ledger.rows("SELECT pid, name FROM commits"):
        ran.setdefault(int(pid), set()).add(str(name))
    return ran


def _client_name(pid: int) -> str:
    return f"celery-nats-leader client {socket.gethostname()}:{pid}"


def test_one_connection_per_prefork_process(cluster_factory: Any) -> None:
    cluster: Cluster = cluster_factory(ttl=4.0)
    worker = cluster.start_worker("w1", pool="prefork", concurrency=2)
    by_child = _run_every_guard(cluster)
    # One child at least ran every guard (the fenced task has all three).
    assert any("cnl.record_fenced" in names for names in by_child.values())

    assert worker.pid is not None
    pids = process_tree(worker.pid)
    held = connections_by_process(cluster.nats, pids)
    # The main process: the election's connection only.
    assert len(held[worker.pid]) == 1, held
    assert held[worker.pid][0].startswith("celery-nats-leader w1@")
    for pid in pids[1:]:
        expected = 1 if pid in by_child else 0
        assert len(held[pid]) == expected, (pid, by_child.get(pid), held)
        if expected:
            assert held[pid] == [_client_name(pid)]
    # No child that ran a task was replaced meanwhile (each is counted above).
    assert set(by_child) <= set(pids[1:]), (by_child, pids)


def test_two_connections_in_a_threads_worker(cluster_factory: Any) -> None:
    # The guards' client stays apart from the election's connection: a warm
    # shutdown closes the election's first, while running tasks still need
    # the once-guard.
    cluster: Cluster = cluster_factory(ttl=4.0)
    worker = cluster.start_worker("w1", pool="threads", concurrency=4)
    ran = _run_every_guard(cluster)
    assert worker.pid is not None
    assert set(ran) == {worker.pid}
    held = connections_by_process(cluster.nats, [worker.pid])[worker.pid]
    assert len(held) == 2, held
    assert _client_name(worker.pid) in held
    assert any(name.startswith("celery-nats-leader w1@") for name in held), held
