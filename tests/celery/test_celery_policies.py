"""What a leader-only task does off the leader, and how stale runs are kept out.

* ``on_follower``: skip, raise, requeue (a message on a non-leader queue is
  forwarded to the leader queue, not bounced back forever);
* a demoted worker's prefetched messages are handed back un-run and run once
  by the new leader;
* ``validate=True`` catches a stale token that the cached state cannot see
  (the worker's main process is frozen while its key is taken away);
* the fencing token keeps a run that outlived its leader's term from
  committing: its commit is refused and the task runs again on the new leader.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
import uuid
from collections import Counter
from typing import Any

import pytest
from cnl_celery_harness import Cluster, run_cli, wait_for

from celery_nats_leader.config.connection import ConnectOptions
from celery_nats_leader.nats.connection import connect
from celery_nats_leader.nats.jetstream import JetStreamBackend
from celery_nats_leader.term.record import encode_record
from tests.support.brokers import Broker

pytestmark = [pytest.mark.celery, pytest.mark.integration]


def postrun_states(cluster: Cluster, task_id: str) -> list[tuple[int, str]]:
    return [
        (int(pid), str(state))
        for pid, state in cluster.ledger.rows(
            "SELECT main_pid, state FROM events WHERE kind = 'postrun' AND task_id = ?", task_id
        )
    ]


def test_on_follower_policies(cluster_factory: Any) -> None:
    cluster: Cluster = cluster_factory(ttl=2.0)
    token = uuid.uuid4().hex[:6]
    leader_only_q, follower_only_q = f"cnl-private-a-{token}", f"cnl-private-b-{token}"
    cluster.broker.queues.update({leader_only_q, follower_only_q})
    leader = cluster.start_worker("leader", queues=(leader_only_q,))
    cluster.wait_leader()
    follower = cluster.start_worker("follower", queues=(follower_only_q,))

    # Routed by hand to the follower's own queue (a per-node / broadcast pattern).
    skipped = cluster.send("cnl.skip", 1, options={"queue": follower_only_q})
    raised = cluster.send("cnl.raise", 2, options={"queue": follower_only_q})
    forwarded = cluster.send("cnl.record", 3, options={"queue": follower_only_q})
    # The same "skip" task on the leader's own queue runs.
    ran = cluster.send("cnl.skip", 4, options={"queue": leader_only_q})
    # Bare @leader_only, routed to the leader queue by default.
    bare = cluster.send("cnl.bare", 5)

    ledger = cluster.ledger
    wait_for(
        # Every execution ends with a postrun record: one each, two for the
        # forwarded task (ignored on the follower, run on the leader).
        lambda: (
            [len(postrun_states(cluster, r.id)) for r in (skipped, raised, forwarded, ran, bare)]
            == [1, 1, 2, 1, 1]
        ),
        60,
        "the five tasks to finish",
        cluster.diagnostics,
    )
    assert postrun_states(cluster, skipped.id) == [(follower.pid, "IGNORED")]
    assert postrun_states(cluster, raised.id) == [(follower.pid, "FAILURE")]
    assert "NotLeaderError" in follower.log()
    # Forwarded: ignored on the follower, run once by the leader.
    assert sorted(postrun_states(cluster, forwarded.id)) == sorted(
        [(follower.pid, "IGNORED"), (leader.pid, "SUCCESS")]
    )
    assert f"forwarded to {cluster.leader_queue()}" in follower.log()
    commits = ledger.rows("SELECT seq, main_pid FROM commits ORDER BY seq")
    assert commits == [(3, leader.pid), (4, leader.pid)]
    # Skipped and raised never ran their body.
    assert ledger.count("SELECT COUNT(*) FROM attempts WHERE seq IN (1, 2)") == 0
    assert ledger.rows("SELECT main_pid FROM events WHERE kind = 'bare'") == [(leader.pid,)]
    assert postrun_states(cluster, bare.id) == [(leader.pid, "SUCCESS")]
    assert postrun_states(cluster, ran.id) == [(leader.pid, "SUCCESS")]


@pytest.mark.parametrize("broker", ["filesystem", "redis", "amqp"], indirect=True)
def test_prefetched_messages_survive_demotion(cluster_factory: Any, broker: Broker) -> None:
    # Deep prefetch on purpose, so that the demoted worker holds messages it
    # has received but not started.
    cluster: Cluster = cluster_factory(ttl=2.0, prefetch_multiplier=4)
    first = cluster.start_worker("w1", concurrency=2)
    cluster.wait_leader()
    second = cluster.start_worker("w2", concurrency=2)
    total = 60
    hold = cluster.tmp_path / "hold"
    for seq in range(total):
        cluster.send("cnl.record", seq, hold=str(hold))
    ledger = cluster.ledger

    def received_by_first() -> int:
        return ledger.count(
            "SELECT COUNT(*) FROM events WHERE kind = 'received' AND main_pid = ?", first.pid
        )

    # Both pool slots busy (their runs wait before committing) and at least
    # one more message received. (How many depends on the transport: the
    # prefetch limit with RabbitMQ and Redis; one more than the pool with the
    # filesystem transport, whose blocking loop waits for a free slot.)
    wait_for(
        lambda: (
            ledger.count("SELECT COUNT(*) FROM attempts WHERE main_pid = ?", first.pid) == 2
            and received_by_first() >= 3
        ),
        60,
        "w1 to hold prefetched messages",
        cluster.diagnostics,
    )
    reserved = received_by_first() - 2

    result = run_cli(cluster, "resign", cluster.role)
    assert result.returncode == 0, result.stderr
    assert f"stepped down from role {cluster.role!r}" in result.stdout
    cluster.wait_leader(exclude=(first,))
    hold.touch()
    wait_for(lambda: ledger.committed() == total, 120, "every task committed", cluster.diagnostics)
    wait_for(lambda: not unfinished(cluster), 60, "every run to finish", cluster.diagnostics)

    committed = ledger.rows("SELECT seq, main_pid FROM commits ORDER BY seq")
    assert [seq for seq, _ in committed] == list(range(total))
    # The demoted worker handed every message it held back without running it...
    rejected = ledger.count(
        "SELECT COUNT(*) FROM events "
        "WHERE kind = 'postrun' AND state = 'REJECTED' AND main_pid = ?",
        first.pid,
    )
    assert rejected >= reserved >= 1
    # ...its only runs were the two that started in its term...
    runs = ledger.rows("SELECT checked_at FROM attempts WHERE main_pid = ?", first.pid)
    promoted_second = min(t.t for t in ledger.promotions() if t.main_pid == second.pid)
    assert len(runs) == 2
    assert all(checked_at < promoted_second for (checked_at,) in runs)
    # ...and no task ran to a second commit (no crash here).
    assert ledger.count("SELECT COUNT(*) FROM refusals WHERE kind = 'duplicate'") == 0
    stale = ledger.count("SELECT COUNT(*) FROM refusals WHERE kind = 'stale'")
    print(
        f"\nprefetch report ({broker.kind}): {reserved} messages held at demotion, {rejected} "
        f"requeued un-run; {stale} of the 2 in-flight runs refused as stale and re-run"
    )


def unfinished(cluster: Cluster) -> list[tuple[int, int, int]]:
    """Runs that started but reached neither a commit nor a refusal yet."""
    rows = cluster.ledger.rows
    runs = Counter(rows("SELECT seq, main_pid, epoch FROM attempts"))
    runs.subtract(rows("SELECT seq, main_pid, epoch FROM commits"))
    runs.subtract(rows("SELECT seq, main_pid, epoch FROM refusals"))
    return [key for key, n in runs.items() if n > 0]


async def _forge_record(cluster: Cluster, *, delete: bool = False) -> int:
    """Put another candidate's record in the role's key (or delete it)."""
    nc = await connect(ConnectOptions(servers=(cluster.nats.url,)), timeout=10)
    try:
        bucket = await JetStreamBackend(nc).open_bucket(
            cluster.config["bucket"], ttl=None, create=False, replicas=1, timeout=10
        )
        if delete:
            entry = await bucket.get(cluster.role, timeout=5)
            assert entry is not None
            await bucket.delete(cluster.role, last=entry.revision, timeout=5)
            return entry.revision
        forged = encode_record(
            instance_id="intruder:1:abcd", token=str(uuid.uuid4()), epoch=None, priority=0, meta={}
        )
        return await bucket.put(cluster.role, forged, timeout=5)
    finally:
        await nc.close()


def test_validate_catches_a_stale_token_in_a_prefork_child(cluster_factory: Any) -> None:
    # A long lease: the cached state keeps saying "leader" for seconds, so
    # only the KV read of validate=True can notice the key was taken.
    cluster: Cluster = cluster_factory(ttl=10.0)
    worker = cluster.start_worker("w1", concurrency=1)
    cluster.wait_leader()
    barrier = cluster.tmp_path / "barrier"
    result = cluster.send("cnl.record_validated", 1, barrier=str(barrier))
    ledger = cluster.ledger
    wait_for(
        lambda: ledger.count("SELECT COUNT(*) FROM events WHERE kind = 'at_barrier'"),
        60,
        "the task to reach its barrier",
        cluster.diagnostics,
    )

    # Freeze the worker's main process (its elector, watch and renewals), take
    # the key away, then let the pool child run its check.
    worker.pause()  # returns once it is stopped: it cannot notice the forgery
    try:
        forged_epoch = asyncio.run(_forge_record(cluster))
        barrier.touch()
        wait_for(
            lambda: postrun_states(cluster, result.id) == [(worker.pid, "REJECTED")],
            60,
            "the child to refuse the task",
        )
        # The body never ran: the stale token was caught before it.
        assert ledger.count("SELECT COUNT(*) FROM attempts") == 0
        asyncio.run(_forge_record(cluster, delete=True))
    finally:
        worker.resume()

    # The worker sees the intruder, steps down, wins the freed key again and
    # runs the requeued task once, under a new term.
    wait_for(
        lambda: ledger.committed() == 1, 60, "the requeued task to commit", cluster.diagnostics
    )
    ((seq, epoch),) = ledger.rows("SELECT seq, epoch FROM commits")
    assert seq == 1 and epoch > forged_epoch
    assert "failed validation" in worker.log()
    demotions = [t.reason for t in ledger.terms() if t.event == "demoted"]
    assert demotions[:1] in (["revision_changed"], ["key_deleted"], ["token_mismatch"])


def test_fencing_refuses_a_run_that_outlived_its_term(cluster_factory: Any) -> None:
    cluster: Cluster = cluster_factory(ttl=2.0)
    first = cluster.start_worker("w1")
    cluster.wait_leader()
    second = cluster.start_worker("w2")
    hold = cluster.tmp_path / "hold"
    cluster.send("cnl.record", 1, hold=str(hold))
    ledger = cluster.ledger
    wait_for(
        lambda: ledger.count("SELECT COUNT(*) FROM attempts WHERE seq = 1"), 60, "task 1 to start"
    )

    # Rolling restart: w1 hands over at once, while task 1 is still running on it.
    first.terminate()
    cluster.wait_leader(exclude=(first,))
    cluster.send("cnl.record", 2)
    wait_for(lambda: ledger.committed() == 1, 60, "task 2 to commit on w2", cluster.diagnostics)
    # Now the old run reaches its commit: refused as stale, handed back.
    hold.touch()
    wait_for(lambda: ledger.committed() == 2, 60, "task 1 to commit", cluster.diagnostics)
    # The old worker then finishes its warm shutdown and exits, like any
    # Celery worker (tests/celery/test_celery_shutdown.py compares the times).
    try:
        exit_code = first.wait(60)
    except subprocess.TimeoutExpired:
        # Every thread's stack into its log (faulthandler, see cnl_celery_app).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGUSR1)
        time.sleep(2)
        raise AssertionError(f"the old worker did not exit:\n{first.log()[-20000:]}") from None
    assert exit_code == 0

    assert ledger.rows("SELECT seq, main_pid FROM commits ORDER BY seq") == [
        (1, second.pid),
        (2, second.pid),
    ]
    assert ledger.rows("SELECT seq, main_pid, kind FROM refusals") == [(1, first.pid, "stale")]
    runs = ledger.rows("SELECT main_pid FROM attempts WHERE seq = 1 ORDER BY id")
    assert runs == [(first.pid,), (second.pid,)]
