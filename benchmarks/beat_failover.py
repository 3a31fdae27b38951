"""Beat failover, side by side: celery-nats-leader's LeaderScheduler vs celery-redbeat.

Three ``celery beat`` replicas of each scheduler, with equal settings: the
same lock TTL (the election TTL, redbeat's ``redbeat_lock_timeout``), the same
loop interval (``beat_max_loop_interval``), the same entries (several
1-second interval entries) and the same Redis broker. celery-nats-leader runs
twice: by the lease alone (the default) and with fast failover
(``nats_leader_fast_failover = True``: the leader's designated successor
takes over about a second after it goes silent, whatever the TTL). Measured,
in one run, for each of the three:

* **crash**: the active scheduler is SIGKILLed, at a random moment or at a
  point inside the dispatch of a 1-second entry (stopped there by a hook,
  then killed): *before the publish* (Celery's ``before_task_publish``: the
  tick is decided, for celery-nats-leader committed, not sent) or *after the
  publish* (``after_task_publish``: sent, for celery-nats-leader not yet
  recorded). Measured: the time from the kill to the next dispatch by another
  replica, the ticks of that entry never dispatched, and the ticks sent twice;
* **pause mid-dispatch**: the active scheduler stops itself (SIGSTOP) inside
  the publish of a due task, the worst moment, for twice the TTL, then is
  continued; duplicate dispatches (one tick sent twice) are counted;
* **pause at a random moment**: the same with a SIGSTOP sent from outside at
  a random time.

Dispatches are recorded in the beat processes themselves (Celery's
``before_task_publish`` signal), with the time on CLOCK_MONOTONIC (one clock
for every process of this host), the task id and the tick they are for: the
slot header of celery-nats-leader, and for redbeat the entry's
``last_run_at`` when it was sent (two sends with the same one are the same
tick sent twice). A real worker per scheduler executes the ticks (a plain
``@app.task``) and records each execution by task id: a tick *run twice* is
one with two executions. The worker of celery-nats-leader runs the bootstep
(``install(app)``), which runs each tick once by default; redbeat's is a
plain Celery worker (redbeat has nothing on the worker side).

Run: ``python benchmarks/beat_failover.py [--trials N | --quick]`` (needs
Redis at ``$BENCH_REDIS_URL``, default 127.0.0.1:6379, and ``nats-server``;
``NATS_SERVER_BIN`` picks the binary). ``--trials 3`` (the default) takes
about 12 minutes, ``--quick`` (one trial per scenario) about 4. Prints a
markdown table. This file is also the Celery app of the beat processes
(``celery -A beat_failover``), configured by ``$BEAT_BENCH_CONFIG``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

HERE = Path(__file__).resolve().parent
REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
CELERY = str(Path(sys.executable).parent / "celery")

#: Equal settings for both schedulers.
LOCK_TTL = 5  # seconds: election TTL = redbeat_lock_timeout (redbeat wants an int)
LOOP_INTERVAL = 1.0  # seconds: beat_max_loop_interval
ENTRIES = 5  # 1-second interval entries (several due at once: a pause can cut a tick)
REPLICAS = 3
#: Where the active scheduler is killed: anywhere, or inside a dispatch.
KILL_POINTS = ("random", "before publish", "after publish")

#: The schedulers compared: label, ``-S`` value, celery-nats-leader's or not,
#: and its ``nats_leader_fast_failover``.
LEASE = "celery-nats-leader"
FAST = "celery-nats-leader fast failover"
REDBEAT = "celery-redbeat"
SCHEDULERS = (
    (LEASE, "nats_leader", True, False),
    (FAST, "nats_leader", True, True),
    (REDBEAT, "beat_failover:BenchRedBeatScheduler", False, False),
)

CONFIG: dict[str, Any] = json.loads(os.environ.get("BEAT_BENCH_CONFIG", "{}"))
NATS_VERSION = "?"

# ------------------------------------------------------------ beat processes

_local = threading.local()
_redis: Any = None


def _client() -> Any:
    global _redis  # noqa: PLW0603 - one client per beat process
    if _redis is None:
        import redis

        _redis = redis.Redis.from_url(CONFIG["redis"])
    return _redis


def _on_publish(sender: str | None = None, headers: dict[str, Any] | None = None, **_: Any) -> None:
    """In a beat process: maybe stop here (the pause scenario), then record the dispatch."""
    headers = headers or {}
    client = _client()
    prefix = CONFIG["prefix"]
    if client.delete(prefix + "pause-next") == 1:
        # Stop inside the publish: the tick is decided (and, for
        # celery-nats-leader, committed) but not sent yet.
        os.kill(os.getpid(), signal.SIGSTOP)
    entry = headers.get("nats_leader_entry") or getattr(_local, "entry", None)
    if entry == "bench-0" and client.delete(prefix + "kill-before publish") == 1:
        # Stopped here for the harness to SIGKILL: the send never happens,
        # so it is not recorded as a dispatch.
        os.kill(os.getpid(), signal.SIGSTOP)
    tick = headers.get("nats_leader_tick") or getattr(_local, "prev_run", None)
    record = {
        "pid": os.getpid(),
        "id": headers.get("id"),
        "entry": entry,
        "tick": str(tick),
        "mono": time.monotonic(),
    }
    client.rpush(prefix + "dispatches", json.dumps(record))


def _after_publish(headers: dict[str, Any] | None = None, **_: Any) -> None:
    """In a beat process: maybe stop right after a send, for the harness to SIGKILL."""
    entry = (headers or {}).get("nats_leader_entry") or getattr(_local, "entry", None)
    if entry == "bench-0" and _client().delete(CONFIG["prefix"] + "kill-after publish") == 1:
        os.kill(os.getpid(), signal.SIGSTOP)


def make_app(config: dict[str, Any]) -> Any:
    from celery import Celery
    from celery.schedules import schedule
    from celery.signals import after_task_publish, before_task_publish

    app = Celery("beat_bench", set_as_current=True)
    app.conf.update(
        broker_url=config["redis"],
        broker_transport_options={"global_keyprefix": config["prefix"]},
        task_default_queue=config["queue"],
        task_ignore_result=True,
        result_backend=None,
        result_expires=None,
        timezone="UTC",
        beat_max_loop_interval=LOOP_INTERVAL,
        beat_enable_remote_control=False,
        beat_schedule={
            f"bench-{i}": {"task": "bench.noop", "schedule": schedule(timedelta(seconds=1))}
            for i in range(ENTRIES)
        },
        # celery-nats-leader
        nats_leader_servers=config.get("nats_url", "nats://127.0.0.1:4222"),
        nats_leader_bucket=config["bucket"],
        nats_leader_ttl=float(LOCK_TTL),
        nats_leader_required=True,
        nats_leader_fast_failover=bool(config.get("fast_failover", False)),
        # celery-redbeat
        redbeat_redis_url=config["redis"],
        redbeat_key_prefix=config["prefix"] + "redbeat",
        redbeat_lock_timeout=LOCK_TTL,
    )
    before_task_publish.connect(_on_publish, weak=False)
    after_task_publish.connect(_after_publish, weak=False)

    @app.task(name="bench.noop", bind=True)
    def noop(self: Any) -> None:
        # A plain task: its executions are recorded by task id.
        _client().rpush(CONFIG["prefix"] + "executions", str(self.request.id))

    if config.get("bootstep"):
        from celery_nats_leader import install

        install(app)
    return app


def _bench_redbeat() -> Any:
    from redbeat import RedBeatScheduler

    class BenchRedBeatScheduler(RedBeatScheduler):  # type: ignore[misc]
        """RedBeatScheduler, unchanged, plus a note of which tick each send is for."""

        def apply_async(self, entry: Any, *args: Any, **kwargs: Any) -> Any:
            # The entry's last run as loaded when it was found due: two sends
            # made from the same one are the same tick, sent twice.
            _local.prev_run = entry.last_run_at.isoformat() if entry.last_run_at else None
            _local.entry = entry.name
            return super().apply_async(entry, *args, **kwargs)

    return BenchRedBeatScheduler


_REDBEAT: list[Any] = []


def __getattr__(name: str) -> Any:
    # ``-S beat_failover:BenchRedBeatScheduler``: import redbeat only in the
    # processes that use it (it connects a beat_init handler to every beat).
    if name == "BenchRedBeatScheduler":
        if not _REDBEAT:
            _REDBEAT.append(_bench_redbeat())
        return _REDBEAT[0]
    raise AttributeError(name)


if CONFIG:
    app = make_app(CONFIG)

# -------------------------------------------------------------------- harness


class Beat:
    """A ``celery beat`` replica (or, with ``worker``, the worker consuming that queue)."""

    def __init__(
        self, index: int, scheduler: str, env: dict[str, str], tmp: Path, worker: str = ""
    ) -> None:
        self.log_path = tmp / f"{'worker' if worker else 'beat'}-{index}-{uuid.uuid4().hex[:4]}.log"
        self._log = self.log_path.open("wb")
        if worker:
            command = ["worker", "-P", "threads", "-c", "4", "-Q", worker, "-n", f"{worker}@%h"]
        else:
            command = [
                "beat",
                "-S",
                scheduler,
                "-s",
                str(tmp / f"schedule-{index}-{uuid.uuid4().hex[:4]}"),
            ]
        self.proc = subprocess.Popen(
            [CELERY, "-A", "beat_failover", *command, "-l", "INFO"],
            cwd=str(HERE),
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def paused(self) -> bool:
        try:
            return Path(f"/proc/{self.pid}/stat").read_text().split(")")[-1].split()[0] == "T"
        except OSError:
            return False

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGCONT)
            os.kill(self.pid, signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self._log.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


class Run:
    """One scheduler's replicas, their dispatches, and the scenarios."""

    def __init__(self, label: str, scheduler: str, config: dict[str, Any], tmp: Path) -> None:
        import redis

        self.label = label
        self.scheduler = scheduler
        self.config = config
        self.tmp = tmp
        self.redis = redis.Redis.from_url(config["redis"])
        self.env = {
            **os.environ,
            "BEAT_BENCH_CONFIG": json.dumps(config),
            "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent)]),
        }
        self.beats: list[Beat] = []
        self.worker: Beat | None = None
        self.crashes: list[dict[str, Any]] = []
        self.pauses: dict[str, list[dict[str, Any]]] = {"mid-dispatch": [], "random": []}
        self._gaps = 0

    def start(self) -> None:
        self.worker = Beat(-1, "", self.env, self.tmp, worker=self.config["queue"])
        for i in range(REPLICAS):
            self.beats.append(Beat(i, self.scheduler, self.env, self.tmp))
        self.wait(self.dispatches, 60, "a first dispatch")

    def replace(self, beat: Beat) -> None:
        """Keep three replicas: start a new one for a dead one."""
        beat.stop()
        self.beats[self.beats.index(beat)] = Beat(
            len(self.beats), self.scheduler, self.env, self.tmp
        )

    def dispatches(self) -> list[dict[str, Any]]:
        raw = self.redis.lrange(self.config["prefix"] + "dispatches", 0, -1)
        return [json.loads(item) for item in raw]

    def executions(self) -> Counter[str]:
        """Executions per task id."""
        raw = self.redis.lrange(self.config["prefix"] + "executions", 0, -1)
        return Counter(item.decode() for item in raw)

    def run_counts(self, start: float, end: float) -> tuple[int, int]:
        """Ticks dispatched in [start, end]: (run twice or more, never run)."""
        executed = self.executions()
        runs: Counter[tuple[str, str]] = Counter()
        ticks = set()
        seen_ids: set[str] = set()
        for d in self.dispatches():
            if not start <= d["mono"] <= end:
                continue
            tick = (d["entry"], d["tick"])
            ticks.add(tick)
            if d["id"] not in seen_ids:
                # Copies under one task id (the outbox's re-send) count by executions.
                seen_ids.add(d["id"])
                runs[tick] += executed[d["id"]]
        twice = sum(n - 1 for n in runs.values() if n > 1)
        never = sum(1 for tick in ticks if runs[tick] == 0)
        return twice, never

    def settle(self) -> None:
        """Stop the schedulers and let the worker execute everything they sent."""
        for beat in self.beats:
            beat.stop()
        ids = {d["id"] for d in self.dispatches()}

        def done() -> bool:
            executed = self.executions()
            return all(executed[i] for i in ids)

        with contextlib.suppress(RuntimeError):
            self.wait(done, 60, "the worker to run every dispatched tick")
        time.sleep(2.0)  # late copies (a retried claim) have time to show up
        for scenario in [*self.crashes, *self.pauses["mid-dispatch"], *self.pauses["random"]]:
            scenario["run_twice"], scenario["never_run"] = self.run_counts(*scenario["window"])

    def wait(self, predicate: Any, timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.01)
        raise RuntimeError(f"{self.label}: timed out waiting for {what}")

    def active(self) -> Beat:
        """The replica that dispatched last."""

        def find() -> Beat | None:
            recent = [d for d in self.dispatches() if d["mono"] > time.monotonic() - 2]
            if not recent:
                return None
            pid = recent[-1]["pid"]
            return next((b for b in self.beats if b.pid == pid and b.alive), None)

        beat: Beat = self.wait(find, 30, "an active scheduler")
        return beat

    # --------------------------------------------------------- scenarios

    def crash(self, point: str = "random") -> None:
        time.sleep(2.0 + random.random())  # a random phase of the 1-second ticks
        start_mono = time.monotonic()
        if point == "random":
            victim = self.active()
        else:
            self.redis.set(self.config["prefix"] + f"kill-{point}", 1)
            victim = self.wait(
                lambda: next((b for b in self.beats if b.paused()), None), 30, f"a stop {point}"
            )
        killed_at = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        victim.proc.wait(10)

        def next_dispatch() -> dict[str, Any] | None:
            after = [
                d for d in self.dispatches() if d["mono"] > killed_at and d["pid"] != victim.pid
            ]
            return after[0] if after else None

        first = self.wait(next_dispatch, 120, "a dispatch after the crash")
        time.sleep(3.0)
        window_end = first["mono"] + 3.0
        # Ticks of one 1-second entry due in [kill, window_end]: were they all sent?
        sent = [
            d
            for d in self.dispatches()
            if d["entry"] == "bench-0" and killed_at <= d["mono"] <= window_end
        ]
        if self.config["bootstep"]:
            # celery-nats-leader (either variant). Exact: tick identities
            # are slots; count the slots never sent.
            from celery_nats_leader.beat.ticks import parse_slot

            slots = sorted(
                {parse_slot(d["tick"]) for d in self.dispatches() if d["entry"] == "bench-0"}
            )
            gaps = sum(round((b - a).total_seconds()) - 1 for a, b in itertools.pairwise(slots))
            lost = float(gaps - self._gaps)
            self._gaps = gaps
        else:
            # redbeat has no tick identity: ticks due in the window minus sends in it.
            lost = max(0.0, (window_end - killed_at) - len(sent))
        window = [d for d in self.dispatches() if start_mono <= d["mono"] <= window_end]
        counts = Counter((d["entry"], d["tick"]) for d in window)
        duplicates = sum(n - 1 for n in counts.values() if n > 1)
        self.crashes.append(
            {
                "point": point,
                "failover": first["mono"] - killed_at,
                "lost": lost,
                "duplicates": duplicates,
                "window": (start_mono, window_end),
            }
        )
        self.replace(victim)
        time.sleep(2.0)

    def pause(self, kind: str) -> None:
        time.sleep(2.0 + random.random())
        start_mono = time.monotonic()
        if kind == "mid-dispatch":
            self.redis.set(self.config["prefix"] + "pause-next", 1)
            victim = self.wait(
                lambda: next((b for b in self.beats if b.paused()), None), 30, "a pause"
            )
        else:
            victim = self.active()
            os.kill(victim.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        while time.monotonic() < stopped_at + 2 * LOCK_TTL:
            time.sleep(0.05)
        os.kill(victim.pid, signal.SIGCONT)
        time.sleep(4.0)
        window = [d for d in self.dispatches() if d["mono"] >= start_mono]
        counts = Counter((d["entry"], d["tick"]) for d in window)
        duplicates = sum(n - 1 for n in counts.values() if n > 1)
        outcome = "kept running, following" if victim.alive else "exited"
        if not victim.alive:
            log = victim.log()
            if "LockNotOwnedError" in log or "Cannot extend" in log:
                outcome = "exited (LockNotOwnedError)"
        self.pauses[kind].append(
            {"duplicates": duplicates, "outcome": outcome, "window": (start_mono, time.monotonic())}
        )
        self.redis.delete(self.config["prefix"] + "pause-next")
        if not victim.alive:
            self.replace(victim)
        time.sleep(2.0)

    def close(self) -> None:
        for beat in self.beats:
            beat.stop()
        if self.worker is not None:
            self.worker.stop()
        keys = list(self.redis.scan_iter(match=self.config["prefix"] + "*"))
        if keys:
            self.redis.delete(*keys)
        self.redis.close()


def _reachable(url: str) -> bool:
    parsed = urlparse(url)
    try:
        with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 6379), 1):
            return True
    except OSError:
        return False


async def _create_buckets(url: str, bucket: str) -> None:
    import nats
    from nats.js.api import KeyValueConfig

    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await js.create_key_value(KeyValueConfig(bucket=bucket, history=1, ttl=LOCK_TTL))
        await js.create_key_value(KeyValueConfig(bucket=f"{bucket}_beat", history=1))
    finally:
        await nc.close()


def measure(
    label: str, scheduler: str, trials: int, nats_url: str, tmp: Path, *, ours: bool, fast: bool
) -> Run:
    uid = uuid.uuid4().hex[:8]
    config = {
        "redis": REDIS_URL,
        "prefix": f"beatbench-{uid}:",
        "queue": f"beatbench-{uid}",
        "bucket": f"bench_{uid}",
        "nats_url": nats_url,
        "bootstep": ours,
        "fast_failover": fast,
    }
    if ours:
        asyncio.run(_create_buckets(nats_url, config["bucket"]))
    run = Run(label, scheduler, config, tmp)
    try:
        run.start()
        for point in KILL_POINTS:
            for _ in range(trials):
                run.crash(point)
        for _ in range(trials):
            run.pause("mid-dispatch")
        for _ in range(trials):
            run.pause("random")
        run.settle()
    finally:
        run.close()
    return run


def _ratio(a: float, b: float) -> str:
    if a == 0 and b == 0:
        return "="
    if a == 0:
        return "∞"
    return f"{b / a:.2f}×"


COLUMN = {
    LEASE: "celery-nats-leader `LeaderScheduler`",
    FAST: "celery-nats-leader `LeaderScheduler`, `fast_failover`",
    REDBEAT: "celery-redbeat `RedBeatScheduler`",
}


def report(runs: list[Run], trials: int) -> str:
    """The markdown table: one column per scheduler, then redbeat ÷ each of ours."""

    def failover(run: Run) -> tuple[float, str]:
        values = [c["failover"] for c in run.crashes]
        median = statistics.median(values)
        return median, f"{median:.2f} s ({min(values):.2f}–{max(values):.2f})"

    def lost(run: Run, point: str) -> float:
        return statistics.mean(c["lost"] for c in run.crashes if c["point"] == point)

    def resent(run: Run, point: str) -> int:
        return sum(c["duplicates"] for c in run.crashes if c["point"] == point)

    def dups(run: Run, kind: str) -> int:
        return sum(p["duplicates"] for p in run.pauses[kind])

    def twice(scenarios: list[dict[str, Any]]) -> int:
        return sum(int(c.get("run_twice", 0)) for c in scenarios)

    def crashes_at(run: Run, point: str) -> list[dict[str, Any]]:
        return [c for c in run.crashes if c["point"] == point]

    def never_run(run: Run) -> int:
        scenarios = [*run.crashes, *run.pauses["mid-dispatch"], *run.pauses["random"]]
        return sum(int(c.get("never_run", 0)) for c in scenarios)

    def outcome(run: Run) -> str:
        seen = Counter(p["outcome"] for kind in run.pauses.values() for p in kind)
        return ", ".join(f"{what} ×{n}" for what, n in seen.items())

    ours = [run for run in runs if run.config["bootstep"]]
    theirs = next((run for run in runs if not run.config["bootstep"]), None)
    ratio = ""
    if theirs is not None and ours:
        f_theirs = failover(theirs)[0]
        ratio = " / ".join(_ratio(failover(run)[0], f_theirs) for run in ours)
    rows = [
        (
            f"SIGKILL of the active scheduler → next dispatch, median (min–max) of "
            f"{trials * len(KILL_POINTS)}",
            [failover(run)[1] for run in runs],
            ratio,
        ),
        *(
            (
                f"SIGKILL {point}: ticks of the 1-s entry never dispatched, per kill (mean) / "
                f"ticks sent twice / ticks run twice (totals of {trials})",
                [
                    f"{lost(run, point):.1f} / {resent(run, point)} / "
                    f"{twice(crashes_at(run, point))}"
                    for run in runs
                ],
                "",
            )
            for point in KILL_POINTS
        ),
        *(
            (
                f"SIGSTOP {2 * LOCK_TTL} s {where}: ticks sent twice / ticks run twice "
                f"(totals of {trials})",
                [f"{dups(run, kind)} / {twice(run.pauses[kind])}" for run in runs],
                "",
            )
            for kind, where in (
                ("mid-dispatch", "inside a dispatch"),
                ("random", "at a random time"),
            )
        ),
        (
            "ticks dispatched and never run, all scenarios",
            [str(never_run(run)) for run in runs],
            "",
        ),
        ("the paused scheduler after SIGCONT", [outcome(run) for run in runs], ""),
    ]
    ratio_head = (
        "redbeat ÷ " + " / ".join("fast failover" if r.label == FAST else "lease" for r in ours)
        if ratio
        else ""
    )
    lines = [
        f"{REPLICAS} `celery beat` replicas per scheduler, {ENTRIES} entries every 1 s, "
        f"lock TTL = election TTL = {LOCK_TTL} s, `beat_max_loop_interval` = {LOOP_INTERVAL:g} s, "
        f"Redis broker, one worker per scheduler running a plain task "
        f"(celery-nats-leader's with the bootstep); {platform.system()} {platform.machine()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}, nats-server {NATS_VERSION}.",
        "",
        "| | "
        + " | ".join(COLUMN.get(run.label, run.label) for run in runs)
        + f" | {ratio_head} |",
        "|---" * (len(runs) + 2) + "|",
    ]
    lines += [f"| {name} | {' | '.join(cells)} | {last} |" for name, cells, last in rows]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3, help="crashes and pauses per scenario")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="one crash per kill point and one pause of each kind, per scheduler (--trials 1)",
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=[label for label, *_ in SCHEDULERS],
        help="measure only this scheduler (repeat for several; default: all three)",
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="also write every crash and pause to PATH, for benchmarks/plots.py",
    )
    args = parser.parse_args()
    trials = 1 if args.quick else args.trials
    if not _reachable(REDIS_URL):
        message = f"beat_failover: Redis not reachable at {REDIS_URL} (set BENCH_REDIS_URL)"
        if os.environ.get("CI", "").lower() == "true":
            print(message, file=sys.stderr)
            return 1
        print(f"_skipped: {message}_")
        return 0
    sys.path.insert(0, str(HERE.parent))
    from celery_nats_leader.testing import NatsServer, binary_version, find_nats_server_binary

    global NATS_VERSION  # noqa: PLW0603 - printed in the report
    NATS_VERSION = str(binary_version(find_nats_server_binary()))
    runs = []
    with tempfile.TemporaryDirectory(prefix="beat-bench-") as tmp, NatsServer() as server:
        for label, scheduler, ours, fast in SCHEDULERS:
            if args.only and label not in args.only:
                continue
            runs.append(
                measure(label, scheduler, trials, server.url, Path(tmp), ours=ours, fast=fast)
            )
    print(report(runs, trials))
    if args.json:
        write_json(args.json, runs)
    return 0


def write_json(path: str, runs: list[Run]) -> None:
    """Every crash and pause of each scheduler as JSON, for ``benchmarks/plots.py``.

    ``{"benchmark": "beat_failover", "settings": {...}, "schedulers": {label:
    {"crashes": [{"point", "failover", "lost", "duplicates", ...}], "pauses":
    {kind: [{"duplicates", "outcome", ...}]}}}}``; times in seconds (the
    monotonic windows are left out).
    """

    def plain(scenario: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in scenario.items() if k != "window"}

    document = {
        "benchmark": "beat_failover",
        "settings": {
            "replicas": REPLICAS,
            "entries": ENTRIES,
            "lock_ttl": LOCK_TTL,
            "loop_interval": LOOP_INTERVAL,
            "nats_server": NATS_VERSION,
            "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, "
            f"Python {platform.python_version()}",
        },
        "schedulers": {
            run.label: {
                "crashes": [plain(c) for c in run.crashes],
                "pauses": {kind: [plain(p) for p in ps] for kind, ps in run.pauses.items()},
            }
            for run in runs
        },
    }
    with open(path, "w") as out:
        json.dump(document, out, indent=1)
        out.write("\n")


if __name__ == "__main__":
    sys.exit(main())
