"""What the operator commands print, and how they exit.

Shared by ``celery nats-leader`` and the ``manage.py election_*`` commands,
which only parse their arguments and print these lines:

* the exit codes (:data:`EXIT_OK`, :data:`EXIT_NO_LEADER`, :data:`EXIT_ERROR`);
* the status report as ``election_status`` and the admin page show it
  (:func:`status_text`, :func:`role_rows`: one line per role, and under it
  every live candidate) and as ``celery nats-leader status`` shows it
  (:func:`status_lines`, :func:`status_document`: one table row per role).

The other operations' outcomes render next to them: :mod:`.resign`
(``outcome_lines``, ``outcome_to_dict``), :mod:`.fence_leader` (``fence_lines``,
``FenceOutcome.to_dict``), :mod:`.bucket` (``outcome_lines``, ``floor_lines``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from celery_nats_leader.election.status import RoleStatus, StatusReport

#: Exit code: all is well.
EXIT_OK = 0

#: Exit code when a configured role has no leader, no leader stepped down or
#: accepted a request, or a bucket is missing or does not fit.
EXIT_NO_LEADER = 1

#: Exit code when NATS cannot be used: unreachable, bucket missing, bad settings.
EXIT_ERROR = 2

#: A line to print, and whether it is good news (``False``: a warning or an
#: error; the CLI prints those on stderr).
Line = tuple[bool, str]

#: Styles a whole line (Django's ``self.style.SUCCESS`` and friends).
Painter = Callable[[str], str]

NO_LEADER = "-- none --"


def seconds(value: float | None, suffix: str = "") -> str:
    """``12.3s`` (or ``-`` when unknown)."""
    if value is None:
        return "-"
    return f"{value:.1f}s{suffix}"


def value(item: Any) -> str:
    """A cell: ``-`` for ``None``."""
    return "-" if item is None else str(item)


@dataclass(frozen=True)
class CandidateRow:
    """One live candidate of a role, as shown.

    Attributes:
        id: Instance id.
        state: ``leader``, ``follower``, ``candidate``, ...
        priority: Its priority.
        epoch: Its term's epoch while leading.
        last_heartbeat: Age of its last confirmed renewal (leader only).
        is_leader: Whether it leads.
        host: Where it runs: worker node name (or host) and pid, from its metadata.

    """

    id: str
    state: str
    priority: str
    epoch: str
    last_heartbeat: str
    is_leader: bool
    host: str


@dataclass(frozen=True)
class RoleRow:
    """One role, as shown.

    Attributes:
        role: The role.
        leader: The leader's id, or :data:`NO_LEADER`.
        has_leader: Whether somebody leads.
        configured: Whether it must have a leader.
        epoch: The term's epoch.
        term_age: How long the term has lasted, per the leader.
        expires_in: Time until the key expires without renewal, per the leader.
        host: The leader's host and pid.
        problem: Why the key could not be read, if so.
        candidates: The live candidates.
        note: What else an operator should know (a leader not answering, a fence).

    """

    role: str
    leader: str
    has_leader: bool
    configured: bool
    epoch: str
    term_age: str
    expires_in: str
    host: str
    problem: str
    candidates: tuple[CandidateRow, ...]
    note: str = ""


def _host(meta: dict[str, Any]) -> str:
    # A Celery worker publishes its node name ("replica1@web-3"): more telling than the host.
    host = meta.get("worker") or meta.get("hostname")
    pid = meta.get("pid")
    if host is None and pid is None:
        return "-"
    return f"{host or '?'}:{pid}" if pid is not None else str(host)


def role_rows(report: StatusReport) -> list[RoleRow]:
    """The rows of the table, in role order."""
    return [_role_row(s, s.role in report.configured_roles) for s in report.roles]


def _role_row(status: RoleStatus, configured: bool) -> RoleRow:
    candidates = tuple(
        CandidateRow(
            id=str(cand.get("id")),
            state=str(cand.get("state", "?")),
            priority=value(cand.get("priority")),
            epoch=value(cand.get("epoch")),
            last_heartbeat=seconds(cand.get("last_heartbeat_age"), " ago"),
            is_leader=bool(cand.get("is_leader")),
            host=_host(dict(cand.get("meta") or {})),
        )
        for cand in status.candidates
    )
    return RoleRow(
        role=status.role,
        leader=status.leader_id or NO_LEADER,
        has_leader=status.has_leader,
        configured=configured,
        epoch=value(status.epoch),
        term_age=seconds(status.term_age),
        expires_in=seconds(status.expires_in),
        host=_host(status.leader_meta),
        problem=status.problem or "",
        candidates=candidates,
        note=status.note or "",
    )


def _table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], paint: Sequence[Painter | None]
) -> list[str]:
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    out = [line(headers)]
    for row, painter in zip(rows, paint, strict=True):
        text = line(row)
        out.append(painter(text) if painter else text)
    return out


def status_text(
    report: StatusReport,
    *,
    ok: Painter | None = None,
    bad: Painter | None = None,
    heading: Painter | None = None,
) -> str:
    """The whole table as ``election_status`` prints it.

    Args:
        report: What to show.
        ok: Paints a role that has a leader, and leaders among candidates.
        bad: Paints a configured role that has none.
        heading: Paints headings.

    """
    rows = role_rows(report)
    led = sum(1 for r in rows if r.has_leader)
    head = heading or (lambda text: text)
    plural = "s" if len(rows) != 1 else ""
    summary = (
        (
            f"{len(rows)} role{plural}, all led"
            if led == len(rows)
            else f"{led} of {len(rows)} roles led"
        )
        if rows
        else "no roles yet"
    )
    silent = sum(1 for s in report.roles if s.silent)
    if silent:
        summary += f", {silent} leader{'s' if silent != 1 else ''} not answering"
    lines = [head(f"Bucket {report.bucket!r} on {', '.join(report.servers)}: {summary}"), ""]
    lines += _table(
        ("ROLE", "LEADER", "EPOCH", "TERM AGE", "EXPIRES IN", "HOST"),
        [
            (
                r.role,
                r.leader if not r.problem else f"?? {r.problem}",
                r.epoch,
                r.term_age,
                r.expires_in,
                r.host,
            )
            for r in rows
        ],
        [ok if r.has_leader else (bad if r.configured else None) for r in rows],
    )
    for r in rows:
        lines.append("")
        if r.note:
            lines.append((bad or head)(f"{r.role}: {r.leader}: {r.note}"))
        if not r.candidates:
            lines.append(head(f"{r.role}: no live candidate answered"))
            continue
        count = len(r.candidates)
        lines.append(head(f"{r.role}: {count} live candidate{'s' if count != 1 else ''}"))
        lines += [
            "  " + text
            for text in _table(
                ("", "ID", "STATE", "PRIORITY", "EPOCH", "LAST HEARTBEAT", "HOST"),
                [
                    (
                        "*" if c.is_leader else "",
                        c.id,
                        c.state,
                        c.priority,
                        c.epoch,
                        c.last_heartbeat,
                        c.host,
                    )
                    for c in r.candidates
                ],
                [ok if c.is_leader else None for c in r.candidates],
            )
        ]
    if report.leaderless:
        lines += ["", (bad or head)(f"NO LEADER: {', '.join(report.leaderless)}")]
    return "\n".join(lines)


_BRIEF_HEADERS = ("ROLE", "LEADER", "EPOCH", "TERM AGE", "EXPIRES IN", "HOST", "PID", "WORKER")


def status_lines(report: StatusReport) -> list[Line]:
    """The report as ``celery nats-leader status`` prints it: one table row per role.

    Args:
        report: What to show.

    Returns:
        The heading, the table and one line per role with a note; then, when
        a configured role has no leader, a ``no leader: ...`` line that is
        not good (printed on stderr).

    """
    rows = []
    for status in report.roles:
        meta = status.leader_meta
        configured = status.role in report.configured_roles
        leader = status.leader_id or (NO_LEADER if configured else "-")
        if status.problem:
            leader = f"?? {status.problem}"
        elif status.silent:
            leader = f"{leader} (not answering)"
        elif status.fenced is not None:
            leader = "-- fenced --"
        rows.append(
            (
                status.role,
                leader,
                "" if status.epoch is None else str(status.epoch),
                "" if status.term_age is None else f"{status.term_age:.1f}s",
                "" if status.expires_in is None else f"{status.expires_in:.1f}s",
                str(meta.get("hostname", "")),
                str(meta.get("pid", "")),
                str(meta.get("worker", "")),
            )
        )
    lines: list[Line] = [(True, f"bucket {report.bucket!r} on {', '.join(report.servers)}")]
    lines += [(True, text) for text in _table(_BRIEF_HEADERS, rows, [None] * len(rows))]
    lines += [
        (True, f"{one.role}: {one.leader_id or 'nobody leads'}: {one.note}")
        for one in report.roles
        if one.note
    ]
    if report.leaderless:
        lines.append((False, f"no leader: {', '.join(report.leaderless)}"))
    return lines


def status_document(report: StatusReport) -> str:
    """The report as ``celery nats-leader status --json`` prints it.

    ``election_status --json`` prints :meth:`StatusReport.to_dict`, a superset
    at the top level and in the role fields.
    """
    body = {
        "bucket": report.bucket,
        "configured_roles": list(report.configured_roles),
        "leaderless": report.leaderless,
        "silent": report.silent,
        "roles": [s.to_dict() for s in report.roles],
    }
    return json.dumps(body, indent=2, sort_keys=True, default=str)


def status_exit_code(report: StatusReport, *, strict: bool = False) -> int:
    """The status commands' exit code: :data:`EXIT_OK`, or :data:`EXIT_NO_LEADER`.

    :data:`EXIT_NO_LEADER` when a configured role has no leader, or with
    ``strict`` when a configured role's leader does not answer.
    """
    return EXIT_NO_LEADER if report.leaderless or (strict and report.silent) else EXIT_OK


__all__ = [
    "EXIT_ERROR",
    "EXIT_NO_LEADER",
    "EXIT_OK",
    "NO_LEADER",
    "CandidateRow",
    "Line",
    "RoleRow",
    "role_rows",
    "seconds",
    "status_document",
    "status_exit_code",
    "status_lines",
    "status_text",
    "value",
]
