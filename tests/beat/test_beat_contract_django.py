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

from celery_nats_leader.testing import NatsServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

HERE = Path(__file__).parent
SECONDS = 10.0
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
        side: Counter(name for name, _ in result[side]["sent"]) for side in ("oracle", "ours")
    }
    oracle, ours = counts["oracle"], counts["ours"]
    # Once-only rows: exactly what django-celery-beat does.
    for name, expected in (
        ("disabled", 0),
        ("start-later", 1),  # issue 10 #3: was sent once a second, ticks dated 1996...
        ("one-off", 1),
        ("clocked-now", 1),  # issue 10 #4: was never sent
        ("clocked-just-before", 1),
        ("cron", 1),
    ):
        assert (oracle[name], ours[name]) == (expected, expected), (name, result)
    # Periodic rows (every second): the same messages, up to the one in flight at the
    # end, and up to the ticks Celery's interval drifted by: Celery counts the next run
    # from the (late) send, the leader scheduler from the tick's slot (docs/beat.md).
    for name in ("every-second", "enabled-later", "expires", "slowed-down"):
        times = {side: [at for row, at in result[side]["sent"] if row == name] for side in SIDES}
        assert times["oracle"], (name, result)
        drift = times["oracle"][-1] - times["oracle"][0] - (len(times["oracle"]) - 1)
        assert -1 <= ours[name] - oracle[name] <= 1 + math.ceil(max(drift, 0.0)), (name, times)
    assert ours["expires"] <= 4 and ours["slowed-down"] <= 5 and ours["enabled-later"] >= 5
    # The start time is honoured: the first message 2 s after the start, not before.
    [start_later] = [at for name, at in result["ours"]["sent"] if name == "start-later"]
    assert 1.9 <= start_later <= 3.5
    # Expired and spent one-off rows are disabled in the database, as django-celery-beat does.
    rows = result["rows"]
    for name in ("expires", "one-off", "clocked-now"):
        assert rows[f"ours:{name}"]["enabled"] is rows[f"oracle:{name}"]["enabled"] is False, name
