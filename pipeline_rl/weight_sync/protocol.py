"""The weight-update protocol, declared once: vLLM's four calls as a rollout worker and
its engine serve them, and what the trainer calls on a worker (:class:`SyncClient`: the
channel's join and the one-call form of an update).

A weight update crosses four files a reader opens: the channel (``channels/<path>.py``:
``client.receive_update``), the worker (``rollout/worker.py``: ``RolloutWorker``'s weight
calls), the engine (``rollout/engines/engine_inprocess.py`` or ``async_weight_updates.py``) and the
backend (``receive/receiver.py``, inside vLLM ``receive/vllm_backend.py``). A worker in
another process is reached through its Ray actor, which writes no call of its own: the
trainer's :class:`~pipeline_rl.weight_sync.publish.clients.ActorClient` and the actor
(``actors/rollout_actor.py``) both expose exactly :data:`SYNC_CALLS`, the worker's own
methods, on the actor's one staging thread.

Every implementation takes ``finish_weight_update(weight_version)`` with the version as
the string vLLM's API carries (``None`` only where vLLM's own call has none).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Protocol


#: A transfer whose peer stops answering fails after this long (never hangs).
DEFAULT_TIMEOUT_S = 60.0
#: Bucket size on the wire (gloo, nccl): large enough that per-message overhead vanishes,
#: small enough that packing the next bucket overlaps sending this one.
DEFAULT_BUCKET_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class OpenContext:
    """What opening a channel may need (``weight_sync.channels.channel.open_channel``):
    ``address``, where workers reach this process (gloo, nccl); ``shared``, what the
    path's channels to every worker share, made once per publisher by the path's
    ``PathTraits.shared`` (the shm path's segment writer, the object-store path's
    one-put-per-version cache); ``secret``, the run key's rendezvous secret, proved to
    each worker before any weight moves (gloo, nccl; empty outside a run); the transfer
    timeout and the bucket size."""

    address: str = "127.0.0.1"
    shared: Any = None
    secret: bytes = field(default=b"", repr=False)
    timeout_s: float = DEFAULT_TIMEOUT_S
    bucket_bytes: int = DEFAULT_BUCKET_BYTES


class WeightSyncCalls(Protocol):
    """The four control calls of vLLM's weight-transfer API (``init_weight_transfer_engine``
    once per channel, then ``start_weight_update`` -> ``update_weights`` ->
    ``finish_weight_update`` per update)."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: dict[str, Any]) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


class SyncClient(Protocol):
    """One rollout worker as the trainer drives it (``RolloutWorker``; across processes
    its Ray actor, the same calls): join the path's channel (vLLM's
    ``init_weight_transfer_engine``), and ``receive_update`` -- start, update and finish of
    one update in a single call (one round trip to a remote worker instead of three),
    returning the seconds its finish took."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def receive_update(self, update_info: dict[str, Any], weight_version: str) -> float: ...


#: :class:`SyncClient`'s calls by name: what a worker's Ray actor exposes of its worker.
SYNC_CALLS: tuple[str, ...] = ("init_weight_transfer_engine", "receive_update")


def receive_in_one_call(worker: WeightSyncCalls, update_info: dict[str, Any],
                        weight_version: str) -> float:
    """``receive_update`` for a worker in this process: its three calls in order; the
    seconds the finish took."""
    worker.start_weight_update()
    worker.update_weights(update_info)
    t = time.perf_counter()
    worker.finish_weight_update(weight_version)
    return time.perf_counter() - t


@dataclass(frozen=True, slots=True)
class SendTiming:
    """Where one send's time went (seconds), as the trainer saw it: the transfer (bytes
    moved: gloo broadcast || receive, or the shared-memory write and the worker's
    check of it) and the worker's finish (staging or loading), which follows it in the
    same call. ``path``: the path the update took (its channel's ``path``)."""

    version: int
    transfer_s: float
    finish_s: float
    num_bytes: int
    path: str

    @property
    def total_s(self) -> float:
        return self.transfer_s + self.finish_s


class TaggedInfo(Protocol):
    """A path's message (an ``init_weight_transfer_engine`` or ``update_weights`` info):
    a dataclass whose class names its path (``PATH``)."""

    PATH: ClassVar[str]
    __dataclass_fields__: ClassVar[dict[str, Any]]


def tagged(info: TaggedInfo) -> dict[str, Any]:
    """The dict a path's info travels as through vLLM's calls: its fields (as they are,
    not copied: a Ray object reference stays one) and its path tag (``"path"``), which
    ``weight_sync.channels.channel.decode_update_info`` / ``decode_init_info`` read back -- the
    one place a message's path is decided."""
    return {**{f.name: getattr(info, f.name) for f in fields(info)}, "path": info.PATH}  # type: ignore[arg-type]
