"""Changing the TTL: a new bucket whose terms' epochs continue above the old bucket's.

A bucket's ``max_age`` is the TTL, so a new TTL needs a new bucket, and a new
bucket's revisions (the epochs) start again at 1, below everything the
database fence has accepted. ``election_bucket --migrate-from OLD`` creates
the new bucket with its epochs above ``OLD``'s. Real nats-server, real
candidates, the fence on SQLite and PostgreSQL.
"""

from __future__ import annotations

import json
import uuid
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from celery_nats_leader.term.token import FencingToken
from celery_nats_leader.testing import NatsServer
from django_nats_leader.fencing import StaleLeaderError, current_epoch, fenced
from tests.django.conftest import Candidates
from tests.django.fenceapp.models import Write
from tests.django.test_fencing import backends

pytestmark = pytest.mark.integration

ROLE = "default"


def run(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out, stderr=StringIO())
    return out.getvalue()


def lead(made: Candidates, instance_id: str) -> FencingToken:
    """Start a candidate that becomes the leader; its term's token."""
    made.start(instance_id)
    handle = made.handle(instance_id)
    assert handle.wait_for_leadership(10), handle.state
    token = handle.token
    assert token is not None
    return token


def write(alias: str, token: FencingToken, writer: str) -> None:
    with fenced(ROLE, token, using=alias, holder=writer):
        Write.objects.using(alias).create(role=ROLE, epoch=token.epoch, writer=writer)


@pytest.mark.parametrize("alias", backends(transaction=False), indirect=True)
def test_terms_on_the_migrated_bucket_pass_the_fence_and_old_ones_do_not(
    alias: str, nats_server: NatsServer, bucket: str, nats_leader: Any
) -> None:
    # Terms on the old bucket (TTL 2 s), each fenced write accepted.
    old = Candidates(url=nats_server.url, bucket=bucket, ttl=2.0)
    try:
        first = lead(old, "old-a")
        write(alias, first, "old-a")
        old.stop()  # released: the next candidate wins a new term at once
        stale = lead(old, "old-b")
        write(alias, stale, "old-b")
    finally:
        old.stop()
    highest = current_epoch(ROLE, using=alias)
    assert highest == stale.epoch > first.epoch

    # Control: a bucket made without the floor starts its epochs at 1.
    plain = Candidates(url=nats_server.url, bucket=f"{bucket}_plain", ttl=3.0)
    try:
        fresh = lead(plain, "plain")
        assert fresh.epoch == 1
        with pytest.raises(StaleLeaderError):
            write(alias, fresh, "plain")
    finally:
        plain.stop()

    # A replica on the old bucket leads while the TTL change begins.
    old = Candidates(url=nats_server.url, bucket=bucket, ttl=2.0)
    new = Candidates(url=nats_server.url, bucket=f"{bucket}_3s", ttl=3.0)
    try:
        rolling = lead(old, "old-c")

        # The TTL change: the new bucket (TTL 3 s) carries the old one's epochs.
        new_bucket = f"{bucket}_3s"
        body = json.loads(
            run(
                "election_bucket",
                "--bucket",
                new_bucket,
                "--ttl",
                "3",
                "--migrate-from",
                bucket,
                "--json",
            )
        )
        assert body["ok"] is True
        [info] = body["buckets"]
        assert (info["name"], info["ttl"], info["created"], info["keys"]) == (
            new_bucket,
            3.0,
            True,
            0,
        )
        carried = body["epoch_floor"]
        assert carried["source"] == bucket
        assert carried["next_revision"] == carried["floor"] > rolling.epoch

        # While the replicas roll over, the role has one leader: the new
        # bucket's replica waits for the old bucket's term to end.
        new.start("new-a")
        handle = new.handle("new-a")
        assert not handle.wait_for_leadership(1.0)
        write(alias, rolling, "old-c")  # still the leader, still accepted
        old.stop()  # the roll replaces it: released, the new replica leads at once
        assert handle.wait_for_leadership(5)
        token = handle.token
        assert token is not None
        assert rolling.epoch < token.epoch == carried["next_revision"]
        write(alias, token, "new-a")  # the fence accepts the new bucket's term
        for refused, writer in ((rolling, "old-c"), (stale, "old-b")):
            with pytest.raises(StaleLeaderError):
                write(alias, refused, writer)
    finally:
        old.stop()
        new.stop()
    assert current_epoch(ROLE, using=alias) == token.epoch
    writers = Write.objects.using(alias).filter(role=ROLE).order_by("id")
    assert list(writers.values_list("writer", flat=True)) == ["old-a", "old-b", "old-c", "new-a"]


@pytest.mark.django_db
def test_migration_refuses_a_missing_source_and_a_bucket_in_use(
    nats_server: NatsServer, bucket: str, nats_leader: Any
) -> None:
    missing = f"gone_{uuid.uuid4().hex[:8]}"
    with pytest.raises(CommandError) as refused:
        run("election_bucket", "--bucket", f"{bucket}_new", "--migrate-from", missing)
    assert f"KV bucket {missing!r} does not exist: nothing to carry the epoch floor from" in str(
        refused.value
    )
    # Nothing was created on the way.
    with pytest.raises(CommandError, match="does not exist"):
        run("election_bucket", "--bucket", f"{bucket}_new")

    used = Candidates(url=nats_server.url, bucket=f"{bucket}_used", ttl=2.0)
    try:
        lead(used, "in-use")
        run("election_bucket", "--create", "--bucket", bucket)
        with pytest.raises(CommandError) as refused:
            run("election_bucket", "--bucket", f"{bucket}_used", "--migrate-from", bucket)
    finally:
        used.stop()
    assert f"KV bucket '{bucket}_used' already holds 1 entries: candidates use it" in str(
        refused.value
    )
