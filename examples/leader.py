"""One candidate for a role: leads while it can, hands over on SIGTERM or Ctrl-C.

The public API only (``new_election``, ``ElectionConfig``, ``ConnectOptions``)::

    NATS_URL=nats://127.0.0.1:4222 python examples/leader.py --name a --role reports

It prints one line per event (``<name> leading epoch 7``, ``<name> stopped
leading: stopped``, ``<name> follows <id>``), so that a person or a program
(``examples/three_candidates.py``) can follow it. On SIGTERM it releases the
role: its key is deleted and another candidate leads within milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import threading

from celery_nats_leader import (
    ConnectOptions,
    DemoteReason,
    ElectionConfig,
    FencingToken,
    LeaderRecord,
    new_election,
)

_PRINT = threading.Lock()


def say(line: str) -> None:
    """Print one whole line: synchronous callbacks run on a thread of their own."""
    with _PRINT:
        print(line, flush=True)


async def run(name: str, role: str, bucket: str, ttl: float) -> None:
    """Campaign for ``role`` until SIGTERM/SIGINT, then release it."""
    servers = tuple(os.environ.get("NATS_URL", "nats://127.0.0.1:4222").split(","))
    election = new_election(
        ElectionConfig(role=role, bucket=bucket, ttl=ttl, instance_id=name, create_bucket=True),
        connect_options=ConnectOptions(servers=servers),
    )

    def promoted(token: FencingToken) -> None:
        say(f"{name} leading epoch {token.epoch}")

    def demoted(reason: DemoteReason) -> None:
        say(f"{name} stopped leading: {reason.value}")

    def leader_changed(record: LeaderRecord | None) -> None:
        if record is not None and record.id != name:
            say(f"{name} follows {record.id} (epoch {record.epoch})")

    election.on_promote(promoted)
    election.on_demote(demoted)
    election.on_leader_change(leader_changed)

    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)

    await election.start()
    say(f"{name} ready")
    try:
        await stopping.wait()
    finally:
        await election.stop()  # demote callbacks, then the key is deleted


def main() -> None:
    """Parse the arguments and run one candidate."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True, help="this candidate's id")
    parser.add_argument("--role", default="reports")
    parser.add_argument("--bucket", default="leaders")
    parser.add_argument("--ttl", type=float, default=2.0, help="seconds (the bucket's max_age)")
    args = parser.parse_args()
    asyncio.run(run(args.name, args.role, args.bucket, args.ttl))


if __name__ == "__main__":
    main()
