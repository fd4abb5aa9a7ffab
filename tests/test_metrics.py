"""pipeline_rl/metrics.py: the TensorBoard curves a run writes are readable by TensorBoard
itself, and the logger writes them without importing torch."""

from __future__ import annotations

from pathlib import Path


def test_tensorboard_scalars_read_back(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from pipeline_rl.metrics import TensorBoardScalars

    tb = TensorBoardScalars(tmp_path / "tb")
    for step in (1, 2, 3):
        tb.add_scalars({"reward_mean": step / 4, "lag_mean": 2}, step)
    tb.add_scalars({"eval/greedy_accuracy": 0.5}, 3)
    tb.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["eval/greedy_accuracy", "lag_mean", "reward_mean"]
    assert [(e.step, e.value) for e in acc.Scalars("reward_mean")] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert [(e.step, e.value) for e in acc.Scalars("lag_mean")] == [(1, 2.0), (2, 2.0), (3, 2.0)]
    assert [(e.step, e.value) for e in acc.Scalars("eval/greedy_accuracy")] == [(3, 0.5)]


def test_weight_sync_waits_for_every_worker_and_counts_skipped_versions() -> None:
    from pipeline_rl.metrics import WeightSyncLatency, percentile

    sync = WeightSyncLatency(workers=2)
    sync.published(1, 100.0)
    sync.published(2, 100.5)
    sync.applied(0, 1, 100.02)
    assert sync.resolve() == []                        # worker 1 has not reached v1
    sync.applied(1, 2, 100.6)                          # worker 1 skipped v1: v2 reaches it
    assert [round(x) for x in sync.resolve()] == [600]  # v1: the slower worker, 0.6 s after step 1
    sync.applied(0, 2, 100.55)
    assert [round(x) for x in sync.resolve()] == [100]  # v2: max(0.05, 0.1) s after step 2
    assert [round(x) for x in sync.all_ms] == [600, 100]
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5 and percentile([], 0.9) != percentile([], 0.9)


def test_turn_metrics_reach_the_record_the_step_line_and_the_summary() -> None:
    """A multi-turn run's turn metrics: the window's turns and environment seconds, the run's
    counts; on the step line only when non-zero; in the summary; none for a single-turn run."""
    from pipeline_rl.metrics import StepMetrics, progress_line, summary_table
    from pipeline_rl.rollout.worker_stats import AgentMetric, EpisodeRecord, EpisodeTally
    from pipeline_rl.run.recorder import EpisodeShape, turn_metrics

    old = EpisodeTally(episodes=2, ok=2, recent=(EpisodeRecord(1, 0.5), EpisodeRecord(2, 0.1)), done=2)
    now = EpisodeTally(episodes=5, ok=4, recent=old.recent + (EpisodeRecord(3, 0.2), EpisodeRecord(1, 1.0),
                                                              EpisodeRecord(2, 0.3)),
                       tool_calls=6, tool_errors=1, done=3, turns=1, timeout=1, env_timeouts=1)
    new = now.minus(old)
    assert [r.turns for r in new.recent] == [3, 1, 2] and (new.episodes, new.done, new.timeout) == (3, 1, 1)
    shape = EpisodeShape.of(new)
    assert shape is not None and (shape.turns_mean, shape.turns_max) == (2.0, 3)
    assert abs(shape.env_s_mean - 0.5) < 1e-9 and 0.3 < shape.env_s_p90 <= 1.0
    rec = turn_metrics(shape, now)
    assert rec["turns_max"] == 3.0 and rec["tool_calls"] == 6.0 and rec["finish_timeout"] == 1.0
    assert rec["env_timeouts"] == 1.0 and rec["env_errors"] == 0.0
    assert turn_metrics(None, EpisodeTally()) == {}                       # single-turn: nothing added
    agents = EpisodeTally(episodes=3, recent=(EpisodeRecord(1, 0.1, (AgentMetric("calls", 2.0),)),
                                              EpisodeRecord(1, 0.1, (AgentMetric("calls", 4.0),)), EpisodeRecord(1, 0.1)))
    assert turn_metrics(EpisodeShape.of(agents), agents)["agent/calls"] == 3.0   # an agent's own numbers
    base = dict(step=1, version=1, time_s=1.0, reward_mean=0.5, tokens_per_s=100.0, lag_mean=0.0, lag_max=0,
                evicted=0, mismatch_kl=0.0, masked_frac=0.0, mixed_version_frac=0.0, trainer_idle_frac=0.0,
                weight_update_stall_ms=0.0, step_time_s=1.0, loss=0.0, buffer_fill=0, completion_len_mean=3.0)
    line = progress_line(StepMetrics(**base, extra=rec))                  # type: ignore[arg-type]
    assert "| turns 2.00 (max 3) | env 0.500s (p90" in line and "| tools 6 (1 failed)" in line
    assert "env errors 0 / timeouts 1" in line
    assert "turns" not in progress_line(StepMetrics(**base))              # type: ignore[arg-type]
    # Groups dropped for equal rewards: on the step line once there are any.
    assert "skip" not in progress_line(StepMetrics(**base))               # type: ignore[arg-type]
    assert "| skip 7" in progress_line(StepMetrics(**base, zero_variance_groups=7))  # type: ignore[arg-type]
    table = summary_table([StepMetrics(**base, extra=rec)])               # type: ignore[arg-type]
    rows = {r.split("|")[1].strip(): r.split("|")[2].strip() for r in table.splitlines()[2:]}
    assert rows["turns per episode (mean / max)"] == "2.00 / 3"
    assert "done 3, turns 1, length 0, env_error 0, timeout 1" in table and "environment errors / timeouts" in table
