"""``celery nats-leader``: the CLI against a real nats-server and live candidates.

The candidates are Electors in this process; the command runs through
click's test runner with a Celery app (no worker, no broker needed): what an
operator sees is its output and exit status.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from celery import Celery
from click.testing import CliRunner, Result

from celery_nats_leader import ElectionConfig, Elector
from celery_nats_leader.config.settings import settings_of_app
from celery_nats_leader.ops.cli import nats_leader
from celery_nats_leader.recipes.once_guard import OnceGuard, Verdict
from celery_nats_leader.testing import NatsServer
from celery_nats_leader.worker.once_tasks import OnceService
from tests.support.services import wait_for

TTL = 2.0


@pytest.fixture(scope="module")
def nats_server() -> Iterator[NatsServer]:
    with NatsServer() as server:
        yield server


@pytest.fixture
def bucket() -> str:
    return f"cli_{uuid.uuid4().hex[:10]}"


@pytest.fixture
def app(nats_server: NatsServer, bucket: str) -> Celery:
    app = Celery("cli", set_as_current=False)
    app.conf.update(
        nats_leader_servers=[nats_server.url],
        nats_leader_bucket=bucket,
        nats_leader_ttl=TTL,
        nats_leader_roles=["default"],
    )
    return app


@pytest.fixture
def two(nats_server: NatsServer, bucket: str) -> Iterator[dict[str, Elector]]:
    """cand-a leads ``default`` (started first, preferred), cand-b follows."""
    electors: dict[str, Elector] = {}
    try:
        for name, priority in (("cand-a", 10), ("cand-b", 0)):
            elector = Elector(nats_server.url, name=f"test-{name}")
            elector.add_role(
                ElectionConfig(
                    role="default",
                    bucket=bucket,
                    ttl=TTL,
                    instance_id=name,
                    priority=priority,
                    create_bucket=True,
                )
            )
            elector.start(timeout=10)
            electors[name] = elector
        assert electors["cand-a"].role("default").is_leader
        yield electors
    finally:
        for elector in electors.values():
            elector.stop()


def cli(app: Celery, *args: str) -> Result:
    return CliRunner().invoke(nats_leader, list(args), obj=SimpleNamespace(app=app))


def test_resign_reports_the_successor(app: Celery, two: dict[str, Elector]) -> None:
    old = two["cand-a"].role("default").token
    assert old is not None
    result = cli(app, "resign", "default")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == f"cand-a stepped down from role 'default' (epoch {old.epoch})"
    # The command saw cand-b's record; cand-b learns it won when its write is acked.
    successor = two["cand-b"].role("default")
    assert successor.wait_for_leadership(2)
    new = successor.token
    assert new is not None and new.epoch > old.epoch
    assert lines[1].startswith(f"new leader of 'default': cand-b (epoch {new.epoch}) after ")
    assert not two["cand-a"].role("default").is_leader


def test_resign_json(app: Celery, two: dict[str, Elector]) -> None:
    old = two["cand-a"].role("default").token
    assert old is not None
    result = cli(app, "resign", "default", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["role"] == "default"
    assert doc["accepted"] is True
    assert doc["answered_by"] == "cand-a"
    assert doc["stepped_down"]["id"] == "cand-a"
    assert doc["stepped_down"]["epoch"] == old.epoch
    assert doc["new_leader"]["id"] == "cand-b"
    assert doc["new_leader"]["epoch"] > old.epoch
    assert 0 < doc["handover_seconds"] < TTL


def test_resign_without_leader_exits_1(app: Celery, two: dict[str, Elector]) -> None:
    result = cli(app, "resign", "reports")
    assert result.exit_code == 1
    assert "nobody leads role 'reports'" in result.stderr


def test_resign_invalid_role_exits_2(app: Celery) -> None:
    result = cli(app, "resign", "not a role")
    assert result.exit_code == 2


# ------------------------------------------------------------------ bucket


def test_bucket_check_create_delete(app: Celery, bucket: str, nats_server: NatsServer) -> None:
    missing = cli(app, "bucket")
    assert missing.exit_code == 1, missing.output
    assert f"election bucket {bucket!r} does not exist" in missing.stdout
    assert "create it with `celery -A cli nats-leader bucket --create`" in missing.stdout

    created = cli(app, "bucket", "--create")
    assert created.exit_code == 0, created.output
    lines = created.stdout.splitlines()
    assert lines[0] == f"election bucket {bucket!r} created"
    assert "  max_age (TTL)  2s" in lines and "  history        1" in lines
    assert lines[-1] == "  fits the election settings"

    # What it made is what an election with the configured TTL accepts.
    with Elector(nats_server.url, name="test-bucket") as elector:
        handle = elector.add_role(ElectionConfig(role="default", bucket=bucket, ttl=TTL))
        assert handle.wait_for_leadership(5) and handle.error is None

    again = cli(app, "bucket", "--check", "--json")
    assert again.exit_code == 0, again.output
    doc = json.loads(again.stdout)
    assert doc["ok"] is True
    [entry] = doc["buckets"]
    assert entry["name"] == bucket and entry["kind"] == "election"
    assert (entry["exists"], entry["ttl"], entry["history"], entry["created"]) == (
        True,
        TTL,
        1,
        False,
    )

    refused = CliRunner().invoke(
        nats_leader, ["bucket", "--delete"], obj=SimpleNamespace(app=app), input="n\n"
    )
    assert refused.exit_code == 1 and "Aborted" in refused.output
    assert cli(app, "bucket").exit_code == 0  # still there

    deleted = cli(app, "bucket", "--delete", "--yes")
    assert deleted.exit_code == 0, deleted.output
    assert deleted.stdout.splitlines() == [f"election bucket {bucket!r} deleted"]
    assert cli(app, "bucket").exit_code == 1


def test_bucket_migrate_from_changes_the_ttl_keeping_epochs_up(
    app: Celery, bucket: str, two: dict[str, Elector]
) -> None:
    term = two["cand-a"].role("default").token
    assert term is not None
    new = f"{bucket}_5s"
    moved = cli(app, "bucket", "--bucket", new, "--ttl", "5", "--migrate-from", bucket)
    assert moved.exit_code == 0, moved.output
    lines = moved.stdout.splitlines()
    assert lines[0] == f"election bucket {new!r} created"
    assert "  max_age (TTL)  5s" in lines
    [next_line] = [line for line in lines if line.startswith("  next epoch")]
    assert next_line.endswith(f"(carried from {bucket!r})")
    floor = int(next_line.split()[2])
    assert floor > term.epoch
    assert lines[-1] == "  its terms' epochs continue above every earlier one"

    # The roll: a replica on the new bucket waits while the old bucket's
    # leader leads; the old follower, once that leader is gone, does not
    # start a term on the moved bucket; the first term on the new bucket
    # gets the floor as its epoch.
    with Elector(app.conf.nats_leader_servers[0], name="test-new") as elector:
        handle = elector.add_role(ElectionConfig(role="default", bucket=new, ttl=5.0))
        assert not handle.wait_for_leadership(1.0)
        old_leader = next(e for e in two.values() if e.role("default").is_leader)
        follower = next(e for e in two.values() if e is not old_leader)
        old_role = follower.role("default")
        promoted: list[object] = []
        old_role.on_promote(promoted.append)
        old_leader.stop()  # releases its key
        assert handle.wait_for_leadership(5) and handle.token is not None
        assert handle.token.epoch == floor
        # The old follower may still be between its create on the old
        # bucket and reading the mark; it ends a follower, never a leader.
        wait_for(lambda: old_role.state.value == "follower", 5, "the old follower to settle")
        assert promoted == [] and not old_role.is_leader and handle.is_leader

    # Run again once a candidate used the new bucket: refused, nothing changed.
    again = cli(app, "bucket", "--bucket", new, "--ttl", "5", "--migrate-from", bucket)
    assert again.exit_code == 2
    assert f"KV bucket {new!r} already holds 1 entries: candidates use it" in again.stderr
    missing = cli(app, "bucket", "--bucket", f"{bucket}_x", "--migrate-from", "nosuch")
    assert missing.exit_code == 2
    assert "KV bucket 'nosuch' does not exist: nothing to carry the epoch floor from" in (
        missing.stderr
    )
    assert cli(app, "bucket", "--migrate-from", bucket, "--once").exit_code == 2


def test_bucket_with_the_leader_beat_scheduler(app: Celery, bucket: str) -> None:
    app.conf.beat_scheduler = "nats_leader"
    created = cli(app, "bucket", "--create", "--json")
    assert created.exit_code == 0, created.output
    entries = {e["kind"]: e for e in json.loads(created.stdout)["buckets"]}
    assert list(entries) == ["election", "beat_state", "once_leases", "once_done"]
    assert entries["election"]["ttl"] == TTL
    assert entries["beat_state"]["name"] == f"{bucket}_beat"
    assert entries["beat_state"]["ttl"] == 0  # the schedule's state never expires
    # Ticks run once by default: the buckets workers claim them in, made by
    # the same command (a least-privilege worker may not create them).
    assert (entries["once_leases"]["name"], entries["once_done"]["name"]) == (
        f"{bucket}_once_leases",
        f"{bucket}_once",
    )
    assert all(e["created"] for e in entries.values())
    # A plain --delete leaves the once-guard's memory of finished runs.
    deleted = cli(app, "bucket", "--delete", "--yes", "--json")
    assert deleted.exit_code == 0, deleted.output
    kinds = [e["kind"] for e in json.loads(deleted.stdout)["buckets"]]
    assert kinds == ["election", "beat_state"]
    remaining = json.loads(cli(app, "bucket", "--once", "--json").stdout)["buckets"]
    assert [e["exists"] for e in remaining] == [True, True]

    # Ticks not run once: the once-guard's buckets are not the deployment's.
    app.conf.nats_leader_beat_once = False
    checked = json.loads(cli(app, "bucket", "--json").stdout)["buckets"]
    assert [e["kind"] for e in checked] == ["election", "beat_state"]


def test_bucket_once_creates_what_the_once_guard_opens(app: Celery, bucket: str) -> None:
    app.conf.nats_leader_once_lease = 12.0
    missing = cli(app, "bucket", "--once")
    assert missing.exit_code == 1, missing.output
    assert "  create it with `celery -A cli nats-leader bucket --create --once`" in (
        missing.stdout.splitlines()
    )
    created = cli(app, "bucket", "--create", "--once", "--json")
    assert created.exit_code == 0, created.output
    entries = {e["kind"]: e for e in json.loads(created.stdout)["buckets"]}
    assert set(entries) == {"once_leases", "once_done"}  # the election's apart
    assert (entries["once_leases"]["name"], entries["once_leases"]["ttl"]) == (
        f"{bucket}_once_leases",
        12.0,
    )
    assert (entries["once_done"]["name"], entries["once_done"]["ttl"]) == (
        f"{bucket}_once",
        86400.0,
    )
    assert all(e["created"] and e["history"] == 1 for e in entries.values())

    # The worker's once-guard opens them as they are (it refuses a bucket
    # whose max_age differs from its setting) and can claim in them.
    service = OnceService.for_settings(settings_of_app(app))
    try:

        async def claim(guard: OnceGuard) -> Verdict:
            return (await guard.claim("cli-made")).verdict

        assert service.run(claim) is Verdict.RUN
    finally:
        service.close()
    # ... in the buckets the command made (had the names differed, the guard
    # would have created its own and these would still be empty).
    listed = json.loads(cli(app, "bucket", "--once", "--json").stdout)["buckets"]
    assert [(e["kind"], e["keys"]) for e in listed] == [("once_leases", 1), ("once_done", 0)]

    # A lease setting that no longer fits the bucket: the check says which
    # setting and how to fix it.
    app.conf.nats_leader_once_lease = 5.0
    checked = cli(app, "bucket", "--once")
    assert checked.exit_code == 1, checked.output
    lines = checked.stdout.splitlines()
    assert f"once-guard lease bucket {bucket + '_once_leases'!r} exists" in lines
    assert "  fits the once-guard settings" in lines  # the done bucket
    assert (
        "  problem: max_age is 12s but once_lease is 5s: they must be equal "
        "(delete and recreate the bucket, or set once_lease to 12)"
    ) in lines
    assert cli(app, "bucket", "--once", "--delete", "--yes").exit_code == 0
    assert cli(app, "bucket", "--once").exit_code == 1  # both gone
    assert cli(app, "bucket", "--bucket", bucket, "--once").exit_code == 2


def test_bucket_with_another_ttl_says_how_to_fix_it(app: Celery, bucket: str) -> None:
    # --ttl overrides the settings: the bucket fits what was asked for...
    assert cli(app, "bucket", "--create", "--ttl", "5").exit_code == 0
    # ... but not the configured elections (TTL 2 s).
    checked = cli(app, "bucket")
    assert checked.exit_code == 1, checked.output
    # The hint uses the configured TTL, not a default.
    assert (
        "  problem: max_age is 5s but the election ttl is 2s: they must be equal "
        "(recreate the bucket with --ttl 2, or set TTL to 5)"
    ) in checked.stdout.splitlines()
    assert cli(app, "bucket", "--delete", "--yes").exit_code == 0


def test_bucket_unreachable_server_exits_2(app: Celery) -> None:
    app.conf.nats_leader_servers = ["nats://127.0.0.1:1"]
    result = cli(app, "bucket", "--timeout", "1")
    assert result.exit_code == 2
    assert "cannot use the buckets" in result.output


def test_status_requires_a_beat_leader_when_beat_runs_under_the_leader_scheduler(
    app: Celery, two: dict[str, Elector]
) -> None:
    # "default" has a leader (cand-a). With a leader scheduler configured and
    # no beat running, the beat role is configured and leaderless: exit 1.
    # It used to check only nats_leader_roles and exit 0.
    ok = cli(app, "status", "--json")
    assert ok.exit_code == 0, ok.output
    app.conf.beat_scheduler = "nats_leader"
    missing = cli(app, "status", "--json")
    assert missing.exit_code == 1, missing.output
    doc = json.loads(missing.stdout)
    roles = {role["role"]: role for role in doc["roles"]}
    assert roles["beat"]["has_leader"] is False
    assert roles["default"]["leader_id"] == "cand-a"
    # Another scheduler: beat is not ours to check.
    app.conf.beat_scheduler = "celery.beat:PersistentScheduler"
    assert cli(app, "status").exit_code == 0
