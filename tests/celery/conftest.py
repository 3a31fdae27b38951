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
from cnl_celery_harness import Cluster

from celery_nats_leader.testing import NatsServer
from tests.support.brokers import Broker, make_broker


@pytest.fixture
def broker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Broker]:
    spec = make_broker(
        getattr(request, "param", "filesystem"),
        tmp_path,
        key_prefix=f"cnl-{uuid.uuid4().hex[:10]}:",
        # Redelivery of a crashed worker's unacknowledged messages: after the
        # visibility timeout, swept every second. A worker SIGKILLed inside
        # its sweep leaves the sweep's lock held until it expires (kombu's
        # default: 300 s, longer than any test waits): 2 s here.
        redis_options={
            "visibility_timeout": 6,
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
            "unacked_mutex_expire": 2,
        },
    )
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
