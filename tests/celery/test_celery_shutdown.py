"""A worker exits within Celery's own shutdown time, whatever state its election is in.

Celery's warm shutdown waits for running tasks and then stops the pool; this
library must add nothing that can make it hang: not its bootstep, its threads
(the election's event loop, the leader services, the Redis wake-up), nor the
requeue of a leader-only task refused as stale.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import threading
import time
import urllib.request
from typing import Any

import pytest
from cnl_celery_harness import Cluster, wait_for

from celery_nats_leader.core.constants import DEFAULT_DEMOTE_TIMEOUT_SECONDS
from celery_nats_leader.testing import free_port
from tests.support.procs import Proc

pytestmark = [pytest.mark.celery, pytest.mark.integration]

#: Slack over plain Celery's own exit time: what our bootstep's stop may add
#: (it takes milliseconds) plus scheduling noise on a loaded machine.
SLACK = 2.0


def exit_times(*workers: Proc, timeout: float = 60.0) -> list[float]:
    """SIGTERM the workers at once; seconds until each exited (with code 0)."""
    started = time.monotonic()
    times: dict[int, float] = {}

    def wait(worker: Proc) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.wait(timeout)
            times[worker.pid] = time.monotonic() - started

    waiters = [threading.Thread(target=wait, args=(w,)) for w in workers]
    for worker in workers:
        worker.terminate()
    for waiter in waiters:
        waiter.start()
    for waiter in waiters:
        waiter.join()
    for worker in workers:
        assert worker.pid in times, f"{worker} did not exit:\n{worker.log()[-5000:]}"
        assert worker.proc.returncode == 0, worker.log()[-3000:]
    return [times[w.pid] for w in workers]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


@pytest.mark.parametrize("pool", ["prefork", "threads", "solo"])
def test_worker_with_a_missing_bucket_exits_on_sigterm(cluster_factory: Any, pool: str) -> None:
    cluster: Cluster = cluster_factory(ttl=2.0, create_bucket=False)
    port = free_port("127.0.0.1")
    worker = cluster.start_worker("w1", pool=pool, config={"metrics_port": port})
    wait_for(lambda: "does not exist" in worker.log(), 30, "the missing-bucket error")
    # Said in one line (no chained tracebacks), and visible to monitoring.
    assert (
        "leader election is not running (1 failed attempt): BucketNotFoundError: KV bucket"
        in worker.log()
    )
    assert "Traceback" not in worker.log()
    wait_for(
        lambda: re.search(
            r'nats_leader_election_error\{[^}]*role="jobs"[^}]*\} 1\.0', scrape(port)
        ),
        30,
        "the election-error metric",
    )
    cluster.send("cnl.plain", 1)
    wait_for(
        lambda: cluster.ledger.count("SELECT COUNT(*) FROM events WHERE kind = 'plain'") == 1,
        30,
        "an ordinary task to run without an election",
    )
    # Celery's own shutdown time, measured beside ours: a plain worker.
    plain = cluster.start_worker("plain", pool=pool, config={"without_leader": True})
    ours, theirs = exit_times(worker, plain)
    print(f"\n{pool}: exited {ours:.2f} s after SIGTERM (plain Celery: {theirs:.2f} s)")
    assert ours <= theirs + SLACK


def test_a_demote_receiver_that_never_returns_does_not_hold_the_shutdown(
    cluster_factory: Any,
) -> None:
    cluster: Cluster = cluster_factory(ttl=2.0)
    worker = cluster.start_worker("w1", pool="threads", config={"hang_on_demote": True})
    cluster.wait_leader()
    plain = cluster.start_worker("plain", pool="threads", config={"without_leader": True})
    ours, theirs = exit_times(worker, plain)
    print(f"\nstuck leader_demoted receiver: exited {ours:.2f} s (plain Celery: {theirs:.2f} s)")
    # The release waits for the receiver at most demote_timeout (5 s by
    # default), then leaves the term to lapse; the stop's own bound
    # (demote_timeout + request_timeout + 1 s) is never reached.
    assert ours <= theirs + DEFAULT_DEMOTE_TIMEOUT_SECONDS + SLACK
    assert (
        "demote callbacks still running after 5.0s (demote_timeout); not releasing the term"
        in worker.log()
    )
    assert "leader election did not stop within" not in worker.log()
