"""The trainer's end of a real gloo weight channel, driven bucket by bucket from a test
(a pause after the first bucket, or the trainer gone after some buckets)."""

from __future__ import annotations

import time
from dataclasses import asdict

import numpy as np
import torch

from pipeline_rl.calls import in_daemon_thread
from pipeline_rl.rollout.engine import GenerationEngine
from pipeline_rl.weight_sync.gloo import Channel, GlooInitInfo
from pipeline_rl.weight_sync.layout import UpdateLayout, bucket_plan
from pipeline_rl.weight_sync.message import WeightUpdate


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
