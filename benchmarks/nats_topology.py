"""What the benchmarks run on: one nats-server or a 3-node cluster, and a fresh bucket.

The cluster's members start from ``deploy/nats/cluster.conf``, as the
manifests run them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import nats
from nats.js.api import KeyValueConfig

from celery_nats_leader.testing import NatsCluster, NatsServer

CLUSTER_CONF = Path(__file__).resolve().parent.parent / "deploy" / "nats" / "cluster.conf"


@contextlib.contextmanager
def topology(kind: str, binary: str) -> Iterator[tuple[list[NatsServer], int]]:
    """``single``: one server (R1 buckets); ``cluster``: three members (R3); and the replicas."""
    if kind == "single":
        with NatsServer(binary=binary) as server:
            yield [server], 1
    else:
        with NatsCluster(3, binary=binary, config_file=CLUSTER_CONF) as cluster:
            yield cluster.servers, 3


async def fresh_bucket(urls: list[str], name: str, ttl: float, replicas: int = 1) -> None:
    """(Re)create bucket ``name`` empty, with ``max_age = ttl``."""
    nc = await nats.connect(servers=urls)
    try:
        js = nc.jetstream()
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await js.delete_key_value(name)
        await js.create_key_value(
            KeyValueConfig(bucket=name, history=1, ttl=ttl, replicas=replicas)
        )
    finally:
        await nc.close()
