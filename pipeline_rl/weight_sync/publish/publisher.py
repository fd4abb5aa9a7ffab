"""Weight publishing: trainer parameters -> :class:`WeightUpdate` -> every rollout worker.

Two halves with different costs:

1. ``pipeline_rl.weight_sync.publish.gather`` (on the training thread, must finish before the next
   optimizer step changes the parameters): copies the full parameters out once, in the served
   dtype. Under ZeRO-3 a collective: every rank calls it. This copy is the only part of
   publishing on the critical path.
2. :class:`WeightPublisher` (off the critical path): a background thread sends the update to
   every worker through vLLM's weight-transfer API, one channel per worker on its path
   (``pipeline_rl.weight_sync.channels.channel``: what the publisher knows of a path is its row of
   ``channel.PATHS``), opened on first use and sent to in parallel; a worker's four calls go
   to its Ray actor (or to the object itself in one process). One path goes through Ray's
   object store, for workers that cannot open a connection to the trainer.

Only the newest version matters: a worker applies the newest update it holds, so when the
publisher falls behind (publishing slower than training) it skips superseded versions instead
of queueing them; skipped versions are counted. A failed offer (e.g. a dead worker) is counted
and logged, never raised into the training loop: the driver supervises and restarts workers,
and :meth:`WeightPublisher.set_workers` hands the newest weights to the new ones at once.
The run key's rendezvous secret (``secret``) is proved to every worker whose path joins a
group (``rendezvous_auth``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from pipeline_rl.weight_sync.channels.channel import TrainerChannel, open_channel, traits
from pipeline_rl.weight_sync.channels.cuda_ipc import to_host
from pipeline_rl.weight_sync.publish.clients import UNKNOWN_NODE, ActorClient, placement_of, trainer_address
from pipeline_rl.weight_sync.message import WeightUpdate
from pipeline_rl.weight_sync.channels.paths import (
    GPU_PATHS,
    Placement,
    choose_path,
    local_placement,
)
from pipeline_rl.weight_sync.channels.path_table import PathName, WeightPath
from pipeline_rl.weight_sync.protocol import OpenContext, SendTiming, SyncClient
from pipeline_rl.weight_sync.channels.shm import ShmSpaceError, new_shared_buffer, shm_fits

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PublishStats:
    """Counters and cumulative seconds of one publisher.

    ``published``: versions offered to the workers; ``superseded``: versions skipped because a
    newer one arrived before they were sent; ``offer_failures``: sends that failed (dead worker);
    ``put_s``: seconds in ``ray.put`` (the object-store path's serialisation); ``offer_s``:
    seconds sending, until every worker finished;
    ``caller_block_s``: seconds :meth:`WeightPublisher.publish` blocked its caller (the
    training thread); ``published_at``: wall-clock time (``time.time()``) each of the last
    versions was handed to :meth:`WeightPublisher.publish`, as (version, time) pairs.
    """

    published: int
    superseded: int
    offer_failures: int
    last_version: int
    put_s: float
    offer_s: float
    caller_block_s: float
    bytes_published: int
    published_at: tuple[tuple[int, float], ...] = ()


def _is_ray_actor(worker: object) -> bool:
    try:
        from ray.actor import ActorHandle
    except ImportError:  # pragma: no cover - ray is a dependency
        return False
    return isinstance(worker, ActorHandle)


def _label(worker: object) -> str:
    """A worker in a log line (a Ray handle's repr names its class and actor id)."""
    return repr(worker)


PUBLISHED_AT_KEPT = 1024  # versions whose publish time the stats keep


class WeightPublisher:
    """Sends each new :class:`WeightUpdate` to every rollout worker, newest version first.

    ``background=True`` (the default) does the transport on a daemon thread, so
    :meth:`publish` only hands over a reference and returns; ``background=False`` publishes
    inline (deterministic, for tests and one-process tools). Thread-safe. A worker whose
    send failed loses its channel and gets a new one, and the newest weights, at the next
    publish (a worker that missed versions re-syncs to the latest, never to a backlog).
    ``secret``: the run key's rendezvous secret (``run_key.rendezvous_secret``).
    """

    def __init__(self, workers: Iterable[object] = (), *, background: bool = True,
                 path: WeightPath = "auto", secret: bytes = b"") -> None:
        self.path: WeightPath = path
        # The path each worker got. Workers are keys as they are: a Ray actor handle hashes and
        # compares by its actor id, so a restarted actor keeps its entry and its channel.
        self.paths: dict[Hashable, PathName] = {}
        self._channels: dict[Hashable, TrainerChannel] = {}
        self._host_copy: WeightUpdate | None = None   # a GPU-gathered version, for byte paths
        self._shared: dict[str, Any] = {}          # per path: what its channels share (PathTraits.shared)
        self._secret = secret
        self._placement: Placement | None = None
        self._last_bytes = 0                       # the size of the last update sent
        self._senders: ThreadPoolExecutor | None = None
        self._published_at: list[tuple[int, float]] = []
        self.send_timings: list[SendTiming] = []   # per worker and version
        self._workers: list[object] = list(workers)
        self._background = background
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        # One send at a time (a version never overtakes another on its way to a worker), and
        # the newest version each worker was sent (set_workers sends nothing older or twice).
        self._sending = threading.Lock()
        self._sent: dict[Hashable, int] = {}
        self._next: WeightUpdate | None = None   # newest update not yet sent
        self._latest: WeightUpdate | None = None
        self._busy = False
        self._closed = False
        self._published = self._superseded = self._failures = self._bytes = 0
        self._last_version = -1
        self._sending_version = -1                 # version the background thread is sending
        self._offer_s = self._block_s = 0.0
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, name="weight-publisher", daemon=True)
            self._thread.start()

    # -- API ---------------------------------------------------------------------------------

    def publish(self, update: WeightUpdate) -> float:
        """Hand ``update`` to the workers (in the background by default); returns the seconds the
        caller was blocked. Idempotent for the newest version (a repeat is ignored); an older
        version raises ValueError."""
        t0 = time.perf_counter()
        wall = time.time()
        with self._wake:
            if self._closed:
                raise RuntimeError("WeightPublisher: publish() after close()")
            newest = max(self._last_version, self._sending_version,
                         self._next.version if self._next is not None else -1)
            if update.version == newest:
                return 0.0
            if update.version < newest:
                raise ValueError(f"WeightPublisher: version {update.version} is older than "
                                 f"{newest}, the newest one published")
            self._published_at.append((update.version, wall))
            del self._published_at[:-PUBLISHED_AT_KEPT]
            if self._background:
                if self._next is not None:
                    self._superseded += 1
                self._next = update
                self._wake.notify_all()
        if not self._background:
            self._send(update)
        blocked = time.perf_counter() - t0
        with self._lock:
            self._block_s += blocked
        return blocked

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until every handed-over update has been offered; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._wake:
            while self._next is not None or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._wake.wait(left)
        return True

    def set_workers(self, workers: Sequence[object]) -> list[str]:
        """Replace the worker list; workers not seen before get the newest weights at once.
        Returns the path each worker gets, in order (the run's start-up line shows them)."""
        with self._lock:
            new = [w for w in workers if all(w is not old for old in self._workers)]
            self._workers = list(workers)
            keep = set(workers)
            gone = [self._channels.pop(k) for k in list(self._channels) if k not in keep]
            for k in [k for k in self._sent if k not in keep]:
                del self._sent[k]
        for channel in gone:
            channel.close()
        paths: list[str] = [self._path_of(w) for w in workers]
        with self._sending:   # a version on its way now reaches the new workers too (``_send``)
            with self._lock:
                latest = self._latest
                behind = [w for w in new if latest is not None and self._sent.get(w, -1) < latest.version]
            if latest is not None and behind:
                self._send_all(behind, latest, reconnect=False)
        return paths

    def offer_latest(self, workers: Sequence[object]) -> None:
        """Offer the newest published weights to ``workers`` now (e.g. a restarted worker
        behind an unchanged handle: its channel is opened anew)."""
        with self._sending:
            with self._lock:
                latest = self._latest
            if latest is not None:
                self._send_all(list(workers), latest, reconnect=True)

    def on_device(self) -> bool:
        """Whether ``gather_weights`` should keep the next version on the GPU: some worker's
        path moves device tensors (ipc, nccl), or, from a trainer on a GPU, some worker's
        path sends the GPU copy as it is (shm: its writer copies the version into the
        segment, ``host_gpu``); others get a host copy."""
        rows = [traits(p) for p in set(self.paths.values())]
        on_gpu = self._placement is not None and self._placement.device == "cuda"
        return any(t.device_tensors or (on_gpu and t.sends_gpu_copy) for t in rows)

    def allocator(self) -> Callable[[int], np.ndarray] | None:
        """Where ``gather_weights`` should put the next version: shared memory once some
        worker's path hands the gathered segment on as it is (shm), else None (ordinary
        memory)."""
        into_segment = any(traits(p).gathers_into_segment for p in set(self.paths.values()))
        if not into_segment or not shm_fits(self._last_bytes) or self.on_device():
            return None
        return new_shared_buffer

    def stats(self) -> PublishStats:
        with self._lock:
            put_s = sum(getattr(shared, "put_s", 0.0) for shared in self._shared.values())
            return PublishStats(published=self._published, superseded=self._superseded,
                                offer_failures=self._failures, last_version=self._last_version,
                                put_s=put_s, offer_s=self._offer_s,
                                caller_block_s=self._block_s, bytes_published=self._bytes,
                                published_at=tuple(self._published_at))

    def close(self, timeout_s: float = 30.0) -> None:
        """Send what is pending, then stop the background thread."""
        if self._thread is not None:
            self.flush(timeout_s)
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
        for channel in list(self._channels.values()):
            channel.close()
        self._channels.clear()
        for shared in self._shared.values():
            shared.close()
        if self._senders is not None:
            self._senders.shutdown(wait=False, cancel_futures=True)

    # -- internals ---------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._wake:
                while self._next is None and not self._closed:
                    self._wake.wait()
                if self._next is None:
                    return
                update, self._next = self._next, None
                self._busy = True
                self._sending_version = update.version
            try:
                self._send(update)
            except Exception:  # never kill the thread: log and go on with the next version
                log.exception("weight publisher: sending version %d failed", update.version)
            finally:
                with self._wake:
                    self._busy = False
                    self._wake.notify_all()

    def _send(self, update: WeightUpdate) -> None:
        """Send ``update`` to every worker, those :meth:`set_workers` adds meanwhile included:
        they were handed the version before this one, and without this one they would wait
        for it forever (the trainer waits for their groups; found by the chaos run, a standby
        taking over while a version was on its way)."""
        with self._sending:
            done: list[object] = []
            while True:
                with self._lock:
                    todo = [w for w in self._workers if all(w is not d for d in done)]
                    if not todo:
                        self._published += 1
                        self._bytes += update.num_bytes
                        self._last_bytes = update.num_bytes
                        self._last_version = update.version
                        self._latest = update
                        return
                self._send_all(todo, update, reconnect=False)
                done += todo

    def _send_all(self, workers: Sequence[object], update: WeightUpdate, reconnect: bool) -> None:
        """Send ``update`` to every worker through its channel, in parallel; a failed
        worker's channel is closed (the next send opens a new one) and counted."""
        if not workers:
            return
        t0 = time.perf_counter()
        if self._senders is None:
            self._senders = ThreadPoolExecutor(max_workers=8, thread_name_prefix="weights-send")
        futures = [self._senders.submit(self._send_one, w, update, reconnect) for w in workers]
        timings = [f.result() for f in futures]
        with self._lock:
            self._offer_s += time.perf_counter() - t0
            self.send_timings.extend(t for t in timings if t is not None)
            del self.send_timings[:-PUBLISHED_AT_KEPT]

    def _send_one(self, worker: object, update: WeightUpdate, reconnect: bool) -> SendTiming | None:
        channel = self._channels.pop(worker, None)
        try:
            if channel is not None and reconnect:
                channel.close()
                channel = None
            if channel is None:
                channel = self._open(worker)
            timing = channel.send(update if traits(channel.path).sends_gpu_copy else self._host(update))
            self._channels[worker] = channel
            with self._lock:
                self._sent[worker] = max(update.version, self._sent.get(worker, -1))
            return timing
        except ShmSpaceError as e:
            fallback = traits(self._path_of(worker)).fallback
            if self.path != "auto" or fallback is None:
                raise
            log.warning("weights: %s; worker %s takes the %s path instead", e, _label(worker), fallback)
            self.paths[worker] = fallback   # type: ignore[assignment]   # a name from channel.PATHS
            return self._send_one(worker, update, reconnect)
        except Exception as e:
            from pipeline_rl.calls import first_line

            log.warning("weight publisher: sending version %d failed: %s", update.version, first_line(e))
            if channel is not None:
                channel.close()
            with self._lock:
                self._failures += 1
            return None

    def _host(self, update: WeightUpdate) -> WeightUpdate:
        """``update`` in host memory (one copy per version, shared by the workers)."""
        if update.device is None:
            return update
        with self._lock:
            cached = self._host_copy
            if cached is None or cached.version != update.version:
                cached = self._host_copy = to_host(update)
        return cached

    def _path_of(self, worker: Hashable) -> PathName:
        """The path ``worker`` gets (asked once per worker; logged when first chosen)."""
        path = self.paths.get(worker)
        if path is None:
            if self._placement is None:
                self._placement = local_placement()
            where = placement_of(self._client(worker))
            path = choose_path(self._placement, where, self.path, GPU_PATHS)
            if where.node_id == UNKNOWN_NODE:
                return path   # asked again at its next channel
            log.info("weights: worker %s gets the %s path (%s%s)", _label(worker), path, traits(path).reason,
                     ", forced" if self.path != "auto" else "")
            self.paths[worker] = path
        return path

    @staticmethod
    def _client(worker: object) -> SyncClient:
        return ActorClient(worker) if _is_ray_actor(worker) else worker  # type: ignore[return-value]

    def _open(self, worker: Hashable) -> TrainerChannel:
        """A new channel to ``worker`` on its path (``weight_sync.channels.channel``)."""
        path, client = self._path_of(worker), self._client(worker)
        row = traits(path)
        address = trainer_address() if row.address == "node" else "127.0.0.1"
        with self._lock:
            shared = self._shared.get(path)
            if shared is None and row.shared is not None:
                shared = self._shared[path] = row.shared()
        return open_channel(path, client, OpenContext(address=address, shared=shared, secret=self._secret))
