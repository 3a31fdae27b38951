"""ALLCALL failover benchmark against real nats-servers without JetStream.

Two measurements, printed as a table:

* **crash failover**: three candidates, each in its own process. The leader
  is SIGKILLed; the time from the kill to the promote callback of its
  successor (``time.monotonic()`` in both processes: on Linux a system-wide
  clock). The killed process is replaced by a fresh one after every run.
* **partition heal**: two clustered servers whose route runs through a fault
  proxy; candidates ``a`` and ``b`` on one side, ``c`` on the other. The
  route is blackholed until each side has its own leader, then healed; the
  time from the heal until exactly one candidate leads and all agree on it.

Usage::

    .venv/bin/python benchmarks/allcall_failover.py [--runs 10] [--ttl 2]
        [--heartbeat 0.2] [--skew 0.2]

The defaults are the test timings (lease 2 s, heartbeat 0.2 s, skew 0.2 s);
``--ttl 10 --heartbeat 1 --skew 1`` gives the seed's (and the library's)
defaults, at about 15 s per crash run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import random
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import nats

from celery_nats_leader import ElectionConfig, FencingToken
from celery_nats_leader.config.connection import ConnectOptions
from celery_nats_leader.election.allcall import AllcallElection
from celery_nats_leader.testing import FaultProxy, NatsServer, free_port

FAST: dict[str, Any] = {"reconnect_time_wait": 0.1, "connect_timeout": 2}


@dataclass(frozen=True)
class Timings:
    ttl: float
    heartbeat: float
    skew: float

    def config(self, name: str, priority: int = 0) -> ElectionConfig:
        return ElectionConfig(
            role="bench",
            instance_id=name,
            strategy="allcall",
            priority=priority,
            ttl=self.ttl,
            heartbeat_interval=self.heartbeat,
            max_clock_skew=self.skew,
        )


# ------------------------------------------------------------ node process


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "t": time.monotonic(), **fields}), flush=True)


async def run_node(url: str, name: str, timings: Timings) -> None:
    """One candidate (``--node`` mode): prints its events as JSON lines."""
    election = AllcallElection(
        timings.config(name), connect_options=ConnectOptions(servers=(url,), options=FAST)
    )

    @election.on_promote
    async def promoted(token: FencingToken) -> None:
        emit("promote", epoch=token.epoch)

    await election.start(wait=0)
    # The init phase lasts exactly lease + skew; one heartbeat more and the
    # first allcall is out: from then on this node is a ready successor.
    await asyncio.sleep(timings.ttl + timings.skew + timings.heartbeat)
    emit("ready", phase=election.phase)
    await asyncio.Event().wait()  # until killed


class Child:
    def __init__(self, proc: asyncio.subprocess.Process, name: str) -> None:
        self.proc = proc
        self.name = name
        self.events: list[dict[str, Any]] = []
        self.changed = asyncio.Event()
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for line in self.proc.stdout:
            self.events.append(json.loads(line))
            self.changed.set()

    def promoted_after(self, t: float) -> float | None:
        return next((e["t"] for e in self.events if e["event"] == "promote" and e["t"] > t), None)

    def has(self, kind: str) -> bool:
        return any(e["event"] == kind for e in self.events)

    async def close(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
        await self.proc.wait()
        self.reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.reader


async def spawn(url: str, name: str, timings: Timings) -> Child:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--node",
        url,
        name,
        "--ttl",
        str(timings.ttl),
        "--heartbeat",
        str(timings.heartbeat),
        "--skew",
        str(timings.skew),
        stdout=asyncio.subprocess.PIPE,
    )
    return Child(proc, name)


async def until(children: list[Child], predicate: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("benchmark condition not reached")
        waits = [asyncio.ensure_future(c.changed.wait()) for c in children]
        for c in children:
            c.changed.clear()
        _, pending = await asyncio.wait(waits, timeout=remaining, return_when="FIRST_COMPLETED")
        for w in pending:
            w.cancel()


async def crash_failover(runs: int, timings: Timings) -> list[float]:
    init = timings.ttl + timings.skew
    results: list[float] = []
    with NatsServer(jetstream=False) as server:
        children = [await spawn(server.url, f"n{i}", timings) for i in range(3)]
        counter = 3
        try:
            await until(children, lambda: any(c.has("promote") for c in children), init + 10)
            for run in range(runs):
                pool = children
                await until(pool, lambda pool=pool: all(c.has("ready") for c in pool), init + 10)
                # Events arrive on the children's heartbeat grids: fault at a
                # random instant, or every run hits the same phase.
                await asyncio.sleep(random.uniform(0, 5 * timings.heartbeat))
                leader = max(
                    (c for c in children if c.has("promote")),
                    key=lambda c: max(e["t"] for e in c.events if e["event"] == "promote"),
                )
                leader.proc.send_signal(signal.SIGKILL)
                killed = time.monotonic()
                rest = [c for c in children if c is not leader]
                await until(
                    rest,
                    lambda rest=rest, killed=killed: any(c.promoted_after(killed) for c in rest),
                    2 * init + 5,
                )
                took = min(t for c in rest if (t := c.promoted_after(killed)) is not None) - killed
                results.append(took)
                print(f"  crash run {run + 1}/{runs}: new leader after {took:.3f}s", flush=True)
                await leader.close()
                children = [*rest, await spawn(server.url, f"n{counter}", timings)]
                counter += 1
        finally:
            for child in children:
                await child.close()
    return results


# ---------------------------------------------------------------- partition


@dataclass
class Cluster:
    elections: list[AllcallElection] = field(default_factory=list)

    def leaders(self) -> list[AllcallElection]:
        return [e for e in self.elections if e.is_leader]

    def converged(self) -> bool:
        leaders = self.leaders()
        return len(leaders) == 1 and all(
            e.leader_id == leaders[0].instance_id for e in self.elections
        )


async def wait_routed(first: str, second: str) -> None:
    one = await nats.connect(first)
    two = await nats.connect(second)
    try:
        got = asyncio.Event()

        async def received(msg: Any) -> None:
            got.set()

        await one.subscribe("route.check", cb=received)
        await one.flush()
        while not got.is_set():
            await two.publish("route.check", b"")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(got.wait(), 0.05)
    finally:
        await one.close()
        await two.close()


async def poll(predicate: Any, timeout: float, interval: float = 0.005) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise TimeoutError("benchmark condition not reached")
        await asyncio.sleep(interval)
    return time.monotonic() - start


async def partition_heal(runs: int, timings: Timings) -> list[float]:
    init = timings.ttl + timings.skew
    route_port = free_port()
    first = NatsServer(
        jetstream=False, server_name="b1", cluster_name="bench", cluster_port=route_port
    )
    await asyncio.to_thread(first.start)
    proxy = FaultProxy("127.0.0.1", route_port)
    await proxy.start()
    second = NatsServer(
        jetstream=False,
        server_name="b2",
        cluster_name="bench",
        cluster_port=free_port(),
        routes=[f"nats://127.0.0.1:{proxy.port}"],
    )
    await asyncio.to_thread(second.start)
    results: list[float] = []
    cluster = Cluster()
    try:
        await wait_routed(first.url, second.url)
        for name, priority, url in (("a", 9, first.url), ("b", 5, first.url), ("c", 1, second.url)):
            election = AllcallElection(
                timings.config(name, priority),
                connect_options=ConnectOptions(servers=(url,), options=FAST),
            )
            cluster.elections.append(election)
        await asyncio.gather(*(e.start(wait=0) for e in cluster.elections))
        a, _, c = cluster.elections
        for run in range(runs):
            await poll(cluster.converged, 2 * init + 10)
            proxy.blackhole()
            await poll(lambda: a.is_leader and c.is_leader, 2 * init + 10)
            await asyncio.sleep(random.uniform(0, 5 * timings.heartbeat))  # random phase
            proxy.heal()
            healed = time.monotonic()
            await poll(cluster.converged, 2 * init + 10)
            took = time.monotonic() - healed
            results.append(took)
            print(
                f"  partition run {run + 1}/{runs}: one leader "
                f"({cluster.leaders()[0].instance_id}) {took:.3f}s after healing",
                flush=True,
            )
            await wait_routed(first.url, second.url)
    finally:
        await asyncio.gather(*(e.stop() for e in cluster.elections), return_exceptions=True)
        await proxy.stop()
        await asyncio.to_thread(second.close)
        await asyncio.to_thread(first.close)
    return results


# ------------------------------------------------------------------- report


def percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[rank - 1]


def row(name: str, values: list[float], expected: str) -> str:
    return (
        f"| {name:<34} | {len(values):>4} | {statistics.median(values):>7.3f} | "
        f"{percentile(values, 99):>7.3f} | {max(values):>7.3f} | {expected:<28} |"
    )


async def main(args: argparse.Namespace) -> None:
    # The library logs every step-down at WARNING; the per-run lines say enough.
    logging.basicConfig(level=logging.ERROR)
    timings = Timings(args.ttl, args.heartbeat, args.skew)
    print(
        f"ALLCALL, nats-server without JetStream: lease {timings.ttl:g}s, "
        f"heartbeat {timings.heartbeat:g}s, max clock skew {timings.skew:g}s",
        flush=True,
    )
    crash = await crash_failover(args.runs, timings)
    heal = await partition_heal(args.partition_runs, timings)
    window = timings.ttl + timings.skew
    print()
    print(f"| {'scenario':<34} | runs | p50 (s) | p99 (s) | max (s) | {'bound':<28} |")
    print(f"|{'-' * 36}|------|---------|---------|---------|{'-' * 30}|")
    print(
        row(
            "crash failover (SIGKILL → promote)",
            crash,
            f"≤ lease+skew+hb = {window + timings.heartbeat:.2f}",
        )
    )
    print(row("partition heal → one leader", heal, f"≤ lease = {timings.ttl:.2f}"))


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="crash runs (default 10)")
    parser.add_argument("--partition-runs", type=int, default=10, help="partition runs")
    parser.add_argument("--ttl", type=float, default=2.0, help="lease, seconds")
    parser.add_argument("--heartbeat", type=float, default=0.2, help="seconds")
    parser.add_argument("--skew", type=float, default=0.2, help="max clock skew, seconds")
    parser.add_argument("--node", nargs=2, metavar=("URL", "NAME"), help=argparse.SUPPRESS)
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse()
    if arguments.node:
        url, name = arguments.node
        timings = Timings(arguments.ttl, arguments.heartbeat, arguments.skew)
        asyncio.run(run_node(url, name, timings))
    else:
        asyncio.run(main(arguments))
