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
