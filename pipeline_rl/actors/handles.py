"""The Ray boundary, typed: one protocol per actor, and the actor classes with their resources.

Ray's handles say nothing about their methods, so each actor has a protocol here whose
members are its methods as Ray exposes them (``handle.method.remote(...)`` -> ``ObjectRef``).
The driver holds handles typed by these, so a renamed or re-typed method is a type error at
its callers; ``tests/test_imports.py`` checks every member against its actor's method.

The actor classes are placed by ``pipeline_rl.actors.placement``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic, ParamSpec, Protocol, TypeVar

if TYPE_CHECKING:
    from ray import ObjectRef

    from pipeline_rl.buffer.types import Admission, BufferStats, ProcessId
    from pipeline_rl.config import Config
    from pipeline_rl.rollout.eval_feed import EvalRequest, EvalResult
    from pipeline_rl.reports import RankStepReport
    from pipeline_rl.resources import CoreSlot
    from pipeline_rl.rollout.worker import WorkerStats
    from pipeline_rl.samples import Group
    from pipeline_rl.weight_sync.channels.paths import Placement

P = ParamSpec("P")
R = TypeVar("R")


class Remote(Protocol, Generic[P, R]):
    """One actor method as Ray exposes it."""

    def remote(self, *args: P.args, **kwargs: P.kwargs) -> "ObjectRef[R]": ...


class BufferHandle(Protocol):
    """:class:`~pipeline_rl.actors.buffer_actor.BufferActor` behind Ray."""

    address: Remote[[], str]
    acquire: Remote[[int, int, float, "ProcessId | None"], "Admission"]
    set_version: Remote[[int], None]
    get_batch: Remote[[int, int, float | None, int], "list[Group] | None"]
    watch: Remote[[], str | None]
    ping: Remote[[], bool]
    worker_lost: Remote[[int], int]
    release: Remote[[int, int], int]
    stats: Remote[[], "BufferStats"]
    close: Remote[[], None]


class RolloutHandle(Protocol):
    """:class:`~pipeline_rl.actors.rollout_actor.RolloutActor` behind Ray."""

    ready: Remote[[], bool]
    take_over: Remote[["CoreSlot | None"], int]
    renew: Remote[["Config"], int]
    run: Remote[[int], "WorkerStats"]
    init_weight_transfer_engine: Remote[[dict[str, Any]], None]   # SyncClient's calls (weight_sync.protocol)
    receive_update: Remote[[dict[str, Any], str], float]
    placement: Remote[[], "Placement"]
    stats: Remote[[], "WorkerStats"]
    evaluate: Remote[["EvalRequest"], "EvalResult"]
    stop: Remote[[], None]
    pid: Remote[[], int]


class TrainerHandle(Protocol):
    """:class:`~pipeline_rl.actors.trainer_actor.TrainerActor` behind Ray."""

    node_ip: Remote[[], str]
    adopt: Remote[["Config", "BufferHandle"], int]
    pid: Remote[[], int]
    setup: Remote[[str, int], int]
    set_workers: Remote[[list[RolloutHandle]], list[str]]
    offer_latest: Remote[[list[RolloutHandle]], None]
    publish_current: Remote[[], None]
    train_step: Remote[[float], "RankStepReport | None"]
    save_checkpoint: Remote[[str], str]
    wait_for_checkpoints: Remote[[], None]
    load_checkpoint: Remote[[str], int]
    close: Remote[[], None]
