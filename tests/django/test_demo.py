"""The example project's demo, end to end (real nats-server, three real worker replicas)."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import ModuleType

import pytest

from celery_nats_leader.testing import free_port

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "example_project"


def _ledger_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "example_ticks_ledger", EXAMPLE / "ticks/ledger.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


ledger = _ledger_module()
T0 = datetime(2030, 1, 1, tzinfo=timezone.utc)


def runs(*seconds: float, epoch: int = 1) -> list:
    return [ledger.Run(T0 + timedelta(seconds=s), "w", epoch, epoch) for s in seconds]


def test_ledger_once_per_tick() -> None:
    verdict = ledger.verify(runs(0, 1, 2) + runs(3, 4, epoch=9), 1.0)
    assert verdict.once_per_tick
    assert verdict.ticks == 5
    assert verdict.dispatch_epochs == [1, 9]


def test_ledger_finds_a_double_run_and_a_gap() -> None:
    verdict = ledger.verify(runs(0, 1, 1, 4), 1.0)
    assert not verdict.once_per_tick
    assert verdict.duplicates == {T0 + timedelta(seconds=1): 2}
    assert verdict.missing == [T0 + timedelta(seconds=2), T0 + timedelta(seconds=3)]


def test_ledger_run_without_tick_identity() -> None:
    verdict = ledger.verify([*runs(0), ledger.Run(None, "w", None, 1)], 1.0)
    assert verdict.unslotted == 1
    assert not verdict.once_per_tick


@pytest.mark.integration
@pytest.mark.celery
@pytest.mark.timeout(240)
def test_demo_end_to_end(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in {"BROKER_URL", "REDIS_URL"}}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    nowhere = f"nats://127.0.0.1:{free_port()}"  # nothing listens: the demo starts its own
    env.update(
        EXAMPLE_DATA_DIR=str(tmp_path / "data"),
        NATS_URL=nowhere,
        EXAMPLE_TICK_SECONDS="1",
        EXAMPLE_TTL="2",
        PYTHONUNBUFFERED="1",
    )
    done = subprocess.run(
        [sys.executable, "manage.py", "demo", "--before", "3", "--after", "5", "--timeout", "60"],
        cwd=EXAMPLE,
        env=env,
        capture_output=True,
        text=True,
        timeout=220,
        check=False,
    )
    out = done.stdout
    (tmp_path / "demo.out").write_text(out + "\n--- stderr\n" + done.stderr)
    assert done.returncode == 0, f"{out}\n--- stderr\n{done.stderr[-4000:]}"

    assert f"nats-server: none with JetStream at {nowhere}; started one at nats://" in out
    assert [f"started replica{i}" in out for i in (1, 2, 3)] == [True] * 3
    assert out.count("$ manage.py election_status") == 2
    tables = out.split("$ manage.py election_status")[1:]
    for table in tables:
        assert re.search(r"^beat +\S+ +\d+ ", table, re.M), table
        assert re.search(r"^default +\S+ +\d+ ", table, re.M), table
    assert "3 live candidates" in tables[0]
    assert "2 live candidates" in tables[1]  # the killed replica is gone
    killed = re.search(r"killed (replica\d) \(pid \d+\) with SIGKILL: it led (.+?);", out)
    assert killed, out
    assert "beat" in killed.group(2)
    assert "---------- leader killed here ----------" in out
    ok = re.search(
        r"OK: (\d+) ticks, each run exactly once, none missing "
        r"\((\d+) before the kill, (\d+) after\)",
        out,
    )
    assert ok, out
    total, before, after = map(int, ok.groups())
    assert before >= 3 and after >= 5 and total == before + after
    ledger_rows = re.findall(r"^  \d\d:\d\d:\d\d\.\d{3} +\d+  (replica\d)@", out, re.M)
    assert len(ledger_rows) == total

    # Set-up says what it waits for; the live view prints each run as it lands:
    # its tick, the replica and both epochs, and names every beat leader.
    assert "waiting for replica1 to lead beat and default ..." in out
    assert re.search(r"^replica1 leads 'beat' \(epoch \d+\)$", out, re.M), out
    live = re.findall(
        r"^  tick (\d\d:\d\d:\d\d\.\d{3})  run +(\d+)  ran on (replica\d) +"
        r"beat epoch +(\d+)  default epoch +(\d+)$",
        out,
        re.M,
    )
    # Every run seen while the demo watched (--before 3, --after 5), each once,
    # and the same runs as the ledger's.
    assert len(live) >= 3 + 5, out
    ledger_ticks = re.findall(r"^  (\d\d:\d\d:\d\d\.\d{3}) +\d+  replica", out, re.M)
    assert len({r[0] for r in live}) == len(live)
    assert {r[0] for r in live} <= set(ledger_ticks)
    beat_leaders = re.findall(r"^  beat leader: (replica\d) \(epoch (\d+)\)$", out, re.M)
    assert len(beat_leaders) >= 2, out
    assert beat_leaders[0][0] == killed.group(1)
    assert beat_leaders[1][0] != killed.group(1)
    first_epoch, second_epoch = int(beat_leaders[0][1]), int(beat_leaders[1][1])
    assert second_epoch > first_epoch
    assert f"beat epoch {first_epoch} -> {second_epoch}" in out
    assert "why the epoch jumped" in out
    by_replica = re.findall(
        r"^leaders by replica: beat -> (replica\d) \(its embedded beat\)", out, re.M
    )
    assert by_replica[0] == killed.group(1) and by_replica[1] != killed.group(1)
    assert "Traceback" not in out + done.stderr


@pytest.mark.integration
@pytest.mark.celery
@pytest.mark.timeout(180)
def test_demo_ctrl_c_stops_the_replicas_without_a_traceback(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in {"BROKER_URL", "REDIS_URL"}}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    env.update(
        EXAMPLE_DATA_DIR=str(tmp_path / "data"),
        NATS_URL=f"nats://127.0.0.1:{free_port()}",
        EXAMPLE_TTL="2",
        PYTHONUNBUFFERED="1",
    )
    # The demo must hear Ctrl-C as from a terminal, even when this run was
    # started in the background of a shell without job control (which starts
    # it with SIGINT ignored, and an ignored signal stays ignored across exec;
    # a handler is reset to the default there).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            [sys.executable, "manage.py", "demo", "--timeout", "60"],
            cwd=EXAMPLE,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # a terminal's Ctrl-C goes to the foreground group
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        for line in proc.stdout:  # the demo's own progress is the event to wait on
            lines.append(line)
            if line.startswith("  tick "):
                break
        os.killpg(proc.pid, signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stdout.close()
    out = "".join(lines) + rest
    assert proc.returncode == 130, out
    assert out.rstrip().endswith("interrupted; replicas stopped"), out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    pids = [int(p) for p in re.findall(r"^started replica\d \(pid (\d+)\)", out, re.M)]
    assert pids, out
    for pid in pids:  # each replica's whole process group is gone
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)
