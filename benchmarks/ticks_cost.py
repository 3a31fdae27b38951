"""What "no tick lost, none run twice" costs: the outbox per tick, the once-guard per run.

Against a nats-server of its own on loopback, in one process:

* **per dispatched tick**: the leader scheduler's dispatch as ``celery beat``
  runs it (:class:`~celery_nats_leader.beat.dispatcher.TickDispatcher` with
  the real state store and role handle, a no-op send): token check, commit,
  record of the send; beside it the one KV write the outbox adds (the
  record), timed alone;
* **per guarded execution**: the once-guard's claim and completion as a
  worker runs them (:class:`~celery_nats_leader.worker.once_tasks.OnceService`,
  the synchronous calls of a task around its body), for a first run and for
  a duplicate (acknowledged without running).

Run: ``python benchmarks/ticks_cost.py [--runs N]``. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from celery_nats_leader.beat.dispatcher import Tick, TickDispatcher
from celery_nats_leader.beat.schedule_store import EntryState, ScheduleStateStore
from celery_nats_leader.config import ElectionConfig
from celery_nats_leader.config.settings import LeaderSettings
from celery_nats_leader.election.elector import Elector
from celery_nats_leader.testing import NatsServer
from celery_nats_leader.worker.once_tasks import OnceService

UTC = timezone.utc


def _row(label: str, samples: list[float]) -> str:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return (
        f"| {label} | {len(samples)} | {statistics.median(samples) * 1e3:.2f} ms "
        f"| {p99 * 1e3:.2f} ms |"
    )


def _timed(call: Callable[[], object], runs: int) -> list[float]:
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return samples


def bench_dispatch(url: str, runs: int) -> list[str]:
    config = ElectionConfig(role="beat", bucket="bench", ttl=10.0, create_bucket=True)
    elector = Elector([url])
    handle = elector.add_role(config)
    elector.start(timeout=10.0)
    try:
        assert handle.wait_for_leadership(10.0)
        token = handle.token
        assert token is not None
        store = ScheduleStateStore(
            elector, "bench_beat", "beat", create=True, replicas=1, timeout=2.0
        )
        dispatcher = TickDispatcher(store, config.instance_id)
        dispatcher.begin_term(token)
        start = datetime(2024, 1, 1, tzinfo=UTC)
        assert dispatcher.adopt("e", start, runs=0, task="t", token=token) is not None
        ticks = iter(range(1, 10 * runs + 10))

        def dispatch() -> None:
            slot = start + timedelta(seconds=next(ticks))
            result = dispatcher.dispatch(handle, token, Tick("e", slot, task="t"), lambda c: None)
            assert result.outcome.value == "sent", result

        dispatch()  # warm up
        whole = _timed(dispatch, runs)
        validate = _timed(handle.validate_token, runs)
        state: list[EntryState] = [dispatcher.states["e"]]

        def record() -> None:
            state[0] = store.update(state[0].sent(), last=state[0].revision)

        update = _timed(record, runs)
    finally:
        elector.stop()
    return [
        _row("whole dispatch: token check + commit + send (no-op) + record", whole),
        _row("of which the token check (KV `get`)", validate),
        _row("added by the outbox: the record of the send (one KV `update`)", update),
    ]


def bench_guard(url: str, runs: int) -> list[str]:
    settings = LeaderSettings(servers=url, bucket="bench", once_lease=30.0)
    service = OnceService.for_settings(settings)
    ids = [str(uuid.uuid4()) for _ in range(runs + 1)]
    service.run(lambda guard: guard.claim(ids[-1]))  # connect, create the buckets

    def first_run(task_id: str) -> None:
        claim = service.run(lambda guard: guard.claim(task_id))
        assert claim.verdict.value == "run", claim
        service.run(lambda guard: guard.complete(claim))

    def duplicate(task_id: str) -> None:
        claim = service.run(lambda guard: guard.claim(task_id))
        assert claim.verdict.value == "done", claim

    pending = iter(ids[:runs])
    firsts = _timed(lambda: first_run(next(pending)), runs)
    again = iter(ids[:runs])
    duplicates = _timed(lambda: duplicate(next(again)), runs)
    service.close()
    return [
        _row("first run: claim (`create` + `get`) + done (`create` + `delete`)", firsts),
        _row("duplicate: claim finds the done record (`create`, `get`, `delete`)", duplicates),
    ]


def _nats_version() -> str:
    try:
        out = subprocess.run(
            ["nats-server", "--version"], capture_output=True, text=True, check=False, timeout=10
        )
        return out.stdout.strip() or out.stderr.strip()
    except OSError:
        return "nats-server (version unknown)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=500, help="samples per measurement")
    args = parser.parse_args()
    with NatsServer() as server:
        dispatch_rows = bench_dispatch(server.url, args.runs)
        guard_rows = bench_guard(server.url, args.runs)
    print(
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, {_nats_version()} on loopback."
    )
    print()
    print("| per dispatched tick (outbox) | runs | p50 | p99 |")
    print("|---|---|---|---|")
    print("\n".join(dispatch_rows))
    print()
    print("| per guarded execution (once-guard, as a worker calls it) | runs | p50 | p99 |")
    print("|---|---|---|---|")
    print("\n".join(guard_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
