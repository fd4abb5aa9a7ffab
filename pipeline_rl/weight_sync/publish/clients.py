"""How the trainer's publisher reaches one rollout worker: a Ray actor as vLLM's
weight-sync client (:class:`ActorClient`), where a worker runs (:func:`placement_of`)
and where the trainer listens (:func:`trainer_address`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pipeline_rl.weight_sync.protocol import DEFAULT_TIMEOUT_S, SYNC_CALLS
from pipeline_rl.weight_sync.channels.paths import Placement, local_placement

#: What the trainer calls on a worker's actor: the weight calls, and where it runs.
_REMOTE_CALLS = frozenset(SYNC_CALLS) | {"placement"}


class ActorClient:
    """A rollout worker's Ray actor as the trainer's client (``SyncClient``, and
    ``placement``): each call is the actor's method of the same name (the worker's own,
    ``actors/rollout_actor.py``), waited for at most ``timeout_s`` (a dead worker never
    hangs a send). Written once for every call: nothing here per call."""

    def __init__(self, actor: Any, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self._actor, self._timeout_s = actor, timeout_s

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name not in _REMOTE_CALLS:
            raise AttributeError(f"{type(self).__name__} has no call {name!r} (the actor's: {sorted(_REMOTE_CALLS)})")

        def call(*args: Any) -> Any:
            import ray

            # The actor's method is looked up when called: an actor without it fails the
            # call (placement_of then takes it for another node), not the attribute.
            return ray.get(getattr(self._actor, name).remote(*args), timeout=self._timeout_s)

        return call


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
