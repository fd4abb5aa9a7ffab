"""The replay buffer's Ray actor (the buffer and its ZeroMQ receiver in one process), and
the rollout workers' admission source backed by it.

Wraps plain classes (``ReplayBuffer``, ``BufferServer``) that work and are tested
without Ray; this module only adds process set-up and the Ray-facing methods.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, cast

from pipeline_rl.actors.process import end_of_startup, setup_actor_process
from pipeline_rl.config import Config
from pipeline_rl.faults import inject, kill_here
from pipeline_rl.resources import CoreSlot

if TYPE_CHECKING:
    from pipeline_rl.actors.handles import BufferHandle
    from pipeline_rl.run_key import RunKey
    from pipeline_rl.buffer.types import Admission, BufferStats, ProcessId
    from pipeline_rl.samples import Group


class BufferActor:
    """The replay buffer and its ZeroMQ receiver in one process.

    Threaded actor: ``acquire`` (workers), ``get_batch`` (trainer ranks, blocking)
    and ``stats`` (driver) run concurrently; the buffer itself is thread-safe.
    """

    def __init__(self, cfg: Config, bind_host: str, start_version: int = 0,
                 avoid: tuple[CoreSlot, ...] = (), *, key: RunKey | None = None) -> None:
        """``avoid``: the rollout workers' core slots, which this process keeps off; ``key``:
        the run key (only producers holding it may push groups)."""
        setup_actor_process(cfg, "buffer", uses_torch=False, avoid=avoid)
        self._fault = cfg.fault
        from pipeline_rl.buffer.server import configured_server

        self._server = configured_server(cfg, bind_host, start_version, key=key)
        self._buffer = self._server.buffer
        end_of_startup()

    def address(self) -> str:
        return self._server.address

    def acquire(self, worker_id: int, max_groups: int, timeout_s: float = 0.0,
                requester: ProcessId | None = None) -> Admission:
        return self._buffer.acquire(worker_id, max_groups, timeout_s, requester)

    def set_version(self, version: int) -> None:
        self._buffer.set_version(version)

    def get_batch(self, num_groups: int, trainer_version: int, timeout_s: float,
                  rank: int) -> list[Group] | None:
        inject(self._fault, "buffer", trainer_version)
        kill_here(self._fault, "buffer_kill", trainer_version)
        return self._buffer.get_batch(num_groups, trainer_version, timeout_s, rank=rank)

    def watch(self, poll_s: float = 0.5) -> str | None:
        """Block until the buffer closes (None) or its receiver thread fails (one line
        saying why); the driver keeps one call pending as a health sentinel, so a dead
        buffer process also shows as this call failing."""
        while not self._buffer.closed:
            error = self._server.error
            if error is not None:
                return f"receiver thread crashed: {type(error).__name__}: {error}"
            time.sleep(poll_s)
        return None

    def ping(self) -> bool:
        return True

    def worker_lost(self, worker_id: int) -> int:
        return self._buffer.worker_lost(worker_id)

    def release(self, worker_id: int, count: int) -> int:
        return self._buffer.release(worker_id, count)

    def stats(self) -> BufferStats:
        return self._buffer.stats()

    def close(self) -> None:
        self._server.close()
        self._buffer.close()


class RayAdmission:
    """Adapter: the rollout worker's admission source, backed by the buffer actor (found
    by its Ray name: an actor handle among a restartable actor's constructor arguments
    makes Ray log an error at every start)."""

    def __init__(self, buffer_name: str, wait_s: float = 30.0) -> None:
        """Finds the buffer by name, waiting up to ``wait_s`` for the name to be registered
        (the driver starts this worker right after asking for the buffer)."""
        import ray

        deadline = time.monotonic() + wait_s
        while True:
            try:
                self._buffer = cast("BufferHandle", ray.get_actor(buffer_name))
                return
            except ValueError:   # not registered (yet)
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def request(self, worker_id: int, max_groups: int, timeout_s: float = 0.0) -> "Future[Admission]":
        """The buffer's answer, on a future: the caller goes on while the call is in flight."""
        # This process's id goes with it: a request it sent before it died, arriving after the
        # driver declared it lost, grants nothing (a new process with its pid is another id).
        from pipeline_rl.buffer.types import ProcessId

        future: Future[Admission] = self._buffer.acquire.remote(worker_id, max_groups, timeout_s,
                                                                ProcessId.current()).future()
        return future

    def release(self, worker_id: int, count: int) -> int:
        import ray

        return int(ray.get(self._buffer.release.remote(worker_id, count)))

    def buffer_address(self) -> str:
        """The ZeroMQ address the buffer's socket is bound to (waits for the buffer to bind)."""
        import ray

        return str(ray.get(self._buffer.address.remote()))
