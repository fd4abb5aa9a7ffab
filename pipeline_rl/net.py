"""Small network helpers shared by the driver and the trainer."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS picks it; a race with another
    process taking it before use is possible, as with any such probe)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
