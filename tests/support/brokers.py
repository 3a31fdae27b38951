"""Brokers of the Celery and beat tests: kombu's filesystem transport, Redis, RabbitMQ.

Redis and RabbitMQ are the machine's shared services (``CNL_REDIS_URL`` /
``CNL_AMQP_URL`` override the local defaults): every key and queue name is
unique per test and removed afterwards. When one is unreachable, the test
fails under ``CI=true`` and is skipped elsewhere.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.services import require_service

REDIS_URL = os.environ.get("CNL_REDIS_URL", "redis://127.0.0.1:6379/0")
AMQP_URL = os.environ.get("CNL_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")

KINDS = ("filesystem", "redis", "amqp")


@dataclass
class Broker:
    """A broker of one test: its Celery URL and transport options, and what to clean up.

    Attributes:
        kind: ``filesystem``, ``redis`` or ``amqp``.
        url: The Celery ``broker_url``.
        transport_options: The Celery ``broker_transport_options``.
        prefix: Redis: the key prefix of this test (every key it creates).
        data_dir: Filesystem: the folder messages wait in.
        queues: RabbitMQ: queues (and their exchanges) to delete afterwards.

    """

    kind: str
    url: str
    transport_options: dict[str, Any] = field(default_factory=dict)
    prefix: str = ""
    data_dir: Path | None = None
    queues: set[str] = field(default_factory=set)

    def ready_messages(self, queue: str) -> int:
        """Messages waiting in ``queue`` (not delivered to any consumer)."""
        if self.kind == "redis":
            import redis

            client = redis.Redis.from_url(self.url)
            try:
                return int(client.llen(self.prefix + queue))
            finally:
                client.close()
        if self.kind == "amqp":
            from kombu import Connection

            with Connection(self.url) as conn:
                try:
                    return int(
                        conn.default_channel.queue_declare(queue, passive=True).message_count
                    )
                except Exception:
                    return 0
        assert self.data_dir is not None
        return sum(1 for name in os.listdir(self.data_dir) if name.endswith(f".{queue}.msg"))

    def cleanup(self) -> None:
        """Remove this test's Redis keys or RabbitMQ queues (files go with ``tmp_path``)."""
        if self.kind == "redis":
            import redis

            client = redis.Redis.from_url(self.url)
            try:
                keys = list(client.scan_iter(match=self.prefix + "*"))
                if keys:
                    client.delete(*keys)
            finally:
                client.close()
        elif self.kind == "amqp":
            from kombu import Connection

            with Connection(self.url) as conn:
                for name in self.queues:
                    channel = conn.channel()
                    with contextlib.suppress(Exception):
                        channel.queue_delete(name)
                    with contextlib.suppress(Exception):
                        channel.exchange_delete(name)
                    with contextlib.suppress(Exception):
                        channel.close()


def make_broker(
    kind: str,
    tmp_path: Path,
    *,
    key_prefix: str,
    store_processed: bool = True,
    redis_options: Mapping[str, Any] | None = None,
) -> Broker:
    """The broker ``kind`` for one test (call :meth:`Broker.cleanup` after it).

    Args:
        kind: One of :data:`KINDS`.
        tmp_path: The test's directory (the filesystem transport's folders go there).
        key_prefix: Redis key prefix, unique to the test (e.g. ``cnl-<uuid>:``).
        store_processed: Filesystem: keep consumed messages (for inspection).
        redis_options: Extra Redis transport options.

    Returns:
        The broker.

    """
    if kind == "filesystem":
        data, processed, control = (
            tmp_path / "fs-data",
            tmp_path / "fs-processed",
            tmp_path / "fs-control",
        )
        for path in (data, processed, control):
            path.mkdir()
        return Broker(
            kind,
            "atomicfs://",  # kombu's filesystem transport, written atomically
            {
                "data_folder_in": str(data),
                "data_folder_out": str(data),
                "processed_folder": str(processed),
                "store_processed": store_processed,
                "control_folder": str(control),
                "polling_interval": 0.05,
            },
            data_dir=data,
        )
    if kind == "redis":
        require_service("redis broker", REDIS_URL)
        # Keys of this test only, in a Redis other tests may share.
        options = {"global_keyprefix": key_prefix, **(redis_options or {})}
        return Broker(kind, REDIS_URL, options, prefix=key_prefix)
    if kind == "amqp":
        require_service("amqp broker", AMQP_URL)
        return Broker(kind, AMQP_URL, {})
    raise ValueError(f"unknown broker kind {kind!r}; one of {KINDS}")
