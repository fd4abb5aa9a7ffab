"""The worker half of every weight path: :class:`WeightReceiver`, the backend vLLM's
``WeightTransferEngineFactory`` builds inside its worker (registered as
``vllm_adapter.BACKEND`` by ``vllm_adapter.register``). One backend for all paths: each
message names its path (``weight_sync.channel.decode_update_info``), so an engine need
not know its path when it starts."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

from vllm.distributed.weight_transfer.base import WeightTransferEngine

import numpy as np

from pipeline_rl.weight_sync import nccl
from pipeline_rl.weight_sync.channel import InitInfo, UpdateInfo, decode_init_info, decode_update_info
from pipeline_rl.weight_sync.core_staging import CoreStager
from pipeline_rl.weight_sync.cuda_ipc import IpcUpdateInfo, check_opened, open_update
from pipeline_rl.weight_sync.dtypes import from_torch
from pipeline_rl.weight_sync.gloo import Channel, GlooInitInfo, GlooUpdateInfo, receive_update
from pipeline_rl.weight_sync.host_gpu import DeviceStaging
from pipeline_rl.weight_sync.message import (
    CheckedUpdate,
    OpenedUpdate,
    WeightUpdate,
    WeightUpdateError,
    as_checked,
    read_weight_spec,
    validate_update,
)
from pipeline_rl.weight_sync.protocol import DEFAULT_BUCKET_BYTES
from pipeline_rl.weight_sync.shm import SegmentReader, ShmUpdateInfo, StatusCell
from pipeline_rl.weight_sync.lora_update import AdapterServer, LoraServing
from pipeline_rl.weight_sync.vllm_adapter import BACKEND, complete_backend, load_served_weights


@complete_backend   # vLLM 0.26's base also declares its trainer half abstract
class WeightReceiver(WeightTransferEngine[Any, Any]):
    """vLLM worker backend :data:`BACKEND`: every path's receiving half, in the
    sequence ``weight_sync.channel`` states.

    ``init_transfer_engine`` joins the trainer's gloo or nccl group (shm and ipc need
    none); ``start_weight_update`` forgets any unapplied update; ``update_weights``
    *receives into staging and checks*: gloo into a receive buffer reused across
    updates, shm mapped from the trainer's segment (on a GPU: copied to this GPU and
    checked there), ipc opened from the trainer's GPU buffer, nccl into a receive buffer
    on this device -- a bad update is drained, then refused with ``WeightUpdateError``,
    nothing loaded; ``finish_weight_update`` *loads* it into ``self.model`` (vLLM calls it
    only while generation is paused). :meth:`take_received` hands a validated host
    update to a caller that loads it elsewhere (the in-process engine's shadow; its
    arrays are views of the receive buffer or the segment, valid until the next
    ``update_weights``). Invariant: the model is touched only by
    ``finish_weight_update``, and only with a complete, checked update."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self._channel: Channel | None = None        # the gloo path's group
        self._group: nccl.Broadcaster | None = None  # the nccl path's group
        self._bucket_bytes = DEFAULT_BUCKET_BYTES
        lora = LoraServing.from_additional(getattr(vllm_config, "additional_config", None))
        #: A LoRA run's serving (None: full weights): updates are the adapter, checked against its spec.
        self.adapter = AdapterServer(vllm_config.model_config.model, lora, model,
                                     lambda full: load_into(model, full, vllm_config)) if lora is not None else None
        self._spec = self.adapter.spec if self.adapter is not None else read_weight_spec(vllm_config.model_config.model)
        self._received: WeightUpdate | None = None
        self._opened: OpenedUpdate | None = None   # checked tensors on this device (ipc, nccl, shm on a GPU)
        self._buffer: np.ndarray | None = None     # the gloo receive buffer, reused
        self._device_buffer = DeviceStaging()      # receive / copy buffer on this device, reused
        self._copying: Future[OpenedUpdate] | None = None   # shm on a GPU: the copy beside generation
        self._segments = SegmentReader()
        self._stager: CoreStager | None = None   # loads beside generation (AsyncLLM on CPU)
        self._staged = False
        self._lock = threading.Lock()  # one receive at a time on the channel

    def parse_init_info(self, init_dict: dict[str, Any]) -> InitInfo:  # type: ignore[override]
        return decode_init_info(init_dict)

    def parse_update_info(self, update_dict: dict[str, Any]) -> UpdateInfo:  # type: ignore[override]
        return decode_update_info(update_dict)

    def init_transfer_engine(self, init_info: InitInfo) -> None:  # type: ignore[override]
        self.shutdown()
        self._bucket_bytes = init_info.bucket_bytes
        if isinstance(init_info, nccl.NcclInitInfo):
            self._group = nccl.join(init_info, 1, self.device if init_info.backend == "nccl" else None)
        else:
            self._channel = Channel.connect(init_info)

    def start_weight_update(self) -> None:
        self._received = None
        self._opened = None
        self._copying = None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's base would also synchronise an accelerator; every receive here is done when it returns.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: UpdateInfo) -> None:  # type: ignore[override]
        """Receive into staging, then check (see the class docstring)."""
        if isinstance(update_info, IpcUpdateInfo):   # opened and checked on the GPU, not loaded
            opened = open_update(update_info, self._gpu_index())
            check_opened(opened, self._spec)
            self._opened = opened
        elif isinstance(update_info, ShmUpdateInfo):
            self._receive_shm(update_info)
        elif isinstance(update_info, nccl.NcclUpdateInfo):
            self._receive_nccl(update_info)
        else:
            self._receive_gloo(update_info)

    def _gpu_index(self) -> int:
        return self.device.index if self.device.index is not None else 0

    def _on_gpu(self) -> bool:
        return str(getattr(self.device, "type", "cpu")) == "cuda"

    def _receive_shm(self, info: ShmUpdateInfo) -> None:
        update = self._segments.update(info)
        if self._on_gpu():   # the host path at GPU speed: copied to this GPU, checked there
            if info.status is not None:   # beside generation; finish loads once it is READY
                cell, version = StatusCell(info.status, create=False), info.version
                self._copying = self._device_buffer.start_copy(
                    update, self.device, lambda opened: check_opened(opened, self._spec),
                    lambda ok: cell.set(version, StatusCell.READY if ok else StatusCell.FAILED))
                return
            self._opened = self._device_buffer.copy_in(update, self.device)
            check_opened(self._opened, self._spec)
            return
        validate_update(update, self._spec, check_values=not info.checked)
        self._received = update
        if info.status is not None and self.adapter is not None:   # an adapter: loaded while paused
            StatusCell(info.status, create=False).set(info.version, StatusCell.NO_SHADOW)
        elif info.status is not None:   # load beside generation; finish swaps
            if self._stager is None:
                self._stager = CoreStager(self.model, self.vllm_config)
            self._staged = self._stager.start(update, info.status)

    def _receive_nccl(self, info: nccl.NcclUpdateInfo) -> None:
        if self._group is None:
            raise RuntimeError(f"{BACKEND}: update_weights before init_weight_transfer_engine")
        into = self._device_buffer.buffer(info.total_bytes(), self.device if self._on_gpu() else None)
        with self._lock:
            tensors = nccl.receive_chunks(self._group, info, into, self._bucket_bytes)
        opened = OpenedUpdate(info.version, into[:info.total_bytes()], tensors)
        check_opened(opened, self._spec)   # after draining: the group stays aligned
        if self._on_gpu():
            self._opened = opened
        else:
            self._received = WeightUpdate(info.version, tuple(info.names), tuple(from_torch(t) for _, t in tensors),
                                          dtype=info.wire_dtype)  # type: ignore[arg-type]

    def _receive_gloo(self, info: GlooUpdateInfo) -> None:
        if self._channel is None:
            raise RuntimeError(f"{BACKEND}: update_weights before init_weight_transfer_engine")
        size = info.total_bytes()
        with self._lock:
            if self._buffer is None or self._buffer.size < size:
                self._buffer = np.empty(size, dtype=np.uint8)
            got = receive_update(self._channel, info, self._bucket_bytes, into=self._buffer)
        # After draining, so the channel stays aligned; values were checked as they arrived.
        if got.non_finite is not None:
            raise WeightUpdateError(f"{got.non_finite}: non-finite values")
        validate_update(got.update, self._spec, check_values=False)
        self._received = got.update

    def take_received(self) -> WeightUpdate:
        """The validated host update received since ``start_weight_update`` (handed out once)."""
        update, self._received = self._received, None
        if update is None:
            raise RuntimeError(f"{BACKEND}: finish_weight_update without a received update")
        return update

    def finish_weight_update(self) -> None:
        """Load what was received and checked (see the class docstring)."""
        if self._copying is not None:   # a copy that failed loads nothing (the worker saw it failed)
            copying, self._copying = self._copying, None
            if not copying.done() or copying.exception() is not None:
                return
            self._opened = copying.result()
        if self._opened is not None:   # on this device: copy into the model, then let it go
            opened, self._opened = self._opened, None
            tensors = sorted(opened.tensors, key=lambda nt: nt[0])
            if self.adapter is not None:
                self.adapter.serve(CheckedUpdate(opened.version, tuple(tensors), 0))
            else:
                load_served_weights(self.model, tensors, self.vllm_config)
            import torch

            torch.cuda.synchronize(self.device)   # the trainer may free its buffer once this returns
            return
        if self._staged and self._stager is not None:   # loaded beside generation: swap it in
            self._staged = False
            self._received = None
            self._stager.finish()    # a failed load changes nothing (the worker saw it failed)
            return
        if self.adapter is not None:
            self.adapter.serve(as_checked(self.take_received()))
            return
        load_into(self.model, as_checked(self.take_received()), self.vllm_config)

    def shutdown(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self._group is not None:
            self._group.close()
            self._group = None


def load_into(model: Any, checked: CheckedUpdate, vllm_config: Any) -> None:
    """Load a checked update into a vLLM model that no step is running on: the
    direct CPU path when it covers the model, else vLLM's layerwise reload."""
    from pipeline_rl.weight_sync.loaders import DirectLoader

    on_cpu = str(vllm_config.device_config.device_type) == "cpu"
    direct = DirectLoader.build(model) if on_cpu else None
    if direct is None or not direct.load(checked, vllm_config):
        load_served_weights(model, checked.tensors, vllm_config)
