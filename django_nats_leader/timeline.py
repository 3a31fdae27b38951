"""Who led when: the admin page's timeline, an inline SVG drawn on the server.

Terms are rebuilt from the event trail kept by the events stream (see
:mod:`celery_nats_leader.ops.events`): a term starts at its ``promoted`` event
and ends at the ``demoted``/``released``/``resigned``/``fenced`` event of the
same epoch (or is still running). Positions come from the times the NATS
server stored the events, one clock for all of them; they are for display
only and never decide anything.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from html import escape

from celery_nats_leader.election.events import EventKind, TransitionEvent

#: Size of one role's chart, pixels.
WIDTH, BAR_HEIGHT, AXIS_HEIGHT = 900, 28, 18

#: Fill colours of successive leaders (cycled), readable on white and dark themes.
PALETTE = ("#417690", "#79aec8", "#5b8a3a", "#b07b2c", "#8a5a9b", "#3a8a85")


@dataclass(frozen=True)
class Term:
    """One term of one role, as the events tell it.

    Attributes:
        role: The role.
        leader: The leader's instance id.
        epoch: The term's epoch.
        start: When the ``promoted`` event was stored.
        end: When the term's last event was stored, or ``None`` while it runs.
        ended_by: The ending event (``demoted``, ``released``, ...), if any.
        reason: Why it ended, if it did.

    """

    role: str
    leader: str
    epoch: int | None
    start: dt.datetime
    end: dt.datetime | None = None
    ended_by: str | None = None
    reason: str | None = None


def stored_time(event: TransitionEvent) -> dt.datetime | None:
    """The server's time of a kept event (NATS gives nanoseconds: cut to microseconds)."""
    if not event.stored_at:
        return None
    text = event.stored_at.rstrip("Z")
    head, _, fraction = text.partition(".")
    text = f"{head}.{fraction[:6].ljust(6, '0')}" if fraction else head
    try:
        return dt.datetime.fromisoformat(text).replace(tzinfo=dt.timezone.utc)
    except ValueError:
        return None


def terms(events: Iterable[TransitionEvent]) -> dict[str, list[Term]]:
    """Every role's terms, oldest first."""
    found: dict[str, list[Term]] = {}
    open_terms: dict[tuple[str, int | None, str], int] = {}
    for event in events:
        when = stored_time(event)
        if when is None:
            continue
        role_terms = found.setdefault(event.role, [])
        key = (event.role, event.epoch, event.id)
        if event.event is EventKind.PROMOTED:
            open_terms[key] = len(role_terms)
            role_terms.append(Term(event.role, event.id, event.epoch, when))
            continue
        index = open_terms.pop(key, None)
        if index is None:
            continue  # its promotion is older than the kept history
        term = role_terms[index]
        role_terms[index] = Term(
            term.role, term.leader, term.epoch, term.start, when, event.event.value, event.reason
        )
    return found


def _x(when: dt.datetime, start: dt.datetime, span: float) -> float:
    return round((when - start).total_seconds() / span * WIDTH, 1)


def timeline_svg(role_terms: Sequence[Term], *, now: dt.datetime, since: dt.datetime) -> str:
    """One role's terms between ``since`` and ``now`` as an inline ``<svg>`` element.

    Args:
        role_terms: The role's terms (from :func:`terms`).
        now: The right edge (the page's "as of").
        since: The left edge.

    Returns:
        SVG markup; every text in it is escaped.

    """
    span = max((now - since).total_seconds(), 1.0)
    height = BAR_HEIGHT + AXIS_HEIGHT
    colours: dict[str, str] = {}
    parts = [
        f'<svg class="election-timeline" xmlns="http://www.w3.org/2000/svg" '
        f'width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" role="img">',
        f'<rect x="0" y="0" width="{WIDTH}" height="{BAR_HEIGHT}" fill="#eeeeee"/>',
    ]
    for term in role_terms:
        end = term.end or now
        if end < since:
            continue
        left = _x(max(term.start, since), since, span)
        right = _x(min(end, now), since, span)
        colour = colours.setdefault(term.leader, PALETTE[len(colours) % len(PALETTE)])
        ending = "still leading" if term.end is None else f"{term.ended_by} ({term.reason})"
        title = f"{term.leader}, epoch {term.epoch}: {term.start:%H:%M:%S} - " + (
            "now" if term.end is None else f"{term.end:%H:%M:%S}"
        )
        width = max(right - left, 3.0)  # a term of a few ms stays visible
        parts.append(
            f'<g class="term" data-leader="{escape(term.leader)}" data-epoch="{term.epoch}">'
            f"<title>{escape(title)}, {escape(ending)}</title>"
            f'<rect x="{left}" y="2" width="{width}" height="{BAR_HEIGHT - 4}" '
            f'fill="{colour}" stroke="#ffffff"/>'
        )
        if width > 60:
            label = escape(f"{term.leader} #{term.epoch}")
            parts.append(
                f'<text x="{left + 4}" y="{BAR_HEIGHT - 10}" font-size="11" fill="#ffffff">'
                f"{label}</text>"
            )
        parts.append("</g>")
    for label, x in ((f"{since:%H:%M:%S}", 2.0), (f"{now:%H:%M:%S} UTC", WIDTH - 2.0)):
        anchor = "start" if x < WIDTH / 2 else "end"
        parts.append(
            f'<text x="{x}" y="{height - 4}" font-size="11" text-anchor="{anchor}" '
            f'fill="#666666">{escape(label)}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


__all__ = ["Term", "stored_time", "terms", "timeline_svg"]
