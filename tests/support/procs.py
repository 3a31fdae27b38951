"""Subprocesses of a test (workers, beat), each in its own process group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from celery_nats_leader.testing.process import wait_thread_states


class Proc:
    """A subprocess in its own process group, its output in a log file.

    Args:
        name: A name for messages.
        argv: The command line.
        env: Its environment.
        log_path: Where stdout and stderr go.
        cwd: Its working directory.

    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        log_path: Path,
        cwd: Path,
    ) -> None:
        self.name = name
        self.log_path = log_path
        with log_path.open("wb") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                list(argv),
                env=dict(env),
                cwd=str(cwd),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, for kill()
            )
        self.pid = self.proc.pid

    def __repr__(self) -> str:
        return f"<{self.name} pid={self.pid}>"

    @property
    def alive(self) -> bool:
        """Whether it has not exited yet."""
        return self.proc.poll() is None

    def log(self) -> str:
        """Everything it wrote so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the process (not its children) while it runs."""
        if self.alive:
            os.kill(self.pid, sig)

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to its whole process group (its pool children, an embedded beat)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, sig)

    def pause(self, timeout: float = 10.0) -> None:
        """SIGSTOP the process (not its pool children); return once every thread is stopped.

        kill(2) only queues the signal: until the kernel has stopped each
        thread, the process may still act (renew, notice a write, ...).
        """
        self.signal(signal.SIGSTOP)
        self._wait_state(stopped=True, timeout=timeout)

    def resume(self, timeout: float = 10.0) -> None:
        """SIGCONT; return once no thread is stopped any more."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGCONT)
        self._wait_state(stopped=False, timeout=timeout)

    def _wait_state(self, *, stopped: bool, timeout: float) -> None:
        states = wait_thread_states(self.pid, stopped=stopped, timeout=timeout)
        if states is not None:
            raise AssertionError(
                f"{self} did not {'stop' if stopped else 'continue'} within {timeout}s "
                f"(thread states {states})"
            )

    def terminate(self) -> None:
        """SIGTERM: Celery's warm shutdown (release leadership, finish tasks)."""
        self.signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the whole process tree at once: a crash of the host or container."""
        self.signal_group(signal.SIGKILL)
        self.proc.wait(10)

    def wait(self, timeout: float = 60.0) -> int:
        """Wait for it to exit; its exit status."""
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 30.0) -> int | None:
        """Graceful stop (SIGTERM, resumed first if paused), then SIGKILL of the group.

        Whatever is left of its process group afterwards (pool children, an
        embedded beat outliving its worker) is killed too.

        Returns:
            Its exit status.

        """
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)
            self.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self.signal_group(signal.SIGKILL)
        return self.proc.returncode
