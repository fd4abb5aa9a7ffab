"""The step recorder: every completed step becomes one :class:`StepMetrics` row (console
line, ``metrics.jsonl``, TensorBoard) with the workers' and the buffer's statistics; the
run ends with its summary table.

Statistics are polled at most every ``_STATS_EVERY_S`` per actor and never waited for:
each worker (and the buffer) has at most one stats call in flight, its answer is taken at
whichever later step finds it in, however late, and a worker's rates are measured over
its own clock between two of its snapshots (``WorkerStats.at``), so an answer delayed by a
weight load or a long engine step neither drops nor distorts them. Each step carries
the rates of every worker's last interval (tokens per second: their sum). Asking every
worker once a step cost them more than it was worth.
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
from pipeline_rl.rollout.worker_stats import AgentMetric, EpisodeTally, RewardTally, WorkerStats
from pipeline_rl.run.remote_calls import CallFailed, Calls
from pipeline_rl.run.life.run_folder import RunFolder
from pipeline_rl.run.life.slots import WorkerSlot

if TYPE_CHECKING:
    from pipeline_rl.actors.handles import BufferHandle
    from pipeline_rl.buffer.types import BufferStats
    from pipeline_rl.metrics import EvalMetrics
    from pipeline_rl.reports import RankStepReport

log = logging.getLogger(__name__)

_STATS_EVERY_S = 0.25      # worker and buffer statistics: one call to each actor at most this often
_HISTORY_STEPS = 1000      # steps of metrics the driver keeps in memory


@dataclass(frozen=True, slots=True)
class _WorkerRates:
    """One worker over the interval between its last two snapshots (its own clock): tokens
    generated per second (training samples'; ``eval_tokens_per_s``: held-out evaluations'),
    and the shares of that time its engine idled and it had a reward call in flight."""

    tokens_per_s: float
    idle_frac: float
    reward_busy_frac: float
    eval_tokens_per_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Generated:
    """What the workers generated over the run's snapshots so far (all workers; a restarted
    worker's from its new life's second snapshot): training samples' tokens, held-out
    evaluations' tokens, and the seconds their engines were busy (not idle on the admission
    budget). Its difference between two steps gives tokens per busy second over them, which
    no single step's window measures as well."""

    tokens: int = 0
    eval_tokens: int = 0
    busy_s: float = 0.0

    def plus(self, other: "Generated") -> "Generated":
        return Generated(self.tokens + other.tokens, self.eval_tokens + other.eval_tokens,
                         self.busy_s + other.busy_s)


@dataclass(slots=True)
class _Seen:
    """A worker as the poll sees it (reset when it restarts): its counters at its last
    answered snapshot (``at``: the worker's clock then, None before the first), its rates
    since the one before, and its stats call in flight (``ref``, sent at ``sent``)."""

    at: float | None = None
    tokens: int = 0
    eval_tokens: int = 0
    idle_s: float = 0.0
    stalls: int = 0
    rewards: RewardTally = RewardTally()
    episodes: EpisodeTally = EpisodeTally()
    rates: _WorkerRates | None = None
    ref: Any = None
    sent: float = float("-inf")


@dataclass(slots=True)
class _Delta:
    """Sums over the snapshots taken at one update."""

    stalls_ms: list[float] = field(default_factory=list)
    rewards: RewardTally = RewardTally()
    episodes: EpisodeTally = EpisodeTally()


@dataclass(frozen=True, slots=True)
class _Rates:
    """The workers' generation over each one's last interval: tokens per second (summed;
    training samples', and held-out evaluations' apart), the share of time their engines
    idled (mean), the mean weight-update stall (ms) and weight sync (ms,
    :class:`WeightSyncLatency`) of the updates last reported, the mean duration of a reward
    call (s) and the share of time the workers had a reward call in flight (mean)."""

    tokens_per_s: float = 0.0
    eval_tokens_per_s: float = 0.0
    idle_frac: float = 0.0
    stall_ms: float = 0.0
    sync_ms: float = 0.0
    reward_s: float = 0.0
    reward_busy_frac: float = 0.0
    turns: EpisodeShape | None = None


@dataclass(frozen=True, slots=True)
class EpisodeShape:
    """The episodes ended in a window: turns per episode (mean, max), the seconds each
    spent in its environment's calls (mean, p90), and each of the agents' own metrics
    averaged over the episodes that returned it (``metrics.jsonl``: ``agent/NAME``)."""

    turns_mean: float
    turns_max: int
    env_s_mean: float
    env_s_p90: float
    agent: tuple[AgentMetric, ...] = ()

    @staticmethod
    def of(tally: EpisodeTally) -> "EpisodeShape | None":
        if not tally.recent:
            return None
        turns, env_s = [r.turns for r in tally.recent], [r.env_s for r in tally.recent]
        by_name: dict[str, list[float]] = {}
        for m in (m for r in tally.recent for m in r.metrics):
            by_name.setdefault(m.name, []).append(m.value)
        agent = tuple(AgentMetric(k, statistics.fmean(v)) for k, v in sorted(by_name.items()))
        return EpisodeShape(statistics.fmean(turns), max(turns), statistics.fmean(env_s), percentile(env_s, 0.9),
                            agent)


def turn_metrics(shape: EpisodeShape | None, run: EpisodeTally) -> dict[str, float]:
    """The turn metrics of a step (``metrics.jsonl`` keys): the last window's ``shape``, and
    the run's counts so far (all workers); none for a run without episodes."""
    if not run.episodes:
        return {}
    out = {"turns_mean": shape.turns_mean, "turns_max": float(shape.turns_max), "env_s_mean": shape.env_s_mean,
           "env_s_p90": shape.env_s_p90, **{f"agent/{m.name}": m.value for m in shape.agent}} \
        if shape is not None else {}
    out.update({"tool_calls": run.tool_calls, "tool_errors": run.tool_errors, "finish_done": run.done,
                "finish_turns": run.turns, "finish_length": run.length, "finish_env_error": run.env_error,
                "finish_timeout": run.timeout, "env_errors": run.env_errors, "env_timeouts": run.env_timeouts,
                "samples_split": run.samples_split, "endpoint_refused": run.endpoint_refused})
    return {k: float(v) for k, v in out.items()}


class _StatsPoll:
    """Worker and buffer statistics for the step lines (see the module docstring)."""

    def __init__(self, calls: Calls, workers: Sequence[WorkerSlot], buffer: BufferHandle) -> None:
        self._calls, self._workers, self._buffer = calls, workers, buffer
        self._seen = [_Seen() for _ in workers]
        self._buffer_ref: Any = None   # the buffer's stats call in flight
        self._buffer_sent = float("-inf")
        self.rates = _Rates()
        self.buffer: BufferStats | None = None
        self.sync = WeightSyncLatency(len(workers))
        self.rewards = RewardTally()   # the run's reward calls, all workers (first lives included)
        self.episodes = EpisodeTally()  # the run's episodes, all workers (``recent`` left empty)
        self.generated = Generated()    # the run's generation, all workers

    def restarted(self, index: int) -> None:
        self._seen[index] = _Seen()    # its call in flight went to the process that died

    def update(self) -> None:
        """Take the answers that are in, then ask every actor without a call in flight whose
        last call is ``_STATS_EVERY_S`` old. Never waits, except for the buffer's first
        snapshot (every step line needs one)."""
        now = time.perf_counter()
        out = [s.ref for s in self._seen if s.ref is not None]
        if self._buffer_ref is not None:
            out.append(self._buffer_ref)
        late = self._calls.pending(out, 0) if out else []
        if self._buffer_ref is not None and self._buffer_ref not in late:
            self.buffer = self._calls.get(self._buffer_ref)
            self._buffer_ref = None
        delta, answered = _Delta(), False
        for i, seen in enumerate(self._seen):
            if seen.ref is not None and seen.ref not in late:
                answered |= self._count(i, delta)
        synced = self.sync.resolve()
        if answered or synced:
            self._set_rates(delta, synced)
        self._ask(now)
        if self.buffer is None:
            self.buffer = self._calls.get(self._buffer_ref)
            self._buffer_ref = None

    def _ask(self, now: float) -> None:
        for seen, w in zip(self._seen, self._workers):
            if seen.ref is None and now - seen.sent >= _STATS_EVERY_S:
                seen.ref, seen.sent = w.handle.stats.remote(), now
        if self._buffer_ref is None and (now - self._buffer_sent >= _STATS_EVERY_S or self.buffer is None):
            self._buffer_ref, self._buffer_sent = self._buffer.stats.remote(), now

    def _set_rates(self, delta: _Delta, synced: list[float]) -> None:
        """The rates after new snapshots: every worker's last interval, the updates and
        reward calls ``delta`` reports and the syncs just resolved (else the previous values)."""
        known = [s.rates for s in self._seen if s.rates is not None]
        r = delta.rewards
        self.rates = _Rates(
            tokens_per_s=sum(k.tokens_per_s for k in known),
            eval_tokens_per_s=sum(k.eval_tokens_per_s for k in known),
            idle_frac=statistics.fmean(k.idle_frac for k in known) if known else self.rates.idle_frac,
            stall_ms=statistics.fmean(delta.stalls_ms) if delta.stalls_ms else self.rates.stall_ms,
            sync_ms=statistics.fmean(synced) if synced else self.rates.sync_ms,
            reward_s=r.seconds / r.calls if r.calls else self.rates.reward_s,
            reward_busy_frac=(statistics.fmean(k.reward_busy_frac for k in known) if known
                              else self.rates.reward_busy_frac),
            turns=EpisodeShape.of(delta.episodes) or self.rates.turns)

    def _count(self, i: int, delta: _Delta) -> bool:
        """Take worker ``i``'s answer into ``delta`` and its rates; False when it failed."""
        seen = self._seen[i]
        ref, seen.ref = seen.ref, None
        try:
            st = self._calls.get(ref)
        except CallFailed:
            return False
        if seen.at is not None and st.at > seen.at:
            seen.rates, generated = _interval(seen, st)
            self.generated = self.generated.plus(generated)
        new = st.updates_applied - seen.stalls  # stall_ms holds the most recent ones only
        delta.stalls_ms += list(st.stall_ms[-new:]) if new > 0 else []
        rewards = st.rewards.minus(seen.rewards)
        delta.rewards = delta.rewards.plus(rewards)
        self.rewards = self.rewards.plus(rewards)
        if st.rewards.first_error and not seen.rewards.first_error:
            log.warning("rollout worker %d: %s (scored 0; further reward failures are counted on the "
                        "step lines)", i, st.rewards.first_error)
        seen.at, seen.tokens, seen.idle_s, seen.stalls = st.at, st.tokens_generated, st.idle_s, st.updates_applied
        seen.eval_tokens = st.eval_tokens
        seen.rewards = st.rewards
        episodes = st.episodes.minus(seen.episodes)
        delta.episodes = delta.episodes.plus(episodes)
        self.episodes = self.episodes.plus(replace(episodes, recent=()))
        seen.episodes = st.episodes
        for applied in st.applied:
            self.sync.applied(i, applied.version, applied.at)
        return True


def _interval(seen: _Seen, st: WorkerStats) -> tuple[_WorkerRates, Generated]:
    """A worker between its snapshot ``seen`` and ``st`` (later, on its own clock): its rates,
    and what it generated."""
    span = st.at - (seen.at or 0.0)
    tokens, evals = max(0, st.tokens_generated - seen.tokens), max(0, st.eval_tokens - seen.eval_tokens)
    idle = min(span, max(0.0, st.idle_s - seen.idle_s))
    reward_busy = min(span, max(0.0, st.rewards.busy_s - seen.rewards.busy_s))
    return (_WorkerRates(tokens / span, idle / span, reward_busy / span, evals / span),
            Generated(tokens, evals, span - idle))


class StepRecorder:
    """Turns each completed step into its metrics row and writes it (see the module
    docstring); keeps the most recent ``_HISTORY_STEPS`` rows in memory (the whole record
    is ``OUT_DIR/metrics.jsonl``)."""

    def __init__(self, folder: RunFolder, calls: Calls, workers: Sequence[WorkerSlot], buffer: BufferHandle,
                 restarts: int = 0) -> None:
        """``folder``: the run's; a resumed run's clock goes on from the time it had reached;
        ``restarts``: the run's restarts so far (``run/life/heal.py``), on every row."""
        self._restarts = restarts
        self.out = out = folder.path
        self._elapsed_before = folder.elapsed_s
        self._workers = workers
        self.start = self._last_step_end = time.perf_counter()
        self._stats = _StatsPoll(calls, workers, buffer)
        self._stats.update()   # the first snapshots, so the first step's rates have a start
        out.mkdir(parents=True, exist_ok=True)
        self._logger = MetricsLogger(out)
        if folder.mark is not None:
            self._logger.log_resume(folder.mark.number, folder.mark.resumed_at, folder.line())
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
        rates, buf, gen = self._stats.rates, self._stats.buffer, self._stats.generated
        assert buf is not None
        res = [r.result for r in reports]
        lm = res[0].metrics
        return StepMetrics(
            step=version, version=version, time_s=self.since_start(),
            reward_mean=statistics.fmean(r.reward_mean for r in res),
            tokens_per_s=rates.tokens_per_s,
            lag_mean=statistics.fmean(r.lag.mean for r in res), lag_max=max(r.lag.max for r in res),
            evicted=sum(buf.evicted.values()), zero_variance_groups=buf.zero_variance, mismatch_kl=float(lm.mismatch_kl_k1),
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
            lr=res[0].lr,
            extra={"mismatch_kl_k3": float(lm.mismatch_kl_k3), "ess": float(lm.ess),
                   "masked_seq_frac": float(lm.masked_seq_frac), "clipped_frac": float(lm.clipped_frac),
                   "train_step_s": float(res[0].step_time_s), "groups_lost": float(buf.admission.lost),
                   "worker_restarts": float(sum(w.restarts for w in self._workers)),
                   "restarts": float(self._restarts),
                   "generator_idle_frac": rates.idle_frac, "eval_tokens_per_s": rates.eval_tokens_per_s,
                   "generated_tokens": float(gen.tokens), "generated_eval_tokens": float(gen.eval_tokens),
                   "generator_busy_s": gen.busy_s,
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
        table = summary_table(history, ran, self._stats.sync.all_ms)
        restarts = int(history[-1].extra.get("restarts", 0)) if history else 0
        if not restarts:
            return table
        width = table.index(" | value |") - 2
        return f"{table}\n| {'run restarts (--run.max_restarts)':<{width}} | {restarts} |"

    def close(self) -> None:
        self._logger.close()
