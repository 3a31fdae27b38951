"""The singleton periodic job: dispatched once per tick by the leader scheduler,
run by the leader of the ``default`` role, recorded under the database fence.

* ``celery_nats_leader.beat.LeaderScheduler`` (embedded beat on every replica)
  dispatches each tick once, from the leader of the ``beat`` role, and stamps
  the tick's identity (its *slot*) and the dispatching term on the message.
* ``@leader_only`` routes the task to the leader queue of ``default``, which
  only that role's current leader consumes, and hands it the term's token.
* ``fenced("default", token)`` makes the database refuse the row if a newer
  term of ``default`` has already written: a paused ex-leader cannot record.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from celery import shared_task

from celery_nats_leader import FencingToken, leader_only
from celery_nats_leader.beat import ENTRY_HEADER, EPOCH_HEADER, RUN_HEADER, TICK_HEADER
from django_nats_leader.fencing import fenced

logger = logging.getLogger(__name__)

#: The role whose leader runs the job (its first worker role).
ROLE = "default"


def _header(request: Any, name: str) -> Any:
    # Celery exposes custom message headers as request attributes and, for
    # some transports, in request.headers too.
    value = getattr(request, name, None)
    headers = getattr(request, "headers", None)
    if value is None and isinstance(headers, Mapping):
        value = headers.get(name)
    return value


@shared_task(bind=True, name="ticks.tasks.tick")
@leader_only(role=ROLE)
def tick(self: Any, leader_token: FencingToken | None = None) -> int:
    """Record this run of the periodic job in the ledger (fenced); return the row id."""
    from ticks.models import Tick

    request = self.request
    slot_text = _header(request, TICK_HEADER)
    dispatch = _header(request, EPOCH_HEADER)
    run = _header(request, RUN_HEADER)
    with fenced(ROLE, leader_token, holder=str(request.hostname)):
        row = Tick.objects.create(
            entry=str(_header(request, ENTRY_HEADER) or self.name),
            slot=datetime.fromisoformat(slot_text) if slot_text else None,
            run=int(run) if run is not None else None,
            dispatch_epoch=int(dispatch) if dispatch is not None else None,
            leader_epoch=leader_token.epoch if leader_token else 0,
            worker=str(request.hostname),
            pid=os.getpid(),
        )
    logger.info("tick %s run %s recorded by %s", slot_text, run, request.hostname)
    return row.id
