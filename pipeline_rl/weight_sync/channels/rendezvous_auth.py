"""Proof of the run key at a weight channel's rendezvous, before any weight moves.

The gloo and nccl channels' rendezvous is a ``torch.distributed.TCPStore`` the trainer
serves on an open port (``pipeline_rl.weight_sync.channels.gloo``; vLLM's ``StatelessProcessGroup``
for nccl). A store answers anyone who connects,
and lists its keys to them (``TCPStore.list_keys``), so neither the port nor a
secret-looking key prefix keeps a foreign process out: it can read the trainer's gloo
address and join the two-member group in the worker's place (to take the weights), or
in the trainer's (to feed the worker its own). What keeps it out is this exchange, run
on the group's own connection the moment the group is formed, before its first byte of
weights:

1. the trainer (rank 0) sends a fresh 32-byte challenge ``c_t``;
2. the worker (rank 1) answers ``c_w`` (its own fresh challenge), ``HMAC(K, "worker" | c_t | c_w)``
   and the host it says it runs on;
3. the trainer checks the answer and sends ``HMAC(K, "trainer" | c_w | c_t)`` (zeros
   when the check failed), which the worker checks in turn.

The exchange runs over any two-member group that can broadcast bytes from either rank
(:class:`ByteBroadcast`): the gloo process group, or vLLM's NCCL communicator (its
tensors on the GPU, ``vllm_adapter.nccl_broadcaster``).

``K`` (``secret``) is derived from the run key (``run_key.rendezvous_secret``), handed
to each end as an argument; the
challenges are fresh per channel, so an answer seen once is worth nothing later. A side
whose peer fails the check shuts the group down and raises :class:`RendezvousRefused`
(the channel is never used); the trainer counts each refusal (:func:`refusals`)
and logs it once per host the peer claims (gloo does not name the peer's address).
Outside a run (no key: tests, in-process benchmarks) both sides prove an empty secret,
which only a process outside any run also holds.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import socket
import threading
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger(__name__)

_NONCE = 32
_MAC = 32
_HOST = 64
_ANSWER = _NONCE + _MAC + _HOST

_lock = threading.Lock()
_refusals = 0
_logged: set[str] = set()


class RendezvousRefused(RuntimeError):
    """The other end of a weight channel could not prove it holds the run key."""


def refusals() -> int:
    """Weight-channel peers this process refused so far."""
    return _refusals


class ByteBroadcast(Protocol):
    """A two-member group's broadcast of ``size`` bytes from ``root`` (``data`` there,
    None on the other rank); returns the bytes on both."""

    def __call__(self, data: bytes | None, size: int, root: int) -> bytes: ...


def prove_membership(pg: Any, rank: int, secret: bytes) -> None:
    """Run the exchange (module docstring) on the formed two-member gloo group ``pg`` as
    ``rank`` (0: trainer, 1: worker); returns when both ends proved ``secret``, else
    raises :class:`RendezvousRefused` (or the group's own error if the peer stops
    answering) after shutting ``pg`` down."""
    prove_over(lambda data, size, root: _broadcast(pg, data, size, root), rank, secret, pg.shutdown)


def prove_over(broadcast: ByteBroadcast, rank: int, secret: bytes, close: Callable[[], Any]) -> None:
    """The exchange over any two-member group (``broadcast``); ``close`` shuts the group
    down when it fails."""
    try:
        if rank == 0:
            _as_trainer(broadcast, secret)
        else:
            _as_worker(broadcast, secret)
    except BaseException:
        try:
            close()
        except Exception:  # noqa: BLE001 - best effort: the peer may be gone
            pass
        raise


def _mac(secret: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, role + first + second, hashlib.sha256).digest()


def _as_trainer(broadcast: ByteBroadcast, secret: bytes) -> None:
    challenge = secrets.token_bytes(_NONCE)
    broadcast(challenge, _NONCE, 0)
    answer = broadcast(None, _ANSWER, 1)
    theirs, mac, host = answer[:_NONCE], answer[_NONCE:_NONCE + _MAC], answer[_NONCE + _MAC:]
    ok = hmac.compare_digest(mac, _mac(secret, b"worker", challenge, theirs))
    broadcast(_mac(secret, b"trainer", theirs, challenge) if ok else bytes(_MAC), _MAC, 0)
    if not ok:
        claimed = host.rstrip(b"\0").decode(errors="replace") or "?"
        _refused(claimed)
        raise RendezvousRefused(f"weight channel: refused a peer (says it is {claimed}): it does not "
                                "hold this run's key; no weights were sent")


def _as_worker(broadcast: ByteBroadcast, secret: bytes) -> None:
    challenge = broadcast(None, _NONCE, 0)
    mine = secrets.token_bytes(_NONCE)
    host = socket.gethostname().encode()[:_HOST].ljust(_HOST, b"\0")
    broadcast(mine + _mac(secret, b"worker", challenge, mine) + host, _ANSWER, 1)
    mac = broadcast(None, _MAC, 0)
    if not hmac.compare_digest(mac, _mac(secret, b"trainer", mine, challenge)):
        raise RendezvousRefused("weight channel: the trainer's end did not prove it holds this run's "
                                "key (another run's trainer, a foreign process, or it refused this "
                                "worker); nothing was received")


def _refused(claimed: str) -> None:
    global _refusals
    with _lock:
        _refusals += 1
        first = claimed not in _logged
        _logged.add(claimed)
    if first:
        log.warning("weight channel: refused a peer that says it is %s: it does not hold this run's "
                    "key (%d refusal(s) so far; this host is logged once)", claimed, _refusals)


def _broadcast(pg: Any, data: bytes | None, size: int, root: int) -> bytes:
    """Broadcast ``size`` bytes from ``root`` (``data`` there, None elsewhere); the bytes."""
    import torch
    import torch.distributed as dist

    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data is not None
           else torch.zeros(size, dtype=torch.uint8))
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    pg.broadcast([buf], opts).wait()
    return bytes(buf.numpy().tobytes())
