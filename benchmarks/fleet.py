"""What a fleet costs: one role, N candidates each with its own NATS connection.

For each nats-server version and each topology (one server, and a 3-node
cluster started from ``deploy/nats/cluster.conf`` with an R3 bucket, as the
tests start it) and each N, at the default TTL:

* messages to join: the server's ``/varz`` ``in_msgs + out_msgs`` while N - 1
  followers join a role that already has a leader (summed over the members on
  the cluster, so routed and replicated messages count too);
* steady state: messages/s from the same counters, the server's CPU (the mean
  of ``/varz`` ``cpu`` sampled each second, and the process's CPU time from
  ``/proc``), and ``/connz`` connections;
* crash failover: SIGKILL of the leader's process to a successor's promote;
* graceful hand-over: ``KvElection.stop()`` of the leader to a successor's promote;
* a rolling restart of all N, one at a time (graceful stop, start on a new
  connection, wait until it follows): how many times leadership moved, against
  how many times the restarted candidate was the leader.

Why few OS processes: N = 200 Python processes (~30 MiB and ~0.5 s of CPU to
start each) do not fit a 2-core machine shared with other jobs, and the
server cannot tell the difference: what it serves is N connections, each with
its own watch, roster subscriptions, reads and writes. So the followers run
as many elections per process (``--hosts`` processes, each election on its
own connection, one asyncio loop per process), and each leader that is
SIGKILLed runs alone in a process of its own (with a higher priority, so that
it wins the hand-over that precedes each crash). What this shares with a real
fleet is the server side; what it does not is the client side: on a
hand-over, 50 elections of one process handle the delete event one after
another on one loop, where 50 hosts would each handle it at once.

Run with ``benchmarks/run`` (all of it) or ``python benchmarks/fleet.py
--sizes 25 --servers system --topologies single`` for a quick look.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nats_topology import fresh_bucket, topology  # benchmarks/ is the script's own folder

from celery_nats_leader import ElectionConfig, KvElection
from celery_nats_leader.config.connection import ConnectOptions
from celery_nats_leader.core.constants import DEFAULT_TTL_SECONDS
from celery_nats_leader.testing import NatsServer, binary_version, server_binary

HERE = os.path.abspath(__file__)
BUCKET = "fleet"
ROLE = "fleet"
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------ host child


def _emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "at": time.monotonic(), **fields}), flush=True)


async def _host(urls: list[str], ids: list[str], ttl: float, priority: int) -> None:
    """Run one election per id, each on its own connection; obey stdin commands.

    Commands: ``start`` (all), ``stop ID``, ``start ID``, ``restart ID [PRIORITY]``.
    Events: ``up``, ``ready``, ``promoted``, ``demoted``, ``stopping``, ``stopped``.
    """
    elections: dict[str, KvElection] = {}

    async def start(name: str, priority: int = priority) -> None:
        config = ElectionConfig(
            role=ROLE, bucket=BUCKET, instance_id=name, ttl=ttl, priority=priority
        )
        election = KvElection(config, connect_options=ConnectOptions(servers=tuple(urls)))

        @election.on_promote
        async def _promoted(token: Any) -> None:
            _emit("promoted", id=name, epoch=token.epoch)

        @election.on_demote
        async def _demoted(reason: Any) -> None:
            _emit("demoted", id=name, reason=str(reason.value))

        elections[name] = election
        await election.start()
        _emit("ready", id=name, state=election.state.value)

    async def stop(name: str) -> None:
        _emit("stopping", id=name)
        await elections.pop(name).stop()
        _emit("stopped", id=name)

    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    _emit("up", ids=ids)
    while line := (await reader.readline()).decode().strip():
        verb, *rest = line.split()
        name = rest[0] if rest else ""
        if verb == "start" and not name:
            await asyncio.gather(*(start(n) for n in ids))
        elif verb == "start":
            await start(name)
        elif verb == "stop":
            await stop(name)
        elif verb == "restart":  # restart ID [PRIORITY]
            await stop(name)
            await start(name, *(int(p) for p in rest[1:2]))
    await asyncio.gather(*(e.stop() for e in elections.values()))


# ---------------------------------------------------------------- parent side


class Host:
    """A child process running some elections; its events go to a shared queue."""

    def __init__(self, fleet: Fleet, ids: list[str], *, priority: int = 0) -> None:
        self.ids = ids
        argv = [sys.executable, HERE, "_host", ",".join(fleet.urls), ",".join(ids)]
        argv += [repr(fleet.ttl), str(priority)]
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        self._fleet = fleet
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with contextlib.suppress(ValueError):
                self._fleet.events.put(json.loads(line))

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def kill(self) -> float:
        at = time.monotonic()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        return at

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Fleet:
    """The candidates of one measurement, and the events they print."""

    def __init__(self, servers: list[NatsServer], ttl: float) -> None:
        self.servers = servers
        self.urls = [s.url for s in servers]
        self.ttl = ttl
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        self.hosts: list[Host] = []
        self.where: dict[str, Host] = {}
        self.leader: str | None = None

    def host(self, ids: list[str], *, priority: int = 0) -> Host:
        made = Host(self, ids, priority=priority)
        self.hosts.append(made)
        for name in ids:
            self.where[name] = made
        self.wait(lambda e: e["event"] == "up" and e["ids"] == ids, 60)
        return made

    def wait(self, match: Callable[[dict[str, Any]], bool], timeout: float) -> dict[str, Any]:
        """The first event from now on that matches (earlier ones are kept in ``seen``)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                event = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"no matching event within {timeout} s") from None
            self.seen.append(event)
            if event["event"] == "promoted":
                self.leader = event["id"]
            if match(event):
                return event

    def wait_all(self, event: str, ids: set[str], timeout: float) -> None:
        left = set(ids)
        while left:
            got = self.wait(lambda e: e["event"] == event and e["id"] in left, timeout)
            left.discard(got["id"])

    def close(self) -> None:
        for host in self.hosts:
            host.close()


def _is(
    kind: str, name: str | None = None, after: float = float("-inf")
) -> Callable[[dict[str, Any]], bool]:
    """A matcher for ``Fleet.wait``: this event, of this candidate, after this time."""

    def match(event: dict[str, Any]) -> bool:
        return bool(
            event["event"] == kind and (name is None or event["id"] == name) and event["at"] > after
        )

    return match


def _varz_totals(servers: list[NatsServer]) -> dict[str, float]:
    """Messages, connections and CPU seconds, summed over the running servers."""
    msgs = 0.0
    cpu_pct = 0.0
    for s in servers:
        varz = s.monitor("varz")
        msgs += varz["in_msgs"] + varz["out_msgs"]
        cpu_pct += float(varz["cpu"])
    conns = sum(int(s.monitor("connz")["num_connections"]) for s in servers)
    return {"msgs": msgs, "cpu_pct": cpu_pct, "conns": conns, "cpu_s": _cpu_seconds(servers)}


def _cpu_seconds(servers: list[NatsServer]) -> float:
    total = 0.0
    for s in servers:
        assert s.pid is not None
        fields = Path(f"/proc/{s.pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime
    return total


def measure(
    servers: list[NatsServer], replicas: int, n: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One fleet of ``n`` candidates on a fresh bucket: every measurement of one column."""
    asyncio.run(fresh_bucket([s.url for s in servers], BUCKET, args.ttl, replicas))
    fleet = Fleet(servers, args.ttl)
    out: dict[str, Any] = {"n": n}
    try:
        # The first leader runs alone, so that it can be SIGKILLed.
        crashable = "leader-0"
        fleet.host([crashable], priority=10).send("start")
        fleet.wait(_is("promoted", crashable), 60)
        followers = [f"f{i}" for i in range(n - 1)]
        per_host = -(-len(followers) // args.hosts)
        groups = [followers[i : i + per_host] for i in range(0, len(followers), per_host)]
        hosts = [fleet.host(ids) for ids in groups]
        before = _varz_totals(servers)
        t0 = time.monotonic()
        for host in hosts:
            host.send("start")
        fleet.wait_all("ready", set(followers), 120)
        joined = _varz_totals(servers)
        out["join_s"] = time.monotonic() - t0
        out["join_msgs"] = joined["msgs"] - before["msgs"]
        # Let the join's first announcements and reads pass before steady state.
        time.sleep(args.ttl / 2)
        start = _varz_totals(servers)
        t0 = time.monotonic()
        cpu_samples = []
        while time.monotonic() - t0 < args.steady:
            time.sleep(1.0)
            cpu_samples.append(_varz_totals(servers)["cpu_pct"])
        end = _varz_totals(servers)
        elapsed = time.monotonic() - t0
        out["msgs_per_s"] = (end["msgs"] - start["msgs"]) / elapsed
        out["varz_cpu"] = statistics.mean(cpu_samples)
        out["proc_cpu"] = 100 * (end["cpu_s"] - start["cpu_s"]) / elapsed
        out["conns"] = end["conns"]
        out["crash"], out["handover"] = [], []
        for run in range(args.runs):
            if fleet.leader != crashable:
                out["note"] = f"run {run}: {fleet.leader} leads, not {crashable}"
                break
            at = fleet.where[crashable].kill()
            promoted = fleet.wait(_is("promoted", after=at), args.ttl * 4)
            out["crash"].append(promoted["at"] - at)
            # The next crash needs a leader alone in its process: start one with
            # a higher priority and hand over to it (the hand-over sample).
            crashable = f"leader-{run + 1}"
            fleet.host([crashable], priority=10).send("start")
            fleet.wait(_is("ready", crashable), 60)
            successor = promoted["id"]
            fleet.where[successor].send(f"stop {successor}")
            stopping = fleet.wait(_is("stopping", successor), 30)
            handed = fleet.wait(_is("promoted"), args.ttl * 4)
            out["handover"].append(handed["at"] - stopping["at"])
            fleet.where[successor].send(f"start {successor}")
            fleet.wait(_is("ready", successor), 60)
        out["rolling"] = rolling_restart(fleet, followers, crashable)
    finally:
        fleet.close()
    return out


def rolling_restart(fleet: Fleet, followers: list[str], leader: str) -> dict[str, Any]:
    """Restart every candidate once, the leader halfway through; count the leader changes.

    After the leader's restart, wait for its successor's promote before going
    on, as an operator would wait for the role to have a leader again.
    """
    half = len(followers) // 2
    order = [*followers[:half], leader, *followers[half:]]
    mark = len(fleet.seen)
    leader_restarts = 0
    for name in order:
        was_leader = name == fleet.leader
        leader_restarts += was_leader
        # Every candidate comes back with the same priority, as in a fleet of
        # equals (the crash runs' leaders had a higher one).
        fleet.where[name].send(f"restart {name} 0")
        fleet.wait(_is("ready", name), 60)
        if was_leader and fleet.leader == name:
            with contextlib.suppress(TimeoutError):  # counted below either way
                fleet.wait(_is("promoted"), fleet.ttl * 2)
    # Any promote still on its way (there should be none) counts too.
    with contextlib.suppress(TimeoutError):
        while True:
            fleet.wait(lambda e: False, 1.0)
    changes = sum(1 for e in fleet.seen[mark:] if e["event"] == "promoted")
    # A term that ended otherwise than by its holder's stop: why it ended.
    others = sorted(
        e["reason"]
        for e in fleet.seen[mark:]
        if e["event"] == "demoted" and e["reason"] != "stopped"
    )
    return {
        "restarts": len(order),
        "changes": changes,
        "leader_restarts": leader_restarts,
        "other_demotions": others,
    }


def _ms(values: list[float]) -> str:
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0] * 1000:.0f} ms"
    low, mid, high = (1000 * v for v in (min(values), statistics.median(values), max(values)))
    return f"{mid:.0f} ({low:.0f}–{high:.0f}) ms"


def _s(values: list[float]) -> str:
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.2f} s"
    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f}) s"


def table(title: str, columns: list[dict[str, Any]]) -> None:
    print(f"\n### {title}\n")
    print("| N candidates | " + " | ".join(str(c["n"]) for c in columns) + " |")
    print("|---|" + "---:|" * len(columns))
    rows: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("messages to join (all followers)", lambda c: f"{c['join_msgs']:,.0f}"),
        ("… per follower", lambda c: f"{c['join_msgs'] / (c['n'] - 1):.1f}"),
        ("join time, all followers at once", lambda c: f"{c['join_s']:.2f} s"),
        ("steady messages/s", lambda c: f"{c['msgs_per_s']:,.0f}"),
        ("… per candidate", lambda c: f"{c['msgs_per_s'] / c['n']:.2f}"),
        ("server CPU, `varz` cpu (mean of 1-s samples)", lambda c: f"{c['varz_cpu']:.1f} %"),
        ("server CPU, `/proc` time over the window", lambda c: f"{c['proc_cpu']:.1f} %"),
        ("connections (`connz`)", lambda c: str(c["conns"])),
        ("crash failover (SIGKILL → promote)", lambda c: _s(c["crash"])),
        ("graceful hand-over (stop → promote)", lambda c: _ms(c["handover"])),
        (
            "rolling restart of all N: leader changes / leader restarts",
            lambda c: (
                f"{c['rolling']['changes']} / {c['rolling']['leader_restarts']}"
                + ("" if c["rolling"]["changes"] == c["rolling"]["leader_restarts"] else " ✗")
                + "".join(f" (demoted: {r})" for r in c["rolling"]["other_demotions"])
            ),
        ),
    ]
    for name, fmt in rows:
        print(f"| {name} | " + " | ".join(fmt(c) for c in columns) + " |")
    for c in columns:
        if "note" in c:
            print(f"\nN = {c['n']}: crash runs stopped early ({c['note']})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="25,50,100,200", help="comma-separated N")
    parser.add_argument("--servers", default="system,newest", help="as benchmarks/core.py")
    parser.add_argument("--topologies", default="single,cluster", help="single, cluster")
    parser.add_argument("--ttl", type=float, default=DEFAULT_TTL_SECONDS)
    parser.add_argument("--steady", type=float, default=20.0, help="seconds of steady state")
    parser.add_argument("--runs", type=int, default=2, help="crashes and hand-overs per N")
    parser.add_argument("--hosts", type=int, default=4, help="processes for the followers")
    parser.add_argument("--quick", action="store_true", help="N = 25 only, 10 s steady, 1 run")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.steady, args.runs = "25", 10.0, 1
    sizes = [int(n) for n in args.sizes.split(",") if n]
    print(
        f"# machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, load average {os.getloadavg()[0]:.1f}; "
        f"one role, TTL {args.ttl:g} s, followers in {args.hosts} processes, "
        f"one connection each; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    for version in [v for v in args.servers.split(",") if v]:
        binary = server_binary(version)
        label = f"nats-server {binary_version(binary)}"
        for kind in [k for k in args.topologies.split(",") if k]:
            columns = []
            with topology(kind, binary) as (servers, replicas):
                for n in sizes:
                    columns.append(measure(servers, replicas, n, args))
            where = "one server" if kind == "single" else "3-node cluster, R3 bucket"
            table(f"{label}, {where}", columns)
            print(f"\n(load average after: {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_host":
        _, _, urls_, ids_, ttl_, priority_ = sys.argv
        asyncio.run(_host(urls_.split(","), ids_.split(","), float(ttl_), int(priority_)))
    else:
        main()
