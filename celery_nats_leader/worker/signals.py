"""Celery signals sent when a worker gains or loses the leadership of a role.

They follow Celery's own signals (:mod:`celery.signals`): connect a receiver
with ``@leader_promoted.connect`` and filter by role with ``sender=``::

    from celery_nats_leader import leader_promoted

    @leader_promoted.connect(sender="reports")
    def warm_cache(sender, token, **kwargs):
        ...

Both are sent in the worker's main process, on a thread of the elector that
runs callbacks (never on the thread that renews the lease), one at a time and
in the order the transitions happened. A receiver that raises is logged by
Celery and does not stop the others. Keep receivers short: the next
transition's signal waits for them.
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

__all__ = ["leader_demoted", "leader_promoted"]

#: Sent when this worker becomes the leader of a role.
#:
#: Arguments: ``sender`` (the role, a ``str``), ``token``
#: (:class:`~celery_nats_leader.term.token.FencingToken` of the new term) and
#: ``instance_id`` (this worker's election id).
leader_promoted = Signal(name="leader_promoted", providing_args={"token", "instance_id"})

#: Sent when this worker stops leading a role.
#:
#: Arguments: ``sender`` (the role), ``reason``
#: (:class:`~celery_nats_leader.election.DemoteReason`, a ``str`` enum such as
#: ``"stopped"`` or ``"lease_expired"``) and ``instance_id``. On a graceful
#: stop it is sent *before* the key is released, so when it runs no successor
#: has been elected yet.
leader_demoted = Signal(name="leader_demoted", providing_args={"reason", "instance_id"})
