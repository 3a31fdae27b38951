"""Leader services of a Celery worker: long-running code on the leader only.

A poller, a change-data-capture consumer, a websocket client: code that must
run on exactly one replica, for as long as it leads a role. Register it with
the :func:`leader_service` decorator or the ``nats_leader_services`` setting;
the worker's main process starts it on promotion and stops it on demotion
(see :mod:`celery_nats_leader.election.leader_services` for the guarantees)::

    from celery_nats_leader import LeaderContext, leader_service

    @leader_service(app, role="feeds")
    def poll_feed(ctx: LeaderContext) -> None:
        while not ctx.wait(5.0):              # sleeps, wakes when the term ends
            fetch_and_store(fence=ctx.token)   # the term's fencing token

or, by name, ``nats_leader_services = {"feeds": ["proj.feeds:poll_feed"]}``.

Every service runs on a thread of its own in the worker's main process,
never in pool children and never on the election's event loop; a coroutine
function gets an event loop of its own on that thread and is cancelled when
the term ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from celery_nats_leader.config import validate_key
from celery_nats_leader.core.errors import ConfigError
from celery_nats_leader.election.leader_services import LeaderContext, ServiceFunction

__all__ = ["ServiceSpec", "leader_service", "registered_services"]


@dataclass(frozen=True)
class ServiceSpec:
    """One leader service registered on an app.

    Attributes:
        function: ``function(ctx)``, plain or coroutine function.
        role: The role; ``None`` means the first of ``nats_leader_roles``.
        name: For logs.
        grace: Seconds a release waits for it to stop; ``None`` = ``lease_margin``.

    """

    function: ServiceFunction
    role: str | None
    name: str
    grace: float | None = None


_registry: weakref.WeakKeyDictionary[Any, list[ServiceSpec]] = weakref.WeakKeyDictionary()


def leader_service(
    app: Any, *, role: str | None = None, grace: float | None = None, name: str | None = None
) -> Callable[[ServiceFunction], ServiceFunction]:
    """Register a function to run on the worker that leads ``role``, while it leads.

    Args:
        app: The Celery app.
        role: The role; default the first of ``nats_leader_roles``.
        grace: Seconds a graceful hand-over waits for the function to
            return; default the role's ``lease_margin``.
        name: For logs; default the function's qualified name.

    Returns:
        A decorator returning the function unchanged.

    Raises:
        ConfigError: If ``role`` is not a valid role name.

    """
    if role is not None:
        validate_key(role, "role")

    def register(function: ServiceFunction) -> ServiceFunction:
        spec = ServiceSpec(function, role, name or _name_of(function), grace)
        _registry.setdefault(app, []).append(spec)
        return function

    return register


def registered_services(
    app: Any, setting: Mapping[str, Any], default_role: str | None
) -> list[ServiceSpec]:
    """The decorated services of ``app`` plus those named in ``nats_leader_services``.

    Args:
        app: The Celery app.
        setting: ``nats_leader_services``: role -> list of ``"module:function"``
            names (or functions).
        default_role: The role of services registered without one.

    Returns:
        Every service with its role resolved.

    Raises:
        ConfigError: If a name cannot be imported or is not callable.

    """
    from kombu.utils.imports import symbol_by_name

    specs: list[ServiceSpec] = []
    for spec in _registry.get(app, []):
        specs.append(spec if spec.role is not None else _with_role(spec, default_role))
    if not isinstance(setting, Mapping):
        raise ConfigError(
            f"nats_leader_services={setting!r} must map roles to lists of functions, "
            'e.g. {"feeds": ["proj.feeds:poll_feed"]}'
        )
    for role, entries in setting.items():
        validate_key(role, "nats_leader_services")
        for entry in [entries] if isinstance(entries, str) or callable(entries) else entries:
            try:
                function = (
                    symbol_by_name(entry)  # type: ignore[no-untyped-call]  # kombu is untyped
                    if isinstance(entry, str)
                    else entry
                )
            except (ImportError, AttributeError, ValueError) as exc:
                raise ConfigError(
                    f"nats_leader_services[{role!r}]: cannot import {entry!r} ({exc}); "
                    "write 'package.module:function'"
                ) from None
            if not callable(function):
                raise ConfigError(f"nats_leader_services[{role!r}]: {entry!r} is not callable")
            specs.append(ServiceSpec(function, role, _name_of(function)))
    return specs


def _with_role(spec: ServiceSpec, role: str | None) -> ServiceSpec:
    return ServiceSpec(spec.function, role, spec.name, spec.grace)


def _name_of(function: Any) -> str:
    module = getattr(function, "__module__", "")
    qualname = getattr(function, "__qualname__", repr(function))
    return f"{module}:{qualname}" if module else str(qualname)


def on_own_thread(function: ServiceFunction) -> Callable[[LeaderContext], None]:
    """``function`` as a plain function (a coroutine function gets its own loop).

    The election's loop never runs user code in a worker: a blocking call
    there would stall the renewals. A coroutine function therefore runs in
    ``asyncio.run`` on the service's own thread, and the end of the term
    cancels it there.
    """
    if not inspect.iscoroutinefunction(function):
        return function  # type: ignore[return-value]  # a plain function already

    @functools.wraps(function)
    def run(ctx: LeaderContext) -> None:
        async def main() -> None:
            loop = asyncio.get_running_loop()
            task = asyncio.current_task()
            assert task is not None

            def cancel() -> None:
                with contextlib.suppress(RuntimeError):  # the loop closed already
                    loop.call_soon_threadsafe(task.cancel)

            ctx.add_stop_callback(cancel)
            try:
                await function(ctx)
            except asyncio.CancelledError:
                if not ctx.stopped:
                    raise

        asyncio.run(main())

    return run
