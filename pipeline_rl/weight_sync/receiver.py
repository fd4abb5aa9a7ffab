"""The worker half of the ``pipeline_rl_gloo`` weight-transfer backend: the class
vLLM's ``WeightTransferEngineFactory`` builds inside its worker (registered by
``pipeline_rl.weight_sync.gloo.register``). Wire format, channel and trainer
half: ``pipeline_rl.weight_sync.gloo``."""

from __future__ import annotations

import threading
from typing import Any

from vllm.distributed.weight_transfer.base import WeightTransferEngine

import numpy as np

from pipeline_rl.rollout.vllm_compat import complete_backend, load_served_weights
from pipeline_rl.weight_sync.gloo import (
    BACKEND,
    DEFAULT_BUCKET_BYTES,
    Channel,
    GlooInitInfo,
    receive_update,
)
from pipeline_rl.weight_sync.core_staging import CoreStager
from pipeline_rl.weight_sync.cuda_ipc import IpcUpdateInfo, OpenedUpdate, check_opened, info_of, is_ipc_info, open_update
from pipeline_rl.weight_sync.layout import UpdateLayout
from pipeline_rl.weight_sync.message import (
    CheckedUpdate,
    WeightUpdate,
    WeightUpdateError,
    as_checked,
    read_weight_spec,
    validate_update,
)
from pipeline_rl.weight_sync.shm import SegmentReader, ShmUpdateInfo, is_shm_info


@complete_backend   # vLLM 0.26's base also declares its trainer half abstract
class GlooWeightTransferEngine(WeightTransferEngine[Any, Any]):
    """vLLM worker backend for ``pipeline_rl_gloo``: the CPU paths' receiving half.

    Lifecycle (vLLM's): ``init_transfer_engine`` joins the trainer's gloo channel (the
    shared-memory path needs none); ``start_weight_update`` forgets any unapplied
    update; ``update_weights`` takes one update -- an :class:`UpdateLayout` is received
    from the channel into a receive buffer reused across updates, a
    :class:`~pipeline_rl.weight_sync.shm.ShmUpdateInfo` is mapped from its segment --
    and validates it against the served model (a bad one is drained from the channel,
    then refused with ``WeightUpdateError``; nothing is loaded); ``finish_weight_update``
    loads it into ``self.model`` -- vLLM calls it only while generation is paused.
    :meth:`take_received` hands the validated update to a caller that loads it
    elsewhere (the in-process engine's shadow; the update's arrays are views of the
    receive buffer or the segment, valid until the next ``update_weights``).
    Invariant: the model is touched only by ``finish_weight_update``, and only with
    a complete, validated update."""

    init_info_cls = GlooInitInfo
    update_info_cls = UpdateLayout
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self._channel: Channel | None = None
        self._bucket_bytes = DEFAULT_BUCKET_BYTES
        self._spec = read_weight_spec(vllm_config.model_config.model)
        self._received: WeightUpdate | None = None
        self._opened: OpenedUpdate | None = None   # the ipc path: views of the trainer's GPU buffer
        self._buffer: np.ndarray | None = None     # the gloo receive buffer, reused
        self._segments = SegmentReader()
        self._stager: CoreStager | None = None   # loads beside generation (AsyncLLM on CPU)
        self._staged = False
        self._lock = threading.Lock()  # one receive at a time on the channel

    def parse_init_info(self, init_dict: dict[str, Any]) -> GlooInitInfo:
        try:
            return GlooInitInfo(**init_dict)
        except TypeError as e:
            raise ValueError(f"invalid init_info for {BACKEND}: {e}") from e

    def parse_update_info(self, update_dict: dict[str, Any]) -> UpdateLayout | ShmUpdateInfo | IpcUpdateInfo:
        if is_ipc_info(update_dict):
            return info_of(update_dict)
        try:
            return ShmUpdateInfo(**update_dict) if is_shm_info(update_dict) else UpdateLayout(**update_dict)
        except TypeError as e:
            raise WeightUpdateError(f"invalid update_info for {BACKEND}: {e}") from e

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self.shutdown()
        self._bucket_bytes = init_info.bucket_bytes
        self._channel = Channel.connect(init_info)

    def start_weight_update(self) -> None:
        self._received = None
        self._opened = None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's base would also synchronise an accelerator; a CPU receive is done when it returns.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: UpdateLayout | ShmUpdateInfo | IpcUpdateInfo) -> None:
        if isinstance(update_info, IpcUpdateInfo):   # opened and checked on the GPU, not loaded
            index = self.device.index if self.device.index is not None else 0
            opened = open_update(update_info, index)
            check_opened(opened, self._spec)
            self._opened = opened
            return
        if isinstance(update_info, ShmUpdateInfo):
            update = self._segments.update(update_info)
            validate_update(update, self._spec, check_values=not update_info.checked)
            self._received = update
            if update_info.status is not None:   # load beside generation; finish swaps
                if self._stager is None:
                    self._stager = CoreStager(self.model, self.vllm_config)
                self._staged = self._stager.start(update, update_info.status)
            return
        if self._channel is None:
            raise RuntimeError(f"{BACKEND}: update_weights before init_weight_transfer_engine")
        size = update_info.total_bytes()
        with self._lock:
            if self._buffer is None or self._buffer.size < size:
                self._buffer = np.empty(size, dtype=np.uint8)
            got = receive_update(self._channel, update_info, self._bucket_bytes, into=self._buffer)
        # After draining, so the channel stays aligned; values were checked as they arrived.
        if got.non_finite is not None:
            raise WeightUpdateError(f"{got.non_finite}: non-finite values")
        validate_update(got.update, self._spec, check_values=False)
        self._received = got.update

    def take_received(self) -> WeightUpdate:
        """The validated update received since ``start_weight_update`` (handed out once)."""
        update, self._received = self._received, None
        if update is None:
            raise RuntimeError(f"{BACKEND}: finish_weight_update without a received update")
        return update

    def finish_weight_update(self) -> None:
        if self._opened is not None:   # the ipc path: copy from the trainer's buffer, then let it go
            opened, self._opened = self._opened, None
            load_served_weights(self.model, sorted(opened.tensors, key=lambda nt: nt[0]), self.vllm_config)
            import torch

            torch.cuda.synchronize(self.device)   # the trainer may free its buffer once this returns
            return
        if self._staged and self._stager is not None:   # loaded beside generation: swap it in
            self._staged = False
            self._received = None
            self._stager.finish()    # a failed load changes nothing (the worker saw it failed)
            return
        load_into(self.model, as_checked(self.take_received()), self.vllm_config)

    def shutdown(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None


def load_into(model: Any, checked: CheckedUpdate, vllm_config: Any) -> None:
    """Load a checked update into a vLLM model that no step is running on: the
    direct CPU path when it covers the model, else vLLM's layerwise reload."""
    from pipeline_rl.weight_sync.loaders import DirectLoader

    on_cpu = str(vllm_config.device_config.device_type) == "cpu"
    direct = DirectLoader.build(model) if on_cpu else None
    if direct is None or not direct.load(checked, vllm_config):
        load_served_weights(model, checked.tensors, vllm_config)
