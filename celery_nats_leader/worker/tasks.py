"""Leader-only tasks: ``@leader_only`` and the ``LeaderTask`` base class.

A leader-only task runs on the worker that currently leads its role::

    @app.task
    @leader_only
    def rebuild_index(): ...

    @app.task(bind=True)
    @leader_only(role="reports", validate=True, on_follower="requeue")
    def nightly_report(self, day, leader_token=None):
        db.write(report, fence=leader_token.epoch)

    @app.task(base=LeaderTask, leader_role="reports")
    def weekly_report(): ...

What it does:

* **Routing.** Calls are sent to the role's leader queue
  (``<nats_leader_queue_prefix><role>``, default ``nats_leader.<role>``) by
  :func:`leader_router`, which :func:`~celery_nats_leader.install` appends to
  ``task_routes``. A worker consumes that queue only while it leads the role.
* **Execution-time check.** Before the body runs, the task checks that its
  worker leads the role *now* (in a prefork child too), and with
  ``validate=True`` also confirms the fencing token against KV. The token is
  put in ``self.request.leader_token`` and, if the function has a
  ``leader_token`` parameter, passed as that keyword.
* **On a follower** (a demoted worker still holding prefetched messages, or a
  message routed elsewhere): ``"requeue"`` (default) gives the message back
  to the leader queue without running it; ``"skip"`` drops it with a log line
  (for per-node or broadcast patterns); ``"raise"`` fails the task with
  :class:`~celery_nats_leader.core.errors.NotLeaderError`.
* If the body raises :class:`~celery_nats_leader.core.errors.LeadershipLostError`
  (for example because a fenced write was refused), the same policy applies:
  with ``"requeue"`` the message goes back to the leader queue for the current
  leader.

Leader-only tasks are ``acks_late`` and ``reject_on_worker_lost``: a message is
acknowledged only after the task ran (or was deliberately skipped), which is
what makes a requeue lossless.

Direct calls (``task()``) run the body as a plain function call: no check, no
token (pass ``leader_token`` yourself if the body needs one). Eager execution
(``task_always_eager``, ``apply()``; development and tests, one process, no
worker) runs the body in the caller without an election, with
:data:`EAGER_TOKEN` (epoch 0, older than every real term) as its token, so
that code written for the worker (``leader_token.epoch``, a fenced write)
runs unchanged; a warning says so once per process.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NoReturn, TypeVar, cast, overload

from celery import Task
from celery._state import get_current_task
from celery.exceptions import Reject

from celery_nats_leader.config import validate_key
from celery_nats_leader.config.settings import settings_of_app
from celery_nats_leader.core import constants as c
from celery_nats_leader.core.errors import ConfigError, LeadershipLostError, NotLeaderError
from celery_nats_leader.term.token import FencingToken
from celery_nats_leader.worker import shared_leadership
from celery_nats_leader.worker.refused import NotRun

__all__ = [
    "LeaderTask",
    "OnFollower",
    "leader_only",
    "leader_router",
    "leader_tasks",
    "upgrade_tasks",
]

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

#: What a task does when it finds its worker does not lead its role.
OnFollower = Literal["requeue", "skip", "raise"]
_POLICIES = ("requeue", "skip", "raise")

#: Attribute set on functions decorated with :func:`leader_only`.
_MARK = "__nats_leader__"

#: The keyword through which the token is passed to functions that accept it.
TOKEN_KWARG = "leader_token"

#: The token of a leader-only task executed eagerly (``task_always_eager``,
#: ``apply()``): there is no election in the caller; epoch 0 is older than
#: every real term, so a database fence that has seen one refuses it.
EAGER_TOKEN = FencingToken(epoch=0, value="eager-execution")

_eager_warned = False


def _eager_token(task: Any, role: str | None) -> FencingToken:
    """The token of an eager execution of ``task`` (warns once per process)."""
    global _eager_warned  # noqa: PLW0603 - one warning per process
    if not _eager_warned:
        _eager_warned = True
        logger.warning(
            "%s runs eagerly (task_always_eager or apply()): leader-only tasks run in the "
            "caller without an election, with a token of epoch 0",
            task.name,
        )
    task.request.leader_role = role
    task.request.leader_token = EAGER_TOKEN
    return EAGER_TOKEN


@dataclass(frozen=True)
class LeaderOptions:
    """The leader-only options of one task.

    Attributes:
        role: The role; ``None`` means the first of ``nats_leader_roles``.
        validate: Confirm the fencing token against KV before running.
        on_follower: ``"requeue"``, ``"skip"`` or ``"raise"``.

    """

    role: str | None = None
    validate: bool = False
    on_follower: OnFollower = "requeue"

    def __post_init__(self) -> None:
        if self.role is not None:
            validate_key(self.role, "role")
        if self.on_follower not in _POLICIES:
            raise ConfigError(
                f"on_follower={self.on_follower!r} is unknown: use 'requeue', 'skip' or 'raise'"
            )
        if not isinstance(self.validate, bool):
            raise ConfigError(f"validate={self.validate!r} must be True or False")


# --------------------------------------------------------------- settings


def _resolve_role(app: Any, options: LeaderOptions) -> str:
    if options.role is not None:
        return options.role
    roles = settings_of_app(app).roles
    return roles[0] if roles else c.DEFAULT_ROLE


@dataclass(frozen=True)
class _Binding:
    """A task's options resolved against its app (cached on the task)."""

    options: LeaderOptions
    role: str
    queue: str


def _binding(task: Any) -> _Binding:
    binding = task.__dict__.get("_nats_leader_binding")
    if binding is None:
        options = leader_options(task)
        if options is None:
            raise TypeError(f"task {task.name!r} is not leader-only")
        role = _resolve_role(task.app, options)
        binding = _Binding(options, role, settings_of_app(task.app).queue_for(role))
        # Per task instance: the app's settings are read once.
        task.__dict__["_nats_leader_binding"] = binding
    return cast(_Binding, binding)


def leader_options(task: Any) -> LeaderOptions | None:
    """The leader-only options of ``task``, or ``None`` for an ordinary task.

    Args:
        task: A Celery task instance.

    Returns:
        The options of a :class:`LeaderTask` or of a ``@leader_only`` function.

    """
    marked = getattr(getattr(task, "run", None), _MARK, None)
    if isinstance(marked, LeaderOptions):
        return marked
    if isinstance(task, LeaderTask):
        return LeaderOptions(task.leader_role, task.leader_validate, task.leader_on_follower)
    return None


def leader_tasks(app: Any) -> list[tuple[Any, str]]:
    """Every leader-only task of ``app`` with its role.

    Args:
        app: A Celery app (finalized on access).

    Returns:
        ``(task, role)`` pairs.

    """
    found = []
    for task in list(app.tasks.values()):
        if leader_options(task) is not None:
            found.append((task, _binding(task).role))
    return found


def leader_router(
    name: str, args: Any, kwargs: Any, options: Any, task: Any = None, **rest: Any
) -> dict[str, str] | None:
    """Celery router (``task_routes``) sending leader-only tasks to their leader queue.

    :func:`~celery_nats_leader.install` appends it to ``task_routes``, after
    your own routes: a route of yours for a leader-only task wins, and so does
    ``apply_async(queue=...)``. Add it yourself to place it elsewhere.

    Returns:
        ``{"queue": "<queue_prefix><role>"}`` for a leader-only task, else ``None``.

    """
    if task is None or leader_options(task) is None:
        return None
    return {"queue": _binding(task).queue}


def upgrade_task(task: Any) -> None:
    """Give a leader-only task its delivery settings (idempotent; done by the worker).

    ``acks_late`` and ``reject_on_worker_lost`` are forced: the requeue
    policy relies on the message staying unacknowledged until the task ran.
    """
    if leader_options(task) is None:
        return
    cls = type(task)
    cls.acks_late = True
    cls.reject_on_worker_lost = True


def upgrade_tasks(app: Any) -> None:
    """Upgrade every leader-only task of ``app`` (see :func:`upgrade_task`)."""
    for task in list(app.tasks.values()):
        upgrade_task(task)


def _add_router(app: Any) -> None:
    routes = app.conf.task_routes
    if routes is None:
        routes = ()
    elif not isinstance(routes, (list, tuple)):
        routes = (routes,)
    if leader_router not in routes:
        app.conf.task_routes = (*routes, leader_router)
        # Routes are compiled on first use: recompile if that happened already.
        amqp = app.amqp
        amqp.flush_routes()
        amqp.__dict__.pop("router", None)


def install_routing(app: Any) -> None:
    """Route ``app``'s leader-only tasks to their leader queues (idempotent).

    Appends :func:`leader_router` to ``task_routes`` whenever the app's
    configuration is loaded (now, if it is already).
    """
    if getattr(app, "_nats_leader_routing", False):
        return
    app._nats_leader_routing = True

    def on_configured(sender: Any = None, **kwargs: Any) -> None:
        _add_router(app)

    app.on_after_configure.connect(on_configured, weak=False)
    if app.configured:
        _add_router(app)


# ------------------------------------------------------ execution check


def _eager(task: Any) -> bool:
    """Whether ``task`` runs under an eager execution (``task_always_eager``, ``apply()``).

    Looked up the whole request stack: a base class whose ``__call__`` calls
    ``super().__call__`` (``OnceTask``, a project's own) has Celery before 5.4
    push a fresh request over the eager tracer's, without ``is_eager``.
    """
    if task.request.is_eager:
        return True
    stack = getattr(getattr(task, "request_stack", None), "stack", None) or ()
    return any(getattr(request, "is_eager", False) for request in stack)


def _worker_execution(task: Any) -> bool:
    """Whether ``task`` is being executed from a message by a worker."""
    request = task.request
    return not request.called_directly and not request.is_eager


def _delivered_from(request: Any, queue: str) -> bool:
    info = request.delivery_info or {}
    return bool(info.get("routing_key") == queue)


def _guard(task: Any, binding: _Binding) -> FencingToken:
    """Check leadership before the body runs; returns the token or refuses."""
    options = binding.options
    result = shared_leadership.check_leadership(binding.role, validate=options.validate)
    request = task.request
    request.leader_role = binding.role
    request.leader_token = result.token
    request.leader_checked_at = result.checked_at
    if result.token is None:
        _refuse(task, binding, result.reason)
    return result.token


def _refuse(task: Any, binding: _Binding, reason: str) -> NoReturn:
    """Apply the ``on_follower`` policy. Never returns."""
    request = task.request
    role = binding.role
    policy = binding.options.on_follower
    if policy == "skip":
        logger.info("%s[%s] skipped: %s (role %r)", task.name, request.id, reason, role)
        raise NotRun()
    if policy == "raise":
        raise NotLeaderError(f"{task.name}[{request.id}]: {reason} (role {role!r})")
    if task.acks_late and _delivered_from(request, binding.queue):
        # Still unacknowledged: hand the very message back to the leader queue.
        # (Celery itself logs the rejection, with this reason, at WARNING.)
        logger.debug("%s[%s] requeued: %s (role %r)", task.name, request.id, reason, role)
        raise Reject(f"{reason} (role {role!r})", requeue=True)
    # The message came from another queue (rejecting it would put it back
    # there, forever): forward a copy with the same id to the leader queue,
    # and only then let this one be acknowledged.
    task.signature_from_request(request, queue=binding.queue).apply_async()
    logger.info(
        "%s[%s] forwarded to %s: %s (role %r)", task.name, request.id, binding.queue, reason, role
    )
    raise NotRun()


def _run_guarded(
    task: Any,
    binding: _Binding,
    body: Callable[..., Any],
    *,
    accepts_token: bool,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    token = _guard(task, binding)
    if accepts_token:
        kwargs[TOKEN_KWARG] = token
    try:
        return body(*args, **kwargs)
    except LeadershipLostError as exc:
        _refuse(task, binding, f"leadership lost while running: {exc}")


def _accepts_token(fun: Callable[..., Any]) -> bool:
    try:
        parameter = inspect.signature(fun).parameters.get(TOKEN_KWARG)
    except (TypeError, ValueError):
        return False
    return parameter is not None and parameter.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.KEYWORD_ONLY,
    )


# -------------------------------------------------------------- public API


@overload
def leader_only(fun: F, /) -> F: ...


@overload
def leader_only(
    *, role: str | None = None, validate: bool = False, on_follower: OnFollower = "requeue"
) -> Callable[[F], F]: ...


def leader_only(
    fun: Callable[..., Any] | None = None,
    /,
    *,
    role: str | None = None,
    validate: bool = False,
    on_follower: OnFollower = "requeue",
) -> Any:
    """Make a task run only on the worker that leads ``role``.

    Put it *under* ``@app.task`` (or ``@shared_task``), bare or with arguments.
    Call :func:`celery_nats_leader.install` on the app so that the task is
    routed to the leader queue and the workers run the election.

    Args:
        fun: The task function (when used bare).
        role: The role; default the first of ``nats_leader_roles``.
        validate: Also confirm the fencing token against KV before each run
            (one KV read, ~0.3 ms on a LAN); closes the few milliseconds in
            which a leader whose key was taken away has not noticed yet.
        on_follower: What to do when the worker does not lead the role:
            ``"requeue"`` (default), ``"skip"`` or ``"raise"``.

    Returns:
        The decorated function (or a decorator).

    Raises:
        ConfigError: On an invalid role or policy.
        TypeError: If applied over ``@app.task`` instead of under it.

    """
    options = LeaderOptions(role, validate, on_follower)

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        if isinstance(f, Task):
            raise TypeError("put @leader_only under @app.task, not over it")
        accepts_token = _accepts_token(f)

        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            task = get_current_task()
            # Checked only when a worker executes *this* task: not for direct
            # or eager calls, nor when another task calls this function. The
            # mark survives other functools.wraps decorators stacked above.
            if task is None or getattr(task.run, _MARK, None) is not options:
                return f(*args, **kwargs)
            if _eager(task):
                token = _eager_token(task, options.role)
                if accepts_token and kwargs.get(TOKEN_KWARG) is None:
                    kwargs[TOKEN_KWARG] = token
                return f(*args, **kwargs)
            if not _worker_execution(task):
                return f(*args, **kwargs)
            return _run_guarded(
                task, _binding(task), f, accepts_token=accepts_token, args=args, kwargs=kwargs
            )

        setattr(wrapper, _MARK, options)
        if accepts_token:
            # Callers never pass the token: hide it from Celery's argument
            # check (``typing``) and from the task's signature.
            signature = inspect.signature(f)
            wrapper.__signature__ = signature.replace(  # type: ignore[attr-defined]
                parameters=[p for p in signature.parameters.values() if p.name != TOKEN_KWARG]
            )
        return wrapper

    if fun is not None:
        return decorate(fun)
    return decorate


class LeaderTask(Task):  # type: ignore[misc]  # Celery is untyped
    """Base class of leader-only tasks: ``@app.task(base=LeaderTask, ...)``.

    Class attributes (or ``@app.task`` options) ``leader_role``,
    ``leader_validate`` and ``leader_on_follower`` mean what ``role``,
    ``validate`` and ``on_follower`` mean for :func:`leader_only`. Subclass it
    to set them once for a family of tasks.
    """

    #: The role; ``None`` means the first of ``nats_leader_roles``.
    leader_role: str | None = None
    #: Confirm the fencing token against KV before each run.
    leader_validate: bool = False
    #: ``"requeue"``, ``"skip"`` or ``"raise"``.
    leader_on_follower: OnFollower = "requeue"

    acks_late = True
    reject_on_worker_lost = True

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Validate the leader options when the task is bound to its app."""
        LeaderOptions(cls.leader_role, cls.leader_validate, cls.leader_on_follower)
        super().on_bound(app)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the task, on the leader only (see the module docs)."""
        marked = getattr(self.run, _MARK, None)
        if marked is None and _eager(self):
            token = _eager_token(self, self.leader_role)
            if _accepts_token(self.run) and kwargs.get(TOKEN_KWARG) is None:
                kwargs = {**kwargs, TOKEN_KWARG: token}
            # The eager tracer has pushed the request (with the token on it):
            # call run() directly, as on the worker (Task.__call__ would push
            # a fresh request before Celery 5.4, without the token).
            return self.run(*args, **kwargs)
        if not _worker_execution(self):
            return super().__call__(*args, **kwargs)
        if marked is not None:
            # The function is @leader_only itself: its wrapper does the check.
            return self.run(*args, **kwargs)
        # The worker has pushed this task's request already: call run()
        # directly, as Celery's docs say for a custom __call__.
        accepts = self.__dict__.get("_nats_leader_accepts_token")
        if accepts is None:
            accepts = self.__dict__["_nats_leader_accepts_token"] = _accepts_token(self.run)
        return _run_guarded(
            self, _binding(self), self.run, accepts_token=accepts, args=args, kwargs=kwargs
        )
