"""A rollout worker's statistics (``pipeline_rl.rollout.worker``): the counters it keeps
under its lock, the snapshot it reports (:class:`WorkerStats`), and the window of
applied updates it remembers."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

#: Applied updates whose stall a worker remembers (``WorkerStats.stall_ms``): a run applies
#: one update per trainer step, so keeping them all would grow the worker (and every stats
#: reply) without bound; a poller that reads the stats once per step needs the last few.
STALL_WINDOW = 256


@dataclass(frozen=True, slots=True)
class AppliedAt:
    """When a worker's engine could first sample with weights ``version`` (``time.time()``)."""

    version: int
    at: float


@dataclass(frozen=True, slots=True)
class RewardTally:
    """A worker's reward calls so far (see the fields). A completion fails when its call
    raised, returned a non-number or a non-finite one, or ran past ``--task.reward_timeout_s``."""

    calls: int = 0          # calls ended: one per completion, or per group (built-in, remote)
    seconds: float = 0.0    # their summed duration
    busy_s: float = 0.0     # wall time with at least one call in flight
    errors: int = 0         # completions scored 0 because their call failed (not by timeout)
    timeouts: int = 0       # completions scored 0 because their call timed out
    first_error: str | None = None  # the first failure, one line (None while none)
    unscored: int = 0       # completions a reward gave no score (None, TRL's convention): scored 0

    def minus(self, old: "RewardTally") -> "RewardTally":
        """What happened since ``old`` (an earlier tally of the same worker), never negative."""
        return RewardTally(max(0, self.calls - old.calls), max(0.0, self.seconds - old.seconds),
                           max(0.0, self.busy_s - old.busy_s), max(0, self.errors - old.errors),
                           max(0, self.timeouts - old.timeouts), self.first_error,
                           max(0, self.unscored - old.unscored))

    def plus(self, other: "RewardTally") -> "RewardTally":
        return RewardTally(self.calls + other.calls, self.seconds + other.seconds, self.busy_s + other.busy_s,
                           self.errors + other.errors, self.timeouts + other.timeouts,
                           self.first_error or other.first_error, self.unscored + other.unscored)


#: Ended episodes whose turns and environment time a worker remembers (``EpisodeTally.recent``).
EPISODE_WINDOW = 1024


@dataclass(frozen=True, slots=True)
class AgentMetric:
    """One number an agent returned beside its reward (``{"reward": 1.0, "tool_calls": 3}``)."""

    name: str
    value: float


@dataclass(frozen=True, slots=True)
class EpisodeRecord:
    """One ended episode, as the turn metrics read it: the model's turns, the seconds its
    environment (or agent) calls took, and the agent's own metrics (none for an environment)."""

    turns: int
    env_s: float
    metrics: tuple[AgentMetric, ...] = ()


@dataclass(frozen=True, slots=True)
class EpisodeTally:
    """A worker's multi-turn episodes so far. ``episodes``: ended (``ok``: of them, those whose
    environment never failed); ``recent``: the most recent ones (at most ``EPISODE_WINDOW``,
    oldest first), so those ended since an earlier tally ``old`` are
    ``recent[-(episodes - old.episodes):]``; ``tool_calls`` / ``tool_errors``: what the
    environments reported; ``done`` ... ``timeout``: episodes by how they ended (the
    environment ended it, the turn cap, the context, the environment failed, it timed out);
    ``env_errors`` / ``env_timeouts``: environment calls that failed / timed out (one per
    failed episode: it ends there); agents (``rollout/agents/runner.py``): ``samples_split``, samples
    beyond one per episode (an agent rewrote its history), ``endpoint_refused``, requests to
    the endpoint without the run's key."""

    episodes: int = 0
    ok: int = 0
    recent: tuple[EpisodeRecord, ...] = ()
    tool_calls: int = 0
    tool_errors: int = 0
    done: int = 0
    turns: int = 0
    length: int = 0
    env_error: int = 0
    timeout: int = 0
    env_errors: int = 0
    env_timeouts: int = 0
    samples_split: int = 0
    endpoint_refused: int = 0

    def since(self, old: "EpisodeTally") -> tuple[EpisodeRecord, ...]:
        """The episodes ended since ``old`` (an earlier tally of the same worker) that are remembered."""
        new = self.episodes - old.episodes
        return self.recent[-new:] if new > 0 else ()

    def counts(self) -> tuple[int, ...]:
        """The counters, in field order (``recent`` left out)."""
        return (self.episodes, self.ok, self.tool_calls, self.tool_errors, self.done, self.turns, self.length,
                self.env_error, self.timeout, self.env_errors, self.env_timeouts, self.samples_split,
                self.endpoint_refused)

    def minus(self, old: "EpisodeTally") -> "EpisodeTally":
        """The counts since ``old`` (never negative; ``recent``: the episodes since it)."""
        diff = [max(0, a - b) for a, b in zip(self.counts(), old.counts())]
        return EpisodeTally(diff[0], diff[1], self.since(old), *diff[2:])

    def plus(self, other: "EpisodeTally") -> "EpisodeTally":
        """Both tallies' counts summed (``recent``: both, this one's first)."""
        both = [a + b for a, b in zip(self.counts(), other.counts())]
        return EpisodeTally(both[0], both[1], self.recent + other.recent, *both[2:])


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """A snapshot of one worker. ``stall_ms``: for the most recent applied updates (at
    most ``STALL_WINDOW``, oldest first), the time no engine step could run;
    ``updates_applied`` counts every applied update, so the ``k`` applied since a
    previous snapshot are ``stall_ms[-k:]`` (when ``k <= STALL_WINDOW``), and
    ``stall_ms_total`` sums the stalls of all of them; ``idle_s``: time the engine
    had nothing to run; ``step_s``: time inside engine steps; ``send_wait_s``: time
    sends were blocked by a full buffer (in the reward/send threads, not the
    engine's); ``heap_trim_s``: time spent handing free heap pages back to the OS
    (``HeapTrimmer``, on the engine's thread between steps); ``applied``: when the most
    recent applied updates went live (at most ``STALL_WINDOW``, oldest first); ``rewards``:
    its reward calls (:class:`RewardTally`); ``episodes``: its multi-turn episodes
    (:class:`EpisodeTally`); ``tokens_generated``: the tokens of training samples,
    ``eval_tokens``: those of held-out evaluations (the same engine's work, counted apart so
    a training throughput is not an evaluation's); ``at``: the worker's clock
    (``time.monotonic()``) when the snapshot was taken, so a poller measures rates over the
    worker's own time between two snapshots, however late each answer reaches it."""

    worker_id: int
    version: int
    groups_started: int
    groups_sent: int
    tokens_generated: int
    steps: int
    step_s: float
    idle_s: float
    elapsed_s: float
    stall_ms: tuple[float, ...]
    updates_applied: int
    updates_rejected: int
    send_wait_s: float
    in_flight_groups: int
    stall_ms_total: float = 0.0
    heap_trim_s: float = 0.0
    eval_tokens: int = 0
    applied: tuple[AppliedAt, ...] = ()
    rewards: RewardTally = RewardTally()
    episodes: EpisodeTally = EpisodeTally()
    at: float = 0.0

    @property
    def reward_errors(self) -> int:
        """Completions scored 0 because their reward failed (raised, non-number, timed out)."""
        return self.rewards.errors + self.rewards.timeouts

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_generated / self.elapsed_s if self.elapsed_s > 0 else 0.0


@dataclass(slots=True)
class Counters:
    """What a worker counts (under its lock); :class:`WorkerStats` is a snapshot of it."""

    groups_started: int = 0
    groups_sent: int = 0
    tokens: int = 0
    eval_tokens: int = 0            # tokens of held-out evaluation answers (not in ``tokens``)
    steps: int = 0
    step_s: float = 0.0
    idle_s: float = 0.0
    elapsed_s: float = 0.0
    updates_rejected: int = 0
    reward_ok: int = 0              # completions a reward call scored (a number came back)
    reward_calls: int = 0           # the fields of RewardTally, as counted
    reward_s: float = 0.0
    reward_busy_s: float = 0.0
    reward_errors: int = 0
    reward_timeouts: int = 0
    reward_first_error: str | None = None
    reward_unscored: int = 0        # completions a reward gave no score (None)
    reward_in_flight: int = 0       # reward calls running now
    reward_busy_since: float = 0.0  # perf_counter() when reward_in_flight last left 0
    env_ok: int = 0                 # episodes ended without their environment failing
    env_errors: int = 0             # environment calls failed (raised, no EnvReply) / timed out
    env_timeouts: int = 0
    episodes: int = 0               # episodes ended, and how (EpisodeTally)
    episode_ends: dict[str, int] = field(default_factory=dict)
    tool_calls: int = 0
    tool_errors: int = 0
    samples_split: int = 0          # agents: samples beyond one per episode; requests without the key
    endpoint_refused: int = 0
    recent_episodes: deque[EpisodeRecord] = field(default_factory=lambda: deque(maxlen=EPISODE_WINDOW))
    updates_applied: int = 0
    stall_ms_total: float = 0.0
    stall_ms: deque[float] = field(default_factory=lambda: deque(maxlen=STALL_WINDOW))
    applied: deque[AppliedAt] = field(default_factory=lambda: deque(maxlen=STALL_WINDOW))

    def snapshot(self, worker_id: int, version: int, send_wait_s: float, in_flight_groups: int,
                 heap_trim_s: float) -> WorkerStats:
        """These counts as :class:`WorkerStats` (the caller holds the worker's lock)."""
        c = self
        busy = c.reward_busy_s + (time.perf_counter() - c.reward_busy_since if c.reward_in_flight else 0.0)
        rewards = RewardTally(c.reward_calls, c.reward_s, busy, c.reward_errors, c.reward_timeouts,
                              c.reward_first_error, c.reward_unscored)
        return WorkerStats(
            worker_id=worker_id, version=version, groups_started=c.groups_started,
            groups_sent=c.groups_sent, tokens_generated=c.tokens, steps=c.steps, step_s=c.step_s,
            idle_s=c.idle_s, elapsed_s=c.elapsed_s, stall_ms=tuple(c.stall_ms),
            updates_applied=c.updates_applied, stall_ms_total=c.stall_ms_total,
            updates_rejected=c.updates_rejected, eval_tokens=c.eval_tokens,
            send_wait_s=send_wait_s, in_flight_groups=in_flight_groups, heap_trim_s=heap_trim_s,
            applied=tuple(c.applied), rewards=rewards, episodes=self._episode_tally(), at=time.monotonic())

    def _episode_tally(self) -> EpisodeTally:
        ends = self.episode_ends
        return EpisodeTally(self.episodes, self.env_ok, tuple(self.recent_episodes), self.tool_calls,
                            self.tool_errors, ends.get("done", 0), ends.get("turns", 0), ends.get("length", 0),
                            ends.get("env_error", 0), ends.get("timeout", 0), self.env_errors, self.env_timeouts,
                            self.samples_split, self.endpoint_refused)

    def episode_ended(self, ended: str, turns: int, env_s: float, tool_calls: int, tool_errors: int,
                      metrics: tuple[AgentMetric, ...] = ()) -> None:
        """Count one ended episode (the caller holds the worker's lock); ``metrics``: an agent's own."""
        self.episodes += 1
        self.env_ok += ended not in ("env_error", "timeout")
        self.episode_ends[ended] = self.episode_ends.get(ended, 0) + 1
        self.tool_calls += tool_calls
        self.tool_errors += tool_errors
        self.recent_episodes.append(EpisodeRecord(turns, env_s, metrics))
