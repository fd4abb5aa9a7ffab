"""The two ends of a real gloo weight channel in a test: the trainer's, driven bucket by
bucket (a pause after the first bucket, or the trainer gone after some buckets), and a
worker's in this process (:class:`ThreadClient`)."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from pipeline_rl.calls import in_daemon_thread
from pipeline_rl.rollout.engine import GenerationEngine
from pipeline_rl.weight_sync.gloo import Channel, GlooInitInfo, receive_update
from pipeline_rl.weight_sync.layout import UpdateLayout, bucket_plan
from pipeline_rl.weight_sync.message import WeightUpdate, WeightUpdateError
from pipeline_rl.weight_sync.protocol import receive_in_one_call


def gloo_trainer(engine: GenerationEngine, bucket_bytes: int, timeout_s: float = 30.0) -> Channel:
    """The trainer's end of a gloo channel the engine joined (in this process)."""
    pending, port = Channel.serve("127.0.0.1", timeout_s)
    joining = in_daemon_thread(engine.init_weight_transfer_engine,
                               asdict(GlooInitInfo("127.0.0.1", port, bucket_bytes, timeout_s)))
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
    backend's own functions (what the vLLM backend does inside vLLM's worker).
    ``fail_once``: refuse the first update after receiving it; ``dies``: the peer goes
    away before the bytes (its end of the group closes)."""

    def __init__(self, fail_once: bool = False, dies: bool = False) -> None:
        self.got: list[WeightUpdate] = []
        self.finished: list[str | None] = []
        self.fail_once, self.dies = fail_once, dies

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        info = GlooInitInfo(**init_info)
        self.channel, self.bucket_bytes = Channel.connect(info), info.bucket_bytes

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict[str, Any]) -> None:
        if self.dies:
            self.channel.close()
            raise ConnectionError("worker died")
        got = receive_update(self.channel, UpdateLayout(**update_info), self.bucket_bytes)
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
