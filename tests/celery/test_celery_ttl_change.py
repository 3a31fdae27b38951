"""Changing the TTL while ``@leader_only`` tasks run: one leader at every instant.

Three real Celery workers lead the role ``jobs`` on a bucket with TTL 1.5 s
while a sender keeps leader-only tasks coming (one every 50 ms). The operator
writes the new settings (a new bucket, TTL 4 s) and runs ``nats-leader bucket
--migrate-from OLD``; the workers then roll over as a Deployment's rolling
update does: a new one starts, an old one stops (warm shutdown), the leader
last, and that one is SIGKILLed (its term must run out, not be handed over).

Judged by the chaos checker (``tests/chaos/checker.py``) from the workers'
own records of their terms (promoted / demoted, on one monotonic clock) and
of their commits: no two workers believe they lead ``jobs`` at one instant,
and every task sent is committed exactly once (a task cut short by the kill
runs again on the successor; its fenced commit is refused as a duplicate).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from cnl_celery_harness import Cluster, run_cli, wait_for

from tests.chaos.checker import Event, check
from tests.support.brokers import Broker
from tests.support.procs import Proc

pytestmark = [pytest.mark.celery, pytest.mark.integration, pytest.mark.timeout(300)]

OLD_TTL = 1.5
NEW_TTL = 4.0
#: Seconds between two leader-only tasks sent during the roll.
SEND_EVERY = 0.05


class Sender:
    """Sends ``cnl.record`` tasks from a thread, recording each send (monotonic)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.sent: list[tuple[int, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sender", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        seq = 0
        while not self._stop.wait(SEND_EVERY):
            self.cluster.send("cnl.record", seq, work=0.01)
            self.sent.append((seq, time.monotonic()))
            seq += 1

    def stop(self) -> int:
        """Stop sending; the number of tasks sent."""
        self._stop.set()
        self._thread.join(30)
        return len(self.sent)


def checker_events(
    cluster: Cluster, sender: Sender, names: dict[int, str], killed: dict[str, float]
) -> list[Event]:
    """The run as the chaos checker reads it: terms, kills, sends and commits."""
    events = [
        Event(
            t.t,
            names[t.main_pid],
            "promote" if t.event == "promoted" else "demote",
            {"role": t.role, "epoch": t.epoch, "reason": t.reason},
        )
        for t in cluster.ledger.terms()
    ]
    events += [Event(at, name, "killed", {}) for name, at in killed.items()]
    events += [Event(at, "sender", "sent", {"task": str(seq)}) for seq, at in sender.sent]
    events += [
        Event(t, names[pid], "run", {"task": str(seq)})
        for seq, pid, t in cluster.ledger.rows("SELECT seq, main_pid, t FROM commits")
    ]
    return sorted(events, key=lambda e: e.t)


@pytest.mark.parametrize("broker", ["amqp"], indirect=True)
def test_a_ttl_change_rolled_over_the_workers_keeps_one_leader_at_every_instant(
    cluster_factory: Any, broker: Broker
) -> None:
    cluster: Cluster = cluster_factory(ttl=OLD_TTL)
    old_bucket = cluster.config["bucket"]
    new_bucket = f"{old_bucket}_4s"
    old = [cluster.start_worker(f"old{i}", pool="threads", wait=False) for i in (1, 2, 3)]
    for worker in old:
        cluster.wait_ready(worker)
    first = cluster.wait_leader()
    sender = Sender(cluster)
    sender.start()
    wait_for(lambda: cluster.ledger.committed() >= 10, 60, "the first leader's commits")

    # The operator's step: the new settings, then the migration.
    cluster.config.update(bucket=new_bucket, ttl=NEW_TTL)
    refused = run_cli(cluster, "bucket", "--migrate-from", old_bucket)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    # The workers' once-guard (``cnl.record_once``) keeps its records.
    assert f"set nats_leader_once_bucket = '{old_bucket}_once'" in refused.stderr
    assert "work they record as done or running could run again" in refused.stderr
    cluster.config["extra"] = {"once_bucket": f"{old_bucket}_once"}
    migrated = run_cli(cluster, "bucket", "--migrate-from", old_bucket)
    assert migrated.returncode == 0, migrated.stdout + migrated.stderr

    # The roll: a new worker up, an old one down; the leader last, killed.
    order = [w for w in old if w is not first] + [first]
    new: list[Proc] = []
    killed: dict[str, float] = {}
    for number, proc in enumerate(order, 1):
        new.append(cluster.start_worker(f"new{number}", pool="threads"))
        if proc is first:
            for replica in new:
                wait_for(
                    lambda r=replica: f"on the old bucket {old_bucket!r} to end" in r.log(),
                    30,
                    f"{replica} waiting for the old term",
                    cluster.diagnostics,
                )
            killed[proc.name] = time.monotonic()
            proc.kill()
        else:
            proc.terminate()
            assert proc.wait(60) == 0, proc.log()[-3000:]
    successor = cluster.wait_leader(exclude=tuple(old), timeout=NEW_TTL + 30)
    wait_for(
        lambda: (
            cluster.ledger.count("SELECT COUNT(*) FROM commits WHERE main_pid = ?", successor.pid)
            >= 10
        ),
        60,
        "the new leader's commits",
        cluster.diagnostics,
    )
    total = sender.stop()
    wait_for(lambda: cluster.ledger.committed() == total, 120, f"{total} commits")

    names = {w.pid: w.name for w in cluster.workers}
    report = check(checker_events(cluster, sender, names, killed), ttl=NEW_TTL)
    print(f"\n{report.table()}")
    assert report.violations == [], report.table()
    assert report.overlap_seconds == 0.0
    assert report.tasks == {"sent": total, "ran": total, "twice": 0, "lost": 0}
    # The successor's term began after the old leader was killed: the new
    # workers waited for the old term instead of starting one beside it.
    [promotion] = [t for t in cluster.ledger.promotions() if t.main_pid == successor.pid]
    assert promotion.t > killed[first.name]
    # No old worker started a term on the moved bucket.
    old_terms = [t for t in cluster.ledger.promotions() if t.main_pid in {w.pid for w in old}]
    assert [t.main_pid for t in old_terms] == [first.pid], old_terms
