"""The ``object_store`` path: each version put into Ray's object store once, for workers
that cannot open a connection to the trainer (``--rollout.weight_path object_store``).

- **Channel** (:class:`ObjectStoreTrainerChannel`): nothing to join. A send puts the
  version into the object store (once per version for all workers: :class:`ObjectPut`,
  the path's shared part) and drives the worker's one call with the reference in the
  message (:class:`ObjectStoreUpdateInfo`). A worker in this process without Ray gets
  the update itself in the message.
- **Worker side**: the receiver fetches the object (Ray moves its bytes between nodes)
  and checks it whole, as every host path's update (``receiver.Receiver``).

The reference travels nested in the message's dict, so Ray does not resolve it while it
dispatches the call: it is fetched by the receiver, off the engine's critical path.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from pipeline_rl.weight_sync.message import WeightUpdate, WeightUpdateError

if TYPE_CHECKING:
    from pipeline_rl.weight_sync.protocol import OpenContext, SendTiming, SyncClient


@dataclass(frozen=True, slots=True)
class ObjectStoreUpdateInfo:
    """``update_weights`` info of the object-store path: the version and ``payload``, a
    Ray ``ObjectRef`` to the :class:`WeightUpdate` (or, for a worker in the trainer's
    process without Ray, the update itself)."""

    PATH: ClassVar[str] = "object_store"
    version: int
    payload: Any

    def fetch(self) -> WeightUpdate:
        """The update behind the payload (fetched from the object store when it is a
        reference); anything else raises ``WeightUpdateError``."""
        value = self.payload
        if not isinstance(value, WeightUpdate):
            import ray

            if not isinstance(value, ray.ObjectRef):
                raise WeightUpdateError(f"object_store: expected a WeightUpdate or an ObjectRef, "
                                        f"got {type(value).__name__}")
            value = ray.get(value)
        if not isinstance(value, WeightUpdate):
            raise WeightUpdateError(f"object_store: the object holds a {type(value).__name__}, "
                                    "not a WeightUpdate")
        if value.version != self.version:
            raise WeightUpdateError(f"object_store: the message names v{self.version}, "
                                    f"the object holds v{value.version}")
        return value


class ObjectPut:
    """The path's part shared by every worker's channel: the newest version's payload,
    put into the object store once (thread-safe: the publisher sends in parallel)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._version = -1
        self._payload: Any = None
        self.put_s = 0.0   # seconds in ray.put (serialisation into the object store)

    def payload(self, update: WeightUpdate) -> tuple[Any, float]:
        """``update``'s payload and the seconds this call spent putting it."""
        with self._lock:
            if self._version == update.version:
                return self._payload, 0.0
            t0 = time.perf_counter()
            self._payload = _put(update)
            self._version = update.version
            spent = time.perf_counter() - t0
            self.put_s += spent
            return self._payload, spent

    def close(self) -> None:
        with self._lock:
            self._payload, self._version = None, -1


def _put(update: WeightUpdate) -> Any:
    import ray

    return ray.put(update) if ray.is_initialized() else update


class ObjectStoreTrainerChannel:
    """The object-store path's ``TrainerChannel`` for one worker."""

    path = "object_store"

    def __init__(self, client: "SyncClient", put: ObjectPut) -> None:
        self.client = client
        self._put = put

    @classmethod
    def open(cls, client: "SyncClient", context: "OpenContext") -> "ObjectStoreTrainerChannel":
        """Nothing to join: the context's :class:`ObjectPut` puts each version once."""
        if not isinstance(context.shared, ObjectPut):
            raise ValueError("the object_store path needs the publisher's ObjectPut (OpenContext.shared)")
        return cls(client, context.shared)

    def send(self, update: WeightUpdate) -> "SendTiming":
        from pipeline_rl.weight_sync.protocol import SendTiming, tagged

        payload, put_s = self._put.payload(update)
        t0 = time.perf_counter()
        finish_s = self.client.receive_update(tagged(ObjectStoreUpdateInfo(update.version, payload)),
                                              str(update.version))
        call_s = time.perf_counter() - t0
        return SendTiming(update.version, put_s + call_s - finish_s, finish_s, update.num_bytes, self.path)

    def close(self) -> None:
        """Nothing per worker: the put is the publisher's."""


def update_of(message: dict[str, Any]) -> WeightUpdate:
    """The update an object-store path's ``update_weights`` message carries (fetched):
    for a stand-in worker that takes only this path (tests, benchmarks)."""
    fields = dict(message)
    if fields.pop("path", None) != ObjectStoreUpdateInfo.PATH:
        raise WeightUpdateError(f"expected an {ObjectStoreUpdateInfo.PATH} message, got {message.get('path')!r}")
    return ObjectStoreUpdateInfo(**fields).fetch()
