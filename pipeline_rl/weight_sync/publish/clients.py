"""How the trainer's publisher reaches one rollout worker: a Ray actor as vLLM's
weight-sync client (:class:`ActorClient`), where a worker runs (:func:`placement_of`)
and where the trainer listens (:func:`trainer_address`)."""

from __future__ import annotations

from typing import Any

from pipeline_rl.weight_sync.protocol import DEFAULT_TIMEOUT_S
from pipeline_rl.weight_sync.channels.paths import Placement, local_placement


class ActorClient:
    """A rollout worker's Ray actor as vLLM's weight-sync client (``SyncClient``): each
    call waits for the actor, at most ``timeout_s`` (a dead worker never hangs a send)."""

    def __init__(self, actor: Any, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self._actor, self._timeout_s = actor, timeout_s

    def _call(self, method: str, *args: Any) -> Any:
        import ray

        return ray.get(getattr(self._actor, method).remote(*args), timeout=self._timeout_s)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update", weight_version)

    def receive_update(self, update_info: dict[str, Any], weight_version: str) -> float:
        return float(self._call("receive_update", update_info, weight_version))

    def placement(self) -> Placement:
        return self._call("placement")  # type: ignore[no-any-return]


#: The node id of a worker that could not say where it runs (taken for another node).
UNKNOWN_NODE = "unknown"


def placement_of(client: object) -> Placement:
    """Where a worker runs: its own answer (``placement()``); a worker object in this
    process without one runs here. A worker that cannot say (no such method: another
    node is assumed, the gloo path works anywhere) or does not answer (dead: retried at
    its next channel) gets node :data:`UNKNOWN_NODE`."""
    ask = getattr(client, "placement", None)
    if not callable(ask):
        return local_placement()
    try:
        return ask()  # type: ignore[no-any-return]
    except Exception:  # noqa: BLE001 - a worker that cannot answer is not on this node
        return Placement(node_id=UNKNOWN_NODE)


def trainer_address() -> str:
    """The address workers reach this process at: the Ray node's IP, else loopback."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except ImportError:  # pragma: no cover - ray is a dependency
        pass
    return "127.0.0.1"
