"""``--trainer.keep_checkpoints K``: the newest K complete checkpoints stay, and the best by
held-out greedy accuracy (the ``best`` link); the rest is deleted (``run/checkpoints.py``)."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline_rl.config import Config
from pipeline_rl.run.checkpoints import CheckpointPolicy
from pipeline_rl.training.checkpoint import RUN_STATE_FILE, checkpoint_name


def _saved(root: Path, *versions: int) -> None:
    for v in versions:
        d = root / "checkpoints" / checkpoint_name(v)
        d.mkdir(parents=True)
        (d / RUN_STATE_FILE).write_text("{}")


def _left(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "checkpoints").iterdir())


def test_the_newest_k_and_the_best_stay(tmp_path: Path) -> None:
    policy = CheckpointPolicy(Config.model_validate({"trainer": {"keep_checkpoints": 2}}), tmp_path)
    _saved(tmp_path, 10, 20)
    (tmp_path / "checkpoints" / "step_000030.partial").mkdir()   # a save under way: not touched
    policy.evaluated(10, 0.9)
    policy.evaluated(20, 0.5)
    _saved(tmp_path, 30, 40)
    policy.tidy()
    assert _left(tmp_path) == ["best", "step_000010", "step_000030", "step_000030.partial", "step_000040"]
    assert (tmp_path / "checkpoints" / "best").resolve().name == "step_000010"
    policy.evaluated(40, 0.95)   # a better one: the old best goes
    assert _left(tmp_path) == ["best", "step_000030", "step_000030.partial", "step_000040"]
    assert (tmp_path / "checkpoints" / "best").resolve().name == "step_000040"


def test_a_resumed_run_reads_its_scores_back_and_0_keeps_all(tmp_path: Path) -> None:
    (tmp_path / "eval.jsonl").write_text(json.dumps({
        "step": 10, "version": 10, "time_s": 1.0, "greedy_accuracy": 1.0, "mean_at_k": 1.0, "pass_at_k": 1.0,
        "k": 2, "num_prompts": 32, "version_min": 10, "version_max": 10, "eval_s": 0.1,
        "greedy_len_mean": 4.0}) + "\n")
    _saved(tmp_path, 10, 20, 30, 40)
    assert CheckpointPolicy(Config(), tmp_path).tidy() == []
    CheckpointPolicy(Config.model_validate({"trainer": {"keep_checkpoints": 1}}), tmp_path).tidy()
    assert _left(tmp_path) == ["best", "step_000010", "step_000040"]


def test_after_a_resume_from_an_older_checkpoint_only_its_timeline_is_kept_and_best(tmp_path: Path) -> None:
    """Resumed at 20 from a run that reached 40 (best: 40): the new timeline's step_25 and
    step_20 stay (K=2), the abandoned 30 and 40 are moved aside, never deleted, and ``best``
    is the live timeline's best (its evaluation at 10), never an abandoned checkpoint."""
    from pipeline_rl.run.life.run_folder import open_run_folder

    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({
        "step": v, "version": v, "time_s": 1.0, "greedy_accuracy": v / 100, "mean_at_k": 1.0, "pass_at_k": 1.0,
        "k": 2, "num_prompts": 32, "version_min": v, "version_max": v, "eval_s": 0.1,
        "greedy_len_mean": 4.0}) + "\n" for v in (10, 20, 30, 40)))
    _saved(tmp_path, 10, 20, 30, 40)
    (tmp_path / "checkpoints" / "best").symlink_to("step_000040")
    open_run_folder(None, str(tmp_path / "checkpoints" / "step_000020"), 20)
    assert not (tmp_path / "checkpoints" / "best").is_symlink()   # it named an abandoned checkpoint
    policy = CheckpointPolicy(Config.model_validate({"trainer": {"keep_checkpoints": 2}}), tmp_path)
    _saved(tmp_path, 25)
    policy.tidy()
    assert _left(tmp_path) == ["best", "step_000010", "step_000020", "step_000025"]
    assert (tmp_path / "checkpoints" / "best").resolve().name == "step_000010"
    assert sorted(p.name for p in (tmp_path / "abandoned" / "resume_1").iterdir()) == ["step_000030", "step_000040"]
