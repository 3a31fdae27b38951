"""The election state machines: no Celery, no Django, no nats-py.

* :mod:`.vocabulary`: the words every part shares: states, demote reasons,
  callback types, subject names, and :class:`~.vocabulary.ServiceHost` (what
  leader services need of an election).
* :mod:`.interface`: :class:`LeaderElection`, the Protocol every strategy
  implements, and :func:`new_election`, which builds the configured one.
* :mod:`.base`: :class:`~.base.BaseElection`, the plumbing both strategies
  share (callbacks, start/teardown, control requests).
* :mod:`.kv`: :class:`KvElection`, the JetStream KV strategy (the default;
  ``Election`` remains its alias),
  with :mod:`.follower_view` (what a follower saw, and when to act) and
  :mod:`.roster` (the candidates it knows, and its place in line).
* :mod:`.allcall` and :mod:`.allcall_protocol`: the ALLCALL strategy and its
  wire format (plain publish/subscribe, no JetStream).
* :mod:`.health`, :mod:`.callbacks`, :mod:`.observer`: health-check demotion,
  running user callbacks, and the metrics hooks.
* :mod:`.leader_services`: leader services, code that runs only while leading.
* :mod:`.trail`: the event trail, each transition published in order.

The state machines talk to NATS only through a
:class:`~celery_nats_leader.core.backend.Backend`.
"""

from __future__ import annotations

from celery_nats_leader.election.interface import LeaderElection, new_election
from celery_nats_leader.election.kv import Election, KvElection
from celery_nats_leader.election.vocabulary import (
    DemoteCallback,
    DemoteReason,
    ElectionState,
    ErrorCallback,
    LeaderChangeCallback,
    PromoteCallback,
    control_subject,
)

__all__ = [
    "DemoteCallback",
    "DemoteReason",
    "Election",
    "ElectionState",
    "ErrorCallback",
    "KvElection",
    "LeaderChangeCallback",
    "LeaderElection",
    "PromoteCallback",
    "control_subject",
    "new_election",
]
