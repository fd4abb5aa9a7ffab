"""Weight publishing: trainer parameters -> :class:`WeightUpdate` -> every rollout worker.

Two halves with different costs:

1. :func:`gather_weights` (on the training thread, must finish before the next optimizer step
   changes the parameters): copies the full parameters into contiguous float32 numpy arrays.
   Under ZeRO-3 it gathers the partitioned parameters first, which is a collective: every rank
   must call it. This copy is the only part of publishing on the critical path.
2. :class:`WeightPublisher` (off the critical path): a background thread puts the update into
   Ray's object store once per version and offers the single ``ObjectRef`` to every worker
   (``worker.offer_weights.remote([ref])``: the ref is nested in a list so Ray does not resolve
   it before the call, and each worker fetches the bytes only when it applies the update).
   Workers that are plain Python objects (tests, one process) get ``offer_weights(update)``.

Only the newest version matters: a worker applies the newest update it holds, so when the
publisher falls behind (publishing slower than training) it skips superseded versions instead
of queueing them; skipped versions are counted. A failed offer (e.g. a dead worker) is counted
and logged, never raised into the training loop: the driver supervises and restarts workers,
and :meth:`WeightPublisher.set_workers` hands the newest weights to the new ones at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline_rl.actors.weights import WeightUpdate

log = logging.getLogger(__name__)


def gather_weights(module: Any, version: int, *, zero_stage: int) -> WeightUpdate:
    """Full parameters of ``module`` (the HF model inside the DeepSpeed engine) as float32 numpy.

    Names are ``named_parameters()`` names of the HF model (tied weights appear once), which
    are the names ``save_pretrained`` writes and vLLM's ``load_weights`` expects. Under ZeRO-3
    this is a collective (``deepspeed.zero.GatheredParameters``); every rank must call it.
    The arrays are copies: later optimizer steps do not change them.
    """
    import torch

    params = list(module.named_parameters())
    names: list[str] = []
    arrays: list[np.ndarray] = []
    if zero_stage == 3:
        import deepspeed

        ctx: Any = deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None)
    else:
        import contextlib

        ctx = contextlib.nullcontext()
    with ctx, torch.no_grad():
        for name, p in params:
            t = p.detach()
            if t.dtype != torch.float32:
                t = t.float()
            arr = t.to("cpu").numpy()
            # A float32 CPU tensor shares memory with .numpy(): copy so the update is a snapshot.
            arrays.append(np.array(arr, dtype=np.float32, order="C", copy=True))
            names.append(name)
    return WeightUpdate(version=version, names=tuple(names), arrays=tuple(arrays))


@dataclass(frozen=True, slots=True)
class PublishStats:
    """Counters and cumulative seconds of one publisher.

    ``published``: versions offered to the workers; ``superseded``: versions skipped because a
    newer one arrived before they were sent; ``offer_failures``: offers that raised (dead worker);
    ``put_s``: seconds in ``ray.put`` (serialisation into the object store); ``offer_s``: seconds
    issuing the offers; ``caller_block_s``: seconds :meth:`WeightPublisher.publish` blocked its
    caller (the training thread).
    """

    published: int
    superseded: int
    offer_failures: int
    last_version: int
    put_s: float
    offer_s: float
    caller_block_s: float
    bytes_published: int


def _is_ray_actor(worker: object) -> bool:
    try:
        from ray.actor import ActorHandle
    except ImportError:  # pragma: no cover - ray is a dependency
        return False
    return isinstance(worker, ActorHandle)


class WeightPublisher:
    """Sends each new :class:`WeightUpdate` to every rollout worker, newest version first.

    ``background=True`` (the default) does the transport on a daemon thread, so
    :meth:`publish` only hands over a reference and returns; ``background=False`` publishes
    inline (deterministic, for tests and one-process tools). Thread-safe.
    """

    def __init__(self, workers: Iterable[object] = (), *, background: bool = True,
                 max_pending_acks: int = 64) -> None:
        self._workers: list[object] = list(workers)
        self._background = background
        self._max_pending_acks = max_pending_acks
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._next: WeightUpdate | None = None   # newest update not yet sent
        self._latest_ref: Any = None             # ObjectRef of the newest sent update (Ray workers)
        self._latest: WeightUpdate | None = None
        self._pending_acks: list[Any] = []       # ObjectRefs of offer_weights calls, checked lazily
        self._busy = False
        self._closed = False
        self._published = self._superseded = self._failures = self._bytes = 0
        self._last_version = -1
        self._sending_version = -1                 # version the background thread is sending
        self._put_s = self._offer_s = self._block_s = 0.0
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

    def set_workers(self, workers: Sequence[object]) -> None:
        """Replace the worker list; workers not seen before get the newest weights at once."""
        with self._lock:
            new = [w for w in workers if all(w is not old for old in self._workers)]
            self._workers = list(workers)
            latest, ref = self._latest, self._latest_ref
        if latest is not None:
            self._offer(new, latest, ref)

    def offer_latest(self, workers: Sequence[object]) -> None:
        """Offer the newest published weights to ``workers`` now (e.g. a restarted worker
        behind an unchanged handle)."""
        with self._lock:
            latest, ref = self._latest, self._latest_ref
        if latest is not None:
            self._offer(list(workers), latest, ref)

    def stats(self) -> PublishStats:
        with self._lock:
            return PublishStats(published=self._published, superseded=self._superseded,
                                offer_failures=self._failures, last_version=self._last_version,
                                put_s=self._put_s, offer_s=self._offer_s,
                                caller_block_s=self._block_s, bytes_published=self._bytes)

    def close(self, timeout_s: float = 30.0) -> None:
        """Send what is pending, then stop the background thread."""
        if self._thread is not None:
            self.flush(timeout_s)
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._check_acks(block=False)

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
        with self._lock:
            workers = list(self._workers)
        ref: Any = None
        if any(_is_ray_actor(w) for w in workers):
            import ray

            t0 = time.perf_counter()
            ref = ray.put(update)   # once per version, whatever the number of workers
            with self._lock:
                self._put_s += time.perf_counter() - t0
        self._offer(workers, update, ref)
        with self._lock:
            self._published += 1
            self._bytes += update.num_bytes
            self._last_version = update.version
            self._latest, self._latest_ref = update, ref

    def _offer(self, workers: Sequence[object], update: WeightUpdate, ref: Any) -> None:
        t0 = time.perf_counter()
        acks = []
        for w in workers:
            try:
                if _is_ray_actor(w):
                    if ref is None:
                        import ray

                        ref = ray.put(update)
                    acks.append(w.offer_weights.remote([ref]))  # type: ignore[attr-defined]
                else:
                    w.offer_weights(update)  # type: ignore[attr-defined]
            except Exception as e:
                log.warning("weight publisher: offering version %d failed: %s", update.version, e)
                with self._lock:
                    self._failures += 1
        with self._lock:
            self._offer_s += time.perf_counter() - t0
            self._pending_acks.extend(acks)
        self._check_acks(block=False)

    def _check_acks(self, *, block: bool) -> None:
        """Count failed remote offers (dead actors) without waiting on live ones; bounds memory."""
        with self._lock:
            acks, self._pending_acks = self._pending_acks, []
        if not acks:
            return
        import ray

        if not ray.is_initialized():   # Ray shut down: nothing left to check
            return
        done, pending = ray.wait(acks, num_returns=len(acks), timeout=None if block else 0)
        failures = 0
        for ref in done:
            try:
                ray.get(ref)
            except Exception as e:
                failures += 1
                log.warning("weight publisher: a worker failed to take an update: %s", str(e).splitlines()[0])
        keep = pending[-self._max_pending_acks:]
        with self._lock:
            self._failures += failures
            self._pending_acks = keep + self._pending_acks
