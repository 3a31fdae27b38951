"""Operator operations on buckets (celery_nats_leader.ops.bucket) on a real server.

The same steps run on the in-memory double, so it keeps telling the truth
about what the operator tools see.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, cast

import nats
import pytest

from celery_nats_leader.config.connection import ConnectOptions
from celery_nats_leader.core.backend import Backend
from celery_nats_leader.core.errors import (
    BucketNotFoundError,
    ConfigError,
    EpochFloorRaceError,
    JetStreamUnavailableError,
)
from celery_nats_leader.election.moves import BucketMarks
from celery_nats_leader.nats import open_backend
from celery_nats_leader.nats.jetstream import JetStreamBackend
from celery_nats_leader.nats.memory import MemoryBackend, MemoryServer
from celery_nats_leader.ops.bucket import (
    ELECTION,
    MIGRATION_HEADROOM,
    BucketTarget,
    bucket_info,
    delete_bucket,
    ensure_bucket,
    migrate_bucket,
)
from celery_nats_leader.testing import NatsServer
from celery_nats_leader.testing.fault_proxy import ThreadedFaultProxy
from tests.integration.helpers import poll


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


async def test_migrated_bucket_continues_the_old_buckets_revisions(backend: Backend) -> None:
    old, new = f"ops_{uuid.uuid4().hex[:8]}", f"ops_{uuid.uuid4().hex[:8]}"
    kv = await backend.open_bucket(old, ttl=3.0, create=True, replicas=1, timeout=5)
    revisions = [await kv.put(role, b"x", timeout=5) for role in ("a", "b", "a", "c", "a")]
    target = BucketTarget(new, ELECTION, 7.0, 1)

    outcome, floor = await migrate_bucket(backend, target, source=old, timeout=5)
    assert outcome.info is not None and outcome.info.created and outcome.info.ttl == 7.0
    assert floor.next_revision == floor.floor == revisions[-1] + 1 + MIGRATION_HEADROOM
    moved = await backend.open_bucket(new, ttl=7.0, create=False, replicas=1, timeout=5)
    assert await moved.create("default", b"term", timeout=5) == floor.floor

    # Once a candidate wrote there, the floor cannot be moved any more.
    with pytest.raises(ConfigError, match=f"KV bucket {new!r} already holds 1 entries"):
        await migrate_bucket(backend, target, source=old, floor=10_000, timeout=5)
    with pytest.raises(BucketNotFoundError, match="nothing to carry the epoch floor from"):
        await migrate_bucket(backend, target, source="ops_missing", timeout=5)
    with pytest.raises(ConfigError, match="names the bucket being created"):
        await migrate_bucket(backend, target, source=new, timeout=5)
    with pytest.raises(ConfigError, match="reaches the ALLCALL strategy's epochs"):
        await migrate_bucket(backend, target, source=None, floor=10**12, timeout=5)


async def test_a_floor_raised_under_a_candidates_write_says_what_it_purged(
    backend: Backend,
) -> None:
    # A replica that wrote between migrate_bucket's emptiness check and the purge
    # lost its record to the purge: the migration must not end as if it worked.
    name = f"ops_{uuid.uuid4().hex[:8]}"
    kv = await backend.open_bucket(name, ttl=3.0, create=True, replicas=1, timeout=5)
    await kv.create("default", b"term", timeout=5)
    with pytest.raises(EpochFloorRaceError, match=f"KV bucket {name!r}: 1 entries written"):
        await backend.raise_next_revision(name, 5_000, timeout=5)


async def test_migrate_refuses_a_new_bucket_a_replica_created_unmarked(backend: Backend) -> None:
    # A replica started with the new settings before the migration (and
    # create_bucket on) made the new bucket without marks: it read none, and
    # campaigns there without waiting for the old bucket's leader. Marking
    # that bucket afterwards cannot reach it, so the migration refuses.
    old, new = f"ops_{uuid.uuid4().hex[:8]}", f"ops_{uuid.uuid4().hex[:8]}"
    await backend.open_bucket(old, ttl=3.0, create=True, replicas=1, timeout=5)
    await backend.open_bucket(new, ttl=7.0, create=True, replicas=1, timeout=5)
    target = BucketTarget(new, ELECTION, 7.0, 1)
    with pytest.raises(ConfigError) as refused:
        await migrate_bucket(backend, target, source=old, timeout=5)
    assert str(refused.value).startswith(
        f"KV bucket {new!r} exists but was not created by --migrate-from {old!r}"
    )
    assert str(refused.value).endswith(
        f"Stop the replicas that use {new!r}, delete it, and run this again before any "
        "replica starts with the new settings"
    )
    # Nothing was marked: the replicas on the old bucket lead on as before.
    assert (await bucket_info(backend, old)).description == ""
    assert (await bucket_info(backend, new)).description == ""

    # As the error says: delete it and run again. A second run accepts the
    # bucket the first one created.
    await delete_bucket(backend, new)
    created, _ = await migrate_bucket(backend, target, source=old, timeout=5)
    again, _ = await migrate_bucket(backend, target, source=old, timeout=5)
    assert created.info is not None and created.info.created
    assert again.info is not None and not again.info.created
    assert BucketMarks.parse(again.info.description) == BucketMarks(migrated_from=old)
    assert BucketMarks.parse((await bucket_info(backend, old)).description) == BucketMarks(
        moved_to=new
    )


class _ReplicaCreatesFirst:
    """A backend on which a replica creates each bucket, unmarked, just before a marked create."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    async def open_bucket(self, name: str, **options: Any) -> Any:
        if options.get("description"):
            await self._backend.open_bucket(name, **{**options, "description": ""})
        return await self._backend.open_bucket(name, **options)


async def test_migrate_refuses_a_new_bucket_a_replica_created_under_it(backend: Backend) -> None:
    # The replica's create lands between the migration's look (no bucket)
    # and its own create, which then finds the replica's unmarked bucket.
    old, new = f"ops_{uuid.uuid4().hex[:8]}", f"ops_{uuid.uuid4().hex[:8]}"
    await backend.open_bucket(old, ttl=3.0, create=True, replicas=1, timeout=5)
    racing = cast(Backend, _ReplicaCreatesFirst(backend))
    with pytest.raises(ConfigError, match=f"exists but was not created by --migrate-from {old!r}"):
        await migrate_bucket(racing, BucketTarget(new, ELECTION, 7.0, 1), source=old, timeout=5)
    # The old bucket's mark is undone; the replica's bucket is left to it.
    assert (await bucket_info(backend, old)).description == ""
    assert (await bucket_info(backend, new)).description == ""


@pytest.mark.parametrize("graceful", [True, False], ids=["restart", "kill"])
async def test_epoch_floor_survives_expiry_and_server_restarts(graceful: bool) -> None:
    # The old bucket's records have all expired (max_age) when the operator
    # migrates, and the server restarts before and after the migration.
    old, new = "ttl_old", "ttl_new"
    with NatsServer() as server:
        async with await open_backend(ConnectOptions(servers=(server.url,))) as be:
            kv = await be.open_bucket(old, ttl=1.0, create=True, replicas=1, timeout=5)
            last = [await kv.put(f"role{n}", b"x", timeout=5) for n in range(40)][-1]

            async def expired() -> bool:
                return (await bucket_info(be, old)).keys == 0

            await poll(expired, timeout=10, what=f"{old} expired")
        await asyncio.to_thread(server.restart, graceful=graceful)
        async with await open_backend(ConnectOptions(servers=(server.url,))) as be:
            # 2.11+ writes a marker per expired key (one more revision each).
            after_old = await be.next_revision(old, timeout=5)
            assert after_old == (last + 1 if be.server_version() < (2, 11) else 2 * last + 1)
            _, floor = await migrate_bucket(
                be, BucketTarget(new, ELECTION, 5.0, 1), source=old, headroom=0, timeout=5
            )
            assert floor.next_revision == floor.floor == after_old
        await asyncio.to_thread(server.restart, graceful=graceful)
        async with await open_backend(ConnectOptions(servers=(server.url,))) as be:
            assert await be.next_revision(new, timeout=5) == after_old
            moved = await be.open_bucket(new, ttl=5.0, create=False, replicas=1, timeout=5)
            assert await moved.create("default", b"term", timeout=5) == after_old


async def test_server_without_jetstream_is_reported_with_advice() -> None:
    with NatsServer(jetstream=False) as server:
        async with await open_backend(ConnectOptions(servers=(server.url,))) as backend:
            with pytest.raises(JetStreamUnavailableError, match="-js"):
                await bucket_info(backend, "leaders", timeout=2)
            with pytest.raises(JetStreamUnavailableError, match="-js"):
                await delete_bucket(backend, "leaders", timeout=2)


async def test_describe_bucket_changes_nothing_else_in_the_stream_config() -> None:
    # A TTL change marks both buckets in their streams' descriptions. That
    # update must not move max_age (the TTL every replica checks) by a
    # nanosecond, nor drop settings nats-py does not model (nats-py 2.14 has
    # no subject_delete_marker_ttl, which nats-server 2.11+ keeps).
    name = f"ops_{uuid.uuid4().hex[:8]}"
    odd = 1_000_000_007  # ns: float seconds (1.000000007) come back as ...006
    assert int(odd / 1e9 * 1e9) != odd
    with NatsServer() as server:
        async with await open_backend(ConnectOptions(servers=(server.url,))) as be:
            config: dict[str, object] = {
                "name": f"KV_{name}",
                "subjects": [f"$KV.{name}.>"],
                "max_msgs_per_subject": 1,
                "max_age": odd,
                "duplicate_window": odd,
                "discard": "new",
                "deny_delete": True,
                "allow_rollup_hdrs": True,
                "allow_direct": True,
                "storage": "file",
                "num_replicas": 1,
            }
            if be.server_version() >= (2, 11):
                config.update(allow_msg_ttl=True, subject_delete_marker_ttl=odd)
            created = await be.nc.request(
                f"$JS.API.STREAM.CREATE.KV_{name}", json.dumps(config).encode(), timeout=5
            )
            assert "error" not in json.loads(created.data), created.data

            async def stream_config() -> dict[str, object]:
                info = await be.nc.request(f"$JS.API.STREAM.INFO.KV_{name}", b"", timeout=5)
                found = json.loads(info.data)["config"]
                assert isinstance(found, dict)
                return found

            before = await stream_config()
            assert before["max_age"] == odd
            await be.describe_bucket(name, "celery-nats-leader moved-to=x", timeout=5)
            after = await stream_config()
            assert after == {**before, "description": "celery-nats-leader moved-to=x"}
            assert (await bucket_info(be, name)).description == "celery-nats-leader moved-to=x"
            await be.describe_bucket(name, "", timeout=5)
            assert await stream_config() == before
            with pytest.raises(BucketNotFoundError, match="ops_missing"):
                await be.describe_bucket("ops_missing", "x", timeout=5)


async def test_bucket_operations_wait_as_long_as_they_are_allowed(
    nats_server: NatsServer, proxy: ThreadedFaultProxy
) -> None:
    """A ``--timeout`` above the connection's JetStream timeout (5 s) is honoured.

    A replicated bucket's create is answered once its servers have elected
    the stream's leader, which a loaded cluster can take longer than 5 s for:
    ``bucket --create --timeout 30`` must then wait 30 s, not 5. Here every
    answer takes longer than the connection's JetStream timeout.
    """
    name = f"slow_{uuid.uuid4().hex[:8]}"
    nc = await nats.connect(proxy.url)
    backend = JetStreamBackend(nc, js_timeout=0.2)
    try:
        proxy.delay(0.15)  # each way: 0.3 s a request
        created = await ensure_bucket(backend, name, ttl=3.0, replicas=1, timeout=5)
        assert (created.name, created.created) == (name, True)
        assert (await bucket_info(backend, name, timeout=5)).ttl == 3.0
        assert await delete_bucket(backend, name, timeout=5) is True
    finally:
        proxy.delay(0)
        await nc.close()
