"""The one channel interface every weight path implements, and the one place a
message's path is decoded.

Trainer side, per worker (:class:`TrainerChannel`)::

    channel = open_channel(path, client, context)   # open: join or map what the path needs
    channel.send(update)                            # send a version: bytes + the worker's call
    channel.close()                                 # close: the worker gets a new one next time

Each path is one class with that shape: ``shm.ShmTrainerChannel`` (one node, a
shared-memory segment written once per version), ``cuda_ipc.IpcTrainerChannel`` (one GPU,
a CUDA IPC handle), ``gloo.GlooTrainerChannel`` (any machine, buckets over TCP) and
``nccl.NcclTrainerChannel`` (GPUs, vLLM's packed NCCL broadcast). A send drives the
worker with one call (``SyncClient.receive_update``: vLLM's start, update and finish).

Worker side, the same sequence on every path (``receiver.WeightReceiver`` in the vLLM
worker; ``rollout.engines.engine_async`` stages in the rollout worker first):

1. **receive into staging** (``update_weights``): the bytes land where the load reads them
   -- the gloo receive buffer or a segment, the trainer's segment mapped, the trainer's GPU
   buffer opened, or an NCCL receive buffer on this GPU -- while generation goes on;
2. **check**: the whole update against the served model (names, shapes, finite values);
   a bad one raises ``WeightUpdateError`` and nothing was loaded;
3. **load** (``finish_weight_update``): into a shadow beside generation, or the live
   model inside the pause; the old weights serve until then.

Every ``update_weights`` and ``init_weight_transfer_engine`` message carries its path tag
(``protocol.tagged``); :func:`decode_update_info` and :func:`decode_init_info` are the only
readers of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from pipeline_rl.weight_sync.cuda_ipc import IpcTrainerChannel, IpcUpdateInfo
from pipeline_rl.weight_sync.gloo import GlooInitInfo, GlooTrainerChannel, GlooUpdateInfo
from pipeline_rl.weight_sync.message import WeightUpdate, WeightUpdateError
from pipeline_rl.weight_sync.nccl import NcclInitInfo, NcclTrainerChannel, NcclUpdateInfo
from pipeline_rl.weight_sync.paths import ResolvedPath
from pipeline_rl.weight_sync.protocol import OpenContext, SendTiming, SyncClient
from pipeline_rl.weight_sync.shm import ShmTrainerChannel, ShmUpdateInfo

UpdateInfo = GlooUpdateInfo | ShmUpdateInfo | IpcUpdateInfo | NcclUpdateInfo
InitInfo = GlooInitInfo | NcclInitInfo

UPDATE_INFOS: dict[str, type[UpdateInfo]] = {
    "gloo": GlooUpdateInfo, "shm": ShmUpdateInfo, "ipc": IpcUpdateInfo, "nccl": NcclUpdateInfo}
INIT_INFOS: dict[str, type[InitInfo]] = {"gloo": GlooInitInfo, "nccl": NcclInitInfo}


class TrainerChannel(Protocol):
    """The trainer's end of one path to one worker (module docstring). ``send`` is
    synchronous: when it returns the worker has staged (or loaded) the version and
    holds no reference to the trainer's buffer; a failed send leaves the channel
    unusable (close it; the publisher opens a new one for the next version)."""

    path: str

    def send(self, update: WeightUpdate) -> SendTiming: ...

    def close(self) -> None: ...


class ChannelOpener(Protocol):
    """A path's ``open``: a channel to ``client`` (a worker's four calls) in ``context``."""

    def __call__(self, client: SyncClient, context: OpenContext) -> TrainerChannel: ...


#: Each path's ``open`` (a classmethod of its channel class).
OPENERS: dict[str, ChannelOpener] = {
    "shm": ShmTrainerChannel.open, "ipc": IpcTrainerChannel.open,
    "gloo": GlooTrainerChannel.open, "nccl": NcclTrainerChannel.open}


def open_channel(path: ResolvedPath, client: SyncClient, context: OpenContext) -> TrainerChannel:
    """Open ``path``'s channel to one worker."""
    return OPENERS[path](client, context)


def _decode(kind: str, table: Mapping[str, type[Any]], message: Mapping[str, Any]) -> Any:
    if not isinstance(message, Mapping):
        raise WeightUpdateError(f"{kind}: expected a dict, got {type(message).__name__}")
    fields = dict(message)
    tag = fields.pop("path", None)
    cls = table.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise WeightUpdateError(f"{kind}: path tag {tag!r} is not one of {', '.join(sorted(table))}")
    try:
        return cls(**fields)
    except TypeError as e:
        raise WeightUpdateError(f"{kind} for the {tag} path: {e}") from e


def decode_update_info(message: Mapping[str, Any]) -> UpdateInfo:
    """An ``update_weights`` message as its path's typed info; a message without a known
    path tag, or with fields that path does not have, raises ``WeightUpdateError``."""
    return _decode("update_info", UPDATE_INFOS, message)  # type: ignore[no-any-return]


def decode_init_info(message: Mapping[str, Any]) -> InitInfo:
    """An ``init_weight_transfer_engine`` message as its path's typed info (only the
    paths with a channel to join have one: gloo, nccl)."""
    return _decode("init_info", INIT_INFOS, message)  # type: ignore[no-any-return]
