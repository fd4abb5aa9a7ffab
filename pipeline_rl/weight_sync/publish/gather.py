"""The trainer's half of publishing that runs on the training thread: a version's full
parameters copied out once, in the served dtype, into one buffer (host memory, a
shared-memory segment, or the trainer's GPU), before the next optimizer step changes them.
The publisher (``pipeline_rl.weight_sync.publish.publisher``) sends what this gathers."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pipeline_rl.weight_sync.dtypes import STORAGE, WireDtype, from_torch, torch_dtype
from pipeline_rl.weight_sync.message import WeightUpdate


def gather_weights(module: Any, version: int, *, zero_stage: int, dtype: WireDtype = "float32",
                   allocate: Callable[[int], np.ndarray] | None = None, on_device: bool = False,
                   named: Sequence[tuple[str, Any]] | None = None) -> WeightUpdate:
    """Full parameters of ``module`` (the HF model inside the DeepSpeed engine) in the wire
    dtype ``dtype`` -- the served model's: a bfloat16 engine gets bfloat16, cast here once,
    parameter by parameter as they are copied out (``float32`` keeps float32).

    The arrays lie back to back in one buffer (``layout.contiguous_bytes`` finds it), so
    the shared-memory path writes them with one pass and the gloo path sends buckets as
    views. Names are ``named_parameters()`` names of the HF model (tied weights appear
    once), which are the names ``save_pretrained`` writes and vLLM's ``load_weights``
    expects. Under ZeRO-3 this is a collective (``deepspeed.zero.GatheredParameters``);
    every rank must call it. The arrays are copies: later optimizer steps do not change them.
    ``allocate(nbytes)``: where the buffer comes from (a uint8 array; the publisher's
    :meth:`WeightPublisher.allocator` gives shared memory when a worker takes the shm path,
    so the gather itself is the one write of the bytes); default: ordinary memory.
    ``on_device`` (a worker takes the ``ipc`` path): parameters on a GPU are gathered
    into one tensor on that GPU instead (``WeightUpdate.device``; a device-to-device copy).
    Parameters on a GPU bound for host memory are gathered on the GPU the same way, then
    copied out whole into ``allocate``'s buffer (``host_gpu.device_to_host``).
    ``named``: the (name, parameter) pairs to send instead of all of them (a LoRA run's
    adapter, ``pipeline_rl.training.lora``), gathered and laid out the same way.
    """
    import torch

    params = list(module.named_parameters() if named is None else named)
    if zero_stage == 3:
        import deepspeed

        ctx: Any = deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None)
    else:
        import contextlib

        ctx = contextlib.nullcontext()
    with ctx, torch.no_grad():
        shapes = [tuple(p.shape) for _, p in params]   # full shapes: read while gathered (ZeRO-3)
        sizes = [p.numel() for _, p in params]
        wire = torch_dtype(dtype)
        device = params[0][1].device if params else torch.device("cpu")
        raw: np.ndarray | None = None
        to_host = device.type == "cuda" and not on_device   # gathered on the GPU, then one copy out
        if device.type == "cuda":
            flat = torch.empty(sum(sizes), dtype=wire, device=device)
        else:
            on_device = False
            raw = allocate(sum(sizes) * wire.itemsize) if allocate is not None else None
            flat = torch.empty(sum(sizes), dtype=wire) if raw is None else torch.from_numpy(raw).view(wire)
        offset = 0
        for (_, p), n in zip(params, sizes):
            flat[offset:offset + n].view(p.shape).copy_(p.detach())   # the cast and the copy in one
            offset += n
        if to_host:   # cast on the GPU, then one device-to-host copy (no CPU-side cast)
            from pipeline_rl.weight_sync.channels.host_gpu import device_to_host

            raw = device_to_host(flat, allocate)
            flat = torch.from_numpy(raw).view(wire)
    names = tuple(name for name, _ in params)
    if on_device:
        from pipeline_rl.weight_sync.channels.cuda_ipc import device_copy

        return WeightUpdate(version=version, names=names, arrays=(), dtype=dtype, device=device_copy(flat, shapes))
    # Views of the allocated array itself (so the shm path finds the file it lies in).
    data = from_torch(flat) if raw is None else raw.view(STORAGE[dtype])
    arrays: list[np.ndarray] = []
    offset = 0
    for shape, n in zip(shapes, sizes):
        arrays.append(data[offset:offset + n].reshape(shape))
        offset += n
    return WeightUpdate(version=version, names=names, arrays=tuple(arrays), dtype=dtype)
