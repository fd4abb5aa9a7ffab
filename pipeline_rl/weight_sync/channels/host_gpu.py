"""The host path at GPU speed: a version crosses host memory between two GPUs as one
device-to-host copy into page-locked shared memory and one host-to-device copy out of
it, with no conversion and no value read on the CPU.

Trainer side (:func:`device_to_host`): the bf16 gather is kept on the trainer's GPU (a
device-to-device cast, as for ipc; the publisher asks for it once a worker takes shm from
a GPU trainer), and the publisher's thread copies it whole into the shm writer's segment,
registered with CUDA as page-locked once (a pinned copy runs at the bus's speed, a
pageable one at a fraction of it); the training thread never waits for that copy.

Worker side (:class:`DeviceStaging`): the engine core maps the segment, registers the
mapping once, copies the update into a buffer on its GPU reused across updates, and
the receiver checks the values there (``cuda_ipc.check_opened``: one reduction) -- on a
thread and a stream of their own while the core keeps generating, reported through the
worker's status cell (:meth:`DeviceStaging.start_copy`); the load then copies GPU to GPU
inside the pause, as on the ipc path.

On a machine without CUDA nothing here registers anything: the copies are plain
copies, so the suite runs the same code on CPU.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline_rl.weight_sync.layout import contiguous_bytes
from pipeline_rl.weight_sync.message import OpenedUpdate, WeightUpdate, WeightUpdateError

if TYPE_CHECKING:
    import torch

#: Host ranges registered with CUDA, by (address, bytes), each with an array keeping its
#: mapping alive: a range is never unmapped while CUDA holds it page-locked (a new mapping
#: at the same address would otherwise be read through the old pages). Only long-lived
#: buffers are pinned (the writer's segment, a reader's mapping of it): a handful per run.
_PINNED: dict[tuple[int, int], np.ndarray] = {}
_PIN_LOCK = threading.Lock()


def pin(host: np.ndarray) -> bool:
    """Register ``host``'s memory with CUDA as page-locked (once per range; it then stays
    mapped for the life of the process). False where CUDA is absent or refuses (the
    copies then run pageable, still correct)."""
    import torch

    if not torch.cuda.is_available() or host.nbytes == 0:
        return False
    key = (int(host.ctypes.data), int(host.nbytes))
    with _PIN_LOCK:
        if key in _PINNED:
            return True
        err = torch.cuda.cudart().cudaHostRegister(key[0], key[1], 0)
        if int(getattr(err, "value", err)) != 0:
            return False
        _PINNED[key] = host
        return True


def device_to_host(flat: "torch.Tensor", allocate: Callable[[int], np.ndarray] | None, *,
                   pinned: bool = False) -> np.ndarray:
    """The bytes of ``flat`` (a 1-D tensor on a GPU; the CPU in tests) in host memory from
    ``allocate`` (ordinary memory when None), one device-to-host copy with no conversion;
    ``pinned``: register the buffer first (a long-lived one: the shm writer's segment).
    Returns the uint8 buffer."""
    import torch

    nbytes = flat.numel() * flat.element_size()
    raw = allocate(nbytes) if allocate is not None else np.empty(nbytes, dtype=np.uint8)
    if not flat.is_cuda:
        torch.from_numpy(raw).copy_(flat.view(torch.uint8))
        return raw
    if pinned:
        pin(raw)
    stream = side_stream(flat.device)   # not behind the training kernels on the default stream
    with torch.cuda.stream(stream):
        torch.from_numpy(raw).copy_(flat.view(torch.uint8), non_blocking=True)
    stream.synchronize()
    return raw


_STREAMS: dict[str, "torch.cuda.Stream"] = {}


def side_stream(device: Any) -> "torch.cuda.Stream":
    """A CUDA stream of this module's own on ``device`` (one per device, kept): the
    copies run on it, beside the default stream's compute (training, generation)."""
    import torch

    key = str(device)
    with _PIN_LOCK:
        if key not in _STREAMS:
            _STREAMS[key] = torch.cuda.Stream(device=device)
        return _STREAMS[key]


class DeviceStaging:
    """A worker's receive buffer on its device (grown when an update needs more, else
    reused) and the copy of a host update into it."""

    def __init__(self) -> None:
        self._buf: "torch.Tensor | None" = None

    def buffer(self, nbytes: int, device: Any = None) -> "torch.Tensor":
        """A uint8 tensor of at least ``nbytes`` on ``device`` (None: CPU)."""
        import torch

        dev = torch.device(device) if device is not None else torch.device("cpu")
        if self._buf is None or self._buf.numel() < nbytes or self._buf.device != dev:
            self._buf = None
            self._buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=dev)
        return self._buf

    def copy_in(self, update: WeightUpdate, device: Any) -> OpenedUpdate:
        """``update`` (host arrays lying back to back: a segment's) copied to ``device``
        (one pinned host-to-device copy), as named views of the buffer in its order."""
        import torch

        from pipeline_rl.weight_sync.dtypes import torch_dtype

        host = contiguous_bytes(update.arrays)
        if host is None:
            raise WeightUpdateError(f"weights v{update.version}: the segment's arrays are not back to back")
        pin(host)
        buf = self.buffer(host.nbytes, device)[:host.nbytes]
        buf.copy_(torch.from_numpy(host), non_blocking=True)
        tensors: list[tuple[str, torch.Tensor]] = []
        offset = 0
        for name, arr in zip(update.names, update.arrays):
            n = int(arr.nbytes)
            view = buf[offset:offset + n].view(torch_dtype(update.dtype_name(arr))).view(arr.shape)
            tensors.append((name, view))
            offset += n
        if buf.is_cuda:
            torch.cuda.current_stream(buf.device).synchronize()   # the segment may be rewritten after this
        return OpenedUpdate(update.version, buf, tensors)

    def start_copy(self, update: WeightUpdate, device: Any, check: Callable[[OpenedUpdate], None],
                   report: Callable[[bool], None]) -> "Future[OpenedUpdate]":
        """:meth:`copy_in` and ``check`` on a thread and a CUDA stream of their own, while the
        engine keeps generating; ``report(ok)`` tells the worker the outcome (its status
        cell: it pauses only after a success). The future holds the checked update for the
        load (or the error)."""
        import logging

        import torch

        future: Future[OpenedUpdate] = Future()

        on_gpu = device is not None and torch.device(device).type == "cuda"

        def run() -> None:
            try:
                with torch.cuda.stream(side_stream(device)) if on_gpu else contextlib.nullcontext():
                    opened = self.copy_in(update, device)
                    check(opened)
                future.set_result(opened)
                report(True)
            except BaseException as e:  # noqa: BLE001 - reported through the cell, the log and the future
                logging.getLogger(__name__).error("weights v%d: copying them to the GPU failed: %s",
                                                  update.version, str(e).splitlines()[0] if str(e) else type(e).__name__)
                future.set_exception(e)
                report(False)

        threading.Thread(target=run, name="weights-to-gpu", daemon=True).start()
        return future
