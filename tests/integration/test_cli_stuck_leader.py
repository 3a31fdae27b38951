"""``celery -A proj nats-leader status --strict`` and ``fence`` on a frozen leader.

The Celery command is run as an operator runs it (a subprocess, with a Celery
app module of its own); the candidates are processes, the leader frozen with
SIGSTOP.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_nats_leader.testing import NatsServer
from tests.harness.candidate_control import CandidateGroup
from tests.integration.helpers import ROLE

pytestmark = pytest.mark.integration

#: Long enough that the CLI runs before the fence (Celery start-up is slow on a loaded
#: machine) end before a frozen leader's key could expire: the fence, not the TTL, acts.
TTL = 30.0
BUCKET = "clifence"
CELERY = str(Path(sys.executable).with_name("celery"))


@pytest.fixture
def app_dir(nats_server: NatsServer, tmp_path: Path) -> Path:
    """A directory with ``opsapp.py``, a Celery app configured for this server.

    The bucket and the events stream are made by the ``bucket`` command.
    """
    (tmp_path / "opsapp.py").write_text(
        textwrap.dedent(
            f"""
            from celery import Celery

            app = Celery("opsapp", set_as_current=False)
            app.conf.update(
                nats_leader_servers={nats_server.url!r},
                nats_leader_bucket={BUCKET!r},
                nats_leader_roles=[{ROLE!r}],
                nats_leader_ttl={TTL!r},
            )
            """
        )
    )
    made = cli(tmp_path, "bucket", "--create", "--events-max-age", "600", "--json")
    assert made.returncode == 0, made.stdout + made.stderr
    stream = json.loads(made.stdout)["events_stream"]
    assert (stream["created"], stream["max_age"]) == (True, 600.0)
    return tmp_path


@pytest.fixture
def frozen(nats_server: NatsServer, app_dir: Path) -> Iterator[tuple[CandidateGroup, int]]:
    """Candidates "a" (the leader, frozen) and "b" (following it). Yields (group, a's epoch)."""
    with CandidateGroup(nats_server.url, role=ROLE, bucket=BUCKET, ttl=TTL) as group:
        group.spawn("a")
        first = group.wait_for("promoted", {"a"}, timeout=30)
        group.spawn("b")
        group.wait_for("leader", {"b"}, timeout=30, where=lambda e: e["leader_id"] == "a")
        group["a"].pause()
        yield group, first["epoch"]
        group["a"].resume()


def cli(app_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CELERY, "-A", "opsapp", "nats-leader", *args],
        cwd=app_dir,
        env={**os.environ, "PYTHONPATH": str(app_dir)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_status_strict_and_fence_on_a_frozen_leader(
    frozen: tuple[CandidateGroup, int], app_dir: Path
) -> None:
    group, epoch = frozen
    plain = cli(app_dir, "status")
    assert plain.returncode == 0, plain.stderr
    assert "a (not answering)" in plain.stdout
    assert f"{ROLE}: a: not answering; its key expires within " in plain.stdout

    strict = cli(app_dir, "status", "--strict", "--json")
    assert strict.returncode == 1, strict.stderr
    doc = json.loads(strict.stdout)
    assert (doc["leaderless"], doc["silent"]) == ([], [ROLE])
    (role,) = doc["roles"]
    assert role["answering"] is False and 0 < role["expires_within"] <= TTL

    fenced = cli(app_dir, "fence", ROLE, "--json")
    assert fenced.returncode == 0, fenced.stderr
    outcome = json.loads(fenced.stdout)
    # Asked first; a frozen leader cannot answer, so it was fenced, and the output says so.
    assert (outcome["action"], outcome["reason"]) == (
        "fenced",
        "it did not answer a request to hand over within 1s",
    )
    assert outcome["fenced"] == {"id": "a", "epoch": epoch}
    assert outcome["new_leader"]["id"] == "b"
    assert outcome["promoted_after"] < 0.1
    group.wait_for("promoted", {"b"}, timeout=5)

    group["a"].resume()
    assert not group.validate("a")
    assert group.wait_for("demoted", {"a"}, timeout=5)["reason"] == "fenced"
    after = cli(app_dir, "status", "--strict")
    assert after.returncode == 0, after.stdout + after.stderr
    assert "not answering" not in after.stdout

    events = cli(app_dir, "events", "--role", ROLE, "--json")
    assert events.returncode == 0, events.stderr
    kept = [json.loads(line) for line in events.stdout.splitlines()]
    assert [(e["id"], e["event"], e["epoch"]) for e in kept] == [
        ("a", "promoted", epoch),
        ("b", "promoted", outcome["new_leader"]["epoch"]),
        ("a", "fenced", epoch),
    ]
    again = cli(app_dir, "fence", ROLE, "--epoch", str(epoch))
    assert again.returncode == 1
    assert f"not {epoch}; nothing fenced" in again.stderr


def test_fence_on_a_live_leader_hands_over_cleanly(nats_server: NatsServer, app_dir: Path) -> None:
    """A leader that answers hands over (no overlap) and the command says so, exit 0."""
    with CandidateGroup(nats_server.url, role=ROLE, bucket=BUCKET, ttl=TTL) as group:
        group.spawn("a")
        first = group.wait_for("promoted", {"a"}, timeout=30)
        group.spawn("b")
        group.wait_for("leader", {"b"}, timeout=30, where=lambda e: e["leader_id"] == "a")

        done = cli(app_dir, "fence", ROLE)
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert lines[0] == (
            f"a (epoch {first['epoch']}) handed {ROLE!r} over cleanly on request (nothing fenced)"
        )
        second = group.wait_for("promoted", {"b"}, timeout=5)
        assert lines[1].startswith(f"new leader of {ROLE!r}: b (epoch {second['epoch']}) after ")
        demoted = group.wait_for("demoted", {"a"}, timeout=5)
        assert demoted["reason"] == "resigned"
        assert demoted.at < second.at  # this host's monotonic clock: no overlap


def test_release_hands_over_only_the_roles_led_from_this_host(
    nats_server: NatsServer, app_dir: Path
) -> None:
    """The preStop hook: ``nats-leader release`` before the pod gets SIGTERM."""
    with CandidateGroup(nats_server.url, role=ROLE, bucket=BUCKET, ttl=TTL) as group:
        group.spawn("a")
        first = group.wait_for("promoted", {"a"}, timeout=30)
        group.spawn("b")
        group.wait_for("leader", {"b"}, timeout=30, where=lambda e: e["leader_id"] == "a")

        elsewhere = cli(app_dir, "release", "--host", "some-other-pod")
        assert elsewhere.returncode == 0, elsewhere.stderr
        assert "no role of bucket 'clifence' is led from some-other-pod" in elsewhere.stdout
        assert group.validate("a")

        here = cli(app_dir, "release")  # this host: where both candidates run
        assert here.returncode == 0, here.stderr
        assert f"{ROLE}: a stepping down" in here.stdout
        assert group.wait_for("demoted", {"a"}, timeout=5)["reason"] == "resigned"
        second = group.wait_for("promoted", {"b"}, timeout=5)
        assert second["epoch"] > first["epoch"]
