"""Fencing a frozen leader: from the fence command to the successor's promotion.

Each run: three candidate processes, the leader frozen with SIGSTOP, then
:func:`~celery_nats_leader.ops.fence_leader.fence_leader` from this process. The
time is from just before the fence call to the successor's own ``promoted``
event (the children print ``time.monotonic()``, the same clock on one host).
Prints a markdown table. Run: ``python benchmarks/fence.py [--runs N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from celery_nats_leader.config.connection import ConnectOptions
from celery_nats_leader.nats.connection import connect
from celery_nats_leader.nats.jetstream import JetStreamBackend
from celery_nats_leader.ops.fence_leader import fence_leader
from celery_nats_leader.testing import NatsServer

# The project's harness lives under tests/ (not shipped): import it from the root.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.harness.candidate_control import CandidateGroup

BUCKET, ROLE, TTL = "bench_fence", "job", 10.0


async def one_run(server: NatsServer, run: int) -> float:
    """One fence of a frozen leader; returns seconds to the successor's promotion."""
    nc = await connect(ConnectOptions.build(server.url), timeout=5)
    try:
        backend = JetStreamBackend(nc)
        await backend.open_bucket(f"{BUCKET}{run}", ttl=TTL, create=True, replicas=1, timeout=5)
        with CandidateGroup(server.url, role=ROLE, bucket=f"{BUCKET}{run}", ttl=TTL) as group:
            for name in ("a", "b", "c"):
                group.spawn(name)
            await asyncio.to_thread(group.wait_for_all, "ready", ["a", "b", "c"], timeout=60)
            first = await asyncio.to_thread(group.wait_for, "promoted", timeout=TTL + 5)
            await asyncio.to_thread(group[first.name].pause)
            called = time.monotonic()
            # handover_wait=0: the fence write itself, not the wait for a frozen leader's answer.
            await fence_leader(
                backend, f"{BUCKET}{run}", ROLE, requester="bench", wait=0, handover_wait=0
            )
            others = {"a", "b", "c"} - {first.name}
            second = await asyncio.to_thread(group.wait_for, "promoted", others, timeout=TTL)
            await asyncio.to_thread(group[first.name].resume)
            return second.at - called
    finally:
        await nc.close()


def server_version() -> str:
    from celery_nats_leader.testing.nats_server import find_nats_server_binary

    out = subprocess.run(
        [find_nats_server_binary(), "--version"], capture_output=True, text=True, check=False
    )
    return out.stdout.strip()


async def main_async(runs: int) -> None:
    with NatsServer() as server:
        times = [await one_run(server, run) for run in range(runs)]
    ms = sorted(t * 1000 for t in times)
    print(f"{server_version()}, {platform.machine()}, {runs} runs, TTL {TTL:g} s")
    print()
    print("| fence -> successor promoted | median | p90 | max |")
    print("|---|---|---|---|")
    p90 = ms[min(len(ms) - 1, int(len(ms) * 0.9))]
    median = statistics.median(ms)
    print(f"| frozen leader (SIGSTOP) | {median:.1f} ms | {p90:.1f} ms | {ms[-1]:.1f} ms |")


def main() -> None:
    """Parse the options and run."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=20)
    asyncio.run(main_async(parser.parse_args().runs))


if __name__ == "__main__":
    main()
