"""The step recorder: every completed step becomes one :class:`StepMetrics` row (console
line, ``metrics.jsonl``, TensorBoard) with the workers' and the buffer's statistics; the
run ends with its summary table.

Statistics are polled at most every ``_STATS_EVERY_S`` and never waited for: a poll's
answers are taken at a later step once all are in (a worker silent for 2 s is left out
of that window), and each step carries the last completed window's rates. A poll calls
into every worker and the buffer: once a step, it cost them more than it was worth.
A worker's first reward failure is printed once (a warning line on the console), the
rest are counted on the step lines.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from pipeline_rl.metrics import (
    MetricsLogger,
    StepMetrics,
    WeightSyncLatency,
    percentile,
    read_evals,
    read_history,
    summary_table,
)
from pipeline_rl.rollout.worker_stats import EpisodeTally, RewardTally
from pipeline_rl.run.remote_calls import CallFailed, Calls
from pipeline_rl.run.run_folder import RunFolder
from pipeline_rl.run.supervisor import WorkerSlot

if TYPE_CHECKING:
    from pipeline_rl.actors.handles import BufferHandle
    from pipeline_rl.buffer.types import BufferStats
    from pipeline_rl.evaluation import EvalMetrics
    from pipeline_rl.reports import RankStepReport

log = logging.getLogger(__name__)

_STATS_EVERY_S = 0.25      # worker and buffer statistics: one poll at most this often
_HISTORY_STEPS = 1000      # steps of metrics the driver keeps in memory


@dataclass(slots=True)
class _Seen:
    """A worker's counters at its last answered poll (reset when it restarts)."""

    tokens: int = 0
    idle_s: float = 0.0
    stalls: int = 0
    rewards: RewardTally = RewardTally()
    episodes: EpisodeTally = EpisodeTally()


@dataclass(slots=True)
class _Delta:
    """Sums over the workers that answered a poll."""

    tokens: int = 0
    idle_s: float = 0.0
    stalls_ms: list[float] = field(default_factory=list)
    answered: int = 0
    rewards: RewardTally = RewardTally()
    episodes: EpisodeTally = EpisodeTally()


@dataclass(frozen=True, slots=True)
class _Rates:
    """The workers' generation over the last completed window: tokens per second, the share
    of time their engines idled, the mean weight-update stall (ms), the mean weight sync
    (ms, :class:`WeightSyncLatency`) of the versions resolved in it, the mean duration of
    a reward call (s) and the share of time the workers had a reward call in flight."""

    tokens_per_s: float = 0.0
    idle_frac: float = 0.0
    stall_ms: float = 0.0
    sync_ms: float = 0.0
    reward_s: float = 0.0
    reward_busy_frac: float = 0.0
    turns: EpisodeShape | None = None


@dataclass(frozen=True, slots=True)
class EpisodeShape:
    """The episodes ended in a window: turns per episode (mean, max) and the seconds each
    spent in its environment's calls (mean, p90)."""

    turns_mean: float
    turns_max: int
    env_s_mean: float
    env_s_p90: float

    @staticmethod
    def of(tally: EpisodeTally) -> "EpisodeShape | None":
        if not tally.recent:
            return None
        turns, env_s = [r.turns for r in tally.recent], [r.env_s for r in tally.recent]
        return EpisodeShape(statistics.fmean(turns), max(turns), statistics.fmean(env_s), percentile(env_s, 0.9))


def turn_metrics(shape: EpisodeShape | None, run: EpisodeTally) -> dict[str, float]:
    """The turn metrics of a step (``metrics.jsonl`` keys): the last window's ``shape``, and
    the run's counts so far (all workers); none for a run without episodes."""
    if not run.episodes:
        return {}
    out = {"turns_mean": shape.turns_mean, "turns_max": float(shape.turns_max), "env_s_mean": shape.env_s_mean,
           "env_s_p90": shape.env_s_p90} if shape is not None else {}
    out.update({"tool_calls": run.tool_calls, "tool_errors": run.tool_errors, "finish_done": run.done,
                "finish_turns": run.turns, "finish_length": run.length, "finish_env_error": run.env_error,
                "finish_timeout": run.timeout, "env_errors": run.env_errors, "env_timeouts": run.env_timeouts})
    return {k: float(v) for k, v in out.items()}


class _StatsPoll:
    """Worker and buffer statistics for the step lines."""

    def __init__(self, calls: Calls, workers: Sequence[WorkerSlot], buffer: BufferHandle, start: float) -> None:
        self._calls, self._workers, self._buffer = calls, workers, buffer
        self._seen = [_Seen() for _ in workers]
        self._refs: list[Any] = []     # the poll in flight: worker stats..., buffer stats
        self._sent = start             # when the poll in flight was sent
        self._window_start = start     # when the last completed poll was sent
        self.rates = _Rates()
        self.buffer: BufferStats | None = None
        self.sync = WeightSyncLatency(len(workers))
        self.rewards = RewardTally()   # the run's reward calls, all workers (first lives included)
        self.episodes = EpisodeTally()  # the run's episodes, all workers (``recent`` left empty)

    def restarted(self, index: int) -> None:
        self._seen[index] = _Seen()

    def update(self) -> None:
        """Take the poll in flight if it is complete; send the next when it is due. The
        first call waits for the buffer's snapshot (every step line needs one)."""
        now = time.perf_counter()
        if self._refs:
            late = self._calls.pending(self._refs, 0)
            if late and now - self._sent < 2.0:
                return
            self._take(late)
        if now - self._window_start >= _STATS_EVERY_S or self.buffer is None:
            self._refs = [w.handle.stats.remote() for w in self._workers] + [self._buffer.stats.remote()]
            self._sent = now
            if self.buffer is None:
                self.buffer = self._calls.get(self._refs[-1])

    def _take(self, late: list[Any]) -> None:
        *worker_refs, buffer_ref = self._refs
        self._refs = []
        if buffer_ref not in late:
            self.buffer = self._calls.get(buffer_ref)
        delta = _Delta()
        for i, ref in enumerate(worker_refs):
            if ref not in late:
                self._count(i, ref, delta)
        synced = self.sync.resolve()
        window = self._sent - self._window_start
        self._window_start = self._sent
        if window <= 0 or not delta.answered:
            return
        r = delta.rewards
        self.rates = _Rates(
            tokens_per_s=delta.tokens / window,
            idle_frac=min(1.0, delta.idle_s / (window * delta.answered)),
            stall_ms=statistics.fmean(delta.stalls_ms) if delta.stalls_ms else self.rates.stall_ms,
            sync_ms=statistics.fmean(synced) if synced else self.rates.sync_ms,
            reward_s=r.seconds / r.calls if r.calls else self.rates.reward_s,
            reward_busy_frac=min(1.0, r.busy_s / (window * delta.answered)),
            turns=EpisodeShape.of(delta.episodes) or self.rates.turns)

    def _count(self, i: int, ref: Any, delta: _Delta) -> None:
        try:
            st = self._calls.get(ref)
        except CallFailed:
            return
        seen = self._seen[i]
        delta.tokens += max(0, st.tokens_generated - seen.tokens)
        delta.idle_s += max(0.0, st.idle_s - seen.idle_s)
        new = st.updates_applied - seen.stalls  # stall_ms holds the most recent ones only
        delta.stalls_ms += list(st.stall_ms[-new:]) if new > 0 else []
        delta.answered += 1
        rewards = st.rewards.minus(seen.rewards)
        delta.rewards = delta.rewards.plus(rewards)
        self.rewards = self.rewards.plus(rewards)
        if st.rewards.first_error and not seen.rewards.first_error:
            log.warning("rollout worker %d: %s (scored 0; further reward failures are counted on the "
                        "step lines)", i, st.rewards.first_error)
        seen.tokens, seen.idle_s, seen.stalls = st.tokens_generated, st.idle_s, st.updates_applied
        seen.rewards = st.rewards
        episodes = st.episodes.minus(seen.episodes)
        delta.episodes = delta.episodes.plus(episodes)
        self.episodes = self.episodes.plus(replace(episodes, recent=()))
        seen.episodes = st.episodes
        for applied in st.applied:
            self.sync.applied(i, applied.version, applied.at)


class StepRecorder:
    """Turns each completed step into its metrics row and writes it (see the module
    docstring); keeps the most recent ``_HISTORY_STEPS`` rows in memory (the whole record
    is ``OUT_DIR/metrics.jsonl``)."""

    def __init__(self, folder: RunFolder, calls: Calls, workers: Sequence[WorkerSlot], buffer: BufferHandle) -> None:
        """``folder``: the run's; a resumed run's clock goes on from the time it had reached."""
        self.out = out = folder.path
        self._elapsed_before = folder.elapsed_s
        self._workers = workers
        self.start = self._last_step_end = time.perf_counter()
        self._stats = _StatsPoll(calls, workers, buffer, self.start)
        out.mkdir(parents=True, exist_ok=True)
        self._logger = MetricsLogger(out)
        self.history: deque[StepMetrics] = deque(maxlen=_HISTORY_STEPS)
        self.steps_done = 0

    def since_start(self) -> float:
        return self._elapsed_before + time.perf_counter() - self.start

    def worker_restarted(self, index: int) -> None:
        self._stats.restarted(index)

    def record(self, reports: Sequence[RankStepReport], version: int) -> StepMetrics:
        """The step that reached ``version``, from every rank's report: logged and returned."""
        now = time.perf_counter()
        step_wall, self._last_step_end = now - self._last_step_end, now
        self._stats.sync.published(version, reports[0].step_end_at)   # rank 0 publishes
        self._stats.update()
        m = self._metrics(reports, version, step_wall)
        self.history.append(m)
        self.steps_done += 1
        self._logger.log(m)
        return m

    def _metrics(self, reports: Sequence[RankStepReport], version: int, step_wall: float) -> StepMetrics:
        rates, buf = self._stats.rates, self._stats.buffer
        assert buf is not None
        res = [r.result for r in reports]
        lm = res[0].metrics
        return StepMetrics(
            step=version, version=version, time_s=self.since_start(),
            reward_mean=statistics.fmean(r.reward_mean for r in res),
            tokens_per_s=rates.tokens_per_s,
            lag_mean=statistics.fmean(r.lag.mean for r in res), lag_max=max(r.lag.max for r in res),
            evicted=sum(buf.evicted.values()), mismatch_kl=float(lm.mismatch_kl_k1),
            masked_frac=float(lm.masked_token_frac),
            mixed_version_frac=statistics.fmean(r.mixed_version_frac for r in res),
            trainer_idle_frac=min(1.0, max(r.wait_s for r in reports) / step_wall) if step_wall else 0.0,
            weight_update_stall_ms=rates.stall_ms, weight_sync_ms=rates.sync_ms,
            reward_errors=self._stats.rewards.errors, reward_timeouts=self._stats.rewards.timeouts,
            reward_unscored=self._stats.rewards.unscored,
            reward_s=rates.reward_s, reward_busy_frac=rates.reward_busy_frac,
            step_time_s=step_wall, loss=float(res[0].loss), buffer_fill=buf.fill,
            completion_len_mean=sum(r.num_tokens for r in res) / max(1, sum(r.num_seqs for r in res)),
            entropy=statistics.fmean(r.entropy for r in res),
            extra={"mismatch_kl_k3": float(lm.mismatch_kl_k3), "ess": float(lm.ess),
                   "masked_seq_frac": float(lm.masked_seq_frac), "clipped_frac": float(lm.clipped_frac),
                   "train_step_s": float(res[0].step_time_s), "groups_lost": float(buf.admission.lost),
                   "worker_restarts": float(sum(w.restarts for w in self._workers)),
                   "generator_idle_frac": rates.idle_frac,
                   **turn_metrics(rates.turns, self._stats.episodes),
                   # Wall clock, so a caller can measure from its own start (start-up included).
                   "unix_time_s": time.time()},
        )

    def log_eval(self, metrics: EvalMetrics) -> None:
        self._logger.log_eval(metrics)

    def summary(self) -> str:
        """The run's summary table, from its whole record read back (flushed first)."""
        self._logger.close()
        history = read_history(self.out / "metrics.jsonl")   # the folder holds this run only
        ran = read_evals(self.out / "eval.jsonl")
        return summary_table(history, ran, self._stats.sync.all_ms)

    def close(self) -> None:
        self._logger.close()
