"""The run restarts itself (``run/life/``: ``heal.py``, ``carry.py``): a killed trainer or buffer
process restarts the run from its newest checkpoint and it finishes with every step once in ``metrics.jsonl``,
its rollout worker renewed (the same process) or, when the renewal fails, a new actor in its
place, as the console says; a failure that would only repeat is not retried; the restart cap
ends the run in one line.
The policy is checked alone first, then through the launcher's entry point on the real
pipeline (one Ray shared by the module)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from pipeline_rl.run.life.heal import RestartPolicy
from pipeline_rl.run.life.supervise import OrchestratorError
from tiny_run import tiny_run_config


def death(cause: str = "trainer failed: its process died") -> OrchestratorError:
    return OrchestratorError(f"{cause}; resume with --resume X", cause=cause, restartable=True)


def test_a_death_restarts_until_the_cap_of_restarts_in_a_row_without_a_step() -> None:
    policy = RestartPolicy(2)
    assert policy.refusal(death(), stepped=True) is None
    assert policy.refusal(death(), stepped=False) is None
    why = policy.refusal(death(), stepped=False)
    assert why is not None and "2 restart(s) in a row without a step in between, --run.max_restarts=2" in why
    assert policy.restarts == 2


def test_a_step_in_between_resets_the_count() -> None:
    policy = RestartPolicy(1)
    for _ in range(4):
        assert policy.refusal(death(), stepped=True) is None
    assert policy.restarts == 4


def test_what_would_repeat_is_not_retried() -> None:
    policy = RestartPolicy(3)
    raised = OrchestratorError("trainer failed: ValueError: bad (at version 3); no checkpoint was saved yet")
    assert policy.refusal(raised, stepped=True) == str(raised) and policy.restarts == 0
    update = OrchestratorError("x", cause="rollout worker 0 failed: WeightLoadFailed: y (at version 3)",
                               restartable=True, repeat_key="WeightLoadFailed: y (at version 3)")
    assert policy.refusal(update, stepped=True) is None
    why = policy.refusal(update, stepped=True)
    assert why is not None and why.endswith("(the same failure twice: not restarted again)")
    assert RestartPolicy(0).refusal(death(), stepped=True) == str(death())   # 0: today's behaviour


def _run(model_dir: str, out: Path, capsys: pytest.CaptureFixture[str], *flags: str,
         console: list[str] | None = None) -> tuple[int, list[str]]:
    """The run's exit status and its ``async_grpo.py:`` lines (every console line in ``console``)."""
    from pipeline_rl.driver import run

    cfg = tiny_run_config(model_dir, out, *flags)
    capsys.readouterr()
    rc = run(cfg)
    err = capsys.readouterr().err.splitlines()
    if console is not None:
        console += err
    return rc, [ln for ln in err if ln.startswith("async_grpo.py:")]


def _workers_of_each_life(monkeypatch: pytest.MonkeyPatch, refuse_renewal: bool) -> list[list[int]]:
    """The rollout workers' pids in each life of the run, as it starts them; with
    ``refuse_renewal``, a carried worker's engine refuses its renewal (raises
    ``EngineNotRenewable``, as an engine that cannot be carried does) inside its own process."""
    import ray

    from pipeline_rl.run.life import one_life

    start_actors = one_life.start_actors
    lives: list[list[int]] = []

    def refuse(actor: Any) -> None:   # runs in the worker's process (Ray's __ray_call__)
        import types

        from pipeline_rl.rollout.engines.engine import GenerationEngine

        engine = actor._worker.engine
        engine.renew = types.MethodType(GenerationEngine.renew, engine)   # the base's: raises

    def started(*args: Any, **kwargs: Any) -> Any:
        carried = args[7] if len(args) > 7 else kwargs.get("carried")
        for w in carried.workers if refuse_renewal and carried is not None else []:
            ray.get(w.handle.__ray_call__.remote(refuse), timeout=30)
        actors = start_actors(*args, **kwargs)
        lives.append([ray.get(w.handle.pid.remote(), timeout=30) for w in actors.workers])
        return actors

    monkeypatch.setattr(one_life, "start_actors", started)
    return lives


def _steps(out: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("point,role,spares,renewal", [("trainer_kill", "trainer", "true", "renewed"),
                                                       ("buffer_kill", "replay buffer", "false", "refused")])
def test_a_killed_process_restarts_the_run_and_it_finishes(point: str, role: str, spares: str, renewal: str,
                                                           ray_local: None, tiny_model_dir: str, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run"
    lives = _workers_of_each_life(monkeypatch, refuse_renewal=renewal == "refused")
    console: list[str] = []
    t0 = time.monotonic()
    rc, lines = _run(tiny_model_dir, out, capsys, "--max-steps", "12", "--trainer.checkpoint_every", "4",
                     "--fault", f"{point}@6", "--run.spare_trainers", spares, console=console)
    assert rc == 0, lines
    assert len(lines) == 1 and lines[0].startswith(f"async_grpo.py: restart 1: {role} failed: "), lines
    # offered to the next life, not started again; a spare trainer rank only when asked for
    offered = ", 1 rollout worker(s) to renew" + (", 1 spare trainer rank(s) to adopt" if spares == "true" else "")
    assert offered + ")" in lines[0], lines
    assert len(lives) == 2, lives
    told = [ln for ln in console if ln.startswith("rollout: ")]
    if renewal == "renewed":   # the same process generates on; the new life says it carried it
        assert lives[1] == lives[0], lives
        assert not [ln for ln in told if "not renewed" in ln], told
        assert [ln for ln in told if ln.endswith(", 1 carried from the run's last life")], told
    else:   # the renewal failed: a new actor (a new process) in its place, and one line saying so and why
        assert lives[1] != lives[0], lives
        assert ("rollout: worker 0 not renewed (EngineNotRenewable: InprocessEngine cannot be carried into "
                "the run's next life): a new actor starts in its place") in told, told
        assert not [ln for ln in told if "carried from" in ln], told
    assert lines[0].endswith("starting again from " + str((out / "checkpoints" / "step_000004").resolve())), lines
    assert _steps(out) == list(range(1, 13))                    # no step twice, none missing
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["restarts"] == 1.0 and rows[0]["restarts"] == 0.0
    with capsys.disabled():
        print(f"\n{point}: run of 12 steps with one restart: {time.monotonic() - t0:.1f} s")


@pytest.mark.slow
def test_the_same_weight_update_failure_twice_ends_the_run(ray_local: None, tiny_model_dir: str, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    rc, lines = _run(tiny_model_dir, tmp_path / "run", capsys, "--max-steps", "12", "--fault", "weight_update@0")
    assert rc == 1 and len(lines) == 2, lines
    assert lines[0].startswith("async_grpo.py: restart 1: rollout worker 0 failed: WeightLoadFailed"), lines
    assert "kept" not in lines[0], lines            # a worker's own failure: new workers
    assert lines[1].startswith("async_grpo.py: error: rollout worker 0 failed: WeightLoadFailed"), lines
    assert lines[1].endswith("(the same failure twice: not restarted again)"), lines


@pytest.mark.slow
def test_the_restart_cap_ends_the_run_in_one_line(ray_local: None, tiny_model_dir: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    rc, lines = _run(tiny_model_dir, tmp_path / "run", capsys, "--max-steps", "12", "--fault", "trainer_kill@0",
                     "--run.max_restarts", "1")
    assert rc == 1 and len(lines) == 2, lines
    assert lines[0].startswith("async_grpo.py: restart 1: trainer failed: "), lines
    assert lines[1].startswith("async_grpo.py: error: trainer failed: "), lines
    assert "(1 restart(s) in a row without a step in between, --run.max_restarts=1)" in lines[1], lines


def test_an_injected_fault_goes_on_into_the_next_life_until_a_life_reached_its_version() -> None:
    from pipeline_rl.run.life.heal import fault_left

    assert fault_left("checkpoint_write@50", 20)       # a restart at 20 (another failure): still ahead
    assert not fault_left("checkpoint_write@50", 50)   # that life reached 50: it fired
    assert fault_left("engine_hang@0", 7) and not fault_left(None, 3)
