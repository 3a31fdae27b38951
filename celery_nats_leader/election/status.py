"""Reading who leads what: the status read model behind every status view.

The KV bucket says who holds each role (id, epoch, revision). Timing comes
from the live candidates themselves, asked over NATS request/reply: each
answers with its own view, measured on its own monotonic clock (the term's
age, the lease left). No wall clocks of two hosts are ever compared.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from celery_nats_leader.config import Strategy
from celery_nats_leader.core import constants as c
from celery_nats_leader.core.backend import Backend, KVEntry
from celery_nats_leader.core.constants import DEFAULT_ROSTER_WINDOW_SECONDS, ROSTER_VERB
from celery_nats_leader.core.errors import ElectionError
from celery_nats_leader.election.vocabulary import control_subject
from celery_nats_leader.term.current import term_of

#: Version of the ``election_status --json`` document; bumped only on an
#: incompatible change (fields are only ever added within one version).
STATUS_SCHEMA_VERSION = 1

#: Keys of every candidate entry of the ``--json`` document, in order.
CANDIDATE_FIELDS = (
    "id",
    "state",
    "priority",
    "is_leader",
    "epoch",
    "term_age",
    "lease_remaining",
    "last_heartbeat_age",
    "meta",
)


@dataclass(frozen=True)
class RoleStatus:
    """One role of a bucket, as the status commands print it.

    Attributes:
        role: The role (the key).
        leader_id: Instance id of the leader, or ``None`` when nobody leads.
        epoch: The leader's term epoch (fencing token epoch).
        revision: KV revision of the latest record.
        priority: The leader's priority.
        term_age: Seconds since the term began, as the leader measures it;
            ``None`` if the leader did not answer.
        expires_in: Seconds until the key expires without renewal, as the
            leader measures it (its lease plus its safety margin); ``None``
            if the leader did not answer.
        leader_meta: Metadata the leader published (hostname, pid, ...).
        candidates: Every live candidate's own description (see
            :meth:`celery_nats_leader.election.KvElection.describe`).
        problem: Why the key could not be read as a record, if so.
        answering: Whether the leader answered the roster request (``None``
            when nobody leads). A leader that does not answer is paused,
            hung, partitioned or dead; its key still names it until it expires.
        expires_within: For a leader that did not answer: the longest its
            key can last without a renewal, in seconds (from when this
            reader or a live follower first saw the current revision).
        fenced: For a key holding an operator's fence marker: the term it
            ended (``id``, ``epoch``, ``by``). Nobody leads.
        successor: With fast failover, the candidate the leader's record
            names to take over (docs/design.md); ``None`` otherwise.

    """

    role: str
    leader_id: str | None
    epoch: int | None = None
    revision: int | None = None
    priority: int | None = None
    term_age: float | None = None
    expires_in: float | None = None
    leader_meta: dict[str, Any] = field(default_factory=dict)
    candidates: list[dict[str, Any]] = field(default_factory=list)
    problem: str | None = None
    answering: bool | None = None
    expires_within: float | None = None
    fenced: dict[str, Any] | None = None
    successor: str | None = None

    @property
    def has_leader(self) -> bool:
        """Whether somebody holds the role."""
        return self.leader_id is not None

    @property
    def silent(self) -> bool:
        """Whether the key names a leader that did not answer (paused, hung or dead)."""
        return self.has_leader and self.answering is False

    @property
    def note(self) -> str | None:
        """What an operator should know beyond the leader's id, in words, or ``None``."""
        if self.silent:
            within = "" if self.expires_within is None else f" within {self.expires_within:.1f} s"
            return f"not answering; its key expires{within}"
        if self.fenced is not None:
            return (
                f"fenced: the term of {self.fenced.get('id')} (epoch {self.fenced.get('epoch')}) "
                f"ended by {self.fenced.get('by')}"
            )
        return None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict (the ``--json`` schema of the status commands)."""
        body = asdict(self)
        body["has_leader"] = self.has_leader
        body["silent"] = self.silent
        body["note"] = self.note
        return body


async def _read_roles(
    backend: Backend,
    bucket: str,
    *,
    roles: Iterable[str] = (),
    every_key: bool = True,
    timeout: float = 5.0,
    roster_window: float = DEFAULT_ROSTER_WINDOW_SECONDS,
    strategy: Strategy = "kv",
) -> list[RoleStatus]:
    """Every role in ``bucket`` (and every role in ``roles``, held or not).

    Args:
        backend: A connected backend.
        bucket: The KV bucket.
        roles: Roles to report even when nobody holds them (configured roles).
        every_key: Also report every other role that holds a record;
            ``False`` reads ``roles`` alone.
        timeout: Seconds for the KV reads.
        roster_window: Seconds to collect answers from live candidates.
        strategy: ``"kv"`` reads the bucket; ``"allcall"`` has no bucket (no
            JetStream), so ``roles`` are reported from the live candidates
            alone: the leader is the candidate that says it leads.

    Returns:
        One entry per role, sorted by role name.

    Raises:
        BucketNotFoundError: If the bucket does not exist.

    """
    if strategy == "allcall":
        return list(
            await asyncio.gather(
                *(_from_roster(backend, bucket, role, roster_window) for role in sorted(set(roles)))
            )
        )
    kv = await backend.open_bucket(bucket, ttl=None, create=False, replicas=1, timeout=timeout)
    # The keys and each record as the stream's leader has them: a listing
    # through a consumer may run on a member still catching up after a
    # restart, and miss a key or show an older record ("no leader" for a role
    # whose leader kept its term, seen after a NATS rolling update).
    asked = set(roles)
    listed = set(await kv.keys(timeout=timeout)) if every_key else set()
    ttl: list[float] = []
    names = sorted(listed | asked)

    async def read(role: str) -> tuple[KVEntry | None, float]:
        entry = await kv.get(role, timeout=timeout)
        # The entry was stored before this moment: it expires by then + TTL.
        return entry, time.monotonic()

    async def one(role: str) -> RoleStatus:
        candidates, (entry, read_at) = await asyncio.gather(
            _roster(backend, bucket, role, roster_window), read(role)
        )
        if entry is None:  # released or expired: said only of a role asked for
            return RoleStatus(role=role, leader_id=None, candidates=candidates)
        term = term_of(entry)
        record = None if term is None else term.record
        if record is None:
            return RoleStatus(
                role=role,
                leader_id=None,
                revision=entry.revision,
                candidates=candidates,
                problem=None if term is None else term.problem,
            )
        if record.is_fence:
            return RoleStatus(
                role=role,
                leader_id=None,
                revision=entry.revision,
                candidates=candidates,
                fenced=dict(record.fenced or {}),
            )
        leader_view = next(
            (cand for cand in candidates if cand.get("id") == record.id and cand.get("is_leader")),
            None,
        )
        term_age = expires_in = expires_within = None
        if leader_view is None:
            if not ttl:
                ttl.append(await kv.ttl(timeout=timeout))
            expires_within = _expires_within(
                candidates, entry.revision, ttl[0] - (time.monotonic() - read_at)
            )
        else:
            term_age = leader_view.get("term_age")
            lease = leader_view.get("lease_remaining")
            margin = leader_view.get("lease_margin") or 0.0
            expires_in = None if lease is None else round(float(lease) + float(margin), 3)
        return RoleStatus(
            role=role,
            leader_id=record.id,
            epoch=record.epoch,
            revision=entry.revision,
            priority=record.priority,
            term_age=term_age,
            expires_in=expires_in,
            leader_meta=dict(record.meta),
            candidates=candidates,
            answering=leader_view is not None,
            expires_within=expires_within,
            successor=record.successor,
        )

    statuses = await asyncio.gather(*(one(name) for name in names))
    # A key left with a marker (a released or expired term) is listed only if asked for.
    return [status for status in statuses if status.role in asked or status.revision is not None]


def _expires_within(candidates: list[dict[str, Any]], revision: int, bound: float) -> float:
    """The tightest upper bound on a silent leader's key expiry, in seconds from now.

    ``bound`` is this reader's own (it read the entry, so the entry was stored
    earlier); each live follower that saw the same revision knows when it
    first did, on its own clock, and reports the time left from there.
    """
    for cand in candidates:
        left = cand.get("leader_expires_within")
        if cand.get("observed_revision") == revision and isinstance(left, int | float):
            bound = min(bound, float(left))
    return round(max(0.0, bound), 1)


@dataclass(frozen=True)
class StatusReport:
    """Who leads what in one bucket, as the status command and admin page show it.

    Attributes:
        bucket: The KV bucket.
        servers: The NATS servers asked.
        configured_roles: Roles that must have a leader (the health probe).
        roles: One entry per role, sorted by name.

    """

    bucket: str
    servers: tuple[str, ...]
    configured_roles: tuple[str, ...]
    roles: tuple[RoleStatus, ...]

    @property
    def leaderless(self) -> list[str]:
        """Configured roles that nobody holds."""
        return [s.role for s in self.roles if s.role in self.configured_roles and not s.has_leader]

    @property
    def healthy(self) -> bool:
        """Whether every configured role has a leader."""
        return not self.leaderless

    @property
    def silent(self) -> list[str]:
        """Configured roles whose leader did not answer (paused, hung or dead)."""
        return [s.role for s in self.roles if s.role in self.configured_roles and s.silent]

    def to_dict(self) -> dict[str, Any]:
        """The ``election_status --json`` document (see the README's Django section)."""
        return {
            "schema_version": STATUS_SCHEMA_VERSION,
            "bucket": self.bucket,
            "servers": list(self.servers),
            "configured_roles": list(self.configured_roles),
            "leaderless": self.leaderless,
            "silent": self.silent,
            "healthy": self.healthy,
            "roles": [
                role_to_dict(s, configured=s.role in self.configured_roles) for s in self.roles
            ],
        }


def candidate_to_dict(candidate: dict[str, Any]) -> dict[str, Any]:
    """One live candidate, with exactly the documented keys (missing ones are ``None``)."""
    body = {name: candidate.get(name) for name in CANDIDATE_FIELDS}
    body["is_leader"] = bool(candidate.get("is_leader"))
    body["meta"] = dict(candidate.get("meta") or {})
    return body


def role_to_dict(status: RoleStatus, *, configured: bool) -> dict[str, Any]:
    """One role of the ``--json`` document."""
    return {
        "role": status.role,
        "configured": configured,
        "has_leader": status.has_leader,
        "leader_id": status.leader_id,
        "epoch": status.epoch,
        "revision": status.revision,
        "priority": status.priority,
        "term_age": status.term_age,
        "expires_in": status.expires_in,
        "leader_meta": dict(status.leader_meta),
        "candidates": [candidate_to_dict(cand) for cand in status.candidates],
        "problem": status.problem,
        "answering": status.answering,
        "expires_within": status.expires_within,
        "fenced": status.fenced,
        "note": status.note,
        "successor": status.successor,
    }


async def read_report(
    backend: Backend,
    bucket: str,
    *,
    configured_roles: Sequence[str] = (),
    only: Sequence[str] = (),
    strategy: Strategy = "kv",
    servers: Sequence[str] = (),
    timeout: float = 5.0,
    roster_window: float = c.DEFAULT_ROSTER_WINDOW_SECONDS,
) -> StatusReport:
    """Read who leads every role of ``bucket``: the one status API.

    :func:`~celery_nats_leader.ops.status.fetch_report` is the same from
    synchronous code, on a connection of its own; every status command, the admin page and
    :meth:`Elector.status <celery_nats_leader.election.elector.Elector.status>` read
    through here.

    Args:
        backend: A connected backend.
        bucket: The KV bucket (for ``"allcall"``: the subjects' namespace).
        configured_roles: Roles that must have a leader (listed even when unheld).
        only: If given, report just these roles (and require a leader for each).
        strategy: ``"kv"`` reads the bucket; ``"allcall"`` has no bucket (no
            JetStream), so the roles are reported from the live candidates
            alone: the leader is the candidate that says it leads.
        servers: The NATS servers asked (shown in the report's heading).
        timeout: Seconds for the KV reads.
        roster_window: Seconds to collect the live candidates' answers.

    Returns:
        The report: one entry per role, sorted by role name.

    Raises:
        BucketNotFoundError: If the bucket does not exist.

    """
    expected = tuple(dict.fromkeys(only or configured_roles))
    statuses = await _read_roles(
        backend,
        bucket,
        roles=expected,
        every_key=not only,
        timeout=timeout,
        roster_window=roster_window,
        strategy=strategy,
    )
    return StatusReport(
        bucket=bucket,
        servers=tuple(servers),
        configured_roles=expected,
        roles=tuple(statuses),
    )


async def _from_roster(backend: Backend, bucket: str, role: str, window: float) -> RoleStatus:
    """A role's status from its live candidates only (strategies without a bucket)."""
    candidates = await _roster(backend, bucket, role, window)
    leader = next((cand for cand in candidates if cand.get("is_leader")), None)
    if leader is None:
        return RoleStatus(role=role, leader_id=None, candidates=candidates)
    lease = leader.get("lease_remaining")
    return RoleStatus(
        role=role,
        leader_id=str(leader.get("id")),
        epoch=leader.get("epoch"),
        priority=leader.get("priority"),
        term_age=leader.get("term_age"),
        expires_in=None if lease is None else float(lease),
        leader_meta=dict(leader.get("meta") or {}),
        candidates=candidates,
    )


async def _roster(backend: Backend, bucket: str, role: str, window: float) -> list[dict[str, Any]]:
    try:
        replies = await backend.request_many(
            control_subject(bucket, role, ROSTER_VERB), b"{}", window=window
        )
    except ElectionError:
        return []
    found: list[dict[str, Any]] = []
    for reply in replies:
        try:
            body = json.loads(reply)
        except ValueError:
            continue
        if isinstance(body, dict) and "id" in body:
            found.append(body)
    return sorted(found, key=lambda cand: (not cand.get("is_leader"), str(cand.get("id"))))
