"""Assertions of the beat tests: exactly once per tick, bounded gaps, only leaders write."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from cnl_beat_harness import BEAT_ROLE, FAILOVER, STATE_BUCKET, BeatCluster
from cnl_beat_ledger import Run

from celery_nats_leader.beat import tick_task_id
from celery_nats_leader.beat.ticks import parse_slot, slot_text

UTC = timezone.utc


def fake_to_wall(cluster: BeatCluster, moment: datetime) -> float:
    """A ``fastcron`` schedule time as the wall-clock time it stands for."""
    speed = float(cluster.config["speed"])
    return cluster.t0 + (moment.timestamp() - cluster.t0) / speed


def expected_slots(spec: dict[str, Any], anchor: datetime, last: datetime) -> list[datetime]:
    """The slots of an entry after ``anchor`` up to ``last``, computed independently."""
    slots: list[datetime] = []
    if spec["kind"] == "interval":
        step = timedelta(seconds=spec["seconds"])
        slot = anchor + step
        while slot <= last:
            slots.append(slot)
            slot += step
        return slots
    # crontab(minute="*"): every whole minute.
    slot = anchor.replace(second=0, microsecond=0) + timedelta(minutes=1)
    while slot <= last:
        slots.append(slot)
        slot += timedelta(minutes=1)
    return slots


def slot_wall(cluster: BeatCluster, spec: dict[str, Any], slot: datetime) -> float:
    return fake_to_wall(cluster, slot) if spec["kind"] == "fastcron" else slot.timestamp()


def period(spec: dict[str, Any]) -> float:
    """Real seconds between two ticks of the entry."""
    if spec["kind"] == "interval":
        return float(spec["seconds"])
    if spec["kind"] == "fastcron":
        return 1.0
    return 60.0


@dataclass
class Verdict:
    """What the ledger and the KV history say about one entry."""

    name: str
    expected: list[datetime]
    executed: dict[datetime, list[Run]]
    lost: list[datetime]


def check_exactly_once(
    cluster: BeatCluster,
    *,
    end_wall: float,
) -> dict[str, Verdict]:
    """Every tick committed is executed exactly once; no tick is skipped, lost or runs twice.

    A scheduler SIGKILLed between a commit and its record leaves the tick
    pending, and its successor sends it again (the outbox): no loss is
    tolerated, whatever was killed.
    """
    verdicts: dict[str, Verdict] = {}
    runs = cluster.runs()
    for spec in cluster.entries:
        name = spec["name"]
        writes = cluster.recorder.state_writes(name)
        assert writes, f"{name}: no state was ever written"
        anchor = writes[0][1].slot
        assert writes[0][1].runs == 0, f"{name}: the first write is not the anchor: {writes[0]}"
        final = writes[-1][1]
        assert final.skipped == 0, f"{name}: ticks were coalesced: {final}"
        expected = expected_slots(spec, anchor, final.slot)
        assert final.runs == len(expected), (name, final, len(expected))
        executed: dict[datetime, list[Run]] = {}
        for run in runs:
            if run.entry == name:
                assert run.tick is not None
                executed.setdefault(parse_slot(run.tick), []).append(run)
        twice = {slot: rs for slot, rs in executed.items() if len(rs) > 1}
        assert not twice, f"{name}: ticks executed more than once: {twice}"
        for slot, rs in executed.items():
            # The task id is derived from the tick: an idempotency key downstream.
            wanted = tick_task_id(STATE_BUCKET, BEAT_ROLE, name, slot_text(slot))
            assert rs[0].task_id == wanted, (name, slot, rs[0].task_id, wanted)
        unexpected = sorted(set(executed) - set(expected))
        assert not unexpected, f"{name}: ticks that the schedule does not have: {unexpected}"
        lost = [slot for slot in expected if slot not in executed]
        for slot in lost:
            committers = [s for _, s in writes if s.slot == slot and s.runs > 0]
            assert committers, f"{name}: tick {slot} skipped (never committed)"
            epoch = committers[-1].epoch
            raise AssertionError(
                f"{name}: tick {slot} committed under epoch {epoch} but never executed"
            )
        # The scheduler kept up: the last tick due FAILOVER before the end was dispatched.
        horizon = end_wall - FAILOVER - period(spec)
        due_by_horizon = [
            s
            for s in expected_slots(spec, anchor, final.slot + timedelta(days=1))
            if slot_wall(cluster, spec, s) <= horizon
        ]
        if due_by_horizon:
            assert final.slot >= due_by_horizon[-1], (name, final.slot, due_by_horizon[-1])
        verdicts[name] = Verdict(name, expected, executed, lost)
    return verdicts


def check_gaps(cluster: BeatCluster, verdicts: dict[str, Verdict], bound: float) -> None:
    """No gap between two executions of an entry longer than one period plus ``bound``."""
    first_run = min((r.wall for r in cluster.runs()), default=0.0)
    for spec in cluster.entries:
        verdict = verdicts[spec["name"]]
        times = sorted(r.mono for rs in verdict.executed.values() for r in rs)
        limit = period(spec) + bound
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert not gaps or max(gaps) <= limit, (
            f"{spec['name']}: longest gap {max(gaps):.2f}s > {limit:.2f}s"
        )
        # And no tick ran much later than its slot (a failover at most), from
        # the first execution on: a database row counts its ticks from its
        # creation, and those due before any replica had started are late by
        # the start-up (seconds on a loaded machine), not by a failover.
        for slot, rs in verdict.executed.items():
            if slot_wall(cluster, spec, slot) < first_run:
                continue
            late = rs[0].wall - slot_wall(cluster, spec, slot)
            assert late <= bound + period(spec), (
                f"{spec['name']}: tick {slot} ran {late:.2f}s after its slot"
            )


def check_terms(cluster: BeatCluster) -> None:
    """Only leaders write state, and never one of an older term after a newer one.

    Every state write carries the writer's (epoch, id); it must match the
    beat role's record of that epoch, and per key the epochs never go down.
    Executed ticks, in tick order, never go back to an older term either.
    """
    terms = cluster.recorder.terms()
    per_key: dict[str, int] = {}
    for observed, state in cluster.recorder.all_state_writes():
        record = terms.get(state.epoch)
        assert record is not None, f"write by {state.by} under unknown epoch {state.epoch}"
        assert record.id == state.by, (
            f"{observed.key} rev {observed.revision} written by {state.by} under epoch "
            f"{state.epoch}, which {record.id} held: a follower wrote schedule state"
        )
        assert state.epoch >= per_key.get(observed.key, 0), (
            f"{observed.key}: epoch went back to {state.epoch} at rev {observed.revision}"
        )
        per_key[observed.key] = state.epoch
    for spec in cluster.entries:
        runs = sorted(
            (r for r in cluster.runs(spec["name"]) if r.tick),
            key=lambda r: parse_slot(r.tick or ""),
        )
        epochs = [r.epoch or 0 for r in runs]
        assert epochs == sorted(epochs), f"{spec['name']}: an older term dispatched a later tick"
