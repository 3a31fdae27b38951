"""A standalone ``celery beat``'s ``/healthz`` and ``/readyz`` beside its ``/metrics``.

Two real beat replicas, each with its own ``nats_leader_metrics_port``: both
are live and ready (readiness is not leadership), the leader's metrics say
it leads; while the nats-server is down neither is ready, yet both stay
live (a restart would not help); once the server is back both are ready
again.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cnl_beat_harness import CELERY, HERE, BeatCluster, wait_for

from celery_nats_leader.testing import free_port
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
