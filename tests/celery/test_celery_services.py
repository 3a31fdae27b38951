"""Leader services in real Celery workers: one copy at a time, restarted on the new leader.

Every worker of the cluster registers the same leader service (see
``cnl_celery_app.recorder``): while it runs it writes an "alive" sample every
20 ms to a file of its worker, its clock read *before* it checks that its term
still holds. Across a SIGKILL, a SIGSTOP past the TTL, a SIGTERM and an
operator's resign, the test asserts what a user would see:

* never two copies at the same instant on live, unpaused workers (the run
  intervals of different workers do not overlap);
* after each failure the service runs again on the new leader, within the
  failover time (TTL bound for a crash or a pause, much less for a graceful
  hand-over);
* the paused leader's copy, once resumed, stops at once (its term is over).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cnl_celery_harness import Cluster, run_cli, wait_for

pytestmark = [pytest.mark.celery, pytest.mark.integration]

TTL = 2.0


@dataclass(frozen=True)
class Run:
    """One run of the service: its worker, term and alive interval."""

    pid: int
    epoch: int
    first: float
    last: float
    stop_reason: str | None


def read_runs(service_dir: Path) -> list[Run]:
    runs: dict[tuple[int, int], dict[str, Any]] = {}
    for path in service_dir.glob("*.txt"):
        pid = int(path.stem)
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) < 3:
                continue  # a line being written
            kind, epoch, at = parts[0], int(parts[1]), float(parts[2])
            run = runs.setdefault((pid, epoch), {"first": None, "last": None, "stop": None})
            if kind == "alive":
                run["first"] = at if run["first"] is None else run["first"]
                run["last"] = at
            elif kind == "stop" and len(parts) == 4:
                run["stop"] = parts[3]
    return sorted(
        (
            Run(pid, epoch, run["first"], run["last"], run["stop"])
            for (pid, epoch), run in runs.items()
            if run["first"] is not None
        ),
        key=lambda run: run.first,
    )


def assert_one_at_a_time(runs: list[Run]) -> None:
    for i, run in enumerate(runs):
        for other in runs[i + 1 :]:
            if other.pid != run.pid:
                assert run.last < other.first or other.last < run.first, (
                    f"two copies at once: {run} and {other}"
                )


def newest_run(service_dir: Path, *, not_pids: set[int], after: float) -> Run | None:
    fresh = [run for run in read_runs(service_dir) if run.pid not in not_pids and run.first > after]
    return fresh[-1] if fresh else None


def test_leader_service_runs_once_across_kill_pause_stop_and_resign(
    cluster_factory: Any, tmp_path: Path
) -> None:
    service_dir = tmp_path / "service"
    service_dir.mkdir()
    cluster: Cluster = cluster_factory(ttl=TTL, service_dir=str(service_dir))
    workers = [
        cluster.start_worker(f"w{i}", pool="threads", concurrency=1, wait=False) for i in (1, 2, 3)
    ]
    for worker in workers:
        cluster.wait_ready(worker)
    gaps: dict[str, float] = {}

    handovers: dict[str, tuple[Run, Run]] = {}

    def next_leader_run(event: str, old: Run, exclude: set[int], since: float) -> Run:
        run = wait_for(
            lambda: newest_run(service_dir, not_pids=exclude, after=since),
            30,
            f"the service on a new leader after {event}",
            cluster.diagnostics,
        )
        handovers[event] = (old, run)
        return run

    first = wait_for(lambda: newest_run(service_dir, not_pids=set(), after=0), 30, "the first run")
    leader = cluster.by_pid(first.pid)

    # 1. The leader crashes.
    leader.kill()
    crashed_at = time.monotonic()
    second = next_leader_run("SIGKILL", first, {leader.pid}, first.last)
    assert second.first > crashed_at  # not a leftover sample of the crashed one
    spare = cluster.start_worker("w4", pool="threads", concurrency=1)

    # 2. The new leader is paused (SIGSTOP, the whole process group) past the TTL.
    paused = cluster.by_pid(second.pid)
    os.killpg(paused.pid, signal.SIGSTOP)
    try:
        third = next_leader_run("SIGSTOP", second, {paused.pid}, second.last)
        time.sleep(0.5)  # keep it paused a while into the successor's term
    finally:
        os.killpg(paused.pid, signal.SIGCONT)
    wait_for(
        lambda: any(
            run.pid == paused.pid and run.epoch == second.epoch and run.stop_reason
            for run in read_runs(service_dir)
        ),
        30,
        "the resumed ex-leader's service to stop",
        cluster.diagnostics,
    )

    # 3. The leader is stopped gracefully (Celery's warm shutdown).
    stopped = cluster.by_pid(third.pid)
    stopped.terminate()
    fourth = next_leader_run("SIGTERM", third, {stopped.pid}, third.last)
    assert stopped.wait(30) == 0

    # 4. An operator asks the leader to step down.
    result = run_cli(cluster, "resign", cluster.role)
    assert result.returncode == 0, result.stdout + result.stderr
    fifth = next_leader_run("resign", fourth, {fourth.pid}, fourth.last)

    runs = read_runs(service_dir)
    assert_one_at_a_time(runs)
    by_term = {(run.pid, run.epoch): run for run in runs}
    print("\nleader service hand-over gaps (last sample of the old run -> first of the new):")
    for event, (old, new) in handovers.items():
        gaps[event] = new.first - by_term[(old.pid, old.epoch)].last
        print(f"  {event:8s} {gaps[event] * 1000:8.1f} ms")
    # The paused leader's run ended with its term, without a sample after its pause.
    resumed = by_term[(paused.pid, second.epoch)]
    assert resumed.last < third.first
    assert resumed.stop_reason in ("lease_expired", "revision_changed", "key_deleted")
    assert by_term[(third.pid, third.epoch)].stop_reason == "stopped"
    assert by_term[(fourth.pid, fourth.epoch)].stop_reason == "resigned"
    # Within the failover time: a crash or a pause costs at most about a TTL
    # (the follower waits one TTL past the last renewal it saw); a graceful
    # hand-over does not wait for any expiry.
    assert gaps["SIGKILL"] < 2 * TTL and gaps["SIGSTOP"] < 2 * TTL, gaps
    assert gaps["SIGTERM"] < TTL / 2 and gaps["resign"] < TTL / 2, gaps
    assert fifth.epoch > fourth.epoch > third.epoch > second.epoch > first.epoch
    assert {w.pid for w in (spare, *workers)} >= {fifth.pid}
