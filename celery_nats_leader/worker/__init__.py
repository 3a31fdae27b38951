"""The Celery worker wiring.

* :mod:`.bootstep`: ``install(app)`` and the bootstep that builds, starts and
  stops the :class:`~.election.WorkerElection`.
* :mod:`.election`: one elector per worker process tree, leader queues,
  signals and metrics.
* :mod:`.shared_leadership`: leadership as prefork children see it (shared memory, plus
  a :class:`~celery_nats_leader.term.TermReader` for ``validate=True``).
* :mod:`.tasks`: ``@leader_only``, the leader task class and its routing.
* :mod:`.leader_services`: ``@leader_service`` and ``nats_leader_services``.
* :mod:`.broker_wake`: wakes a Redis consumer when a leader queue is added.
* :mod:`.signals`: ``leader_promoted`` / ``leader_demoted``.

This package imports nothing on import: :mod:`.shared_leadership` is usable without Celery.
"""
