"""The management commands against a real nats-server with live candidates in this process."""

from __future__ import annotations

import json
import re
import socket
from datetime import datetime, timedelta, timezone
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from celery_nats_leader import ElectionConfig, Elector
from celery_nats_leader.testing import NatsServer, free_port
from tests.django.conftest import Candidates

pytestmark = pytest.mark.integration


def run(*args: str) -> tuple[str, str]:
    out, err = StringIO(), StringIO()
    call_command(*args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def run_failing(*args: str) -> tuple[CommandError, str]:
    out = StringIO()
    with pytest.raises(CommandError) as info:
        call_command(*args, stdout=out, stderr=StringIO())
    return info.value, out.getvalue()


@pytest.fixture
def two(candidates: Candidates, nats_leader: Any) -> Candidates:
    """cand-a (priority 5) leads default and beat; cand-b (priority 1) follows both."""
    candidates.start("cand-a", roles=("default", "beat"), priority=5)
    candidates.start("cand-b", roles=("default", "beat"), priority=1)
    assert candidates.handle("cand-a").wait_for_leadership(5)
    assert candidates.handle("cand-a", "beat").wait_for_leadership(5)
    return candidates


# ------------------------------------------------------------ election_status


def test_status_json_field_by_field(two: Candidates, nats_server: NatsServer, bucket: str) -> None:
    leader = two.handle("cand-a")
    token = leader.token
    assert token is not None

    out, _ = run("election_status", "--json")
    doc = json.loads(out)

    assert doc["schema_version"] == 1
    assert doc["bucket"] == bucket
    assert doc["servers"] == [nats_server.url]
    assert doc["configured_roles"] == ["default"]
    assert doc["leaderless"] == []
    assert doc["healthy"] is True
    assert [r["role"] for r in doc["roles"]] == ["beat", "default"]

    beat, default = doc["roles"]
    assert beat["configured"] is False  # held, shown, but not required by ROLES
    assert beat["leader_id"] == "cand-a"

    assert set(default) == {
        "role",
        "configured",
        "has_leader",
        "leader_id",
        "epoch",
        "revision",
        "priority",
        "term_age",
        "expires_in",
        "leader_meta",
        "candidates",
        "problem",
        "answering",
        "expires_within",
        "fenced",
        "note",
        "successor",
    }
    assert default["successor"] is None  # no fast failover here
    assert default["role"] == "default"
    assert default["configured"] is True
    assert default["has_leader"] is True
    assert default["leader_id"] == "cand-a"
    assert default["epoch"] == token.epoch
    assert default["revision"] >= token.epoch
    assert default["priority"] == 5
    assert 0 <= default["term_age"] < 60
    # The key expires at most one TTL after the leader's last renewal.
    assert 0 < default["expires_in"] <= 2.0
    assert default["leader_meta"]["pid"] == __import__("os").getpid()
    assert default["leader_meta"]["hostname"] == socket.gethostname()
    assert default["problem"] is None

    first, second = default["candidates"]
    assert set(first) == {
        "id",
        "state",
        "priority",
        "is_leader",
        "epoch",
        "term_age",
        "lease_remaining",
        "last_heartbeat_age",
        "meta",
    }
    assert (first["id"], first["state"], first["is_leader"]) == ("cand-a", "leader", True)
    assert first["priority"] == 5
    assert first["epoch"] == token.epoch
    assert 0 <= first["last_heartbeat_age"] < 2.0
    assert 0 < first["lease_remaining"] <= 2.0
    assert (second["id"], second["state"], second["is_leader"]) == ("cand-b", "follower", False)
    assert second["priority"] == 1
    assert second["epoch"] is None
    assert second["last_heartbeat_age"] is None


def test_status_table(two: Candidates, bucket: str) -> None:
    token = two.handle("cand-a").token
    assert token is not None
    out, _ = run("election_status")
    lines = out.splitlines()
    assert lines[0].startswith(f"Bucket '{bucket}' on nats://127.0.0.1:")
    assert lines[0].endswith(": 2 roles, all led")
    header = next(line for line in lines if line.startswith("ROLE"))
    assert header.split() == ["ROLE", "LEADER", "EPOCH", "TERM", "AGE", "EXPIRES", "IN", "HOST"]
    default_row = next(line for line in lines if line.startswith("default "))
    assert default_row.split()[:3] == ["default", "cand-a", str(token.epoch)]
    assert "default: 2 live candidates" in out
    leader_line = next(line for line in lines if "cand-a" in line and "leader" in line.split())
    assert leader_line.split()[:4] == ["*", "cand-a", "leader", "5"]
    assert leader_line.split()[5].endswith("s")  # last heartbeat "0.3s ago"
    follower = next(line for line in lines if line.split()[:2] == ["cand-b", "follower"])
    assert follower.split()[2] == "1"


def test_status_only_one_role(two: Candidates) -> None:
    out, _ = run("election_status", "--json", "--role", "beat")
    doc = json.loads(out)
    assert [r["role"] for r in doc["roles"]] == ["beat"]
    assert doc["configured_roles"] == ["beat"]
    assert doc["roles"][0]["configured"] is True


def test_status_exits_1_when_a_role_has_no_leader(two: Candidates, nats_leader: Any) -> None:
    nats_leader(ROLES=["default", "reports"])
    error, out = run_failing("election_status")
    assert error.returncode == 1
    assert "reports" in str(error)
    assert "NO LEADER: reports" in out
    reports = next(line for line in out.splitlines() if line.startswith("reports "))
    assert "-- none --" in reports

    error, out = run_failing("election_status", "--json")
    assert error.returncode == 1
    doc = json.loads(out)
    assert doc["healthy"] is False
    assert doc["leaderless"] == ["reports"]
    reports_doc = next(r for r in doc["roles"] if r["role"] == "reports")
    assert reports_doc["has_leader"] is False
    assert reports_doc["leader_id"] is None
    assert reports_doc["candidates"] == []


def test_status_watch_refreshes(two: Candidates) -> None:
    out, _ = run("election_status", "--watch", "--count", "3", "--interval", "0.1", "--json")
    docs = [json.loads(line) for line in out.splitlines()]
    assert len(docs) == 3
    assert all(d["roles"][1]["leader_id"] == "cand-a" for d in docs)
    # Each refresh says which one it is and when it was read.
    assert [d["refresh"] for d in docs] == [1, 2, 3]
    times = [datetime.fromisoformat(d["refreshed_at"].replace("Z", "+00:00")) for d in docs]
    assert times == sorted(times) and times[0] < times[-1]
    assert all(abs(t - datetime.now(timezone.utc)) < timedelta(minutes=1) for t in times)
    out, _ = run("election_status", "--watch", "--count", "2", "--interval", "0.1")
    assert out.count("Bucket '") == 2
    separators = re.findall(r"^--- (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) UTC, refresh (\d+)$", out, re.M)
    assert [n for _, n in separators] == ["1", "2"], out
    # The separator comes first, then that refresh's table.
    assert out.index("refresh 1") < out.index("Bucket '") < out.index("refresh 2")


def test_status_invalid_role_exits_2(two: Candidates) -> None:
    error, _ = run_failing("election_status", "--role", "no such role")
    assert error.returncode == 2
    assert "not a valid role name" in str(error)


def test_status_unreachable_server_exits_2(settings: Any) -> None:
    settings.NATS_LEADER = {"SERVERS": [f"nats://127.0.0.1:{free_port()}"], "ROLES": ["x"]}
    error, _ = run_failing("election_status", "--timeout", "1")
    assert error.returncode == 2
    assert "cannot read the elections" in str(error)


def test_status_missing_bucket_exits_2(nats_leader: Any) -> None:
    error, _ = run_failing("election_status")
    assert error.returncode == 2
    assert "does not exist" in str(error)


def test_status_reads_settings_when_used(two: Candidates, settings: Any) -> None:
    settings.NATS_LEADER = {**settings.NATS_LEADER, "ROLES": ["beat"]}
    out, _ = run("election_status", "--json")
    assert json.loads(out)["configured_roles"] == ["beat"]


# ------------------------------------------------------------ election_resign


def test_resign_hands_over(two: Candidates) -> None:
    old = two.handle("cand-a").token
    assert old is not None
    out, _ = run("election_resign", "default")
    lines = out.splitlines()
    assert lines[0] == f"cand-a stepped down from role 'default' (epoch {old.epoch})"
    # The command saw cand-b's record; cand-b learns it won when its write is acked.
    assert two.handle("cand-b").wait_for_leadership(2)
    new = two.handle("cand-b").token
    assert new is not None and new.epoch > old.epoch
    assert lines[1].startswith(f"new leader of 'default': cand-b (epoch {new.epoch}) after ")
    assert two.handle("cand-b").is_leader
    assert not two.handle("cand-a").is_leader
    # The other role was not touched.
    assert two.handle("cand-a", "beat").is_leader


def test_resign_json(two: Candidates) -> None:
    old = two.handle("cand-a", "beat").token
    assert old is not None
    out, _ = run("election_resign", "beat", "--json")
    doc = json.loads(out)
    assert doc["role"] == "beat"
    assert doc["accepted"] is True
    assert doc["answered_by"] == "cand-a"
    assert doc["stepped_down"]["id"] == "cand-a"
    assert doc["stepped_down"]["epoch"] == old.epoch
    assert doc["new_leader"]["id"] == "cand-b"
    assert doc["new_leader"]["epoch"] > old.epoch
    assert 0 < doc["handover_seconds"] < 2.0


def test_resign_without_leader(two: Candidates) -> None:
    error, _ = run_failing("election_resign", "reports")
    assert error.returncode == 1
    assert "nobody leads role 'reports'" in str(error)


def test_resign_invalid_role(two: Candidates) -> None:
    error, _ = run_failing("election_resign", "not a role")
    assert error.returncode == 2


# ------------------------------------------------------------ election_bucket


def test_bucket_inspect(two: Candidates, bucket: str) -> None:
    out, _ = run("election_bucket")
    assert out.splitlines()[0] == f"election bucket '{bucket}' exists"
    fields = dict(line.strip().rsplit(None, 1) for line in out.splitlines()[1:6])
    assert fields == {
        "max_age (TTL)": "2s",
        "history": "1",
        "replicas": "1",
        "storage": "file",
        "entries": fields["entries"],
    }
    assert "fits the election settings" in out
    out, _ = run("election_bucket", "--json")
    doc = json.loads(out)
    assert doc["ok"] is True
    (entry,) = doc["buckets"]
    assert entry == {
        "name": bucket,
        "kind": "election",
        "exists": True,
        "ttl": 2.0,
        "history": 1,
        "replicas": 1,
        "storage": "file",
        "keys": entry["keys"],
        "created": False,
        "description": "",  # a TTL change's marks would be here
        "problems": [],
    }
    assert entry["keys"] >= 2  # one entry per held role
    error, out = run_failing("election_bucket", "--replicas", "3")
    assert error.returncode == 1
    assert "problem: replicas is 1, expected 3" in out


def test_bucket_ttl_mismatch(two: Candidates, nats_leader: Any) -> None:
    nats_leader(TTL=5)
    error, out = run_failing("election_bucket")
    assert error.returncode == 1
    assert "max_age is 2s but the election ttl is 5s" in out


def test_bucket_missing_then_created(
    nats_leader: Any, nats_server: NatsServer, bucket: str
) -> None:
    nats_leader(TTL=3, ROLES=["default"])
    error, out = run_failing("election_bucket")
    assert error.returncode == 1
    assert f"election bucket '{bucket}' does not exist" in out
    assert "--create" in out

    out, _ = run("election_bucket", "--create", "--json")
    (doc,) = json.loads(out)["buckets"]
    assert (doc["created"], doc["ttl"], doc["history"], doc["replicas"]) == (True, 3.0, 1, 1)
    assert doc["problems"] == []
    # An election that may not create buckets accepts it.
    elector = Elector(nats_server.url)
    handle = elector.add_role(ElectionConfig(role="default", bucket=bucket, ttl=3))
    try:
        elector.start(timeout=10)
        assert handle.wait_for_leadership(5)
    finally:
        elector.stop()
    # Creating again is harmless and says so.
    out, _ = run("election_bucket", "--create")
    assert f"election bucket '{bucket}' exists" in out


def test_bucket_beat_state(nats_leader: Any, settings: Any, bucket: str) -> None:
    # With the leader beat scheduler, the schedule's state bucket is managed too.
    settings.CELERY_BEAT_SCHEDULER = "celery_nats_leader.beat:LeaderScheduler"
    error, out = run_failing("election_bucket", "--json")
    assert error.returncode == 1
    doc = json.loads(out)
    assert doc["ok"] is False
    # Ticks run once by default: the once-guard's buckets are the deployment's too.
    assert [(b["name"], b["kind"], b["exists"]) for b in doc["buckets"]] == [
        (bucket, "election", False),
        (f"{bucket}_beat", "beat_state", False),
        (f"{bucket}_once_leases", "once_leases", False),
        (f"{bucket}_once", "once_done", False),
    ]
    out, _ = run("election_bucket", "--create", "--json")
    doc = json.loads(out)
    assert doc["ok"] is True
    election, state, leases, done = doc["buckets"]
    assert (leases["ttl"], leases["created"], done["ttl"], done["created"]) == (
        30.0,
        True,
        86400.0,
        True,
    )
    assert (election["ttl"], election["created"]) == (2.0, True)
    assert (state["name"], state["ttl"], state["history"], state["created"]) == (
        f"{bucket}_beat",
        0.0,
        1,
        True,
    )
    out, _ = run("election_bucket")
    assert f"beat state bucket '{bucket}_beat' exists" in out
    assert "max_age (TTL)  none" in out


def test_bucket_invalid_settings(settings: Any) -> None:
    settings.NATS_LEADER = {"TTL": "soon"}
    error, _ = run_failing("election_bucket")
    assert error.returncode == 2
    assert "invalid NATS_LEADER settings" in str(error)


def test_bucket_once_guard(nats_leader: Any, bucket: str) -> None:
    nats_leader(TTL=2, ROLES=["default"], ONCE_LEASE=9)
    out, _ = run("election_bucket", "--create", "--once", "--json")
    doc = json.loads(out)
    assert doc["ok"] is True
    assert [(b["name"], b["kind"], b["ttl"], b["created"]) for b in doc["buckets"]] == [
        (f"{bucket}_once_leases", "once_leases", 9.0, True),
        (f"{bucket}_once", "once_done", 86400.0, True),
    ]
    nats_leader(TTL=2, ROLES=["default"], ONCE_LEASE=4)
    error, out = run_failing("election_bucket", "--once")
    assert error.returncode == 1
    assert "max_age is 9s but once_lease is 4s: they must be equal" in out
