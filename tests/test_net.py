"""The rendezvous port lies where no OS-assigned port can take it before the bind."""

from __future__ import annotations

import socket
from pathlib import Path

from pipeline_rl.net import ephemeral_low, rendezvous_port


def test_a_rendezvous_port_is_below_the_ephemeral_range_and_bindable(tmp_path: Path) -> None:
    """A race on the run's rendezvous port (a client socket handed the probed port before
    torch's store bound it) once failed a start-up with EADDRINUSE; the port now comes from
    below the ephemeral range, which the OS never hands out on its own."""
    ranges = tmp_path / "range"
    ranges.write_text("32768\t60999\n")
    for _ in range(20):
        port = rendezvous_port(path=ranges)
        assert 20000 <= port < 32768
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_an_unknown_or_narrow_range_falls_back_to_the_os(tmp_path: Path) -> None:
    assert ephemeral_low(tmp_path / "missing") is None
    assert rendezvous_port(path=tmp_path / "missing") > 0
    narrow = tmp_path / "narrow"
    narrow.write_text("1024 65535\n")
    assert rendezvous_port(path=narrow) > 0
