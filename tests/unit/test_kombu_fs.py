"""The tests' filesystem broker: queues declared by several processes at once.

kombu's own filesystem transport creates an exchange's table file before it
locks and writes it: a worker declaring its queues while another starts could
read an empty table and die on ``JSONDecodeError``. ``atomicfs`` replaces
tables whole; here eight processes bind a queue each to one exchange at the
same instant while reading the table, for many new exchanges (the race is
at a table's creation), and every binding must be there.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

from kombu import Connection, Exchange, Queue

from celery_nats_leader.testing import kombu_fs

PROCESSES = 8
EXCHANGES = 30


def _declare(folder: str, index: int, start: Any, results: Any) -> None:
    kombu_fs.register()
    options = {
        "data_folder_in": f"{folder}/data",
        "data_folder_out": f"{folder}/data",
        "control_folder": f"{folder}/control",
    }
    try:
        with Connection("atomicfs://", transport_options=options) as connection:
            channel = connection.channel()
            for number in range(EXCHANGES):
                exchange = Exchange(f"shared{number}", type="direct")
                queue = Queue(f"q{index}", exchange, routing_key=f"q{index}")
                start.wait()  # all bind to a table nobody has created yet
                queue(channel).declare()
                channel.get_table(f"shared{number}")  # reads while the others write
            results.put((index, None))
    except Exception as exc:  # reported to the test, which names it
        results.put((index, repr(exc)))


def test_queues_declared_at_once_by_many_processes_are_all_bound(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    context = multiprocessing.get_context("fork")
    start = context.Barrier(PROCESSES)
    results = context.Queue()
    processes = [
        context.Process(target=_declare, args=(str(tmp_path), i, start, results))
        for i in range(PROCESSES)
    ]
    for process in processes:
        process.start()
    outcomes = dict(results.get(timeout=60) for _ in processes)
    for process in processes:
        process.join(10)
    assert outcomes == dict.fromkeys(range(PROCESSES))

    kombu_fs.register()
    options = {"control_folder": str(tmp_path / "control")}
    with Connection("atomicfs://", transport_options=options) as connection:
        channel = connection.channel()
        tables = [channel.get_table(f"shared{number}") for number in range(EXCHANGES)]
    bound = [sorted(row[2] for row in table) for table in tables]
    assert bound == [sorted(f"q{i}" for i in range(PROCESSES))] * EXCHANGES
