"""Typed messages and errors shared by the replay buffer and its ZeroMQ link.

Everything that leaves ``pipeline_rl.buffer`` (to a rollout worker, a trainer
rank, or the driver's logger) is one of the frozen dataclasses below; no dicts
or tuples as interfaces.
"""

from __future__ import annotations

import functools
import os
import re
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# A tcp endpoint: ``tcp://HOST:PORT`` with HOST a name, an IPv4 address, ``*``
# (bind only) or a bracketed IPv6 address; PORT 0-65535 or ``*`` (bind only).
_TCP = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+|\*):(\d{1,5}|\*)$")
_IPC_MAX_PATH = 107  # sockaddr_un.sun_path on Linux, minus the terminating NUL


class TransportError(Exception):
    """Base of the errors raised by the buffer's ZeroMQ link."""


class BackpressureTimeout(TransportError, TimeoutError):
    """A producer waited ``send_timeout_s`` for a full buffer to take a group.

    Raised instead of blocking forever; nothing was sent, so the group may be
    retried. Persistent backpressure means the trainer has stalled or died."""


class BufferUnreachable(TransportError, ConnectionError):
    """No buffer answered at the address (never connected, or the connection was
    lost and did not come back within the wait)."""


def check_address(address: str, *, bind: bool) -> str:
    """Return ``address`` if it is ``tcp://HOST:PORT`` or ``ipc://PATH``; raise a
    one-line ``ValueError`` otherwise. Wildcards (``*``) are accepted only for bind."""
    if not isinstance(address, str):
        raise ValueError(f"buffer address must be a string, got {type(address).__name__}")
    if address.startswith("ipc://"):
        path = address[len("ipc://"):]
        if not path or len(path.encode()) > _IPC_MAX_PATH:
            raise ValueError(f"buffer address {address!r}: ipc path must be 1..{_IPC_MAX_PATH} bytes")
        return address
    match = _TCP.match(address)
    if match is None:
        raise ValueError(f"buffer address {address!r} is not tcp://HOST:PORT or ipc://PATH")
    host, port = match.groups()
    if not bind and ("*" in (host, port) or int(port) == 0):
        raise ValueError(f"buffer address {address!r}: a producer needs a concrete host and port")
    if port != "*" and int(port) > 65535:
        raise ValueError(f"buffer address {address!r}: port {port} is out of range")
    return address


@dataclass(frozen=True, slots=True)
class Admission:
    """The answer to a rollout worker's request to start new groups.

    ``granted``: how many groups the worker may start now (0..max_groups); the
    admission budget is global across workers (docs/design.md section 2).
    ``version``: the latest trainer version the buffer knows.
    ``min_version``: the oldest weights version the worker may generate these
    groups with and still have them pass ``--staleness`` when trained
    (``<= version``; equals ``version`` under ``--staleness 0``). A worker holding
    older weights should wait for newer weights before starting them, or they
    are likely to be evicted.
    """

    granted: int
    version: int
    min_version: int = 0


@dataclass(frozen=True, slots=True)
class ProcessId:
    """A process as the admission knows the one asking (``ReplayBuffer.acquire``'s
    ``requester``). A pid alone is not one: the kernel reuses pids, and another node has the
    same ones. So it is the ``node`` (Ray's node id inside Ray, else the host name), the
    ``pid`` and ``started``, the process's start (clock ticks after boot, ``/proc/<pid>/stat``
    field 22; without ``/proc``, the time it first named itself), compared only among ids of
    one node. Two processes never share all three. :meth:`current` builds it once per process;
    it pickles (it crosses Ray calls)."""

    node: str
    pid: int
    started: float

    @staticmethod
    def current() -> ProcessId:
        """This process's id (built at its first call in each process, a forked child included)."""
        return _process_id(os.getpid())


@functools.lru_cache(maxsize=4)
def _process_id(pid: int) -> ProcessId:
    return ProcessId(_node(), pid, _start_time(pid))


def _start_time(pid: int) -> float:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return time.time()   # called once per process (cached), so still one value per process
    # Field 2, the command, may hold spaces and parentheses: fields 3.. follow its last ")".
    return float(stat[stat.rindex(")") + 1:].split()[22 - 3])


def _node() -> str:
    """Ray's node id in a process of a Ray job (Ray not imported here: not one), else the host name."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return str(ray.get_runtime_context().get_node_id())
    return socket.gethostname()


@dataclass(frozen=True, slots=True)
class AdmissionStats:
    """The admission budget: ``used <= limit`` holds whenever a grant is made,
    with ``used = accepted - evicted + outstanding`` and
    ``limit = (staleness + version + 1) * groups_per_step``."""

    version: int
    limit: int
    used: int
    granted: int
    outstanding: int
    lost: int
    unadmitted: int


@dataclass(frozen=True, slots=True)
class BufferStats:
    """A snapshot of the replay buffer and its receiver, for the driver's logs.

    ``groups_in``: groups accepted into the buffer; ``groups_out``: handed to
    trainer ranks; ``evicted``: dropped at hand-out, by reason (``stale``: lag
    above ``--staleness``); ``rejected``: messages refused by the receiver, by
    reason (wire-format reasons from ``pipeline_rl.wire`` plus ``multipart``,
    ``handshake_failed``, ``unauthorized``: a CURVE producer without the run key); ``fill``/``capacity``: groups stored now / at most;
    ``full_wait_s``: seconds the receiver stopped reading because the buffer
    was full (producers were blocked by backpressure meanwhile);
    ``consumer_wait_s``: seconds trainer ranks waited in ``get_batch``, of which
    ``straggler_wait_s`` waiting for a group due at the step being assembled
    (``straggler_timeouts``: steps assembled without it after the wait ran out);
    ``lag_histogram``: lag -> count over groups handed out; ``bytes_in``:
    message bytes accepted; ``connections``/``disconnections``: producer
    connection events seen by the receiver; ``zero_variance``: groups dropped on arrival
    because their rewards were all equal (``--algorithm.skip_zero_variance``; never in
    ``groups_in``).
    Invariant: ``groups_in == groups_out + sum(evicted.values()) + fill``
    (plus groups held for a multi-rank step not yet collected: ``held``).
    """

    groups_in: int
    groups_out: int
    evicted: dict[str, int]
    rejected: dict[str, int]
    fill: int
    held: int
    capacity: int
    full_wait_s: float
    consumer_wait_s: float
    lag_histogram: dict[int, int]
    bytes_in: int
    straggler_wait_s: float
    straggler_timeouts: int
    connections: int
    disconnections: int
    admission: AdmissionStats
    zero_variance: int = 0

    def as_dict(self) -> dict[str, float]:
        """Flat scalar metrics for a logger (histograms as ``lag/<k>`` keys)."""
        out: dict[str, float] = {
            "groups_in": self.groups_in, "groups_out": self.groups_out, "fill": self.fill,
            "held": self.held, "capacity": self.capacity, "full_wait_s": self.full_wait_s,
            "consumer_wait_s": self.consumer_wait_s, "bytes_in": self.bytes_in,
            "straggler_wait_s": self.straggler_wait_s, "straggler_timeouts": self.straggler_timeouts,
            "connections": self.connections, "disconnections": self.disconnections,
            "zero_variance": self.zero_variance, "evicted": sum(self.evicted.values()), "rejected": sum(self.rejected.values()),
        }
        out.update({f"evicted/{k}": v for k, v in self.evicted.items()})
        out.update({f"rejected/{k}": v for k, v in self.rejected.items()})
        out.update({f"lag/{k}": v for k, v in sorted(self.lag_histogram.items())})
        adm = self.admission
        out.update({"admission/version": adm.version, "admission/limit": adm.limit,
                    "admission/used": adm.used, "admission/lost": adm.lost,
                    "admission/unadmitted": adm.unadmitted})
        return out


@dataclass(slots=True)
class _Counters:
    """Mutable counters behind :class:`BufferStats` (guarded by the buffer's lock)."""

    groups_in: int = 0
    groups_out: int = 0
    bytes_in: int = 0
    full_wait_s: float = 0.0
    consumer_wait_s: float = 0.0
    straggler_wait_s: float = 0.0
    straggler_timeouts: int = 0
    connections: int = 0
    disconnections: int = 0
    zero_variance: int = 0
    evicted: dict[str, int] = field(default_factory=dict)
    rejected: dict[str, int] = field(default_factory=dict)
    lag_histogram: dict[int, int] = field(default_factory=dict)
