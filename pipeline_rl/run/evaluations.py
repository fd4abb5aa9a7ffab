"""Held-out evaluation, the driver's half (:class:`Evaluations`): when the workers are asked.

At the start (as soon as the workers generate;
training does not wait for it), every ``--eval.every`` steps and at the end, the same
``--eval.num_prompts`` held-out ids are split over the live workers; training goes on
and the answers are collected after later steps. At most one evaluation is in flight (a
due one is skipped and counted meanwhile); the starting and the final ones are of one
version each (pinned: the workers hold their updates until they have answered), and the
final one is waited for, bounded. The
answers are read through the run's supervisor, the one place that handles a dead worker:
an evaluation with a share on a worker the supervisor reports lost (``WorkerLost``, through
:meth:`Evaluations.worker_lost`) is lost (counted, one line); any other failure is raised.

What a worker does with a request: :mod:`pipeline_rl.rollout.eval_feed`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline_rl.config import EvalConfig
from pipeline_rl.metrics import EvalMetrics
from pipeline_rl.rollout.eval_feed import EvalRequest, EvalResult
from pipeline_rl.run.remote_calls import CallFailed, Calls, RayCalls, WorkerCall, WorkerLost

#: How long a due evaluation waits for the starting one (:meth:`Evaluations.start_due`).
START_WAIT_S = 60.0
#: Reads the answers to calls made to the workers; None when the reader reported them lost
#: (the run's: ``Supervisor.answers``).
ReadAnswers = Callable[[Sequence[WorkerCall]], "list[Any] | None"]

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
    shares: list[WorkerCall]    # refs: ``ObjectRef[EvalResult]``
    stream: bool = True


class Evaluations:
    """Launches, collects and reports held-out evaluations (see the module docstring).
    ``clock`` gives the run's elapsed seconds (for ``EvalMetrics.time_s``); ``calls`` waits
    for the workers' answers (Ray's, unless a test gives stand-ins); ``answers`` reads them:
    the run gives its supervisor's (``Supervisor.answers``), which reports a dead worker's
    share to :meth:`worker_lost` before it returns None; without one, a failure is raised."""

    def __init__(self, cfg: EvalConfig, clock: Callable[[], float], calls: Calls | None = None,
                 answers: ReadAnswers | None = None) -> None:
        self.cfg = cfg
        self._clock = clock
        self._calls: Calls = calls if calls is not None else RayCalls()
        self._answers: ReadAnswers = answers if answers is not None else self._read
        self._next_id = 0
        self._in_flight: _InFlight | None = None
        self.skipped = 0
        self.lost = 0

    @property
    def enabled(self) -> bool:
        return self.cfg.every > 0

    def due(self, step: int) -> bool:
        return self.enabled and step % self.cfg.every == 0

    def launch(self, step: int, version: int, workers: Sequence[Any], *, stream: bool = True) -> bool:
        """Ask ``workers`` (Ray handles of rollout actors, ``workers[i]`` being worker ``i``)
        to evaluate (``stream``: as a side-stream, :class:`EvalFeed`); False (and counted as
        skipped) while the previous evaluation is still running."""
        if self._in_flight is not None:
            self.skipped += 1
            log.info("evaluation after step %d skipped: the one after step %d is still running",
                     step, self._in_flight.step)
            return False
        shares = split_prompts(self.cfg.num_prompts, len(workers))
        eval_id = self._next_id
        self._next_id += 1
        calls = [WorkerCall(i, w.evaluate.remote(EvalRequest(eval_id, share, self.cfg.k, stream)))
                 for i, (w, share) in enumerate(zip(workers, shares))]
        self._in_flight = _InFlight(eval_id, step, version, time.monotonic(), calls, stream)
        return True

    def worker_lost(self, notice: WorkerLost) -> None:
        """The supervisor's notice: the evaluation in flight, if it has a share on that worker,
        is lost (counted, one line)."""
        job = self._in_flight
        if job is None or all(c.index != notice.index for c in job.shares):
            return
        self._in_flight = None
        self.lost += 1
        log.warning("evaluation after step %d lost: rollout worker %d: %s", job.step, notice.index, notice.why)

    def _read(self, calls: Sequence[WorkerCall]) -> list[Any]:
        return [self._calls.get(c.ref) for c in calls]

    def poll(self, timeout_s: float = 0.0) -> EvalMetrics | None:
        """The in-flight evaluation's metrics once all its answers are in (waiting up to
        ``timeout_s``), else None (also when the answers' reader reported it lost)."""
        job = self._in_flight
        if job is None:
            return None
        if self._calls.pending([c.ref for c in job.shares], timeout_s):
            return None
        parts: list[EvalResult] | None = self._answers(job.shares)
        if parts is None or self._in_flight is not job:   # lost: worker_lost was told
            return None
        self._in_flight = None
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

    def begin_start(self, version: int, workers: Sequence[Any]) -> None:
        """As soon as the workers generate: evaluate the starting weights (``version``), all
        at once and not as a side-stream, so each worker holds its weight updates until it
        has answered and ``version_max == version`` (:attr:`EvalFeed.pinned`); training goes
        on meanwhile, and :meth:`collect` records it like any other."""
        if self.enabled:
            self._launch_pinned(version, workers)

    def _await_weights(self, version: int, workers: Sequence[Any], timeout_s: float = START_WAIT_S) -> None:
        """Until every worker holds weights ``version``. A resumed run's workers start from the
        base model's weights and apply the checkpoint's, published at start-up, in the first
        pass of their loop; the starting evaluation pins what a worker holds, so asked before
        that it would measure the base model under the checkpoint's step."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                held = min(self._calls.get(w.stats.remote(), timeout_s).version for w in workers)
            except CallFailed:
                return   # a worker lost at the start: the supervisor reports it
            if held >= version:
                return
            if time.monotonic() > deadline:
                log.warning("starting evaluation: a worker still holds weights v%d, not v%d, after %.0f s",
                            held, version, timeout_s)
                return
            time.sleep(0.02)

    def start_due(self, version: int, workers: Sequence[Any], record: Callable[[EvalMetrics], None], *,
                  last: bool = False) -> None:
        """After the step that made ``version``: launch the evaluation due now, if any. The
        starting evaluation, if still out, is waited for first (at most ``START_WAIT_S``) and
        recorded: it is short, and the due one would otherwise be skipped. After the ``last``
        step the final evaluation goes out, due or not, pinned to the final weights
        (:meth:`_launch_pinned`), beside the final checkpoint."""
        if not self.enabled or not (last or self.due(version)):
            return
        job = self._in_flight
        if job is not None and not job.stream and (done := self.poll(START_WAIT_S)) is not None:
            record(done)
        if last:
            self._launch_pinned(version, workers)
        else:
            self.launch(version, version, workers)

    def _launch_pinned(self, version: int, workers: Sequence[Any]) -> bool:
        """An evaluation of weights ``version`` alone: once every worker holds them (at most
        ``START_WAIT_S``), all at once and not as a side-stream, so no worker applies an update
        until it has answered. A side-stream asked right after the step that made ``version``
        starts on the weights a worker still holds, the version before."""
        self._await_weights(version, workers)
        return self.launch(version, version, workers, stream=False)

    def collect(self, record: Callable[[EvalMetrics], None]) -> None:
        """Between two steps: record the evaluation in flight if it has finished."""
        if self.enabled and (done := self.poll(0.0)) is not None:
            record(done)

    def finish(self, version: int, workers: Sequence[Any], record: Callable[[EvalMetrics], None],
               timeout_s: float) -> None:
        """At the end of a run: wait for the evaluation in flight, then evaluate the final
        weights (unless it already did), pinned to them, and wait; TimeoutError (one line)
        past ``timeout_s``."""
        if not self.enabled:
            return
        done = self.poll(timeout_s)
        if done is not None:
            record(done)
        if self.in_flight_step is not None:
            raise TimeoutError(f"the evaluation after step {self.in_flight_step} did not finish "
                               f"within {timeout_s:.0f} s")
        if done is None or done.version != version:
            self._launch_pinned(version, workers)
            last = self.poll(timeout_s)
            if last is not None:
                record(last)
            elif self.in_flight_step is not None:
                raise TimeoutError(f"the final evaluation did not finish within {timeout_s:.0f} s")
