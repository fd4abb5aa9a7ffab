"""What one life of the run hands to the next, and how the next takes it up.

Every life shares the :class:`RunIdentity` (the buffer's Ray name, the run key), so a carried
worker, and a process Ray restarts with its first constructor arguments, find the current
life's buffer. A life that ends in a failure a restart heals may hand on (:class:`Carried`)
its rollout workers and its trainer ranks' spares: the workers are renewed
(``RolloutActor.renew``: a second or less) instead of started (a vLLM start: 11 s of a core on
CPU, minutes on a GPU), the spares adopted (``TrainerActor.adopt``). One that cannot be is
replaced -- a worker by its standby or a new actor, the spares by new ranks -- and one console
line says which and why. The run's folder goes on too (``run/life/run_folder.py``,
``restart_in``).

Invariant: every wait here is bounded by ``_RENEW_TIMEOUT_S``; what was not renewed or
adopted in time is killed and replaced, never waited on again.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline_rl.actors.handles import BufferHandle, RolloutHandle, TrainerHandle
from pipeline_rl.config import Config
from pipeline_rl.run.cluster import say
from pipeline_rl.run.life.slots import WorkerSlot
from pipeline_rl.run.life.stop import kill
from pipeline_rl.run.life.supervise import cause_of
from pipeline_rl.run.remote_calls import RayCalls
from pipeline_rl.run_key import RunKey

log = logging.getLogger("pipeline_rl.run.life.carry")

_RENEW_TIMEOUT_S = 30.0  # a carried worker not renewed by then is replaced by a new actor


@dataclass(frozen=True, slots=True)
class RunIdentity:
    """What every life of one run shares: the replay buffer's Ray name (each life's buffer
    registers under it once the last one is killed) and the run key (``pipeline_rl.run_key``:
    made once per run, handed to each actor as a constructor argument; the driver holds it
    only here, for the run's lives)."""

    buffer_name: str
    key: RunKey = field(repr=False)

    @classmethod
    def new(cls) -> "RunIdentity":
        return cls(f"pipeline_rl_buffer_{os.getpid()}_{uuid.uuid4().hex[:8]}", RunKey.new())


@dataclass(slots=True)
class Carried:
    """What a life of the run hands to the next when a restart heals its failure
    (:func:`pipeline_rl.run.life.run_life`): its rollout workers, renewed there
    (:func:`renew_workers`), and its trainer ranks' spares, adopted there
    (:func:`adopt_spares`) (empty: none)."""

    workers: list[WorkerSlot] = field(default_factory=list)
    spares: list[TrainerHandle] = field(default_factory=list)


def adopt_spares(cfg: Config, spares: Sequence[TrainerHandle], buffer: BufferHandle) -> list[TrainerHandle]:
    """The last life's spare ranks, adopted for this life (``TrainerActor.adopt``); none when
    there are none or one fails to answer within ``_RENEW_TIMEOUT_S`` (every spare is then
    killed: the ranks start as new actors, which one console line says with why)."""
    import ray

    if not spares:
        return []
    refs = [t.adopt.remote(cfg, buffer) for t in spares]
    ray.wait(refs, num_returns=len(refs), timeout=_RENEW_TIMEOUT_S)
    failures = [f for f in map(_failure, refs) if f is not None]
    if len(spares) == cfg.trainer.num_ranks and not failures:
        return list(spares)
    say(f"trainer: spare ranks not adopted ({len(spares)} of {cfg.trainer.num_ranks} ranks: "
        f"{cause_of(failures[0]) if failures else 'a spare per rank is needed'}): new ranks start in their place")
    for t in spares:
        kill(t)
    return []


def renew_workers(cfg: Config, carried: Sequence[WorkerSlot]) -> dict[int, Any]:
    """Ask every carried worker, and its standby, to renew itself for this life (not waited
    for; a standby is up again once its renewal answers, ``WorkerSlot.renew_standby``): its
    slot starts again from no restarts (the group ids and prompts of the life, as a new
    actor's). The workers' ``renew`` calls by index."""
    refs = {}
    for w in carried:
        w.restarts, w.run_ref = 0, None
        standby = w.standby
        if standby is not None:
            w.renew_standby(lambda: standby.renew.remote(cfg))
        refs[w.index] = w.handle.renew.remote(cfg)
    return refs


def renewed(slots: Sequence[WorkerSlot], refs: dict[int, Any], new_rollout: Callable[[int], RolloutHandle]) -> set[int]:
    """Wait up to ``_RENEW_TIMEOUT_S`` for the workers' renewals. A worker that failed to
    renew (its process died, or an engine that cannot be carried) gives its place to its
    standby when that is renewed (the worker, if its process died, becomes the standby Ray
    restarts), else to a new actor; one console line names each such worker, why and what
    took its place. The indices given a new actor."""
    import ray

    calls = RayCalls()
    if refs:
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=_RENEW_TIMEOUT_S)
    replaced, told = set(), []
    for w in slots:
        failure = _failure(refs[w.index]) if w.index in refs else None
        if failure is None:
            continue
        why = f"worker {w.index} not renewed ({cause_of(failure)})"
        died = isinstance(failure, ray.exceptions.RayActorError)
        if w.wait_standby(calls, _RENEW_TIMEOUT_S) and _took_over(w, calls):
            if not died:   # alive but unusable: no standby for this life
                kill(w.standby)
                w.standby = None
            told.append(f"{why}: its standby takes its place")
            continue
        kill(w.handle)
        w.handle = new_rollout(w.index)
        replaced.add(w.index)
        told.append(f"{why}: a new actor starts in its place")
    if told:
        say("rollout: " + "; ".join(told))
    return replaced


def _took_over(w: WorkerSlot, calls: RayCalls) -> bool:
    """Whether ``w``'s renewed standby took the slot, on its core (``WorkerSlot.standby_take_over``)."""
    failed = w.standby_take_over(calls, _RENEW_TIMEOUT_S)
    if failed is not None:   # any failure: a new actor takes the place
        log.info("rollout worker %d: its standby could not take over: %s", w.index, failed)
    return failed is None


def _failure(ref: Any) -> BaseException | None:
    """What a ``renew`` or ``adopt`` call failed with (None: it returned)."""
    import ray

    try:
        ray.get(ref, timeout=0)
        return None
    except Exception as e:  # noqa: BLE001 -- any failure: something else takes its place
        return e
