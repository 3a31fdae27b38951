"""Every default, limit and naming convention of the package, in one place.

Other modules import from here instead of repeating literals, so that a
change of default (or of a subject layout that other processes depend on)
happens in exactly one spot.
"""

from __future__ import annotations

import re

#: Name of the KV bucket that holds one key per role.
DEFAULT_BUCKET = "leaders"

#: Role elected when none is given.
DEFAULT_ROLE = "default"

#: Election TTL in seconds: the bucket's ``max_age`` and the longest a crashed
#: leader can keep a role.
DEFAULT_TTL_SECONDS = 10.0

#: The heartbeat is ``ttl / HEARTBEATS_PER_TTL`` unless configured.
HEARTBEATS_PER_TTL = 4

#: The shortest disconnect grace, in heartbeats (also its default): a leader
#: rides out a reconnect that costs it one renewal.
MIN_DISCONNECT_GRACE_HEARTBEATS = 2

#: ``ttl`` must be at least this many heartbeats, so that one or two lost
#: renewals do not cost the role.
MIN_HEARTBEATS_PER_TTL = 3

#: Shortest TTL accepted, in seconds. Below this, scheduling noise of a busy
#: Python process is a large part of the lease.
MIN_TTL_SECONDS = 0.5

#: Longest TTL accepted, in seconds (a day): longer terms make a crash
#: unrecoverable for too long to be a sane choice.
MAX_TTL_SECONDS = 86_400.0

#: Seconds added to ``2 x ttl`` to make the default beat catch-up window:
#: room for a successor's campaign, its loading of the schedule's state, a
#: busy host and clock skew between replicas (see ``LeaderSettings.catch_up_window``).
BEAT_CATCH_UP_EXTRA_SECONDS = 5.0

#: Lease safety margin as a fraction of the TTL when not configured. The
#: leader steps down at ``last_confirmed_send + ttl - margin``; the margin
#: absorbs event-loop lag and server expiry granularity.
LEASE_MARGIN_FRACTION = 0.1

#: Largest random delay, in seconds, before a follower campaigns after the
#: key was released or expired. Spreads a herd of candidates over a few
#: milliseconds without making handoffs slow.
DEFAULT_CAMPAIGN_JITTER_SECONDS = 0.005

#: Extra campaign delay, in seconds, per priority point below the highest
#: priority a candidate knows of. Preferred candidates campaign first.
DEFAULT_PRIORITY_STEP_SECONDS = 0.01

#: Longest priority-based campaign delay, in seconds, whatever the gap.
MAX_PRIORITY_LAG_SECONDS = 0.5

#: Delay, in seconds, per candidate of the same priority ahead in line (by
#: id) before a follower campaigns for a free role. The first in line goes at
#: once; the others follow a step apart (plus the jitter), in case it is gone.
SUCCESSOR_STEP_SECONDS = 0.002

#: A roster entry not refreshed for this many heartbeats is dropped: the
#: first followers in line announce themselves every heartbeat, crashed
#: candidates stop doing so.
ROSTER_EXPIRY_HEARTBEATS = 3

#: How many followers at the front of the line announce themselves every
#: heartbeat (the others stay silent: N announcing to N is N² messages).
ANNOUNCED_SUCCESSORS = 3

#: Seconds beyond the TTL after which a follower deletes a record it saw
#: unchanged (conditionally at that revision) instead of waiting for the
#: server's ``max_age`` timer, which fires up to ~250 ms late on 2.10+.
#: The leader already stepped down ``lease_margin`` before the TTL; this only
#: keeps the follower no earlier than the server could be (docs/design.md).
FOLLOWER_EXPIRY_MARGIN_SECONDS = 0.01

#: During a TTL change, how often a replica on the new bucket reads the old
#: bucket's key while a term of the role is held there (at most; the
#: heartbeat interval if shorter): a released old term is followed within it.
MOVE_POLL_SECONDS = 0.25

#: During a TTL change, how often a replica that cannot read the old bucket
#: says so again at WARNING (it says it at once, and waits meanwhile).
MOVE_WARNING_REPEAT_SECONDS = 30.0

#: Consecutive health-check failures that make a leader resign.
DEFAULT_HEALTH_CHECK_FAILURES = 3

#: Seconds a stop or a release waits for the demote callbacks (``demote_timeout``).
#: Below the elector's 10-s stop bound, so that a stop still ends in order (callbacks
#: that outlived it are not waited for again when the election is torn down).
DEFAULT_DEMOTE_TIMEOUT_SECONDS = 5.0

#: Exponential backoff for transient errors.
BACKOFF_INITIAL_SECONDS = 0.05
BACKOFF_MAX_SECONDS = 5.0
BACKOFF_MULTIPLIER = 2.0
BACKOFF_JITTER = 0.1

#: Consecutive transient failures that open the circuit breaker, and how long
#: an open circuit waits (as a multiple of the TTL, capped; never less than
#: BACKOFF_MAX_SECONDS) before trying again.
CIRCUIT_BREAKER_THRESHOLD = 10
CIRCUIT_BREAKER_COOLDOWN_TTLS = 1.0
CIRCUIT_BREAKER_MAX_COOLDOWN_SECONDS = 30.0

#: Subject prefix for the request/reply side channel (roster and resign
#: requests). Layout: ``{prefix}.{bucket}.{role}.{verb}``.
CONTROL_SUBJECT_PREFIX = "_NATS_LEADER"
ROSTER_VERB = "roster"

#: Transition events: ``{prefix}.{bucket}.{role}`` (the role last: it may
#: contain dots), kept by the optional stream ``{stream prefix}{bucket}``.
EVENTS_SUBJECT_PREFIX = "_NATS_LEADER_EVENTS"
EVENTS_STREAM_PREFIX = "NATS_LEADER_EVENTS_"

#: Events an election keeps while it cannot publish them (disconnected).
EVENT_BUFFER = 64
RESIGN_VERB = "resign"

#: Fast failover (``fast_failover``): the leader asks its designated successor
#: for a promise on ``{prefix}.{bucket}.{role}.promise.{candidate digest}``.
PROMISE_VERB = "promise"

#: How often a leader asks its designated successor for a promise, seconds.
PROMISE_INTERVAL_SECONDS = 0.15

#: What one promise is worth: the successor takes no fast takeover before the
#: promise's receipt plus this (its own clock). Failover after a crash takes
#: between ``PROMISE_GRACE_SECONDS - PROMISE_INTERVAL_SECONDS`` and this, plus a write.
PROMISE_GRACE_SECONDS = 0.9

#: How much sooner than a promise runs out the leader stops counting on it,
#: on top of the clock-rate allowance: the time between a check of
#: ``is_leader`` and the work it allows (the lease margin's role, for the lease).
PROMISE_MARGIN_SECONDS = 0.2

#: The largest difference of clock *rates* between two hosts the fast path
#: assumes (1 %: NTP-disciplined clocks differ by about 0.005 %). The leader
#: counts a promise of ``G`` seconds as ``G x (1 - 2 x CLOCK_RATE_BOUND)`` and
#: checks every successor's replies against the bound (docs/design.md).
CLOCK_RATE_BOUND = 0.01

#: A leader whose promises would run out within this many seconds names no
#: successor (one renewal with ``successor`` unset): it goes on under its KV
#: lease, and the role fails over by the TTL until a successor answers again.
PROMISE_REVOKE_LEAD_SECONDS = 0.25

#: Seconds a leader waits before asking a candidate for a promise again after
#: it did not answer (or after the successor was dropped).
PROMISE_RETRY_SECONDS = 1.0

#: Seconds a candidate whose answers broke the clock-rate bound is not
#: designated successor again (the leader logs it at ERROR).
RATE_REFUSAL_SECONDS = 60.0

#: How long a roster request collects answers from live candidates, seconds.
DEFAULT_ROSTER_WINDOW_SECONDS = 0.25

#: NATS KV key names: what nats-py and the server accept.
KEY_PATTERN = re.compile(r"^[-/_=.a-zA-Z0-9]+$")

#: NATS KV bucket names.
BUCKET_PATTERN = re.compile(r"^[a-zA-Z0-9_-]+$")

#: Default NATS server URL.
DEFAULT_SERVERS = ("nats://127.0.0.1:4222",)

#: The ``id`` of a fence marker (an operator ended a term; nobody leads).
FENCE_ID = "fenced"

#: Version of the JSON record layout, written into every record.
RECORD_VERSION = 1

#: ALLCALL: seconds between allcalls when ``heartbeat_interval`` is not
#: configured (the seed's heartBeat), capped at ``ttl / 4`` for short leases.
ALLCALL_DEFAULT_HEARTBEAT_SECONDS = 1.0

#: ALLCALL: the seed's maxClockSkew, the largest difference, in seconds,
#: between the wall clocks of any two hosts that ALLCALL tolerates.
ALLCALL_DEFAULT_MAX_CLOCK_SKEW_SECONDS = 1.0

#: ALLCALL: ``max_clock_skew`` may be at most this fraction of the lease.
ALLCALL_MAX_CLOCK_SKEW_FRACTION_OF_TTL = 0.5

#: Prefix of every Prometheus metric name (``nats_leader_metrics_namespace`` changes it).
DEFAULT_METRICS_NAMESPACE = "nats_leader"

# The message headers of beat's ticks: a contract between the leader scheduler
# (beat/) that sets them and the workers (worker/) that read them.

#: Message header: the epoch of the term that dispatched the task (an integer).
EPOCH_HEADER = "nats_leader_epoch"
#: Message header of messages sent by older versions: the whole fencing token
#: (``"<epoch>:<value>"``). No longer sent; still read (its epoch only).
TOKEN_HEADER = "nats_leader_token"
#: Message header: ``True`` when workers with the bootstep run this tick once
#: (the once-guard keyed by its per-tick task id); ``False`` for entries and
#: schedulers that opted out.
ONCE_HEADER = "nats_leader_once"
#: Message header: the beat role whose leader dispatched the task.
ROLE_HEADER = "nats_leader_role"
#: Message header: the periodic entry's name.
ENTRY_HEADER = "nats_leader_entry"
#: Message header: the tick's slot (ISO 8601, UTC), its identity.
TICK_HEADER = "nats_leader_tick"
#: Message header: the entry's run number of this tick (1 for the first run).
RUN_HEADER = "nats_leader_run"
#: Message header: the instance id of the scheduler that dispatched it.
DISPATCHER_HEADER = "nats_leader_dispatcher"
