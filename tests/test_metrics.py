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
