"""Small network helpers shared by the driver and the trainer."""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Ray's workers take ports 10002-19999 by default; a rendezvous port stays above them.
_LOWEST_RENDEZVOUS_PORT = 20000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS picks it from its ephemeral range; a
    race with another process taking it before use is possible, as with any such probe)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def ephemeral_low(path: Path = _EPHEMERAL_RANGE) -> int | None:
    """The lowest port the OS hands out on its own (``bind(0)``, an outgoing connection);
    None where the range is unknown (not Linux)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def rendezvous_port(host: str = "127.0.0.1", attempts: int = 64, path: Path = _EPHEMERAL_RANGE) -> int:
    """A port free on ``host`` now, for a rendezvous that another process binds a moment
    later (torch's store, a weight-update group).

    Invariant: the port lies below the OS's ephemeral range (and above Ray's worker
    ports), so no port the OS assigns to a client socket or a ``bind(0)`` can take it in
    between; only an explicit bind of the same number could. Where that range is unknown
    or leaves no room, :func:`free_port`."""
    low = ephemeral_low(path)
    if low is None or low - 1 <= _LOWEST_RENDEZVOUS_PORT:
        return free_port(host)
    rng = random.SystemRandom()
    for _ in range(attempts):
        port = rng.randrange(_LOWEST_RENDEZVOUS_PORT, low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        return port
    return free_port(host)
