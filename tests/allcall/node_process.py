"""One ALLCALL candidate in a process of its own, for crash tests (SIGKILL).

Usage: ``python -m tests.allcall.node_process URL ID PRIORITY TTL HEARTBEAT SKEW``

Prints one JSON line per event on stdout, with ``time.monotonic()`` (on
Linux a system-wide clock, comparable with the parent's): ``started``,
``promote`` (with the epoch) and ``demote`` (with the reason). Runs until
killed or until its stdin is closed.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from celery_nats_leader import DemoteReason, ElectionConfig, FencingToken
from celery_nats_leader.config.connection import ConnectOptions
from celery_nats_leader.election.allcall import AllcallElection


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "t": time.monotonic(), **fields}), flush=True)


async def main(url: str, name: str, priority: int, ttl: float, hb: float, skew: float) -> None:
    election = AllcallElection(
        ElectionConfig(
            role="beat",
            instance_id=name,
            strategy="allcall",
            priority=priority,
            ttl=ttl,
            heartbeat_interval=hb,
            max_clock_skew=skew,
        ),
        connect_options=ConnectOptions(servers=(url,), options={"reconnect_time_wait": 0.1}),
    )

    @election.on_promote
    async def promoted(token: FencingToken) -> None:
        emit("promote", epoch=token.epoch)

    @election.on_demote
    async def demoted(reason: DemoteReason) -> None:
        emit("demote", reason=reason.value)

    await election.start(wait=0)
    emit("started")
    loop = asyncio.get_running_loop()
    # Block until the parent closes our stdin (a clean stop) or kills us.
    await loop.run_in_executor(None, sys.stdin.read)
    await election.stop()


if __name__ == "__main__":
    url, name, priority, ttl, hb, skew = sys.argv[1:7]
    asyncio.run(main(url, name, int(priority), float(ttl), float(hb), float(skew)))
