"""The ``gloo`` path: weights to a worker on any machine, in buckets over TCP.

- **Channel**: one stateless two-member gloo group per (trainer, worker) pair: a
  ``TCPStore`` served by the trainer on a free port, the worker joins it
  (:func:`rendezvous`, the one function that sets the store up on either side).
  Per-worker channels keep a dead or restarted worker from blocking the others; a
  restarted worker gets a new channel and is sent the newest version (never a backlog).
  The two ends prove the run key to each other on the formed group before any weight
  moves (``pipeline_rl.weight_sync.channels.rendezvous_auth``: the store itself admits anyone).
- **Wire format** (:class:`GlooUpdateInfo`): version, names, dtypes and shapes travel
  in the ``update_weights`` call; the bytes follow as broadcasts from the trainer
  (rank 0) of contiguous *buckets* of at most ``bucket_bytes`` (a larger tensor is a
  bucket of its own), cut the same way on both sides by ``layout.bucket_plan``. The
  sender packs bucket ``i + 1`` while bucket ``i`` is on the wire (double buffering).
- **Checked before applied**: the worker receives into a reused buffer, checks each
  bucket for non-finite values as the next one arrives and validates the whole update
  against the served model; a bad update is still drained from the channel (the group
  stays aligned) and then refused with one-line ``WeightUpdateError``, the served
  weights untouched. Loading happens only in ``finish_weight_update``, so a failure
  half-way never leaves a half-loaded model that generation resumes on.

:class:`GlooTrainerChannel` is the trainer's end (``weight_sync.channels.channel.TrainerChannel``);
the worker's is ``receiver.Receiver``, in the vLLM worker's backend or, with ``AsyncLLM``, in the
rollout worker (which hands the bytes to its engine core in a segment).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from pipeline_rl.weight_sync.dtypes import all_finite
from pipeline_rl.weight_sync.layout import UpdateLayout, arrays_in, bucket_plan, contiguous_bytes
from pipeline_rl.weight_sync.message import WeightUpdate
from pipeline_rl.weight_sync.channels.rendezvous_auth import prove_membership
from pipeline_rl.weight_sync.protocol import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_TIMEOUT_S,
    OpenContext,
    SendTiming,
    SyncClient,
    tagged,
)
from pipeline_rl.calls import in_daemon_thread

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


# -- wire format -------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class GlooInitInfo:
    """Worker side of the handshake: where the trainer's store listens (the worker is
    rank 1 of the two-member group, the trainer rank 0)."""

    PATH: ClassVar[str] = "gloo"
    master_address: str
    master_port: int
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S


@dataclass(frozen=True, slots=True)
class GlooUpdateInfo(UpdateLayout):
    """``update_weights`` info of the gloo path: the update's layout; the bytes follow
    on the channel."""

    PATH: ClassVar[str] = "gloo"


def rendezvous(address: str, port: int, *, serve: bool, timeout_s: float) -> Any:
    """The ``TCPStore`` a channel's two members meet at: served by the trainer on
    ``address`` (``port`` 0: a free one, read back from ``store.port``), joined by the
    worker at ``address:port``. The one place the rendezvous is set up."""
    import torch.distributed as dist

    if serve:
        return dist.TCPStore(address, port, 2, is_master=True, timeout=timedelta(seconds=timeout_s),
                             wait_for_workers=False)
    return dist.TCPStore(address, port, 2, is_master=False, timeout=timedelta(seconds=timeout_s))


# -- the channel -------------------------------------------------------------------------
class Channel:
    """A two-member gloo group (trainer rank 0, worker rank 1) outside
    ``torch.distributed``'s global state (the trainer's DeepSpeed group is untouched)."""

    def __init__(self, store: Any, rank: int, timeout_s: float, secret: bytes) -> None:
        """``secret``: the run key's rendezvous secret (``run_key.rendezvous_secret``),
        proved to the other end before any weight moves."""
        import torch.distributed as dist

        self._store = store  # the trainer's server store must outlive the group
        timeout = timedelta(seconds=timeout_s)
        prefix = dist.PrefixStore("pipeline_rl_weights", store)
        self._pg: Any = dist.ProcessGroupGloo(prefix, rank, 2, timeout)
        self.rank = rank
        prove_membership(self._pg, rank, secret)   # before any weight moves (rendezvous_auth)

    @classmethod
    def serve(cls, address: str, timeout_s: float, secret: bytes) -> tuple["Channel.Pending", int]:
        """Trainer side: listen on a free port of ``address``; returns a pending channel
        (joined by :meth:`Pending.join` once the worker connects) and the port."""
        store = rendezvous(address, 0, serve=True, timeout_s=timeout_s)
        return cls.Pending(store, timeout_s, secret), int(store.port)

    @classmethod
    def connect(cls, info: GlooInitInfo, secret: bytes) -> "Channel":
        """Worker side: join the trainer's store."""
        store = rendezvous(info.master_address, info.master_port, serve=False, timeout_s=info.timeout_s)
        return cls(store, 1, info.timeout_s, secret)

    @dataclass
    class Pending:
        store: Any
        timeout_s: float
        secret: bytes = field(repr=False)

        def join(self) -> "Channel":
            return Channel(self.store, 0, self.timeout_s, self.secret)

    def broadcast(self, buffer: "torch.Tensor") -> Any:
        """Start broadcasting ``buffer`` from rank 0 (in place on rank 1); returns the work."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        return self._pg.broadcast([buffer], opts)

    def close(self) -> None:
        try:
            self._pg.shutdown()
        except Exception:  # noqa: BLE001 - best effort: the peer may be gone
            pass


def send_update(channel: Channel, info: UpdateLayout, arrays: Sequence[np.ndarray],
                bucket_bytes: int) -> None:
    """Trainer side: broadcast the arrays bucket by bucket. Arrays that already lie back
    to back (``gather_weights`` writes them so) go out as views of their buffer, no
    copy; otherwise the next bucket is packed while the previous one is on the wire
    (two buffers alive at most)."""
    import torch

    nbytes = info.nbytes()
    flat = contiguous_bytes(arrays)
    in_flight: Any = None
    offset = 0
    for bucket in bucket_plan(nbytes, bucket_bytes):
        size = sum(nbytes[i] for i in bucket)
        if flat is not None:
            data = flat[offset:offset + size]
        else:
            parts = [np.ascontiguousarray(arrays[i]).reshape(-1).view(np.uint8) for i in bucket]
            data = parts[0] if len(parts) == 1 else np.concatenate(parts)
        offset += size
        work = channel.broadcast(torch.from_numpy(data))
        if in_flight is not None:
            in_flight.wait()
        in_flight = work
    if in_flight is not None:
        in_flight.wait()


@dataclass(frozen=True, slots=True, eq=False)
class Received:
    """What :func:`receive_update` got: the update (arrays are views of the receive
    buffer) and the first parameter holding a NaN or infinity, if any."""

    update: WeightUpdate
    non_finite: str | None


def receive_update(channel: Channel, info: UpdateLayout, bucket_bytes: int,
                   into: np.ndarray | None = None) -> Received:
    """Worker side: receive every bucket straight into its place in one flat buffer
    (``into``, uint8 of at least the update's size, reused across updates -- a
    shared-memory segment where an engine in another process loads from it; else a new
    one) and cut it into the update's arrays (views, no further copy). Two buckets are
    posted at a time, so the previous one is checked for non-finite values while the
    next is on the wire; every bucket is drained whatever it holds (the channel stays
    aligned)."""
    import torch

    nbytes = info.nbytes()
    total = sum(nbytes)
    flat = into[:total] if into is not None else np.empty(total, dtype=np.uint8)
    arrays = arrays_in(flat, info)
    buckets = bucket_plan(nbytes, bucket_bytes)
    starts = np.concatenate([[0], np.cumsum(nbytes, dtype=np.int64)]) if nbytes else np.zeros(1, np.int64)
    non_finite: str | None = None

    def post(bucket: range) -> Any:
        lo, hi = int(starts[bucket.start]), int(starts[bucket.stop])
        return channel.broadcast(torch.from_numpy(flat[lo:hi]))

    pending = post(buckets[0]) if buckets else None
    for k, bucket in enumerate(buckets):
        assert pending is not None
        pending.wait()
        pending = post(buckets[k + 1]) if k + 1 < len(buckets) else None
        for i in bucket:
            if non_finite is None and not all_finite(arrays[i], info.dtype_names[i]):
                non_finite = info.names[i]
    update = WeightUpdate(info.version, tuple(info.names), tuple(arrays),
                          dtype=info.wire_dtype)  # type: ignore[arg-type]
    return Received(update, non_finite)


# -- trainer side ----------------------------------------------------------------------------

class GlooTrainerChannel:
    """The gloo path's :class:`~pipeline_rl.weight_sync.channels.channel.TrainerChannel` for one
    worker (rank 0 is the only sender; it drives the worker's calls through ``client``
    and broadcasts the bytes).

    ``send`` runs the worker's ``receive_update`` (start, then ``update_weights``, which
    blocks in the receive, then finish) on a helper thread while this thread
    broadcasts; an error on either side ends the send with that error, and the channel
    is then unusable (close it; a new ``open`` makes a fresh one)."""

    path = "gloo"

    def __init__(self, client: SyncClient, channel: Channel, bucket_bytes: int) -> None:
        self.client = client
        self._channel = channel
        self._bucket_bytes = bucket_bytes

    @classmethod
    def open(cls, client: SyncClient, context: OpenContext) -> "GlooTrainerChannel":
        """Serve a store, have the worker join it (its ``init_weight_transfer_engine``
        blocks until both sides are in), join it here."""
        pending, port = Channel.serve(context.address, context.timeout_s, context.secret)
        info = GlooInitInfo(context.address, port, context.bucket_bytes, context.timeout_s)
        worker = in_daemon_thread(client.init_weight_transfer_engine, tagged(info))
        joined = in_daemon_thread(pending.join)
        # A worker that fails to join (dead, refused) ends this at once instead of leaving
        # the trainer's side waiting out the store's timeout (its thread then times out alone).
        both: list[Future[Any]] = [worker, joined]
        wait(both, return_when=FIRST_EXCEPTION)
        worker.result()
        return cls(client, joined.result(), context.bucket_bytes)

    def send(self, update: WeightUpdate) -> SendTiming:
        """One full round in one worker call: start, update (receive || broadcast),
        finish(version)."""
        info = GlooUpdateInfo.of(update)
        t0 = time.perf_counter()
        future = in_daemon_thread(self.client.receive_update, tagged(info), str(update.version))
        try:
            send_update(self._channel, info, update.arrays, self._bucket_bytes)
        except BaseException:
            if future.done():
                future.result()  # the worker's error explains the broken channel
            raise
        finish_s = future.result()
        total = time.perf_counter() - t0
        return SendTiming(update.version, total - finish_s, finish_s, update.num_bytes, self.path)

    def close(self) -> None:
        self._channel.close()
