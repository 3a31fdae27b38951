"""The worker-side fence: a task sent under an ended beat term does not run (opt-in).

Tasks built on ``FencedBeatTask`` check the beat epoch in their message
against the beat role's current term (one KV read) before the body runs.
Three beat replicas dispatch such a task every second; after a failover,
messages carrying the old term's epoch are refused (also in the token header
of messages queued by older versions), messages carrying the current one run,
and messages without one (not beat dispatches) run.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
from cnl_beat_app import make_app
from cnl_beat_harness import BeatCluster, wait_for

from celery_nats_leader.beat import (
    ENTRY_HEADER,
    EPOCH_HEADER,
    ROLE_HEADER,
    TICK_HEADER,
    TOKEN_HEADER,
)
from celery_nats_leader.term.token import FencingToken

pytestmark = [pytest.mark.integration, pytest.mark.celery, pytest.mark.timeout(180)]

ENTRIES = [
    {"name": "fenced-every-second", "kind": "interval", "seconds": 1, "task": "cnl_beat.fenced"}
]


def test_stale_term_refused_current_and_unfenced_run(
    cluster_factory: Callable[..., BeatCluster], broker: Any
) -> None:
    cluster = cluster_factory(entries=ENTRIES)
    cluster.start_worker()
    for _ in range(3):
        cluster.start_beat()
    first = cluster.wait_leader()
    cluster.wait_runs_by(first.epoch, 2)
    cluster.kill_leader(first)
    second = cluster.wait_new_term(first.epoch)
    cluster.wait_runs_by(second.epoch, 2)

    client = make_app(cluster.config)
    try:
        legacy_stale = FencingToken(first.epoch, first.token).to_header()
        sent = {}
        for label, headers in {
            "stale": {EPOCH_HEADER: first.epoch, ROLE_HEADER: "beat"},
            "current": {EPOCH_HEADER: second.epoch, ROLE_HEADER: "beat"},
            "legacy-stale": {TOKEN_HEADER: legacy_stale, ROLE_HEADER: "beat"},
            "malformed": {EPOCH_HEADER: "not-an-epoch", ROLE_HEADER: "beat"},
            "unfenced": {},
        }.items():
            task_id = str(uuid.uuid4())
            marks = {ENTRY_HEADER: f"manual-{label}", TICK_HEADER: label}
            client.send_task(
                "cnl_beat.fenced",
                task_id=task_id,
                queue=cluster.queue,
                headers={**headers, **marks},
            )
            sent[label] = task_id
    finally:
        client.close()

    def settled() -> bool:
        ran = {r.task_id for r in cluster.ledger.runs("cnl_beat.fenced")}
        refused = {row[1] for row in cluster.ledger.refusals()}
        return all(task_id in ran | refused for task_id in sent.values())

    wait_for(settled, 30, "the worker to run or refuse every manual message", cluster.diagnostics)
    ran = {r.task_id for r in cluster.ledger.runs("cnl_beat.fenced")}
    refusals = {row[1]: row for row in cluster.ledger.refusals()}
    assert sent["current"] in ran and sent["unfenced"] in ran
    for label in ("stale", "legacy-stale"):
        assert sent[label] in refusals and sent[label] not in ran, label
        reason = refusals[sent[label]][5]
        assert f"dispatched under epoch {first.epoch}" in reason, reason
    assert sent["malformed"] in refusals and sent["malformed"] not in ran
    # Beat's own dispatches of the current term run.
    beat_runs = [r for r in cluster.ledger.runs("cnl_beat.fenced") if r.entry == ENTRIES[0]["name"]]
    assert any(r.epoch == second.epoch for r in beat_runs)
    # Every refusal is one of the manual messages or a tick of the killed
    # term that was still queued when the new term began (the documented
    # price of the fence): never a tick of the current term.
    for row in refusals.values():
        if row[2] == ENTRIES[0]["name"]:
            assert row[4] is not None and int(row[4]) == first.epoch


def test_a_fenced_message_waits_out_a_nats_outage_without_spending_retries(
    cluster_factory: Callable[..., BeatCluster], nats_server: Any
) -> None:
    # While NATS is unreachable the fence cannot read the term: the message
    # comes back every second, for as long as it takes. Celery's retry with
    # max_retries=None stopped at the task's own limit (3): about three
    # seconds into an outage the tick ended as FAILURE and never ran.
    cluster = cluster_factory(entries=[])
    worker = cluster.start_worker()
    client = make_app(cluster.config)
    task_id = str(uuid.uuid4())
    rechecks = 6  # twice Celery's default max_retries
    nats_server.stop()
    try:
        client.send_task(
            "cnl_beat.fenced",
            task_id=task_id,
            queue=cluster.queue,
            headers={
                EPOCH_HEADER: 1,
                ROLE_HEADER: "beat",
                ENTRY_HEADER: "manual",
                TICK_HEADER: "t",
            },
        )

        def waits() -> list[str]:
            return [
                line
                for line in worker.log_path.read_text(errors="replace").splitlines()
                if task_id in line
                and ("cannot check its beat epoch yet" in line or "MaxRetries" in line)
            ]

        wait_for(
            lambda: len(waits()) >= rechecks or any("MaxRetries" in line for line in waits()),
            60,
            f"{rechecks} rechecks of the fenced message while NATS is down",
            cluster.diagnostics,
        )
        assert not any("MaxRetries" in line for line in waits()), waits()
    finally:
        client.close()
        nats_server.start()

    wait_for(
        lambda: any(r.task_id == task_id for r in cluster.ledger.runs("cnl_beat.fenced")),
        60,
        "the fenced message to run once NATS is back",
        cluster.diagnostics,
    )
    log = worker.log_path.read_text(errors="replace")
    assert "MaxRetriesExceededError" not in log
    runs = [r for r in cluster.ledger.runs("cnl_beat.fenced") if r.task_id == task_id]
    assert len(runs) == 1
