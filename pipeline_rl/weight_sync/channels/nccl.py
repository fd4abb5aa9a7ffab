"""The ``nccl`` path: the trainer and a rollout worker on different GPUs, the bytes
broadcast GPU to GPU with vLLM's NCCL communicator, in vLLM's packed format.

One two-member group per (trainer, worker) pair, as on the gloo path: the trainer (rank
0) serves the rendezvous, the worker's engine joins it in ``init_weight_transfer_engine``
(:class:`NcclInitInfo`). Per update the layout travels in ``update_weights``
(:class:`NcclUpdateInfo`); the bytes follow as broadcasts of *packed chunks*, cut by
:func:`chunk_plan` exactly as vLLM's packed broadcast cuts them (tensors back to back as
uint8; a chunk ends with the tensor that takes it past ``bucket_bytes``), so either end
could be vLLM's own. A chunk whose tensors already lie back to back (``gather_weights``
writes them so) is sent as a view; others are packed with vLLM's ``pack_tensors``.
The worker receives every chunk into one reused buffer on its GPU, checks the values
there (one reduction, nothing read on the CPU), and the load copies from it.

The collective code (:func:`send_chunks`, :func:`receive_chunks`) takes any
:class:`Broadcaster`: vLLM's ``PyNcclCommunicator`` on GPUs
(``vllm_adapter.nccl_broadcaster``), or a gloo group on CPU
(``NcclInitInfo.backend == "gloo"``), which is how the suite runs this path on a machine
without GPUs. ``auto`` never picks this path until it has run on two GPUs; forcing it is
refused in one line where it cannot run (:func:`nccl_refusal`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

import numpy as np

from pipeline_rl.weight_sync.layout import UpdateLayout
from pipeline_rl.weight_sync.message import WeightUpdate, WeightUpdateError
from pipeline_rl.weight_sync.protocol import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_TIMEOUT_S,
    OpenContext,
    SendTiming,
    SyncClient,
    tagged,
)
from pipeline_rl.calls import in_daemon_thread
from pipeline_rl.net import rendezvous_port

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class NcclInitInfo:
    """Where the trainer's rendezvous listens (the worker is rank 1); ``backend``:
    ``nccl`` on GPUs, ``gloo`` to run the same collective code on CPU."""

    PATH: ClassVar[str] = "nccl"
    master_address: str
    master_port: int
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S
    backend: Literal["nccl", "gloo"] = "nccl"

    def device_for(self, device: Any) -> Any:
        """The device a member joins on: ``device`` for NCCL, none for the CPU stand-in."""
        return device if self.backend == "nccl" else None


@dataclass(frozen=True, slots=True)
class NcclUpdateInfo(UpdateLayout):
    """``update_weights`` info of the nccl path: the update's layout; the packed chunks
    follow on the group."""

    PATH: ClassVar[str] = "nccl"


class Broadcaster(Protocol):
    """A two-member group: ``broadcast`` sends ``tensor`` from rank 0 and fills it in
    place on rank 1; it returns once ``tensor`` may be reused (on GPUs: ordered on the
    current stream)."""

    def broadcast(self, tensor: "torch.Tensor") -> None: ...

    def close(self) -> None: ...


def gpu_count() -> int:
    """CUDA devices this process sees (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def nccl_refusal(count: int | None = None) -> str | None:
    """Why ``--rollout.weight_path nccl`` cannot run with ``count`` GPUs (default: this
    machine's, :func:`gpu_count`), in one line, or None: it needs CUDA and at least two."""
    count = gpu_count() if count is None else count
    if count >= 2:
        return None
    return (f"nccl: needs CUDA and at least 2 GPUs (this machine has {count}); "
            "use auto, ipc, shm or gloo")


def chunk_plan(nbytes: Sequence[int], bucket_bytes: int) -> list[range]:
    """vLLM's packed-broadcast cut: tensors go into the current chunk until its total
    passes ``bucket_bytes``; the tensor that passes it closes the chunk."""
    chunks: list[range] = []
    start, total = 0, 0
    for i, n in enumerate(nbytes):
        total += n
        if total > bucket_bytes:
            chunks.append(range(start, i + 1))
            start, total = i + 1, 0
    if start < len(nbytes):
        chunks.append(range(start, len(nbytes)))
    return chunks


def _offsets(nbytes: Sequence[int]) -> list[int]:
    out = [0]
    for n in nbytes:
        out.append(out[-1] + n)
    return out


def send_chunks(group: Broadcaster, info: UpdateLayout, tensors: Sequence["torch.Tensor"],
                flat: "torch.Tensor | None", bucket_bytes: int) -> None:
    """Rank 0: broadcast the update chunk by chunk. ``flat`` (uint8): the tensors' bytes
    back to back, when they lie so (each chunk is then a view of it); else each chunk is
    packed from ``tensors`` with vLLM's ``pack_tensors``."""
    from pipeline_rl.weight_sync.receive.vllm_adapter import pack_chunk

    nbytes = info.nbytes()
    starts = _offsets(nbytes)
    for chunk in chunk_plan(nbytes, bucket_bytes):
        if flat is not None:
            data = flat[starts[chunk.start]:starts[chunk.stop]]
        else:
            data = pack_chunk([(info.names[i], tensors[i]) for i in chunk], bucket_bytes)
        group.broadcast(data)


def receive_chunks(group: Broadcaster, info: UpdateLayout, into: "torch.Tensor",
                   bucket_bytes: int) -> list[tuple[str, "torch.Tensor"]]:
    """Rank 1: receive every chunk straight into its place in ``into`` (uint8, at least
    the update's size, on the group's device; reused across updates) and return the
    update's tensors as views of it, in the info's order."""
    from pipeline_rl.weight_sync.dtypes import torch_dtype

    nbytes = info.nbytes()
    starts = _offsets(nbytes)
    for chunk in chunk_plan(nbytes, bucket_bytes):
        group.broadcast(into[starts[chunk.start]:starts[chunk.stop]])
    # vLLM's unpack_tensor cuts a chunk the same way (bytes back to back, viewed as each dtype).
    return [(name, into[starts[i]:starts[i + 1]].view(torch_dtype(d)).view(shape))
            for i, (name, d, shape) in enumerate(zip(info.names, info.dtype_names, info.shapes))]


class GlooBroadcaster:
    """The collective code's group on CPU: a two-member gloo group (``gloo.Channel``)."""

    def __init__(self, channel: Any) -> None:
        self._channel = channel

    def broadcast(self, tensor: "torch.Tensor") -> None:
        self._channel.broadcast(tensor).wait()

    def close(self) -> None:
        self._channel.close()


def join(info: NcclInitInfo, rank: int, secret: bytes, device: Any = None) -> Broadcaster:
    """This side's member of the group ``info`` names (blocks until both are in, and both
    proved ``secret``, the run key's rendezvous secret: ``rendezvous_auth``)."""
    if info.backend == "gloo":
        from pipeline_rl.weight_sync.channels.gloo import Channel, rendezvous

        store = rendezvous(info.master_address, info.master_port, serve=rank == 0, timeout_s=info.timeout_s)
        return GlooBroadcaster(Channel(store, rank, info.timeout_s, secret))
    from pipeline_rl.weight_sync.receive.vllm_adapter import nccl_broadcaster

    return nccl_broadcaster(info.master_address, info.master_port, rank, device, info.timeout_s, secret)


class NcclTrainerChannel:
    """The nccl path's ``TrainerChannel`` for one worker: open joins the group (rank 0)
    while the worker's engine joins it; send drives the worker's one call on a helper
    thread and broadcasts the chunks from here. A failed send leaves the group unusable
    (close it; a new open makes a fresh one)."""

    path = "nccl"

    def __init__(self, client: SyncClient, group: Broadcaster, bucket_bytes: int) -> None:
        self.client = client
        self._group = group
        self._bucket_bytes = bucket_bytes

    @classmethod
    def open(cls, client: SyncClient, context: OpenContext,
             backend: Literal["nccl", "gloo"] = "nccl") -> "NcclTrainerChannel":
        """Refused in one line where NCCL cannot run (``backend="gloo"``: the same code on
        CPU, for the suite)."""
        if backend == "nccl":
            why = nccl_refusal()
            if why is not None:
                raise WeightUpdateError(why)
        info = NcclInitInfo(context.address, rendezvous_port(context.address), context.bucket_bytes,
                            context.timeout_s, backend)
        joined = in_daemon_thread(join, info, 0, context.secret, _current_device(backend))
        worker = in_daemon_thread(client.init_weight_transfer_engine, tagged(info))
        both: list[Future[Any]] = [worker, joined]
        wait(both, return_when=FIRST_EXCEPTION)
        worker.result()
        return cls(client, joined.result(), context.bucket_bytes)

    def send(self, update: WeightUpdate) -> SendTiming:
        """One update in one worker call: start, update (receive || broadcast), finish."""
        info, tensors, flat = _source(update)
        t0 = time.perf_counter()
        future = in_daemon_thread(self.client.receive_update, tagged(info), str(update.version))
        try:
            send_chunks(self._group, info, tensors, flat, self._bucket_bytes)
        except BaseException:
            if future.done():
                future.result()   # the worker's error explains the broken group
            raise
        finish_s = future.result()
        total = time.perf_counter() - t0
        return SendTiming(update.version, total - finish_s, finish_s, update.num_bytes, self.path)

    def close(self) -> None:
        self._group.close()


def _current_device(backend: str) -> Any:
    if backend != "nccl":
        return None
    import torch

    return torch.device("cuda", torch.cuda.current_device())


def _source(update: WeightUpdate) -> tuple[NcclUpdateInfo, list["torch.Tensor"], "torch.Tensor | None"]:
    """The update's info, its tensors and (when they lie back to back) their flat bytes:
    the GPU copy (``update.device``) or the host arrays."""
    import torch

    from pipeline_rl.weight_sync.dtypes import to_torch
    from pipeline_rl.weight_sync.layout import contiguous_bytes

    if update.device is not None:
        copy = update.device
        names = list(update.names)
        info = NcclUpdateInfo(update.version, names, [update.dtype] * len(names), [list(s) for s in copy.shapes])
        flat = copy.flat.view(torch.uint8)
        return info, [], flat
    info = NcclUpdateInfo.of(update)
    raw = contiguous_bytes(update.arrays)
    flat_bytes = torch.from_numpy(raw) if raw is not None and raw.flags.writeable else None
    tensors = [] if flat_bytes is not None else [
        to_torch(np.ascontiguousarray(a), update.dtype_name(a)) for a in update.arrays]
    return info, tensors, flat_bytes
