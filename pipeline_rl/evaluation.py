"""Driver side of held-out evaluation: when to evaluate, on which workers, and what to log.

Every ``--eval.every`` steps (and once at the end) the driver splits the
``--eval.num_prompts`` held-out prompt ids (the same ones each time: ids
``0 .. num_prompts-1`` of the task's eval split) over the live rollout workers and
asks each for its share (``RolloutActor.evaluate``). Training goes on meanwhile;
the answers are collected after later steps (:meth:`Evaluations.poll`). At most
one evaluation is in flight: one that is due while the previous is still running
is skipped (and counted), so evaluation can never fall behind and pile up.
The final evaluation is waited for (bounded by ``timeout_s``) before the summary.

A worker that dies during an evaluation loses that evaluation (logged; the
driver's supervision restarts the worker); any other failure is raised.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeline_rl.actors.evaluation import EvalRequest, EvalResult
from pipeline_rl.config import EvalConfig
from pipeline_rl.metrics import EvalMetrics

if TYPE_CHECKING:
    from ray import ObjectRef

log = logging.getLogger("pipeline_rl.evaluation")


def split_prompts(num_prompts: int, num_workers: int) -> list[tuple[int, ...]]:
    """Contiguous, near-equal shares of ``0 .. num_prompts-1`` (empty shares dropped)."""
    base, extra = divmod(num_prompts, num_workers)
    out, start = [], 0
    for w in range(num_workers):
        size = base + (1 if w < extra else 0)
        if size:
            out.append(tuple(range(start, start + size)))
        start += size
    return out


@dataclass(slots=True)
class _InFlight:
    eval_id: int
    step: int
    version: int
    launched: float
    refs: "list[ObjectRef[EvalResult]]"


class Evaluations:
    """Launches, collects and reports held-out evaluations (see the module docstring).
    ``clock`` gives the run's elapsed seconds (for ``EvalMetrics.time_s``)."""

    def __init__(self, cfg: EvalConfig, clock: Callable[[], float]) -> None:
        self.cfg = cfg
        self._clock = clock
        self._next_id = 0
        self._in_flight: _InFlight | None = None
        self.skipped = 0
        self.lost = 0

    @property
    def enabled(self) -> bool:
        return self.cfg.every > 0

    def due(self, step: int) -> bool:
        return self.enabled and step % self.cfg.every == 0

    def launch(self, step: int, version: int, workers: Sequence[Any]) -> bool:
        """Ask ``workers`` (Ray handles of rollout actors) to evaluate; False (and counted
        as skipped) while the previous evaluation is still running."""
        if self._in_flight is not None:
            self.skipped += 1
            log.info("evaluation after step %d skipped: the one after step %d is still running",
                     step, self._in_flight.step)
            return False
        shares = split_prompts(self.cfg.num_prompts, len(workers))
        eval_id = self._next_id
        self._next_id += 1
        refs = [w.evaluate.remote(EvalRequest(eval_id, share, self.cfg.k)) for w, share in zip(workers, shares)]
        self._in_flight = _InFlight(eval_id, step, version, time.monotonic(), refs)
        return True

    def poll(self, timeout_s: float = 0.0) -> EvalMetrics | None:
        """The in-flight evaluation's metrics once all its answers are in (waiting up to
        ``timeout_s``), else None."""
        import ray

        job = self._in_flight
        if job is None:
            return None
        ready, pending = ray.wait(job.refs, num_returns=len(job.refs), timeout=timeout_s)
        if pending:
            return None
        self._in_flight = None
        try:
            parts: list[EvalResult] = ray.get(ready)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            self.lost += 1
            log.warning("evaluation after step %d lost: a rollout worker died (%s)", job.step,
                        str(e).splitlines()[0] if str(e) else type(e).__name__)
            return None
        res = EvalResult.merge(parts)
        return EvalMetrics(
            step=job.step, version=job.version, time_s=self._clock(),
            greedy_accuracy=res.greedy_accuracy, mean_at_k=res.mean_at_k, pass_at_k=res.pass_at_k,
            k=res.k, num_prompts=res.num_prompts, version_min=res.version_min, version_max=res.version_max,
            eval_s=time.monotonic() - job.launched,
            greedy_len_mean=res.greedy_tokens / res.num_prompts if res.num_prompts else 0.0)

    @property
    def in_flight_step(self) -> int | None:
        return None if self._in_flight is None else self._in_flight.step
