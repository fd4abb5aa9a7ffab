"""The step lines' worker statistics (``run/recorder.py``'s poll) when a worker is slow to
answer: a worker busy in a weight load or a long engine step answers its stats call seconds
late, and its generation rate must still be its real one (it read 0 in every row of the
GPU check's 0.5 B run), while the training loop never waits for the answer.

The workers and the remote calls are stand-ins on a clock the test moves (the poll's own
clock and the workers' share it, as on one machine); each worker's snapshot is taken when
it answers, as a real worker's is."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from pipeline_rl.rollout.worker_stats import WorkerStats
from pipeline_rl.run import recorder
from pipeline_rl.run.remote_calls import ActorDied, NoAnswer


class Clock:
    """The test's time, in seconds; stands in for the ``time`` module in the recorder."""

    def __init__(self) -> None:
        self.t = 100.0

    def perf_counter(self) -> float:
        return self.t

    def monotonic(self) -> float:
        return self.t

    def time(self) -> float:
        return self.t


class Ref:
    """A remote result that arrives at ``ready_at``; its value is made then (``make(ready_at)``)."""

    def __init__(self, ready_at: float, make: Callable[[float], Any]) -> None:
        self.ready_at, self.make = ready_at, make


class Calls:
    """``Calls`` on the test's clock; reading a result that has not arrived fails (the poll must not wait)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def pending(self, refs: Any, timeout_s: float) -> list[Any]:
        return [r for r in refs if self.clock.t < r.ready_at]

    def get(self, ref: Ref, timeout_s: float | None = None) -> Any:
        if self.clock.t < ref.ready_at:
            raise NoAnswer(TimeoutError("the poll waited for an answer"))
        return ref.make(ref.ready_at)


class Worker:
    """A rollout worker whose tokens count from ``start + warm`` at ``rate`` per second on the
    test's clock (tokens count when a sequence finishes: the first take a while), with one
    weight update applied at ``start`` (a 1,683.6 ms stall); ``delay(n)``: how long after it
    is asked its ``n``-th stats answer arrives (the snapshot is of that moment)."""

    def __init__(self, clock: Clock, rate: float, delay: Callable[[int], float], warm: float = 0.0,
                 eval_rate: float = 0.0) -> None:
        self.clock, self.rate, self.delay, self.warm, self.start = clock, rate, delay, warm, clock.t
        self.eval_rate = eval_rate
        self.asked = 0
        self.fail_next = False
        self.handle = SimpleNamespace(stats=SimpleNamespace(remote=self._ask))

    def _ask(self) -> Ref:
        self.asked += 1
        asked, fail, self.fail_next = self.clock.t, self.fail_next, False
        return Ref(asked + self.delay(self.asked), self._failed if fail else self.snapshot)

    @staticmethod
    def _failed(at: float) -> WorkerStats:
        raise ActorDied(RuntimeError("The actor died unexpectedly"))

    def snapshot(self, at: float) -> WorkerStats:
        return WorkerStats(worker_id=0, version=1, groups_started=0, groups_sent=0,
                           tokens_generated=int(self.rate * max(0.0, at - self.start - self.warm)), steps=0, step_s=0.0,
                           idle_s=0.0, elapsed_s=0.0, stall_ms=(1683.6,), updates_applied=1,
                           updates_rejected=0, send_wait_s=0.0, in_flight_groups=0, at=at,
                           eval_tokens=int(self.eval_rate * (at - self.start)))


@pytest.fixture()
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(recorder, "time", c)
    return c


def poll(clock: Clock, workers: list[Worker]) -> Any:
    buffer = SimpleNamespace(stats=SimpleNamespace(remote=lambda: Ref(clock.t, lambda at: SimpleNamespace(fill=0))))
    slots = [SimpleNamespace(handle=w.handle) for w in workers]
    return recorder._StatsPoll(Calls(clock), slots, buffer)  # type: ignore[arg-type]


def steps(clock: Clock, stats: Any, n: int, step_s: float) -> list[float]:
    """The tokens per second of ``n`` step lines, ``step_s`` apart (as the GPU run's 1.33 s steps)."""
    out = []
    for _ in range(n):
        clock.t += step_s
        stats.update()
        out.append(stats.rates.tokens_per_s)
    return out


def late_after_the_first(n: int) -> float:
    """The first answer at once (the worker not yet busy), every later one 3 s late: past the
    2 s the poll used to wait before it dropped an answer, as while weights keep loading."""
    return 0.0 if n == 1 else 3.0


def test_a_worker_whose_answers_come_late_reports_its_real_rate(clock: Clock) -> None:
    """The old poll dropped every late answer and kept the first window's rates: 0 tokens/s
    (no sequence had finished yet) beside a real stall, in every row, as on the GPU."""
    worker = Worker(clock, rate=1000.0, delay=late_after_the_first, warm=2.0)
    stats = poll(clock, [worker])
    rows = steps(clock, stats, 20, 1.331)
    assert rows[-10:] == [pytest.approx(1000.0, rel=0.01)] * 10, rows   # the old poll: 0.0 in every row
    assert stats.rates.stall_ms == 1683.6


def test_late_workers_add_up_and_one_call_at_a_time_is_in_flight(clock: Clock) -> None:
    prompt, late = Worker(clock, 1000.0, lambda n: 0.0), Worker(clock, 500.0, lambda n: 3.0)
    stats = poll(clock, [prompt, late])
    rows = steps(clock, stats, 80, 0.1)
    assert rows[-1] == pytest.approx(1500.0, rel=0.01)
    assert late.asked == 3                      # asked again only once it answered (every 3 s)
    assert 20 <= prompt.asked <= 1 + 8.0 / recorder._STATS_EVERY_S


def test_evaluation_tokens_are_a_rate_of_their_own(clock: Clock) -> None:
    """A worker evaluating beside training: its evaluation tokens/s is reported apart
    (``eval_tokens_per_s``), summed over the workers, and not in the training tokens/s."""
    a, b = Worker(clock, 1000.0, lambda n: 0.0, eval_rate=300.0), Worker(clock, 500.0, lambda n: 0.0, eval_rate=100.0)
    stats = poll(clock, [a, b])
    rows = steps(clock, stats, 10, 1.0)
    assert rows[-1] == pytest.approx(1500.0, rel=0.01)
    assert stats.rates.eval_tokens_per_s == pytest.approx(400.0, rel=0.01)
    # The run's totals: each worker's answered snapshots 1 s apart (the first is the start, the
    # last one asked is not in yet), never idle here: 8 s busy each.
    g = stats.generated
    assert (g.tokens, g.eval_tokens, g.busy_s) == (pytest.approx(12_000, rel=0.01), pytest.approx(3_200, rel=0.01),
                                                   pytest.approx(16.0))


def test_a_failed_answer_is_skipped_and_a_restarted_worker_starts_afresh(clock: Clock) -> None:
    worker = Worker(clock, 1000.0, lambda n: 0.0)
    stats = poll(clock, [worker])
    steps(clock, stats, 10, 0.3)
    worker.fail_next = True
    assert steps(clock, stats, 3, 0.3)[-1] == pytest.approx(1000.0, rel=0.01)   # the last rate stays
    worker.start, worker.rate = clock.t, 200.0    # its new process counts from zero
    stats.restarted(0)
    assert steps(clock, stats, 10, 0.3)[-1] == pytest.approx(200.0, rel=0.01)
