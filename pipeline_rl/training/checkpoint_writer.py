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
- a failed write is raised, in one line, by the next save or by :meth:`CheckpointWriter.wait`;
  its ``.partial`` folder stays for the next start to tidy;
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
from typing import Any

import numpy as np

from pipeline_rl.lora_config import LoraConfig
from pipeline_rl.training.checkpoint import (
    CheckpointError, RunState, copy_tokenizer_files, publish_dir, write_run_state,
)
from pipeline_rl.weight_sync.message import WeightUpdate

log = logging.getLogger(__name__)

#: How long rank 0 waits for the other ranks' parts of a checkpoint before it gives up on it.
PEERS_WRITTEN_TIMEOUT_S = 1800.0
_POLL_S = 0.05


#: The weights' size from which a rank's writes run at idle priority on every CPU (module
#: docstring): 64 MiB, 16 M float32 parameters (the built-in model has 0.4 M, SmolLM2-135M 135 M).
IDLE_WRITE_MIN_BYTES = 64 * 2**20


class CheckpointWriter:
    """One background thread that runs a rank's checkpoint writes in order (module docstring);
    ``idle``: at the lowest priority, on every CPU."""

    def __init__(self, idle: bool = False) -> None:
        self.idle = idle
        self._jobs: queue.Queue[tuple[Path, Callable[[], None]] | None] = queue.Queue()
        self._idle = threading.Condition()
        self._pending = 0
        self._error: str | None = None
        self._thread: threading.Thread | None = None

    def submit(self, where: Path, job: Callable[[], None]) -> None:
        """Queue ``job``, which writes into ``where`` (a checkpoint's folder or a file in it)."""
        with self._idle:
            self._pending += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
            self._thread.start()
        self._jobs.put((where, job))

    def wait(self, timeout_s: float | None = None) -> None:
        """Return once every queued write is done; raise :class:`CheckpointError` (one line)
        when one failed (reported once) or when ``timeout_s`` passes first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._idle:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise CheckpointError(f"checkpoint writes still going on after {timeout_s:.0f} s")
                self._idle.wait(left)
            error, self._error = self._error, None
        if error is not None:
            raise CheckpointError(error)

    def close(self, timeout_s: float) -> None:
        """Let the queued writes finish (up to ``timeout_s``), then stop the thread."""
        try:
            self.wait(timeout_s)
        except CheckpointError as e:
            log.error("trainer: %s", e)
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=1.0)

    def _run(self) -> None:
        if self.idle:
            run_when_idle()
        while (item := self._jobs.get()) is not None:
            where, job = item
            try:
                if self._error is None:   # after a failure the rest of that save is moot
                    job()
            except Exception as e:  # noqa: BLE001 - reported by the next wait()
                self._error = _failure(where, e)
                log.error("trainer: %s", self._error)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()


def writer_for(module: Any) -> CheckpointWriter:
    """A rank's writer for ``module``'s state: idle (module docstring) when its weights are
    :data:`IDLE_WRITE_MIN_BYTES` or more (ZeRO-3: their full size, not this rank's shard)."""
    size = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in module.parameters())
    return CheckpointWriter(idle=size >= IDLE_WRITE_MIN_BYTES)


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


def _failure(where: Path, e: Exception) -> str:
    """One line: which checkpoint, what failed, and the space left on its disk (a full disk
    shows up in torch's writer as ``unexpected pos``, not as an error of its own)."""
    name = next((p.name.removesuffix(".partial") for p in (where, *where.parents) if p.name.endswith(".partial")),
                where.name)
    first = str(e).splitlines()[0] if str(e) else ""
    try:
        free = shutil.disk_usage(next(p for p in (where, *where.parents) if p.exists())).free
        space = f" ({free / 2**20:,.0f} MiB free on its disk)"
    except (OSError, StopIteration):
        space = ""
    return f"writing checkpoint {name} failed: {type(e).__name__}: {first}{space}"


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


def write_weights(out: Path, module: Any, update: WeightUpdate, lora: LoraConfig | None, model_dir: Path) -> None:
    """``update``'s weights into ``out`` as a Hugging Face folder of ``module`` (with LoRA,
    PEFT's adapter files naming the base model), in the module's dtype, with the tokenizer."""
    import torch

    from pipeline_rl.training.lora import save_adapter

    dtype = next(module.parameters()).dtype
    state = {n: torch.from_numpy(a).to(dtype) for n, a in zip(update.names, update.arrays, strict=True)}
    if lora is not None:
        save_adapter(out, state, lora, model_dir)
    else:
        module.save_pretrained(str(out), state_dict=state)
    copy_tokenizer_files(model_dir, out)


def written_marker(part: Path, rank: int) -> Path:
    """The empty file rank ``rank`` leaves in ``part`` once its files of it are written."""
    return part / f".written-rank{rank}"


def finish_part(part: Path, final: Path, rank: int, world_size: int, state: RunState,
                timeout_s: float = PEERS_WRITTEN_TIMEOUT_S) -> None:
    """This rank's files in ``part`` are written: mark it; rank 0 then waits for every other
    rank's mark, writes the run state and renames ``part`` to ``final``."""
    written_marker(part, rank).touch()
    if rank != 0:
        return
    deadline = time.monotonic() + timeout_s
    for peer in range(1, world_size):
        while not written_marker(part, peer).exists():
            if time.monotonic() > deadline:
                raise CheckpointError(f"{final.name}: rank {peer} did not write its part within {timeout_s:.0f} s")
            time.sleep(_POLL_S)
    for r in range(world_size):
        written_marker(part, r).unlink(missing_ok=True)
    write_run_state(part, state)
    publish_dir(part, final)
