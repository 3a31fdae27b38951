"""Built-in health checks for Django processes: is the database reachable?

Use as ``NATS_LEADER = {"HEALTH_CHECK": "django_nats_leader.health:database_reachable"}``
(or ``CELERY_NATS_LEADER_HEALTH_CHECK`` for Celery workers of a Django
project): a leader that cannot reach its database resigns after
``HEALTH_CHECK_FAILURES`` failed checks in a row, so a healthier replica
takes the role.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections

logger = logging.getLogger(__name__)


def database_check(alias: str = DEFAULT_DB_ALIAS) -> Callable[[], bool]:
    """A health check that runs ``SELECT 1`` on the database ``alias``.

    Args:
        alias: The database alias.

    Returns:
        A callable returning whether the query succeeded.

    """

    def check() -> bool:
        connection = connections[alias]
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT 1")
                cursor.fetchone()
        except DatabaseError as exc:
            logger.warning("health check: database %r unreachable: %s", alias, exc)
            return False
        finally:
            # Checks run on a worker thread: leave no connection behind on it.
            connection.close()
        return True

    return check


#: The default database, for the dotted-path setting.
database_reachable = database_check()

__all__ = ["database_check", "database_reachable"]
