"""Parent-side control of candidate processes (the child program is :mod:`.candidate`).

:class:`CandidateGroup` spawns children, reads their events on a thread per
child into one queue, and offers :meth:`~CandidateGroup.wait_for`, commands,
and the signals (:meth:`CandidateProcess.kill`,
:meth:`~CandidateProcess.pause`, :meth:`~CandidateProcess.resume`,
:meth:`~CandidateProcess.terminate`). The events are those listed in
:mod:`tests.harness.candidate`.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from celery_nats_leader.testing.process import wait_thread_states

__all__ = [
    "EXITED",
    "MODULE",
    "CandidateEvent",
    "CandidateGroup",
    "CandidateProcess",
    "leadership_overlap",
]

#: The child program (``python -m ...``).
MODULE = "tests.harness.candidate"

#: The repository root: the child imports its program from ``tests/``.
ROOT = Path(__file__).resolve().parents[2]

#: Pseudo-event the parent adds when a child's stdout closes (it exited).
EXITED = "exited"


@dataclass(frozen=True)
class CandidateEvent:
    """One line a candidate printed (or the ``exited`` pseudo-event).

    Attributes:
        kind: ``ready``, ``promoted``, ``demoted``, ``leader``, ``validate``,
            ``status``, ``resigned``, ``error``, ``stopped`` or ``exited``.
        name: The candidate's id.
        at: :func:`time.monotonic` when it happened (in the child; for
            ``exited``, when the parent noticed).
        data: The whole JSON object.

    """

    kind: str
    name: str
    at: float
    data: Mapping[str, Any] = field(repr=False)

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def get(self, key: str, default: Any = None) -> Any:
        """Return a field of the event, or ``default``."""
        return self.data.get(key, default)

    def __repr__(self) -> str:
        extra = {k: v for k, v in self.data.items() if k not in ("event", "id", "at", "pid")}
        return f"<{self.kind} {self.name} at={self.at:.3f} {extra}>"


class CandidateProcess:
    """One child candidate process.

    Created by :meth:`CandidateGroup.spawn`; its events go to the group.

    Args:
        name: The candidate's id.
        argv: The full command line.
        sink: Where to put the events read from the child.
        env: The child's environment (default: inherited).

    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        sink: queue.Queue[CandidateEvent],
        *,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self._sink = sink
        child_env = dict(os.environ if env is None else env)
        # The harness is not installed: the child finds ``tests`` from the root.
        child_env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(ROOT), child_env.get("PYTHONPATH")])
        )
        self._proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            env=child_env,
        )
        self._stdin_lock = threading.Lock()
        self._reader = threading.Thread(
            target=self._read, name=f"candidate-{name}-events", daemon=True
        )
        self._reader.start()

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        """Exit status once it exited (negative: killed by that signal), else ``None``."""
        return self._proc.poll()

    @property
    def is_running(self) -> bool:
        """Whether the child has not exited (a paused child is running)."""
        return self._proc.poll() is None

    def _read(self) -> None:
        stdout = self._proc.stdout
        assert stdout is not None
        for line in stdout:
            try:
                body = json.loads(line)
            except ValueError:
                sys.stderr.write(f"[{self.name}] {line}")
                continue
            if isinstance(body, dict) and "event" in body:
                self._sink.put(
                    CandidateEvent(
                        kind=str(body["event"]),
                        name=str(body.get("id", self.name)),
                        at=float(body.get("at", time.monotonic())),
                        data=body,
                    )
                )
        code = self._proc.wait()
        self._sink.put(
            CandidateEvent(
                kind=EXITED,
                name=self.name,
                at=time.monotonic(),
                data={"event": EXITED, "id": self.name, "returncode": code},
            )
        )

    def send(self, command: str) -> None:
        """Write one command line (``validate``, ``status``, ``resign``, ``stop``) to stdin.

        Raises:
            RuntimeError: If the child has exited.

        """
        stdin = self._proc.stdin
        if stdin is None or not self.is_running:
            raise RuntimeError(f"candidate {self.name} is not running")
        with self._stdin_lock:
            try:
                stdin.write(command + "\n")
                stdin.flush()
            except (BrokenPipeError, ValueError) as exc:
                raise RuntimeError(f"candidate {self.name} is not running") from exc

    def kill(self) -> float:
        """SIGKILL the child (a crash: nothing released) and reap it.

        Returns:
            :func:`time.monotonic` right before the signal was sent.

        """
        at = time.monotonic()
        if self.is_running:
            self._proc.kill()
        self._proc.wait()
        return at

    def terminate(self) -> float:
        """Send SIGTERM (a graceful stop); does not wait, see :meth:`wait`.

        Returns:
            :func:`time.monotonic` right before the signal was sent.

        """
        at = time.monotonic()
        if self.is_running:
            self._proc.terminate()
        return at

    def pause(self, timeout: float = 5.0) -> float:
        """Freeze the child with SIGSTOP; returns once every thread of it is stopped.

        Args:
            timeout: Seconds to wait for the stop to take effect.

        Returns:
            :func:`time.monotonic` right before the signal was sent.

        """
        at = time.monotonic()
        self._proc.send_signal(signal.SIGSTOP)
        self._wait_state(stopped=True, timeout=timeout)
        return at

    def resume(self, timeout: float = 5.0) -> float:
        """Continue a paused child (SIGCONT); returns once it runs again.

        Returns:
            :func:`time.monotonic` right before the signal was sent.

        """
        at = time.monotonic()
        self._proc.send_signal(signal.SIGCONT)
        self._wait_state(stopped=False, timeout=timeout)
        return at

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the child to exit.

        Returns:
            Its exit status.

        Raises:
            subprocess.TimeoutExpired: If it is still running after ``timeout``.

        """
        return self._proc.wait(timeout)

    def close(self) -> None:
        """Kill the child if it still runs (also if paused) and release its pipes."""
        if self.is_running:
            self._proc.kill()
        self._proc.wait()
        if self._proc.stdin is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
        self._reader.join(timeout=5.0)
        if self._proc.stdout is not None:
            self._proc.stdout.close()

    def _wait_state(self, *, stopped: bool, timeout: float) -> None:
        # kill(2) only queues the signal: poll /proc until it took effect, so
        # that "paused" means paused (same approach as NatsServer.pause).
        states = wait_thread_states(self.pid, stopped=stopped, timeout=timeout)
        if states is not None:
            raise RuntimeError(
                f"candidate {self.name} did not {'stop' if stopped else 'continue'} "
                f"within {timeout}s (thread states {states})"
            )


class CandidateGroup:
    """Candidate processes of one role, and every event they print.

    Each event is in :attr:`log` (arrival order) and is also *pending* until
    a :meth:`wait_for` returns it, so each event is returned at most once and
    events that arrived before a wait are not missed.

    Example:
        >>> with CandidateGroup(server.url, role="beat", ttl=2) as group:  # doctest: +SKIP
        ...     a, b = group.spawn("a", create_bucket=True), group.spawn("b")
        ...     first = group.wait_for("promoted")
        ...     group[first.name].kill()
        ...     second = group.wait_for("promoted", among={"a", "b"} - {first.name})

    Args:
        url: NATS URL, or several (a cluster).
        role: The role every candidate runs for.
        ttl: The election TTL, seconds.
        bucket: The KV bucket.
        python: The interpreter to run children with.
        log_level: When given, children log to stderr at this level.
        reconnect_wait: Children's NATS ``reconnect_time_wait``, seconds.
        env: Children's environment (default: inherited).

    """

    def __init__(
        self,
        url: str | Sequence[str],
        *,
        role: str = "default",
        ttl: float = 2.0,
        bucket: str = "leaders",
        python: str = sys.executable,
        log_level: str | None = None,
        reconnect_wait: float | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.urls = [url] if isinstance(url, str) else list(url)
        self.role = role
        self.ttl = ttl
        self.bucket = bucket
        self._python = python
        self._log_level = log_level
        self._reconnect_wait = reconnect_wait
        self._env = env
        self._procs: dict[str, CandidateProcess] = {}
        self._queue: queue.Queue[CandidateEvent] = queue.Queue()
        self._pending: list[CandidateEvent] = []
        self.log: list[CandidateEvent] = []
        self._counter = 0

    # ----------------------------------------------------------- processes

    def spawn(
        self,
        name: str | None = None,
        *,
        url: str | Sequence[str] | None = None,
        priority: int = 0,
        create_bucket: bool = False,
        replicas: int = 1,
        allow_takeover: bool = False,
        health_file: str | os.PathLike[str] | None = None,
        release_on_stop: bool = True,
        extra_args: Sequence[str] = (),
        wrapper: Sequence[str] = (),
    ) -> CandidateProcess:
        """Start one candidate process (returns at once; wait for its ``ready``).

        Args:
            name: Its id; default ``<role>-c<n>``.
            url: Connect here instead of the group's URL(s) (e.g. a fault proxy).
            priority: Its priority.
            create_bucket: Create the bucket if missing.
            replicas: Replicas of the bucket it creates.
            allow_takeover: Politely ask a lower-priority leader to step down.
            health_file: Healthy while this file exists.
            release_on_stop: Delete the key on a graceful stop.
            extra_args: More command line options (see ``--help``).
            wrapper: Run the child as ``wrapper + argv``; the wrapper must exec
                it in place (e.g. :meth:`.NetnsHost.command`'s ``ip netns exec
                NAME``), so that signals reach the candidate.

        Returns:
            The process.

        """
        self._counter += 1
        name = name or f"{self.role}-c{self._counter}"
        if name in self._procs:
            raise ValueError(f"a candidate named {name!r} was spawned already")
        urls = self.urls if url is None else ([url] if isinstance(url, str) else list(url))
        argv = [self._python, "-m", MODULE, "--id", name, "--role", self.role]
        argv += ["--bucket", self.bucket, "--ttl", repr(self.ttl), "--stop-on-eof"]
        for one in urls:
            argv += ["--url", one]
        if priority:
            argv += ["--priority", str(priority)]
        if create_bucket:
            argv += ["--create-bucket", "--replicas", str(replicas)]
        if allow_takeover:
            argv.append("--allow-takeover")
        if health_file is not None:
            argv += ["--health-file", os.fspath(health_file)]
        if not release_on_stop:
            argv.append("--no-release-on-stop")
        if self._log_level:
            argv += ["--log-level", self._log_level]
        if self._reconnect_wait is not None:
            argv += ["--reconnect-wait", repr(self._reconnect_wait)]
        argv = [*wrapper, *argv, *extra_args]
        proc = CandidateProcess(name, argv, self._queue, env=self._env)
        self._procs[name] = proc
        return proc

    def __getitem__(self, name: str) -> CandidateProcess:
        return self._procs[name]

    def __iter__(self) -> Iterator[CandidateProcess]:
        return iter(list(self._procs.values()))

    def __len__(self) -> int:
        return len(self._procs)

    @property
    def names(self) -> list[str]:
        """Every spawned candidate's id, in spawn order."""
        return list(self._procs)

    @property
    def running(self) -> set[str]:
        """Ids of the candidates whose process has not exited."""
        return {name for name, proc in self._procs.items() if proc.is_running}

    # -------------------------------------------------------------- events

    def wait_for(
        self,
        kind: str,
        among: Iterable[str] | None = None,
        *,
        timeout: float = 30.0,
        after: float | None = None,
        where: Callable[[CandidateEvent], bool] | None = None,
    ) -> CandidateEvent:
        """Return (and consume) the first pending ``kind`` event of one of ``among``.

        Args:
            kind: The event, e.g. ``"promoted"``.
            among: Candidate ids to accept it from; default any.
            timeout: Seconds to wait.
            after: Only accept events that happened at or after this
                :func:`time.monotonic` reading.
            where: Only accept events for which this returns true.

        Returns:
            The event.

        Raises:
            TimeoutError: No such event within ``timeout``; the message lists
                the recent events.

        """
        names = None if among is None else set(among)

        def matches(event: CandidateEvent) -> bool:
            return (
                event.kind == kind
                and (names is None or event.name in names)
                and (after is None or event.at >= after)
                and (where is None or where(event))
            )

        deadline = time.monotonic() + timeout
        while True:
            for index, event in enumerate(self._pending):
                if matches(event):
                    del self._pending[index]
                    return event
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                recent = "\n  ".join(repr(e) for e in self.log[-25:])
                who = "any candidate" if names is None else sorted(names)
                # The last events of those waited for, which a busy leader's
                # renewals may have pushed out of the recent ones (an error
                # that ended a start, an exit).
                theirs = "\n  ".join(repr(e) for e in self.log if names is None or e.name in names)[
                    -3000:
                ]
                raise TimeoutError(
                    f"no {kind!r} event from {who} within {timeout:g}s; recent events:\n  "
                    f"{recent}\nevents of {who}:\n  {theirs or '(none)'}"
                )
            try:
                self._take(self._queue.get(timeout=remaining))
            except queue.Empty:
                continue

    def wait_for_all(
        self, kind: str, among: Iterable[str], *, timeout: float = 30.0
    ) -> dict[str, CandidateEvent]:
        """Wait for one ``kind`` event from each of ``among``.

        Returns:
            The events by candidate id.

        """
        deadline = time.monotonic() + timeout
        found: dict[str, CandidateEvent] = {}
        for name in among:
            found[name] = self.wait_for(kind, {name}, timeout=max(0.0, deadline - time.monotonic()))
        return found

    def drain(self) -> list[CandidateEvent]:
        """Take every event that arrived so far into :attr:`log` (without waiting).

        Returns:
            All events logged so far.

        """
        while True:
            try:
                self._take(self._queue.get_nowait())
            except queue.Empty:
                return list(self.log)

    def events(
        self, kind: str | None = None, among: Iterable[str] | None = None
    ) -> list[CandidateEvent]:
        """Events received so far (see :meth:`drain`), filtered by kind and candidate."""
        names = None if among is None else set(among)
        return [
            e
            for e in self.drain()
            if (kind is None or e.kind == kind) and (names is None or e.name in names)
        ]

    def _take(self, event: CandidateEvent) -> None:
        self.log.append(event)
        self._pending.append(event)

    # ------------------------------------------------------------ commands

    def request(
        self, name: str, command: str, reply: str, *, timeout: float = 10.0
    ) -> CandidateEvent:
        """Send ``command`` to one candidate and wait for its ``reply`` event.

        Returns:
            The reply event.

        """
        sent = time.monotonic()
        self._procs[name].send(command)
        return self.wait_for(reply, {name}, timeout=timeout, after=sent)

    def validate(self, name: str, *, timeout: float = 10.0) -> bool:
        """Ask one candidate to ``validate_token()`` against the store.

        Returns:
            Its answer.

        """
        return bool(self.request(name, "validate", "validate", timeout=timeout)["result"])

    def status(self, name: str, *, timeout: float = 10.0) -> dict[str, Any]:
        """Ask one candidate for its :meth:`~celery_nats_leader.KvElection.describe`.

        Returns:
            Its description.

        """
        return dict(self.request(name, "status", "status", timeout=timeout)["status"])

    def resign(self, name: str, *, timeout: float = 10.0) -> CandidateEvent:
        """Ask one candidate to resign; returns its ``resigned`` event."""
        return self.request(name, "resign", "resigned", timeout=timeout)

    # ---------------------------------------------------------- leadership

    def leader(self) -> str:
        """The candidate that was promoted last and has not been demoted or exited since.

        Raises:
            LookupError: If no such candidate is known from the events so far.

        """
        leading: dict[str, float] = {}
        for event in self.drain():
            if event.kind == "promoted":
                leading[event.name] = event.at
            elif event.kind in ("demoted", EXITED, "stopped"):
                leading.pop(event.name, None)
        alive = {n: at for n, at in leading.items() if self._procs[n].is_running}
        if not alive:
            raise LookupError("no candidate leads, as far as its events tell")
        return max(alive, key=lambda n: alive[n])

    def overlap(self, ended: Mapping[str, float] | None = None) -> float:
        """Total seconds during which two candidates believed they led.

        See :func:`leadership_overlap`; killed candidates' beliefs end at the
        times in ``ended`` (e.g. what :meth:`CandidateProcess.kill` returned).
        """
        return leadership_overlap(self.drain(), ended or {})

    # ------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Kill every child still running and reap them all. Idempotent."""
        for proc in self._procs.values():
            proc.close()

    def __enter__(self) -> CandidateGroup:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def leadership_overlap(events: Iterable[CandidateEvent], ended: Mapping[str, float]) -> float:
    """Total time during which more than one process believed it led.

    A belief runs from a ``promoted`` event to the same process's ``demoted``
    event, or else to its time in ``ended`` (when it was killed), or else to
    its ``exited`` event, or forever. All times are one host's monotonic
    clock. Callback times are a little late on both ends, so this is an
    estimate with the resolution of a callback's latency (milliseconds).

    Args:
        events: Events of the candidates.
        ended: Candidate id → when its process was killed.

    Returns:
        Seconds of overlap (0 when leadership never overlapped).

    """
    intervals: list[tuple[float, float]] = []
    open_at: dict[str, float] = {}
    for event in sorted(events, key=lambda e: e.at):
        if event.kind == "promoted":
            open_at[event.name] = event.at
        elif event.kind in ("demoted", EXITED) and event.name in open_at:
            start = open_at.pop(event.name)
            intervals.append((start, min(event.at, ended.get(event.name, event.at))))
    for name, start in open_at.items():
        intervals.append((start, ended.get(name, float("inf"))))
    points = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    total, depth, last = 0.0, 0, 0.0
    for at, step in points:
        if depth > 1:
            total += at - last
        depth += step
        last = at
    return total
