"""The worker half of every weight path, once: :class:`Receiver` joins a path's group and
receives each update into staging and checks it (steps 1 and 2 of ``weight_sync.channels.channel``);
both engines use it:

- the in-process engine's and an ``AsyncLLM`` engine core's vLLM backend,
  :class:`WeightReceiver` (registered as ``vllm_adapter.BACKEND`` by
  ``vllm_adapter.register``), which adds step 3, the load;
- an ``AsyncLLM`` rollout worker (``rollout.engines.async_weight_updates``), which receives the
  host paths' bytes in its own process, into its staging segment, beside generation,
  and hands its engine core that segment (device paths go to the core untouched).

Each message names its path (``weight_sync.channels.channel.decode_update_info``), so an engine
need not know its path when it starts; each message is decoded once, by the process
that receives its bytes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline_rl.weight_sync.channels import nccl
from pipeline_rl.weight_sync.channels.channel import InitInfo, UpdateInfo, decode_init_info, decode_update_info
from pipeline_rl.weight_sync.channels.cuda_ipc import IpcUpdateInfo, check_opened, open_update
from pipeline_rl.weight_sync.dtypes import from_torch
from pipeline_rl.weight_sync.channels.gloo import Channel, GlooInitInfo, GlooUpdateInfo, receive_update
from pipeline_rl.weight_sync.channels.host_gpu import DeviceStaging
from pipeline_rl.weight_sync.message import OpenedUpdate, WeightSpec, WeightUpdate, WeightUpdateError, validate_update
from pipeline_rl.weight_sync.channels.object_store import ObjectStoreUpdateInfo
from pipeline_rl.weight_sync.protocol import DEFAULT_BUCKET_BYTES
from pipeline_rl.weight_sync.channels.shm import SegmentReader, SharedSegment, ShmUpdateInfo, StatusCell

if TYPE_CHECKING:
    from pipeline_rl.weight_sync.receive.core_staging import CoreStager


@dataclass(frozen=True, slots=True, eq=False)
class Received:
    """One update received into staging and checked, nothing loaded. Exactly one of:

    - ``host``: a host update (its arrays are views of the staging buffer, a segment or
      a fetched object: valid until the next receive); ``segment``, the shm path's
      message for the segment its bytes lie in, when they lie in one (the trainer's, or
      the receiver's staging segment); ``status``, the trainer's request to load it
      beside generation and report in that cell (``shm.StatusCell``);
    - ``opened``: its tensors on this process's device (ipc, nccl, shm copied to a GPU);
    - ``copying``: shm on a GPU with a status cell, the copy to the GPU under way beside
      generation (the cell says when it is done)."""

    version: int
    host: WeightUpdate | None = None
    segment: ShmUpdateInfo | None = None
    status: str | None = None
    opened: OpenedUpdate | None = None
    copying: "Future[OpenedUpdate] | None" = None


class Receiver:
    """Every path's receiving half (module docstring). ``device``: where device paths
    land (None or a CPU device: host memory); ``staging``: a segment of this process that
    host bytes are received into (gloo) or written to (object store), so that another
    process can load them (None: a buffer of its own, reused); ``check_values``: check
    host values for non-finite ones (False: the process that loads them on its GPU checks
    them there); ``secret``: the run key's rendezvous secret, proved when joining a group.
    One receive at a time per group (the caller serialises updates)."""

    def __init__(self, spec: WeightSpec, *, device: Any = None, staging: SharedSegment | None = None,
                 check_values: bool = True, secret: bytes = b"") -> None:
        self._spec, self._device, self._staging = spec, device, staging
        self._check_values, self.secret = check_values, secret
        self._channel: Channel | None = None         # the gloo path's group
        self._group: nccl.Broadcaster | None = None  # the nccl path's group
        self._bucket_bytes = DEFAULT_BUCKET_BYTES
        self._buffer: np.ndarray | None = None       # the gloo receive buffer without staging
        self._device_buffer = DeviceStaging()        # receive / copy buffer on this device, reused
        self._segments = SegmentReader()
        self._lock = threading.Lock()
        self._receivers: dict[type, Callable[[Any], Received]] = {
            GlooUpdateInfo: self._gloo, ShmUpdateInfo: self._shm, IpcUpdateInfo: self._ipc,
            nccl.NcclUpdateInfo: self._nccl, ObjectStoreUpdateInfo: self._object}

    @property
    def on_gpu(self) -> bool:
        return str(getattr(self._device, "type", "cpu")) == "cuda"

    # -- join -------------------------------------------------------------------------------------
    def join(self, info: InitInfo) -> None:
        """Join the trainer's group (a new one replaces the old); both ends prove the run key."""
        self.close()
        self._bucket_bytes = info.bucket_bytes
        if isinstance(info, GlooInitInfo):
            self._channel = Channel.connect(info, self.secret)
        else:
            self._group = nccl.join(info, 1, self.secret, info.device_for(self._device))

    def join_message(self, message: dict[str, Any]) -> None:
        self.join(decode_init_info(message))

    # -- receive ----------------------------------------------------------------------------------
    def receive(self, info: UpdateInfo) -> Received:
        """Receive ``info``'s update into staging and check it whole (names, shapes, finite
        values); a bad update is drained first (a group stays aligned), then refused with
        ``WeightUpdateError``."""
        return self._receivers[type(info)](info)

    def receive_message(self, message: dict[str, Any]) -> Received:
        return self.receive(decode_update_info(message))

    def _gloo(self, info: GlooUpdateInfo) -> Received:
        if self._channel is None:
            raise RuntimeError("weights: update_weights before init_weight_transfer_engine")
        size = info.total_bytes()
        with self._lock:
            got = receive_update(self._channel, info, self._bucket_bytes, into=self._host_buffer(size))
        # After draining, so the channel stays aligned; values were checked as they arrived.
        if got.non_finite is not None:
            raise WeightUpdateError(f"{got.non_finite}: non-finite values")
        validate_update(got.update, self._spec, check_values=False)
        segment = (ShmUpdateInfo.of(info.layout(), self._staging.path, checked=True)
                   if self._staging is not None and self._staging.path is not None else None)
        return Received(info.version, host=got.update, segment=segment)

    def _host_buffer(self, size: int) -> np.ndarray:
        if self._staging is not None:
            return self._staging.buffer(size)
        if self._buffer is None or self._buffer.size < size:
            self._buffer = np.empty(size, dtype=np.uint8)
        return self._buffer

    def _shm(self, info: ShmUpdateInfo) -> Received:
        update = self._segments.update(info)
        if self.on_gpu:   # the host path at GPU speed: copied to this GPU, checked there
            check = lambda opened: check_opened(opened, self._spec)  # noqa: E731
            if info.status is not None:   # beside generation; the load waits for the cell
                cell, version = StatusCell(info.status, create=False), info.version
                return Received(info.version, copying=self._device_buffer.start_copy(
                    update, self._device, check,
                    lambda ok: cell.set(version, StatusCell.READY if ok else StatusCell.FAILED)))
            opened = self._device_buffer.copy_in(update, self._device)
            check(opened)
            return Received(info.version, opened=opened)
        check_values = self._check_values and not info.checked
        validate_update(update, self._spec, check_values=check_values)
        segment = ShmUpdateInfo.of(info.layout(), info.segment, checked=info.checked or check_values,
                                   offset=info.offset)
        return Received(info.version, host=update, segment=segment, status=info.status)

    def _ipc(self, info: IpcUpdateInfo) -> Received:
        index = self._device.index if getattr(self._device, "index", None) is not None else 0
        opened = open_update(info, index)
        check_opened(opened, self._spec)
        return Received(info.version, opened=opened)

    def _nccl(self, info: nccl.NcclUpdateInfo) -> Received:
        if self._group is None:
            raise RuntimeError("weights: update_weights before init_weight_transfer_engine")
        into = self._device_buffer.buffer(info.total_bytes(), self._device if self.on_gpu else None)
        with self._lock:
            tensors = nccl.receive_chunks(self._group, info, into, self._bucket_bytes)
        opened = OpenedUpdate(info.version, into[:info.total_bytes()], tensors)
        check_opened(opened, self._spec)   # after draining: the group stays aligned
        if self.on_gpu:
            return Received(info.version, opened=opened)
        host = WeightUpdate(info.version, tuple(info.names), tuple(from_torch(t) for _, t in tensors),
                            dtype=info.wire_dtype)  # type: ignore[arg-type]
        return Received(info.version, host=host)

    def _object(self, info: ObjectStoreUpdateInfo) -> Received:
        update = info.fetch()
        validate_update(update, self._spec, check_values=self._check_values)
        segment = self._staging.write(update, checked=self._check_values) if self._staging is not None else None
        return Received(info.version, host=update, segment=segment)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self._group is not None:
            self._group.close()
            self._group = None


def make_stager(model: Any, vllm_config: Any) -> "CoreStager":
    from pipeline_rl.weight_sync.receive.core_staging import CoreStager

    return CoreStager(model, vllm_config)
