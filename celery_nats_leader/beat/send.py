"""The send of one committed tick: its message options, headers and Celery's ``apply_async``.

The dispatcher (:mod:`.dispatcher`) decides when a tick is sent and what
happens when the send fails (:func:`is_permanent_send_error` tells it
which failures every retry would repeat); this module builds the message:
the tick's task id, the headers the workers' once-guard and fence read
(:mod:`.dispatch_fence`), and a copy of the entry carrying them.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from typing import Any

from celery import beat as celery_beat
from kombu.exceptions import OperationalError, SerializationError

from celery_nats_leader.beat.schedule_store import EntryState
from celery_nats_leader.beat.ticks import slot_text, tick_task_id
from celery_nats_leader.core.constants import (
    DISPATCHER_HEADER,
    ENTRY_HEADER,
    EPOCH_HEADER,
    ONCE_HEADER,
    ROLE_HEADER,
    RUN_HEADER,
    TICK_HEADER,
)
from celery_nats_leader.term.token import FencingToken

__all__ = ["is_permanent_send_error", "opts_out", "send_tick", "tick_options"]

logger = logging.getLogger(__name__)


def opts_out(value: Any) -> bool:
    """Whether an entry's ``nats_leader_once`` option or header turns the once-guard off."""
    return value is not None and str(value).strip().lower() in {"false", "0", "no", "off"}


def tick_options(
    entry: Any,
    committed: EntryState,
    token: FencingToken,
    *,
    state_bucket: str,
    role: str,
    dispatcher_id: str,
    once: bool,
) -> dict[str, Any]:
    """The ``apply_async`` options of one committed tick of ``entry``.

    Args:
        entry: The schedule entry (its own options are copied, not changed).
        committed: The tick's committed state.
        token: The term that committed it.
        state_bucket: The beat state bucket (part of the tick's task id).
        role: The beat role.
        dispatcher_id: This scheduler's election id.
        once: Whether ticks run once on the workers unless the entry opts out
            (``nats_leader_beat_once``).

    Returns:
        The entry's options with the tick's task id (unless the entry fixes
        one) and headers.

    """
    slot = slot_text(committed.slot)
    options = dict(entry.options or {})
    own_headers = dict(options.get("headers") or {})
    task_id = tick_task_id(state_bucket, role, committed.entry, slot)
    # Run once on the workers unless opted out (the settings, the entry's
    # options or, for database rows, the entry's headers), and only under
    # our per-tick id: an id the entry fixes is the same for every tick.
    opted_out = opts_out(options.pop(ONCE_HEADER, None)) or opts_out(own_headers.get(ONCE_HEADER))
    options.setdefault("task_id", task_id)
    # The epoch, not the token: the token is the term's secret, and
    # headers end up in logs and brokers. The worker-side check needs the
    # epoch only; the dispatcher's instance id says who sent it.
    options["headers"] = {
        **own_headers,
        EPOCH_HEADER: token.epoch,
        ROLE_HEADER: role,
        ENTRY_HEADER: committed.entry,
        TICK_HEADER: slot,
        RUN_HEADER: committed.runs,
        DISPATCHER_HEADER: dispatcher_id,
        ONCE_HEADER: once and not opted_out and options["task_id"] == task_id,
    }
    return options


def send_tick(
    apply_async: Callable[..., Any],
    entry: Any,
    committed: EntryState,
    token: FencingToken,
    *,
    producer: Any,
    options: dict[str, Any],
) -> None:
    """Publish one committed tick through Celery's ``apply_async`` hook.

    Raises:
        Exception: What ``apply_async`` raised, logged as Celery logs it.

    """
    # Send a shallow clone carrying this tick's options: the entry itself
    # may be persisted (shelve, database) and must not keep them. No
    # __reduce__ (ModelEntry cannot be rebuilt that way): copy the fields.
    outgoing = object.__new__(type(entry))
    outgoing.__dict__.update(entry.__dict__)
    outgoing.options = options
    try:
        result = apply_async(outgoing, producer=producer, advance=False)
    except Exception as exc:
        # As Celery's apply_entry(), on the celery.beat logger (where
        # users alert on beat's errors); the dispatcher then decides
        # whether the tick is sent again or dropped, and says so.
        celery_beat.error("Message Error: %s\n%s", exc, traceback.format_stack(), exc_info=True)
        raise
    logger.info(
        "Scheduler: Sending due task %s (%s) tick %s run %d epoch %d id %s",
        committed.entry,
        entry.task,
        slot_text(committed.slot),
        committed.runs,
        token.epoch,
        getattr(result, "id", options["task_id"]),
    )


def is_permanent_send_error(exc: BaseException) -> bool:
    """Whether a send failed in a way that every retry would repeat.

    Celery wraps the cause in ``SchedulingError``; a message that cannot be
    serialized (kombu's ``EncodeError``, a ``TypeError`` or ``ValueError``
    from the encoder) fails the same way every time, while a broker or
    network error (``OSError``, kombu's ``OperationalError``) may pass later.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (OSError, OperationalError)):
            return False
        if isinstance(current, (SerializationError, TypeError, ValueError)):
            return True
        current = current.__cause__ or current.__context__
    return False
