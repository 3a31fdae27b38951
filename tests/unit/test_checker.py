"""The soak's checker on hand-made event logs: each kind of violation is caught."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.chaos.checker import Event, check, load_events

TTL = 2.0


def ev(t: float, proc: str, kind: str, **data: Any) -> Event:
    return Event(t, proc, kind, {"t": t, "proc": proc, "kind": kind, **data})


def clean_failover() -> list[Event]:
    """c1 leads, is SIGKILLed at 10.0, c2 leads at 12.03: no violation."""
    return [
        ev(1.0, "c1", "promote", role="r", epoch=3, lease=1.8),
        ev(1.1, "c1", "write", resource="file", role="r", epoch=3, accepted=True),
        ev(9.99, "chaos", "fault", fault="sigkill", target="c1"),
        ev(10.0, "c1", "killed"),
        ev(12.03, "c2", "promote", role="r", epoch=9, lease=1.8),
        ev(12.04, "c2", "write", resource="file", role="r", epoch=9, accepted=True),
        ev(20.0, "c2", "demote", role="r", reason="stopped"),
    ]


def test_a_clean_failover_passes_and_measures_the_leaderless_time() -> None:
    report = check(clean_failover(), ttl=TTL)
    assert report.ok, report.violations
    assert report.overlap_seconds == 0.0
    (fault,) = report.faults
    assert fault.kind == "sigkill" and fault.survived
    assert fault.leaderless["r"] == pytest.approx(12.03 - 9.99)
    assert fault.bound == pytest.approx(TTL + 0.05)
    assert report.writes == {"accepted": 2}
    assert "| sigkill | 1 | 1 | 1 | 2040 ms |" in report.table()


def test_overlap_is_caught() -> None:
    events = clean_failover()
    # c1 was not killed after all, and led until 12.5: 470 ms beside c2.
    events = [e for e in events if e.kind != "killed"]
    events.append(ev(12.5, "c1", "demote", role="r", reason="lease_expired"))
    report = check(events, ttl=TTL)
    kinds = [v.kind for v in report.violations]
    assert kinds == ["overlap"]
    assert report.overlap_seconds == pytest.approx(0.47)
    assert "c1 and c2 both led 'r'" in report.violations[0].detail


def test_a_paused_leader_is_no_overlap_and_its_lease_ended_in_the_pause() -> None:
    events = [
        ev(1.0, "c1", "promote", role="r", epoch=3, lease=1.8),
        ev(5.0, "c1", "paused"),
        ev(5.0, "chaos", "fault", fault="sigstop", target="c1"),
        ev(7.02, "c2", "promote", role="r", epoch=9, lease=1.8),
        ev(8.0, "c1", "resumed"),
        # The demote line comes after the resume: the lease was over by then.
        ev(8.004, "c1", "demote", role="r", reason="lease_expired"),
        ev(12.0, "c2", "demote", role="r", reason="stopped"),
    ]
    report = check(events, ttl=TTL)
    assert report.ok, report.violations
    assert report.faults[0].leaderless["r"] == pytest.approx(2.02)
    # A short pause (shorter than the lease) keeps the lease: a leader in
    # the same instant is an overlap.
    short = [
        ev(1.0, "c1", "promote", role="r", epoch=3, lease=1.8),
        ev(5.0, "c1", "paused"),
        ev(5.5, "c2", "promote", role="r", epoch=9, lease=1.8),
        ev(6.0, "c1", "resumed"),
        ev(6.2, "c1", "demote", role="r", reason="revision_changed"),
    ]
    assert [v.kind for v in check(short, ttl=TTL).violations] == ["overlap"]


def test_a_stale_fenced_write_is_caught() -> None:
    events = [
        *clean_failover(),
        # A write with the old epoch accepted after the new leader's write.
        ev(12.05, "c1-old", "write", resource="pg", role="r", epoch=9, accepted=True),
        ev(12.06, "c1-old", "write", resource="pg", role="r", epoch=3, accepted=True),
        # Rejected stale writes are the fence working, not a violation.
        ev(12.07, "c1-old", "write", resource="file", role="r", epoch=3, accepted=False),
    ]
    report = check(events, ttl=TTL)
    assert [v.kind for v in report.violations] == ["stale write"]
    # After the operator cleared the fences (bucket recreated), epochs restart.
    reset = [*events, ev(13.0, "chaos", "fence_reset")]
    reset.append(ev(13.1, "c3", "write", resource="pg", role="r", epoch=1, accepted=True))
    assert [v.kind for v in check(reset, ttl=TTL).violations] == ["stale write"]
    assert "pg accepted epoch 3 from c1-old for 'r' after epoch 9" in report.violations[0].detail
    assert report.writes == {"accepted": 4, "rejected": 1}


def test_a_tick_lost_between_runs_is_placed_where_the_next_tick_ran() -> None:
    # The soak's shape: only the worker's ledger (no "tick" lines); the
    # second 150 never ran between 149 and 151. The violation is placed at
    # the run of 151, not at 0.0 (no dispatch time exists).
    events = [
        ev(10.0, "ledger", "run", tick="every-second@148", task="t148"),
        ev(11.0, "ledger", "run", tick="every-second@149", task="t149"),
        ev(13.0, "ledger", "run", tick="every-second@151", task="t151"),
        ev(14.0, "ledger", "run", tick="every-second@147", task="t147"),  # a late retry
    ]
    report = check(events, ttl=TTL)
    assert [(v.kind, v.at) for v in report.violations] == [("tick lost", 13.0)]
    assert report.violations[0].detail.endswith(": every-second@150")
    assert report.ticks == {"ran": 4, "twice": 0, "lost": 1}


def test_a_tick_run_twice_and_a_lost_tick_are_caught() -> None:
    events = [
        ev(1.0, "beat1", "tick", tick="every-second@100"),
        ev(1.1, "w1", "run", tick="every-second@100", task="t100"),
        ev(2.0, "beat1", "tick", tick="every-second@101"),
        ev(2.1, "w1", "run", tick="every-second@101", task="t101"),
        ev(2.2, "w2", "run", tick="every-second@101", task="t101"),
        # 102 never dispatched: lost in a failover.
        ev(4.0, "beat2", "tick", tick="every-second@103"),
        ev(4.1, "w2", "run", tick="every-second@103", task="t103"),
    ]
    report = check(events, ttl=TTL)
    assert sorted(v.kind for v in report.violations) == ["tick lost", "tick twice"]
    assert report.ticks == {"dispatched": 3, "ran": 3, "twice": 1, "lost": 1}
    # The documented loss window allows one lost tick: the duplicate remains.
    allowed = check(events, ttl=TTL, loss_window_ticks=1)
    assert [v.kind for v in allowed.violations] == ["tick twice"]


def test_a_lost_leader_only_task_is_caught() -> None:
    events = [
        ev(1.0, "sender", "sent", task="a"),
        ev(1.0, "sender", "sent", task="b"),
        ev(1.5, "w1", "run", task="a"),
        ev(9.0, "sender", "sent", task="late"),
    ]
    report = check(events, ttl=TTL, drain_until=5.0)
    assert [v.kind for v in report.violations] == ["task lost"]
    assert "1 leader-only task(s) never ran: b" in report.violations[0].detail
    assert report.tasks == {"sent": 3, "ran": 1, "twice": 0, "lost": 1}


def test_a_task_popped_by_a_killed_worker_is_the_broker_window_and_nothing_else() -> None:
    # kombu's Redis transport takes a message off the queue before recording
    # it as unacknowledged: a worker killed in between loses it. Only a task
    # no worker received and none left in the broker, sent before the kill of
    # a worker reading the leader queue, one per kill, is that.
    events = [
        ev(0.5, "w1", "promote", role="tasks", epoch=1),
        ev(1.0, "sender", "sent", task="a"),
        ev(1.1, "tasks", "received", task="a", worker="w1"),
        ev(1.2, "tasks", "run", task="a", worker="w1"),
        ev(1.3, "tasks", "received", task="x", worker="w3"),  # w3: a worker, never leads
        ev(2.0, "sender", "sent", task="popped"),
        ev(2.0, "sender", "sent", task="second"),
        ev(2.0, "sender", "sent", task="third"),
        ev(2.0, "sender", "sent", task="queued"),
        ev(2.05, "w3", "killed"),  # a follower: not reading the leader queue
        ev(2.1, "w1", "killed"),
        ev(2.5, "w2", "promote", role="tasks", epoch=2),
        ev(3.0, "sender", "sent", task="received"),
        ev(3.1, "tasks", "received", task="received", worker="w2"),
        ev(3.15, "w2", "demote", role="tasks", reason="lease_expired"),
        ev(3.2, "w2", "killed"),  # demoted 50 ms ago: its read may still be pending
        ev(4.0, "sender", "sent", task="after"),
        ev(4.5, "c1", "killed"),  # not a worker
        ev(5.0, "chaos", "done"),
        ev(6.0, "tasks", "left", task="queued", where="queue"),
        ev(7.0, "w2", "promote", role="tasks", epoch=3),
        ev(8.0, "w2", "killed"),  # after the run: explains nothing
    ]
    report = check(events, ttl=TTL, broker_pop_window=True)
    assert [v.kind for v in report.violations] == ["task lost"]
    # Two kills explain two messages ("popped", "second"), not a third; a
    # received task and one left in the queue are not the window; no worker
    # reading the leader queue was killed after "after" was sent.
    detail = report.violations[0].detail
    assert "4 leader-only task(s) never ran: third, queued, received, after" in detail
    assert "(still in the broker: queued)" in detail
    assert report.tasks == {
        "sent": 7,
        "ran": 1,
        "twice": 0,
        "lost": 4,
        "lost in the broker's pop window": 2,
    }
    # Without the window (RabbitMQ) every loss is a violation.
    strict = check(events, ttl=TTL)
    assert strict.tasks["lost"] == 6
    assert "lost in the broker's pop window" not in strict.tasks


def test_a_slow_graceful_handover_and_a_leader_that_never_came_back() -> None:
    events = [
        ev(1.0, "c1", "promote", role="r", epoch=3, lease=1.8),
        ev(5.0, "chaos", "fault", fault="sigterm", target="c1"),
        ev(5.01, "c1", "demote", role="r", reason="stopped"),
        ev(5.31, "c2", "promote", role="r", epoch=4, lease=1.8),
        ev(6.0, "chaos", "fault", fault="sigkill", target="c2"),
        ev(6.001, "c2", "killed"),
        ev(30.0, "chaos", "done"),
    ]
    report = check(events, ttl=TTL)
    slow, never = report.faults
    assert slow.leaderless["r"] == pytest.approx(0.30)
    assert never.leaderless["r"] == math.inf and not never.survived
    # Over the bound: reported, not a violation (timing goals are the
    # benchmark's); a role left without a leader is one.
    assert slow.over_bound == 1
    assert [v.kind for v in report.violations] == ["no leader"]
    assert "| sigkill | 1 | 0 | 1 | never | never | never | 2050 ms | 1 |" in report.table()
    assert "| sigterm | 1 | 1 | 1 | 300 ms | 300 ms | 300 ms | 50 ms | 1 |" in report.table()


def test_faults_that_hit_no_leader_have_no_leaderless_time() -> None:
    events = [*clean_failover(), ev(15.0, "chaos", "fault", fault="sigkill", target="c3")]
    report = check(events, ttl=TTL)
    assert report.ok
    assert report.faults[1].leaderless == {} and report.faults[1].survived


def test_events_are_read_from_every_file_and_a_torn_last_line_is_skipped(
    tmp_path: Path,
) -> None:
    (tmp_path / "c1.jsonl").write_text(
        json.dumps({"t": 2.0, "proc": "c1", "kind": "promote", "role": "r", "epoch": 1})
        + "\n"
        + '{"t": 3.0, "proc": "c1", "ki'
    )
    (tmp_path / "chaos.jsonl").write_text(
        json.dumps({"t": 1.0, "proc": "chaos", "kind": "start"}) + "\n"
    )
    events = load_events(tmp_path)
    assert [(e.t, e.proc, e.kind) for e in events] == [
        (1.0, "chaos", "start"),
        (2.0, "c1", "promote"),
    ]


def test_a_late_demote_line_ends_the_belief_at_the_lease_deadline() -> None:
    # c1's last renewal was sent at 4.9 (lease until 6.7); starved, it wrote its
    # demote line at 7.3, after c2 was promoted at 7.0: no overlap, the lease
    # ended before.
    events = [
        ev(1.0, "c1", "promote", role="r", epoch=3, lease=1.8),
        ev(4.95, "c1", "renewed", role="r", until=6.7),
        ev(7.0, "c2", "promote", role="r", epoch=9, lease=1.8),
        ev(7.3, "c1", "demote", role="r", reason="lease_expired"),
    ]
    assert check(events, ttl=TTL).ok
    # A renewal whose lease reaches past the successor's promotion is an overlap.
    events.insert(2, ev(5.6, "c1", "renewed", role="r", until=7.2))
    report = check(events, ttl=TTL)
    assert [v.kind for v in report.violations] == ["overlap"]
    assert report.overlap_seconds == pytest.approx(0.2)
