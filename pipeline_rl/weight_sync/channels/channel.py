"""The one channel interface every weight path implements, and the one place a
message's path is decoded.

Trainer side, per worker (:class:`TrainerChannel`)::

    channel = open_channel(path, client, context)   # open: join or map what the path needs
    channel.send(update)                            # send a version: bytes + the worker's call
    channel.close()                                 # close: the worker gets a new one next time

Each path is one class with that shape: ``shm.ShmTrainerChannel`` (one node, a
shared-memory segment written once per version), ``cuda_ipc.IpcTrainerChannel`` (one GPU,
a CUDA IPC handle), ``gloo.GlooTrainerChannel`` (any machine, buckets over TCP),
``nccl.NcclTrainerChannel`` (GPUs, vLLM's packed NCCL broadcast) and
``object_store.ObjectStoreTrainerChannel`` (Ray's object store, once per version). A send
drives the worker with one call (``SyncClient.receive_update``: vLLM's start, update and
finish). What the rest of the project needs to know of a path is its row of
:data:`PATHS` (:class:`PathTraits`), and when it may be taken its row of
``path_table.PATH_TABLE`` (where the names are typed): no other module decides by a
path's name (``tests/test_path_names.py``).

Worker side, the same sequence on every path, by the one ``receiver.Receiver`` (in the
vLLM worker's backend, ``vllm_backend.WeightReceiver``; an ``AsyncLLM`` rollout worker's
receives the host paths in its own process first and hands its engine core a segment):

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

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pipeline_rl.weight_sync.channels.cuda_ipc import IpcTrainerChannel, IpcUpdateInfo
from pipeline_rl.weight_sync.channels.gloo import GlooInitInfo, GlooTrainerChannel, GlooUpdateInfo
from pipeline_rl.weight_sync.message import WeightUpdate, WeightUpdateError
from pipeline_rl.weight_sync.channels.nccl import NcclInitInfo, NcclTrainerChannel, NcclUpdateInfo
from pipeline_rl.weight_sync.channels.object_store import ObjectPut, ObjectStoreTrainerChannel, ObjectStoreUpdateInfo
from pipeline_rl.weight_sync.protocol import OpenContext, SendTiming, SyncClient
from pipeline_rl.weight_sync.channels.shm import SharedWriter, ShmTrainerChannel, ShmUpdateInfo

UpdateInfo = GlooUpdateInfo | ShmUpdateInfo | IpcUpdateInfo | NcclUpdateInfo | ObjectStoreUpdateInfo
InitInfo = GlooInitInfo | NcclInitInfo


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


@dataclass(frozen=True, slots=True)
class PathTraits:
    """One weight path as the publisher and the receivers know it.

    - ``open``: its channel's ``open``; ``update_info`` / ``init_info``: its messages
      (``init_info`` None: nothing to join);
    - ``address``: where its workers reach the trainer (``node``: the Ray node's IP,
      for a rendezvous; ``loopback``: no connection is made to the trainer);
    - ``sends_gpu_copy``: a version gathered on the trainer's GPU is sent as it is (its
      channel copies what it needs); otherwise a host copy is made once per version;
    - ``device_tensors``: the bytes land on the worker's device, received by the engine
      that loads them (an ``AsyncLLM`` worker forwards the message to its engine core);
      otherwise the worker receives host bytes;
    - ``shared``: what the publisher makes once for all the path's channels
      (``OpenContext.shared``), closed with the publisher;
    - ``gathers_into_segment``: the trainer may gather a version straight into shared
      memory for it (``shm.new_shared_buffer``);
    - ``fallback``: the path a worker takes instead when this one runs out of room
      (``shm.ShmSpaceError``) and the path was chosen, not forced;
    - ``reason``: why ``auto`` chose it, for the start-up log."""

    name: str
    open: ChannelOpener
    update_info: type[UpdateInfo]
    init_info: type[InitInfo] | None
    address: Literal["node", "loopback"]
    sends_gpu_copy: bool
    device_tensors: bool
    reason: str
    shared: Callable[[], Any] | None = None
    gathers_into_segment: bool = False
    fallback: str | None = None


#: Every path, declared once (the names are the ``--rollout.weight_path`` values).
PATHS: dict[str, PathTraits] = {t.name: t for t in (
    PathTraits("shm", ShmTrainerChannel.open, ShmUpdateInfo, None, "loopback", sends_gpu_copy=True,
               device_tensors=False, reason="same node", shared=SharedWriter, gathers_into_segment=True,
               fallback="gloo"),
    PathTraits("gloo", GlooTrainerChannel.open, GlooUpdateInfo, GlooInitInfo, "node", sends_gpu_copy=False,
               device_tensors=False, reason="other node"),
    PathTraits("ipc", IpcTrainerChannel.open, IpcUpdateInfo, None, "loopback", sends_gpu_copy=True,
               device_tensors=True, reason="same GPU"),
    PathTraits("nccl", NcclTrainerChannel.open, NcclUpdateInfo, NcclInitInfo, "node", sends_gpu_copy=True,
               device_tensors=True, reason="different GPUs"),
    PathTraits("object_store", ObjectStoreTrainerChannel.open, ObjectStoreUpdateInfo, None, "loopback",
               sends_gpu_copy=False, device_tensors=False, reason="Ray's object store", shared=ObjectPut),
)}

UPDATE_INFOS: dict[str, type[UpdateInfo]] = {t.name: t.update_info for t in PATHS.values()}
INIT_INFOS: dict[str, type[InitInfo]] = {t.name: t.init_info for t in PATHS.values() if t.init_info is not None}


def traits(path: str) -> PathTraits:
    """The row of ``path`` (a name from :data:`PATHS`)."""
    return PATHS[path]


def open_channel(path: str, client: SyncClient, context: OpenContext) -> TrainerChannel:
    """Open ``path``'s channel to one worker."""
    return PATHS[path].open(client, context)


def path_of(message: Mapping[str, Any]) -> PathTraits:
    """The row of the path a message is tagged with (its tag only, nothing decoded);
    an unknown tag raises ``WeightUpdateError``."""
    tag = message.get("path") if isinstance(message, Mapping) else None
    row = PATHS.get(tag) if isinstance(tag, str) else None
    if row is None:
        raise WeightUpdateError(f"message: path tag {tag!r} is not one of {', '.join(sorted(PATHS))}")
    return row


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
