"""A Celery worker's ``/healthz`` and ``/readyz`` on its metrics port (what Kubernetes probes)."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest
from cnl_celery_harness import Cluster, wait_for

from celery_nats_leader.config.connection import ConnectOptions
from celery_nats_leader.nats.connection import connect
from celery_nats_leader.nats.jetstream import JetStreamBackend
from celery_nats_leader.ops.fence_leader import fence_leader
from celery_nats_leader.testing import free_port
from tests.support.http_probe import get

pytestmark = [pytest.mark.celery, pytest.mark.integration]


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

    # The metrics an alert rule needs, labelled with the bucket.
    bucket = cluster.config["bucket"]
    for port, leading in ((leader_port, 1.0), (follower_port, 0.0)):
        text = get(port, "/metrics")[1]
        assert sample(text, "nats_leader_is_leader", bucket=bucket, role=role) == leading
        assert sample(text, "nats_leader_has_leader", bucket=bucket, role=role) == 1.0
        assert sample(text, "nats_leader_leaderless_seconds", bucket=bucket, role=role) == 0.0
        assert sample(text, "nats_leader_ttl_seconds", bucket=bucket, role=role) == 2.0
        assert sample(text, "nats_leader_connected") == 1.0

    # An operator fences the leader: a failure of kind "fenced", on the leader only.
    async def fence() -> None:
        nc = await connect(ConnectOptions.build(cluster.config["nats_url"]), timeout=5)
        try:
            # Fenced at once: a live leader asked first would hand over instead.
            await fence_leader(
                JetStreamBackend(nc), bucket, role, requester="test", handover_wait=0
            )
        finally:
            await nc.close()

    asyncio.run(fence())

    def fenced_count() -> float | None:
        text = get(leader_port, "/metrics")[1]
        return sample(text, "nats_leader_failures_total", role=role, kind="fenced")

    assert wait_for(fenced_count, 30, "the fenced failure counted") == 1.0
    follower_text = get(follower_port, "/metrics")[1]
    assert sample(follower_text, "nats_leader_failures_total", role=role, kind="fenced") is None


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of the first sample of ``name`` whose labels include ``labels``."""
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
        if all(found.get(key) == value for key, value in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_worker_metrics_take_the_configured_namespace_and_instance_id(
    cluster_factory: Any,
) -> None:
    # nats_leader_metrics_namespace names every metric; the replica is the
    # label instance_id (Prometheus keeps "instance" for the target).
    cluster: Cluster = cluster_factory(ttl=2.0)
    port = free_port("127.0.0.1")
    extra = {**cluster.config.get("extra", {}), "metrics_namespace": "billing_leader"}
    cluster.start_worker("w1", config={"metrics_port": port, "extra": extra})
    cluster.wait_leader()
    bucket, role = cluster.config["bucket"], cluster.role

    def leading() -> str | None:
        status, text = get(port, "/metrics")
        if status != 200 or sample(text, "billing_leader_is_leader", role=role) != 1.0:
            return None
        return str(text)

    text = wait_for(leading, 30, "the leader's metrics")
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    names = {line.split("{")[0].split(" ")[0] for line in samples}
    assert names and all(name.startswith("billing_leader_") for name in names), names
    assert sample(text, "billing_leader_ttl_seconds", bucket=bucket, role=role) == 2.0
    assert re.search(r'billing_leader_is_leader\{[^}]*instance_id="[^"]+"', text)
    assert "instance=" not in text
