"""``manage.py election_events`` and the events stream of ``election_bucket``."""

from __future__ import annotations

import json
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command

from tests.django.conftest import Candidates

pytestmark = pytest.mark.integration


def run(*args: str) -> tuple[str, str]:
    out, err = StringIO(), StringIO()
    call_command(*args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def test_bucket_creates_the_stream_and_events_lists_the_transitions(
    candidates: Candidates, nats_leader: Any, bucket: str
) -> None:
    out, _ = run("election_bucket", "--create", "--events-max-age", "3600", "--json")
    stream = json.loads(out)["events_stream"]
    assert (stream["created"], stream["max_age"], stream["messages"]) == (True, 3600.0, 0)
    assert stream["subjects"] == [f"_NATS_LEADER_EVENTS.{bucket}.>"]
    # A second run finds it, created nothing.
    out, _ = run("election_bucket", "--events-max-age", "3600", "--json")
    assert json.loads(out)["events_stream"]["created"] is False

    candidates.start("cand-a", priority=5)
    candidates.start("cand-b", priority=1)
    first = candidates.handle("cand-a").token
    assert first is not None
    run("election_resign", "default")
    assert candidates.handle("cand-b").wait_for_leadership(5)
    second = candidates.handle("cand-b").token
    assert second is not None

    out, err = run("election_events", "--json", "--role", "default")
    lines = [json.loads(line) for line in out.splitlines()]
    assert [(e["id"], e["event"], e["reason"], e["epoch"]) for e in lines] == [
        ("cand-a", "promoted", None, first.epoch),
        ("cand-a", "resigned", "resigned", first.epoch),
        ("cand-b", "promoted", None, second.epoch),
    ]
    assert err == ""
    assert all(e["stored_at"] and e["stream_seq"] for e in lines)

    out, _ = run("election_events", "--limit", "1")
    (line,) = out.splitlines()
    assert line.endswith(f"default  epoch {second.epoch}  promoted  cand-b"), line


def test_events_without_a_stream_says_so(candidates: Candidates, nats_leader: Any) -> None:
    candidates.start("cand-a")
    out, err = run("election_events")
    assert out == ""
    assert "no events stream for bucket" in err
