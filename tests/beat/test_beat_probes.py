"""A beat's ``/healthz`` and ``/readyz`` beside its ``/metrics``.

Two real standalone beat replicas, each with its own
``nats_leader_metrics_port``: both are live and ready (readiness is not
leadership), the leader's metrics say it leads; while the nats-server is
down neither is ready, yet both stay live (a restart would not help); once
the server is back both are ready again.

A real ``celery worker -B`` with ``nats_leader_beat_metrics_port``: its beat
child serves the beat role's probes and tick counters on that port, the
worker its own roles on ``nats_leader_metrics_port``; the liveness command
of docs/operating.md passes on both, and fails once the beat child is gone.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cnl_beat_harness import CELERY, HERE, BeatCluster, wait_for
from prometheus_client.parser import text_string_to_metric_families

from celery_nats_leader.testing import free_port
from tests.support import REPO
from tests.support.http_probe import get
from tests.support.procs import Proc

pytestmark = [pytest.mark.integration, pytest.mark.celery, pytest.mark.timeout(180)]


def start_beat(cluster: BeatCluster, tmp_path: Path, name: str, port: int) -> Proc:
    """A beat replica of the cluster's app with a metrics port of its own."""
    config = dict(cluster.config, extra={**cluster.config["extra"], "metrics_port": port})
    proc = Proc(
        name,
        [CELERY, "-A", "cnl_beat_app", "beat", "-S", "nats_leader",
         "-s", str(tmp_path / f"schedule-{name}"), "-l", "INFO"],
        env=dict(cluster.env, CNL_BEAT_CONFIG=json.dumps(config)),
        log_path=tmp_path / f"{name}.log",
        cwd=HERE,
    )  # fmt: skip
    cluster.beats.append(proc)  # stopped (and its log shown) by the harness
    return proc


def test_standalone_beat_serves_health_and_readiness(
    cluster_factory: Callable[..., BeatCluster], tmp_path: Path
) -> None:
    cluster = cluster_factory(entries=[{"kind": "interval", "name": "every-second", "seconds": 1}])
    ports = {"a": free_port("127.0.0.1"), "b": free_port("127.0.0.1")}
    procs = {name: start_beat(cluster, tmp_path, name, port) for name, port in ports.items()}
    record = cluster.wait_leader()
    leader = next(n for n, p in procs.items() if p.pid == int(record.meta["pid"]))

    def states(status: int) -> dict[str, Any] | None:
        found = {}
        for name, port in ports.items():
            code, body = get(port, "/readyz")
            if code != status:
                return None
            found[name] = body["checks"]
        return found

    ready = wait_for(lambda: states(200), 30, "both replicas ready", cluster.diagnostics)
    for name, checks in ready.items():
        assert checks["nats_connected"] is True
        assert checks["roles"]["beat"]["started"] is True
        assert checks["roles"]["beat"]["is_leader"] is (name == leader)
    for port in ports.values():
        code, body = get(port, "/healthz")
        assert (code, body["checks"]["election_loop"]) == (200, True)
        metrics = get(port, "/metrics")[1]
        assert 'nats_leader_is_leader{bucket="leaders",instance_id=' in metrics
        # What the shipped alerts read (no leader, disconnected) covers beat too.
        assert 'nats_leader_has_leader{bucket="leaders",instance_id=' in metrics
        assert "nats_leader_connected{instance_id=" in metrics
    assert "nats_leader_beat_ticks_total" in get(ports[leader], "/metrics")[1]

    # NATS down: not ready (an orchestrator stops routing to them), still live.
    cluster.nats.stop()
    down = wait_for(lambda: states(503), 30, "both replicas not ready", cluster.diagnostics)
    assert {name: checks["nats_connected"] for name, checks in down.items()} == {
        "a": False,
        "b": False,
    }
    for port in ports.values():
        assert get(port, "/healthz")[0] == 200
    cluster.nats.start()
    wait_for(lambda: states(200), 60, "both replicas ready again", cluster.diagnostics)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A Prometheus text page as ``{(name, sorted labels): value}``."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def liveness_command(ports: tuple[int, int]) -> str:
    """The ``exec`` liveness probe of docs/operating.md, on this test's two ports."""
    page = (REPO / "docs" / "operating.md").read_text()
    (code,) = re.findall(r'- "(import urllib\.request as u;.*)"', page)
    assert "(9808, 9809)" in code
    return code.replace("(9808, 9809)", repr(ports))


def test_embedded_beat_serves_its_probes_and_metrics_on_its_own_port(
    cluster_factory: Callable[..., BeatCluster],
) -> None:
    cluster = cluster_factory(
        entries=[{"kind": "interval", "name": "every-second", "seconds": 1}],
        extra={"once_lease": 2.0},
    )
    cluster.config["bootstep"] = True  # the worker campaigns for "default" and serves its port
    cluster.start_worker()  # executes the ticks (no port of its own)
    worker_port, beat_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    host = cluster.start_embedded(
        extra={"metrics_port": worker_port, "beat_metrics_port": beat_port}
    )
    record = cluster.wait_leader(timeout=60)
    beat_pid = int(record.meta["pid"])
    assert cluster.beat_by_pid(beat_pid) is host and beat_pid != host.pid
    cluster.wait_runs_by(record.epoch, 3)

    def ready(port: int) -> dict[str, Any] | None:
        code, body = get(port, "/readyz")
        return body["checks"] if code == 200 else None

    beat = wait_for(lambda: ready(beat_port), 30, "the beat port ready", cluster.diagnostics)
    assert beat == {
        "nats_connected": True,
        "roles": {"beat": {"error": None, "is_leader": True, "started": True, "state": "leader"}},
    }
    worker = wait_for(lambda: ready(worker_port), 30, "the worker port ready", cluster.diagnostics)
    assert sorted(worker["roles"]) == ["default"]  # the beat role is not the worker's
    for port in (worker_port, beat_port):
        code, body = get(port, "/healthz")
        assert (code, body["status"], body["checks"]["election_loop"]) == (200, "ok", True)

    # The beat's metrics: it leads, under the leader record's id, and counts
    # the ticks it dispatched (at least the three the worker already ran).
    beat_metrics = samples(get(beat_port, "/metrics")[1])
    labels = (("bucket", "leaders"), ("instance_id", record.id), ("role", "beat"))
    assert beat_metrics[("nats_leader_is_leader", labels)] == 1.0
    assert beat_metrics[("nats_leader_has_leader", labels)] == 1.0
    assert beat_metrics[("nats_leader_ttl_seconds", labels)] == cluster.ttl
    assert beat_metrics[("nats_leader_connected", (("instance_id", record.id),))] == 1.0

    def ticks(outcome: str) -> float:
        page = samples(get(beat_port, "/metrics")[1])
        key = (("entry", "every-second"), ("instance_id", record.id), ("outcome", outcome))
        return page.get(("nats_leader_beat_ticks_total", (*key, ("role", "beat"))), 0.0)

    executed = len([r for r in cluster.runs("every-second") if r.epoch == record.epoch])
    assert ticks("dispatched") >= executed >= 3
    assert (ticks("lost"), ticks("send_failed")) == (0.0, 0.0)
    # The worker's metrics: its own role under its own instance_id, no beat series.
    worker_metrics = samples(get(worker_port, "/metrics")[1])
    connected = [dict(k[1]) for k in worker_metrics if k[0] == "nats_leader_connected"]
    worker_ids = {labels["instance_id"] for labels in connected}
    assert len(worker_ids) == 1 and record.id not in worker_ids
    assert not [k for k in worker_metrics if k[0].startswith("nats_leader_beat_ticks")]
    assert not [k for k in worker_metrics if ("role", "beat") in k[1]]

    # The documented liveness command passes while both answer...
    command = [sys.executable, "-c", liveness_command((worker_port, beat_port))]
    assert subprocess.run(command, capture_output=True, timeout=30, check=False).returncode == 0
    # ... and fails once the beat child is gone, while the worker's own
    # /healthz still says 200 (the worker does not watch its beat).
    os.kill(beat_pid, signal.SIGKILL)
    wait_for(lambda: get(beat_port, "/healthz")[0] == 0, 30, "the beat port closed")
    assert get(worker_port, "/healthz")[0] == 200
    failed = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    assert failed.returncode == 1
    assert "Connection refused" in failed.stderr
