"""The ``ipc`` path: the trainer and a rollout worker share one GPU.

The trainer gathers each version into one bf16 tensor on its GPU (``gather_weights(...,
on_device=True)``: a device-to-device copy, the snapshot the optimizer cannot change
while the worker reads it) and shares that tensor through a CUDA IPC handle -- the
mechanism of vLLM's ``ipc`` backend (``torch.multiprocessing``'s ``reduce_tensor`` /
``rebuild_cuda_tensor``), with its field names. The handle travels in the worker's one
call (``receive_update``) to the engine core, which opens it, cuts the update's tensors
out of it as views and loads them with the model's own ``load_weights``: no byte
crosses host memory, a socket or a file.

Why this project's backend and not vLLM's ``ipc`` class in the engine core: the engine's
backend is fixed when the engine starts, before the publisher knows the path; vLLM's
trainer half changed its API at 0.28 (``trainer_send_weights`` before, ``trainer_init``
after) and its handle dicts need pickle through vLLM's own serialiser. One backend that
takes every path's info keeps the engine independent of the placement and of the vLLM
release; the handle is pickled once here and carried as text.

Invariants: one handle per update (the whole buffer); the trainer keeps the buffer alive
and unchanged until the worker's call returned (the publisher sends the next version only
after that, and a new version is a new buffer); the engine core synchronises its copies
before the call returns, so the trainer may then free it.
"""

from __future__ import annotations

import base64
import math
import pickle
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from pipeline_rl.weight_sync.layout import UpdateLayout
from pipeline_rl.weight_sync.message import DeviceCopy, OpenedUpdate, WeightSpec, WeightUpdate, WeightUpdateError

if TYPE_CHECKING:
    import numpy as np
    import torch

    from pipeline_rl.weight_sync.protocol import OpenContext, SendTiming, SyncClient


@dataclass(frozen=True, slots=True)
class IpcUpdateInfo:
    """``update_weights`` info of the ``ipc`` path: the layout (lists line up, tensors
    back to back in this order), the base64 text of the pickled CUDA IPC arguments of
    the buffer holding them, and the UUID of the GPU it lives on."""

    PATH: ClassVar[str] = "ipc"
    version: int
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    ipc_handle: str
    gpu_uuid: str

    def layout(self) -> UpdateLayout:
        return UpdateLayout(self.version, self.names, self.dtype_names, self.shapes)


def gpu_uuid(device_index: int) -> str:
    import torch

    return str(torch.cuda.get_device_properties(device_index).uuid)


def export_update(update: WeightUpdate) -> IpcUpdateInfo:
    """The IPC info of an update gathered on the GPU (``update.device``); raises
    ``WeightUpdateError`` for an update in host memory."""
    from torch.multiprocessing.reductions import reduce_tensor

    copy = update.device
    if copy is None or not copy.flat.is_cuda:
        raise WeightUpdateError(f"weights v{update.version}: the ipc path needs the update on the GPU")
    _, args = reduce_tensor(copy.flat)
    return IpcUpdateInfo(update.version, list(update.names), [update.dtype] * len(update.names),
                         [list(s) for s in copy.shapes], base64.b64encode(pickle.dumps(args)).decode("ascii"),
                         gpu_uuid(copy.flat.device.index or 0))


def open_update(info: IpcUpdateInfo, device_index: int) -> OpenedUpdate:
    """The update's tensors as views of the trainer's buffer, opened on ``device_index``
    (which must be the trainer's GPU); no copy."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if gpu_uuid(device_index) != info.gpu_uuid:
        raise WeightUpdateError(f"weights v{info.version}: the ipc path shares GPU {info.gpu_uuid}, "
                                f"this engine runs on {gpu_uuid(device_index)}")
    args = list(pickle.loads(base64.b64decode(info.ipc_handle)))
    args[6] = device_index            # reduce_tensor's device index: the receiver's own
    flat = rebuild_cuda_tensor(*args)
    layout = info.layout()
    out: list[tuple[str, torch.Tensor]] = []
    offset = 0
    for name, shape in zip(layout.names, layout.shapes):
        n = int(torch.Size(shape).numel())
        out.append((name, flat[offset:offset + n].view(shape)))
        offset += n
    if offset != flat.numel():
        raise WeightUpdateError(f"weights v{info.version}: the layout covers {offset} values, "
                                f"the shared buffer holds {flat.numel()}")
    return OpenedUpdate(info.version, flat, out)


def check_opened(opened: OpenedUpdate, spec: WeightSpec) -> None:
    """Refuse (``WeightUpdateError``, one line) an update that is not the served model's
    complete set of finite weights; one reduction where the tensors are checks every
    value (on a GPU nothing is read on the CPU but the answer). ``opened.flat`` may be
    typed (the ipc buffer) or raw bytes (a receive buffer)."""
    import torch

    tensors = opened.tensors
    names = [n for n, _ in tensors]
    if len(set(names)) != len(names):
        raise WeightUpdateError("duplicate parameter names in the update")
    for name, t in tensors:
        expected = spec.shapes.get(name)
        if expected is None:
            raise WeightUpdateError(f"unknown parameter {name!r} (not in the served model)")
        if tuple(t.shape) != expected:
            raise WeightUpdateError(f"{name}: shape {tuple(t.shape)} != expected {expected}")
    missing = sorted(set(spec.shapes) - set(names))
    if missing:
        raise WeightUpdateError(f"missing parameter {missing[0]!r}: updates must be complete")
    flat, dtypes = opened.flat, {t.dtype for _, t in tensors}
    if flat.dtype == torch.uint8 and len(dtypes) == 1:   # received bytes: read them as the update's dtype
        flat = flat[:sum(t.numel() * t.element_size() for _, t in tensors)].view(dtypes.pop())
    if flat.dtype == torch.uint8 or not bool(torch.isfinite(flat).all()):
        bad = next((n for n, t in tensors if not bool(torch.isfinite(t).all())), None)
        if bad is not None:
            raise WeightUpdateError(f"{bad}: non-finite values")


def to_host(update: WeightUpdate) -> WeightUpdate:
    """An update gathered on the GPU, copied into host memory for the gloo path (one
    device-to-host copy, no conversion); an update already there is returned as it is.
    (The shm path copies it into its segment itself: ``shm.SharedWriter``.)"""
    from pipeline_rl.weight_sync.dtypes import STORAGE
    from pipeline_rl.weight_sync.channels.host_gpu import device_to_host

    copy = update.device
    if copy is None:
        return update
    data: np.ndarray = device_to_host(copy.flat, None).view(STORAGE[update.dtype])
    arrays, offset = [], 0
    for shape in copy.shapes:
        n = math.prod(shape)
        arrays.append(data[offset:offset + n].reshape(shape))
        offset += n
    return WeightUpdate(update.version, update.names, tuple(arrays), dtype=update.dtype)


class IpcTrainerChannel:
    """The ``ipc`` path's ``TrainerChannel`` for one worker: the handle of the version's
    GPU buffer goes in the worker's one call; the engine core copies from it."""

    path = IpcUpdateInfo.PATH

    def __init__(self, client: "SyncClient") -> None:
        self.client = client

    @classmethod
    def open(cls, client: "SyncClient", context: "OpenContext") -> "IpcTrainerChannel":
        """Nothing to join: each send carries its own handle."""
        return cls(client)

    def send(self, update: WeightUpdate) -> "SendTiming":
        from pipeline_rl.weight_sync.protocol import SendTiming, tagged

        t0 = time.perf_counter()
        info = export_update(update)
        export_s = time.perf_counter() - t0
        finish_s = self.client.receive_update(tagged(info), str(update.version))
        call_s = time.perf_counter() - t0 - export_s
        _collect()   # the worker let go of the buffer: CUDA may free the older ones now
        return SendTiming(update.version, export_s + call_s - finish_s, finish_s, update.num_bytes, self.path)

    def close(self) -> None:
        _collect()


def _collect() -> None:
    """Free what CUDA IPC kept of buffers the worker has let go of."""
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.ipc_collect()
    except Exception:  # noqa: BLE001 - nothing to free on a broken context
        pass


def device_copy(flat: "torch.Tensor", shapes: list[tuple[int, ...]]) -> DeviceCopy:
    """A :class:`DeviceCopy` once ``flat``'s copies are done (another process reads it)."""
    import torch

    torch.cuda.current_stream(flat.device).synchronize()
    return DeviceCopy(flat, tuple(shapes))
