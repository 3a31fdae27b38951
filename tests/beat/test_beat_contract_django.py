"""The scheduler contract, against django-celery-beat's ``DatabaseScheduler`` as the oracle.

Both schedulers run in one subprocess (``cnl_beat_contract_django``) on
PostgreSQL where reachable (a schema of the test's own), SQLite otherwise,
each on its own copy of the same rows, on the real clock; the leader
scheduler on a real nats-server. A user must see the same messages from both:
``enabled``, ``start_time`` (a never-run row is backdated 30 years by
django-celery-beat), ``expires``, ``one_off``, clocked "run once, now", interval
and crontab rows, and rows changed in the database while beat runs.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from cnl_beat_harness import Database

from celery_nats_leader.beat.ticks import parse_slot
from celery_nats_leader.testing import NatsServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

HERE = Path(__file__).parent
SECONDS = 14.0
SIDES = ("oracle", "ours")


def run_both(nats_server: NatsServer, database: Database) -> dict[str, Any]:
    env = {
        **os.environ,
        "CNL_BEAT_DB": json.dumps(database.settings),
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, str(HERE / "cnl_beat_contract_django.py"), nats_server.url, str(SECONDS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_database_rows_behave_as_with_database_scheduler(
    nats_server: NatsServer, database: Database
) -> None:
    result = run_both(nats_server, database)
    counts = {
        side: Counter(name for name, *_ in result[side]["sent"]) for side in ("oracle", "ours")
    }
    oracle, ours = counts["oracle"], counts["ours"]
    # Once-only rows: exactly what the installed django-celery-beat does (the
    # same on 2.5 to 2.9; each side reads only its own rows, see the program).
    for name, expected in (
        ("disabled", 0),
        ("start-later", 1),  # issue 10 #3: was sent once a second, ticks dated 1996...
        ("one-off", 1),
        ("clocked-now", 1),  # issue 10 #4: was never sent
        ("clocked-just-before", 1),
        ("cron", 1),
    ):
        # Each side's sends of the row (name, seconds into the run, slot): the
        # whole result is too long for pytest to show.
        sends = {side: [s for s in result[side]["sent"] if s[0] == name] for side in SIDES}
        # django-celery-beat's reserve() leaves the entry it sent in its
        # schedule with its last_run_at from before the send (only the row is
        # updated); a heap rebuilt from that schedule before the rows are read
        # again finds the row due again, and the oracle sends it twice (the
        # cron row at +5.49 s and +5.52 s on 2.5.0, 1 run in 6 with another
        # test beside it; the same code is in 2.9). The probable mechanism;
        # the leader scheduler commits each slot in KV before its send.
        allowed = {"cron": (1, 2), "start-later": (1, 2)}
        if not result["anchors_at_date_changed"]:
            # Before django-celery-beat 2.8 a row that never ran is anchored
            # afresh each time the schedule is read again (a one-off row
            # disabled, the rows changed at +5 s and +6 s): at "now", so the
            # cron row's first slot (the minute 4-6 s into the run) is lost
            # when a re-read comes between the slot and its send; 30 years
            # back for a row with a start time, sent again when such a
            # re-read comes right after its send. The leader scheduler
            # anchors a row once, in KV, and sends each slot once (deliberate
            # differences, docs/support.md).
            allowed["cron"] = (0, 1, 2)
        if name in allowed:
            assert oracle[name] in allowed[name] and ours[name] == 1, (name, sends)
            continue
        assert (oracle[name], ours[name]) == (expected, expected), (name, sends, result)
    # Rows that keep running (every second): the same messages, up to the one in flight
    # at the end and the ticks Celery's interval drifted by: Celery counts the next run
    # from the (late) send, the leader scheduler from the tick's slot (docs/beat.md).
    times = {
        name: {side: [at for row, at, *_ in result[side]["sent"] if row == name] for side in SIDES}
        for name in ("every-second", "enabled-later", "expires", "slowed-down")
    }
    for name in ("every-second", "enabled-later"):
        oracle_times = times[name]["oracle"]
        assert oracle_times, (name, result)
        drift = oracle_times[-1] - oracle_times[0] - (len(oracle_times) - 1)
        allowed = 1 + math.ceil(max(drift, 0.0))
        ours_times = times[name]["ours"]
        if not result["anchors_at_date_changed"]:
            # Before 2.8 each re-read of the schedule before the row's first
            # send (the one-off and the two clocked rows disabling themselves:
            # three) anchors it at "now" again, so the oracle's first send
            # comes up to three seconds later than ours (seen: 2.2 s).
            late = oracle_times[0] - ours_times[0]
            allowed += math.ceil(min(max(late, 0.0), 3.0))
        assert -1 <= ours[name] - oracle[name] <= allowed, times[name]
        # And on our side alone: one send per second of its own span, each
        # slot once.
        slots = [tick for row, _, tick in result["ours"]["sent"] if row == name]
        assert len(set(slots)) == len(slots), (name, slots)
        span = ours_times[-1] - ours_times[0]
        assert abs(len(ours_times) - (span + 1)) <= 1.5, (name, ours_times)
        assert min(times[name]["ours"]) >= (5.0 if name == "enabled-later" else 0.0)
    # Rows that stop (slowed down to every 100 s at +6 s of the run, and, where
    # django-celery-beat disables an expired row, expired at +6 s): both sent
    # some; the leader scheduler only ticks whose slot came before.
    stops = {
        # Changed 6 s into the run, noticed at the next tick (at most 1 s), plus slack.
        "slowed-down": result["started"] + 6.0 + 1.0 + 1.0,
    }
    rows = result["rows"]
    # django-celery-beat 2.8+ disables a row once its ``expires`` has passed;
    # before, it keeps sending it (each message carries the expiry, so workers
    # drop it): the leader scheduler does what the installed one does.
    expiry_disables = rows["oracle:expires"]["enabled"] is False
    assert rows["ours:expires"]["enabled"] is rows["oracle:expires"]["enabled"], result
    if expiry_disables:
        # expires = the rows' creation + 6 s: a tick is sent only while not expired.
        stops["expires"] = result["base"] + 6.0
        assert ours["expires"] <= 7
    else:
        expires = times["expires"]["oracle"]
        drift = expires[-1] - expires[0] - (len(expires) - 1)
        assert -1 <= ours["expires"] - oracle["expires"] <= 1 + math.ceil(max(drift, 0.0)), times
    for name, stop in stops.items():
        assert oracle[name] >= 1 and ours[name] >= 1, times[name]
        assert ours[name] >= oracle[name] - 1, times[name]
        slots = [tick for row, _, tick in result["ours"]["sent"] if row == name]
        assert all(parse_slot(tick).timestamp() < stop for tick in slots), (name, slots, stop)
    # The start time is honoured: the tick is found due at the start time, not before
    # (its identity is the time it was found due: the 30-year-old anchor has no slot).
    [start_later] = [tick for name, _, tick in result["ours"]["sent"] if name == "start-later"]
    assert parse_slot(start_later).timestamp() - result["base"] >= 2.0
    # Spent one-off rows are disabled in the database, as django-celery-beat does.
    for name in ("one-off", "clocked-now"):
        assert rows[f"ours:{name}"]["enabled"] is rows[f"oracle:{name}"]["enabled"] is False, name
