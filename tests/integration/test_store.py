"""What the store holds, and bad input: the bucket, the key, the server.

Elections run in the test's event loop here, so the test can read their
logs and count what they send to the server.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import KeyValueConfig

from celery_nats_leader import (
    BucketConfigError,
    BucketNotFoundError,
    DemoteReason,
    ElectionState,
    JetStreamUnavailableError,
)
from celery_nats_leader.term.record import encode_record
from celery_nats_leader.testing import NatsServer
from tests.integration.helpers import (
    BUCKET,
    HEARTBEAT,
    ROLE,
    SLACK,
    TTL,
    LocalElections,
    LogCounter,
    create_bucket,
    in_thread,
    wait_connections,
)

pytestmark = pytest.mark.integration

NOT_A_RECORD = "is not a leader record"


class ServerCalls:
    """Sees every message clients send: JetStream API requests and KV writes among them.

    One subscription, so messages are handled in the order the server sent
    them; :meth:`barrier` uses that to know when a client's earlier messages
    have all been seen.
    """

    def __init__(self) -> None:
        self.subjects: list[str] = []
        self._seen = asyncio.Event()

    async def attach(self, nc: Client) -> None:
        async def seen(msg: Msg) -> None:
            self.subjects.append(msg.subject)
            self._seen.set()

        await nc.subscribe(">", cb=seen)
        await nc.flush()

    async def barrier(self, client: Client) -> int:
        """Position in :attr:`subjects` after everything ``client`` sent so far."""
        marker = f"test.barrier.{uuid.uuid4().hex}"
        await client.publish(marker, b"")
        await client.flush()
        while marker not in self.subjects:
            self._seen.clear()
            await asyncio.wait_for(self._seen.wait(), 5.0)
        return self.subjects.index(marker) + 1

    def store_calls(self, since: int) -> list[str]:
        """JetStream API requests and KV writes seen from position ``since`` on."""
        return [s for s in self.subjects[since:] if s.startswith(("$JS.API.", "$KV."))]


async def test_bucket_deleted_stops_the_election_with_a_clear_error(
    local: LocalElections, bucket: str, nc: Client, package_log: LogCounter
) -> None:
    # Both share one connection that stays open (as with the Elector): any
    # retry loop would show up as traffic.
    (shared,) = await local.connect(1)
    leader, follower = local.add("a", connection=shared), local.add("b", connection=shared)
    await leader.start()
    await local.wait_for("promoted", {"a"})
    await follower.start()
    calls = ServerCalls()
    await calls.attach(nc)

    await nc.jetstream().delete_key_value(bucket)
    deleted_at = time.monotonic()
    errors = [await local.wait_for("error", {name}, timeout=HEARTBEAT + SLACK) for name in "ab"]

    for event in errors:
        assert isinstance(event.value, BucketNotFoundError)
        assert repr(BUCKET) in str(event.value)
        # Within about one resync interval (the heartbeat) of the deletion.
        assert event.at - deleted_at < HEARTBEAT + SLACK / 2
    assert [e.value for e in local.events("demoted", {"a"})] == [DemoteReason.ERROR]
    for election in (leader, follower):
        assert election.state is ElectionState.STOPPED
        assert isinstance(election.error, BucketNotFoundError)
        assert not election.is_leader
        with pytest.raises(BucketNotFoundError):
            await election.wait_for_leadership(0.1)
    assert package_log.count("election stopped") == 2
    # No endless retry: no store call on the shared connection from then on.
    # There is no event for "nothing happens", so this watches for a while.
    quiet_from = await calls.barrier(shared)
    await asyncio.sleep(3 * HEARTBEAT)
    await calls.barrier(shared)
    assert calls.store_calls(quiet_from) == []
    assert package_log.count("election stopped") == 2


async def test_foreign_token_written_by_hand_demotes_the_leader(
    local: LocalElections, bucket: str, nc: Client
) -> None:
    for name in ("a", "b"):
        local.add(name)
    await local["a"].start()
    first = await local.wait_for("promoted", {"a"})
    await local["b"].start()

    kv = await nc.jetstream().key_value(bucket)
    forged = encode_record(instance_id="intruder", token="forged", epoch=None, priority=0, meta={})
    written_at = time.monotonic()
    forged_revision = await kv.put(ROLE, forged)

    demoted = await local.wait_for("demoted", {"a"}, timeout=HEARTBEAT + SLACK)
    # The watch shows the foreign revision at once; the next renewal would fail anyway.
    assert demoted.value in {DemoteReason.REVISION_CHANGED, DemoteReason.TOKEN_MISMATCH}
    assert demoted.at - written_at < HEARTBEAT + SLACK / 2
    assert not await local["a"].validate_token()
    assert local.leaders() == []
    for name in ("a", "b"):
        await local.wait_for(
            "leader",
            {name},
            after=written_at,
            timeout=SLACK,
            where=lambda event: event.value is not None and event.value.id == "intruder",
        )
        assert local[name].leader_id == "intruder"

    # The intruder does not renew: its record expires and a candidate takes over.
    successor = await local.wait_for("promoted", after=written_at, timeout=TTL + SLACK)
    assert TTL - 0.05 < successor.at - written_at < TTL + SLACK
    assert successor.value.epoch > forged_revision > first.value.epoch
    assert local.leaders() == [successor.name]
    assert await local[successor.name].validate_token()


async def test_server_without_jetstream_is_reported_with_advice(local: LocalElections) -> None:
    with NatsServer(jetstream=False) as server:
        for create in (False, True):
            election = local.add(f"c{create}", url=server.url, create_bucket=create)
            began = time.monotonic()
            with pytest.raises(JetStreamUnavailableError, match="-js"):
                await election.start()
            assert time.monotonic() - began < 5.0
            # Nothing left behind: the connection start() opened is closed.
            await in_thread(wait_connections, server, 0)


async def test_missing_bucket_is_reported_with_how_to_create_it(
    local: LocalElections, nats_server: NatsServer, nc: Client
) -> None:
    election = local.add("a")
    with pytest.raises(BucketNotFoundError) as caught:
        await election.start()
    message = str(caught.value)
    assert f"nats kv add {BUCKET} --ttl {TTL:g}s --history 1" in message
    assert "create_bucket=True" in message
    # Without the `nats` CLI: the project's own commands, with the configured TTL.
    assert "`celery -A <app> nats-leader bucket --create`" in message
    assert "`manage.py election_bucket --create`" in message
    # Nothing left behind: only the test's own connection remains.
    await in_thread(wait_connections, nats_server, 1)
    # Once the operator created the bucket, the same election starts.
    await create_bucket(nats_server.url)
    await election.start()
    assert election.is_leader
    # Or, with create_bucket=True, the election creates it (max_age = ttl).
    created = local.add("b", bucket="created", create_bucket=True)
    await created.start()
    assert created.is_leader
    status = await (await nc.jetstream().key_value("created")).status()
    assert (status.ttl, status.history) == (TTL, 1)


async def test_bucket_with_another_max_age_is_refused(
    local: LocalElections, nats_server: NatsServer, nc: Client
) -> None:
    await nc.jetstream().create_key_value(KeyValueConfig(bucket=BUCKET, history=1, ttl=5 * TTL))
    for create in (False, True):
        election = local.add(f"c{create}", create_bucket=create)
        with pytest.raises(BucketConfigError) as caught:
            await election.start()
        message = str(caught.value)
        assert f"max_age={5 * TTL:g}s" in message
        assert f"election ttl is {TTL:g}s" in message


@pytest.mark.parametrize(
    "value",
    [b"\x00\xff not json", b'{"owner": "cron@host-7", "until": "tomorrow"}', b"[1, 2, 3]"],
    ids=["garbage", "foreign-json", "json-array"],
)
async def test_foreign_value_in_the_key_is_someone_elses_until_it_expires(
    local: LocalElections, bucket: str, nc: Client, package_log: LogCounter, value: bytes
) -> None:
    kv = await nc.jetstream().key_value(bucket)
    written_at = time.monotonic()
    revision = await kv.put(ROLE, value)

    names = ["a", "b", "c"]
    for name in names:
        local.add(name)
    await asyncio.gather(*(local[name].start() for name in names))
    # Held by someone else, who is not one of us: nobody leads, nobody crashed.
    for name in names:
        election = local[name]
        assert election.state is ElectionState.FOLLOWER
        assert (election.is_leader, election.leader_id, election.error) == (False, None, None)

    successor = await local.wait_for("promoted", timeout=TTL + SLACK)
    assert TTL - 0.05 < successor.at - written_at < TTL + SLACK
    assert successor.value.epoch > revision
    assert local.leaders() == [successor.name]
    assert [e.name for e in local.events("promoted")] == [successor.name]
    assert local.events("error") == []
    # Logged once per candidate, not once per look at the key.
    assert package_log.count(NOT_A_RECORD) == len(names)
