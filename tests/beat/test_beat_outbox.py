"""No tick lost, none run twice: the active scheduler killed at every point of the dispatch.

Three real ``celery beat`` replicas, a real worker, a real nats-server. The
entries' task uses the once-guard (``OnceTask``). The active scheduler is
stopped at one point of a dispatch (a test hook, see
``cnl_beat_app.install_kill_points``) and SIGKILLed there; a new replica
replaces it; this is repeated for every point, twice:

* ``before_commit``: the token is confirmed, the tick not committed: the
  successor dispatches the tick;
* ``before_publish``: committed (pending), not sent: the successor finds the
  pending tick and sends it (the outbox);
* ``after_publish``: sent, the send not recorded: the successor sends it
  again under the same task id; the worker's once-guard runs it once;
* ``after_record``: sent and recorded: nothing to recover.

The ledger of executions by tick identity must show every committed tick
exactly once and no tick the schedule does not have.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cnl_beat_checks import check_exactly_once, check_gaps, check_terms
from cnl_beat_harness import FAILOVER, BeatCluster, Database, Proc, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.celery, pytest.mark.timeout(400)]

POINTS = ("before_commit", "before_publish", "after_publish", "after_record")
ROUNDS = 2


def _stopped(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # The state follows the parenthesized command name.
    return stat.rsplit(")", 1)[1].split()[0] == "T"


def kill_at_every_point(
    cluster: BeatCluster, rounds: int = ROUNDS, points: tuple[str, ...] = POINTS
) -> dict[str, int]:
    """Stop the active scheduler at each point in turn and SIGKILL it there.

    Returns:
        How many schedulers were killed at each point.

    """
    folder = Path(cluster.config["kill_points"])
    dead: list[Proc] = []
    killed = dict.fromkeys(points, 0)
    leader = cluster.wait_leader()
    cluster.wait_runs_by(leader.epoch, 1)
    for point in points * rounds:
        (folder / point).touch()

        def claimed(point: str = point) -> list[Path]:
            return sorted(folder.glob(f"{point}.*"))

        marker = wait_for(claimed, 30, f"a scheduler to reach {point}", cluster.diagnostics)[0]
        pid = int(marker.suffix[1:])
        wait_for(lambda pid=pid: _stopped(pid), 10, f"pid {pid} to stop at {point}")
        proc = cluster.beat_by_pid(pid)
        assert proc is not None, f"pid {pid} is not a beat replica"
        proc.signal(signal.SIGKILL)
        proc.wait(10)
        marker.unlink()
        dead.append(proc)
        killed[point] += 1
        leader = cluster.wait_leader(exclude=tuple(dead))
        cluster.wait_runs_by(leader.epoch, 1)
        # A replacement keeps three replicas. It starts once the failover is
        # over and is campaigning before the next kill, so that its start-up
        # (Celery, Django) does not compete with a failover for the CPU.
        spare = cluster.start_beat()
        wait_for(lambda spare=spare: "campaigns for role" in spare.log(), 60, f"{spare} to start")
    cluster.wait_runs_by(leader.epoch, 2)
    return killed


def _resends(cluster: BeatCluster) -> int:
    return sum(p.log().count("sending it again under the same task id") for p in cluster.beats)


def _acknowledged_duplicates(cluster: BeatCluster) -> int:
    return sum(w.log().count("already ran (on ") for w in cluster.workers)


def _check(cluster: BeatCluster, killed: dict[str, int], end_wall: float) -> None:
    # Nothing lost, even from the killed terms; nothing twice.
    verdicts = check_exactly_once(cluster, end_wall=end_wall)
    check_gaps(cluster, verdicts, FAILOVER)
    check_terms(cluster)
    for verdict in verdicts.values():
        assert not verdict.lost, verdict
    # Every kill between the commit and the record left a pending tick that
    # the successor sent again.
    assert _resends(cluster) >= killed["before_publish"] + killed["after_publish"]
    # A tick sent twice (killed after the publish) ran once: the second copy
    # was acknowledged by the once-guard without running.
    assert _acknowledged_duplicates(cluster) >= killed["after_publish"]


@pytest.mark.parametrize("broker", ["filesystem", "redis"], indirect=True)
def test_celery_scheduler_killed_at_every_point_of_the_dispatch(
    cluster_factory: Callable[..., BeatCluster], broker: Any, tmp_path: Path
) -> None:
    entries = [
        {"name": "every-second", "kind": "interval", "seconds": 1, "task": "cnl_beat.once"},
        {"name": "fast-cron", "kind": "fastcron", "task": "cnl_beat.once"},
    ]
    cluster = cluster_factory(entries=entries, extra={"once_lease": 2.0})
    (tmp_path / "kill-points").mkdir()
    cluster.config["kill_points"] = str(tmp_path / "kill-points")
    cluster.start_worker()
    for _ in range(3):
        cluster.start_beat()
    killed = kill_at_every_point(cluster)
    end_wall = time.time()
    cluster.drain()
    _check(cluster, killed, end_wall)


def test_database_scheduler_killed_at_every_point_of_the_dispatch(
    cluster_factory: Callable[..., BeatCluster], database: Database, broker: Any, tmp_path: Path
) -> None:
    entries = [
        {"name": "db-every-second", "kind": "interval", "seconds": 1, "task": "cnl_beat.once"},
    ]
    cluster = cluster_factory(
        entries=entries,
        scheduler="django_nats_leader",
        database=database,
        extra={"once_lease": 2.0},
    )
    (tmp_path / "kill-points").mkdir()
    cluster.config["kill_points"] = str(tmp_path / "kill-points")
    cluster.django_setup()
    cluster.start_worker()
    for _ in range(3):
        cluster.start_beat()
    killed = kill_at_every_point(cluster)
    end_wall = time.time()
    cluster.drain()
    _check(cluster, killed, end_wall)
