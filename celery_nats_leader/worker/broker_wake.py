"""Wake a Redis consumer whose blocking read predates a change of its queues.

kombu's Redis transport reads all consumed queues with one ``BRPOP`` that
blocks for up to ``brpop_timeout`` (1 s, or ``polling_interval``). A queue
added meanwhile, such as a leader queue on promotion, is read only once that
``BRPOP`` times out: about a second of a new leader doing nothing while its
tasks wait. Lowering ``polling_interval`` would make every worker poll Redis
more often for the whole of its life.

Instead, right after a leader queue is added, the pending ``BRPOP`` is ended
with ``CLIENT UNBLOCK`` from a second connection: Redis answers the blocked
command as if it had timed out (no message is popped, none can be lost), and
kombu issues its next ``BRPOP`` on the new set of queues at once. The blocked
connection is found in ``CLIENT LIST`` by its address, which is this socket's
local address. When that does not work (a proxy in between, ``CLIENT``
commands not allowed, Redis < 5), nothing breaks: the read simply ends at its
timeout as before.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

__all__ = ["wake_consumer"]

logger = logging.getLogger(__name__)

#: Set once the "cannot wake" warning was logged by this process.
_warned = threading.Event()


def wake_consumer(task_consumer: Any) -> bool:
    """End ``task_consumer``'s pending Redis ``BRPOP`` so that it re-reads its queues.

    Call on the consumer's thread right after changing its queues. Returns at
    once: the ``CLIENT UNBLOCK`` is sent from a short-lived thread.

    Args:
        task_consumer: A kombu consumer (Celery's ``consumer.task_consumer``).

    Returns:
        Whether a wake-up was sent (``False`` for other transports or when no
        read is pending).

    """
    channel = getattr(task_consumer, "channel", None)
    if channel is None or not type(channel).__module__.startswith("kombu.transport.redis"):
        return False
    connection = getattr(channel, "_in_poll", None)
    sock = getattr(connection, "_sock", None)
    pool = getattr(channel, "pool", None)
    if not connection or sock is None or pool is None:
        return False  # no BRPOP in flight: the next one reads the new queues
    try:
        address = sock.getsockname()
    except OSError:
        return False
    if not isinstance(address, tuple):
        return False  # a Unix socket: no address to find it by
    threading.Thread(
        target=_unblock, args=(pool, address[0], address[1]), name="nats-leader-wake", daemon=True
    ).start()
    return True


def _unblock(pool: Any, host: str, port: int) -> None:
    import redis

    wanted = {f"{host}:{port}", f"[{host}]:{port}"}
    client = redis.Redis(connection_pool=pool)
    try:
        for entry in client.client_list(_type="normal"):
            if entry.get("addr") in wanted:
                # Unblocked "as if timed out": the BRPOP returns nil, pops nothing.
                client.client_unblock(int(entry["id"]))
                return
        logger.debug("nats-leader: no Redis client at %s:%d to wake", host, port)
    except (redis.RedisError, OSError, ValueError) as exc:
        # Said once: every later promotion would fail the same way (ACLs, a proxy).
        level = logging.DEBUG if _warned.is_set() else logging.WARNING
        _warned.set()
        logger.log(
            level,
            "nats-leader: could not wake the Redis consumer (%s: %s); a promoted worker "
            "reads its leader queue only when its pending BRPOP times out (polling_interval)",
            type(exc).__name__,
            exc,
        )
    finally:
        client.close()
