"""A TTL change's marks (election/moves.py) against the in-memory backend.

Fast logic tests; the same roll runs against a real nats-server with real
beat replicas in tests/beat/test_beat_ttl_change.py and with the database
fence in tests/django/test_ttl_change.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from celery_nats_leader import DemoteReason
from celery_nats_leader.election.moves import BucketMarks
from celery_nats_leader.nats.memory import MemoryBackend, MemoryServer
from tests.unit.test_election_logic import Candidate, make, server

__all__ = ["make", "server"]  # the fixtures, used by name

OLD, NEW = "leaders", "leaders_new"


async def move(server: MemoryServer, *, ttl: float = 0.6) -> None:
    """What ``bucket --migrate-from OLD`` leaves: OLD marked first, then NEW created marked."""
    admin = MemoryBackend(server)
    await admin.describe_bucket(OLD, BucketMarks(moved_to=NEW).describe(), timeout=1)
    description = BucketMarks(migrated_from=OLD).describe()
    await admin.open_bucket(
        NEW, ttl=ttl, create=True, replicas=1, timeout=1, description=description
    )


def test_marks_read_back_and_other_descriptions_carry_none() -> None:
    both = BucketMarks(moved_to="c", migrated_from="a")
    assert BucketMarks.parse(both.describe()) == both
    assert both.describe() == "celery-nats-leader migrated-from=a moved-to=c"
    assert BucketMarks.parse("") == BucketMarks()
    assert BucketMarks.parse("moved-to=x (someone else's stream)") == BucketMarks()
    assert BucketMarks().describe() == ""


async def test_a_follower_of_the_moved_bucket_never_starts_a_term_and_the_new_bucket_waits(
    make: Callable[..., Candidate], server: MemoryServer
) -> None:
    old_leader, old_follower = make("old-a", bucket=OLD), make("old-b", bucket=OLD)
    await old_leader.election.start()
    await old_follower.election.start()
    assert old_leader.election.is_leader
    await move(server)
    new = make("new-a", bucket=NEW)
    started = asyncio.get_running_loop().time()
    await new.election.start()
    # start() returns once it knows it follows (it does not wait a TTL).
    assert asyncio.get_running_loop().time() - started < 0.3
    # One leader of the role: the new bucket's replica waits for the old
    # term. (A wrong campaign would come within a heartbeat: two TTLs
    # without one show the wait.)
    await asyncio.sleep(0.6 * 2)
    assert not new.election.is_leader and new.promotions == []

    await old_leader.election.stop()  # released: the key is deleted at once
    assert old_leader.demotions == [DemoteReason.STOPPED]
    await asyncio.wait_for(new.promoted.wait(), 2.0)
    # The old follower saw the delete and campaigned; it read the mark after
    # its create and gave the key back, so it never led.
    assert old_follower.promotions == []
    assert not old_follower.election.is_leader
    old = await MemoryBackend(server).open_bucket(
        OLD, ttl=None, create=False, replicas=1, timeout=1
    )
    assert await old.get("beat", timeout=1) is None


async def test_an_old_leader_that_dies_holds_the_new_bucket_off_until_its_key_expires(
    make: Callable[..., Candidate], server: MemoryServer
) -> None:
    old_leader = make("old-a", bucket=OLD)
    await old_leader.election.start()
    await move(server)
    new = make("new-a", bucket=NEW)
    await new.election.start()
    loop = asyncio.get_running_loop()
    old_leader.backend.connected = False  # it can no longer renew: as if killed
    cut = loop.time()
    await asyncio.wait_for(new.promoted.wait(), 3.0)
    # Not before the old key's max_age ran out after its last renewal.
    assert loop.time() - cut >= 0.6 - 0.6 / 4


async def test_a_replica_started_on_a_moved_bucket_never_leads_unless_the_move_is_undone(
    make: Callable[..., Candidate], server: MemoryServer
) -> None:
    first = make("old-a", bucket=OLD)
    await first.election.start()
    await first.election.stop()
    await move(server)
    late = make("old-late", bucket=OLD)
    started = asyncio.get_running_loop().time()
    await late.election.start()
    assert asyncio.get_running_loop().time() - started < 0.3  # decided: it follows
    await asyncio.sleep(0.6 * 2)  # two TTLs without a campaign
    assert late.promotions == []
    await late.election.stop()

    # Deleting the new bucket undoes the move (a roll given up).
    await MemoryBackend(server).delete_bucket(NEW, timeout=1)
    again = make("old-again", bucket=OLD)
    await again.election.start()
    await asyncio.wait_for(again.promoted.wait(), 2.0)


@pytest.mark.parametrize("deleted", [True, False], ids=["old-bucket-deleted", "old-key-free"])
async def test_the_new_bucket_leads_at_once_when_the_old_one_holds_no_term(
    make: Callable[..., Candidate], server: MemoryServer, deleted: bool
) -> None:
    await MemoryBackend(server).open_bucket(OLD, ttl=0.6, create=True, replicas=1, timeout=1)
    await move(server)
    if deleted:
        await MemoryBackend(server).delete_bucket(OLD, timeout=1)
    new = make("new-a", bucket=NEW)
    await new.election.start()
    assert new.election.is_leader
