"""Three candidate processes elect a leader; the leader is killed; then a clean stop.

Run it with ``scripts/demo``. It starts its own nats-server (JetStream, a
temporary store) unless ``NATS_URL`` names one, and prints what happens:

* who leads, as the status reader sees it;
* the leader is killed with SIGKILL: a follower takes over within the TTL;
* the new leader is stopped with SIGTERM: it releases the key and a follower
  is promoted within milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from typing import Any

from celery_nats_leader import Election, ElectionConfig, read_status
from celery_nats_leader.backend.jetstream import JetStreamBackend
from celery_nats_leader.connection import ConnectOptions, connect

ROLE = "demo"
BUCKET = "demo_leaders"
TTL = 2.0


_print_lock = threading.Lock()


def emit(event: str, **fields: Any) -> None:
    """Tell the parent what happened, one JSON line, timed on this host's monotonic clock."""
    line = json.dumps({"event": event, "at": time.monotonic(), **fields})
    with _print_lock:  # callbacks print from their own thread
        print(line, flush=True)


async def candidate(url: str, name: str) -> None:
    """Run one candidate until SIGTERM (graceful) or SIGKILL (crash)."""
    config = ElectionConfig(role=ROLE, bucket=BUCKET, ttl=TTL, instance_id=name, create_bucket=True)
    election = Election(config, connect_options=ConnectOptions(servers=(url,)))
    election.on_promote(lambda token: emit("promoted", id=name, epoch=token.epoch))
    election.on_demote(lambda reason: emit("demoted", id=name, reason=reason.value))
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await election.start()
    emit("ready", id=name, pid=os.getpid())
    await stop.wait()
    await election.stop()
    emit("stopped", id=name)


async def print_status(url: str) -> None:
    """Print the role table, as an operator would see it."""
    nc = await connect(ConnectOptions(servers=(url,)))
    try:
        rows = await read_status(JetStreamBackend(nc), BUCKET, roles=[ROLE])
    finally:
        await nc.close()
    for row in rows:
        alive = ", ".join(f"{c['id']}({c['state']})" for c in row.candidates)
        print(f"  role={row.role} leader={row.leader_id} epoch={row.epoch} candidates: {alive}")


class Candidates:
    """The three child processes and the events they print."""

    def __init__(self, url: str) -> None:
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.unclaimed: list[dict[str, Any]] = []
        for i in range(3):
            name = f"candidate-{i}"
            proc = subprocess.Popen(
                [sys.executable, __file__, "--candidate", name, "--url", url],
                stdout=subprocess.PIPE,
                text=True,
            )
            self.procs[name] = proc
            threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.events.put(json.loads(line))

    def next_event(self, wanted: str, among: list[str], timeout: float = 15.0) -> dict[str, Any]:
        """Return the first event ``wanted`` printed by one of ``among``."""
        deadline = time.monotonic() + timeout
        while True:
            for event in self.unclaimed:
                if event["event"] == wanted and event["id"] in among:
                    self.unclaimed.remove(event)
                    return event
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no {wanted!r} event within {timeout}s")
            try:
                self.unclaimed.append(self.events.get(timeout=remaining))
            except queue.Empty:
                continue

    def close(self) -> None:
        """Kill whatever still runs."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def main_demo(url: str) -> None:
    """Drive the three candidates and narrate."""
    print(f"NATS at {url}; role {ROLE!r}, TTL {TTL:g}s")
    group = Candidates(url)
    try:
        names = list(group.procs)
        for _ in names:
            group.next_event("ready", names)
        first = group.next_event("promoted", names)
        print(f"1. {first['id']} leads (epoch {first['epoch']})")
        asyncio.run(print_status(url))

        rest = [n for n in names if n != first["id"]]
        killed_at = time.monotonic()
        group.procs[first["id"]].send_signal(signal.SIGKILL)
        second = group.next_event("promoted", rest)
        print(
            f"2. SIGKILL {first['id']}: {second['id']} promoted after "
            f"{second['at'] - killed_at:.3f}s (TTL {TTL:g}s), epoch {second['epoch']}"
        )
        asyncio.run(print_status(url))

        last = [n for n in rest if n != second["id"]]
        stopped_at = time.monotonic()
        group.procs[second["id"]].send_signal(signal.SIGTERM)
        third = group.next_event("promoted", last)
        print(
            f"3. SIGTERM {second['id']}: it released the key; {third['id']} promoted after "
            f"{(third['at'] - stopped_at) * 1000:.1f}ms, epoch {third['epoch']}"
        )
        asyncio.run(print_status(url))
        assert first["epoch"] < second["epoch"] < third["epoch"], "epochs must grow"
        print("Epochs grew with every term: a stale leader's token is always older.")
    finally:
        group.close()


def main() -> None:
    """Entry point: parent (the demo) or child (one candidate)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidate", help=argparse.SUPPRESS)
    parser.add_argument("--url", default=os.environ.get("NATS_URL"))
    args = parser.parse_args()
    if args.candidate:
        asyncio.run(candidate(args.url, args.candidate))
        return
    with ExitStack() as stack:
        url = args.url
        if not url:
            from celery_nats_leader.testing import NatsServer

            server = stack.enter_context(NatsServer())
            url = server.url
        main_demo(url)


if __name__ == "__main__":
    main()
