"""The two ends of a real weight channel in a test: the trainer's gloo end, driven bucket
by bucket (a pause after the first bucket, or the trainer gone after some buckets), and a
worker's in this process (:class:`ThreadClient`: gloo, or nccl's collective code on gloo)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from pipeline_rl.calls import in_daemon_thread
from pipeline_rl.rollout.engines.engine import GenerationEngine
from pipeline_rl.weight_sync.channels import nccl
from pipeline_rl.weight_sync.channels.channel import decode_init_info, decode_update_info
from pipeline_rl.weight_sync.channels.cuda_ipc import check_opened
from pipeline_rl.weight_sync.dtypes import from_torch
from pipeline_rl.weight_sync.channels.gloo import Channel, GlooInitInfo, receive_update
from pipeline_rl.weight_sync.layout import UpdateLayout, bucket_plan
from pipeline_rl.weight_sync.message import OpenedUpdate, WeightSpec, WeightUpdate, WeightUpdateError
from pipeline_rl.weight_sync.protocol import receive_in_one_call, tagged


def gloo_trainer(engine: GenerationEngine, bucket_bytes: int, timeout_s: float = 30.0) -> Channel:
    """The trainer's end of a gloo channel the engine joined (in this process)."""
    pending, port = Channel.serve("127.0.0.1", timeout_s, b"")
    joining = in_daemon_thread(engine.init_weight_transfer_engine,
                               tagged(GlooInitInfo("127.0.0.1", port, bucket_bytes, timeout_s)))
    channel = pending.join()
    joining.result()
    return channel


def send_buckets(channel: Channel, update: WeightUpdate, bucket_bytes: int, *, pause_s: float = 0.0,
                 stop_after: int | None = None) -> None:
    """Broadcast ``update`` bucket by bucket, waiting ``pause_s`` after the first one;
    ``stop_after``: close the channel after that many buckets (the trainer dies half-way)."""
    flat = np.concatenate([a.reshape(-1).view(np.uint8) for a in update.arrays])
    nbytes, offset = UpdateLayout.of(update).nbytes(), 0
    for k, bucket in enumerate(bucket_plan(nbytes, bucket_bytes)):
        if stop_after is not None and k == stop_after:
            channel.close()
            return
        size = sum(nbytes[i] for i in bucket)
        channel.broadcast(torch.from_numpy(flat[offset:offset + size].copy())).wait()
        offset += size
        if k == 0:
            time.sleep(pause_s)


class ThreadClient:
    """The worker side in this process: joins the channel and receives with the
    backend's own functions (what the vLLM backend does inside vLLM's worker): gloo, or
    nccl's collective code on a gloo group (checked against ``spec`` when given).
    ``fail_once``: refuse the first update after receiving it; ``dies``: the peer goes
    away before the bytes (its end of the group closes)."""

    def __init__(self, fail_once: bool = False, dies: bool = False, spec: WeightSpec | None = None) -> None:
        self.got: list[WeightUpdate] = []
        self.finished: list[str | None] = []
        self.fail_once, self.dies, self.spec = fail_once, dies, spec
        self.group: nccl.Broadcaster | None = None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        info = decode_init_info(init_info)
        if isinstance(info, nccl.NcclInitInfo):
            self.group, self.bucket_bytes = nccl.join(info, 1, b""), info.bucket_bytes
            return
        self.channel, self.bucket_bytes = Channel.connect(info, b""), info.bucket_bytes

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict[str, Any]) -> None:
        info = decode_update_info(update_info)
        if self.dies:
            (self.group or self.channel).close()
            raise ConnectionError("worker died")
        if isinstance(info, nccl.NcclUpdateInfo):
            assert self.group is not None
            into = torch.empty(info.total_bytes(), dtype=torch.uint8)
            tensors = nccl.receive_chunks(self.group, info, into, self.bucket_bytes)
            check_opened(OpenedUpdate(info.version, into, tensors),
                         self.spec or WeightSpec({n: tuple(t.shape) for n, t in tensors}))
            self.got.append(WeightUpdate(info.version, tuple(info.names), tuple(from_torch(t) for _, t in tensors),
                                         dtype=info.wire_dtype))  # type: ignore[arg-type]
            return
        assert not isinstance(info, (nccl.NcclUpdateInfo,)) and isinstance(info, UpdateLayout)
        got = receive_update(self.channel, info, self.bucket_bytes)
        if got.non_finite is not None:
            raise WeightUpdateError(f"{got.non_finite}: non-finite values")
        if self.fail_once:
            self.fail_once = False
            raise WeightUpdateError("refused once")
        self.got.append(got.update)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.finished.append(weight_version)

    def receive_update(self, update_info: dict[str, Any], weight_version: str) -> float:
        return receive_in_one_call(self, update_info, weight_version)


class ShmClient(ThreadClient):
    """A worker on this machine: maps the trainer's segment (the backend's reader) and keeps
    a copy of each version it got (the segment is rewritten by the next one)."""

    def __init__(self) -> None:
        super().__init__()
        from pipeline_rl.weight_sync.channels.shm import SegmentReader

        self.reader = SegmentReader()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        from pipeline_rl.weight_sync.channels.shm import ShmUpdateInfo

        info = decode_update_info(update_info)
        assert isinstance(info, ShmUpdateInfo)
        got = self.reader.update(info)
        self.got.append(WeightUpdate(got.version, got.names, tuple(a.copy() for a in got.arrays), dtype=got.dtype))
