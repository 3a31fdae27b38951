"""Election core benchmarks: failover, hand-over, overlap, scale, and the KV floor.

Run with ``benchmarks/run`` (or ``python benchmarks/core.py --help``). Every
timing is taken on this machine's monotonic clock; candidates are separate
processes, each with its own NATS connection, against a nats-server started
for the run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import nats
from nats.js.api import KeyValueConfig

from celery_nats_leader import ElectionConfig, Elector
from celery_nats_leader.testing import NatsServer, binary_version, server_binary

# The project's harness lives under tests/ (not shipped): import it from the root.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.harness.candidate_control import CandidateGroup

BUCKET = "bench"
HERE = os.path.abspath(__file__)


# ---------------------------------------------------------------- children


def _scale_child(url: str, roles: int, ttl: float, seconds: float) -> None:
    """Hold ``roles`` roles on one connection; print CPU share and RSS."""
    elector = Elector(url)
    for i in range(roles):
        elector.add_role(ElectionConfig(role=f"scale.r{i}", bucket=BUCKET, ttl=ttl))
    elector.start(timeout=60)
    held = sum(h.is_leader for h in elector.roles)
    # Measure steady state only: let the start-up campaigns settle first.
    time.sleep(ttl)
    cpu0, wall0 = time.process_time(), time.monotonic()
    time.sleep(seconds)
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    still = sum(h.is_leader for h in elector.roles)
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    elector.stop()
    print(
        json.dumps(
            {"held": held, "still": still, "cpu_share": cpu / wall, "rss_mib": rss_kib / 1024}
        )
    )


# ------------------------------------------------------------------ parent


def percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(pct / 100 * (len(ordered) - 1))))
    return ordered[index]


def _group(url: str, role: str, ttl: float) -> CandidateGroup:
    return CandidateGroup(url, role=role, bucket=BUCKET, ttl=ttl)


def _spawn(group: CandidateGroup) -> str:
    """Start one candidate; it prints only its own events (promoted, demoted, ...).

    Printing every follower's view of each leader change (a JSON line into a
    pipe, read by this process) costs ~10 processes CPU on every hand-over:
    on 2 cores that alone added ~1.4 ms to the median.
    """
    return group.spawn(extra_args=("--no-leader-events",)).name


def _start(group: CandidateGroup, candidates: int) -> None:
    """Spawn ``candidates`` processes and wait until they run and one leads."""
    names = [_spawn(group) for _ in range(candidates)]
    group.wait_for_all("ready", names, timeout=60)
    group.wait_for("promoted", timeout=60)


def crash_failover(
    url: str, ttl: float, runs: int, candidates: int = 5
) -> tuple[list[float], float]:
    """SIGKILL the leader among ``candidates`` processes; time until a successor's promote."""
    killed: dict[str, float] = {}
    samples: list[float] = []
    with _group(url, f"crash{str(ttl).replace('.', '_')}", ttl) as group:
        _start(group, candidates)
        for _ in range(runs):
            leader = group.leader()
            others = group.running - {leader}
            at = group[leader].kill()
            killed[leader] = at
            promoted = group.wait_for("promoted", others, timeout=ttl * 4, after=at)
            samples.append(promoted.at - at)
            # Keep the group at its size for the next run.
            group.wait_for("ready", {_spawn(group)}, timeout=60)
        return samples, group.overlap(killed)


def graceful_handoff(
    url: str, runs: int, candidates: int = 10, ttl: float = 5.0
) -> tuple[list[float], float]:
    """SIGTERM the leader (KvElection.stop()); time until a successor's promote."""
    samples: list[float] = []
    with _group(url, "handoff", ttl) as group:
        _start(group, candidates)
        for _ in range(runs):
            leader = group.leader()
            others = group.running - {leader}
            at = group[leader].terminate()
            promoted = group.wait_for("promoted", others, timeout=ttl * 4, after=at)
            samples.append(promoted.at - at)
            group[leader].wait()
            group.wait_for("ready", {_spawn(group)}, timeout=60)
        return samples, group.overlap()


def churn_handoff(
    url: str, runs: int, candidates: int = 10, ttl: float = 5.0, churn: int = 3
) -> tuple[list[float], float]:
    """Before each hand-over, SIGKILL ``churn`` followers and start replacements.

    The crashed followers' roster entries are still fresh when the leader
    stops: the successor may have to skip dead candidates ahead of it in line.
    """
    samples: list[float] = []
    killed: dict[str, float] = {}
    chooser = random.Random(7)
    with _group(url, "churn", ttl) as group:
        _start(group, candidates)
        for _ in range(runs):
            leader = group.leader()
            for victim in chooser.sample(sorted(group.running - {leader}), churn):
                killed[victim] = group[victim].kill()
            group.wait_for_all("ready", [_spawn(group) for _ in range(churn)], timeout=60)
            others = group.running - {leader}
            at = group[leader].terminate()
            promoted = group.wait_for("promoted", others, timeout=ttl * 4, after=at)
            samples.append(promoted.at - at)
            group[leader].wait()
            group.wait_for("ready", {_spawn(group)}, timeout=60)
        return samples, group.overlap(killed)


async def kv_floor(url: str, ops: int = 500) -> tuple[list[float], list[float]]:
    """Raw nats-py KV get and update round trips: the floor under every election step."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    kv = await js.create_key_value(KeyValueConfig(bucket="bench_floor", history=1, ttl=60))
    revision = await kv.put("k", b"v" * 150)
    gets, updates = [], []
    for _ in range(ops):
        t = time.monotonic()
        revision = await kv.update("k", b"v" * 150, last=revision)
        updates.append(time.monotonic() - t)
        t = time.monotonic()
        await kv.get("k")
        gets.append(time.monotonic() - t)
    await nc.close()
    return gets, updates


def scale(url: str, roles: int, ttl: float, seconds: float) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, HERE, "_scale", url, str(roles), str(ttl), str(seconds)],
        capture_output=True,
        text=True,
        check=True,
        timeout=seconds + 300,
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


Stat = tuple[str, list[float], str, float, str]  # name, samples, target, unit, suffix


def cell(values: list[float], unit: float, suffix: str) -> str:
    def fmt(v: float) -> str:
        return f"{v * unit:.3f}" if suffix == "s" else f"{v * unit:.2f}"

    if not values:
        return "–"
    if len(values) == 1:
        return f"{fmt(values[0])}{' s' if suffix == 's' else suffix}"
    return (
        f"{fmt(statistics.median(values))} / {fmt(percentile(values, 99))} / "
        f"{fmt(max(values))}{' s' if suffix == 's' else suffix}"
    )


def measure(args: argparse.Namespace, version: str) -> tuple[list[Stat], list[str]]:
    """Every core measurement against one nats-server version."""
    stats: list[Stat] = []
    extra: list[str] = []
    with NatsServer(binary=server_binary(version)) as server:
        url = server.url
        asyncio.run(_create_bucket(url, 1.0))
        gets, updates = asyncio.run(kv_floor(url))
        stats.append(("KV `get` round trip (floor)", gets, "–", 1000, " ms"))
        stats.append(("KV `update` round trip (floor)", updates, "–", 1000, " ms"))
        overlaps = 0.0
        for ttl in (1.0, 5.0):
            asyncio.run(_create_bucket(url, ttl))
            samples, overlap = crash_failover(url, ttl, args.crash_runs)
            overlaps += overlap
            stats.append(
                (f"crash failover, TTL {ttl:g} s, 5 candidates", samples,
                 f"p99 ≤ {ttl + 0.05:g} s", 1, "s")
            )  # fmt: skip
        asyncio.run(_create_bucket(url, 5.0))
        samples, overlap = graceful_handoff(url, args.handoff_runs)
        overlaps += overlap
        stats.append(("graceful hand-over, 10 candidates", samples, "p99 ≤ 5 ms", 1000, " ms"))
        samples, overlap = churn_handoff(url, max(1, args.handoff_runs // 2))
        overlaps += overlap
        stats.append(
            ("hand-over after 3 of 10 were killed and replaced", samples, "p99 ≤ 5 ms", 1000, " ms")
        )
        stats.append(("overlap of two leaders, all runs (total)", [overlaps], "0", 1000, " ms"))
        if args.scale_roles:
            asyncio.run(_create_bucket(url, 5.0))
            result = scale(url, args.scale_roles, 5.0, args.scale_seconds)
            extra.append(
                f"{args.scale_roles} roles, one process, TTL 5 s: {result['still']} held, "
                f"CPU {result['cpu_share'] * 100:.1f} % of a core, "
                f"RSS {result['rss_mib']:.0f} MiB (target < 10 %)"
            )
    return stats, extra


def main() -> None:
    parser = argparse.ArgumentParser(description="celery-nats-leader core benchmarks")
    parser.add_argument("--crash-runs", type=int, default=20)
    parser.add_argument("--handoff-runs", type=int, default=100)
    parser.add_argument("--scale-roles", type=int, default=1000, help="0 skips the scale run")
    parser.add_argument("--scale-seconds", type=float, default=30.0)
    parser.add_argument(
        "--servers",
        default="system,newest",
        help="comma-separated nats-server versions for server_binary() "
        "(system, newest, 2.10 ... 2.15, or a full version); one column each",
    )
    parser.add_argument("--quick", action="store_true", help="few runs, for a smoke check")
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="also write every sample (seconds) to PATH, for benchmarks/plots.py",
    )
    args = parser.parse_args()
    if args.quick:
        args.crash_runs, args.handoff_runs, args.scale_roles, args.scale_seconds = 3, 10, 100, 5.0

    versions = [v for v in args.servers.split(",") if v]
    numbers = [str(binary_version(server_binary(v))) for v in versions]
    labels = [f"nats-server {n}" for n in numbers]
    machine = (
        f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}"
    )
    print(f"# machine: {machine}; {', '.join(labels)}")
    load_before = os.getloadavg()[0]
    columns = [measure(args, version) for version in versions]
    if args.json:
        load = (load_before, os.getloadavg()[0])
        write_json(args.json, machine, numbers, columns, load)
    print("| measurement (p50 / p99 / max) | runs | " + " | ".join(labels) + " | target |")
    print("|---|---|" + "---|" * len(labels) + "---|")
    for i, (name, samples, target, unit, suffix) in enumerate(columns[0][0]):
        cells = [cell(stats[i][1], unit, suffix) for stats, _ in columns]
        print(f"| {name} | {len(samples)} | " + " | ".join(cells) + f" | {target} |")
    for label, (_, extra) in zip(labels, columns, strict=True):
        for line in extra:
            print(f"\n{label}: {line}")


def write_json(
    path: str,
    machine: str,
    versions: list[str],
    columns: list[tuple[list[Stat], list[str]]],
    load: tuple[float, float],
) -> None:
    """The run's samples as JSON: ``{"machine", "servers": [{"version", "measurements"}]}``.

    Each measurement has its ``name``, ``samples`` in seconds (raw, unsorted),
    the table's ``unit`` factor and ``suffix``, and its ``target``;
    ``load_average`` is the 1-minute load at the start and at the end.
    """
    servers = [
        {
            "version": version,
            "measurements": [
                {"name": name, "samples": samples, "unit": unit, "suffix": suffix, "target": target}
                for name, samples, target, unit, suffix in stats
            ],
            "notes": extra,
        }
        for version, (stats, extra) in zip(versions, columns, strict=True)
    ]
    document = {
        "benchmark": "core",
        "machine": machine,
        "load_average": [round(v, 2) for v in load],
        "servers": servers,
    }
    with open(path, "w") as out:
        json.dump(document, out, indent=1)
        out.write("\n")


async def _create_bucket(url: str, ttl: float) -> None:
    """(Re)create the benchmark bucket with ``max_age = ttl``."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    with contextlib.suppress(nats.js.errors.NotFoundError):
        await js.delete_key_value(BUCKET)
    await js.create_key_value(KeyValueConfig(bucket=BUCKET, history=1, ttl=ttl))
    await nc.close()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_scale":
        _, _, url_, roles_, ttl_, seconds_ = sys.argv
        _scale_child(url_, int(roles_), float(ttl_), float(seconds_))
    else:
        main()
