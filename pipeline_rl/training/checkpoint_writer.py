"""Checkpoints written off the training thread: the trainer copies its state (DeepSpeed's
files, the weights, the moving average, the RNG) and goes on training while one background
thread per rank writes the copy into ``step_N.partial``; the folder takes its final name
only when every rank has written its part, as a synchronous save does.

How DeepSpeed's files get there. DeepSpeed writes every file of a checkpoint through the
engine's checkpoint engine (``deepspeed.runtime.checkpoint_engine.CheckpointEngine``, the
interface its own Nebula, fast and decoupled writers implement). :func:`background_engine`
makes one: ``save`` copies the state it is handed into host memory (so the next optimizer
step cannot change what is written) and queues the write; ``load`` is what DeepSpeed's default
torch engine does.

Where the copy goes. :class:`Staging` keeps the host buffers of one save for the next (as
torch's asynchronous checkpointing does with its cached state dict): a save of the same
state copies into memory already mapped (pinned, on a CUDA machine) instead of allocating it
again, which on the real model cost more than the copy itself (fresh pages are faulted in
one at a time: 1.6 GB cloned in 3.0-4.6 s against 0.25 s copied into kept buffers, on the
2-core machine). The price is host memory: one copy of the saved state stays allocated.

Invariants:
- one rank's writes run in order, one at a time, on one thread; a save first waits for the
  previous one to be written, so at most one copy of the state is held besides the live one,
  and a save may reuse the previous save's buffers;
- a checkpoint is complete (final name, ``run_state.json``) only when every rank has written
  its files: rank 0 renames it after every other rank's marker file is there;
- a rank whose write fails leaves ``.failed-rank{R}`` in the ``.partial`` folder, holding its
  one-line cause, and skips the rest of that save (its part is never marked written, so the
  checkpoint never completes; the folder stays for the next start to tidy). Rank 0's wait for
  the other ranks raises at once on seeing it, and every rank's :meth:`CheckpointWriter.check`
  raises it too (once): ``checkpoint step_N: rank R failed to write its part: CAUSE``. The
  trainer checks after every step and every second of one (``training.rank_step``), so a
  failure of any rank reaches the driver within a second or two, not at the next save;
- writes pending with no progress for ``WRITE_STALL_S`` (30 s: nothing under the ``.partial``
  folder changed and no job ended, ``training.checkpoint_progress``) are a failure too (rank
  0's wait for the others, :meth:`~CheckpointWriter.check`, :meth:`~CheckpointWriter.wait`),
  naming the ranks not done; a slow write of a large state grows its files all along;
- a large state (:data:`IDLE_WRITE_MIN_BYTES` of weights or more) is written by a thread at the
  lowest CPU priority that may run on every CPU of the machine, the trainer's pinned core
  included: it writes in whatever CPU time training and generation leave, anywhere (on a
  GPU machine most of it; on the 2-core machine the rollout worker's core waits for
  admission much of the time); a save that finds the previous one still being written waits
  for the rest. A small state is written at normal priority on the trainer's core: its write
  takes milliseconds, and its checkpoint is there within a step, as a restart expects;
- a process killed during a write loses that checkpoint: a restart goes back to the one
  before, so it loses one interval plus the steps trained while the write was going on.

Why the lowest priority. On a CPU trainer a write at normal priority shares the core with
training and holds Python's lock for long stretches (torch's and safetensors' writers do not
let go of it inside a file): on the 2-core machine a 1.6 GB ``torch.save`` beside a Python-heavy
loop on the same core slowed the loop by twice the save's own time (5 s for a 2.4 s save); at
nice 19, by 0.1 s, the save finishing once the loop had stopped.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline_rl.training.checkpoint import (
    CheckpointError, RunState, copy_tokenizer_files, publish_dir, write_run_state,
)
from pipeline_rl.training.checkpoint_progress import (
    SAMPLE_S, WRITE_STALL_S, PeerFailed, Progress, failed_line, fingerprint, leave_failure, part_of, peer_failure,
    stall_line, written_marker,
)
from pipeline_rl.weight_sync.message import WeightUpdate

if TYPE_CHECKING:
    from pipeline_rl.training.lora import AdapterWeights, FullWeights

log = logging.getLogger(__name__)

_POLL_S = 0.05

#: The weights' size from which a rank's writes run at idle priority on every CPU (module
#: docstring): 64 MiB, 16 M float32 parameters (the built-in model has 0.4 M, SmolLM2-135M 135 M).
IDLE_WRITE_MIN_BYTES = 64 * 2**20


class CheckpointWriter:
    """One background thread that runs a rank's checkpoint writes in order (module docstring);
    ``idle``: at the lowest priority, on every CPU; ``rank`` of ``world_size``: whose failure
    markers it leaves and reads; ``stall_s``: how long pending writes may make no progress."""

    def __init__(self, idle: bool = False, rank: int = 0, world_size: int = 1,
                 stall_s: float = WRITE_STALL_S) -> None:
        self.idle, self.rank, self.world_size, self.stall_s = idle, rank, world_size, stall_s
        self._jobs: queue.Queue[tuple[Path, Callable[[], None]] | None] = queue.Queue()
        self._idle = threading.Condition()
        self._pending = 0
        self._done = 0                      # jobs finished: progress between two files
        self._error: str | None = None      # this rank's failure, not reported yet
        self._failed: Path | None = None    # the save that failed: its other jobs are skipped
        self._part: Path | None = None      # the newest save's folder, watched for progress and markers
        self._told = False                  # a failure seen in it was reported
        self._progress: Progress | None = None
        self._thread: threading.Thread | None = None

    def submit(self, where: Path, job: Callable[[], None]) -> None:
        """Queue ``job``, which writes into ``where`` (a checkpoint's folder or a file in it)."""
        part = part_of(where)
        with self._idle:
            self._pending += 1
            if part != self._part:
                self._part, self._told = part, False
                self._progress = Progress(lambda: (self._done, fingerprint(part)), min(SAMPLE_S, self.stall_s / 4))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
            self._thread.start()
        self._jobs.put((where, job))

    def check(self) -> None:
        """Raise :class:`CheckpointError` (one line) now, never waiting, when a write of the
        newest save failed on this rank or on another (its marker), or its writes pending here
        made no progress for ``stall_s``. Each failure is raised once."""
        with self._idle:
            line = self._failure()
        if line is not None:
            raise CheckpointError(line)

    def wait(self, timeout_s: float | None = None) -> None:
        """Return once every queued write is done; raise :class:`CheckpointError` (one line)
        as :meth:`check` does, also when they made no progress for ``stall_s``, or when
        ``timeout_s`` passes first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._idle:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise CheckpointError(f"checkpoint writes still going on after {timeout_s:.0f} s")
                if self._error is None and (line := self._failure()) is not None:
                    raise CheckpointError(line)
                self._idle.wait(SAMPLE_S if left is None else min(left, SAMPLE_S))
            line = self._failure()
        if line is not None:
            raise CheckpointError(line)

    def close(self, timeout_s: float) -> None:
        """Let the queued writes finish (up to ``timeout_s``), then stop the thread."""
        try:
            self.wait(timeout_s)
        except CheckpointError as e:
            log.error("trainer: %s", e)
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=1.0)

    def _failure(self) -> str | None:
        """The failure to raise now, if any, marked as reported (under the lock): this rank's,
        another's marker in the newest save, or a stall of the writes pending here."""
        if self._error is not None:
            error, self._error, self._told = self._error, None, True
            return error
        if self._part is None or self._told:
            return None
        peer = peer_failure(self._part, self.world_size)
        if peer is not None:
            self._told = True
            return peer
        if self._pending and self._progress is not None and self._progress.idle_s() > self.stall_s:
            self._progress.restart()   # a stall is told again only after as long again
            return stall_line(self._part, self.world_size, self.stall_s)
        return None

    def _run(self) -> None:
        if self.idle:
            run_when_idle()
        while (item := self._jobs.get()) is not None:
            where, job = item
            part = part_of(where)
            try:
                if part != self._failed:   # after a failure the rest of that save is moot
                    job()
            except PeerFailed as e:   # rank 0 saw another rank's failure: that rank's line, no marker
                self._fail(part, str(e), None)
            except Exception as e:  # noqa: BLE001 - reported by check() or wait()
                cause = _cause(where, e)
                self._fail(part, failed_line(part, self.rank, cause), cause)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._done += 1
                    self._idle.notify_all()

    def _fail(self, part: Path, line: str, cause: str | None) -> None:
        """Record a failed write of ``part``; with ``cause``, this rank's own, also as its marker."""
        with self._idle:
            self._failed = part
            if part != self._part or not self._told:   # else a failure of this save was raised already
                self._error = line
        log.error("trainer: %s", line)
        if cause is not None:
            leave_failure(part, self.rank, cause)


def writer_for(module: Any, rank: int = 0, world_size: int = 1) -> CheckpointWriter:
    """Rank ``rank``'s writer for ``module``'s state: idle (module docstring) when its weights
    are :data:`IDLE_WRITE_MIN_BYTES` or more (ZeRO-3: their full size, not this rank's shard)."""
    size = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in module.parameters())
    return CheckpointWriter(idle=size >= IDLE_WRITE_MIN_BYTES, rank=rank, world_size=world_size)


def run_when_idle() -> None:
    """The calling thread at the lowest CPU priority (nice 19) and free to run on every CPU of
    the machine, not only its process's pinned core (Linux: both are a thread's own); what
    the OS cannot do is left as it is."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))   # the kernel keeps it within the cgroup's CPUs
    except (AttributeError, OSError):
        pass


def _cause(where: Path, e: Exception) -> str:
    """One line: what failed, and the space left on its disk (a full disk shows up in torch's
    writer as ``unexpected pos``, not as an error of its own)."""
    first = str(e).splitlines()[0] if str(e) else ""
    try:
        free = shutil.disk_usage(next(p for p in (where, *where.parents) if p.exists())).free
        space = f" ({free / 2**20:,.0f} MiB free on its disk)"
    except (OSError, StopIteration):
        space = ""
    return f"{type(e).__name__}: {first}{space}"


class Staging:
    """Host buffers a save copies the state into, kept for the next save (module docstring).

    A buffer is found by the file it is written to (its name: a checkpoint's folder changes,
    DeepSpeed's file names do not) and the tensor's place in the state; a tensor whose shape
    or dtype changed gets a new one. Invariant: a buffer is reused only after the write that
    read it is done (the trainer waits for the previous save before it copies the next)."""

    def __init__(self) -> None:
        self._buffers: dict[str, Any] = {}   # key -> torch.Tensor (host, pinned with CUDA)
        self._arrays: dict[str, np.ndarray] = {}

    def copy(self, item: Any, key: str) -> Any:
        """``item`` with every tensor it holds (nested in dicts, lists and tuples) replaced by a
        host copy in a kept buffer; anything else is returned as it is."""
        import torch

        if torch.is_tensor(item):
            return self._tensor(item.detach(), key)
        if isinstance(item, dict):
            return type(item)({k: self.copy(v, f"{key}/{k}") for k, v in item.items()})
        if isinstance(item, list):
            return [self.copy(v, f"{key}/{i}") for i, v in enumerate(item)]
        if isinstance(item, tuple):
            return tuple(self.copy(v, f"{key}/{i}") for i, v in enumerate(item))
        return item

    def array(self, key: str) -> Callable[[int], np.ndarray]:
        """An ``allocate(nbytes)`` (``gather_weights``) that hands out ``key``'s kept uint8 buffer."""
        def allocate(nbytes: int) -> np.ndarray:
            buf = self._arrays.get(key)
            if buf is None or buf.nbytes != nbytes:
                buf = self._arrays[key] = np.empty(nbytes, dtype=np.uint8)
            return buf
        return allocate

    def _tensor(self, t: Any, key: str) -> Any:
        import torch

        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            pin = t.device.type == "cuda"
            buf = self._buffers[key] = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
        buf.copy_(t)
        return buf


def background_engine(writer: CheckpointWriter, staging: Staging) -> Any:
    """DeepSpeed's checkpoint-engine interface, writing through ``writer``: ``save`` copies the
    state into ``staging``'s host buffers now and writes it on the writer's thread (DeepSpeed
    is imported here, not when this module is)."""
    import torch
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

    class BackgroundEngine(CheckpointEngine):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.name = "pipeline_rl.BackgroundEngine"

        def create(self, info: CheckpointCommitInfo) -> None:
            pass

        def save(self, state_dict: Any, path: str) -> None:
            copy = staging.copy(state_dict, Path(path).name)
            writer.submit(Path(path), lambda: torch.save(copy, path))

        def load(self, path: str, map_location: Any = None) -> Any:
            return torch.load(path, map_location=map_location, weights_only=False)

        def commit(self, info: CheckpointCommitInfo) -> bool:
            return True

        def preserves_storage_sharing(self) -> bool:
            return False   # DeepSpeed need not clone what it hands over: save() copies it all

    return BackgroundEngine()


def write_weights(out: Path, module: Any, update: WeightUpdate, trained: FullWeights | AdapterWeights,
                  model_dir: Path) -> None:
    """``update``'s weights into ``out`` as ``trained`` saves them (a Hugging Face folder of
    ``module``; with LoRA, PEFT's adapter files naming the base model), in the module's dtype,
    with the tokenizer."""
    import torch

    dtype = next(module.parameters()).dtype
    state = {n: torch.from_numpy(a).to(dtype) for n, a in zip(update.names, update.arrays, strict=True)}
    trained.save(out, module, state, model_dir)
    copy_tokenizer_files(model_dir, out)


def finish_part(part: Path, final: Path, rank: int, world_size: int, state: RunState,
                stall_s: float = WRITE_STALL_S) -> None:
    """This rank's files in ``part`` are written: mark it; rank 0 then waits for every other
    rank's mark, writes the run state and renames ``part`` to ``final``. Rank 0 raises
    :class:`PeerFailed` at once on another rank's failure marker, and after ``stall_s`` with
    no progress in ``part``."""
    written_marker(part, rank).touch()
    if rank != 0:
        return
    progress = Progress(lambda: fingerprint(part), min(SAMPLE_S, stall_s / 4))
    while True:
        if (line := peer_failure(part, world_size)) is not None:
            raise PeerFailed(line)
        if all(written_marker(part, peer).exists() for peer in range(1, world_size)):
            break
        if progress.idle_s() > stall_s:
            raise PeerFailed(stall_line(part, world_size, stall_s))
        time.sleep(_POLL_S)
    for r in range(world_size):
        written_marker(part, r).unlink(missing_ok=True)
    write_run_state(part, state)
    publish_dir(part, final)
