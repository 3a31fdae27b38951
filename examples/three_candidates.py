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
import os
from contextlib import ExitStack

from celery_nats_leader import read_status
from celery_nats_leader.nats.connection import ConnectOptions, connect
from celery_nats_leader.nats.jetstream import JetStreamBackend
from celery_nats_leader.testing import CandidateGroup

ROLE = "demo"
BUCKET = "demo_leaders"
TTL = 2.0


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


def main_demo(url: str) -> None:
    """Drive the three candidates (child processes) and narrate."""
    print(f"NATS at {url}; role {ROLE!r}, TTL {TTL:g}s")
    with CandidateGroup(url, role=ROLE, bucket=BUCKET, ttl=TTL) as group:
        names = [f"candidate-{i}" for i in range(3)]
        for name in names:
            group.spawn(name, create_bucket=True)
        group.wait_for_all("ready", names, timeout=15.0)
        first = group.wait_for("promoted", names, timeout=15.0)
        print(f"1. {first.name} leads (epoch {first['epoch']})")
        asyncio.run(print_status(url))

        rest = [n for n in names if n != first.name]
        killed_at = group[first.name].kill()
        second = group.wait_for("promoted", rest, timeout=15.0)
        print(
            f"2. SIGKILL {first.name}: {second.name} promoted after "
            f"{second.at - killed_at:.3f}s (TTL {TTL:g}s), epoch {second['epoch']}"
        )
        asyncio.run(print_status(url))

        last = [n for n in rest if n != second.name]
        stopped_at = group[second.name].terminate()
        third = group.wait_for("promoted", last, timeout=15.0)
        print(
            f"3. SIGTERM {second.name}: it released the key; {third.name} promoted after "
            f"{(third.at - stopped_at) * 1000:.1f}ms, epoch {third['epoch']}"
        )
        asyncio.run(print_status(url))
        assert first["epoch"] < second["epoch"] < third["epoch"], "epochs must grow"
        print("Epochs grew with every term: a stale leader's token is always older.")


def main() -> None:
    """Entry point: start a nats-server unless NATS_URL names one, then run the demo."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("NATS_URL"))
    args = parser.parse_args()
    with ExitStack() as stack:
        url = args.url
        if not url:
            from celery_nats_leader.testing import NatsServer

            server = stack.enter_context(NatsServer())
            url = server.url
        main_demo(url)


if __name__ == "__main__":
    main()
