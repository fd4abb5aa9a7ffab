"""Who may push samples into the buffer: only processes that hold the run key
(``pipeline_rl.run_key``), checked by a ZAP handler on the buffer's context. How depends
on where the buffer binds (:func:`mechanism_for`; ``BufferServer(mechanism=...)`` forces one):

- **Loopback** (``127.0.0.0/8``, ``::1``, ``localhost``, ``ipc://``: a private local Ray,
  the default run): ZeroMQ PLAIN. Each producer presents a password derived from the run
  key (its own HMAC label); the ZAP handler compares it in constant time
  (``hmac.compare_digest``). Messages are not encrypted: traffic on the loopback
  interface cannot be read by another unprivileged user of the machine (reading it takes
  root or ``CAP_NET_RAW``, who could read the run's memory as well), and this costs
  nothing per message -- CURVE's per-message encryption cost 0.34-0.77x throughput on
  the buffer benchmark.
- **Any other address** (a cluster: the node's address or a wildcard): ZeroMQ CURVE with
  key pairs derived from the run key. The ZAP handler admits only the run's client key,
  and every message on an admitted connection is encrypted and authenticated.

A peer is refused at the handshake, before any message is read:

- a peer with another mechanism (plain ZeroMQ, or a CURVE client that does not know the
  server's key) fails the handshake in libzmq (the socket monitor says so but does not
  name the peer: the buffer counts it under ``handshake_failed``);
- a PLAIN client with a wrong password, or a CURVE client with another client key,
  reaches the ZAP handler, which refuses it (counted under ``unauthorized``) and logs it
  once per peer address.

ZAP (RFC 27) runs on this module's thread, on the server's own context
(``inproc://zeromq.zap.01``). The producer picks its mechanism from the address it
connects to by the same rule, so both ends agree without anything else travelling.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import zmq
from zmq.utils import z85

from pipeline_rl.run_key import Purpose, RunKey

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = "pipeline_rl"
_POLL_MS = 100
PLAIN_USERNAME = b"pipeline_rl"

#: How producers prove the run key: ``"plain"`` (loopback) or ``"curve"`` (network).
Mechanism = Literal["plain", "curve"]


def is_local(address: str) -> bool:
    """True for an ``ipc://`` address or a TCP address on a loopback host."""
    if address.startswith("ipc://"):
        return True
    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def mechanism_for(address: str) -> Mechanism:
    """The mechanism for a buffer bound at (or a producer connecting to) ``address``:
    PLAIN on loopback, CURVE anywhere else (module docstring)."""
    return "plain" if is_local(address) else "curve"


@dataclass(frozen=True, slots=True)
class CurvePair:
    """One CURVE key pair, Z85-encoded as libzmq takes it. ``repr`` hides the secret half."""

    public: bytes
    secret: bytes = field(repr=False)


def _pair(key: RunKey, purpose: Purpose) -> CurvePair:
    secret = z85.encode(key.derive(purpose))
    return CurvePair(zmq.curve_public(secret), secret)


def server_pair(key: RunKey) -> CurvePair:
    """The buffer's CURVE key pair for this run."""
    return _pair(key, Purpose.BUFFER_SERVER)


def client_pair(key: RunKey) -> CurvePair:
    """The rollout workers' CURVE key pair for this run (one for all: each holds the run key)."""
    return _pair(key, Purpose.BUFFER_CLIENT)


def plain_password(key: RunKey) -> bytes:
    """The producers' PLAIN password for this run (Z85 of an HMAC of the run key)."""
    return z85.encode(key.derive(Purpose.BUFFER_PLAIN))


def make_server(sock: zmq.Socket[bytes], key: RunKey, mechanism: Mechanism) -> None:
    """Make ``sock`` (before it binds) a PLAIN or CURVE server for the run, asking ZAP."""
    if mechanism == "plain":
        sock.plain_server = True
    else:
        pair = server_pair(key)
        sock.curve_server = True
        sock.curve_secretkey = pair.secret
        sock.curve_publickey = pair.public
    sock.zap_domain = ZAP_DOMAIN.encode()


def make_client(sock: zmq.Socket[bytes], key: RunKey, mechanism: Mechanism) -> None:
    """Make ``sock`` (before it connects) a PLAIN or CURVE client of the run's buffer."""
    if mechanism == "plain":
        sock.plain_username = PLAIN_USERNAME
        sock.plain_password = plain_password(key)
        return
    pair = client_pair(key)
    sock.curve_serverkey = server_pair(key).public
    sock.curve_publickey = pair.public
    sock.curve_secretkey = pair.secret


class ZapHandler:
    """Answers libzmq's ZAP requests for one context on a daemon thread until :meth:`close`:
    with ``mechanism`` PLAIN, a client whose password is the run's (constant-time compare);
    with CURVE, a client whose public key is the run's client key; anything else is
    refused; ``refused(address)`` is called for each refusal (the buffer counts it), and
    each peer address is logged once. Bind it before the server socket binds."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], key: RunKey,
                 refused: Callable[[str], None], mechanism: Mechanism = "curve") -> None:
        self._mechanism = mechanism.upper().encode()
        self._allowed = (plain_password(key) if mechanism == "plain"
                         else z85.decode(client_pair(key).public))
        self._refused = refused
        self._logged: set[str] = set()
        self._stop = threading.Event()
        self._sock = ctx.socket(zmq.REP)
        self._sock.linger = 0
        self._sock.bind(ZAP_ENDPOINT)
        self._thread = threading.Thread(target=self._run, name="buffer-zap", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(_POLL_MS):
                continue
            frames = self._sock.recv_multipart()
            self._sock.send_multipart(self._answer(frames))

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        """The reply to one ZAP request (``1.0``, id, domain, address, identity,
        mechanism, credentials...)."""
        if len(frames) < 6:
            return [b"1.0", frames[1] if len(frames) > 1 else b"", b"500", b"malformed", b"", b""]
        request_id, address, mechanism = frames[1], frames[3].decode(errors="replace"), frames[5]
        if mechanism == self._mechanism and self._admits(frames[6:]):
            return [b"1.0", request_id, b"200", b"OK", b"run", b""]
        self._refused(address)
        if address not in self._logged:
            self._logged.add(address)
            log.warning("buffer: refused a producer at %s: it does not hold this run's key "
                        "(%s client); further refusals of this address are only counted",
                        address, mechanism.decode(errors="replace"))
        return [b"1.0", request_id, b"400", b"not a member of this run", b"", b""]

    def _admits(self, credentials: list[bytes]) -> bool:
        """PLAIN: (username, password); CURVE: (client public key). Constant time."""
        if not credentials:
            return False
        given = credentials[-1] if self._mechanism == b"PLAIN" else credentials[0]
        return hmac.compare_digest(given, self._allowed)

    def close(self) -> None:
        """Stop the thread (joined) and close its socket. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        self._sock.close(0)
