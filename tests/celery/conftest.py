"""Fixtures of the Celery integration tests (the harness is in ``cnl_celery_harness``).

Every test gets its own ``nats-server`` (never the system one), its own KV
bucket, queue names and ledger. There is no ``__init__.py`` here on purpose:
this directory is called ``celery`` and must never become importable as a
package; helper modules are imported by their own unique names, and worker
subprocesses find them through ``PYTHONPATH``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cnl_celery_harness import AMQP_URL, REDIS_URL, Broker, Cluster

from celery_nats_leader.testing import NatsServer
from celery_nats_leader.testing.services import require_service


@pytest.fixture
def broker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Broker]:
    kind = getattr(request, "param", "filesystem")
    token = uuid.uuid4().hex[:10]
    if kind == "filesystem":
        data, processed, control = (
            tmp_path / "fs-data",
            tmp_path / "fs-processed",
            tmp_path / "fs-control",
        )
        for path in (data, processed, control):
            path.mkdir()
        spec = Broker(
            kind,
            "atomicfs://",  # kombu's filesystem transport, written atomically
            {
                "data_folder_in": str(data),
                "data_folder_out": str(data),
                "processed_folder": str(processed),
                "store_processed": True,
                "control_folder": str(control),
                "polling_interval": 0.05,
            },
            data_dir=data,
        )
    elif kind == "redis":
        require_service("redis broker", REDIS_URL)
        prefix = f"cnl-{token}:"
        spec = Broker(
            kind,
            REDIS_URL,
            {
                # Keys of this test only, in a Redis other tests may share.
                "global_keyprefix": prefix,
                # Redelivery of a crashed worker's unacknowledged messages:
                # after the visibility timeout, swept every second.
                "visibility_timeout": 6,
                "unacked_restore_interval": 1,
                "unacked_restore_throttle": 1,
            },
            prefix=prefix,
        )
    elif kind == "amqp":
        require_service("amqp broker", AMQP_URL)
        spec = Broker(kind, AMQP_URL, {})
    else:  # pragma: no cover
        raise ValueError(kind)
    try:
        yield spec
    finally:
        spec.cleanup()


@pytest.fixture
def nats_server() -> Iterator[NatsServer]:
    with NatsServer() as server:
        yield server


@pytest.fixture
def cluster_factory(
    tmp_path: Path, nats_server: NatsServer, broker: Broker
) -> Iterator[Callable[..., Cluster]]:
    clusters: list[Cluster] = []

    def make(**kwargs: Any) -> Cluster:
        cluster = Cluster(tmp_path, nats_server, broker, **kwargs)
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        cluster.close()
