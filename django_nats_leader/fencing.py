"""The database fence: a stale leader's writes are rejected by the database itself.

A leader that was paused (GC, SIGSTOP, a frozen VM) or cut off may still
believe it leads when it wakes up, while a successor already runs a newer
term. Every term has a :class:`~celery_nats_leader.term.token.FencingToken` whose
``epoch`` strictly grows from term to term. The database remembers, per role,
the highest epoch it has accepted a write from (:class:`FenceEpoch`), and
:func:`fenced` refuses a write that carries an older one::

    from django_nats_leader.fencing import fenced

    with fenced("reports", leader_token):      # StaleLeaderError if outdated
        Report.objects.create(day=day, body=body)

How it stays right under concurrency: inside one transaction, :func:`fenced`
makes sure the role's row exists (``INSERT ... ON CONFLICT DO NOTHING``, so
two first writers cannot both insert), locks it with ``SELECT ... FOR
UPDATE``, compares the epochs, raises the high-water mark if the token is
newer, and only then runs the block. The lock is held until the transaction
commits, so a stale writer that raced a newer one waits for it, then reads
the newer epoch and is rejected; a writer whose epoch was accepted commits
its writes before any other fenced write of the role can start. On
PostgreSQL (and other databases with row locks) this is exact. On SQLite,
which has no row locks, the insert takes the database's single write lock,
which serializes fenced writes just the same (use ``"transaction_mode":
"IMMEDIATE"`` in the database ``OPTIONS`` to avoid ``database is locked``
errors under load).

The fence orders writes by term: once any write of epoch ``n`` committed,
every write of an epoch below ``n`` fails. A stale leader's write that
commits *before* the successor's first fenced write is still accepted: its
term was the newest the database had seen, which is all a fencing token can
promise (Kleppmann, "How to do distributed locking").

Epochs of the two strategies are not comparable: a KV epoch is a stream
revision, an ALLCALL epoch a wall-clock millisecond count (~1.7e12,
:func:`~celery_nats_leader.term.token.epoch_strategy` tells them apart). The fence
never orders one against the other: a token of the other strategy than the
one the role's fence was raised by is refused with
:class:`StrategyChangedError`, in both directions. After moving a role from
one strategy to the other (and stopping every process of the old one), an
operator runs ``manage.py election_fence_reset ROLE``; nothing resets it
silently, because a stray process of the old strategy would otherwise be
ordered against the new one (an ALLCALL term would lock every KV term out
for good; a KV term would pass as "older" with no meaning).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

from django.db import router, transaction

from celery_nats_leader.core.errors import ConfigError, LeadershipLostError
from celery_nats_leader.term.token import FencingToken, epoch_strategy

if TYPE_CHECKING:
    from django_nats_leader.models import FenceEpoch

logger = logging.getLogger(__name__)

#: Characters of the token value stored next to the epoch (never the whole token).
TOKEN_PREFIX_CHARS = 12


class StaleLeaderError(LeadershipLostError):
    """Raised when a fenced write carries an older term than one the database has seen.

    It is a :class:`~celery_nats_leader.core.errors.LeadershipLostError` (and so an
    :class:`~celery_nats_leader.core.errors.ElectionError`): a ``@leader_only``
    task that hits it is handled by its ``on_follower`` policy (by default
    requeued for the current leader).

    Attributes:
        role: The role.
        epoch: The rejected token's epoch (``None`` when there was no token).
        current_epoch: The highest epoch the database has accepted.

    """

    def __init__(self, message: str, *, role: str, epoch: int | None, current_epoch: int | None):
        super().__init__(message)
        self.role = role
        self.epoch = epoch
        self.current_epoch = current_epoch


class StrategyChangedError(ConfigError):
    """Raised when a fenced write's epoch comes from another strategy than the role's fence.

    The role's fence was raised by terms of one strategy (say ALLCALL, whose
    epochs are millisecond timestamps) and the write carries a term of the
    other (KV, whose epochs are revisions): the two cannot be ordered. The
    message says what to run once the old strategy's processes are stopped.

    A configuration problem, not a lost leadership: it is a
    :class:`~celery_nats_leader.core.errors.ConfigError`, *not* a
    :class:`StaleLeaderError`. Inside ``@leader_only`` the task fails once
    with this message; as a lost leadership it was requeued to the same
    leader, which can never pass the fence until an operator acts, and came
    back at broker speed.

    Attributes:
        role: The role.
        epoch: The refused term's epoch.
        current_epoch: The epoch the fence holds.
        fence_strategy: The strategy of the epoch in the database.
        token_strategy: The strategy of the refused token's epoch.

    """

    def __init__(
        self,
        message: str,
        *,
        role: str,
        epoch: int,
        current_epoch: int,
        fence_strategy: str,
        token_strategy: str,
    ):
        super().__init__(message)
        self.role = role
        self.epoch = epoch
        self.current_epoch = current_epoch
        self.fence_strategy = fence_strategy
        self.token_strategy = token_strategy


def _as_token(token: FencingToken | str | None, role: str) -> FencingToken:
    if isinstance(token, FencingToken):
        return token
    if isinstance(token, str):
        return FencingToken.from_header(token)
    raise StaleLeaderError(
        f"no fencing token for role {role!r}: this process does not lead it",
        role=role,
        epoch=None,
        current_epoch=None,
    )


def _database(using: str | None) -> str:
    if using is not None:
        return using
    from django_nats_leader.models import FenceEpoch

    return str(router.db_for_write(FenceEpoch))


@contextlib.contextmanager
def fenced(
    role: str,
    token: FencingToken | str | None,
    *,
    using: str | None = None,
    holder: str = "",
) -> Iterator[FenceEpoch]:
    """Run the block only if ``token`` is not older than any term the database has seen.

    The block runs inside a transaction (a savepoint when already inside one)
    that holds the role's fence row locked until the outermost transaction
    commits; write to the same database (``using``) inside the block so that
    the writes commit, or roll back, together with the fence.

    Args:
        role: The election role whose leadership the write relies on.
        token: The leader's token (``RoleHandle.token``, ``leader_token`` of a
            ``@leader_only`` task) or its header form ``"<epoch>:<value>"``.
            ``None`` (not leading) is rejected.
        using: The database alias; default the router's choice for
            :class:`~django_nats_leader.models.FenceEpoch`.
        holder: Who writes (an instance id), stored for operators.

    Yields:
        The role's locked fence row, already carrying ``token``'s epoch. For
        the eager token (epoch 0: ``task_always_eager``), which never
        creates nor raises the fence, an unsaved row when the role has none.

    Raises:
        StaleLeaderError: ``token`` is older than the newest epoch seen for
            ``role``, or is another term of the same epoch. Nothing in the
            block ran.

    """
    from django_nats_leader.models import FenceEpoch

    fencing_token = _as_token(token, role)
    prefix = fencing_token.value[:TOKEN_PREFIX_CHARS]
    db = _database(using)
    with transaction.atomic(using=db):
        if fencing_token.epoch == 0:
            # No term at all: an eager run (task_always_eager; development
            # and tests). It never creates or raises the fence (a row at 0
            # would read as a KV term and lock every ALLCALL term out), and
            # is refused once the database has seen any real term.
            existing = FenceEpoch.objects.using(db).select_for_update().filter(role=role).first()
            if existing is not None:
                raise StaleLeaderError(
                    f"stale leader for role {role!r}: an eager run (epoch 0) is older than "
                    f"epoch {existing.epoch}, already seen by the database",
                    role=role,
                    epoch=0,
                    current_epoch=existing.epoch,
                )
            yield FenceEpoch(role=role, epoch=0, token_prefix=prefix, holder=holder)
            return
        # Insert-or-nothing first, so that two first writers of a role cannot
        # both create the row (ON CONFLICT DO NOTHING / INSERT OR IGNORE).
        FenceEpoch.objects.using(db).bulk_create(
            [FenceEpoch(role=role, epoch=fencing_token.epoch, token_prefix=prefix, holder=holder)],
            ignore_conflicts=True,
        )
        row = FenceEpoch.objects.using(db).select_for_update().get(role=role)
        held, offered = epoch_strategy(row.epoch), epoch_strategy(fencing_token.epoch)
        if held != offered:
            logger.error(
                "fence %r: refused a term of the %s strategy (epoch %d): the fence holds "
                "an epoch of the %s strategy (%d)",
                role,
                offered,
                fencing_token.epoch,
                held,
                row.epoch,
            )
            raise StrategyChangedError(
                f"the database fence of role {role!r} holds epoch {row.epoch}, a term of the "
                f"{held!r} strategy, and cannot order this {offered!r} term (epoch "
                f"{fencing_token.epoch}) against it. If role {role!r} moved from {held} to "
                f"{offered}: stop every {held} process of the role, then run "
                f"'manage.py election_fence_reset {role}'",
                role=role,
                epoch=fencing_token.epoch,
                current_epoch=row.epoch,
                fence_strategy=held,
                token_strategy=offered,
            )
        if fencing_token.epoch < row.epoch:
            logger.warning(
                "fence %r: rejected a write of epoch %d, epoch %d is newer",
                role,
                fencing_token.epoch,
                row.epoch,
            )
            raise StaleLeaderError(
                f"stale leader for role {role!r}: its term (epoch {fencing_token.epoch}) is older "
                f"than epoch {row.epoch}, already seen by the database",
                role=role,
                epoch=fencing_token.epoch,
                current_epoch=row.epoch,
            )
        if fencing_token.epoch == row.epoch and row.token_prefix and row.token_prefix != prefix:
            raise StaleLeaderError(
                f"conflicting term for role {role!r}: epoch {row.epoch} was seen with another "
                "token (two buckets using one role name?)",
                role=role,
                epoch=fencing_token.epoch,
                current_epoch=row.epoch,
            )
        if fencing_token.epoch > row.epoch:
            logger.info("fence %r: epoch %d -> %d", role, row.epoch, fencing_token.epoch)
            row.epoch = fencing_token.epoch
            row.token_prefix = prefix
            row.holder = holder
            row.save(using=db, update_fields=["epoch", "token_prefix", "holder", "updated_at"])
        yield row


def current_epoch(role: str, *, using: str | None = None) -> int | None:
    """The highest epoch accepted for ``role``, or ``None`` before its first fenced write."""
    from django_nats_leader.models import FenceEpoch

    row = FenceEpoch.objects.using(_database(using)).filter(role=role).first()
    return None if row is None else row.epoch


def reset_fence(role: str, strategy: str, *, using: str | None = None) -> int | None:
    """Forget the role's fence epoch if it was raised by another strategy than ``strategy``.

    For a role that moved from one election strategy to the other. The next
    fenced write of ``strategy`` sets the fence again. A fence already of
    ``strategy`` is never lowered (that would let its stale leaders write).

    Args:
        role: The role.
        strategy: The role's strategy now (``"kv"`` or ``"allcall"``).
        using: The database alias; default the router's choice.

    Returns:
        The epoch forgotten, or ``None`` when the role had no fence row.

    Raises:
        ValueError: The fence already holds an epoch of ``strategy``.

    """
    from django_nats_leader.models import FenceEpoch

    db = _database(using)
    with transaction.atomic(using=db):
        row = FenceEpoch.objects.using(db).select_for_update().filter(role=role).first()
        if row is None:
            return None
        if epoch_strategy(row.epoch) == strategy:
            raise ValueError(
                f"the database fence of role {role!r} holds epoch {row.epoch}, already a "
                f"{strategy!r} term: lowering it would let stale leaders write; nothing changed"
            )
        forgotten: int = row.epoch
        row.delete()
    logger.warning(
        "fence %r: forgot epoch %d (%s) for the %s strategy",
        role,
        forgotten,
        epoch_strategy(forgotten),
        strategy,
    )
    return forgotten


__all__ = [
    "TOKEN_PREFIX_CHARS",
    "StaleLeaderError",
    "StrategyChangedError",
    "current_epoch",
    "fenced",
    "reset_fence",
]
