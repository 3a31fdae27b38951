"""A Celery worker's ``/healthz`` and ``/readyz`` on its metrics port (what Kubernetes probes)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest
from cnl_celery_harness import Cluster, wait_for

from celery_nats_leader.testing import free_port

pytestmark = [pytest.mark.celery, pytest.mark.integration]


def get(port: int, path: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as answer:
            body = answer.read()
            return answer.status, json.loads(body) if path != "/metrics" else body.decode()
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())
    except OSError:
        return 0, None  # not listening yet


def test_worker_serves_health_and_readiness_beside_metrics(cluster_factory: Any) -> None:
    cluster: Cluster = cluster_factory(ttl=2.0)
    leader_port, follower_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    cluster.start_worker("w1", config={"metrics_port": leader_port})
    cluster.wait_leader()
    cluster.start_worker("w2", config={"metrics_port": follower_port})
    role = cluster.role

    def ready(port: int) -> dict[str, Any] | None:
        status, body = get(port, "/readyz")
        return body if status == 200 else None

    leader = wait_for(lambda: ready(leader_port), 30, "the leader ready")
    follower = wait_for(lambda: ready(follower_port), 30, "the follower ready")
    assert leader["checks"]["nats_connected"] is True
    assert leader["checks"]["roles"][role]["is_leader"] is True
    # A follower is ready too: readiness is about serving, not about leading.
    assert follower["checks"]["roles"][role] == {
        "started": True,
        "state": "follower",
        "is_leader": False,
        "error": None,
    }
    for port in (leader_port, follower_port):
        status, body = get(port, "/healthz")
        assert (status, body["status"], body["checks"]["election_loop"]) == (200, "ok", True)
        status, text = get(port, "/metrics")
        assert status == 200 and "nats_leader_is_leader" in text
