"""NATS connections and threads of one worker host, counted on the server and in /proc.

A prefork worker (``-c 8`` by default) on kombu's filesystem broker runs every
kind of guarded task, many of each, so that every child runs every kind:
``@leader_only``, ``@leader_only(validate=True)``, ``@leader_only @run_once``
and a beat-fenced ``@leader_only(validate=True) @run_once`` task
(``FencedBeatTask``). Then the server's ``connz`` is joined with the worker's
processes (the sockets' owners in ``/proc``) and each process's thread count
is read.

Run with ``python benchmarks/process_connections.py [--pool prefork] [--concurrency 8]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "celery"), str(ROOT)]

from cnl_celery_harness import Cluster  # noqa: E402

from celery_nats_leader.beat import EPOCH_HEADER, ROLE_HEADER  # noqa: E402
from celery_nats_leader.testing import NatsServer  # noqa: E402
from tests.support.brokers import make_broker  # noqa: E402
from tests.support.connections import (  # noqa: E402
    connections_by_process,
    process_tree,
    thread_count,
)

KINDS = ("cnl.record", "cnl.record_validated", "cnl.record_once", "cnl.record_fenced")


def measure(pool: str, concurrency: int, per_kind: int) -> list[str]:
    with tempfile.TemporaryDirectory() as tmp, NatsServer() as server:
        broker = make_broker("filesystem", Path(tmp), key_prefix="bench-pc:")
        cluster = Cluster(Path(tmp), server, broker, ttl=4.0)
        try:
            worker = cluster.start_worker("w1", pool=pool, concurrency=concurrency)
            cluster.wait_leader()
            epoch = cluster.ledger.promotions()[-1].epoch
            assert epoch is not None
            headers = {
                EPOCH_HEADER: epoch,
                ROLE_HEADER: cluster.role,
            }
            sent = 0
            for _ in range(per_kind):
                for kind in KINDS:
                    options = {"headers": headers} if kind == "cnl.record_fenced" else {}
                    cluster.send(kind, sent, 0.02, options=options)
                    sent += 1
            deadline = time.monotonic() + 300
            while cluster.ledger.committed() < sent:
                if time.monotonic() > deadline:
                    raise TimeoutError(cluster.diagnostics())
                time.sleep(0.2)
            ran: dict[int, set[str]] = {}
            for pid, name in cluster.ledger.rows("SELECT pid, name FROM commits"):
                ran.setdefault(int(pid), set()).add(str(name))
            assert worker.pid is not None
            pids = process_tree(worker.pid)
            held = connections_by_process(server, pids)
            threads = {pid: thread_count(pid) for pid in pids}
        finally:
            cluster.close()
            broker.cleanup()
    children = pids[1:]
    rows = [
        f"| {pool} -c {concurrency}, {sent} tasks ({per_kind} of each of {len(KINDS)} kinds) | |",
        f"| main process: connections / threads | {len(held[worker.pid])} / "
        f"{threads[worker.pid]} |",
    ]
    if children:
        every_kind = sum(1 for pid in children if ran.get(pid, set()) >= set(KINDS[1:]))
        child_conns = sorted(len(held[pid]) for pid in children)
        child_threads = sorted(threads[pid] for pid in children)
        rows += [
            f"| children that ran every kind | {every_kind}/{len(children)} |",
            f"| each child: connections (min–max) | {child_conns[0]}–{child_conns[-1]} |",
            f"| each child: threads (min–max) | {child_threads[0]}–{child_threads[-1]} |",
        ]
    rows.append(
        f"| worker host: connections / threads | {sum(len(v) for v in held.values())} / "
        f"{sum(threads.values())} |"
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool", default="prefork", choices=("prefork", "threads", "solo"))
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--per-kind", type=int, default=40)
    args = parser.parse_args()
    print("| measure | value |")
    print("|---|---|")
    for row in measure(args.pool, args.concurrency, args.per_kind):
        print(row)


if __name__ == "__main__":
    main()
