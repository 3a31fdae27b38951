"""Operator operations on buckets (celery_nats_leader.ops.bucket) on a real server.

The same steps run on the in-memory double, so it keeps telling the truth
about what the operator tools see.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from celery_nats_leader.backend import Backend
from celery_nats_leader.errors import BucketNotFoundError, JetStreamUnavailableError
from celery_nats_leader.nats import ConnectOptions, open_backend
from celery_nats_leader.nats.memory import MemoryBackend, MemoryServer
from celery_nats_leader.ops.bucket import bucket_info, delete_bucket, ensure_bucket
from celery_nats_leader.testing import NatsServer


@pytest.fixture(params=["jetstream", "memory"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    if request.param == "memory":
        yield MemoryBackend(MemoryServer())
        return
    with NatsServer() as server:
        async with await open_backend(ConnectOptions(servers=(server.url,))) as real:
            yield real


async def test_create_inspect_delete(backend: Backend) -> None:
    name = f"ops_{uuid.uuid4().hex[:8]}"
    with pytest.raises(BucketNotFoundError, match=name):
        await bucket_info(backend, name)

    created = await ensure_bucket(backend, name, ttl=3.0, replicas=1)
    assert (created.name, created.ttl, created.history, created.created) == (name, 3.0, 1, True)
    assert created.problems(ttl=3.0, replicas=1) == []
    assert created.problems(ttl=5.0) == [
        "max_age is 3s but the election ttl is 5s: they must be equal "
        "(recreate the bucket with --ttl 5, or set TTL to 3)"
    ]

    again = await ensure_bucket(backend, name, ttl=3.0, replicas=1)
    assert again.created is False
    assert await bucket_info(backend, name) == again

    kv = await backend.open_bucket(name, ttl=3.0, create=False, replicas=1, timeout=5)
    await kv.put("beat", b"x", timeout=5)
    assert (await bucket_info(backend, name)).keys == 1

    assert await delete_bucket(backend, name) is True
    assert await delete_bucket(backend, name) is False
    with pytest.raises(BucketNotFoundError):
        await bucket_info(backend, name)


async def test_persistent_bucket_has_no_max_age(backend: Backend) -> None:
    name = f"ops_{uuid.uuid4().hex[:8]}"
    info = await ensure_bucket(backend, name, ttl=None, replicas=1, persistent=True)
    assert (info.ttl, info.history) == (0.0, 1)
    assert info.problems(ttl=None, persistent=True) == []


async def test_server_without_jetstream_is_reported_with_advice() -> None:
    with NatsServer(jetstream=False) as server:
        async with await open_backend(ConnectOptions(servers=(server.url,))) as backend:
            with pytest.raises(JetStreamUnavailableError, match="-js"):
                await bucket_info(backend, "leaders", timeout=2)
            with pytest.raises(JetStreamUnavailableError, match="-js"):
                await delete_bucket(backend, "leaders", timeout=2)
