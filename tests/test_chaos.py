"""The chaos benchmark, short: a run that is SIGKILLed whole (then ``--resume RUN_DIR``),
loses a rollout worker, then its trainer while it writes a checkpoint (the run restarts
itself) still reaches its last step, with every step once in ``metrics.jsonl`` and in
TensorBoard, the killed save tidied, and no kill losing more than one checkpoint interval."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import chaos
from pipeline_rl.run.life.run_folder import read_resumes
from tiny_run import TINY_RUN_FLAGS


def test_chaos_flags_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        chaos.main(["--steps", "20", "--checkpoint-every", "20", "--out", str(tmp_path)])
    assert e.value.code == 2 and "leaves no room" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        chaos.main(["--eval-prompts", "0", "--out", str(tmp_path)])
    assert e.value.code == 2 and "--eval-prompts must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.slow
def test_a_worker_kill_a_trainer_kill_in_a_save_and_a_whole_run_kill(tiny_model_dir: str, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    out = tmp_path / "chaos"
    # Three times the tiny run's batch: ~0.2 s steps, so that the kills from outside land near
    # their planned steps even when the machine is busy with the tests beside this one.
    status = chaos.main(["--quick", "--stall-s", "240", "--eval-prompts", "16", "--out", str(out), "--",
                         "--model.path", tiny_model_dir, *TINY_RUN_FLAGS, "--rollout.standby", "true",
                         "--trainer.batch_size", "24", "--trainer.micro_batch_size", "24"])
    res = json.loads((out / "chaos.json").read_text())
    assert status == 0, (out / "chaos.md").read_text()
    c = res["chaos"]
    assert (c["reached"], c["twice"], c["missing"]) == (50, [], [])
    (worker,), (trainer,), (whole,) = res["worker_kills"], res["actor_kills"], res["run_kills"]
    assert worker["restart_step"] is not None and worker["groups_lost"] is not None
    assert trainer["kind"] == "trainer (in a save)", "the trainer kill was meant to land in a checkpoint write"
    run = out / "chaos"
    flags = res["flags"]   # --eval-prompts reaches both runs' launch (the tiny run evaluates never)
    assert flags[flags.index("--eval.num_prompts") + 1] == "16"
    # The checkpoint interval the run was launched with (--quick's): no kill may lose more.
    every = int(flags[flags.index("--trainer.checkpoint_every") + 1])
    assert every == res["checkpoint_every"]
    marks = read_resumes(run)
    assert trainer["resumed_at"] % every == 0 and 0 < trainer["steps_lost"] <= every   # the save before the killed one
    assert whole["resumed_at"] % every == 0
    for kill in res["actor_kills"] + res["run_kills"]:   # back to the checkpoint it resumed from
        assert kill["steps_lost"] is not None and 0 <= kill["steps_lost"] <= every, (kill, every)
    for kill in res["worker_kills"]:
        assert 0 <= _worker_steps_lost(kill, marks) <= every, (kill, marks, every)
    assert sorted(m.resumed_at for m in marks) == sorted([trainer["resumed_at"], whole["resumed_at"]])
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.endswith((".partial", ".old"))]
    logs = "".join(f.read_text() for f in sorted(out.glob("chaos_segment*.log")))
    assert "a checkpoint save was interrupted" in logs and "async_grpo.py: restart 1: trainer failed" in logs
    assert "resume 1, at step" in logs or "resume 2, at step" in logs   # the --resume: before or after the restart
    losses = [e.step for f in sorted((run / "tb").glob("*tfevents*")) for e in EventFileLoader(str(f)).Load()
              if any(v.tag == "loss" for v in e.summary.value)]
    assert sorted(losses) == list(range(1, 51))


def _worker_steps_lost(kill: dict[str, Any], marks: list[Any]) -> int:
    """The steps a worker kill (``chaos.WorkerKill``) cost: none when the run went on past it
    (its standby or Ray's restart took the worker's place); when a run restart overtook it
    before the worker was back (every worker then new), that restart's: the steps since the
    checkpoint it resumed from (``marks``: ``run_folder.ResumeMark``)."""
    back = kill["at"] + kill["back_s"]
    over = [m.resumed_at for m in marks if kill["at"] < m.unix_time_s <= back]
    return max(0, kill["step"] - min(over)) if over else 0


def _row(step: int, at: float, restarts: float, lost: float = 0.0) -> chaos.Row:
    return chaos.Row(step, at, lost, restarts, 0)


def test_a_worker_kill_is_back_when_its_restart_is_counted() -> None:
    rows = [_row(s, float(s), 0.0) for s in range(1, 6)] + [_row(6, 6.5, 0.0, 2.0), _row(7, 9.0, 1.0, 2.0)]
    kill = chaos.WorkerKill(5, 5.2, 0, 1)
    chaos.resolve_worker_kill(kill, chaos.Timeline([(0, r) for r in rows]), 1.0, None)
    assert (kill.restart_step, kill.groups_lost) == (7, 2.0) and kill.back_s == pytest.approx(3.8)
    assert kill.time_lost_s == pytest.approx(2.0)   # steps 6-7 took 4 s, 2 median steps


def test_a_worker_kill_does_not_count_a_later_run_restart_as_its_time_lost() -> None:
    # The worker is back at step 7; the trainer dies at step 8 and the run restarts from step 5
    # at t=20: steps 6-11 again, in the restart's life, are not the worker kill's cost.
    before = [_row(s, float(s), 1.0 if s >= 7 else 0.0) for s in range(1, 9)]
    after = [_row(s, 20.0 + s, 0.0) for s in range(6, 12)]
    kill = chaos.WorkerKill(4, 4.5, 0, 1)
    chaos.resolve_worker_kill(kill, chaos.Timeline([(0, r) for r in before + after]), 1.0, 19.0)
    assert kill.restart_step == 7 and kill.time_lost_s == pytest.approx(0.0)


def test_a_worker_kill_overtaken_by_a_run_restart_is_back_after_that_restart() -> None:
    # The trainer dies at step 8 before the killed worker is back; the run restarts from step
    # 5 at t=20 with new workers, and its counters start again from zero.
    before = [_row(s, float(s), 0.0) for s in range(1, 9)]
    after = [_row(s, 20.0 + s, 0.0) for s in range(6, 12)]
    kill = chaos.WorkerKill(4, 4.5, 0, 1)
    chaos.resolve_worker_kill(kill, chaos.Timeline([(0, r) for r in before + after]), 1.0, 19.0)
    assert (kill.restart_step, kill.groups_lost) == (6, 0.0) and kill.back_s == pytest.approx(21.5)
