"""The elections' KV buckets: inspect, create, delete, and a deploy-time probe.

The election bucket needs ``max_age`` equal to the TTL and ``history=1``;
the beat schedule's state bucket needs ``history=1`` and no ``max_age``
(:meth:`BucketInfo.problems` says what is wrong, in words an operator can act on).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from celery_nats_leader.backend import Backend, BucketInfo
from celery_nats_leader.errors import BucketNotFoundError, ElectionError, JetStreamUnavailableError
from celery_nats_leader.nats import open_backend
from celery_nats_leader.ops.oneshot import operator_name
from celery_nats_leader.settings import LeaderSettings

logger = logging.getLogger(__name__)


async def bucket_info(backend: Backend, bucket: str, *, timeout: float = 5.0) -> BucketInfo:
    """Read a bucket's settings.

    Raises:
        BucketNotFoundError: The bucket does not exist.
        JetStreamUnavailableError: The server has no JetStream.

    """
    return await backend.bucket_info(bucket, timeout=timeout)


async def ensure_bucket(
    backend: Backend,
    bucket: str,
    *,
    ttl: float | None,
    replicas: int,
    timeout: float = 5.0,
    persistent: bool = False,
) -> BucketInfo:
    """Create the bucket (``history=1``, ``max_age=ttl``) unless it exists.

    An existing bucket is left as it is (see :meth:`BucketInfo.problems`).
    With ``persistent`` (the beat schedule's state) it gets no ``max_age``.

    Returns:
        Its settings, with ``created`` telling whether this call made it.

    Raises:
        JetStreamUnavailableError: The server has no JetStream.

    """
    try:
        return await backend.bucket_info(bucket, timeout=timeout)
    except BucketNotFoundError:
        pass
    # Created through the election backend, so it gets exactly the settings
    # elections check for (a concurrent creator is tolerated there).
    await backend.open_bucket(
        bucket,
        ttl=None if persistent else ttl,
        create=True,
        replicas=replicas,
        timeout=timeout,
        persistent=persistent,
    )
    logger.info(
        "created KV bucket %r (max_age=%s, history=1, replicas=%d)",
        bucket,
        "none" if persistent else f"{ttl:g}s",
        replicas,
    )
    info = await backend.bucket_info(bucket, timeout=timeout)
    return BucketInfo(**{**info.to_dict(), "created": True})


def bucket_ttls(settings: LeaderSettings) -> dict[str, set[float]]:
    """Each bucket the configured roles use, with the TTLs those roles want."""
    found: dict[str, set[float]] = {}
    for role in dict.fromkeys((*settings.roles, settings.beat_role)):
        config = settings.election_config(role)
        found.setdefault(config.bucket, set()).add(config.ttl)
    return found


async def delete_bucket(backend: Backend, bucket: str, *, timeout: float = 5.0) -> bool:
    """Delete a bucket and everything in it (every role's record, or the beat state).

    Live candidates of its roles fail with a missing bucket afterwards: stop
    them first.

    Returns:
        Whether the bucket existed.

    Raises:
        JetStreamUnavailableError: The server has no JetStream.

    """
    existed = await backend.delete_bucket(bucket, timeout=timeout)
    if existed:
        logger.info("deleted KV bucket %r", bucket)
    return existed


@dataclass(frozen=True)
class ProbeResult:
    """What a deploy-time probe of NATS found.

    Attributes:
        reachable: Whether a NATS server answered.
        error: Why not, or the JetStream problem.
        buckets: Per bucket: its info, or ``None`` when missing.

    """

    reachable: bool
    error: str | None = None
    buckets: dict[str, BucketInfo | None] = field(default_factory=dict)


async def probe(settings: LeaderSettings, buckets: Iterable[str], *, timeout: float) -> ProbeResult:
    """Connect and look up ``buckets``, for the ``check --deploy`` checks."""
    try:
        async with await open_backend(
            settings.connection, timeout=timeout, name=operator_name("check")
        ) as be:
            found: dict[str, BucketInfo | None] = {}
            for name in buckets:
                try:
                    found[name] = await be.bucket_info(name, timeout=timeout)
                except BucketNotFoundError:
                    found[name] = None
            return ProbeResult(reachable=True, buckets=found)
    except JetStreamUnavailableError as exc:
        return ProbeResult(reachable=True, error=str(exc))
    except ElectionError as exc:
        return ProbeResult(reachable=False, error=str(exc))


__all__ = [
    "BucketInfo",
    "ProbeResult",
    "bucket_info",
    "bucket_ttls",
    "delete_bucket",
    "ensure_bucket",
    "probe",
]
