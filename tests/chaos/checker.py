"""An independent checker of a chaos run: it reads recorded events, nothing else.

Every process of a soak (election candidates, the fault scheduler, beat,
workers) appends JSON lines to its own file in one directory. Each line has
``t`` (:func:`time.monotonic` of the writer: ``CLOCK_MONOTONIC``, one clock for
the whole host, so lines of different processes are ordered by it), ``proc``
(the writer's name) and ``kind``:

============== ==================================================================
promote        ``proc`` leads ``role`` from now (``epoch``, ``lease`` seconds)
demote         ``proc`` stopped leading ``role`` (``reason``)
renewed        ``proc``'s renewal of ``role`` was confirmed: its lease runs
               ``until`` (the renewal's send time + the lease)
write          a fenced write (``resource``, ``role``, ``epoch``, ``accepted``),
               recorded while the resource's lock is held: the resource's order
killed         the scheduler killed ``proc`` (recorded once it is dead)
exited         ``proc`` exited (seen by the scheduler)
paused         ``proc`` is stopped (recorded once the kernel says so)
resumed        ``proc`` is about to be continued (recorded before SIGCONT)
fault          the scheduler injects a fault (``fault``, ``target``, ``roles``)
fence_reset    the operator cleared every fence (the bucket was recreated)
tick           beat dispatched a tick (``tick``: the tick's identity)
sent           a leader-only task was sent (``task``)
received       a worker took a task's message from the broker (``task``, ``worker``)
left           at the end, a task's message is still in the broker (``task``, ``where``)
run            a task ran (``task``, and ``tick`` for a tick's task)
============== ==================================================================

The checker knows one fact about the system beyond the events: a process
believes it leads only until its lease deadline, which its own clock checks on
every question. After a ``renewed`` line the deadline is at most its
``until``; a belief ends there even when the ``demote`` line comes later (a
starved or paused process runs its callbacks late). In particular a process
resumed after a pause longer than its lease has no lease when it resumes.

:func:`check` returns a :class:`Report`; :meth:`Report.table` prints it.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "Event",
    "FaultOutcome",
    "Report",
    "Violation",
    "check",
    "load_events",
]

#: Faults after which a successor must lead within TTL + this (seconds).
CRASH_SLACK = 0.05
#: Faults after which a successor must lead within this (seconds).
GRACEFUL_BOUND = 0.05
#: Fault kinds judged against ``TTL + CRASH_SLACK``.
CRASH_FAULTS = frozenset({"sigkill", "sigstop"})
#: Fault kinds judged against ``GRACEFUL_BOUND``.
GRACEFUL_FAULTS = frozenset({"sigterm"})


@dataclass(frozen=True)
class Event:
    """One recorded line."""

    t: float
    proc: str
    kind: str
    data: Mapping[str, Any]

    def get(self, name: str, default: Any = None) -> Any:
        """A field of the line."""
        return self.data.get(name, default)


@dataclass(frozen=True)
class Violation:
    """A broken invariant, with when and who."""

    kind: str
    at: float
    detail: str


@dataclass(frozen=True)
class FaultOutcome:
    """What followed one fault.

    Attributes:
        kind: The fault kind (``sigkill``, ``blackhole``, ...).
        at: When it was injected.
        target: The process or server it hit.
        leaderless: Per role whose leader it hit: seconds without a live
            leader that followed (``inf`` if none came back before the end).
        bound: The bound the leaderless time is judged against, if any.

    """

    kind: str
    at: float
    target: str
    leaderless: dict[str, float] = field(default_factory=dict)
    bound: float | None = None

    @property
    def survived(self) -> bool:
        """A leader came back for every role the fault left without one."""
        return all(math.isfinite(v) for v in self.leaderless.values())

    @property
    def over_bound(self) -> int:
        """Roles whose leaderless time exceeded the bound."""
        if self.bound is None:
            return 0
        return sum(1 for v in self.leaderless.values() if v > self.bound)


@dataclass
class Report:
    """The checker's findings."""

    faults: list[FaultOutcome]
    violations: list[Violation]
    overlap_seconds: float
    writes: Counter[str]
    ticks: dict[str, int]
    tasks: dict[str, int]
    duration: float

    @property
    def ok(self) -> bool:
        """No violation."""
        return not self.violations

    def by_kind(self) -> dict[str, list[FaultOutcome]]:
        """Faults grouped by kind, in kind order."""
        groups: dict[str, list[FaultOutcome]] = defaultdict(list)
        for fault in self.faults:
            groups[fault.kind].append(fault)
        return dict(sorted(groups.items()))

    def table(self) -> str:
        """A markdown table: faults by kind, survived, violations, leaderless time."""
        lines = [
            "| fault | injected | survived | hit a leader | leaderless p50 | p99 | max "
            "| bound | over bound |",
            "|---|---:|---:|---:|---:|---:|---:|---|---:|",
        ]
        for kind, faults in self.by_kind().items():
            gaps = sorted(g for f in faults for g in f.leaderless.values())
            bound = faults[0].bound
            lines.append(
                f"| {kind} | {len(faults)} | {sum(f.survived for f in faults)} | "
                f"{sum(bool(f.leaderless) for f in faults)} | {_ms(_pct(gaps, 50))} | "
                f"{_ms(_pct(gaps, 99))} | {_ms(gaps[-1] if gaps else None)} | "
                f"{'-' if bound is None else _ms(bound)} | "
                f"{'-' if bound is None else sum(f.over_bound for f in faults)} |"
            )
        total = len(self.faults)
        lines.append(
            f"| **all** | {total} | {sum(f.survived for f in self.faults)} | "
            f"{sum(bool(f.leaderless) for f in self.faults)} | | | | | "
            f"{sum(f.over_bound for f in self.faults)} |"
        )
        counts = Counter(v.kind for v in self.violations)
        summary = [
            "",
            f"run: {self.duration:.0f} s; violations: {len(self.violations)}"
            + (f" ({', '.join(f'{k}: {n}' for k, n in sorted(counts.items()))})" if counts else ""),
            "overlap (two live, unpaused leaders of one role): "
            f"{self.overlap_seconds * 1000:.1f} ms",
            "fenced writes: "
            + ", ".join(f"{k}: {n}" for k, n in sorted(self.writes.items()))
            + " (rejected = a stale leader stopped by the fence)",
        ]
        if self.ticks:
            summary.append("beat ticks: " + ", ".join(f"{k}: {n}" for k, n in self.ticks.items()))
        if self.tasks:
            summary.append(
                "leader-only tasks: " + ", ".join(f"{k}: {n}" for k, n in self.tasks.items())
            )
        summary.extend(
            f"VIOLATION {v.kind} at {v.at:.3f}: {v.detail}" for v in self.violations[:50]
        )
        return "\n".join(lines + summary)


def _pct(values: Sequence[float], p: float) -> float | None:
    if not values:
        return None
    rank = max(0, math.ceil(p / 100 * len(values)) - 1)
    return values[rank]


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    if not math.isfinite(value):
        return "never"
    return f"{value * 1000:.0f} ms"


def load_events(directory: str | Path) -> list[Event]:
    """Read every ``*.jsonl`` file of ``directory`` into one list ordered by time.

    A line cut short by a kill (the last line of a file) is skipped.
    """
    events: list[Event] = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                raw = json.loads(line)
            except ValueError:
                continue
            if not isinstance(raw, dict) or "t" not in raw or "kind" not in raw:
                continue
            events.append(
                Event(float(raw["t"]), str(raw.get("proc", path.stem)), str(raw["kind"]), raw)
            )
    events.sort(key=lambda e: e.t)
    return events


# ------------------------------------------------------------------ intervals


def _subtract(
    spans: list[tuple[float, float]], holes: list[tuple[float, float]]
) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in spans:
        pieces = [(start, end)]
        for h0, h1 in holes:
            nxt = []
            for a, b in pieces:
                if h1 <= a or h0 >= b:
                    nxt.append((a, b))
                    continue
                if a < h0:
                    nxt.append((a, h0))
                if h1 < b:
                    nxt.append((h1, b))
            pieces = nxt
        out.extend(pieces)
    return out


def _union(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _pauses(events: Sequence[Event], end: float) -> dict[str, list[tuple[float, float]]]:
    pauses: dict[str, list[tuple[float, float]]] = defaultdict(list)
    open_at: dict[str, float] = {}
    for e in events:
        if e.kind == "paused":
            open_at[e.proc] = e.t
        elif e.kind in ("resumed", "killed", "exited") and e.proc in open_at:
            pauses[e.proc].append((open_at.pop(e.proc), e.t))
    for proc, t in open_at.items():
        pauses[proc].append((t, end))
    return pauses


def _beliefs(
    events: Sequence[Event], end: float, pauses: Mapping[str, list[tuple[float, float]]]
) -> dict[str, list[tuple[str, float, float]]]:
    """Per role: (proc, start, end) while proc believed it led and was live."""
    beliefs: dict[str, list[tuple[str, float, float]]] = defaultdict(list)
    # (proc, role) -> (start, lease, latest possible lease deadline)
    leading: dict[tuple[str, str], tuple[float, float, float]] = {}

    def close(proc: str, role: str, t: float) -> None:
        start, lease, until = leading.pop((proc, role))
        stop = min(t, until)
        # Resumed after a pause longer than the lease: no lease at the resume.
        for p0, p1 in pauses.get(proc, ()):
            if start <= p0 < stop and p1 - p0 > lease and p1 < stop:
                stop = p1
                break
        for piece in _subtract([(start, stop)], pauses.get(proc, [])):
            if piece[1] > piece[0]:
                beliefs[role].append((proc, *piece))

    for e in events:
        if e.kind == "promote":
            role = str(e.get("role"))
            if (e.proc, role) in leading:
                close(e.proc, role, e.t)
            lease = float(e.get("lease", math.inf))
            # Until its first renewal the deadline is unknown here (logs that
            # record no renewals keep beliefs until the demote line).
            leading[(e.proc, role)] = (e.t, lease, math.inf)
        elif e.kind == "renewed":
            key = (e.proc, str(e.get("role")))
            if key in leading:
                start, lease, until = leading[key]
                renewed = float(e.get("until", math.inf))
                leading[key] = (start, lease, renewed if until == math.inf else max(until, renewed))
        elif e.kind == "demote":
            role = str(e.get("role"))
            if (e.proc, role) in leading:
                close(e.proc, role, e.t)
        elif e.kind in ("killed", "exited"):
            for proc, role in [k for k in leading if k[0] == e.proc]:
                close(proc, role, e.t)
    for proc, role in list(leading):
        close(proc, role, end)
    return beliefs


# ---------------------------------------------------------------------- check


def check(
    events: Sequence[Event],
    *,
    ttl: float,
    loss_window_ticks: int = 0,
    drain_until: float | None = None,
    broker_pop_window: bool = False,
) -> Report:
    """Judge a run from its events.

    Args:
        events: Every line of the run, ordered by ``t`` (see :func:`load_events`).
        ttl: The election TTL, seconds (bounds of the leaderless time).
        loss_window_ticks: Ticks each beat failover may lose (the documented
            window; 0 when the tick outbox closes it).
        drain_until: Tasks sent after this time are not required to have run.
        broker_pop_window: The task broker hands a message over before it
            records it as unacknowledged (kombu's Redis transport): a worker
            killed in between loses that one message. A lost task that no
            worker ever received and that was not ``left`` in the broker is
            then counted apart, at most one per kill of a worker reading the
            leader queue (see :func:`_leader_queue_kills`) after the task was
            sent; any other loss is still a violation.

    Returns:
        The report.

    """
    events = sorted(events, key=lambda e: e.t)
    if not events:
        return Report([], [], 0.0, Counter(), {}, {}, 0.0)
    start, end = events[0].t, events[-1].t
    violations: list[Violation] = []
    pauses = _pauses(events, end)
    beliefs = _beliefs(events, end, pauses)

    # Overlap: two processes' beliefs in one role at one instant.
    overlap = 0.0
    for role, spans in beliefs.items():
        ordered = sorted(spans, key=lambda s: s[1])
        for i, (proc_a, _, a1) in enumerate(ordered):
            for proc_b, b0, b1 in ordered[i + 1 :]:
                if b0 >= a1:
                    break
                if proc_a == proc_b:
                    continue
                both = min(a1, b1) - b0
                overlap += both
                violations.append(
                    Violation(
                        "overlap",
                        b0,
                        f"{proc_a} and {proc_b} both led {role!r} for {both * 1000:.1f} ms",
                    )
                )

    # Fencing: in each resource's order, an accepted epoch never goes down.
    writes: Counter[str] = Counter()
    highest: dict[tuple[str, str], tuple[int, str]] = {}
    for e in events:
        if e.kind == "fence_reset":
            # The operator recreated the bucket (epochs restart at 1) and
            # cleared the fences with it, as documented.
            highest.clear()
            continue
        if e.kind != "write":
            continue
        accepted = bool(e.get("accepted"))
        writes["accepted" if accepted else "rejected"] += 1
        if not accepted:
            continue
        key = (str(e.get("resource")), str(e.get("role")))
        epoch = int(e.get("epoch"))
        seen = highest.get(key)
        if seen is not None and epoch < seen[0]:
            violations.append(
                Violation(
                    "stale write",
                    e.t,
                    f"{key[0]} accepted epoch {epoch} from {e.proc} for {key[1]!r} after "
                    f"epoch {seen[0]} from {seen[1]}",
                )
            )
        else:
            highest[key] = (epoch, e.proc)

    ticks = _check_ticks(events, loss_window_ticks, violations)
    tasks = _check_tasks(events, drain_until, broker_pop_window, violations)
    faults = _fault_outcomes(events, beliefs, pauses, ttl, end)
    # Timing bounds are goals, reported in the table; a role that never got
    # a leader back is a failure.
    for fault in faults:
        for role, gap in fault.leaderless.items():
            if not math.isfinite(gap):
                violations.append(
                    Violation(
                        "no leader",
                        fault.at,
                        f"after {fault.kind} of {fault.target}, {role!r} never had a leader again",
                    )
                )
    violations.sort(key=lambda v: v.at)
    return Report(faults, violations, overlap, writes, ticks, tasks, end - start)


def _check_ticks(
    events: Sequence[Event], window: int, violations: list[Violation]
) -> dict[str, int]:
    dispatched: dict[str, float] = {}
    runs: Counter[str] = Counter()
    first_run: dict[str, float] = {}
    for e in events:
        tick = e.get("tick")
        if tick is None:
            continue
        if e.kind == "tick":
            dispatched.setdefault(str(tick), e.t)
        elif e.kind == "run":
            runs[str(tick)] += 1
            first_run.setdefault(str(tick), e.t)
    if not dispatched and not runs:
        return {}
    for tick, n in sorted(runs.items()):
        if n > 1:
            violations.append(
                Violation("tick twice", first_run[tick], f"tick {tick} ran {n} times")
            )
    # Ticks are named "<entry>@<scheduled second>": a second with no tick at
    # all between the first and the last is a lost tick.
    lost: list[str] = []
    by_entry: dict[str, dict[int, float]] = defaultdict(dict)
    for tick in set(dispatched) | set(runs):
        entry, _, second = tick.rpartition("@")
        if second.lstrip("-").isdigit():
            seen = [t for t in (dispatched.get(tick), first_run.get(tick)) if t is not None]
            by_entry[entry][int(second)] = min(seen)
    # Where a loss shows: a missing second when the next tick of its entry
    # was seen; a tick that never ran when it was dispatched.
    noticed: list[float] = []
    for entry, seconds in by_entry.items():
        for s in range(min(seconds), max(seconds)):
            if s not in seconds:
                lost.append(f"{entry}@{s}")
                noticed.append(min(t for n, t in seconds.items() if n > s))
    never_ran = [t for t in dispatched if t not in runs]
    noticed += [dispatched[t] for t in never_ran]
    lost_total = len(lost) + len(never_ran)
    if lost_total > window:
        violations.append(
            Violation(
                "tick lost",
                min(noticed),
                f"{lost_total} tick(s) never ran (allowed: {window}): "
                f"{', '.join(sorted(lost + never_ran)[:10])}",
            )
        )
    found = {"dispatched": len(dispatched)} if dispatched else {}
    return {
        **found,
        "ran": sum(1 for t in runs if runs[t] >= 1),
        "twice": sum(1 for n in runs.values() if n > 1),
        "lost": lost_total,
    }


def _check_tasks(
    events: Sequence[Event],
    drain_until: float | None,
    broker_pop_window: bool,
    violations: list[Violation],
) -> dict[str, int]:
    sent: dict[str, float] = {}
    runs: Counter[str] = Counter()
    received: set[str] = set()
    left: set[str] = set()
    consumers: set[str] = set()
    for e in events:
        task = e.get("task")
        if task is None:
            continue
        if e.kind == "sent":
            sent[str(task)] = e.t
        elif e.kind == "run" and e.get("tick") is None:
            runs[str(task)] += 1
        elif e.kind == "received":
            received.add(str(task))
            consumers.add(str(e.get("worker")))
        elif e.kind == "left":
            left.add(str(task))
    if not sent:
        return {}
    due = {t: at for t, at in sent.items() if drain_until is None or at <= drain_until}
    lost = sorted((t for t in due if runs[t] == 0), key=lambda t: due[t])
    popped: list[str] = []
    if broker_pop_window:
        # A killed worker's pending read may have taken one message off the
        # queue that it never recorded: that message was sent before the
        # kill, never reached any worker and is not left in the broker. Each
        # kill explains one loss, if the worker was reading the leader queue.
        kills = _leader_queue_kills(events, consumers)
        unexplained = []
        for task in lost:
            kill = next((k for k in kills if k >= due[task]), None)
            if task in received or task in left or kill is None:
                unexplained.append(task)
                continue
            kills.remove(kill)
            popped.append(task)
        lost = unexplained
    if lost:
        still = sorted(left.intersection(lost))
        violations.append(
            Violation(
                "task lost",
                min(due[t] for t in lost),
                f"{len(lost)} leader-only task(s) never ran: {', '.join(lost[:10])}"
                + (f" (still in the broker: {', '.join(still[:10])})" if still else ""),
            )
        )
    found = {
        "sent": len(sent),
        "ran": sum(1 for t in sent if runs[t]),
        "twice": sum(1 for t in sent if runs[t] > 1),
        "lost": len(lost),
    }
    if broker_pop_window:
        found["lost in the broker's pop window"] = len(popped)
    return found


#: Seconds a worker's pending read may still include the leader queue after
#: its demotion: kombu's read ends within ``polling_interval`` (1 s by
#: default); doubled for a busy machine.
LEADER_READ_AFTER_DEMOTE = 2.0


def _leader_queue_kills(events: Sequence[Event], consumers: set[str]) -> list[float]:
    """When a worker reading the leader queue was killed, before the run's ``done``.

    A worker reads the leader queue while it leads, and for one pending read
    after its demotion. Kills after ``done`` (a worker stuck in its shutdown)
    explain nothing.
    """
    done = next((e.t for e in events if e.kind == "done"), math.inf)
    last: dict[str, tuple[str, float]] = {}  # worker -> (promote|demote, t)
    kills = []
    for e in events:
        if e.proc not in consumers:
            continue
        if e.kind in ("promote", "demote"):
            last[e.proc] = (e.kind, e.t)
        elif e.kind == "killed" and e.t <= done and e.proc in last:
            kind, at = last[e.proc]
            if kind == "promote" or e.t - at <= LEADER_READ_AFTER_DEMOTE:
                kills.append(e.t)
    return kills


def _fault_outcomes(
    events: Sequence[Event],
    beliefs: Mapping[str, list[tuple[str, float, float]]],
    pauses: Mapping[str, list[tuple[float, float]]],
    ttl: float,
    end: float,
) -> list[FaultOutcome]:
    covered = {role: _union((s[1], s[2]) for s in spans) for role, spans in beliefs.items()}
    outcomes = []
    for e in events:
        if e.kind != "fault":
            continue
        kind = str(e.get("fault"))
        target = str(e.get("target"))
        bound = (
            ttl + CRASH_SLACK
            if kind in CRASH_FAULTS
            else GRACEFUL_BOUND
            if kind in GRACEFUL_FAULTS
            else None
        )
        leaderless: dict[str, float] = {}
        roles = e.get("roles")
        for role, spans in beliefs.items():
            if roles is not None and role not in roles:
                continue
            # Did the fault hit this role's leader? Process faults: the target
            # led the role when hit. Other faults: the role lost its leader
            # within one TTL (the longest a live leader can outlast a fault).
            if kind in CRASH_FAULTS | GRACEFUL_FAULTS and not any(
                p == target and s0 <= e.t < s1 + 0.001 for p, s0, s1 in spans
            ):
                continue
            gap = _first_gap(covered.get(role, []), e.t, e.t + ttl + 2 * CRASH_SLACK, end)
            if gap is None:
                continue
            gap_start, gap_end = gap
            # Crash bounds run from the fault; other gaps from their start.
            origin = e.t if kind in CRASH_FAULTS else gap_start
            leaderless[role] = gap_end - origin if math.isfinite(gap_end) else math.inf
        outcomes.append(FaultOutcome(kind, e.t, target, leaderless, bound))
    return outcomes


def _first_gap(
    covered: Sequence[tuple[float, float]], after: float, within: float, end: float
) -> tuple[float, float] | None:
    """The first uncovered span starting in ``[after, within]``, or ``None``."""
    cursor = after
    for c0, c1 in covered:
        if c1 <= cursor:
            continue
        if c0 > cursor:
            break  # uncovered from cursor
        cursor = c1
    if cursor > within or cursor >= end:
        return None
    nxt = next((c0 for c0, _ in covered if c0 > cursor), None)
    return (cursor, nxt if nxt is not None else math.inf)
