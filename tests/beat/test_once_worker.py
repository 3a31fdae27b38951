"""The once-guard on real Celery workers and a real nats-server.

Duplicated messages (the same task id several times, as a re-sent beat tick
or a producer's retry make them) run once with ``OnceTask`` and every time
without it; a run whose worker process is SIGKILLed midway runs again once
(``acks_late`` redelivery), while a duplicate sent during the first run does
not run at all. Each test runs Celery's own behaviour (the same task without
the guard) beside ours.
"""

from __future__ import annotations

import collections
import os
import signal
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cnl_beat_app import make_app
from cnl_beat_harness import BeatCluster, wait_for

from celery_nats_leader.core.constants import ONCE_HEADER, TICK_HEADER

pytestmark = [pytest.mark.integration, pytest.mark.celery, pytest.mark.timeout(180)]

LEASE = 2.0
EXTRA = {"once_lease": LEASE, "once_retention": 600.0}


def _already_ran(cluster: BeatCluster) -> int:
    return sum(w.log().count("already ran (on ") for w in cluster.workers)


@pytest.mark.parametrize("broker", ["filesystem", "redis"], indirect=True)
def test_duplicates_run_once_with_the_guard_and_every_time_without(
    cluster_factory: Callable[..., BeatCluster], broker: Any
) -> None:
    cluster = cluster_factory(entries=[], extra=EXTRA)
    app = make_app(cluster.config)
    ids = [str(uuid.uuid4()) for _ in range(20)]
    copies = 3
    for _ in range(copies):
        for task_id in ids:
            app.send_task("cnl_beat.once", task_id=task_id, queue=cluster.queue)
            app.send_task("cnl_beat.plain", task_id=task_id, queue=cluster.queue)
    # Two workers of four threads each compete for the copies.
    cluster.start_worker(pool="threads", concurrency=4)
    cluster.start_worker(pool="threads", concurrency=4)

    duplicates = len(ids) * (copies - 1)
    wait_for(
        lambda: (
            len(cluster.ledger.runs("cnl_beat.plain")) == len(ids) * copies
            and _already_ran(cluster) == duplicates
        ),
        90,
        f"{len(ids) * copies} plain runs and {duplicates} duplicates acknowledged",
        cluster.diagnostics,
    )
    guarded = collections.Counter(r.task_id for r in cluster.ledger.runs("cnl_beat.once"))
    plain = collections.Counter(r.task_id for r in cluster.ledger.runs("cnl_beat.plain"))
    # Celery runs every copy; the guard runs each id once.
    assert plain == dict.fromkeys(ids, copies)
    assert guarded == dict.fromkeys(ids, 1)


@pytest.mark.parametrize("broker", ["redis"], indirect=True)
def test_a_run_killed_midway_runs_again_and_its_duplicate_never(
    cluster_factory: Callable[..., BeatCluster], broker: Any, tmp_path: Path
) -> None:
    cluster = cluster_factory(entries=[], extra=EXTRA)
    app = make_app(cluster.config)
    worker = cluster.start_worker(pool="prefork", concurrency=3)
    results: dict[str, tuple[int, int]] = {}
    for task in ("once_hold", "plain_hold"):
        hold = tmp_path / f"{task}.hold"
        hold.touch()
        task_id = str(uuid.uuid4())
        app.send_task(f"cnl_beat.{task}", args=[str(hold)], task_id=task_id, queue=cluster.queue)

        def starts(task: str = task) -> list[Any]:
            return cluster.ledger.runs(f"{task}:start")

        wait_for(lambda: len(starts()) == 1, 60, f"{task} to start", cluster.diagnostics)
        # A duplicate arrives while the first run is in its body.
        app.send_task(f"cnl_beat.{task}", args=[str(hold)], task_id=task_id, queue=cluster.queue)
        if task == "plain_hold":
            wait_for(lambda: len(starts()) == 2, 60, "the duplicate to start", cluster.diagnostics)
        else:
            wait_for(
                lambda: "running on " in worker.log(),
                60,
                "the duplicate to be told the id is running",
                cluster.diagnostics,
            )
        # The pool process running the first run dies (the worker lives on).
        os.kill(starts()[0].pid, signal.SIGKILL)
        hold.unlink()

        def ends(task: str = task) -> list[Any]:
            return cluster.ledger.runs(f"{task}:end")

        if task == "plain_hold":
            # Celery: the duplicate finishes, the redelivered first run too.
            wait_for(lambda: len(ends()) == 2, 60, "plain runs to end", cluster.diagnostics)
        else:
            # Redelivered (acks_late), it waits out the dead run's lease, then
            # runs; the duplicate's retry finds it done.
            wait_for(
                lambda: len(ends()) == 1 and _already_ran(cluster) == 1,
                60,
                "the guarded run to end and its duplicate to be acknowledged",
                cluster.diagnostics,
            )
        results[task] = (len(starts()), len(ends()))
    assert results["plain_hold"] == (3, 2)  # Celery's acks_late: the body ran twice to the end
    assert results["once_hold"] == (2, 1)  # ours: interrupted once, then run once to the end


def test_a_body_that_hands_its_message_on_lets_the_copy_run(
    cluster_factory: Callable[..., BeatCluster], broker: Any
) -> None:
    # A guarded body that sends its message on under the same id and raises
    # Ignore (a follower forwarding to the leader queue, Task.replace) did not
    # finish a run: the claim is released and the copy runs, once.
    cluster = cluster_factory(entries=[], extra=EXTRA)
    app = make_app(cluster.config)
    ids = [str(uuid.uuid4()) for _ in range(3)]
    for task_id in ids:
        app.send_task("cnl_beat.once_forward", task_id=task_id, queue=cluster.queue)
    cluster.start_worker(pool="threads", concurrency=4)
    wait_for(
        lambda: len(cluster.ledger.runs("once_forward:ran")) == len(ids),
        60,
        "every handed-on copy to run",
        cluster.diagnostics,
    )
    ledger = cluster.ledger
    handed_on = collections.Counter(r.task_id for r in ledger.runs("once_forward:handed-on"))
    ran = collections.Counter(r.task_id for r in ledger.runs("once_forward:ran"))
    assert handed_on == dict.fromkeys(ids, 1) and ran == dict.fromkeys(ids, 1)


def test_a_tick_whose_body_replaces_itself_or_raises_ignore_runs_once(
    cluster_factory: Callable[..., BeatCluster], broker: Any
) -> None:
    # Celery's Task.replace sends the replacement under the tick's id and
    # raises Ignore; a body may also store its own state and raise Ignore.
    # Both finished the run: a re-sent copy of the tick (the outbox sends
    # twice) is not run again, and the replacement (an OnceTask) runs once.
    cluster = cluster_factory(entries=[], extra=EXTRA)
    cluster.config["bootstep"] = True  # runs our ticks (the once header) once
    app = make_app(cluster.config)
    ids = {name: [str(uuid.uuid4()) for _ in range(4)] for name in ("replace", "ignore")}
    tick = {ONCE_HEADER: True, TICK_HEADER: "manual"}
    for _ in range(2):
        for task_id in ids["replace"]:
            app.send_task(
                "cnl_beat.tick_replace",
                kwargs={"queue": cluster.queue},
                task_id=task_id,
                queue=cluster.queue,
                headers=tick,
            )
        for task_id in ids["ignore"]:
            app.send_task(
                "cnl_beat.tick_ignore", task_id=task_id, queue=cluster.queue, headers=tick
            )
    cluster.start_worker(pool="threads", concurrency=4)
    ledger = cluster.ledger

    def dropped(name: str) -> int:
        # Copies acknowledged as already run (the guard logs them at INFO).
        return sum(
            f"cnl_beat.{name}[" in line and "already ran (on " in line
            for w in cluster.workers
            for line in w.log().splitlines()
        )

    def settled() -> bool:
        # Each copy either ran its body or was dropped as already run, and
        # every replacement sent ran.
        replace_runs = len(ledger.runs("cnl_beat.tick_replace"))
        return (
            replace_runs + dropped("tick_replace") == 2 * len(ids["replace"])
            and len(ledger.runs("cnl_beat.tick_ignore")) + dropped("tick_ignore")
            == 2 * len(ids["ignore"])
            and len(ledger.runs("cnl_beat.once")) + dropped("once") >= replace_runs
        )

    wait_for(settled, 90, "every copy of the ticks settled", cluster.diagnostics)
    bodies = collections.Counter(r.task_id for r in ledger.runs("cnl_beat.tick_replace"))
    replacements = collections.Counter(r.task_id for r in ledger.runs("cnl_beat.once"))
    ignored = collections.Counter(r.task_id for r in ledger.runs("cnl_beat.tick_ignore"))
    assert bodies == dict.fromkeys(ids["replace"], 1)
    assert replacements == dict.fromkeys(ids["replace"], 1)
    assert ignored == dict.fromkeys(ids["ignore"], 1)
    assert (dropped("tick_replace"), dropped("tick_ignore")) == (4, 4)
